"""What train.objective does in the step (what it is: jaxpar.config.objectives): how a batch is prepared
before the gradient, what each target's cross-entropy reduces to, which of its metrics a pipeline's last
stage reports, and the shape of a step's batch. `training_objective(cfg)` picks one; the step never asks
which objective it runs.

- sft (`Windows`): the mean cross-entropy over the counted targets, each row weighted by the step
  (PackedRows.weighted).
- dpo, simpo, orpo (`Pairs`): rows of whole pairs weighted by their valid pairs
  (jaxpar.train.preference.weighted_pairs); the preference loss over them; for DPO each target's
  log-probability under the reference (the model with every adapter's B zeroed) computed before and
  outside the gradient, in the targets' order, the way evaluation computes its loss.
- grpo (`Completions`): the rollout carries its log-probabilities and advantages (jaxpar.rl.rollout);
  GRPO's clipped policy objective (jaxpar.rl.grpo).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import Config
from jaxpar.config.objectives import Objective, objective_of
from jaxpar.config.precision import PrecisionPolicy
from jaxpar.data.packed_rows import PackedRows
from jaxpar.laid_out.forward import mean_loss, target_losses
from jaxpar.model.adapters import without_adapters
from jaxpar.model.axes import layout_hooks
from jaxpar.parallel.hooks import eval_hooks
from jaxpar.parallel.layout import Layout
from jaxpar.parallel.pipeline_plan import PipelinePlan
from jaxpar.rl import grpo
from jaxpar.train.preference import batch_objective, weighted_pairs


class Windows:
    """sft: the mean next-token cross-entropy."""

    def __init__(self, cfg: Config, objective: Objective):
        self.cfg, self.objective = cfg, objective

    def reduction(self) -> Callable:
        """reduce(losses_BL, batch) -> (loss, stats): what each target's cross-entropy becomes, with the
        objective's metrics ('loss', and for a mixture each source's share)."""
        return mean_loss

    def preparation(self, graphdef: nnx.GraphDef, layout: Layout, pipeline: PipelinePlan,
                    precision: PrecisionPolicy) -> Callable:
        """prepare(params, batch) -> the batch as the gradient takes it."""
        return lambda params, batch: batch.weighted()

    def head_metrics(self, stats: dict) -> dict:
        """What a pipeline's last stage reports besides the loss: multi-token prediction's loss, and the
        objective's own metrics where it has them (not sft's: a mixture's shares are the step's)."""
        return {k: v for k, v in stats.items() if k != "loss" and (k == "mtp_loss" or not self.objective.plain)}

    def abstract_batch(self, shape: tuple[int, int], sharding, sources: int):
        """The shapes, dtypes and sharding of one step's batch (B, T): a token array, or packed rows (a
        mixture's with each row's source)."""
        one = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
        if self.cfg.data.packing == "none":
            return one
        source_B = jax.ShapeDtypeStruct(shape[:1], jnp.int32, sharding=sharding) if sources else None
        return PackedRows(one, one, one, one, source_B=source_B, sources=sources)


class Pairs(Windows):
    """dpo, simpo, orpo: a preference loss over the rows' pairs, with its pair metrics."""

    def reduction(self) -> Callable:
        return functools.partial(batch_objective, self.objective.name, self.cfg.train.preference)

    def preparation(self, graphdef, layout, pipeline, precision) -> Callable:
        loss_chunks = self.cfg.train.loss_chunks
        if not self.objective.reference_without_adapters:
            return lambda params, batch: weighted_pairs(batch)

        def prepare(params, batch: PackedRows) -> PackedRows:
            batch = weighted_pairs(batch)
            reference = without_adapters(pipeline.to_model_order(params))
            with layout_hooks(eval_hooks(layout)):
                losses_BL = target_losses(graphdef, reference, batch, precision, loss_chunks)
            return dataclasses.replace(batch, reference_BL=jax.lax.stop_gradient(-losses_BL))

        return prepare


class Completions(Windows):
    """grpo: the clipped policy objective over the rows' sampled completions."""

    def reduction(self) -> Callable:
        return functools.partial(grpo.batch_objective, self.cfg.rl)

    def preparation(self, graphdef, layout, pipeline, precision) -> Callable:
        return lambda params, batch: batch  # the rollout carries its log-probabilities (jaxpar.rl.rollout.Scoring)

    def abstract_batch(self, shape: tuple[int, int], sharding, sources: int):
        """Packed rows of prompt + completion, each with its advantage and its targets' log-probabilities
        under the sampling weights (and the reference policy's with rl.kl_beta > 0)."""
        one = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding)
        per_row = jax.ShapeDtypeStruct(shape[:1], jnp.float32, sharding=sharding)
        per_target = jax.ShapeDtypeStruct((shape[0], shape[1] - 1), jnp.float32, sharding=sharding)
        reference = per_target if self.cfg.rl.kl_beta > 0 else None
        return PackedRows(one, one, one, one, reference_BL=reference, sampled_BL=per_target, advantages_B=per_row)


_BY_ROWS = {"windows": Windows, "pairs": Pairs, "completions": Completions}


def training_objective(cfg: Config) -> Windows:
    """What cfg's train.objective does in the step."""
    objective = objective_of(cfg)
    return _BY_ROWS[objective.rows](cfg, objective)
