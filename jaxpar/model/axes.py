"""Logical axis names for parameters and activations; no mesh axis appears in model code.

Parameters carry their logical names as Flax `out_sharding` metadata, so
`nnx.get_partition_spec` and `nnx.logical_axis_rules` work on jaxpar modules as on any
Flax model (eager sharding is off: the layout is chosen by jaxpar.parallel).

Hooks let a parallel layout act inside the model without the model knowing any mesh:
`constrain` annotates an activation's sharding by logical names; `model_weights` is applied
to the whole parameter state before the model is built from it, and `layer_weights` to each
layer's weights inside the layer scan (ZeRO-3 gathers there). They do nothing unless a
layout installs itself with `layout_hooks`.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

LOGICAL_AXES = ("batch", "seq", "embed", "mlp", "heads", "kv", "vocab", "expert", "layers", "pos")


class LayoutHooks(Protocol):
    """What a parallel layout provides to the model while a step is traced."""

    def constrain(self, x: jax.Array, names: tuple) -> jax.Array: ...

    def model_weights(self, state): ...

    def layer_weights(self, layer_state, index: jax.Array): ...

    def expert_all_to_all(self, x_EGCD: jax.Array, inverse: bool) -> jax.Array: ...

    def batch_shard_index(self) -> jax.Array: ...

    # A jax.checkpoint policy for the layer scan when no remat is asked for: it keeps
    # activations but not the weights `layer_weights` produced (redone in backward). None: no policy.
    layer_weights_policy: object


_hooks: contextvars.ContextVar[LayoutHooks | None] = contextvars.ContextVar("jaxpar_layout", default=None)


def param(key: jax.Array, shape: tuple[int, ...], names: tuple[str | None, ...], scale: float,
          dtype=jax.numpy.float32) -> nnx.Param:
    """A normal(0, scale) parameter annotated with logical axis names."""
    assert len(names) == len(shape), (names, shape)
    value = scale * jax.random.normal(key, shape, dtype)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def ones_param(shape: tuple[int, ...], names: tuple[str | None, ...]) -> nnx.Param:
    """A parameter of ones (norm scales) annotated with logical axis names."""
    return nnx.Param(jax.numpy.ones(shape, jax.numpy.float32), out_sharding=names, eager_sharding=False)


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Constrain an activation's sharding by logical names, if a layout is active."""
    hooks = _hooks.get()
    return x if hooks is None else hooks.constrain(x, names)


def model_weights(state):
    """The parameter state as the model should use it (e.g. non-stacked shards gathered)."""
    hooks = _hooks.get()
    return state if hooks is None else hooks.model_weights(state)


def layer_weights(layer_state, index: jax.Array):
    """Layer `index`'s weights as the layer should use them (e.g. gathered), if a layout is active."""
    hooks = _hooks.get()
    return layer_state if hooks is None else hooks.layer_weights(layer_state, index)


def expert_all_to_all(x_EGCD: jax.Array, inverse: bool) -> jax.Array:
    """Expert parallelism: (E, G, C, D) -> (E_local, G x shards, C, D), or back when inverse."""
    hooks = _hooks.get()
    return x_EGCD if hooks is None or not hasattr(hooks, "expert_all_to_all") else hooks.expert_all_to_all(
        x_EGCD, inverse)


def batch_shard_index() -> jax.Array:
    """Index of this device's slice of the batch (0 without a manual layout)."""
    hooks = _hooks.get()
    return jnp.zeros((), jnp.int32) if hooks is None or not hasattr(hooks, "batch_shard_index") else (
        hooks.batch_shard_index())


def layer_weights_policy():
    """The active layout's checkpoint policy for layer weights (see LayoutHooks), or None."""
    hooks = _hooks.get()
    return None if hooks is None else getattr(hooks, "layer_weights_policy", None)


@contextlib.contextmanager
def layout_hooks(hooks: LayoutHooks):
    """Install a layout's hooks while tracing a step."""
    token = _hooks.set(hooks)
    try:
        yield
    finally:
        _hooks.reset(token)
