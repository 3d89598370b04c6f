"""One layout, ready to run: mesh, state shardings, sharded init, jitted train and eval steps."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.config import Config
from jaxpar.model import Transformer
from jaxpar.parallel import Layout
from jaxpar.parallel.schedules import build as build_schedule
from jaxpar.train.optim import lr_schedule, make_optimizer
from jaxpar.train.precision import LossScale
from jaxpar.train.step import TrainState, make_eval_step, make_train_step


class Trainer:
    """Builds the jitted, sharded pieces of training for one config on one mesh.

    The state is never materialized unsharded: its shapes come from `eval_shape`, its
    shardings from the layout (rules table + ZeRO stage), and `init` runs under
    `jit(out_shardings=...)`.
    """

    def __init__(self, cfg: Config, mesh: jax.sharding.Mesh):
        self.cfg, self.mesh = cfg, mesh
        self.layout = Layout(mesh, zero=cfg.parallel.zero)
        abstract_model = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(cfg.train.seed)))
        self.graphdef, abstract_params = nnx.split(abstract_model)
        self.tx = make_optimizer(cfg.train)
        self.schedule = lr_schedule(cfg.train)
        abstract_opt = jax.eval_shape(self.tx.init, abstract_params)
        self.replicated = NamedSharding(mesh, PartitionSpec())
        param_specs = self.layout.param_specs(abstract_params)
        self.state_shardings = TrainState(
            self.replicated, self.layout.named(param_specs), self.layout.named(self.layout.opt_specs(abstract_opt)),
            LossScale(self.replicated, self.replicated, self.replicated))
        self.batch_sharding = self.layout.batch_sharding()

        pipe = cfg.parallel.pipeline
        self.pipeline = (build_schedule(pipe.schedule, self.layout.sizes["stage"], pipe.microbatches, pipe.virtual)
                         if self.layout.pipelined else None)
        train_step = make_train_step(self.graphdef, self.tx, self.schedule, cfg.train, self.layout, param_specs,
                                     self.pipeline)
        self.step = jax.jit(train_step, in_shardings=(self.state_shardings, self.batch_sharding),
                            out_shardings=(self.state_shardings, self.replicated), donate_argnums=0)
        self.eval_loss = jax.jit(make_eval_step(self.graphdef, cfg.train.precision, self.layout),
                                 in_shardings=(self.state_shardings.params, self.batch_sharding),
                                 out_shardings=self.replicated)

    def init(self) -> TrainState:
        """Create the initial state directly in its sharded layout."""
        cfg = self.cfg

        def create():
            params = nnx.state(Transformer(cfg.model, rngs=nnx.Rngs(cfg.train.seed)))
            return TrainState(jnp.zeros((), jnp.int32), params, self.tx.init(params),
                              LossScale.initial(cfg.train.precision))

        return jax.jit(create, out_shardings=self.state_shardings)()

    def put_batch(self, tokens_BT: np.ndarray) -> jax.Array:
        """Place a host batch onto the mesh with the batch sharding."""
        return jax.device_put(tokens_BT, self.batch_sharding)

    def put_state(self, state: TrainState) -> TrainState:
        """Copy a state (from any layout) into this layout's shardings."""
        return jax.device_put(state, self.state_shardings)

    def compile_step(self):
        """Lower and compile the train step without running it (for plans and HLO checks)."""
        abstract_state = jax.eval_shape(self.init)
        T = self.cfg.model.seq_len + 1
        batch = jax.ShapeDtypeStruct((self.cfg.train.batch_size, T), jnp.int32, sharding=self.batch_sharding)
        return self.step.lower(abstract_state, batch).compile()
