"""The embedding lookup in a vocabulary-split table, written per tensor rank where XLA cannot split it.

Tensor parallelism splits the embedding's vocabulary rows; the partitioner looks tokens up in such a
table by masking each rank's rows and summing over the ranks. Inside the step's shard_map (manual over
the batch axes: expert parallelism, or gradients reduced in bf16) with the tokens also split over an
automatic axis (`context`), XLA's SPMD partitioner aborts on that gather once the shapes make it pick
that strategy (jax 0.12.0.1, data=1 x tensor=2 x expert=2 x context=2 at 8 x 64 tokens per shard:
"Check failed: partition_group_list.num_replica_groups() * partition_group_list.num_devices_per_group()
== device_groups.num_devices_per_group()" in ExpandDeviceGroups, from
PartitionGatherTrivialSlicedOperandDimensions). `by_rank` writes the same computation in arrays the
partitioner splits without that step: the table as (P parts, V / P rows, D) split over the vocabulary's
axes, each part's lookup of the tokens it holds (a gather batched over the parts, no communication),
zeros elsewhere, and the sum over the parts (an all-reduce, as before). Each token has exactly one
nonzero term, so the sum is exact; it runs in fp32 (XLA:CPU aborts on a bf16 all-reduce inside the
step: jaxpar.parallel.reductions). Shapes: P parts, R rows per part, B batch, L sequence, D width.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def by_rank(table_VD: jax.Array, tokens_BL: jax.Array, parts: int, constrain) -> jax.Array:
    """table_VD's rows for tokens_BL (B, L, D), looked up in each of `parts` blocks of rows and summed;
    constrain(x, logical names) places the blocks on the vocabulary's mesh axes."""
    V, D = table_VD.shape
    R = V // parts
    table_PRD = constrain(table_VD.reshape(parts, R, D), ("vocab", None, "embed"))
    local_PBL = tokens_BL[None] - (jnp.arange(parts, dtype=tokens_BL.dtype) * R)[:, None, None]
    held_PBL = (local_PBL >= 0) & (local_PBL < R)
    local_PBL = constrain(jnp.where(held_PBL, local_PBL, 0), ("vocab", "batch", "seq"))
    x_PBLD = jax.vmap(lambda rows_RD, local_BL: jnp.take(rows_RD, local_BL, axis=0))(table_PRD, local_PBL)
    x_PBLD = jnp.where(held_PBL[..., None], x_PBLD.astype(jnp.float32), 0.0)
    return jnp.sum(constrain(x_PBLD, ("vocab", "batch", "seq", "embed")), axis=0).astype(table_VD.dtype)
