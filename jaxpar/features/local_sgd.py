"""Local SGD (parallel.sync_every > 1): whole replicas over mesh.data, each stepping on its own rows,
synchronized every H steps by an outer rule (parallel.outer). What it does not combine with is each
switch row's `with_local_sgd` (jaxpar.features.local_sgd_clashes)."""

from __future__ import annotations

from jaxpar.config import Config
from jaxpar.features.feature import Checks, Switch


def _label(value, cfg: Config, sizes: dict) -> str | None:
    return f"sync_every={value} outer={cfg.parallel.outer}" if value > 1 else None


# verify runs R one-device replicas (jaxpar.verify.local_sgd)
SWITCHES = (Switch("parallel.sync_every", _label),)


def checks(cfg: Config, sizes: dict[str, int]) -> Checks:
    p = cfg.parallel
    if p.sync_every < 1:
        yield f"parallel.sync_every must be 1 (synchronous) or more, got {p.sync_every}."
    if p.outer_lr <= 0 or not 0 <= p.outer_momentum < 1:
        yield "parallel.outer_lr must be positive and parallel.outer_momentum in [0, 1)."
    if p.sync_every > 1 and sizes["data"] == 1:
        yield f"parallel.sync_every={p.sync_every} (local SGD) needs data-parallel replicas: mesh.data > 1."


def clash_sentence(cfg: Config, clash: list[str]) -> str:
    """What to say of the switches (and model.moe.experts) that local SGD does not take."""
    return (f"parallel.sync_every={cfg.parallel.sync_every} (local SGD: whole replicas over mesh.data, tensor "
            f"parallelism inside each) does not combine with {', '.join(clash)}; leave "
            f"{'it' if len(clash) == 1 else 'them'} at the default.")
