"""What a mixture of experts adds to the train step, behind one object: each row's PRNG key (its
routing noise; the adapters' dropout draws from it too) and routing trace, the auxiliary losses and
routing statistics of the objective, the router biases' own update (bias balancing), and the step's
routing metrics. A dense model's ExpertTerms adds
nothing, so the step reads the same for both.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpar.config.moe import MoEConfig
from jaxpar.model.routing_trace import RoutingTrace


@dataclasses.dataclass(frozen=True)
class ExpertTerms:
    """moe: the model's MoE section; seed: train.seed (the rows' keys'); traced_units: the MoE layers
    whose decisions the step records (verify; 0: none); traced_batches: how many traced batches
    make the step (batch shards under manual collectives x microbatches), by which per-batch counts
    scale to the step; keyed_rows: whether the rows need keys beyond routing noise (model.lora.dropout)."""

    moe: MoEConfig
    seed: int
    traced_units: int
    traced_batches: int
    keyed_rows: bool = False
    moe_per_unit: int = 1  # MoE blocks per scanned unit (model.unit_blocks / moe.every)

    @classmethod
    def build(cls, moe: MoEConfig, seed: int, n_layers: int, traced_batches: int, trace_routing: bool,
              keyed_rows: bool = False, moe_per_unit: int = 1) -> ExpertTerms:
        traced_units = (n_layers - moe.first_dense) // moe.every if trace_routing and moe.experts else 0
        return cls(moe, seed, traced_units, traced_batches, keyed_rows, max(moe_per_unit, 1))

    def routing_stats(self, sums: dict, units: int) -> dict:
        """routing_stats over `units` (stacked unit, microbatch) pairs, each unit's sums over its MoE blocks."""
        return routing_stats(sums, units * self.moe_per_unit)

    def row_inputs(self, step: jax.Array, rows: int, replay_BULE: jax.Array | None):
        """(a PRNG key per row for routing noise and the adapters' dropout, or None; the routing trace, or
        None). The keys fold in the step and the row's index, so they do not depend on which device or
        microbatch holds the row."""
        noise_B = None
        if self.keyed_rows or (self.moe.experts and self.moe.noise and self.moe.chooses_top_k):
            step_key = jax.random.fold_in(jax.random.PRNGKey(self.seed), step)  # the same on every layout
            noise_B = row_keys(step_key, rows)
        if self.traced_units == 0:
            return noise_B, None
        return noise_B, RoutingTrace(jnp.eye(rows, dtype=jnp.float32), replay_BULE, units=self.traced_units)

    def objective_terms(self, routing: dict) -> tuple[jax.Array, dict]:
        """(the auxiliary losses to add to the objective, each routing statistic summed over the layers)
        from run_blocks' per-layer statistics; (0, {}) for a dense model."""
        if not routing:
            return jnp.zeros((), jnp.float32), {}
        sums = {k: jnp.sum(v, axis=0) for k, v in routing.items()}
        terms = self.moe.aux_weight * sums["aux"] + self.moe.z_loss_weight * sums["z"]
        return (terms + sums["bias_term"] if "bias_term" in sums else terms), sums

    def hold_bias(self, grads):
        """(the gradients the optimizer sees, the ones held back for the biases' own rule): under bias
        balancing the router biases move by their own rule and the optimizer sees zero for them."""
        if self.moe.balance != "bias" or not self.moe.experts:
            return grads, None
        return jax.tree_util.tree_map_with_path(lambda p, g: jnp.zeros_like(g) if _is_bias(p) else g, grads), grads

    def move_bias(self, params, held):
        """The parameters with each router bias moved by bias_rate toward equal load: down where the
        load was above the mean, its held gradient's sign (jaxpar.model.moe.bias_balance_term)."""
        if held is None:
            return params
        return jax.tree_util.tree_map_with_path(
            lambda p, w, g: w - self.moe.bias_rate * jnp.sign(g) if _is_bias(p) else w, params, held)

    def step_metrics(self, stats: dict) -> dict:
        """The step's routing metrics: the expert token counts, their spread across experts and the
        traced decisions, from per traced batch to the whole batch."""
        metrics = {k: v * self.traced_batches for k, v in stats.items() if k.startswith("moe_routing_")}
        if "moe_expert_tokens" in stats:
            counts = stats["moe_expert_tokens"] * self.traced_batches
            metrics.update(moe_expert_tokens=counts,
                           moe_load_cv=jnp.std(counts) / jnp.maximum(jnp.mean(counts), 1e-9))
        return metrics


def routing_stats(sums: dict, count: int) -> dict:
    """The reported MoE statistics: routing sums over `count` (layer, microbatch) pairs, averaged."""
    if not sums:
        return {}
    mean = {k: v / count for k, v in sums.items()}
    stats = {"moe_aux_loss": mean["aux"], "moe_z_loss": mean["z"], "moe_unrouted_fraction": mean["unrouted"],
             "moe_expert_tokens": mean["expert_tokens"], "moe_max_load": mean["max_load"]}
    if "dropped" in mean:  # routers with a capacity to overflow (not Expert Choice)
        stats["moe_dropped_fraction"] = mean["dropped"]
    # traced token by token (verify): the decisions' codes, and replayed, the flips and their margins
    stats.update({f"moe_{k}": v for k, v in mean.items() if k.startswith("routing_")})
    return stats


def row_keys(key: jax.Array, rows: int) -> jax.Array:
    """One PRNG key per batch row (the row's index folded in): per-row randomness that does not
    depend on which device or microbatch holds the row."""
    return jax.vmap(lambda r: jax.random.fold_in(key, r))(jnp.arange(rows))


def _is_bias(path) -> bool:
    """A router bias of bias balancing (DeepSeek-V3)."""
    return "router_bias" in jax.tree_util.keystr(path)
