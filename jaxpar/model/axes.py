"""Logical axis names for parameters and activations; no mesh axis appears in model code.

Parameters carry their logical names as Flax `out_sharding` metadata, so
`nnx.get_partition_spec` and `nnx.logical_axis_rules` work on jaxpar modules as on any
Flax model. Activations are annotated through `constrain`, which does nothing unless a
parallel layout has installed a resolver with `activation_sharding` (jaxpar.parallel does).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable

import jax
from flax import nnx

LOGICAL_AXES = ("batch", "seq", "embed", "mlp", "heads", "kv", "vocab", "expert", "layers", "pos")

_resolver: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("jaxpar_resolver", default=None)


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
    resolve = _resolver.get()
    return x if resolve is None else resolve(x, names)


@contextlib.contextmanager
def activation_sharding(resolve: Callable[[jax.Array, tuple], jax.Array]):
    """Install `resolve(x, logical_names) -> x` for `constrain` while tracing a step."""
    token = _resolver.set(resolve)
    try:
        yield
    finally:
        _resolver.reset(token)
