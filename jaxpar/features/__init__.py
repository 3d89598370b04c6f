"""Each feature in one home: a module per feature, each with its rows of the switch table
(`SWITCHES`), its checks (`checks(cfg, sizes)`, one sentence for each thing a config gets wrong),
and where it has them, its derived values (`derive`) and its part of the rules table (`rules`).

This index puts them together: `problem` runs every feature's checks in FEATURES' order (the
order in which the values they divide by are themselves checked), `with_derived` fills in the
automatic values, `layout_rules` folds the features' entries into the rules table, and the switch
table is every feature's rows in NAMED's order, which is the order of a layout's name
(`layout_name`, after the mesh). A new switch is a field (jaxpar.config) and a row and a check in
its feature's module. Pure Python, like jaxpar.config: the CLI validates before jax starts.
"""

from __future__ import annotations

from jaxpar.config import MESH_AXES, Config
from jaxpar.features import (
    adapters,
    context,
    data,
    evals,
    experts,
    local_sgd,
    mla,
    model,
    mtp,
    offload,
    pipeline,
    precision,
    rl,
    run,
    tensor,
    training,
)
from jaxpar.features.feature import KEEP, Checks, Switch, first

FEATURES = (run, model, mla, tensor, context, training, data, pipeline, experts, mtp, offload, local_sgd,
            precision, adapters, rl, evals)
NAMED = (pipeline, data, context, tensor, local_sgd, offload, model, training, precision, experts, adapters)
DERIVED = (training, experts)  # in this order: the automatic loss chunks count the tokens per device
RULES = (context, tensor)  # in this order: sequence parallelism splits each context slice
MESH_KEYS = tuple(f"mesh.{axis}" for axis in MESH_AXES)
_ROWS = [row for feature in NAMED for row in feature.SWITCHES]
# the mesh axes' rows in the mesh's order, then the others in NAMED's
SWITCHES: tuple[Switch, ...] = (*sorted((s for s in _ROWS if s.key in MESH_KEYS), key=lambda s: MESH_KEYS.index(s.key)),
                                *(s for s in _ROWS if s.key not in MESH_KEYS))
SEARCHED_KEYS = tuple(s.key for s in SWITCHES if s.searched)


def problem(cfg: Config, sizes: dict[str, int]) -> str | None:
    """The first sentence of what the config gets wrong on a mesh of these axis sizes, or None."""
    for feature in FEATURES:
        sentence = first(feature.checks(cfg, sizes))
        if sentence is not None:
            return sentence
    return first(_local_sgd_clashes(cfg, sizes))


def _local_sgd_clashes(cfg: Config, sizes: dict[str, int]) -> Checks:
    """Under local SGD, the switches set away from their defaults that it cannot take (their rows'
    with_local_sgd), and a mixture of experts."""
    if cfg.parallel.sync_every <= 1:
        return
    clash = not_with_local_sgd(cfg, sizes) + (["model.moe.experts"] if cfg.model.moe.experts > 0 else [])
    if clash:
        yield local_sgd.clash_sentence(cfg, clash)


def with_derived(cfg: Config, sizes: dict[str, int]) -> Config:
    """The config with its automatic values filled in for this mesh (each feature's `derive`)."""
    for feature in DERIVED:
        cfg = feature.derive(cfg, sizes)
    return cfg


def layout_rules(table: dict, cfg: Config, sizes: dict[str, int]) -> dict:
    """The rules table `table` adapted to one model on one mesh by the features that take part in it."""
    for feature in RULES:
        table = feature.rules(table, cfg, sizes)
    return table


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
    mesh = [p for s, p in zip(SWITCHES, parts) if s.key in MESH_KEYS and p]
    rest = [p for s, p in zip(SWITCHES, parts) if s.key not in MESH_KEYS and p]
    return " ".join([" ".join(mesh) or "single device", *rest])


def reference_overrides(cfg: Config) -> dict:
    """What verify's one-device reference of `cfg` sets: every row that does not keep its value (a row whose
    reference is a function: that of the layout's value)."""
    return {s.key: s.reference(value_of(cfg, s.key, {})) if callable(s.reference) else s.reference
            for s in SWITCHES if s.reference != KEEP}


def not_with_local_sgd(cfg: Config, sizes: dict) -> list[str]:
    """The switches set away from their defaults that local SGD cannot take."""
    defaults = Config()
    return [s.key for s in SWITCHES if not s.with_local_sgd
            and value_of(cfg, s.key, sizes) != (1 if s.key.startswith("mesh.") else value_of(defaults, s.key, {}))]
