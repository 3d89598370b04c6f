"""One layout, ready to run: mesh, state shardings, sharded init, jitted train and eval steps."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import ConfigError
from jaxpar.session import Session
from jaxpar.model import Transformer, is_block_model
from jaxpar.train import local_sgd
from jaxpar.parallel import Layout, PipelinePlan, layout_rules
from jaxpar.train.optim import Optimizer
from jaxpar.validation import check_model_fits
from jaxpar.train.precision import COMPUTE_DTYPES, LossScale
from jaxpar.train.step import TrainState, make_eval_step, make_train_step


class Trainer:
    """Builds the jitted, sharded pieces of training for one session (config on its mesh).

    The state is never materialized unsharded: its shapes come from `eval_shape`, its
    shardings from the layout (rules table + ZeRO stage), and `init` runs under
    `jit(out_shardings=...)`. Stacked layers are stored in the pipeline plan's order; the
    `to_model_order` view is what checkpoints, evaluation and verification see.
    """

    def __init__(self, session: Session, model: Callable[[nnx.Rngs], nnx.Module] | None = None,
                 rules: Mapping | None = None):
        cfg = self.cfg = session.cfg
        self.mesh = mesh = session.mesh
        # model(rngs) builds the module to train (None: jaxpar's Transformer for cfg.model); its own
        # logical axis names join the rules table through `rules`. Both are kept as given, for a
        # reference trainer of the same model on another config.
        self.model, self.rules = model, rules
        if model is not None and cfg.model.from_hf:
            raise ConfigError("model.from_hf loads a checkpoint into jaxpar's Transformer; a module of your own "
                              "(model=...) cannot take it.")
        self._build = model or (lambda rngs: Transformer(cfg.model, rngs=rngs))
        abstract_model = nnx.eval_shape(lambda: self._build(nnx.Rngs(cfg.train.seed)))
        block_model = is_block_model(abstract_model)
        check_model_fits(block_model, type(abstract_model).__name__, cfg, session.mesh_sizes)
        self.graphdef, abstract_params = nnx.split(abstract_model)
        self.session = session
        stacked_at = abstract_model.STACKED_AT if block_model else ()
        rules = {**layout_rules(cfg.model.kv_heads, session.mesh_sizes["tensor"], cfg.parallel.sequence),
                 **(rules or {})}
        self.layout = Layout.build(mesh, abstract_params, stacked_at, cfg.parallel.zero,
                                   COMPUTE_DTYPES[cfg.train.precision], rules,
                                   COMPUTE_DTYPES[cfg.parallel.grad_reduce_dtype])
        self.pipeline = PipelinePlan.build(cfg.parallel.pipeline, self.layout.sizes["stage"],
                                           abstract_model.stacked_layers() if stacked_at else 0)
        self.optimizer = Optimizer.build(cfg.train, abstract_params)
        # where imported weights are placed: the synchronous layout, in model order
        self.param_shardings = self.layout.named(self.layout.param_specs(abstract_params))
        abstract_opt = jax.eval_shape(self.optimizer.tx.init, abstract_params)
        self.replicated = NamedSharding(mesh, PartitionSpec())
        # local SGD: each replica's state is laid out by the rules inside one replica, on a leading
        # replica dimension over data; evaluation and sampling use the synchronous layout
        self.replicas = session.mesh_sizes["data"] if cfg.parallel.sync_every > 1 else 0
        state_layout = self.layout
        if self.replicas:
            state_layout = Layout.build(mesh, abstract_params, stacked_at, 0,
                                        COMPUTE_DTYPES[cfg.train.precision], local_sgd.replica_rules(rules))
        param_specs = state_layout.param_specs(abstract_params)
        scalar = PartitionSpec()
        specs = TrainState(scalar, param_specs, state_layout.opt_specs(abstract_opt), LossScale(scalar, scalar, scalar),
                           param_specs if self.pipeline.stale_weights else None)
        if self.replicas:
            outer = local_sgd.OuterState(param_specs, param_specs) if cfg.parallel.outer == "nesterov" else None
            specs = dataclasses.replace(local_sgd.per_replica(specs), outer=outer)
        opt_memory = "pinned_host" if cfg.train.offloads_optimizer else None
        self.state_shardings = dataclasses.replace(self.layout.named(specs), opt_state=self.layout.named(
            specs.opt_state, opt_memory))
        self.batch_sharding = self.layout.batch_sharding()
        train_step = make_train_step(self.graphdef, self.optimizer, cfg, state_layout, self.pipeline)
        if self.replicas:
            train_step = local_sgd.make_local_step(train_step, cfg.parallel, self.replicas)
        self.step = jax.jit(train_step, in_shardings=(self.state_shardings, self.batch_sharding),
                            out_shardings=(self.state_shardings, self.replicated), donate_argnums=0)
        eval_step = make_eval_step(self.graphdef, cfg.train.precision, self.layout, self.pipeline)
        self.eval_loss = jax.jit(lambda params, tokens_BT: eval_step(self.weights(params), tokens_BT),
                                 in_shardings=(self.state_shardings.params, self.batch_sharding),
                                 out_shardings=self.replicated)

    def init(self) -> TrainState:
        """Create the initial state directly in its sharded layout: from model.from_hf's weights (each
        device reading its own slices), else freshly initialized."""
        if self.session.hf_checkpoint is None:
            return self._create_fresh()
        from jaxpar.interop.hf_weights import load_params

        params, _ = load_params(self.session.hf_checkpoint, self.cfg.model, self.param_shardings)
        return self._create_from(params)

    def abstract_state(self) -> TrainState:
        """The shapes, dtypes and shardings of the state `init` creates, without creating it."""
        return jax.eval_shape(self._create_fresh)

    def _state_from(self, params) -> TrainState:
        """The initial state around `params` (model order): optimizer and loss-scale state, 2BW's
        stale copy, and under local SGD one replica per data-parallel rank."""
        cfg = self.cfg
        params = self.pipeline.from_model_order(params)
        state = TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.tx.init(params),
                           LossScale.initial(cfg.train.precision), params if self.pipeline.stale_weights else None)
        if not self.replicas:
            return state
        outer = local_sgd.OuterState.initial(params) if cfg.parallel.outer == "nesterov" else None
        return dataclasses.replace(local_sgd.stacked(state, self.replicas), outer=outer)

    @functools.cached_property
    def _create_fresh(self):
        seed = self.cfg.train.seed
        return jax.jit(lambda: self._state_from(nnx.state(self._build(nnx.Rngs(seed)))),
                       out_shardings=self.state_shardings)

    @functools.cached_property
    def _create_from(self):
        return jax.jit(self._state_from, in_shardings=(self.param_shardings,), out_shardings=self.state_shardings)

    def weights(self, params):
        """The one set of weights a model runs with (evaluation, samples): the stored parameters,
        or under local SGD the mean of the replicas' (identical right after a synchronization)."""
        return local_sgd.replica_mean(params) if self.replicas else params

    def to_model_order(self, tree):
        """Stacked leaves (in params or optimizer state) as the model orders its layers."""
        return self.pipeline.to_model_order(tree)

    def from_model_order(self, tree):
        """Stacked leaves from the model's layer order to the order this layout stores them in."""
        return self.pipeline.from_model_order(tree)

    def put_batch(self, tokens_BT: np.ndarray) -> jax.Array:
        """Place a host batch (the whole batch, on every process) onto the mesh with the batch sharding."""
        return jax.device_put(tokens_BT, self.batch_sharding)

    def put_windows(self, sampler, starts_B: np.ndarray) -> jax.Array:
        """Build the global batch of windows at `starts_B` from this process's rows only.

        Each process reads just the windows its own devices hold, so no process ever loads
        the whole batch; the global array is assembled from the per-device pieces.
        """
        shape = (len(starts_B), self.cfg.model.seq_len + 1)
        read: dict[tuple, np.ndarray] = {}  # devices that share rows (tensor, stage replicas) read them once

        def rows(index: tuple[slice, ...]) -> np.ndarray:
            key = index[0].indices(shape[0])
            if key not in read:
                read[key] = sampler.windows(starts_B[index[0]])
            return read[key][:, index[1]]

        return jax.make_array_from_callback(shape, self.batch_sharding, rows)

    def put_state(self, state: TrainState) -> TrainState:
        """Copy a state (from any layout) into this layout's shardings (adding or dropping
        2BW's stale weights as this config needs: a fresh copy of the current ones)."""
        stale = ((state.stale_params if state.stale_params is not None else state.params)
                 if self.pipeline.stale_weights else None)
        return jax.device_put(dataclasses.replace(state, stale_params=stale), self.state_shardings)

    def abstract_batch(self) -> jax.ShapeDtypeStruct:
        """The shape, dtype and sharding of one step's batch."""
        T = self.cfg.model.seq_len + 1
        return jax.ShapeDtypeStruct((self.cfg.train.batch_size, T), jnp.int32, sharding=self.batch_sharding)

    def compile_step(self, compiler_options: dict | None = None):
        """Lower and compile the train step without running it (for plans and HLO checks)."""
        return self.step.lower(self.abstract_state(), self.abstract_batch()).compile(compiler_options)
