"""Dropless experts: every token's k assignments computed, none dropped and no capacity padded.

The assignments are sorted by expert, each expert's contiguous rows go through its weights with
one grouped matmul (`jax.lax.ragged_dot`), and the results are put back in token order and
weighted by the gates. Under expert parallelism every device sees the tokens of all `expert`
shards (an all-gather), computes the assignments to the experts it holds, and the shards' partial
outputs are summed back to the tokens' own devices (a reduce-scatter): every buffer has a size
fixed by the shapes (all tokens x k rows), so no token is ever dropped for lack of room.
Shape legend: T tokens, K choices per token, A = T x K assignments, D model width, F expert
width, E experts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def dropless_experts(x_TD: jax.Array, experts_TK: jax.Array, gates_TK: jax.Array, hidden, w_down_EFD: jax.Array,
                     first_expert: jax.Array | int = 0) -> jax.Array:
    """sum_k gate_k x expert_k(x) for every token, over the experts held here: w_down_EFD's E experts,
    numbered from first_expert (assignments to other experts add nothing; under expert parallelism
    another device adds them). hidden(x_AD, sizes_E) -> h_AF runs the experts' first layer(s) on
    rows sorted by expert (see MoE)."""
    T, K = experts_TK.shape
    E = w_down_EFD.shape[0]
    local_A = experts_TK.reshape(T * K) - first_expert
    held_A = (local_A >= 0) & (local_A < E)
    key_A = jnp.where(held_A, local_A, E)  # the experts held here, in order, then the others
    order_A = jnp.argsort(key_A, stable=True)  # token order within each expert
    sizes_E = jnp.bincount(key_A, length=E + 1)[:E].astype(jnp.int32)
    x_AD = x_TD[order_A // K]
    y_AD = jax.lax.ragged_dot(hidden(x_AD, sizes_E), w_down_EFD, sizes_E)
    y_AD = jnp.where(held_A[order_A][:, None], y_AD, 0)  # rows past the held experts' groups
    y_TKD = jnp.zeros_like(y_AD).at[order_A].set(y_AD).reshape(T, K, -1)  # back in token order
    return jnp.einsum("TKD,TK->TD", y_TKD, gates_TK.astype(y_TKD.dtype))
