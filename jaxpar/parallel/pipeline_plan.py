"""Everything about a pipeline that is derived from the config, in one frozen plan: the schedule
table, the order the stacked layers are stored in (interleaved stages hold non-contiguous
layers), PipeDream-2BW's stale-weight rule, and whether backward recomputes; and the one entry
point that runs the model's stage functions through the schedule.

Outside this package nothing knows about stages: the trainer stores the state in
`from_model_order` order and hands checkpoints, evaluation and verification the
`to_model_order` view.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.model.axes import holds_array, is_stacked, is_variable
from jaxpar.parallel.gpipe import gpipe_value_and_grad
from jaxpar.parallel.one_f_one_b import one_f_one_b_value_and_grad
from jaxpar.parallel.pipeline import StageFns
from jaxpar.parallel.schedules import Table, build, storage_order
from jaxpar.parallel.two_bw import two_bw_window
from jaxpar.parallel.zero_bubble import zero_bubble_value_and_grad


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """table: the schedule (None without a pipeline, mesh.stage = 1); storage: the model layer
    held at each stacked position (None: model order); stale_weights: 2BW takes gradients on the
    weights one step old (also on one device, so that verify's reference follows the same rule);
    recompute: 1F1B-type schedules redo each forward in backward instead of keeping residuals."""

    table: Table | None
    storage: tuple[int, ...] | None
    stacked_layers: int
    stale_weights: bool
    recompute: bool

    @classmethod
    def build(cls, pipe, stages: int, stacked_layers: int) -> PipelinePlan:
        """From parallel.pipeline (`pipe`), mesh.stage and the model's number of stacked layers."""
        table = build(pipe.schedule, stages, pipe.microbatches, pipe.virtual) if stages > 1 else None
        order = storage_order(stacked_layers, stages, table.virtual if table else 1, pipe.schedule)
        return cls(table, None if order == sorted(order) else tuple(order), stacked_layers,
                   pipe.schedule == "2bw", pipe.recompute)

    @property
    def carries(self) -> bool:
        """Whether steps overlap (2BW on stages): a step finishes the previous step's microbatches, and
        what is in flight between them is part of the state."""
        return self.table is not None and self.table.schedule == "2bw"

    def microbatches(self, grad_accum: int) -> int:
        """The microbatches one step cuts its batch into: the schedule's, else train.grad_accum's."""
        return grad_accum if self.table is None else self.table.microbatches

    def step_metrics(self) -> dict:
        """What a pipelined step reports of its schedule: the idle share of its ticks."""
        if self.table is None:
            return {}
        return {"pipeline_idle_fraction": jnp.asarray(self.table.idle_fraction, jnp.float32)}

    def to_model_order(self, tree):
        """Stacked leaves (of params or optimizer state) from storage order back to model order."""
        return tree if self.storage is None else _permute_layers(tree, np.argsort(self.storage))

    def from_model_order(self, tree):
        """Stacked leaves from model order to this plan's storage order."""
        return tree if self.storage is None else _permute_layers(tree, np.asarray(self.storage))

    def _layer_ids(self, axis: str):
        local = self.stacked_layers // self.table.stages
        stored = jnp.asarray(self.storage if self.storage is not None else range(self.stacked_layers), jnp.int32)
        return jax.lax.dynamic_slice_in_dim(stored, jax.lax.axis_index(axis) * local, local)

    def window_value_and_grad(self, fns: StageFns, old, params, stacked_mask, micro_2M, carry, live, has_current,
                              axis: str = "stage"):
        """2BW inside a shard_map manual over `axis`: the step's window (jaxpar.parallel.two_bw) on the
        previous step's microbatches and then the step's (`micro_2M`), from what is in flight (`carry`;
        None: nothing). Returns ((the previous step's share of the mean loss, stats, gradients), carry)."""
        return two_bw_window(fns, old, params, stacked_mask, micro_2M, self._layer_ids(axis), self.table, carry,
                             live, has_current, axis, self.recompute)

    def value_and_grad(self, fns: StageFns, params, stacked_mask, micro, axis: str = "stage"):
        """Inside a shard_map manual over `axis`: run the microbatches `micro` ((tokens_MbT, rows_Mb),
        as Layout.split_microbatches cuts them) through the schedule. Returns this device's
        (share of the mean loss, (sums of the layers' statistics, sums of the head's), gradients)."""
        layer_ids = self._layer_ids(axis)
        if self.table.schedule == "gpipe":
            executor = gpipe_value_and_grad
        elif self.table.split_backward:
            executor = zero_bubble_value_and_grad
        else:
            executor = functools.partial(one_f_one_b_value_and_grad, recompute=self.recompute)
        return executor(fns, params, stacked_mask, micro, layer_ids, self.table, axis)


def _permute_layers(tree, index: np.ndarray):
    def one(v):
        if not is_variable(v) or not holds_array(v):  # (a placeholder in the optimizer state)
            return v
        value = v.get_value()
        # every leaf stacked over layers: weights, Adam moments, and Adafactor's factored statistics
        stacked = is_stacked(v) and value.ndim >= 1 and value.shape[0] == len(index)
        return v.replace(jnp.take(value, index, axis=0)) if stacked else v

    return jax.tree.map(one, tree, is_leaf=is_variable)
