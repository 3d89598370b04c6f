"""Data parallelism and ZeRO: the batch's rows over mesh.data (and mesh.expert outside MoE layers), and
ZeRO's stages over those devices (parallel.zero; what each shards is jaxpar.config.parallel.ZeroStage)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxpar.features.feature import Checks, Switch, axis, unless

if TYPE_CHECKING:  # annotations only: the chain of module-level imports stays short
    from jaxpar.config import Config

SWITCHES = (
    Switch("mesh.data", axis("data"), reference=1, searched=True),
    Switch("parallel.zero", unless(0, "zero={value}"), reference=0, searched=True, with_local_sgd=False),
)


def checks(cfg: Config, sizes: dict[str, int]) -> Checks:
    t = cfg.train
    batch_ways = sizes["data"] * sizes["expert"] * t.grad_accum
    if t.batch_size % batch_ways:
        yield (f"train.batch_size={t.batch_size} is not divisible by mesh.data x mesh.expert x train.grad_accum"
               f" = {sizes['data']} x {sizes['expert']} x {t.grad_accum}.")


def routed_tokens_per_device(cfg: Config, sizes: dict[str, int]) -> int:
    """Tokens one device routes at a time: its share of the batch (of one accumulation or pipeline
    microbatch)."""
    t = cfg.train
    microbatches = cfg.parallel.pipeline.microbatches if sizes["stage"] > 1 else t.grad_accum
    return t.batch_size // (sizes["data"] * sizes["expert"] * microbatches) * cfg.model.seq_len
