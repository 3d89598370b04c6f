"""One layout, ready to run: its state plan (jaxpar.train.state_plan), its jitted steps
(jaxpar.train.step_compiler), and the state and batches placed on its mesh."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxpar.data.packed_rows import PackedRows
from jaxpar.session import Session
from jaxpar.train.state_plan import StatePlan
from jaxpar.train.step import TrainState
from jaxpar.train.step_compiler import compile_steps


class Trainer:
    """A session's state plan and jitted steps: `init()` and `step(state, batch)`, `eval_loss(params,
    batch)`, and placing states and batches on the mesh. `model` (a builder from nnx.Rngs; None:
    jaxpar's Transformer) and `rules` (its own logical names) are kept as given, for a reference
    trainer of the same model on another config. trace_routing: the step's metrics also hold each
    token's routing decisions, and the step takes decisions to replay as a third argument (verify;
    jaxpar.train.step.make_train_step)."""

    def __init__(self, session: Session, model: Callable[[nnx.Rngs], nnx.Module] | None = None,
                 rules: Mapping | None = None, trace_routing: bool = False):
        self.session, self.model, self.rules, self.trace_routing = session, model, rules, trace_routing
        self.plan = plan = StatePlan.build(session, model, rules)
        self.cfg, self.mesh, self.graphdef = session.cfg, session.mesh, plan.graphdef
        self.layout, self.pipeline, self.optimizer = plan.layout, plan.pipeline, plan.optimizer
        self.state_shardings, self.param_shardings = plan.state_shardings, plan.param_shardings
        self.batch_sharding, self.replicated, self.strategy = plan.batch_sharding, plan.replicated, plan.strategy
        self.precision = plan.precision
        self.step, self.eval_loss = compile_steps(plan, trace_routing)

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

    @functools.cached_property
    def _create_fresh(self):
        return jax.jit(lambda: self.plan.initial_state(self.plan.fresh_params()), out_shardings=self.state_shardings)

    @functools.cached_property
    def _create_from(self):
        return jax.jit(self.plan.initial_state, in_shardings=(self.param_shardings,),
                       out_shardings=self.state_shardings)

    def weights(self, params):
        """The one set of weights a model runs with (evaluation, samples): see StatePlan.weights."""
        return self.plan.weights(params)

    def to_model_order(self, tree):
        """Stacked leaves (in params or optimizer state) as the model orders its layers."""
        return self.pipeline.to_model_order(tree)

    def from_model_order(self, tree):
        """Stacked leaves from the model's layer order to the order this layout stores them in."""
        return self.pipeline.from_model_order(tree)

    def put_batch(self, tokens_BT):
        """Place a host batch (the whole batch, on every process: a token array or packed rows) onto the
        mesh with the batch sharding."""
        return jax.device_put(tokens_BT, self.batch_sharding)

    def put_windows(self, sampler, starts_B: np.ndarray):
        """Build the global batch of windows (or packed rows) at `starts_B` from this process's rows only.

        Each process reads just the rows its own devices hold, so no process ever loads the whole
        batch; the global arrays are assembled from the per-device pieces.
        """
        read: dict[tuple, object] = {}  # devices that share rows (tensor, stage replicas) read them once

        def rows(index: tuple[slice, ...]):
            key = index[0].indices(len(starts_B))
            if key not in read:
                read[key] = sampler.windows(starts_B[index[0]])
            return read[key]

        def leaf(i: int, shape: tuple):  # the host batch has the abstract batch's structure: leaf i is leaf i
            return jax.make_array_from_callback(
                shape, self.batch_sharding, lambda index: jax.tree.leaves(rows(index))[i][(slice(None), *index[1:])])

        leaves, structure = jax.tree.flatten(self.abstract_batch())
        return jax.tree.unflatten(structure, [leaf(i, a.shape) for i, a in enumerate(leaves)])

    def put_state(self, state: TrainState) -> TrainState:
        """Copy a state (from any layout) into this layout's shardings (adding or dropping
        2BW's stale weights as this config needs: a fresh copy of the current ones)."""
        stale = ((state.stale_params if state.stale_params is not None else state.params)
                 if self.pipeline.stale_weights else None)
        return jax.device_put(dataclasses.replace(state, stale_params=stale), self.state_shardings)

    def abstract_batch(self):
        """The shapes, dtypes and sharding of one step's batch: a token array, or packed rows."""
        shape = (self.cfg.train.batch_size, self.cfg.model.seq_len + 1)
        one = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self.batch_sharding)
        if self.cfg.data.packing == "none":
            return one
        sources = len(self.session.mixture)
        source_B = jax.ShapeDtypeStruct(shape[:1], jnp.int32, sharding=self.batch_sharding) if sources else None
        return PackedRows(one, one, one, one, source_B=source_B, sources=sources)

    def compile_step(self, compiler_options: dict | None = None):
        """Lower and compile the train step without running it (for plans and HLO checks)."""
        return self.step.lower(self.abstract_state(), self.abstract_batch()).compile(compiler_options)

