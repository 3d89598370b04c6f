"""How the step runs the model's layer scan: rematerialization policies, the sqrt-segmented
scan, and the expansion of sharded weights layer by layer (the layout's hooks).

remat: 'none' keeps every activation for backward; 'full' keeps only each layer's input and
recomputes the layer; 'dots' keeps matmul outputs only; 'sqrt' splits the L layers into about
sqrt(L) segments (the last one shorter when they do not divide L), keeps segment inputs and
recomputes a whole segment in backward (a nested scan): O(sqrt L) activation memory. When the
layout expands weights per layer (ZeRO-2/3), the expanded weights are fetched again in
backward rather than kept, so about one layer's full weights exist at a time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxpar.model import LayerScan

# Per-layer checkpoint policies; 'sqrt' checkpoints whole segments instead (see _segmented_scan).
REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def layer_scan(remat: str, hooks=None) -> LayerScan:
    """The scan for Transformer.run_blocks: each layer's weights through the layout's
    hooks.layer_weights (with its index in the stacked state; none: as stored), under the remat
    policy (or, without one, the hooks' policy)."""

    def scan(one_layer, x_BLD, stacked, layer_ids):
        def step(x, layer):
            layer_state, index, layer_id = layer
            return one_layer(x, hooks.layer_weights(layer_state, index) if hooks else layer_state, layer_id)

        policy = REMAT_POLICIES.get(remat) or (hooks.layer_weights_policy if hooks else None)
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
