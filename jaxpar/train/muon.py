"""train.optimizer=muon: optax's Muon (Newton-Schulz orthogonalised Nesterov momentum,
`optax.contrib.muon`) for the hidden matrices, and train.optimizer=adamw's update for the rest
(embeddings, output head, norm scales, biases, attention sinks).

A weight is a matrix by its role, looked up by its name in ROLES and checked against its logical
names: which axes a layer contracts with its input (the reduction axes, the matrix's rows) and
which it produces (the output axes, its columns). Every other axis is a batch axis that Muon maps
over, each slice orthogonalised apart as if it were a weight of its own: the stacked layers
('layers', which pipeline stages split), the routed experts ('expert'), and the projections a
fused weight holds side by side (Q, K and V in w_qkv; gate and up in w_gate_up). The embedding
(a lookup table) and the head (a classifier over the vocabulary) stay with AdamW, as in Moonlight, and so
do a mixture of experts' router and noise scales (D x E, a classifier over the experts; Marin's MoE recipes keep
them with AdamW too). With softmax scores every token's logit gradient sums to zero over the experts, so the
router's gradient has rank E - 1 at most, and Newton-Schulz, which brings every singular value towards one, gives
the missing direction, made of rounding, a whole step of its own: measured in bf16 (benchmarks/verify_sweep.py,
draws 25, 55, 79, 84: 4 experts, 3 steps), the router's update differed from fp32's by 0.17-0.26 of itself, and
on draw 84 by 0.019 once that direction (the same shift of every expert's logit) is taken out.

The learning rate: optax's consistent_rms=0.2 (Moonlight, Liu et al. 2025) scales each
orthogonalised update by 0.2 sqrt(max(fan_in, fan_out)), about AdamW's update RMS, so Muon follows
train.lr and its schedule, as the AdamW part does. Weight decay (train.weight_decay, decoupled and
scaled by the learning rate, as AdamW's) applies to every Muon matrix.

optax.contrib.muon's own Adam part would be Nesterov Adam with unmasked weight decay (it would decay
the norm scales too), so Muon's weights are partitioned off first and it sees only matrices.
"""

from __future__ import annotations

import dataclasses

import jax
import optax
from flax import nnx
from optax.contrib import MuonDimensionNumbers

from jaxpar.config import ConfigError, TrainConfig
from jaxpar.model.axes import holds_array, is_variable, path_names, weight_names

# axes that stack weights of their own: the layers (pipeline stages split this axis) and the routed experts
BATCH_AXES = ("layers", "expert")
MUON_BETA, NS_STEPS, CONSISTENT_RMS = 0.95, 5, 0.2


@dataclasses.dataclass(frozen=True)
class Role:
    """A matrix as one layer (and one expert) uses it: its logical names, and which positions among them
    are the matrix's rows (reduction) and columns (output); the others are batch axes."""

    names: tuple
    reduction: tuple[int, ...]
    output: tuple[int, ...]

    def dimension_numbers(self) -> MuonDimensionNumbers:
        """Counted from the last axis, so that the leading batch axes (layers, experts) may be there or not."""
        n = len(self.names)
        return MuonDimensionNumbers(tuple(p - n for p in self.reduction), tuple(p - n for p in self.output))


ROLES = {
    "w_qkv": Role(("embed", None, "heads", "kv"), (0,), (2, 3)),  # Q, K and V, each D x (H K)
    "w_q": Role(("embed", "heads", "kv"), (0,), (1, 2)),  # grouped-query attention's and MLA's queries
    "w_kv": Role(("embed", None, "kv_heads", "kv"), (0,), (2, 3)),  # K and V, each D x (G K)
    "wo": Role(("heads", "kv", "embed"), (0, 1), (2,)),  # (H K) x D
    "w_up": Role(("embed", "mlp"), (0,), (1,)),
    "w_gate_up": Role(("embed", None, "mlp"), (0,), (2,)),  # gate and up, each D x F
    "w_down": Role(("mlp", "embed"), (0,), (1,)),
    "w_q_down": Role(("embed", None), (0,), (1,)),  # MLA: D x the query latent
    "w_kv_down": Role(("embed", None), (0,), (1,)),  # MLA: D x (the key/value latent and the shared rotated key)
    "w_q_up": Role((None, "heads", "kv"), (0,), (1, 2)),  # MLA: the query latent x (H K)
    "w_kv_up": Role((None, "heads", "kv"), (0,), (1, 2)),  # MLA: the latent x (H (nope + v))
    "w_proj": Role((None, "embed", "mlp"), (0, 1), (2,)),  # MTP: (embedding, hidden state) 2 D x D
}


