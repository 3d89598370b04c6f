"""The jitted steps of a state plan: the train step (the strategy's transformation of the pure step,
with explicit shardings and the state donated) and the evaluation loss."""

from __future__ import annotations

import jax

from jaxpar.train.state_plan import StatePlan
from jaxpar.train.step import make_eval_step, make_train_step


def compile_steps(plan: StatePlan, trace_routing: bool = False):
    """(step(state, tokens_BT) -> (state, metrics), eval_loss(params, tokens_BT) -> loss), both jitted
    (compiled when first called). trace_routing: see make_train_step (the step's third argument, the
    decisions to replay or None, is split by rows like the batch)."""
    train_step = plan.strategy.step(make_train_step(plan.graphdef, plan.optimizer, plan.cfg, plan.state_layout,
                                                    plan.pipeline, plan.precision, trace_routing))
    replayed = (plan.batch_sharding,) if trace_routing else ()
    step = jax.jit(train_step, in_shardings=(plan.state_shardings, plan.batch_sharding, *replayed),
                   out_shardings=(plan.state_shardings, plan.replicated), donate_argnums=0)
    eval_step = make_eval_step(plan.graphdef, plan.precision, plan.layout, plan.pipeline, plan.cfg.train.loss_chunks)
    eval_loss = jax.jit(lambda params, tokens_BT: eval_step(plan.weights(params), tokens_BT),
                        in_shardings=(plan.state_shardings.params, plan.batch_sharding), out_shardings=plan.replicated)
    return step, eval_loss
