"""PipeDream-2BW's training step on pipeline stages: the step's window of the endless 1F1B stream
(jaxpar.parallel.two_bw), which finishes the previous step's microbatches on the weights one version
old and starts the step's own on the current ones. The previous step's gradient, whole at the window's
end, updates the current weights: W(t+1) = W(t) - update(gradient taken at W(t-1)), the rule a single
device follows with jaxpar.train.step (state.stale_params), so verify compares the two.

So a step's metrics are the previous step's, and the weights lag the batches by one step: after the
step of batch t the state holds t updates and batch t in flight (state.in_flight). The first step
only fills the pipeline; `drain` (the step without a batch of its own) finishes the last. A step
with nothing in flight runs its batch on the stale copy and keeps both versions, so that a run
drained and then trained further goes on exactly as the run that never stopped (on a fresh start
the two versions are the same).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxpar.config import Config
from jaxpar.config.precision import PrecisionPolicy
from jaxpar.data.packed_rows import PackedRows
from jaxpar.model.moe_step import ExpertTerms
from jaxpar.parallel.gradients import carry_spec, window_gradients
from jaxpar.parallel.layout import Layout
from jaxpar.parallel.pipeline_plan import PipelinePlan
from jaxpar.train.loss_scale import unless_skipped
from jaxpar.train.objectives import training_objective
from jaxpar.train.optim import Optimizer
from jaxpar.train.state import InFlight, TrainState
from jaxpar.train.step import RowInputs, UpdateTail, in_device_order, pipelined_loss, stage_fns


def make_two_bw_step(graphdef: nnx.GraphDef, optimizer: Optimizer, cfg: Config, layout: Layout,
                     pipeline: PipelinePlan, precision: PrecisionPolicy, trace_routing: bool = False,
                     trace_gradients: bool = False):
    """step(state, batch, has_current) -> (state, the previous step's metrics, with 'completed': whether
    there was a previous step). has_current False: the drain, whose batch is only a shape. trace_routing:
    the metrics hold the previous step's routing decisions (jaxpar.model.moe_step; verify replays them);
    trace_gradients: the previous step's gradients (verify compares them)."""
    t, M = cfg.train, pipeline.table.microbatches
    experts = ExpertTerms.build(cfg.model.moe, t.seed, cfg.model.n_layers, layout.manual_batch_ways * M,
                                trace_routing, keyed_rows=cfg.model.lora.dropout > 0,
                                moe_per_unit=cfg.model.moe_blocks_per_unit)
    prepare = training_objective(cfg).preparation(graphdef, layout, pipeline, precision)
    update = UpdateTail(optimizer, cfg, layout, pipeline, precision, experts, trace_gradients)

    def grad_fn(hooks, stale, params, batches, carry, scale, live, has_current):
        micro = [layout.split_microbatches(b, M) for b in batches]
        micro_2M = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), *micro)
        fns = stage_fns(graphdef, hooks, cfg, precision, scale, experts)
        (loss, (sums, head_sums), grads), carry = pipeline.window_value_and_grad(
            fns, stale, params, layout.stacked_mask(params), micro_2M, carry, live, has_current)
        stats = {**pipelined_loss(loss / scale, {k: v / M for k, v in head_sums.items()}, cfg),
                 **experts.routing_stats(sums, M * pipeline.stacked_layers)}
        return (stats, grads), carry

    def train_step(state: TrainState, batch, has_current=True):
        has_current = jnp.asarray(has_current)
        own = prepare(state.params, in_device_order(PackedRows.of(batch), layout))
        noise_B, trace = experts.row_inputs(state.step, own.tokens_BT.shape[0], None)
        flight = state.in_flight
        if flight is None:  # traced for its shapes only (in_flight_shapes): nothing in flight yet
            flight = InFlight(None, own, noise_B, jnp.zeros((), bool))
        # (a routing trace records the rows' decisions as they are made: the same for either step's rows)
        batches = tuple((b, RowInputs(keys, b.segments(), trace)) for b, keys in ((flight.batch, flight.noise_B),
                                                                                   (own, noise_B)))
        scale = state.loss_scale.scale
        # With nothing in flight (a start, or after a drain, which applied the last step's update early), the
        # step's batch runs on the stale copy and no versions turn over: the run goes on as if never drained.
        current = unless_skipped(flight.live, state.params, state.stale_params)
        (stats, grads), carry = window_gradients(layout, grad_fn, state.stale_params, current, batches,
                                                 flight.carry, scale, flight.live, has_current)
        params, opt_state, loss_scale, metrics = update(state, stats, grads, scale, state.step - 1, flight.live)
        metrics = {**metrics, "completed": flight.live}
        in_flight = InFlight(carry, own, noise_B, has_current)
        stale = unless_skipped(flight.live, state.params, state.stale_params)
        return TrainState(state.step + has_current.astype(jnp.int32), params, opt_state, loss_scale, stale,
                          state.outer, in_flight), metrics

    return train_step


def in_flight_specs(layout: Layout, in_flight: InFlight) -> InFlight:
    """Where what is in flight lives: the carry each device's own, the batch and its keys by rows."""
    rows = layout.batch_sharding().spec
    by_rows = lambda tree: jax.tree.map(lambda _: rows, tree)  # noqa: E731
    return InFlight(jax.tree.map(lambda _: carry_spec(layout), in_flight.carry), by_rows(in_flight.batch),
                    by_rows(in_flight.noise_B), jax.sharding.PartitionSpec())
