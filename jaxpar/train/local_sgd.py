"""Local SGD in the DiLoCo style (parallel.sync_every = H > 1).

Each data-parallel replica is a real slice of the state: every parameter, optimizer-state and
loss-scale leaf has a leading replica dimension R (the size of mesh.data) sharded over `data`.
The step is the synchronous single-replica step mapped over that dimension
(`jax.vmap(..., spmd_axis_name="data")`): each replica differentiates its own rows and updates
its own weights and optimizer state, and no gradient crosses `data` (tensor parallelism inside
a replica works as usual). After every H-th step the replicas synchronize (a `lax.cond`, so the
all-reduce over `data` runs on those steps only):

- `avg`: every replica takes the mean of the replicas' weights;
- `nesterov`: the outer gradient is the anchor (the weights after the last synchronization)
  minus that mean; an outer Nesterov step of outer_lr with outer_momentum on it gives the new
  anchor, which every replica takes. outer_lr=1 with outer_momentum=0 is `avg`.

The replicas keep their own optimizer states, as in DiLoCo. The step reports every metric
averaged over the replicas, and on synchronizing steps `replica_spread`: the root-mean-square
distance of the replicas' weights from their mean, relative to the mean's norm, just before
they are synchronized.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxpar.config import Config, ParallelConfig

REPLICA_AXIS = "data"


def replica_rules(rules: dict) -> dict:
    """The rules table inside one replica: its rows are not split further (the replica dimension
    takes `data`)."""
    return {**rules, "batch": None}


def per_replica(specs):
    """Specs of a replica's state -> specs of the replica-stacked state (leading dimension over data)."""
    return jax.tree.map(lambda s: PartitionSpec(REPLICA_AXIS, *s), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def stacked(tree, replicas: int):
    """R identical copies of every leaf, on a new leading dimension."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (replicas, *x.shape)), tree)


def replica_mean(params_R):
    """The mean of the replicas' weights (an all-reduce over data)."""
    return jax.tree.map(lambda p: p.mean(0), params_R)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OuterState:
    """parallel.outer=nesterov: the weights after the last synchronization and the outer momentum."""

    anchor: object
    momentum: object

    @staticmethod
    def initial(params) -> OuterState:
        return OuterState(params, jax.tree.map(jnp.zeros_like, params))


def _spread(params_R, mean) -> jax.Array:
    replicas = jax.tree.leaves(params_R)[0].shape[0]
    squares = sum(jnp.sum(jnp.square(p - m)) for p, m in zip(jax.tree.leaves(params_R), jax.tree.leaves(mean)))
    norm = sum(jnp.sum(jnp.square(m)) for m in jax.tree.leaves(mean))
    return jnp.sqrt(squares / replicas) / jnp.maximum(jnp.sqrt(norm), 1e-30)


def synchronize(params_R, outer: OuterState | None, p: ParallelConfig):
    """(the replicas' new weights, the new outer state, the spread before synchronizing)."""
    replicas = jax.tree.leaves(params_R)[0].shape[0]
    mean = replica_mean(params_R)
    spread = _spread(params_R, mean)
    if p.outer == "avg":
        return stacked(mean, replicas), outer, spread
    outer_grad = jax.tree.map(jnp.subtract, outer.anchor, mean)
    momentum = jax.tree.map(lambda m, g: p.outer_momentum * m + g, outer.momentum, outer_grad)
    anchor = jax.tree.map(lambda a, g, m: a - p.outer_lr * (g + p.outer_momentum * m), outer.anchor, outer_grad,
                          momentum)
    return stacked(anchor, replicas), OuterState(anchor, momentum), spread


def make_local_step(replica_step, p: ParallelConfig, replicas: int):
    """The local-SGD step from one replica's synchronous step (state, tokens) -> (state, metrics)."""

    def local_step(state, tokens_BT):
        # device r of `data` holds rows r * B/R ... (r + 1) * B/R - 1: replica r's rows
        tokens_RbT = jax.tree.map(lambda x: x.reshape(replicas, -1, *x.shape[1:]), tokens_BT)  # packed rows too
        inner = dataclasses.replace(state, outer=None)
        new, metrics_R = jax.vmap(replica_step, spmd_axis_name=REPLICA_AXIS)(inner, tokens_RbT)
        synced = new.step[0] % p.sync_every == 0
        params, outer, spread = jax.lax.cond(
            synced, lambda: synchronize(new.params, state.outer, p),
            lambda: (new.params, state.outer, jnp.zeros((), jnp.float32)))
        metrics = {k: jnp.mean(v.astype(jnp.float32), axis=0) for k, v in metrics_R.items()}
        metrics.update(replica_spread=spread, synced=synced)
        return dataclasses.replace(new, params=params, outer=outer), metrics

    return local_step


class Synchronous:
    """Every data-parallel rank takes every step together: the training strategy that changes
    nothing about the state plan or the step."""

    replicas = 0

    def state_layout(self, layout, relayout):
        return layout

    def specs(self, specs):
        return specs

    def initial(self, state):
        return state

    def step(self, step):
        return step

    def weights(self, params):
        return params


class LocalSGD:
    """Local SGD as a transformation of the state plan and the step: each of R replicas (mesh.data)
    keeps its own weights and optimizer state on a leading replica dimension over data, laid out
    inside a replica by the rules table without the batch's data split; the synchronous step is
    mapped over the replicas and they synchronize every H steps. Evaluation and samples use the
    replicas' mean (identical right after a synchronization)."""

    def __init__(self, p: ParallelConfig, replicas: int):
        self.p, self.replicas = p, replicas

    def state_layout(self, layout, relayout):
        """relayout(rules) -> Layout: the layout of one replica's state (rows not split; ZeRO-0 and fp32
        reductions, since local SGD takes neither switch: jaxpar.features.not_with_local_sgd)."""
        return relayout(replica_rules(dict(layout.rules)))

    def specs(self, specs):
        outer = OuterState(specs.params, specs.params) if self.p.outer == "nesterov" else None
        return dataclasses.replace(per_replica(specs), outer=outer)

    def initial(self, state):
        outer = OuterState.initial(state.params) if self.p.outer == "nesterov" else None
        return dataclasses.replace(stacked(state, self.replicas), outer=outer)

    def step(self, step):
        return make_local_step(step, self.p, self.replicas)

    def weights(self, params):
        return replica_mean(params)


def strategy(cfg: Config, sizes: dict[str, int]) -> Synchronous | LocalSGD:
    """Local SGD when parallel.sync_every > 1 (validated: mesh.data > 1), else synchronous."""
    return LocalSGD(cfg.parallel, sizes["data"]) if cfg.parallel.sync_every > 1 else Synchronous()
