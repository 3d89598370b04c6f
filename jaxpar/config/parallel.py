"""The parallel.* section: partitioning beyond plain data and tensor parallelism, and the pipeline."""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Pipeline parallelism over mesh.stage: schedule, microbatches per step, virtual stages per device."""

    schedule: Literal["naive", "gpipe", "1f1b", "interleaved", "2bw", "zb-h1", "zbv"] = "1f1b"
    microbatches: int = 4
    virtual: int = 1
    recompute: bool = False  # 1F1B-type schedules: redo each forward in backward, keep only its input


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How work and state are partitioned beyond plain data/tensor parallelism."""

    zero: Literal[0, 1, 2, 3] = 0  # ZeRO stage over the data-parallel devices (ZeroStage below)
    # Megatron sequence parallelism: between blocks the residual stream's sequence is split over mesh.tensor
    sequence: bool = False
    # the data-parallel gradient reductions' payload (bf16: half the bytes; accumulated into fp32 either way)
    grad_reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    # local SGD (DiLoCo): each data-parallel replica takes sync_every steps on its own rows, then the replicas
    # synchronize: `avg` averages weights, `nesterov` takes an outer Nesterov step on the averaged change (1: sync)
    sync_every: int = 1
    outer: Literal["avg", "nesterov"] = "avg"
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    pipeline: PipelineConfig = PipelineConfig()
    # mesh.context > 1: attention across the split sequence (jaxpar.parallel.context), its key/value blocks passed
    # round a ring or all-gathered; balanced: device i holds chunks i and 2C-1-i of 2C, the same causal work for all
    context_attention: Literal["ring", "allgather"] = "ring"
    context_balance: bool = True
    # how tokens reach the experts of dropless routing under mesh.expert: allgather (every row to every expert
    # device, mesh.expert x the rows) or ragged (each device sends each expert device only the rows routed there)
    expert_dispatch: Literal["allgather", "ragged"] = "allgather"


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
