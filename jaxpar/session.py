"""Everything checked and derived from the config before anything is compiled: the validated
config, its devices, mesh sizes, process split and mesh, and its precision policy (each computed
once, here). What runs a model reads no data; a run's own inputs (its rows, GRPO's prompts and
reward) are training's (jaxpar.train.run_session)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from jaxpar.config import Config, precision
from jaxpar.config.from_run import resolve_run
from jaxpar.config.hf_config import resolve as resolve_hf
from jaxpar.config.precision import PrecisionPolicy
from jaxpar.config.sources import parse_mixture
from jaxpar.data.token_folder import TextCodec, tokenizer_folder
from jaxpar.features import layout_name, with_derived
from jaxpar.features.model import check_attention_platform
from jaxpar.features.validation import validate
from jaxpar.runtime.devices import make_mesh


@dataclasses.dataclass(frozen=True)
class Session:
    """A validated config (automatic values filled in) on its devices.

    mesh_sizes: every mesh axis's size; process_split: how many processes each axis spans.
    """

    cfg: Config
    devices: list
    mesh_sizes: dict[str, int]
    process_split: dict[str, int]
    mesh: object  # jax.sharding.Mesh (jax is imported only after the devices are set up)

    @functools.cached_property
    def mixture(self) -> tuple[tuple[str, float], ...]:
        """data.mixture's (folder, weight) pairs, the weights summing to 1; () without a mixture (parsed
        from the config: no folder is read)."""
        return parse_mixture(self.cfg.data.mixture)

    def mesh_name(self) -> str:
        """The mesh axes of size > 1, such as 'data=4 tensor=2' ('single device' when none)."""
        return " ".join(f"{axis}={size}" for axis, size in self.mesh_sizes.items() if size > 1) or "single device"

    def layout_name(self) -> str:
        """The whole layout, such as 'data=4 tensor=2 grad_accum=2 bf16' (jaxpar.features)."""
        return layout_name(self.cfg, self.mesh_sizes)

    @functools.cached_property
    def precision(self) -> PrecisionPolicy:
        """Every dtype decision of the run (jaxpar.config.precision), resolved once."""
        return precision.of(self.cfg)

    @functools.cached_property
    def hf_checkpoint(self):
        """model.from_hf's safetensors, checked against its config.json (None without one)."""
        if not self.cfg.model.from_hf:
            return None
        from jaxpar.interop.hf_weights import open_checkpoint

        return open_checkpoint(self.cfg.model)

    @property
    def tokenizer(self) -> Path | None:
        """The tokenizer's folder: the tokenized folder's, else model.from_hf's (None: bytes)."""
        return tokenizer_folder(self.cfg.data, self.cfg.model.from_hf)

    @functools.cached_property
    def codec(self) -> TextCodec:
        """Text <-> token ids (prompts and samples): the tokenized folder's tokenizer, else model.from_hf's,
        else bytes."""
        return TextCodec(self.tokenizer)


def on_devices(cfg: Config, devices: list) -> Session:
    """Validate `cfg` for `devices` (already set up) and derive its mesh; raises UserError."""
    cfg = resolve_hf(resolve_run(cfg))  # a config built in Python (not by load_config) may name model.from_hf
    sizes, split = validate(cfg, len(devices), len({d.process_index for d in devices}))
    check_attention_platform(cfg, devices[0].platform)
    return Session(with_derived(cfg, sizes), devices, sizes, split, make_mesh(sizes, devices, split))