def role_of(path: tuple[str, ...], weight: nnx.Variable) -> Role | None:
    """The weight's role when it is a matrix Muon knows: its name in ROLES, its logical names the
    role's after batch axes only (a weight of another shape under the same name is not taken)."""
    role, value = ROLES.get(path[-1]), weight.get_value()
    if role is None or not holds_array(weight) or value.ndim < len(role.names):
        return None
    names = weight_names(weight, value.ndim)
    lead, rest = names[:len(names) - len(role.names)], names[len(names) - len(role.names):]
    return role if rest == role.names and all(name in BATCH_AXES for name in lead) else None


def _choices(t: TrainConfig) -> tuple[str, ...] | None:
    """train.muon_weights as path suffixes; None for 'all'."""
    entries = tuple(e.strip() for e in t.muon_weights.split(",") if e.strip())
    return None if entries == ("all",) else entries


def _matches(path: tuple[str, ...], entry: str) -> bool:
    return "/".join(path) == entry or "/".join(path).endswith("/" + entry)


def _takes(choices, path: tuple[str, ...], weight) -> bool:
    return role_of(path, weight) is not None and (choices is None or any(_matches(path, e) for e in choices))


def _map_weights(fn, tree):
    """fn(path names, variable) on every weight of `tree` (params, updates, or a part of them where
    others are None), as a tree of the same structure."""
    return jax.tree_util.tree_map_with_path(
        lambda path, v: v.replace(fn(path_names(path), v)) if is_variable(v) else v, tree,
        is_leaf=lambda x: x is None or is_variable(x))


def check_muon_weights(t: TrainConfig, abstract_params) -> None:
    """ConfigError (before anything is compiled) when train.muon_weights names a weight Muon cannot
    treat as a matrix, or no weight at all, or when the model has no matrix Muon knows."""
    weights = {path_names(p): v for p, v in jax.tree_util.tree_leaves_with_path(abstract_params, is_leaf=is_variable)
               if is_variable(v) and holds_array(v)}
    matrices = [path for path, v in weights.items() if role_of(path, v) is not None]
    if not matrices:
        raise ConfigError("train.optimizer=muon found no weight it knows as a matrix in this model "
                          f"(it takes weights named {', '.join(ROLES)}); use train.optimizer=adamw.")
    for entry in _choices(t) or ():
        named = [path for path in weights if _matches(path, entry)]
        if not named:
            raise ConfigError(f"train.muon_weights names {entry!r}, which is no weight of this model; its matrices "
                              f"are {', '.join(sorted({'/'.join(p[-2:]) for p in matrices}))}.")
        for path in named:
            if role_of(path, weights[path]) is None:
                raise ConfigError(
                    f"train.muon_weights names {'/'.join(path)} of shape {tuple(weights[path].get_value().shape)}, "
                    f"which Muon cannot treat as a matrix: it takes the hidden matrices "
                    f"({', '.join(sorted({p[-1] for p in matrices}))}) and leaves embeddings, the output head, "
                    "norm scales and biases to AdamW.")


def dimension_numbers(t: TrainConfig):
    """tree -> the tree of each weight's MuonDimensionNumbers, None where AdamW takes it."""
    choices = _choices(t)

    def numbers(path, weight):
        return role_of(path, weight).dimension_numbers() if _takes(choices, path, weight) else None

    return lambda tree: _map_weights(numbers, tree)


def muon_update(t: TrainConfig, schedule: optax.Schedule, adamw: optax.GradientTransformation):
    """Muon on the matrices train.muon_weights picks, `adamw` on everything else."""
    choices = _choices(t)
    labels = lambda tree: _map_weights(lambda path, w: "muon" if _takes(choices, path, w) else "adam", tree)  # noqa: E731
    muon = optax.contrib.muon(schedule, beta=MUON_BETA, ns_steps=NS_STEPS, weight_decay=t.weight_decay,
                              nesterov=True, consistent_rms=CONSISTENT_RMS,
                              muon_weight_dimension_numbers=dimension_numbers(t))
    return optax.partition({"muon": muon, "adam": adamw}, labels)
