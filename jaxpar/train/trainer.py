"""One layout, ready to run: mesh, state shardings, sharded init, jitted train and eval steps."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.session import Session
from jaxpar.model import Transformer
from jaxpar.parallel import Layout
from jaxpar.parallel.schedules import build as build_schedule
from jaxpar.parallel.schedules import storage_order
from jaxpar.train.optim import lr_schedule, make_optimizer
from jaxpar.train.precision import COMPUTE_DTYPES, LossScale
from jaxpar.train.step import TrainState, make_eval_step, make_train_step


class Trainer:
    """Builds the jitted, sharded pieces of training for one config on one mesh.

    The state is never materialized unsharded: its shapes come from `eval_shape`, its
    shardings from the layout (rules table + ZeRO stage), and `init` runs under
    `jit(out_shardings=...)`.
    """

    def __init__(self, session: Session):
        cfg = session.cfg
        self.cfg, self.mesh = cfg, session.mesh
        mesh = session.mesh
        self.layout = Layout(mesh, zero=cfg.parallel.zero, compute_dtype=COMPUTE_DTYPES[cfg.train.precision])
        abstract_model = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(cfg.train.seed)))
        self.graphdef, abstract_params = nnx.split(abstract_model)
        self.tx = make_optimizer(cfg.train)
        self.schedule = lr_schedule(cfg.train)
        abstract_opt = jax.eval_shape(self.tx.init, abstract_params)
        self.replicated = NamedSharding(mesh, PartitionSpec())
        param_specs = self.layout.param_specs(abstract_params)
        # PipeDream-2BW keeps a second, one-step-old copy of the weights (also on a single device,
        # so that `verify` compares against the same stale-update rule).
        self.two_bw = cfg.parallel.pipeline.schedule == "2bw"
        self.state_shardings = TrainState(
            self.replicated, self.layout.named(param_specs), self.layout.named(self.layout.opt_specs(abstract_opt)),
            LossScale(self.replicated, self.replicated, self.replicated),
            self.layout.named(param_specs) if self.two_bw else None)
        self.batch_sharding = self.layout.batch_sharding()

        pipe = cfg.parallel.pipeline
        self.pipeline = (build_schedule(pipe.schedule, self.layout.sizes["stage"], pipe.microbatches, pipe.virtual)
                         if self.layout.pipelined else None)
        # Interleaved stages hold non-contiguous layers: the stacked weights are stored permuted.
        order = storage_order(cfg.model.n_layers, self.layout.sizes["stage"], self.pipeline.virtual
                              if self.pipeline else 1)
        self._storage = None if order == sorted(order) else np.asarray(order)
        train_step = make_train_step(self.graphdef, self.tx, self.schedule, cfg.train, self.layout, param_specs,
                                     self.pipeline, stale_weights=self.two_bw, moe=cfg.model.moe,
                                     recompute=pipe.recompute)
        self.step = jax.jit(train_step, in_shardings=(self.state_shardings, self.batch_sharding),
                            out_shardings=(self.state_shardings, self.replicated), donate_argnums=0)
        self.eval_loss = jax.jit(make_eval_step(self.graphdef, cfg.train.precision, self.layout, self.to_model_order),
                                 in_shardings=(self.state_shardings.params, self.batch_sharding),
                                 out_shardings=self.replicated)

    def init(self) -> TrainState:
        """Create the initial state directly in its sharded layout."""
        return self._create()

    @functools.cached_property
    def _create(self):
        cfg = self.cfg

        def create():
            params = self.from_model_order(nnx.state(Transformer(cfg.model, rngs=nnx.Rngs(cfg.train.seed))))
            return TrainState(jnp.zeros((), jnp.int32), params, self.tx.init(params),
                              LossScale.initial(cfg.train.precision), params if self.two_bw else None)

        return jax.jit(create, out_shardings=self.state_shardings)

    def _permute_layers(self, tree, index):
        def one(v):
            if not isinstance(v, nnx.Variable):
                return v
            names = v.get_metadata().get("out_sharding") or ()
            value = v.get_value()
            # every leaf stacked over layers: weights, Adam moments, and Adafactor's factored statistics
            stacked = bool(names) and names[0] == "layers" and value.ndim >= 1 and value.shape[0] == len(self._storage)
            return v.replace(jnp.take(value, index, axis=0)) if stacked else v

        return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))

    def to_model_order(self, tree):
        """Stacked weights (in params or optimizer state) from storage order back to layer order."""
        return tree if self._storage is None else self._permute_layers(tree, np.argsort(self._storage))

    def from_model_order(self, tree):
        """Stacked weights from layer order to this layout's storage order."""
        return tree if self._storage is None else self._permute_layers(tree, self._storage)

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
        stale = (state.stale_params if state.stale_params is not None else state.params) if self.two_bw else None
        return jax.device_put(dataclasses.replace(state, stale_params=stale), self.state_shardings)

    def compile_step(self):
        """Lower and compile the train step without running it (for plans and HLO checks)."""
        abstract_state = jax.eval_shape(self.init)
        T = self.cfg.model.seq_len + 1
        batch = jax.ShapeDtypeStruct((self.cfg.train.batch_size, T), jnp.int32, sharding=self.batch_sharding)
        return self.step.lower(abstract_state, batch).compile()
