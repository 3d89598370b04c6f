"""Model FLOPs per token, the numerator of model FLOPs utilization (MFU): what the model needs,
whatever a layout recomputes or pads; and MFU itself, against a GPU's datasheet or a CPU's
measured matmul rate."""

from __future__ import annotations


def _param_leaves(cfg):
    """(path, size, logical axis names) of every parameter of cfg's Transformer, abstractly."""
    from flax import nnx

    from jaxpar.model.transformer import Transformer

    abstract = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
    for path, leaf in nnx.to_flat_state(nnx.state(abstract, nnx.Param)):
        yield path, leaf.size, tuple(leaf.get_metadata().get("out_sharding") or ())


def _lookup_tables(cfg) -> tuple[str, ...]:
    """The parameters a token looks a row up in instead of multiplying by: learned positions, and the
    input embedding unless it is tied to the logits."""
    return ("pos_embedding",) if cfg.model.tie_embeddings else ("embedding", "pos_embedding")


def active_params(cfg, lookups: tuple[str, ...] = ()) -> int:
    """Parameters one token uses: all of a dense model; in an MoE layer, the router and the
    top-k experts (topk and dropless; top-1 for Switch and, on average, capacity_factor for Expert Choice) of E.
    `lookups`: top-level parameters left out."""
    moe = cfg.model.moe
    per_token = (moe.top_k if moe.chooses_top_k else
                 {"switch": 1, "expert_choice": moe.capacity_factor}[moe.router])
    return int(sum(size * (per_token / moe.experts if "expert" in names else 1)
                   for path, size, names in _param_leaves(cfg) if path[0] not in lookups))


def matmul_flops_floor(cfg) -> float:
    """Matmul FLOPs per step that every layout of cfg runs at least, summed over devices:
    6 x tokens x the weights that multiply activations (one expert per token in an MoE layer),
    leaving out the lookup tables (the input embedding unless tied to the logits, learned
    positions), vectors (norm scales), attention's own products and any recomputation."""
    lookups = _lookup_tables(cfg)
    per_token = 0.0
    for path, size, names in _param_leaves(cfg):
        if path[0] in lookups or len([n for n in names if n != "layers"]) < 2:
            continue
        per_token += size / cfg.model.moe.experts if "expert" in names else size
    return 6 * per_token * cfg.train.batch_size * cfg.model.seq_len


def flops_per_token(cfg) -> float:
    """6 * the active params a token multiplies by (forward + backward matmuls; not the lookup tables:
    an untied model's input embedding, learned positions) + 12 * layers * (heads x head width) * seq_len
    (attention's scores and weighted values): the model FLOPs of MFU, 6N + 12 L H Q T. Latent attention's
    (model.mla) head width is the mean of its query/key and value widths; a windowed layer attends to
    min(window, seq_len) keys in T's place; multi-token prediction's modules add their blocks' attention
    and the shared output head once more each (6 V D)."""
    m = cfg.model
    width = (m.mla.qk_dim + m.mla.v_dim) / 2 if m.mla.enabled else m.head_size
    keys = sum(min(m.window, m.seq_len) if m.layer_is_local(i) else m.seq_len for i in range(m.n_layers))
    keys += m.mtp.depth * m.seq_len
    return (6 * active_params(cfg, _lookup_tables(cfg)) + 12 * m.n_heads * width * keys
            + 6 * m.mtp.depth * m.vocab_size * m.d_model)


def utilization(cfg, tokens_per_s: float, devices: list, compute_dtype: str, record: dict) -> dict:
    """MFU: flops_per_token x tokens/s over the peak matmul rate in `compute_dtype` (the precision
    policy's). A GPU with a hardware profile (jaxpar.runtime.hardware): its datasheet peak x the devices. A
    CPU: the machine's measured rate in `record` (jaxpar.runtime.machine.describe), which all emulated devices
    share. Returns the figures and where the peak comes from; mfu is None without a peak."""
    from jaxpar.runtime.hardware import GPU_PROFILES, for_device_kind

    per_token = flops_per_token(cfg)
    first = devices[0]
    profile = for_device_kind(first.device_kind) if first.platform == "gpu" else None
    if profile is not None:
        peak, source = GPU_PROFILES[profile].peak_flops[compute_dtype] * len(devices), f"{profile} datasheet"
    elif first.platform == "cpu" and compute_dtype in record["matmul_flops"]:
        peak = record["matmul_flops"][compute_dtype]
        source = f"measured {record['matmul_size']}^3 {compute_dtype} matmul"
    else:
        peak, source = None, f"no hardware profile for {first.device_kind}"
    return {"mfu": per_token * tokens_per_s / peak if peak else None, "model_flops_per_token": per_token,
            "peak_flops": peak, "peak_source": source}


if __name__ == "__main__":  # python -m jaxpar.train.model_flops [CONFIG.yaml] [key=value ...]: one JSON line
    import json
    import sys

    from jaxpar.config.presets import load_config

    yaml = [a for a in sys.argv[1:] if a.endswith((".yaml", ".yml")) and "=" not in a]
    config = load_config(yaml[0] if yaml else None, [a for a in sys.argv[1:] if a not in yaml])
    print(json.dumps({"flops_per_token": flops_per_token(config)}))
