"""Data parallelism and ZeRO: the batch's rows over mesh.data (and mesh.expert outside MoE layers), and
ZeRO's stages as what they shard over those devices (parallel.zero)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from jaxpar.features.feature import Checks, Switch, axis, unless

if TYPE_CHECKING:  # annotations only: the layout imports ZeroStage from here
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
