"""`gradients`: a step differentiated on a layout (jaxpar.parallel.layout).

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

from collections.abc import Callable

import jax
from flax import nnx
from jax.sharding import PartitionSpec

from jaxpar.model.adapters import trainable
from jaxpar.model.axes import is_variable, layout_hooks, path_names
from jaxpar.parallel.hooks import ManualHooks, PartitionerHooks
from jaxpar.parallel.layout import Layout
from jaxpar.parallel.reductions import summed
from jaxpar.parallel.zero import manual_part


def gradients(layout: Layout, grad_fn: Callable, params, batch, *args):
    """(stats, grads) for the global batch; grad_fn(hooks, params, batch, *args) -> (stats, grads),
    where `hooks` expand weight shards for the model (jaxpar.parallel.hooks).

    Under shard_map grad_fn sees its local batch shard (every array of `batch` is cut on its
    rows), and stats (the loss and any other per-shard averages) and gradients come back summed
    over the data-parallel axes and divided by their size (the mean over equal shards). A frozen
    weight's gradient is None (jaxpar.model.adapters).
    Partitioned by the compiler, it sees the global batch and its means are the global ones
    already. Gradients are in the `grad_specs` layout.
    """
    grad_specs = layout.grad_specs(params)

    def per_shard(params, batch, *args):
        hooks = PartitionerHooks(layout) if not layout.manual_data else ManualHooks.for_params(layout, params)
        target = hooks.differentiated(params)
        with layout_hooks(hooks):
            stats, grads = grad_fn(hooks, target, batch, *args)
        return _shard_means(layout, stats, grads)

    if not layout.manual:  # no stages, no experts: the compiler partitions it all
        hooks = PartitionerHooks(layout)
        with layout_hooks(hooks):
            stats, grads = grad_fn(hooks, params, batch, *args)
        grads = trainable(grads)
    else:
        manual_in, manual_out = _manual_specs(layout, params)
        fn = jax.shard_map(per_shard, mesh=layout.mesh, axis_names=set(layout.manual), check_vma=False,
                           in_specs=(manual_in, PartitionSpec(layout.manual_data)) + (PartitionSpec(),) * len(args),
                           out_specs=(PartitionSpec(), manual_out))
        stats, grads = fn(params, batch, *args)
    if layout.zero.shards_gradients and not layout.manual_data:  # the shards, reduced layer by layer in backward
        grads = jax.lax.with_sharding_constraint(grads, layout.named(grad_specs))
    return stats, grads


def _manual_specs(layout: Layout, params) -> tuple:
    """The manual axes' part of the parameters' specs (shard_map's in_specs for them) and of the
    gradients' (its out_specs)."""
    is_spec = lambda x: isinstance(x, PartitionSpec)  # noqa: E731
    return tuple(jax.tree.map(lambda s: manual_part(s, layout.manual), specs, is_leaf=is_spec)
                 for specs in (layout.param_specs(params), layout.grad_specs(params)))


def _shard_means(layout: Layout, stats, grads) -> tuple:
    """Inside the shard_map: (stats, gradients) as means over the data-parallel shards (_reduce). A
    pipeline's loss is nonzero on the last stage only, hence the sum over `stage` too."""
    stats = jax.tree.map(lambda x: jax.lax.psum(x, layout.manual) / layout.manual_batch_ways, stats)
    grads = jax.tree_util.tree_map_with_path(lambda p, g: _reduce(layout, g, path_names(p)), trainable(grads),
                                             is_leaf=is_variable)
    return stats, grads


def _reduce(layout: Layout, grad: nnx.Variable, path: tuple) -> nnx.Variable:
    """Mean of a local gradient over the data-parallel shards: summed over the data-parallel
    axes its weight is not sharded over (expert weights live on one expert shard each;
    ZeRO-2/3 ones were reduce-scattered in backward already), over `stage` too for a weight
    shared by all pipeline stages, then divided by the number of batch shards."""
    plan, value = layout.weights[path], grad.get_value()
    if value is None:  # a frozen weight's
        return grad
    if layout.manual_data and not (layout.zero.shards_gradients and plan.zero_dim is not None):
        axes = tuple(a for a in layout.manual_data if a not in plan.used_axes)
        value = summed(value, axes, layout.reduce_dtype).astype(value.dtype) if axes else value
    if layout.pipelined and not plan.stacked:
        value = jax.lax.psum(value, "stage")
    return grad.replace(value / layout.manual_batch_ways)


def carry_spec(layout: Layout) -> PartitionSpec:
    """Where 2BW's in-flight values live between steps: each device's own, one leading entry per device
    of the manual axes."""
    return PartitionSpec(layout.manual)


def window_gradients(layout: Layout, grad_fn: Callable, stale, params, batches, carry, *args):
    """2BW's step on a pipeline layout (its batch axes manual): grad_fn(hooks, stale, params, batches, carry,
    *args) -> ((stats, grads) of the previous step's batch, carry) runs the step's window on each device.
    Returns the previous step's (stats, grads), reduced as `gradients` reduces them, and what stays in
    flight, each device's own (carry_spec; carry None: nothing is in flight yet)."""
    manual_in, manual_out = _manual_specs(layout, params)

    def per_shard(stale, params, batches, carry, *args):
        hooks = ManualHooks.for_params(layout, params)
        local = None if carry is None else jax.tree.map(lambda a: a[0], carry)
        with layout_hooks(hooks):
            (stats, grads), local = grad_fn(hooks, stale, params, batches, local, *args)
        return *_shard_means(layout, stats, grads), jax.tree.map(lambda a: a[None], local)

    fn = jax.shard_map(per_shard, mesh=layout.mesh, axis_names=set(layout.manual), check_vma=False,
                       in_specs=(manual_in, manual_in, PartitionSpec(layout.manual_data),
                                 carry_spec(layout)) + (PartitionSpec(),) * len(args),
                       out_specs=(PartitionSpec(), manual_out, carry_spec(layout)))
    stats, grads, carry = fn(stale, params, batches, carry, *args)
    return (stats, grads), carry
