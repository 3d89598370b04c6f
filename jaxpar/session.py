"""Everything checked and derived from the config before anything is compiled: the validated
config, its devices, mesh sizes, process split and mesh (each computed once, here), and the
data samplers (loaded when first used)."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from jaxpar.config import Config, precision
from jaxpar.config.from_run import resolve_run
from jaxpar.config.hf_config import resolve as resolve_hf
from jaxpar.config.precision import PrecisionPolicy
from jaxpar.config.sources import parse_mixture
from jaxpar.data.corpus import load_tokens, split_tokens
from jaxpar.data.loader import BatchSampler
from jaxpar.data.mixture import mixture_samplers
from jaxpar.data.packing import packed_samplers
from jaxpar.data.preference import check_preference_source
from jaxpar.data.token_folder import TextCodec, has_loss_mask, tokenizer_folder
from jaxpar.errors import DataError
from jaxpar.features import layout_name, with_derived
from jaxpar.features.model import check_attention_platform
from jaxpar.features.validation import validate
from jaxpar.rl.prompts import PromptSet
from jaxpar.rl.rewards import Reward, load_reward
from jaxpar.runtime.devices import make_mesh, setup_devices


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
    def _samplers(self) -> tuple:
        m, t, d = self.cfg.model, self.cfg.train, self.cfg.data
        if t.objective == "grpo":  # prompts, sampled and scored every step: no held-out windows
            return PromptSet.load(self.cfg, self.codec), None
        check_preference_source(d, t.objective)  # pairs for a preference objective, and only for one
        if self.mixture:
            return mixture_samplers(self.mixture, d, m, t)
        if d.packing != "none":
            return packed_samplers(d, m, t)
        if has_loss_mask(d.source):
            raise DataError(f"data.source '{d.source}' was tokenized with --sft or --chat, and data.packing=none would "
                            f"put the prompts in the loss too; train it with data.packing=pack (or concat).")
        train_tokens, val_tokens = split_tokens(load_tokens(d.source, m.vocab_size), d.val_fraction, m.seq_len)
        return (BatchSampler(train_tokens, m.seq_len, t.batch_size, t.seed),
                BatchSampler(val_tokens, m.seq_len, t.batch_size, t.seed))

    @functools.cached_property
    def mixture(self) -> tuple[tuple[str, float], ...]:
        """data.mixture's (folder, weight) pairs, the weights summing to 1; () without a mixture."""
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

    @functools.cached_property
    def reward(self) -> Reward | None:
        """train.objective=grpo's reward function (jaxpar.rl.rewards), imported and checked; else None."""
        return load_reward(self.cfg.rl) if self.cfg.train.objective == "grpo" else None

    @property
    def train_data(self):
        """The training rows: a BatchSampler of windows, or a sampler of packed rows (data.packing)."""
        return self._samplers[0]

    @property
    def val_data(self):
        return self._samplers[1]


def on_devices(cfg: Config, devices: list) -> Session:
    """Validate `cfg` for `devices` (already set up) and derive its mesh; raises UserError."""
    cfg = resolve_hf(resolve_run(cfg))  # a config built in Python (not by load_config) may name model.from_hf
    sizes, split = validate(cfg, len(devices), len({d.process_index for d in devices}))
    check_attention_platform(cfg, devices[0].platform)
    return Session(with_derived(cfg, sizes), devices, sizes, split, make_mesh(sizes, devices, split))


def prepare(cfg: Config, devices: list | None = None) -> Session:
    """Set up devices (emulated on CPU) unless given, validate the config, derive its mesh and load the
    data; raises UserError."""
    session = on_devices(cfg, devices or setup_devices(cfg))
    session.train_data  # noqa: B018 (a missing or unreadable data.source is reported before compiling)
    session.hf_checkpoint  # noqa: B018 (so is a missing, cut-short or misshapen model.from_hf checkpoint)
    session.reward  # noqa: B018 (and a GRPO reward that cannot be imported)
    return session
