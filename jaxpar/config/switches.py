"""The layout switches: every config key that changes how a run is laid out or computed, and not
what it computes, in one table; and ZeRO's stages as what they shard.

Each row says, once: how the key appears in the layout's name (`jaxpar verify`'s "data=4 tensor=2
zero=3 fp32"), what verify's one-device reference does with it (keeps it, or takes a value), whether
`jaxpar plan --search` enumerates it, and whether it combines with local SGD. Its valid values are
declared next to its field in jaxpar.config (a Literal type). `validation.validate`,
`Session.layout_name`, `verify.reference_config` and the planner's search read this table; a new
switch is a new field and a new row.

Pure Python, like jaxpar.config: the CLI validates before jax starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxpar.config import MESH_AXES, Config

KEEP = "keep"  # a row's `reference`: verify's reference keeps the layout's value

# label(value, cfg, mesh sizes) -> the layout name's part for this key, or None when it shows nothing
Label = Callable[[object, Config, dict], str | None]


@dataclasses.dataclass(frozen=True)
class Switch:
    key: str  # the dotted config key
    label: Label
    reference: object = KEEP  # what verify's one-device reference sets it to, or KEEP
    searched: bool = False  # jaxpar plan --search enumerates it
    with_local_sgd: bool = True  # it may differ from its default under local SGD (parallel.sync_every > 1)


def _unless(default, text: str) -> Label:
    """Shown as `text` (formatted with the value) unless the value is `default`."""
    return lambda value, cfg, sizes: None if value == default else text.format(value=value)


def _axis(axis: str) -> Label:
    return lambda value, cfg, sizes: f"{axis}={sizes[axis]}" if sizes[axis] > 1 else None


def _pipeline(value, cfg: Config, sizes: dict) -> str | None:
    pipe = cfg.parallel.pipeline
    if sizes["stage"] == 1:
        return None
    return f"{pipe.schedule} M={pipe.microbatches}" + (f" v={pipe.virtual}" if pipe.virtual > 1 else "")


def _local_sgd(value, cfg: Config, sizes: dict) -> str | None:
    return f"sync_every={value} outer={cfg.parallel.outer}" if value > 1 else None


def _never(value, cfg, sizes) -> None:
    return None


SWITCHES: tuple[Switch, ...] = (
    *(Switch(f"mesh.{axis}", _axis(axis), reference=1, searched=True, with_local_sgd=axis in ("data", "tensor"))
      for axis in MESH_AXES),
    Switch("parallel.pipeline.schedule", _pipeline, searched=True),  # 2bw's stale-weight rule holds on one device
    Switch("parallel.pipeline.microbatches", _never, searched=True),  # named with the schedule
    Switch("parallel.pipeline.virtual", _never, searched=True),
    Switch("parallel.zero", _unless(0, "zero={value}"), reference=0, searched=True, with_local_sgd=False),
    Switch("parallel.context_attention", lambda value, cfg, sizes: value if sizes["context"] > 1 else None,
           searched=True),
    Switch("parallel.context_balance",
           lambda value, cfg, sizes: None if sizes["context"] == 1 or value else "unbalanced"),
    Switch("parallel.sequence", _unless(False, "sequence"), reference=False, with_local_sgd=False),
    Switch("parallel.grad_reduce_dtype", _unless("fp32", "grad_reduce={value}"), reference="fp32",
           with_local_sgd=False),
    Switch("parallel.sync_every", _local_sgd),  # verify runs R one-device replicas (jaxpar.train.verify_local)
    Switch("train.offload", _unless("none", "offload={value}"), reference="none", with_local_sgd=False),
    Switch("model.attention", _unless("dot", "attention={value}"), reference="dot"),
    Switch("train.grad_accum", _unless(1, "grad_accum={value}"), reference=1, searched=True, with_local_sgd=False),
    Switch("train.remat", _unless("none", "remat={value}"), reference="none", searched=True),
    Switch("train.optimizer", _unless("adamw", "{value}")),
    Switch("train.loss_chunks", _unless(1, "loss_chunks={value}"), reference=1),  # checked against the whole logits
    Switch("train.precision", lambda value, cfg, sizes: value, reference="fp32"),
)


def value_of(cfg: Config, key: str, sizes: dict):
    """A switch's value in a config on a mesh (a mesh axis: its resolved size)."""
    if key.startswith("mesh."):
        return sizes[key.removeprefix("mesh.")]
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def layout_name(cfg: Config, sizes: dict) -> str:
    """The whole layout in words, such as 'data=4 tensor=2 grad_accum=2 bf16'."""
    parts = [s.label(value_of(cfg, s.key, sizes), cfg, sizes) for s in SWITCHES]
    mesh = [p for s, p in zip(SWITCHES, parts) if s.key.startswith("mesh.") and p]
    rest = [p for s, p in zip(SWITCHES, parts) if not s.key.startswith("mesh.") and p]
    return " ".join([" ".join(mesh) or "single device", *rest])


def reference_overrides() -> dict:
    """What verify's one-device reference sets: every row that does not keep its value."""
    return {s.key: s.reference for s in SWITCHES if s.reference != KEEP}


SEARCHED_KEYS = tuple(s.key for s in SWITCHES if s.searched)
MESH_KEYS = tuple(f"mesh.{axis}" for axis in MESH_AXES)


def not_with_local_sgd(cfg: Config, sizes: dict) -> list[str]:
    """The switches set away from their defaults that local SGD cannot take."""
    defaults = Config()
    return [s.key for s in SWITCHES if not s.with_local_sgd
            and value_of(cfg, s.key, sizes) != (1 if s.key.startswith("mesh.") else value_of(defaults, s.key, {}))]


@dataclasses.dataclass(frozen=True)
class ZeroStage:
    """ZeRO by what it shards over the data-parallel devices (parallel.zero = 0 ... 3)."""

    stage: int

    @property
    def shards_optimizer_state(self) -> bool:
        return self.stage >= 1

    @property
    def shards_gradients(self) -> bool:
        """Gradients are reduce-scattered onto shards, layer by layer in backward (and each layer's
        weight is expanded from what a device holds inside the layer scan)."""
        return self.stage >= 2

    @property
    def shards_params(self) -> bool:
        return self.stage >= 3

    @property
    def slices_replicated_weights(self) -> bool:
        """Gradients sharded, parameters not (ZeRO-2): each device differentiates its slice of a
        replicated weight."""
        return self.shards_gradients and not self.shards_params
