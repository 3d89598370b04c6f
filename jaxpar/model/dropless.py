"""Dropless experts: every token's k assignments computed, none dropped and no capacity padded.

The assignments are sorted by expert, each expert's contiguous rows go through its weights with
one grouped matmul (`jax.lax.ragged_dot`, or its fp8 form: jaxpar.model.axes.gemm), and the
results are put back in token order and weighted by the gates. Under expert parallelism every
device sees the tokens of all `expert` shards (an all-gather), computes the assignments to the
experts it holds, and the shards' partial outputs are summed back to the tokens' own devices (a
reduce-scatter): every buffer has a size fixed by the shapes (all tokens x k rows), so no token is
ever dropped for lack of room.

With parallel.expert_dispatch=ragged (`ragged_dropless_experts`) each device sends each expert device
only the assignments routed there, by ragged all-to-all, and gets their results back the same way:
traffic of the routed rows (A of them per device), not mesh.expert x the tokens. The receive buffer
holds S x A rows, as many as every shard's assignments to one device (all of them routed to its
experts): no routing overflows it, so nothing is dropped, and it is the size of the all-gather's
rows, so it costs no more memory.
Shape legend: T tokens, K choices per token, A = T x K assignments, D model width, F expert
width, E experts (held here), S expert shards, R = S x A received rows.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxpar.model.axes import ExpertExchange, gemm


def dropless_experts(x_TD: jax.Array, experts_TK: jax.Array, gates_TK: jax.Array, hidden, w_down_EFD: jax.Array,
                     first_expert: jax.Array | int = 0, b_down_ED: jax.Array | None = None) -> jax.Array:
    """sum_k gate_k x expert_k(x) for every token, over the experts held here: w_down_EFD's E experts,
    numbered from first_expert (assignments to other experts add nothing; under expert parallelism
    another device adds them). hidden(x_AD, sizes_E) -> h_AF runs the experts' first layer(s) on
    rows sorted by expert (see MoE); b_down_ED: each expert's output bias (gpt-oss), or None."""
    T, K = experts_TK.shape
    E = w_down_EFD.shape[0]
    local_A = experts_TK.reshape(T * K) - first_expert
    held_A = (local_A >= 0) & (local_A < E)
    key_A = jnp.where(held_A, local_A, E)  # the experts held here, in order, then the others
    order_A = jnp.argsort(key_A, stable=True)  # token order within each expert
    sizes_E = jnp.bincount(key_A, length=E + 1)[:E].astype(jnp.int32)
    x_AD = x_TD[order_A // K]
    y_AD = down(hidden(x_AD, sizes_E), w_down_EFD, sizes_E, b_down_ED)
    y_AD = jnp.where(held_A[order_A][:, None], y_AD, 0)  # rows past the held experts' groups
    return _gated(y_AD, order_A, gates_TK)


def ragged_dropless_experts(x_TD: jax.Array, experts_TK: jax.Array, gates_TK: jax.Array, hidden,
                            w_down_EFD: jax.Array, exchange: ExpertExchange,
                            b_down_ED: jax.Array | None = None) -> jax.Array:
    """`dropless_experts` for this device's own tokens, its assignments sent to the devices holding their
    experts by ragged all-to-all and their results brought back (w_down_EFD: the E experts held here)."""
    T, K = experts_TK.shape
    A, S, E = T * K, exchange.shards, w_down_EFD.shape[0]
    experts_A = experts_TK.reshape(A)
    order_A = jnp.argsort(experts_A, stable=True)  # by expert, hence by the device holding it
    counts_SX = exchange.gathered(jnp.bincount(experts_A, length=S * E).astype(jnp.int32))  # X: all S x E experts
    routes = _Routes.of(counts_SX.reshape(S, S, E), exchange.shard())
    x_AD = x_TD[order_A // K]
    rows_RD = exchange.ragged_all_to_all(x_AD, jnp.zeros((S * A, *x_AD.shape[1:]), x_AD.dtype), *routes.there)
    y_RD = _held_experts(rows_RD, routes.held_SE, hidden, w_down_EFD, b_down_ED)
    y_AD = exchange.ragged_all_to_all(y_RD, jnp.zeros((A, *y_RD.shape[1:]), y_RD.dtype), *routes.back)
    return _gated(y_AD, order_A, gates_TK)


def _gated(y_AD: jax.Array, order_A: jax.Array, gates_TK: jax.Array) -> jax.Array:
    """The assignments' results (sorted as order_A sorted them) back in token order, summed over each
    token's choices weighted by its gates: (T, D)."""
    T, K = gates_TK.shape
    y_TKD = jnp.zeros_like(y_AD).at[order_A].set(y_AD, unique_indices=True).reshape(T, K, -1)
    return jnp.einsum("TKD,TK->TD", y_TKD, gates_TK.astype(y_TKD.dtype))


@dataclasses.dataclass(frozen=True)
class _Routes:
    """The ragged all-to-alls' arguments (input_offsets, send_sizes, output_offsets, recv_sizes) on this
    device: `there` sends its assignments, sorted by expert, shard d's block to shard d, where the blocks
    land one after the other in shard order; `back` returns each block's results to where it came from.
    held_SE: the rows each shard sends for each expert held here."""

    there: tuple[jax.Array, ...]
    back: tuple[jax.Array, ...]
    held_SE: jax.Array

    @classmethod
    def of(cls, counts_SDE: jax.Array, me: jax.Array) -> _Routes:
        """counts_SDE: assignments of shard s to expert e of shard d; me: this device's shard."""
        sent_SD = counts_SDE.sum(-1)
        start_SD = jnp.cumsum(sent_SD, axis=1) - sent_SD  # where shard s's rows for d begin among its own
        land_SD = jnp.cumsum(sent_SD, axis=0) - sent_SD  # where they land in d's buffer
        there = (start_SD[me], sent_SD[me], land_SD[me], sent_SD[:, me])
        back = (land_SD[:, me], sent_SD[:, me], start_SD[:, me], sent_SD[me])
        return cls(there, back, counts_SDE[:, me])


def _held_experts(rows_RD: jax.Array, held_SE: jax.Array, hidden, w_down_EFD: jax.Array,
                  b_down_ED: jax.Array | None) -> jax.Array:
    """The experts held here on the received rows, in the order they arrived: shard s's block (held_SE[s, e]
    rows for each expert e in turn), one after the other, then unused rows (whose results go nowhere)."""
    S, E = held_SE.shape
    ends = jnp.cumsum(held_SE.reshape(S * E))
    block_R = jnp.searchsorted(ends, jnp.arange(rows_RD.shape[0], dtype=ends.dtype), side="right")
    order_R = jnp.argsort(jnp.where(block_R < S * E, block_R % E, E), stable=True)  # by expert, unused rows last
    sizes_E = held_SE.sum(0)
    y_RD = down(hidden(rows_RD[order_R], sizes_E), w_down_EFD, sizes_E, b_down_ED)
    return jnp.zeros_like(y_RD).at[order_R].set(y_RD, unique_indices=True)


def per_row(b_EX: jax.Array, sizes_E: jax.Array, rows: int) -> jax.Array:
    """Each expert's bias on its rows, for rows sorted by expert (sizes_E each; the rows past them take
    the last expert's, and are discarded)."""
    return jnp.repeat(b_EX, sizes_E, axis=0, total_repeat_length=rows)


def down(h_AF: jax.Array, w_down_EFD: jax.Array, sizes_E: jax.Array, b_down_ED: jax.Array | None) -> jax.Array:
    """The experts' down projection of rows sorted by expert (as the layout's GEMM runs it: fp8 for
    train.precision=fp8), with each expert's bias where it has one."""
    y_AD = gemm().ragged_dot(h_AF, w_down_EFD, sizes_E)
    return y_AD if b_down_ED is None else y_AD + per_row(b_down_ED, sizes_E, h_AF.shape[0]).astype(y_AD.dtype)
