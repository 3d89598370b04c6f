"""A parallel layout: one frozen plan of where every part of the training state lives, built
from the mesh, the rules table, the ZeRO stage and the abstract parameters before anything is
traced; and `gradients`, which differentiates a step on that layout.

Data, tensor and ZeRO parallelism are left to XLA's SPMD partitioner: the loss is
differentiated on the global batch, activations carry sharding constraints, and ZeRO-2/3
constrain each layer's weight (3: an all-gather in the compute dtype) and its gradient (2 and
3: summed in fp32 onto the shard) inside the layer scan, so gradients are reduced layer by
layer during backward (jaxpar.parallel.hooks).

`jax.shard_map` appears only where collectives are written by hand. A pipeline is manual
over `stage` (the executors ppermute between stages) and automatic over the rest. With
`mesh.expert` > 1 the batch axes are manual too, for the expert all-to-all: each shard
differentiates its slice of the batch, and gradients are summed with `psum` over the
data-parallel axes their weight is not sharded on (ZeRO 0-1) or reduce-scattered layer by
layer by custom VJPs (ZeRO 2-3).
"""
from __future__ import annotations

import dataclasses
import math
import types
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.model import constrain, layout_hooks
from jaxpar.model.axes import is_stacked, logical_names, path_names
from jaxpar.parallel.hooks import ManualHooks, PartitionerHooks
from jaxpar.parallel.reductions import summed
from jaxpar.parallel.rules import RULES, data_parallel_axes, logical_to_spec
from jaxpar.parallel.zero import manual_part, zero_dim, zero_spec


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


@dataclasses.dataclass(frozen=True)
class WeightPlan:
    """Where one parameter lives: its logical names, rules-table spec, the spec with ZeRO's
    data-parallel sharding added, the (dimension, axes) ZeRO shards it over (None when no
    dimension can take it), whether it is stacked over layers, and the mesh axes its spec uses."""

    names: tuple
    spec: PartitionSpec
    zero_spec: PartitionSpec
    zero_dim: tuple | None
    stacked: bool
    used_axes: frozenset


