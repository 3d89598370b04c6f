"""The hooks a layout gives a step while it is traced: activation constraints and the expert
all-to-all for the model (jaxpar.model.axes.ModelHooks), and for the step the weights as the
model should use them (`model_weights` for the whole state, `layer_weights` for one layer
inside the layer scan) with the checkpoint policy that goes with them.

Two implementations, both complete:
- `PartitionerHooks`, for a step XLA's SPMD partitioner shards: constraints only. ZeRO-3
  constrains a layer's weight shard to its full sharding in the compute dtype (an all-gather
  inside the layer scan) and, in a custom VJP, the fp32 gradient back to the shard (a
  reduce-scatter); ZeRO-2 only constrains the gradient.
- `ManualHooks`, inside a shard_map manual over the batch axes (expert parallelism): the
  collectives by hand. ZeRO-3 all-gathers the shard (its VJP reduce-scatters); ZeRO-2 holds
  the full replicated weight, differentiates this device's slice, and a custom VJP gives the
  slice its reduce-scattered gradient.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.model.axes import path_names
from jaxpar.parallel.rules import logical_to_spec
from jaxpar.parallel.zero import without_axes

if TYPE_CHECKING:
    from jaxpar.parallel.layout import Layout

# Primitives that expand a weight shard to the full weight (ZeRO-3 gathers, ZeRO-2 slices its
# replica; both wrapped in custom VJPs, which a checkpoint policy sees as one custom_vjp_call).
_EXPANDING_PRIMITIVES = frozenset({"all_gather", "dynamic_slice", "squeeze", "custom_vjp_call"})


def _keep_all_but_expanded_weights(primitive, *_, **__) -> bool:
    """Checkpoint policy: keep every intermediate for backward except expanded layer weights."""
    return primitive.name not in _EXPANDING_PRIMITIVES


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


class _Hooks:
    """What both implementations share: walking a state to expand each weight with `_expand`.
    in_step: traced inside the step's gradients (under its shard_map when it has one); False for
    code traced outside it with the stored weights (evaluation)."""

    def __init__(self, layout: Layout, in_step: bool = True):
        self.layout, self.in_step = layout, in_step
        self.expands = in_step and layout.zero >= 2
        # ZeRO-2/3 expand each layer's weights from a shard; redo that in backward, never keep it.
        self.layer_weights_policy = _keep_all_but_expanded_weights if self.expands else None

    def model_weights(self, state):
        """The full non-stacked weights (embedding, head, final norm)."""
        if not self.expands:
            return state
        weights = self.layout.weights
        return jax.tree_util.tree_map_with_path(
            lambda p, v: v if weights[path_names(p)].stacked else self._expand(v, path_names(p), None),
            state, is_leaf=_is_var)

    def layer_weights(self, layer_state, index: jax.Array):
        """Layer `index`'s full weights inside the layer scan (`index`: its place in the stacked state)."""
        if not self.expands:
            return layer_state
        stack = self.layout.layer_weights_at
        return jax.tree_util.tree_map_with_path(lambda p, v: self._expand(v, stack + path_names(p), index),
                                                layer_state, is_leaf=_is_var)

    def differentiated(self, params):
        """What the step differentiates: the parameters as stored."""
        return params

    def _expand(self, variable: nnx.Variable, path: tuple, layer: jax.Array | None) -> nnx.Variable:
        """The full weight of `variable` (the parameter at `path`, or its slice for stacked layer `layer`)."""
        raise NotImplementedError


class PartitionerHooks(_Hooks):
    """Hooks for a step the compiler partitions (no shard_map, or a pipeline's manual `stage` only)."""

    def constrain(self, x: jax.Array, names: tuple) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, self._sharding(logical_to_spec(names, self.layout.rules)))

    def expert_all_to_all(self, x_EGCD: jax.Array, inverse: bool) -> jax.Array:
        return x_EGCD  # experts are only split by hand (the batch axes are manual with mesh.expert > 1)

    def _sharding(self, spec: PartitionSpec):
        # Inside a pipeline's shard_map (manual over `stage`), a bare spec of the automatic axes.
        if self.in_step and self.layout.manual:
            return without_axes(spec, self.layout.manual)
        return NamedSharding(self.layout.mesh, spec)

    def _expand(self, variable, path, layer):
        plan = self.layout.weights[path]
        if plan.zero_dim is None:
            return variable
        full, shard = plan.spec, plan.zero_spec
        if layer is not None:  # a layer's slice of a stacked weight has no 'layers' dimension
            full, shard = PartitionSpec(*full[1:]), PartitionSpec(*shard[1:])
        full, shard = self._sharding(full), self._sharding(shard)
        value = variable.get_value()
        if self.layout.zero >= 3:
            dtype = self.layout.compute_dtype if jnp.issubdtype(value.dtype, jnp.floating) else value.dtype
            return variable.replace(_constrained_gather(value, dtype, full, shard))
        return variable.replace(_gradient_constrained(value, shard))


