"""Model FLOPs per token, the numerator of model FLOPs utilization (MFU): what the model needs,
whatever a layout recomputes or pads."""

from __future__ import annotations


def _param_leaves(cfg):
    """(path, size, logical axis names) of every parameter of cfg's Transformer, abstractly."""
    from flax import nnx

    from jaxpar.model import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    for path, leaf in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        yield path, leaf.size, tuple(leaf.get_metadata().get("out_sharding") or ())


def active_params(cfg) -> int:
    """Parameters one token uses: all of a dense model; in an MoE layer, the router and the
    top-k experts (topk and dropless; top-1 for Switch and, on average, capacity_factor for Expert Choice) of E."""
    moe = cfg.model.moe
    per_token = (moe.top_k if moe.chooses_top_k else
                 {"switch": 1, "expert_choice": moe.capacity_factor}[moe.router])
    return int(sum(size * (per_token / moe.experts if "expert" in names else 1)
                   for _, size, names in _param_leaves(cfg)))


def matmul_flops_floor(cfg) -> float:
    """Matmul FLOPs per step that every layout of cfg runs at least, summed over devices:
    6 x tokens x the weights that multiply activations (one expert per token in an MoE layer),
    leaving out the lookup tables (the input embedding unless tied to the logits, learned
    positions), vectors (norm scales), attention's own products and any recomputation."""
    lookups = ("pos_embedding",) if cfg.model.tie_embeddings else ("embedding", "pos_embedding")
    per_token = 0.0
    for path, size, names in _param_leaves(cfg):
        if path[0] in lookups or len([n for n in names if n != "layers"]) < 2:
            continue
        per_token += size / cfg.model.moe.experts if "expert" in names else size
    return 6 * per_token * cfg.train.batch_size * cfg.model.seq_len


def flops_per_token(cfg) -> float:
    """6 * active params (forward + backward matmuls) + 12 * layers * (heads x head width) * seq_len
    (attention's scores and weighted values)."""
    m = cfg.model
    return 6 * active_params(cfg) + 12 * m.n_layers * m.n_heads * m.head_size * m.seq_len
