"""Next-token cross-entropy from logits and integer targets, without a gather on the vocabulary.

optax.softmax_cross_entropy_with_integer_labels picks each target's logit with take_along_axis, a
gather on the vocabulary axis, which tensor parallelism splits. Inside a shard_map manual over a batch
axis (expert parallelism, or gradients reduced in bf16), with `tensor` and `context` both > 1 and
automatic, XLA's SPMD partitioner aborts on that gather (jax 0.12.0.1: "Check failed:
partition_group_list.num_replica_groups() * partition_group_list.num_devices_per_group() ==
device_groups.num_devices_per_group()" in ExpandDeviceGroups, reached from
PartitionGatherTrivialSlicedOperandDimensions). Here the target's logit is a masked sum over the
vocabulary instead: the partitioner reduces it like any sum over a split axis, and the value is the same
to the bit (every other term of the sum is an exact zero), its gradient too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_cross_entropy(logits_BLV: jax.Array, targets_BL: jax.Array) -> jax.Array:
    """Each position's cross-entropy (B, L) in fp32: logsumexp of its logits minus its target's logit."""
    logits_BLV = logits_BLV.astype(jnp.float32)
    vocab_V = jnp.arange(logits_BLV.shape[-1], dtype=targets_BL.dtype)
    target_BL = jnp.sum(jnp.where(vocab_V == targets_BL[..., None], logits_BLV, 0.0), axis=-1)
    return jax.nn.logsumexp(logits_BLV, axis=-1) - target_BL
