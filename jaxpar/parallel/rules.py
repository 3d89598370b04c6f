"""The one table that maps logical axis names to mesh axes, and the shardings it implies.

Model code names logical axes only; this table decides the layout:
batch over data (and expert, which acts as extra data parallelism outside MoE layers),
Megatron tensor parallelism over `tensor` (MLP hidden, attention heads, vocabulary), and the
stacked layers split into pipeline stages over `stage`. The features adapt it to one model and
mesh (jaxpar.features.layout_rules): key/value heads are replicated when there are fewer of them
than tensor ranks, context parallelism splits the sequence over `context`, and sequence
parallelism splits the residual stream's sequence over `tensor`.
"""

from __future__ import annotations

from jax.sharding import PartitionSpec

# logical name -> mesh axis (or tuple of mesh axes), None = replicated.
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "expert"),
    "seq": None,  # inside a block: attention and the MLP see the whole sequence (but under mesh.context)
    "residual_seq": None,  # the residual stream between blocks; "tensor" under sequence parallelism
    "embed": None,
    "mlp": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",  # grouped-query attention's key/value heads
    "kv": None,
    "vocab": "tensor",
    "expert": "expert",
    "layers": "stage",
    "pos": None,
}


def axis_names(entry) -> tuple[str, ...]:
    """The mesh axes of a rules-table or PartitionSpec entry: one axis, several, or none (None)."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def data_parallel_axes(rules: dict = RULES) -> tuple[str, ...]:
    """The mesh axes the batch is split over: every device along them holds different rows."""
    return axis_names(rules.get("batch"))


def logical_to_spec(names: tuple[str | None, ...], rules: dict = RULES) -> PartitionSpec:
    """Translate logical names to a PartitionSpec; a mesh axis is used at most once."""
    used: set[str] = set()
    spec = []
    for name in names:
        axes = tuple(a for a in axis_names(rules.get(name) if name is not None else None) if a not in used)
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)
