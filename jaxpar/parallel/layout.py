"""A parallel layout: mesh + rules table + ZeRO stage.

It gives the shardings of every part of the training state and computes the gradients.

Data, tensor and ZeRO parallelism are left to XLA's SPMD partitioner (`_PartitionerHooks`):
the loss is differentiated on the global batch, activations carry sharding constraints, and
ZeRO-2/3 constrain each layer's weight (3: an all-gather in the compute dtype) and its
gradient (2 and 3: summed in fp32 onto the shard) inside the layer scan, so gradients are
reduced layer by layer during backward.

`jax.shard_map` appears only where collectives are written by hand. A pipeline is manual
over `stage` (the executors ppermute between stages) and automatic over the rest. With
`mesh.expert` > 1 the batch axes are manual too, for the expert all-to-all: each shard
differentiates its slice of the batch, gradients are summed with `psum` over the
data-parallel axes their weight is not sharded on (stages 0-1) or reduce-scattered layer by
layer by custom VJPs (stages 2-3), and the Layout itself is the model's hooks.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.model import layout_hooks
from jaxpar.parallel.rules import RULES, logical_to_spec
from jaxpar.parallel.zero import DATA_PARALLEL_AXES, manual_part, without_axes, zero_dim, zero_spec


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _names(variable: nnx.Variable, ndim: int) -> tuple:
    names = tuple(variable.get_metadata().get("out_sharding") or ())
    return names if len(names) == ndim else (None,) * ndim


class Layout:
    """Shardings and in-step hooks for one mesh, rules table and ZeRO stage."""

    def __init__(self, mesh: jax.sharding.Mesh, zero: int = 0, rules: dict = RULES,
                 compute_dtype=jnp.float32):
        self.mesh, self.zero, self.rules = mesh, zero, rules
        self.compute_dtype = compute_dtype  # ZeRO-3 gathers weights in it
        self.sizes = dict(mesh.shape)
        # Only axes of size > 1 are made manual: XLA's SPMD partitioner rejects the tensor
        # all-reduces of a shard_map that is manual over size-1 axes only (tensor=N alone).
        self.data_axes = tuple(a for a in DATA_PARALLEL_AXES if self.sizes.get(a, 1) > 1)
        self.pipelined = self.sizes.get("stage", 1) > 1
        self.batch_ways = math.prod(self.sizes[a] for a in self.data_axes)
        # shard_map only where the step needs collectives written by hand; data, ZeRO and tensor
        # parallelism are left to XLA's SPMD partitioner as sharding constraints (the same step
        # ran 1.4-1.7x faster that way than written per shard under shard_map on emulated CPU
        # devices: benchmarks/RESULTS.md, "Where the time went"). The batch axes are manual for
        # the expert all-to-all. A pipeline is manual over `stage` and leaves the batch axes to
        # the partitioner, except with tensor > 1: there XLA's partitioner aborts on the
        # embedding gather when `data` and `tensor` are both automatic under a manual `stage`
        # (a failed check in ExpandDeviceGroups, jax 0.12.0.1), so the batch axes stay manual.
        tensor = self.sizes.get("tensor", 1) > 1
        manual_batch = self.sizes.get("expert", 1) > 1 or (self.pipelined and tensor)
        self.manual_data = self.data_axes if manual_batch else ()
        self.manual = self.manual_data + (("stage",) if self.pipelined else ())
        # How many batch shards the traced loss sees: one (its own) when the batch axes are
        # manual, all of them when the compiler partitions the global batch.
        self.traced_batch_shards = 1 if self.manual_data else self.batch_ways
        # What per-shard means are averaged over: the manual batch shards (1 when partitioned).
        self.manual_batch_ways = self.batch_ways // self.traced_batch_shards
        # ZeRO-2/3 expand each layer's weights from a shard; redo that in backward, never keep it.
        self.layer_weights_policy = _keep_all_but_expanded_weights if zero >= 2 else None

    # ---- partition specs -------------------------------------------------------------
    def spec(self, names: tuple, shape: tuple, zero: bool) -> PartitionSpec:
        """The rules-table spec of a leaf, with ZeRO sharding added when `zero`."""
        spec = logical_to_spec(names, self.rules)
        return zero_spec(spec, shape, names, self.sizes) if zero else spec

    def _specs(self, tree, zero: bool):
        def one(x):
            if _is_var(x):
                shape = x.get_value().shape
                return x.replace(self.spec(_names(x, len(shape)), shape, zero))
            return self.spec((None,) * len(x.shape), x.shape, zero) if getattr(x, "ndim", 0) else PartitionSpec()

        return jax.tree.map(one, tree, is_leaf=_is_var)

    def param_specs(self, params):
        """Parameters: sharded over data-parallel devices only under ZeRO-3."""
        return self._specs(params, self.zero >= 3)

    def grad_specs(self, params):
        """Gradients after reduction: reduce-scattered under ZeRO-2 and 3."""
        return self._specs(params, self.zero >= 2)

    def opt_specs(self, opt_state):
        """Optimizer state: sharded over data-parallel devices from ZeRO-1 on."""
        return self._specs(opt_state, self.zero >= 1)

    def named(self, specs):
        """PartitionSpecs -> NamedShardings on this mesh."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs,
                            is_leaf=lambda x: isinstance(x, PartitionSpec))

    def batch_sharding(self) -> NamedSharding:
        """Sharding of a (batch, seq) token array."""
        return NamedSharding(self.mesh, logical_to_spec(("batch", "seq"), self.rules))

    # ---- hooks used by the model while tracing (see jaxpar.model.axes) ----------------
    def auto_hooks(self):
        """Hooks for code traced outside shard_map (evaluation): plain sharding constraints."""
        return _AutoHooks(self)

    def constrain(self, x: jax.Array, names: tuple) -> jax.Array:
        """Inside shard_map: constrain the automatic axes only."""
        spec = without_axes(logical_to_spec(names, self.rules), self.manual)
        return jax.lax.with_sharding_constraint(x, spec)

    def model_weights(self, state):
        """Inside shard_map, ZeRO-2/3: the full non-stacked weights (embedding, final norm)."""
        return state if self.zero < 2 else _expand_model_weights(self._expand, state)

    def layer_weights(self, layer_state, index: jax.Array):
        """Inside shard_map, ZeRO-2/3: one layer's full weights, from its gradient shard."""
        return layer_state if self.zero < 2 else _expand_layer_weights(self._expand, self._stacked, layer_state, index)

    def expert_all_to_all(self, x_EGCD: jax.Array, inverse: bool) -> jax.Array:
        """Inside shard_map: send each expert's slots to the device holding it (and back)."""
        if self.sizes.get("expert", 1) == 1:
            return x_EGCD
        split, concat = (1, 0) if inverse else (0, 1)
        return jax.lax.all_to_all(x_EGCD, "expert", split, concat, tiled=True)

    def batch_shard_index(self) -> jax.Array:
        """Inside shard_map: this device's index along the data-parallel axes."""
        return jax.lax.axis_index(self.data_axes) if self.data_axes else jnp.zeros((), jnp.int32)

    def _expand(self, variable: nnx.Variable, path: tuple, layer: jax.Array | None):
        """Shard -> full weight whose gradient is reduce-scattered back onto the shard.

        ZeRO-3 all-gathers the shard (autodiff transposes that into a reduce-scatter).
        ZeRO-2 holds the full weight already (replicated): it is looked up, and a custom
        VJP gives the shard the reduce-scattered gradient, layer by layer during backward.
        """
        found = self._zero_dims[path]
        if found is None:
            return variable
        d, axes = found
        shard = variable.get_value()
        if layer is not None:
            d -= 1  # a layer's slice of a stacked weight has no 'layers' dimension
        if self.zero >= 3:
            dtype = self.compute_dtype if jnp.issubdtype(shard.dtype, jnp.floating) else shard.dtype
            return variable.replace(_gathered_in(shard, dtype, d, axes))
        full = self._replicas[path]
        full = full if layer is None else jax.lax.dynamic_index_in_dim(full, layer, keepdims=False)
        return variable.replace(_replica_with_scattered_grad(shard, full.astype(shard.dtype), d, axes))

    def _zero_shards(self, params):
        """This device's ZeRO slice of each (replicated) weight: a local slice, no communication."""
        def one(path, v):
            found = self._zero_dims[_path_key(path)]
            if found is None:
                return v
            d, axes = found
            value = v.get_value()
            size = value.shape[d] // math.prod(self.sizes[a] for a in axes)
            start = jax.lax.axis_index(axes) * size  # axes are data-parallel axes only
            return v.replace(jax.lax.dynamic_slice_in_dim(value, start, size, axis=d))

        return jax.tree_util.tree_map_with_path(one, params, is_leaf=_is_var)

    # ---- gradients -------------------------------------------------------------------
    def _weight_tables(self, params) -> None:
        """Tracing-time tables for the hooks: each weight's ZeRO dimension, its rules-table
        and ZeRO specs, the mesh axes its spec uses, and which weights are stacked."""
        self._zero_dims, self._weight_specs, self._used_axes = {}, {}, {}
        flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_var)[0]
        for path, v in flat:
            shape = v.get_value().shape
            names = _names(v, len(shape))
            key, spec = _path_key(path), logical_to_spec(names, self.rules)
            self._zero_dims[key] = zero_dim(spec, shape, names, self.sizes)
            self._weight_specs[key] = (spec, zero_spec(spec, shape, names, self.sizes))
            self._used_axes[key] = {a for e in spec for a in ((e,) if isinstance(e, str) else e or ())}
        self._stacked = [_path_key(p) for p, v in flat if _is_stacked(v)]

    def gradients(self, grad_fn, params, param_specs, batch, *args):
        """(stats, grads) for the global batch; grad_fn(params, batch, *args) -> (stats, grads).

        Under shard_map grad_fn sees its local batch shard, and stats (the loss and any other
        per-shard averages) and gradients come back summed over the data-parallel axes and
        divided by their size (the mean over equal shards). Partitioned by the compiler, it sees
        the global batch and its means are the global ones already. Gradients are in the
        `grad_specs` layout.
        """
        is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
        grad_specs = self.grad_specs(params)
        self._weight_tables(params)

        def per_shard(params, batch, *args):
            target = params
            if self.manual_data and self.zero == 2:
                # differentiate w.r.t. local shards; the hooks look the full weights up
                self._replicas = {_path_key(p): v.get_value()
                                  for p, v in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_var)[0]}
                target = self._zero_shards(params)
            with layout_hooks(self if self.manual_data else _PartitionerHooks(self)):
                stats, grads = grad_fn(target, batch, *args)
            # (a pipeline's loss is nonzero on the last stage only, hence the sum over `stage` too)
            stats = jax.tree.map(lambda x: jax.lax.psum(x, self.manual) / self.manual_batch_ways, stats)
            grads = jax.tree_util.tree_map_with_path(lambda p, g: self._reduce(g, _path_key(p)), grads,
                                                     is_leaf=_is_var)
            return stats, grads

        if not self.manual:  # no stages, no experts: the compiler partitions it all
            with layout_hooks(_PartitionerHooks(self)):
                stats, grads = grad_fn(params, batch, *args)
        else:
            manual_in = jax.tree.map(lambda s: manual_part(s, self.manual), param_specs, is_leaf=is_spec)
            manual_out = jax.tree.map(lambda s: manual_part(s, self.manual), grad_specs, is_leaf=is_spec)
            fn = jax.shard_map(per_shard, mesh=self.mesh, axis_names=set(self.manual), check_vma=False,
                               in_specs=(manual_in, PartitionSpec(self.manual_data)) + (PartitionSpec(),) * len(args),
                               out_specs=(PartitionSpec(), manual_out))
            stats, grads = fn(params, batch, *args)
        if self.zero >= 2 and not self.manual_data:  # the shards, reduced layer by layer in backward
            grads = jax.lax.with_sharding_constraint(grads, self.named(grad_specs))
        return stats, grads

    def _reduce(self, grad: nnx.Variable, path: tuple) -> nnx.Variable:
        """Mean of a local gradient over the data-parallel shards: summed over the data-parallel
        axes its weight is not sharded over (expert weights live on one expert shard each;
        ZeRO-2/3 ones were reduce-scattered in backward already), over `stage` too for a weight
        shared by all pipeline stages, then divided by the number of batch shards."""
        value = grad.get_value()
        if self.manual_data and not (self.zero >= 2 and self._zero_dims[path] is not None):
            axes = tuple(a for a in self.manual_data if a not in self._used_axes[path])
            value = jax.lax.psum(value, axes) if axes else value
        if self.pipelined and path not in self._stacked:
            value = jax.lax.psum(value, "stage")
        return grad.replace(value / self.manual_batch_ways)

    def stacked_mask(self, params):
        """A tree of bools: True for stacked (per-layer) weights, which pipeline stages split."""
        return jax.tree.map(lambda v: v.replace(_is_stacked(v)), params, is_leaf=_is_var)


