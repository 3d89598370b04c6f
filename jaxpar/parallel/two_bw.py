"""PipeDream-2BW without a flush: one step's window of the endless 1F1B stream (jaxpar.parallel.schedules.
steady_window) on two weight versions, with what is in flight carried from step to step.

A window runs the previous step's last microbatches (numbered -M .. -1) on the weights one version
old and the step's own (0 .. M-1) on the current ones, each tick as 1F1B's executor runs it
(jaxpar.parallel.one_f_one_b). Each stage runs its backwards, and its forwards, in microbatch order,
so one gradient sum serves both steps: at a stage's first backward of the step's own microbatches
the sum holds the previous step's whole gradient, which is banked, and the sum starts again from
zero (the loss and statistics likewise at the first forward). What a window leaves in flight, the
stash of inputs, cotangents and residuals and the step's partial sums, is the next window's start.

The first step has no previous microbatches (`live` False: their ticks idle) and the drain after the
last step has no own ones (`has_current` False): the same program, whose ticks after the previous
step's last action are empty (an idle branch and two sends of zeros), so one compiled program serves
every step of a run.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.model.adapters import trainable, with_frozen, zero_grad
from jaxpar.parallel.one_f_one_b import Stash, _OneFOneB
from jaxpar.parallel.pipeline import IDLE, microbatch
from jaxpar.parallel.schedules import Table, carried_stash_size


def _first_tick(table: Table, kind: str) -> np.ndarray:
    """For each stage, the first tick it runs `kind` of one of the step's own microbatches."""
    first = [len(table.ticks)] * table.stages
    for t in reversed(range(len(table.ticks))):
        for s, action in enumerate(table.ticks[t]):
            if action is not None and action.kind == kind and action.microbatch >= 0:
                first[s] = t
    return np.asarray(first, np.int32)


def _select(pred, a, b):
    """a where pred else b, leaf by leaf (a frozen weight's zero-size float0 gradient passes as it is)."""
    return jax.tree.map(lambda x, y: x if x.dtype == jax.dtypes.float0 else jnp.where(pred, x, y), a, b)


class _SteadyWindow(_OneFOneB):
    """One 2BW window on one device. batch_2M: the previous step's M microbatches, then the step's."""

    def __init__(self, fns, old, params, is_stacked, batch_2M, layer_ids, table: Table, axis: str,
                 recompute: bool, live, has_current):
        super().__init__(fns, params, is_stacked, batch_2M, layer_ids, table, axis, recompute)
        self.old = fns.cast(old)
        self.M = table.microbatches
        previous = np.asarray([[a is not None and a.microbatch < 0 for a in row] for row in table.ticks])
        self.branch = jnp.where(jnp.where(previous, ~live, ~has_current), IDLE, self.branch)
        self.bank_b = jnp.asarray(_first_tick(table, "B"))[self.s]
        self.bank_f = jnp.asarray(_first_tick(table, "F"))[self.s]

    @staticmethod
    def stash_slots(table: Table) -> int:
        return carried_stash_size(table.stages, table.microbatches)

    def weights_for(self, m):
        """The previous step's microbatches run on the weights one version old."""
        return _select(m < 0, self.old, self.compute)

    def rows_for(self, m):
        return microbatch(self.batch_M, m + self.M)

    def empty_carry(self, params):
        """What is in flight before the first step: nothing (an empty stash, zero sums)."""
        v = self.table.virtual
        empty = jnp.zeros((self.K, v) + self.zeros_x.shape, self.zeros_x.dtype)
        residuals = {name: [jnp.zeros((self.K + 1, v) + r.shape, r.dtype) for r in shapes]
                     for name, shapes in self.kept.items()}
        return (Stash(empty, empty, residuals), trainable(jax.tree.map(zero_grad, params)),
                jnp.zeros((), jnp.float32), self.no_stats)

    def run_window(self, params, carry):
        """(the previous step's (share of the mean loss, stats, gradients), what stays in flight)."""
        zeros = jax.tree.map(zero_grad, params)
        stash, grads, loss_sum, stats_sum = carry
        grads = with_frozen(zeros, grads)

        def body(c, t):
            sums, banked = c
            stash, grads, loss_sum, stats_sum = sums
            at_b, at_f = t == self.bank_b, t == self.bank_f
            banked = (_select(at_b, grads, banked[0]), *_select(at_f, (loss_sum, stats_sum), banked[1:]))
            grads = _select(at_b, zeros, grads)
            loss_sum, stats_sum = _select(at_f, (jnp.zeros_like(loss_sum), self.no_stats), (loss_sum, stats_sum))
            sums, _ = self.tick((stash, grads, loss_sum, stats_sum), t)
            return (sums, banked), None

        banked0 = (zeros, jnp.zeros((), jnp.float32), self.no_stats)
        init = ((stash, grads, loss_sum, stats_sum), banked0)
        (sums, banked), _ = jax.lax.scan(body, init, jnp.arange(len(self.table.ticks)))
        stash, grads, loss_sum, stats_sum = sums
        prev_grads, prev_loss, prev_stats = banked
        return (prev_loss / self.M, prev_stats, prev_grads), (stash, trainable(grads), loss_sum, stats_sum)


def two_bw_window(fns, old, params, is_stacked, batch_2M, layer_ids, table: Table, carry, live, has_current,
                  axis: str = "stage", recompute: bool = False):
    """2BW's window on this device (inside a shard_map manual over `axis`). old: the weights one version
    old; params: the current ones; batch_2M: the previous step's microbatches, then the step's; carry:
    what the previous window left in flight (None: nothing, before the first step; then `live` must be
    False). Returns ((the previous step's share of the mean loss, (layers' stats, head's), gradients),
    what stays in flight)."""
    window = _SteadyWindow(fns, old, params, is_stacked, batch_2M, layer_ids, table, axis, recompute, live,
                           has_current)
    return window.run_window(params, window.empty_carry(params) if carry is None else carry)
