"""Everything checked and loaded before anything is compiled: config, devices, mesh sizes, data."""

from __future__ import annotations

import dataclasses

from jaxpar.config import Config
from jaxpar.validation import validate, with_derived
from jaxpar.data import BatchSampler, load_tokens, split_tokens
from jaxpar.runtime import make_mesh, setup_devices


@dataclasses.dataclass
class Session:
    """A validated config with its devices, mesh sizes and data samplers."""

    cfg: Config
    devices: list
    mesh_sizes: dict[str, int]
    train_data: BatchSampler
    val_data: BatchSampler

    def mesh(self):
        """The configured mesh over this session's devices."""
        return make_mesh(self.mesh_sizes, self.devices, self.cfg.mesh)


def prepare(cfg: Config) -> Session:
    """Set up devices (emulated on CPU), validate the config and load the data; raises UserError."""
    devices = setup_devices(cfg)
    sizes = validate(cfg, len(devices), len({d.process_index for d in devices}))
    cfg = with_derived(cfg, sizes)
    m, t = cfg.model, cfg.train
    train_tokens, val_tokens = split_tokens(load_tokens(cfg.data.source, m.vocab_size), cfg.data.val_fraction,
                                            m.seq_len)
    return Session(cfg, devices, sizes, BatchSampler(train_tokens, m.seq_len, t.batch_size, t.seed),
                   BatchSampler(val_tokens, m.seq_len, t.batch_size, t.seed))