# Primitives that expand a weight shard to the full weight (ZeRO-3 gathers, ZeRO-2 slices its
# replica; both wrapped in custom VJPs, which a checkpoint policy sees as one custom_vjp_call).
_EXPANDING_PRIMITIVES = frozenset({"all_gather", "dynamic_slice", "squeeze", "custom_vjp_call"})


def _keep_all_but_expanded_weights(primitive, *_, **__) -> bool:
    """Checkpoint policy: keep every intermediate for backward except expanded layer weights."""
    return primitive.name not in _EXPANDING_PRIMITIVES


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


def _path_key(path) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def _is_stacked(variable: nnx.Variable) -> bool:
    names = variable.get_metadata().get("out_sharding") or ()
    return bool(names) and names[0] == "layers"


def _expand_model_weights(expand, state):
    """ZeRO-2/3: the full non-stacked weights (embedding, head, final norm), each through
    expand(variable, path, None)."""
    return jax.tree_util.tree_map_with_path(
        lambda p, v: v if _is_stacked(v) else expand(v, _path_key(p), None), state, is_leaf=_is_var)


def _expand_layer_weights(expand_one, stacked: list, layer_state, index: jax.Array):
    """ZeRO-2/3: one layer's full weights inside the layer scan, each through
    expand_one(variable, path of the stacked weight, index)."""

    def expand(path, variable):
        key = _path_key(path)
        matches = [full for full in stacked if full[-len(key):] == key]
        return expand_one(variable, matches[0], index) if matches else variable

    return jax.tree_util.tree_map_with_path(expand, layer_state, is_leaf=_is_var)


