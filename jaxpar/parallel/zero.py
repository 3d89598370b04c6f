"""ZeRO as a change of partition specs: shard a state leaf over the data-parallel axes.

Stage 1 applies it to optimizer state, stage 2 also to gradients, stage 3 also to
parameters. The same function serves every optax optimizer, because optimizer-state
shardings are derived leaf by leaf from `jax.eval_shape(tx.init, params)`.
"""

from __future__ import annotations

import math

from jax.sharding import PartitionSpec

from jaxpar.parallel.rules import axis_names, data_parallel_axes

# The axes the batch is split over (the rules table's 'batch'): ZeRO shards state over them.
DATA_PARALLEL_AXES = data_parallel_axes()


def zero_dim(spec: PartitionSpec, shape: tuple[int, ...], names: tuple, mesh_sizes: dict[str, int],
             over: tuple[str, ...] = DATA_PARALLEL_AXES):
    """(dimension, axes) to shard over for ZeRO, or None when no dimension can take it.

    The axes are those of `over` (the data-parallel axes, and the layout may add `context`) of size
    > 1 that the spec does not use yet; the dimension is the one with the largest local size that
    they divide, never 'layers' (so a layer's slice of a stacked weight stays spread over all devices).
    """
    entries = list(spec) + [None] * (len(shape) - len(spec))
    used = {a for e in entries for a in axis_names(e)}
    axes = tuple(a for a in over if a not in used and mesh_sizes.get(a, 1) > 1)
    if not axes:
        return None
    ways = math.prod(mesh_sizes[a] for a in axes)
    local = [shape[d] // math.prod(mesh_sizes[a] for a in axis_names(entries[d])) for d in range(len(shape))]
    for d in sorted(range(len(shape)), key=lambda d: -local[d]):
        if (d >= len(names) or names[d] != "layers") and local[d] % ways == 0:
            return d, axes
    return None


def zero_spec(spec: PartitionSpec, shape: tuple[int, ...], names: tuple, mesh_sizes: dict[str, int],
              over: tuple[str, ...] = DATA_PARALLEL_AXES) -> PartitionSpec:
    """The spec with the axes of `over` added on the dimension `zero_dim` picks."""
    found = zero_dim(spec, shape, names, mesh_sizes, over)
    if found is None:
        return spec
    d, axes = found
    entries = list(spec) + [None] * (len(shape) - len(spec))
    merged = axis_names(entries[d]) + axes
    entries[d] = merged[0] if len(merged) == 1 else merged
    return PartitionSpec(*entries)


def _filter(spec: PartitionSpec, keep) -> PartitionSpec:
    out = []
    for entry in spec:
        kept = tuple(a for a in axis_names(entry) if keep(a))
        out.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*out)


def manual_part(spec: PartitionSpec, manual: tuple[str, ...]) -> PartitionSpec:
    """Only the manual (shard_map) axes of a spec; automatic axes are left to the compiler."""
    return _filter(spec, lambda a: a in manual)


def without_axes(spec: PartitionSpec, drop: tuple[str, ...]) -> PartitionSpec:
    """The spec with the given mesh axes removed (for constraints inside shard_map)."""
    return _filter(spec, lambda a: a not in drop)
