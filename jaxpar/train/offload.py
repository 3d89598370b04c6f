"""train.offload=optimizer: the optimizer state lives in pinned host memory and comes to the device
for the update, one layer at a time where the optimizer allows it.

The update is the optimizer's chain taken apart: clipping by the global norm first (it needs
every gradient, and has no state), then the optimizer's own update in two parts:
- the stacked (per-layer) leaves, in a `lax.scan` over the layers: each iteration brings one
  layer's slice of the state into device memory, updates it and stores it back in host memory;
- the other leaves (embedding, final norm, the optimizer's step counts) brought over whole.
On the device, the update then holds the parameters and gradients, the non-stacked leaves'
state and one layer's state at a time, instead of the whole state through forward and
backward. A per-layer update is exact only for optimizers that treat each layer's slice as they
treat the stacked weight: AdamW does (elementwise), and Muon (each layer's slice is a matrix of its
own: jaxpar.train.muon); Adafactor may factor a stacked norm scale
(layers x d_model) that it would not factor per layer, so `layerwise` checks the state shapes and
otherwise the state comes over whole.
"""

from __future__ import annotations

import dataclasses

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from jaxpar.model.axes import is_stacked, is_variable
from jaxpar.train.loss_scale import unless_skipped

STACKED, REST, SHARED = "stacked", "rest", "shared"



def _kinds(tree):
    """Per leaf: STACKED (a per-layer weight or its state), REST (another weight's), SHARED (a plain
    array of the optimizer, such as its step count: needed by both parts)."""
    return jax.tree.map(lambda x: (STACKED if is_stacked(x) else REST) if is_variable(x) else SHARED, tree,
                        is_leaf=is_variable)


def _part(tree, kinds, wanted: tuple):
    """The leaves of `tree` whose kind is in `wanted`, the others None (optax skips None leaves)."""
    return jax.tree.map(lambda x, k: x if k in wanted else None, tree, kinds,
                        is_leaf=lambda x: x is None or is_variable(x) or isinstance(x, PartitionSpec))


def _merge(a, b):
    """Leaves from `a` where it has them, else from `b` (two parts of one tree)."""
    return jax.tree.map(lambda x, y: y if x is None else x, a, b, is_leaf=lambda x: x is None or is_variable(x))


def layerwise(update: optax.GradientTransformation, abstract_params) -> bool:
    """Whether `update`'s state for one layer's slice has the shapes of the stacked state's slices."""
    def stacked_part(tree):
        return _part(tree, _kinds(tree), (STACKED,))

    def one_layer(tree):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), tree)

    whole = stacked_part(jax.eval_shape(update.init, abstract_params))
    per_layer = jax.eval_shape(update.init, one_layer(stacked_part(abstract_params)))
    shapes = lambda tree: [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]  # noqa: E731
    return shapes(_part(per_layer, _kinds(per_layer), (STACKED, REST))) == shapes(one_layer(whole))


def _mover(mesh, specs, kinds):
    """move(part, wanted, memory_kind, layer=False): the part of the state holding the kinds `wanted`
    (or one layer's slices of its stacked leaves) into `memory_kind`, in its sharding."""

    def move(part, wanted: tuple, memory_kind: str, layer: bool = False):
        where = jax.tree.map(lambda s: NamedSharding(mesh, PartitionSpec(*s[1:]) if layer else s,
                                                     memory_kind=memory_kind),
                             specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
        return jax.device_put(part, _part(where, kinds, wanted))

    return move


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where the offloaded optimizer state lives: the mesh and the partition specs of the optimizer's
    own update state (the second item of the chain's state)."""

    mesh: jax.sharding.Mesh
    specs: object


def offloaded_update(optimizer, grads, opt_state, params, placement: Placement, finite=None):
    """(updates, new optimizer state in pinned host memory) for `optimizer` (jaxpar.train.optim: the
    chain clip_by_global_norm(clip_norm) -> update, by layer or whole), whose state `opt_state` is in
    host memory. Where `finite` is False the old state is stored back (a skipped step), chosen on
    the device."""
    update, clip_norm, by_layer = optimizer.update, optimizer.clip_norm, optimizer.by_layer
    mesh, specs = placement.mesh, placement.specs
    clip_state, state = opt_state
    grads, clip_state = optax.clip_by_global_norm(clip_norm).update(grads, clip_state)
    kinds, param_kinds = _kinds(state), _kinds(params)
    move = _mover(mesh, specs, kinds)
    if not by_layer:
        everything = (STACKED, REST, SHARED)
        old = move(state, everything, "device")
        updates, new = update.update(grads, old, params)
        return updates, (clip_state, move(unless_skipped(finite, new, old), everything, "pinned_host"))
    rest = move(_part(state, kinds, (REST, SHARED)), (REST, SHARED), "device")
    rest_updates, new_rest = update.update(_part(grads, param_kinds, (REST,)), rest,
                                           _part(params, param_kinds, (REST,)))
    new_rest = unless_skipped(finite, _part(new_rest, kinds, (REST, SHARED)), rest)

    def one_layer(_, layer):
        layer_grads, layer_params, layer_state = layer
        old = move(layer_state, (STACKED,), "device", layer=True)
        layer_updates, new = update.update(layer_grads, _merge(old, _part(rest, kinds, (SHARED,))), layer_params)
        new = unless_skipped(finite, _part(new, kinds, (STACKED,)), old)
        return None, (layer_updates, move(new, (STACKED,), "pinned_host", layer=True))

    stacked = lambda tree, k: _part(tree, k, (STACKED,))  # noqa: E731
    _, (stacked_updates, new_stacked) = jax.lax.scan(
        one_layer, None, (stacked(grads, param_kinds), stacked(params, param_kinds), stacked(state, kinds)))
    new_rest = move(new_rest, (REST, SHARED), "pinned_host")
    return _merge(stacked_updates, rest_updates), (clip_state, _merge(new_stacked, new_rest))


def update_peak_bytes(abstract_opt_state, shardings, by_layer: bool) -> int:
    """Bytes of optimizer state one device holds in device memory at once during an offloaded
    update: all of it when the update is not by layer, else the non-stacked part and one layer."""
    def nbytes(leaf, sharding, per_layer: bool):
        shape = sharding.shard_shape(leaf.shape)
        count = 1
        for size in shape[1:] if per_layer else shape:
            count *= size
        return count * leaf.dtype.itemsize

    _, state = abstract_opt_state
    kinds = jax.tree.leaves(_kinds(state))
    leaves, where = jax.tree.leaves(state), jax.tree.leaves(shardings[1])
    return sum(nbytes(leaf, s, by_layer and kind == STACKED) for leaf, s, kind in zip(leaves, where, kinds))