class _PartitionerHooks:
    """Hooks for a step the compiler partitions (no shard_map): activation constraints, and
    ZeRO-2/3 as sharding constraints on each layer's weights and on their gradients.

    ZeRO-3 constrains a layer's weight shard to its full (rules-table) sharding in the compute
    dtype, which XLA turns into an all-gather inside the layer scan; the custom VJP constrains
    the fp32 gradient back to the shard, a reduce-scatter. ZeRO-2 keeps the forward as it is and
    only constrains the gradient.
    """

    def __init__(self, layout: Layout):
        self.layout, self.zero = layout, layout.zero
        self.layer_weights_policy = layout.layer_weights_policy

    def constrain(self, x, names):
        return jax.lax.with_sharding_constraint(x, self._sharding(logical_to_spec(names, self.layout.rules)))

    def model_weights(self, state):
        return state if self.zero < 2 else _expand_model_weights(self._expand, state)

    def layer_weights(self, layer_state, index):
        return layer_state if self.zero < 2 else _expand_layer_weights(self._expand, self.layout._stacked,
                                                                        layer_state, index)

    def _sharding(self, spec: PartitionSpec):
        # Inside a pipeline's shard_map (manual over `stage`), a bare spec of the automatic axes.
        if self.layout.manual:
            return without_axes(spec, self.layout.manual)
        return NamedSharding(self.layout.mesh, spec)

    def _expand(self, variable: nnx.Variable, path: tuple, layer: jax.Array | None):
        layout = self.layout
        if layout._zero_dims[path] is None:
            return variable
        full, shard = layout._weight_specs[path]
        if layer is not None:  # a layer's slice of a stacked weight has no 'layers' dimension
            full, shard = PartitionSpec(*full[1:]), PartitionSpec(*shard[1:])
        full, shard = self._sharding(full), self._sharding(shard)
        value = variable.get_value()
        if self.zero >= 3:
            dtype = layout.compute_dtype if jnp.issubdtype(value.dtype, jnp.floating) else value.dtype
            return variable.replace(_constrained_gather(value, dtype, full, shard))
        return variable.replace(_gradient_constrained(value, shard))


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


class _AutoHooks:
    def __init__(self, layout: Layout):
        self.layout = layout

    def constrain(self, x, names):
        spec = logical_to_spec(names, self.layout.rules)
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.layout.mesh, spec))

    def model_weights(self, state):
        return state

    def layer_weights(self, layer_state, index):
        return layer_state