class ManualHooks(_Hooks):
    """Hooks inside a shard_map that is manual over the batch axes. Under ZeRO-2, `replicas`
    holds the full (replicated) weights by path, and the step differentiates the shards."""

    def __init__(self, layout: Layout, replicas: dict | None = None):
        super().__init__(layout)
        self.replicas = replicas

    @classmethod
    def for_params(cls, layout: Layout, params) -> ManualHooks:
        if layout.zero != 2:
            return cls(layout)
        flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_var)[0]
        return cls(layout, {path_names(p): v.get_value() for p, v in flat})

    def constrain(self, x: jax.Array, names: tuple) -> jax.Array:
        """Constrain the automatic axes only."""
        return jax.lax.with_sharding_constraint(x, without_axes(logical_to_spec(names, self.layout.rules),
                                                                self.layout.manual))

    def expert_all_to_all(self, x_EGCD: jax.Array, inverse: bool) -> jax.Array:
        """Send each expert's slots to the device holding it (and back)."""
        if self.layout.sizes.get("expert", 1) == 1:
            return x_EGCD
        split, concat = (1, 0) if inverse else (0, 1)
        return jax.lax.all_to_all(x_EGCD, "expert", split, concat, tiled=True)

    def differentiated(self, params):
        """ZeRO-2: this device's slice of each replicated weight (a local slice, no communication);
        the layers look the full weights up in `replicas`."""
        if self.replicas is None:
            return params
        weights, sizes = self.layout.weights, self.layout.sizes
        return jax.tree_util.tree_map_with_path(
            lambda p, v: v if weights[path_names(p)].zero_dim is None else v.replace(
                _local_slice(v.get_value(), *weights[path_names(p)].zero_dim, sizes)), params, is_leaf=_is_var)

    def _expand(self, variable, path, layer):
        found = self.layout.weights[path].zero_dim
        if found is None:
            return variable
        d, axes = found
        shard = variable.get_value()
        if layer is not None:
            d -= 1  # a layer's slice of a stacked weight has no 'layers' dimension
        if self.layout.zero >= 3:
            dtype = self.layout.compute_dtype if jnp.issubdtype(shard.dtype, jnp.floating) else shard.dtype
            return variable.replace(_gathered_in(shard, dtype, d, axes))
        full = self.replicas[path]
        full = full if layer is None else jax.lax.dynamic_index_in_dim(full, layer, keepdims=False)
        return variable.replace(_replica_with_scattered_grad(shard, full.astype(shard.dtype), d, axes))


def _local_slice(value: jax.Array, dim: int, axes: tuple[str, ...], sizes) -> jax.Array:
    """This device's block of `value` along `dim`, split over the (data-parallel) `axes`."""
    size = value.shape[dim] // math.prod(sizes[a] for a in axes)
    return jax.lax.dynamic_slice_in_dim(value, jax.lax.axis_index(axes) * size, size, axis=dim)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _constrained_gather(shard, dtype, full, sharded):
    """Forward: the weight in the compute dtype with its full sharding (an all-gather).
    Backward: the gradient summed in fp32 and constrained to the shard (a reduce-scatter)."""
    return jax.lax.with_sharding_constraint(shard.astype(dtype), full)


def _constrained_gather_fwd(shard, dtype, full, sharded):
    return _constrained_gather(shard, dtype, full, sharded), jnp.zeros((), shard.dtype)


def _constrained_gather_bwd(dtype, full, sharded, like, grad):
    return (jax.lax.with_sharding_constraint(grad.astype(jnp.float32), sharded).astype(like.dtype),)


_constrained_gather.defvjp(_constrained_gather_fwd, _constrained_gather_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gradient_constrained(weight, sharded):
    """Forward: the weight. Backward: its gradient summed in fp32 onto the shard (ZeRO-2)."""
    return weight


def _gradient_constrained_fwd(weight, sharded):
    return weight, None


def _gradient_constrained_bwd(sharded, _, grad):
    return (jax.lax.with_sharding_constraint(grad.astype(jnp.float32), sharded).astype(grad.dtype),)


_gradient_constrained.defvjp(_gradient_constrained_fwd, _gradient_constrained_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _replica_with_scattered_grad(shard, full, dim, axes):
    """Forward: the full (replicated) weight. Backward: its gradient reduce-scattered onto `shard`."""
    return full


def _replica_fwd(shard, full, dim, axes):
    return full, None


def _replica_bwd(dim, axes, _, grad):
    summed = jax.lax.psum_scatter(grad.astype(jnp.float32), axes, scatter_dimension=dim, tiled=True)
    return summed.astype(grad.dtype), None


_replica_with_scattered_grad.defvjp(_replica_fwd, _replica_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gathered_in(shard, dtype, dim, axes):
    """Forward: the full weight, all-gathered in the compute dtype (half the bytes of fp32 in
    bf16). Backward: its gradient reduce-scattered in fp32 onto the shard, in the shard's dtype
    (fp32 sums are what mixed precision wants, and XLA:CPU aborts on a bf16 reduce-scatter)."""
    return jax.lax.all_gather(shard.astype(dtype), axes, axis=dim, tiled=True)


def _gathered_fwd(shard, dtype, dim, axes):
    return _gathered_in(shard, dtype, dim, axes), jnp.zeros((), shard.dtype)


def _gathered_bwd(dtype, dim, axes, like, grad):
    summed = jax.lax.psum_scatter(grad.astype(jnp.float32), axes, scatter_dimension=dim, tiled=True)
    return (summed.astype(like.dtype),)


_gathered_in.defvjp(_gathered_fwd, _gathered_bwd)
