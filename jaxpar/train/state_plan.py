"""The training state of one session before anything is traced: what it holds and where each part
lives. The step compiler (jaxpar.train.step_compiler) and the Trainer build on this plan.

The state is never materialized unsharded: its shapes come from `eval_shape`, its shardings from
the layout (rules table + ZeRO stage), and it is created under `jit(out_shardings=...)`. Stacked
layers are stored in the pipeline plan's order; `to_model_order` is what checkpoints, evaluation
and verification see. A training strategy (synchronous, or local SGD) transforms the plan: where
the state lives, its specs, how it starts, and the step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

import jaxpar.train.local_sgd as local_sgd
from jaxpar.config import Config, ConfigError
from jaxpar.model import Transformer, is_block_model
from jaxpar.parallel import Layout, PipelinePlan, layout_rules
from jaxpar.precision import PrecisionPolicy
from jaxpar.session import Session
from jaxpar.train.loss_scale import LossScale
from jaxpar.train.optim import Optimizer
from jaxpar.train.step import TrainState
from jaxpar.validation import check_model_fits


@dataclasses.dataclass(frozen=True)
class StatePlan:
    """layout: where the synchronous state lives (evaluation, samples and imported weights use it);
    state_layout: where the training state lives (the strategy's); param_shardings: the parameters
    on `layout`, in model order."""

    cfg: Config
    precision: PrecisionPolicy
    build_model: Callable[[nnx.Rngs], nnx.Module]
    graphdef: nnx.GraphDef
    abstract_params: nnx.State
    layout: Layout
    state_layout: Layout
    pipeline: PipelinePlan
    optimizer: Optimizer
    strategy: local_sgd.Synchronous | local_sgd.LocalSGD
    state_shardings: TrainState
    param_shardings: nnx.State
    batch_sharding: NamedSharding
    replicated: NamedSharding

    @classmethod
    def build(cls, session: Session, model: Callable[[nnx.Rngs], nnx.Module] | None = None,
              rules: Mapping | None = None) -> StatePlan:
        """The plan of `session`'s config on its mesh for jaxpar's Transformer, or for `model` (a builder
        from nnx.Rngs) whose own logical names `rules` maps to mesh axes."""
        cfg, mesh = session.cfg, session.mesh
        if model is not None and cfg.model.from_hf:
            raise ConfigError("model.from_hf loads a checkpoint into jaxpar's Transformer; a module of your own "
                              "(model=...) cannot take it.")
        build_model = model or (lambda rngs: Transformer(cfg.model, rngs=rngs))
        abstract_model = nnx.eval_shape(lambda: build_model(nnx.Rngs(cfg.train.seed)))
        block_model = is_block_model(abstract_model)
        check_model_fits(block_model, type(abstract_model).__name__, cfg, session.mesh_sizes)
        graphdef, abstract_params = nnx.split(abstract_model)
        stacked_at = abstract_model.STACKED_AT if block_model else ()
        rules = {**layout_rules(cfg.model.kv_heads, session.mesh_sizes["tensor"], cfg.parallel.sequence,
                              session.mesh_sizes["context"]),
                 **(rules or {})}
        policy = session.precision

        def relayout(rules: dict, zero: int = 0, reduce_dtype=jnp.float32) -> Layout:
            return Layout.build(mesh, abstract_params, stacked_at, zero=zero, compute_dtype=policy.compute_dtype,
                                rules=rules, reduce_dtype=reduce_dtype, output_grad_dtype=policy.dtype("output_grad"),
                                context_attention=cfg.parallel.context_attention,
                                context_balance=cfg.parallel.context_balance)

        layout = relayout(rules, cfg.parallel.zero, policy.grad_reduce_dtype)
        strategy = local_sgd.strategy(cfg, session.mesh_sizes)
        state_layout = strategy.state_layout(layout, relayout)
        pipeline = PipelinePlan.build(cfg.parallel.pipeline, layout.sizes["stage"],
                                      abstract_model.stacked_layers() if stacked_at else 0)
        optimizer = Optimizer.build(cfg.train, abstract_params)
        specs = strategy.specs(_state_specs(state_layout, abstract_params, optimizer, pipeline))
        opt_memory = "pinned_host" if cfg.train.offloads_optimizer else None
        state_shardings = dataclasses.replace(layout.named(specs), opt_state=layout.named(specs.opt_state, opt_memory))
        return cls(cfg=cfg, precision=policy, build_model=build_model, graphdef=graphdef,
                   abstract_params=abstract_params, layout=layout, state_layout=state_layout, pipeline=pipeline,
                   optimizer=optimizer, strategy=strategy, state_shardings=state_shardings,
                   param_shardings=layout.named(layout.param_specs(abstract_params)),
                   batch_sharding=layout.batch_sharding(), replicated=NamedSharding(mesh, PartitionSpec()))

    def initial_state(self, params) -> TrainState:
        """The state around `params` (model order; traced): optimizer and loss-scale state, 2BW's
        stale copy, as the strategy starts it."""
        params = self.pipeline.from_model_order(params)
        state = TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.tx.init(params),
                           LossScale.initial(self.precision), params if self.pipeline.stale_weights else None)
        return self.strategy.initial(state)

    def fresh_params(self) -> nnx.State:
        """Newly initialized parameters (traced, under the state's shardings)."""
        return nnx.state(self.build_model(nnx.Rngs(self.cfg.train.seed)))

    def weights(self, params):
        """The one set of weights a model runs with (evaluation, samples): the stored parameters, or
        the strategy's view of them (local SGD: the replicas' mean)."""
        return self.strategy.weights(params)


def _state_specs(layout: Layout, abstract_params, optimizer: Optimizer, pipeline: PipelinePlan) -> TrainState:
    """The partition specs of one replica's state on `layout`."""
    param_specs = layout.param_specs(abstract_params)
    scalar = PartitionSpec()
    return TrainState(scalar, param_specs, layout.opt_specs(jax.eval_shape(optimizer.tx.init, abstract_params)),
                      LossScale(scalar, scalar, scalar), param_specs if pipeline.stale_weights else None)