@dataclasses.dataclass(frozen=True)
class Layout:
    """The plan of one mesh, rules table and ZeRO stage for one model's parameters.

    weights: every parameter's WeightPlan by path; layer_weights_at: the path of the module
    whose stacked state the layer scan runs over (a layer's weights are found below it).
    """

    mesh: jax.sharding.Mesh
    zero: int
    rules: Mapping
    compute_dtype: object  # ZeRO-3 gathers weights in it
    sizes: Mapping[str, int]
    data_axes: tuple[str, ...]  # the data-parallel axes of size > 1
    batch_ways: int  # how many slices the batch is cut into
    manual_data: tuple[str, ...]  # the batch axes a shard_map makes manual (none when partitioned)
    manual: tuple[str, ...]  # every manual axis: manual_data, and `stage` for a pipeline
    traced_batch_shards: int  # batch shards the traced loss sees: 1 under manual batch axes, else all
    weights: Mapping[tuple, WeightPlan]
    layer_weights_at: tuple[str, ...]
    reduce_dtype: object  # the payload of the data-parallel gradient reductions (parallel.grad_reduce_dtype)

    @classmethod
    def build(cls, mesh: jax.sharding.Mesh, abstract_params, layer_weights_at: tuple[str, ...] = ("blocks",),
              zero: int = 0, compute_dtype=jnp.float32, rules: Mapping = RULES,
              reduce_dtype=jnp.float32) -> Layout:
        sizes = dict(mesh.shape)
        data_axes = tuple(a for a in data_parallel_axes(rules) if sizes.get(a, 1) > 1)
        pipelined = sizes.get("stage", 1) > 1
        # shard_map only where the step needs collectives written by hand; data, ZeRO and tensor
        # parallelism are left to XLA's SPMD partitioner as sharding constraints (the same step
        # ran 1.4-1.7x faster that way than written per shard under shard_map on emulated CPU
        # devices: benchmarks/RESULTS.md, "Where the time went"). The batch axes are manual for
        # the expert all-to-all. A pipeline is manual over `stage` and leaves the batch axes to
        # the partitioner, except with tensor > 1: there XLA's partitioner aborts on the
        # embedding gather when `data` and `tensor` are both automatic under a manual `stage`
        # (a failed check in ExpandDeviceGroups, jax 0.12.0.1), so the batch axes stay manual.
        # Only axes of size > 1 are made manual: XLA's SPMD partitioner rejects the tensor
        # all-reduces of a shard_map that is manual over size-1 axes only. Gradients reduced in
        # another dtype than fp32 are reduced by hand too: the partitioner reduces each weight
        # gradient in the dtype its matmul produced it in.
        manual_batch = (sizes.get("expert", 1) > 1 or (pipelined and sizes.get("tensor", 1) > 1)
                        or jnp.dtype(reduce_dtype) != jnp.float32)
        manual_data = data_axes if manual_batch else ()
        batch_ways = math.prod(sizes[a] for a in data_axes)
        weights = {}
        for path, v in jax.tree_util.tree_flatten_with_path(abstract_params, is_leaf=_is_var)[0]:
            shape = v.get_value().shape
            names = logical_names(v, len(shape))
            spec = logical_to_spec(names, rules)
            weights[path_names(path)] = WeightPlan(
                names, spec, zero_spec(spec, shape, names, sizes), zero_dim(spec, shape, names, sizes), is_stacked(v),
                frozenset(a for e in spec for a in ((e,) if isinstance(e, str) else e or ())))
        return cls(mesh, zero, types.MappingProxyType(dict(rules)), compute_dtype, types.MappingProxyType(sizes),
                   data_axes, batch_ways, manual_data, manual_data + (("stage",) if pipelined else ()),
                   1 if manual_data else batch_ways, types.MappingProxyType(weights), tuple(layer_weights_at),
                   reduce_dtype)

    @property
    def sequence_parallel(self) -> bool:
        """Whether the residual stream is split along the sequence over a tensor axis of size > 1."""
        return self.rules.get("residual_seq") == "tensor" and self.sizes.get("tensor", 1) > 1

    @property
    def pipelined(self) -> bool:
        return self.sizes.get("stage", 1) > 1

    @property
    def manual_batch_ways(self) -> int:
        """What per-shard means are averaged over: the manual batch shards (1 when partitioned)."""
        return self.batch_ways // self.traced_batch_shards

    # ---- partition specs -------------------------------------------------------------
    def spec(self, names: tuple, shape: tuple, zero: bool) -> PartitionSpec:
        """The rules-table spec of a leaf, with ZeRO sharding added when `zero`."""
        spec = logical_to_spec(names, self.rules)
        return zero_spec(spec, shape, names, self.sizes) if zero else spec

    def _specs(self, tree, zero: bool):
        def one(x):
            if _is_var(x):
                shape = x.get_value().shape
                return x.replace(self.spec(logical_names(x, len(shape)), shape, zero))
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

    def named(self, specs, memory_kind: str | None = None):
        """PartitionSpecs -> NamedShardings on this mesh (in `memory_kind`: 'device', 'pinned_host';
        None: the default)."""
        return jax.tree.map(lambda s: NamedSharding(self.mesh, s, memory_kind=memory_kind), specs,
                            is_leaf=lambda x: isinstance(x, PartitionSpec))

    def batch_sharding(self) -> NamedSharding:
        """Sharding of a (batch, ...) array: rows over the data-parallel axes."""
        return NamedSharding(self.mesh, logical_to_spec(("batch",), self.rules))

    def split_microbatches(self, batch, count: int):
        """Arrays (B, ...) -> (count, B / count, ...). Microbatch i is the i-th block of consecutive
        rows of every batch shard the trace sees, so each microbatch stays spread over all devices,
        and MoE routing groups (consecutive tokens) hold the same tokens as without splitting."""
        shards = self.traced_batch_shards

        def one(a):
            B, rest = a.shape[0], a.shape[1:]
            micro = a.reshape(shards, count, B // (shards * count), *rest).swapaxes(0, 1)
            return constrain(micro.reshape(count, B // count, *rest), (None, "batch") + (None,) * len(rest))

        return jax.tree.map(one, batch)

    def stacked_mask(self, params):
        """A tree of bools: True for stacked (per-layer) weights, which pipeline stages split."""
        return jax.tree.map(lambda v: v.replace(is_stacked(v)), params, is_leaf=_is_var)

    def eval_hooks(self) -> PartitionerHooks:
        """Hooks for code traced outside shard_map with the stored weights (evaluation)."""
        return PartitionerHooks(self, in_step=False)


def gradients(layout: Layout, grad_fn: Callable, params, batch, *args):
    """(stats, grads) for the global batch; grad_fn(hooks, params, batch, *args) -> (stats, grads),
    where `hooks` expand weight shards for the model (jaxpar.parallel.hooks).

    Under shard_map grad_fn sees its local batch shard (every array of `batch` is cut on its
    rows), and stats (the loss and any other per-shard averages) and gradients come back summed
    over the data-parallel axes and divided by their size (the mean over equal shards).
    Partitioned by the compiler, it sees the global batch and its means are the global ones
    already. Gradients are in the `grad_specs` layout.
    """
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    grad_specs = layout.grad_specs(params)

    def per_shard(params, batch, *args):
        hooks = PartitionerHooks(layout) if not layout.manual_data else ManualHooks.for_params(layout, params)
        target = hooks.differentiated(params)
        with layout_hooks(hooks):
            stats, grads = grad_fn(hooks, target, batch, *args)
        # (a pipeline's loss is nonzero on the last stage only, hence the sum over `stage` too)
        stats = jax.tree.map(lambda x: jax.lax.psum(x, layout.manual) / layout.manual_batch_ways, stats)
        grads = jax.tree_util.tree_map_with_path(lambda p, g: _reduce(layout, g, path_names(p)), grads,
                                                 is_leaf=_is_var)
        return stats, grads

    if not layout.manual:  # no stages, no experts: the compiler partitions it all
        hooks = PartitionerHooks(layout)
        with layout_hooks(hooks):
            stats, grads = grad_fn(hooks, params, batch, *args)
    else:
        manual_in = jax.tree.map(lambda s: manual_part(s, layout.manual), layout.param_specs(params), is_leaf=is_spec)
        manual_out = jax.tree.map(lambda s: manual_part(s, layout.manual), grad_specs, is_leaf=is_spec)
        fn = jax.shard_map(per_shard, mesh=layout.mesh, axis_names=set(layout.manual), check_vma=False,
                           in_specs=(manual_in, PartitionSpec(layout.manual_data)) + (PartitionSpec(),) * len(args),
                           out_specs=(PartitionSpec(), manual_out))
        stats, grads = fn(params, batch, *args)
    if layout.zero >= 2 and not layout.manual_data:  # the shards, reduced layer by layer in backward
        grads = jax.lax.with_sharding_constraint(grads, layout.named(grad_specs))
    return stats, grads


def _reduce(layout: Layout, grad: nnx.Variable, path: tuple) -> nnx.Variable:
    """Mean of a local gradient over the data-parallel shards: summed over the data-parallel
    axes its weight is not sharded over (expert weights live on one expert shard each;
    ZeRO-2/3 ones were reduce-scattered in backward already), over `stage` too for a weight
    shared by all pipeline stages, then divided by the number of batch shards."""
    plan, value = layout.weights[path], grad.get_value()
    if layout.manual_data and not (layout.zero >= 2 and plan.zero_dim is not None):
        axes = tuple(a for a in layout.manual_data if a not in plan.used_axes)
        value = summed(value, axes, layout.reduce_dtype).astype(value.dtype) if axes else value
    if layout.pipelined and not plan.stacked:
        value = jax.lax.psum(value, "stage")
    return grad.replace(value / layout.manual_batch_ways)
