"""How the step runs the model's layer scan: rematerialization policies, the sqrt-segmented
scan, and the expansion of sharded weights layer by layer (the layout's hooks).

remat: 'none' keeps every activation for backward; 'full' keeps only each layer's input and
recomputes the layer; 'dots' keeps matmul outputs only; 'sqrt' splits the L layers into about
sqrt(L) segments (the last one shorter when they do not divide L), keeps segment inputs and
recomputes a whole segment in backward (a nested scan): O(sqrt L) activation memory. When the
layout expands weights per layer (ZeRO-2/3), the expanded weights are fetched again in
backward rather than kept, so about one layer's full weights exist at a time.

train.offload=activations names each layer's input and offloads it to pinned host memory (the
remat policy save_and_offload_only_these_names), where full remat would keep it on the device;
the layer is recomputed in backward from the copy brought back. With remat 'dots' the matmul
outputs stay on the device as well; 'none' and 'full' keep nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

if TYPE_CHECKING:  # annotations only
    from jaxpar.model.transformer import LayerScan


# Per-layer checkpoint policies; 'sqrt' checkpoints whole segments instead (see _segmented_scan).
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}

LAYER_INPUT = "layer_input"  # the checkpoint name of each layer's input (offloaded by train.offload)
OFFLOAD_LAYER_INPUTS = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=[LAYER_INPUT],
    offload_src="device", offload_dst="pinned_host")


def _policy(remat: str, offload_inputs: bool, hooks):
    if offload_inputs:
        if remat == "dots":
            return jax.checkpoint_policies.save_from_both_policies(REMAT_POLICIES["dots"], OFFLOAD_LAYER_INPUTS)
        return OFFLOAD_LAYER_INPUTS
    return REMAT_POLICIES.get(remat) or (hooks.layer_weights_policy if hooks else None)


def layer_scan(remat: str, hooks=None, offload_inputs: bool = False) -> LayerScan:
    """The scan for Transformer.run_blocks: each layer's weights through the layout's
    hooks.layer_weights (with its index in the stacked state; none: as stored), under the remat
    policy (or, without one, the hooks' policy). offload_inputs: each layer's input goes to pinned
    host memory for backward (remat 'sqrt' keeps segment inputs instead; validation refuses both)."""

    def scan(one_layer, x_BLD, stacked, layer_ids):
        def step(x, layer):
            layer_state, index, layer_id = layer
            if offload_inputs:
                x = checkpoint_name(x, LAYER_INPUT)  # every use below goes through the name, so only the copy is kept
            return one_layer(x, hooks.layer_weights(layer_state, index) if hooks else layer_state, layer_id)

        policy = _policy(remat, offload_inputs, hooks)
        if policy is not None:
            step = jax.checkpoint(step, policy=policy, prevent_cse=False)
        layers = (stacked, jnp.arange(len(layer_ids)), layer_ids)
        if remat == "sqrt":
            return _segmented_scan(step, x_BLD, layers, sqrt_segment_size(len(layer_ids)))
        return jax.lax.scan(step, x_BLD, layers)

    return scan


def sqrt_segment_size(n_layers: int) -> int:
    """Layers per remat segment: round(sqrt(L)), so there are about sqrt(L) segments. When it
    does not divide L (a prime L such as 7, 11, 13), the last segment is shorter."""
    return max(1, round(n_layers ** 0.5))


def _segmented_scan(step, x_BLD, layers, size: int):
    """Checkpointed segments of `size` layers (only each segment's input is kept): an outer scan
    over the full segments, each an inner scan over its layers, then a shorter last segment."""
    n_layers = jax.tree.leaves(layers)[0].shape[0]
    full, rest = divmod(n_layers, size)

    @jax.checkpoint
    def one_segment(x, segment_layers):
        return jax.lax.scan(step, x, segment_layers)

    head = jax.tree.map(lambda a: a[:full * size].reshape(full, size, *a.shape[1:]), layers)
    x_BLD, stats = jax.lax.scan(one_segment, x_BLD, head)
    stats = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), stats)
    if rest:
        x_BLD, tail_stats = one_segment(x_BLD, jax.tree.map(lambda a: a[full * size:], layers))
        stats = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), stats, tail_stats)
    return x_BLD, stats
