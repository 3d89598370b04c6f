"""A parallel layout: mesh + rules table + ZeRO stage.

It gives the shardings of every part of the training state and computes gradients with
one mechanism for every ZeRO stage: the loss is differentiated per data-parallel shard
inside `jax.shard_map` (manual over the data-parallel axes, and over `stage` when
pipelining; automatic over `tensor`), then each gradient is summed with `psum` over the
data-parallel axes its weight is not sharded on (stages 0-1), or reduce-scattered layer by
layer during backward (stages 2-3): ZeRO-3 all-gathers each layer's weight shards inside the
layer scan (autodiff turns the gather into the reduce-scatter), ZeRO-2 looks the replicated
weight up and a custom VJP reduce-scatters its gradient onto the shard. Inside the same
shard_map the layout provides the model's hooks: activation constraints on the automatic
axes, and the all-to-all of expert parallelism over `expert`.
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
        # shard_map is manual over the batch axes, and over `stage` when pipelining.
        self.manual = self.data_axes + (("stage",) if self.pipelined else ())
        self.batch_ways = math.prod(self.sizes[a] for a in self.data_axes)
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
        if self.zero < 2:
            return state
        return jax.tree_util.tree_map_with_path(
            lambda p, v: v if _is_stacked(v) else self._expand(v, _path_key(p), None), state, is_leaf=_is_var)

    def layer_weights(self, layer_state, index: jax.Array):
        """Inside shard_map, ZeRO-2/3: one layer's full weights, from its gradient shard."""
        if self.zero < 2:
            return layer_state

        def expand(path, variable):
            key = _path_key(path)
            matches = [full for full in self._stacked if full[-len(key):] == key]
            return self._expand(variable, matches[0], index) if matches else variable

        return jax.tree_util.tree_map_with_path(expand, layer_state, is_leaf=_is_var)

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
    def gradients(self, grad_fn, params, param_specs, batch, *args):
        """(stats, grads) for the global batch; grad_fn(params, local_batch, *args) -> (stats, grads).

        Stats (the loss and any other per-shard averages) and gradients come back summed over
        the data-parallel axes and divided by their size (the mean over equal shards);
        gradients are in the `grad_specs` layout.
        """
        is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
        grad_specs = self.grad_specs(params)
        flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_var)[0]
        # Tracing-time tables for the hooks: each weight's ZeRO dimension, and which are stacked.
        self._zero_dims = {}
        for path, v in flat:
            shape = v.get_value().shape
            names = _names(v, len(shape))
            self._zero_dims[_path_key(path)] = zero_dim(logical_to_spec(names, self.rules), shape, names, self.sizes)
        self._stacked = [_path_key(p) for p, v in flat if _is_stacked(v)]
        self._used_axes = {}
        for path, v in flat:
            spec = logical_to_spec(_names(v, v.get_value().ndim), self.rules)
            self._used_axes[_path_key(path)] = {a for e in spec for a in ((e,) if isinstance(e, str) else e or ())}

        def per_shard(params, batch, *args):
            target = params
            if self.zero == 2:  # differentiate w.r.t. local shards; the hooks look the full weights up
                self._replicas = {_path_key(p): v.get_value()
                                  for p, v in jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_var)[0]}
                target = self._zero_shards(params)
            with layout_hooks(self):
                stats, grads = grad_fn(target, batch, *args)
            # (a pipeline's loss is nonzero on the last stage only, hence the sum over `stage` too)
            stats = jax.tree.map(lambda x: jax.lax.psum(x, self.manual) / self.batch_ways, stats)
            grads = jax.tree_util.tree_map_with_path(lambda p, g: self._reduce(g, _path_key(p)), grads,
                                                     is_leaf=_is_var)
            return stats, grads

        if not self.manual:  # one batch shard, no stages: the compiler partitions it all
            with layout_hooks(self.auto_hooks()):
                return grad_fn(params, batch, *args)
        manual_in = jax.tree.map(lambda s: manual_part(s, self.manual), param_specs, is_leaf=is_spec)
        manual_out = jax.tree.map(lambda s: manual_part(s, self.manual), grad_specs, is_leaf=is_spec)
        fn = jax.shard_map(per_shard, mesh=self.mesh, axis_names=set(self.manual), check_vma=False,
                           in_specs=(manual_in, PartitionSpec(self.data_axes)) + (PartitionSpec(),) * len(args),
                           out_specs=(PartitionSpec(), manual_out))
        return fn(params, batch, *args)

    def _reduce(self, grad: nnx.Variable, path: tuple) -> nnx.Variable:
        """Mean of a local gradient over the data-parallel shards: summed over the data-parallel
        axes its weight is not sharded over (expert weights live on one expert shard each;
        ZeRO-2/3 ones were reduce-scattered in backward already), over `stage` too for a weight
        shared by all pipeline stages, then divided by the number of batch shards."""
        value = grad.get_value()
        if not (self.zero >= 2 and self._zero_dims[path] is not None):
            axes = tuple(a for a in self.data_axes if a not in self._used_axes[path])
            value = jax.lax.psum(value, axes) if axes else value
        if self.pipelined and path not in self._stacked:
            value = jax.lax.psum(value, "stage")
        return grad.replace(value / self.batch_ways)

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
