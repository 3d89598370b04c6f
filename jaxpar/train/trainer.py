"""A laid-out model ready to train: what the training state holds and where each part lives, the
jitted steps, and the state and batches placed on the mesh.

The state is never materialized unsharded: its shapes come from `eval_shape`, its shardings from
the layout (jaxpar.laid_out.model), and it is created under `jit(out_shardings=...)`. A training
strategy (synchronous, or local SGD) transforms the plan: where the state lives, its specs, how it
starts, and the step.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec

import jaxpar.train.local_sgd as local_sgd
from jaxpar.laid_out.forward import make_eval_step
from jaxpar.laid_out.model import LaidOutModel
from jaxpar.model.adapters import trainable
from jaxpar.parallel.layout import Layout
from jaxpar.parallel.pipeline_plan import PipelinePlan
from jaxpar.session import Session
from jaxpar.train.loss_scale import LossScale
from jaxpar.train.objectives import training_objective
from jaxpar.train.optim import Optimizer
from jaxpar.train.pacing import InStep, OneBehind
from jaxpar.train.state import TrainState
from jaxpar.train.step import make_train_step
from jaxpar.train.two_bw_step import in_flight_specs, make_two_bw_step


class Trainer(LaidOutModel):
    """A laid-out model (jaxpar.laid_out.model) ready to train: its training state, where it lives, and its
    jitted steps: `init()` and `step(state, batch)`, `eval_loss(params, batch)`, and placing states and
    batches on the mesh. trace_routing: the step's metrics also hold each token's routing decisions, and
    the step takes decisions to replay as a third argument (verify; jaxpar.train.step.make_train_step);
    trace_gradients: they hold the step's gradients (verify; a synchronous strategy only: local SGD's
    metrics are its replicas' means).

    state_layout: where the training state lives (the strategy's)."""

    def __init__(self, session: Session, model: Callable[[nnx.Rngs], nnx.Module] | None = None,
                 rules: Mapping | None = None, trace_routing: bool = False, trace_gradients: bool = False):
        super().__init__(session, model, rules)
        self.trace_routing, self.trace_gradients = trace_routing, trace_gradients
        self._lay_out_state()
        self.step, self.eval_loss = self._compile_steps()
        # how the steps line up with the run's (jaxpar.train.pacing): 2BW's complete the one before
        self.pacing = OneBehind(self.step.drain) if self.pipeline.carries else InStep()

    def _lay_out_state(self) -> None:
        """The training state's layout and shardings, as the strategy (synchronous, local SGD) keeps it."""
        cfg, layout = self.cfg, self.layout
        strategy = local_sgd.strategy(cfg, self.session.mesh_sizes)
        state_layout = strategy.state_layout(layout, self.relayout)
        optimizer = Optimizer.build(cfg.train, trainable(self.abstract_params))
        specs = strategy.specs(_state_specs(state_layout, self.abstract_params, optimizer, self.pipeline))
        opt_memory = "pinned_host" if cfg.train.offloads_optimizer else None
        state_shardings = dataclasses.replace(layout.named(specs), opt_state=layout.named(specs.opt_state, opt_memory))
        self.state_layout, self.optimizer, self.strategy = state_layout, optimizer, strategy
        self.state_shardings = state_shardings
        self.in_flight_shapes = None
        if self.pipeline.carries:  # 2BW: what a step leaves in flight is part of the state, its shapes traced once
            self.in_flight_shapes = jax.eval_shape(self._two_bw_step(), self.abstract_state(), self.abstract_batch(),
                                                   True)[0].in_flight
            self.state_shardings = dataclasses.replace(
                state_shardings, in_flight=layout.named(in_flight_specs(layout, self.in_flight_shapes)))
            self.__dict__.pop("_create_fresh", None)  # traced above with the state's shardings before this

    def _two_bw_step(self):
        return make_two_bw_step(self.graphdef, self.optimizer, self.cfg, self.state_layout, self.pipeline,
                                self.precision, self.trace_routing, self.trace_gradients)

    def _compile_steps(self):
        """(step(state, tokens_BT) -> (state, metrics), eval_loss(params, tokens_BT) -> loss), both jitted
        (compiled when first called). With trace_routing the step's third argument, the decisions to
        replay or None, is split by rows like the batch."""
        if self.pipeline.carries:
            return self._compile_two_bw(), self._compile_eval()
        train_step = self.strategy.step(make_train_step(self.graphdef, self.optimizer, self.cfg, self.state_layout,
                                                        self.pipeline, self.precision, self.trace_routing,
                                                        self.trace_gradients))
        replayed = (self.batch_sharding,) if self.trace_routing else ()
        step = jax.jit(train_step, in_shardings=(self.state_shardings, self.batch_sharding, *replayed),
                       out_shardings=(self.state_shardings, self.replicated), donate_argnums=0)
        return step, self._compile_eval()

    def _compile_eval(self):
        eval_step = make_eval_step(self.graphdef, self.precision, self.layout, self.pipeline,
                                   self.cfg.train.loss_chunks)
        eval_loss = jax.jit(lambda params, tokens_BT: eval_step(self.weights(params), tokens_BT),
                            in_shardings=(self.state_shardings.params, self.batch_sharding),
                            out_shardings=self.replicated)
        return eval_loss

    def _compile_two_bw(self):
        """2BW's step(state, batch) (its metrics the previous step's) and `drain`, the same program with no
        batch of its own (jaxpar.train.two_bw_step)."""
        window = jax.jit(self._two_bw_step(), in_shardings=(self.state_shardings, self.batch_sharding, self.replicated),
                         out_shardings=(self.state_shardings, self.replicated), donate_argnums=0)
        return WindowStep(window)

    def initial_state(self, params) -> TrainState:
        """The state around `params` (model order; traced): optimizer and loss-scale state, 2BW's
        stale copy, as the strategy starts it."""
        params = self.pipeline.from_model_order(params)
        state = TrainState(jnp.zeros((), jnp.int32), params, self.optimizer.tx.init(trainable(params)),
                           LossScale.initial(self.precision), params if self.pipeline.stale_weights else None)
        if self.in_flight_shapes is not None:
            state = dataclasses.replace(state, in_flight=jax.tree.map(
                lambda a: jnp.zeros(a.shape, a.dtype), self.in_flight_shapes))
        return self.strategy.initial(state)

    def init(self) -> TrainState:
        """Create the initial state directly in its sharded layout: from model.from_hf's or model.from_run's
        weights (each device reading its own slices; model.lora's adapters on them), else freshly
        initialized in one program."""
        if self.starts_fresh and not self.cfg.model.lora.from_peft:
            return self._create_fresh()
        return self._create_from(self.start_params())

    def abstract_state(self) -> TrainState:
        """The shapes, dtypes and shardings of the state `init` creates, without creating it."""
        return jax.eval_shape(self._create_fresh)

    @functools.cached_property
    def _create_fresh(self):
        return jax.jit(lambda: self.initial_state(self.fresh_params()), out_shardings=self.state_shardings)

    @functools.cached_property
    def _create_from(self):
        return jax.jit(self.initial_state, in_shardings=(self.param_shardings,),
                       out_shardings=self.state_shardings)

    def weights(self, params):
        """The one set of weights the model runs with (evaluation, samples): the strategy's view of the
        stored parameters (local SGD: the replicas' mean)."""
        return self.strategy.weights(params)

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
        in_flight = None
        if self.in_flight_shapes is not None:  # a state from another layout has nothing in flight here
            in_flight = state.in_flight or jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), self.in_flight_shapes)
        return jax.device_put(dataclasses.replace(state, stale_params=stale, in_flight=in_flight),
                              self.state_shardings)

    def abstract_batch(self):
        """The shapes, dtypes and sharding of one step's batch: a token array, or packed rows (GRPO's
        with each completion's advantage and log-probabilities: jaxpar.rl.rollout)."""
        shape = (self.cfg.train.batch_size, self.cfg.model.seq_len + 1)
        sources = len(self.session.mixture)
        return training_objective(self.cfg).abstract_batch(shape, self.batch_sharding, sources)

    def compile_step(self, compiler_options: dict | None = None):
        """Lower and compile the train step without running it (for plans and HLO checks)."""
        return self.step.lower(self.abstract_state(), self.abstract_batch()).compile(compiler_options)


class WindowStep:
    """2BW's jitted step as `Trainer.step` is called (state, batch), and its drain: the same program with
    no batch of its own, which takes the last batch only for its shape."""

    def __init__(self, window):
        self.window, self.last_batch = window, None

    def __call__(self, state, batch):
        self.last_batch = batch
        return self.window(state, batch, True)

    def lower(self, state, batch):
        return self.window.lower(state, batch, True)

    def trace(self, state, batch):
        return self.window.trace(state, batch, True)

    def drain(self, state):
        if self.last_batch is None:
            raise ValueError("drain() follows a step: its program takes the last step's batch for its shape")
        return self.window(state, self.last_batch, False)


def _state_specs(layout: Layout, abstract_params, optimizer: Optimizer, pipeline: PipelinePlan) -> TrainState:
    """The partition specs of one replica's state on `layout`."""
    param_specs = layout.param_specs(abstract_params)
    scalar = PartitionSpec()
    return TrainState(scalar, param_specs,
                      layout.opt_specs(jax.eval_shape(optimizer.tx.init, trainable(abstract_params))),
                      LossScale(scalar, scalar, scalar), param_specs if pipeline.stale_weights else None)
