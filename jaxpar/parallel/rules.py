"""The one table that maps logical axis names to mesh axes, and the shardings it implies.

Model code names logical axes only; this table decides the layout:
batch over data (and expert, which acts as extra data parallelism outside MoE layers),
Megatron tensor parallelism over `tensor` (MLP hidden, attention heads, vocabulary).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

# logical name -> mesh axis (or tuple of mesh axes), None = replicated.
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "expert"),
    "seq": None,
    "embed": None,
    "mlp": "tensor",
    "heads": "tensor",
    "kv": None,
    "vocab": "tensor",
    "expert": "expert",
    "layers": None,
    "pos": None,
}


def logical_to_spec(names: tuple[str | None, ...], rules: dict = RULES) -> PartitionSpec:
    """Translate logical names to a PartitionSpec; a mesh axis is used at most once."""
    used: set[str] = set()
    spec = []
    for name in names:
        target = rules.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a not in used)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def _logical_names(variable: nnx.Variable) -> tuple:
    names = variable.get_metadata().get("out_sharding") or ()
    return tuple(names) if len(names) == variable.shape.__len__() else (None,) * len(variable.shape)


def tree_shardings(tree, mesh: jax.sharding.Mesh, rules: dict = RULES):
    """NamedShardings for every leaf of a state tree (params, optimizer state, ...).

    nnx Variables use their logical metadata; any other array (step counters) is replicated.
    """

    def one(x):
        if isinstance(x, nnx.Variable):
            return x.replace(NamedSharding(mesh, logical_to_spec(_logical_names(x), rules)))
        return NamedSharding(mesh, PartitionSpec())

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def batch_sharding(mesh: jax.sharding.Mesh, rules: dict = RULES) -> NamedSharding:
    """Sharding of a (batch, seq) token array."""
    return NamedSharding(mesh, logical_to_spec(("batch", "seq"), rules))


def activation_resolver(mesh: jax.sharding.Mesh, rules: dict = RULES):
    """A function for `jaxpar.model.activation_sharding` constraining activations by this table."""

    def resolve(x: jax.Array, names: tuple) -> jax.Array:
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(names, rules)))

    return resolve
