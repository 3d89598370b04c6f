"""Which Hugging Face tensors each jaxpar parameter is made of, and how: one table, read both ways.

A Hugging Face linear layer stores (out, in) with the heads flattened into `out`; jaxpar stores
(in, ..., out) with heads as their own dimension, Q/K/V (and SwiGLU's gate/up) fused into slots,
every layer stacked on a leading axis, and a mixture of experts' weights with an expert axis next
(where Mixtral, Qwen3-MoE and DeepSeek-V3 store one tensor per expert, and gpt-oss one per layer). Each
parameter is a `TensorMap` (jaxpar.interop.hf_tensor_map): its source tensors and how they reshape,
reorder and transpose into it, so any box of it (a device's shard) reads just the rows and columns
inside, and one layer of it writes back as the checkpoint's tensors.

The names follow the model's features: Gemma's sandwich norms (`pre_feedforward_layernorm` where the
others say post_attention_layernorm), gpt-oss's sinks, output bias and fused experts, DeepSeek-V3's
latent attention (its rotary rows interleaved in the checkpoint, half-split in jaxpar), correction
bias and shared experts, and its dense first layers (`dense_blocks`).

Pure NumPy: the checks before compiling and the export use it without jax.
"""

from __future__ import annotations

import functools

from jaxpar.config.model import ModelConfig
from jaxpar.interop.hf_tensor_map import TensorMap

__all__ = ["TensorMap", "tensor_maps"]

# A mixture of experts' tensors in each family: the block's name, then the experts' gate, up and down
# projections (one tensor per expert; transformers 5 fuses them in memory and writes these names back).
MOE_TENSORS = {"mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
               "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
               "deepseek_v3": ("mlp", "gate_proj", "up_proj", "down_proj")}
# A block's norms by jaxpar's name: pre-norm blocks, and Gemma's sandwich (a norm after each sublayer too)
PLAIN_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
SANDWICH_NORMS = {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                  "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}


def moe_family(m: ModelConfig) -> str:
    """Which family's tensor names an MoE model reads and writes: DeepSeek-V3's (latent attention),
    Qwen3-MoE's (query/key norms) or Mixtral's (gpt-oss's fused experts: _gpt_oss_expert_maps)."""
    return "deepseek_v3" if m.mla.enabled else "qwen3_moe" if m.qk_norm else "mixtral"


def tensor_maps(m: ModelConfig) -> list[TensorMap]:
    """Every parameter of a jaxpar Transformer of shape `m`, as the tensors of its Hugging Face family
    (none for multi-token prediction's modules, which no family stores)."""
    D, V, padded = m.d_model, m.vocab_size, m.padded_vocab
    maps = [TensorMap(("embedding",), ("model.embed_tokens.weight",), (V, D), (V, D), (0, 1), pad=(0, V, padded)),
            TensorMap(("final_norm", "scale"), ("model.norm.weight",), (D,), (D,), (0,))]
    if not m.tie_embeddings:
        maps.append(TensorMap(("head",), ("lm_head.weight",), (V, D), (V, D), (1, 0), pad=(1, V, padded)))
    first = m.moe.first_dense if m.moe.experts else 0
    if first:  # DeepSeek-V3's dense first layers, a stack of their own
        maps += _block_maps(m, ("dense_blocks",), functools.partial(TensorMap, layers=first), moe=False)
    if not m.has_layer_units:
        return maps + _block_maps(m, ("blocks",), functools.partial(TensorMap, layers=m.n_layers), moe=False)
    # The scanned unit of several blocks: every moe.every-th one's MLP the experts, the local and global
    # layers in their pattern (jaxpar.model.transformer)
    every = m.unit_blocks
    for j in range(every):
        stacked = functools.partial(TensorMap, layers=m.units, layer_step=every, layer_offset=first + j)
        maps += _block_maps(m, ("blocks", "blocks", str(j)), stacked, moe=m.block_is_moe(j))
    return maps


def _block_maps(m: ModelConfig, at: tuple[str, ...], stacked, moe: bool) -> list[TensorMap]:
    """One stacked block's parameters (under the path `at`); stacked(path, ...) makes a TensorMap of it."""
    D, F = m.d_model, m.d_ff
    layer = "model.layers.{layer}."
    norms = SANDWICH_NORMS if m.sandwich_norm else PLAIN_NORMS
    maps = [stacked((*at, norm, "scale"), (layer + name + ".weight",), (D,), (D,), (0,))
            for norm, name in norms.items()]
    maps += _latent_maps(m, at, stacked) if m.mla.enabled else _attention_maps(m, at, stacked)
    if moe:
        return maps + (_gpt_oss_expert_maps if m.moe.mlp == "gpt_oss" else _expert_maps)(m, at, stacked)
    return maps + _mlp_maps(at + ("mlp",), layer + "mlp.", stacked, D, F)


def _mlp_maps(at: tuple[str, ...], prefix: str, stacked, D: int, F: int) -> list[TensorMap]:
    """A gated MLP's gate and up projections (F, D) into jaxpar's (D, 2, F), its down projection (D, F)."""
    return [stacked((*at, "w_gate_up"), (prefix + "gate_proj.weight", prefix + "up_proj.weight"), (F, D), (F, D),
                    (1, 0), slot_axis=1),
            stacked((*at, "w_down"), (prefix + "down_proj.weight",), (D, F), (D, F), (1, 0))]


def _attention_maps(m: ModelConfig, at: tuple[str, ...], stacked) -> list[TensorMap]:
    D, H, G, K = m.d_model, m.n_heads, m.kv_heads, m.head_size
    attn = "model.layers.{layer}.self_attn."
    maps = [stacked((*at, "attn", "wo"), (attn + "o_proj.weight",), (D, H * K), (D, H, K), (1, 2, 0))]
    qkv = [attn + f"{p}_proj" for p in "qkv"]
    if G == H:
        maps.append(stacked((*at, "attn", "w_qkv"), tuple(n + ".weight" for n in qkv), (H * K, D), (H, K, D),
                            (2, 0, 1), slot_axis=1))
        if m.qkv_bias:
            maps.append(stacked((*at, "attn", "b_qkv"), tuple(n + ".bias" for n in qkv), (H * K,), (H, K),
                                (0, 1), slot_axis=0))
    else:
        maps += [stacked((*at, "attn", "w_q"), (qkv[0] + ".weight",), (H * K, D), (H, K, D), (2, 0, 1)),
                 stacked((*at, "attn", "w_kv"), tuple(n + ".weight" for n in qkv[1:]), (G * K, D), (G, K, D),
                         (2, 0, 1), slot_axis=1)]
        if m.qkv_bias:
            maps += [stacked((*at, "attn", "b_q"), (qkv[0] + ".bias",), (H * K,), (H, K), (0, 1)),
                     stacked((*at, "attn", "b_kv"), tuple(n + ".bias" for n in qkv[1:]), (G * K,), (G, K),
                             (0, 1), slot_axis=0)]
    if m.qk_norm:
        maps += [stacked((*at, "attn", f"{p}_norm", "scale"), (attn + f"{p}_norm.weight",), (K,), (K,), (0,))
                 for p in "qk"]
    if m.out_bias:
        maps.append(stacked((*at, "attn", "b_o"), (attn + "o_proj.bias",), (D,), (D,), (0,)))
    if m.sinks:  # gpt-oss: one logit per query head
        maps.append(stacked((*at, "attn", "sinks"), (attn + "sinks",), (H,), (H,), (0,)))
    return maps


def _latent_maps(m: ModelConfig, at: tuple[str, ...], stacked) -> list[TensorMap]:
    """DeepSeek-V3's latent attention. Its checkpoints store each rotated query and key as interleaved pairs
    (2i, 2i + 1), which transformers rotates and de-interleaves (rope_interleave); jaxpar's half-split rotation
    of the same rows taken evens then odds computes the same thing bit for bit, so those rows are reordered
    on the way in and back on the way out."""
    D, H, mla = m.d_model, m.n_heads, m.mla
    R, Q, N, E, V = mla.kv_rank, mla.q_rank, mla.nope_dim, mla.rope_dim, mla.v_dim
    attn = "model.layers.{layer}.self_attn."
    rope = tuple(range(0, E, 2)) + tuple(range(1, E, 2))
    head_rows = (1, tuple(range(N)) + tuple(N + i for i in rope))  # each head's query: [nope | rope]
    maps = [stacked((*at, "attn", "w_kv_down"), (attn + "kv_a_proj_with_mqa.weight",), (R + E, D), (R + E, D), (1, 0),
                    reorder=(0, tuple(range(R)) + tuple(R + i for i in rope))),  # [latent | the shared rotated key]
            stacked((*at, "attn", "kv_norm", "scale"), (attn + "kv_a_layernorm.weight",), (R,), (R,), (0,)),
            stacked((*at, "attn", "w_kv_up"), (attn + "kv_b_proj.weight",), (H * (N + V), R), (H, N + V, R),
                    (2, 0, 1)),
            stacked((*at, "attn", "wo"), (attn + "o_proj.weight",), (D, H * V), (D, H, V), (1, 2, 0))]
    if not Q:  # queries straight from the model width
        return maps + [stacked((*at, "attn", "w_q"), (attn + "q_proj.weight",), (H * (N + E), D), (H, N + E, D),
                               (2, 0, 1), reorder=head_rows)]
    return maps + [
        stacked((*at, "attn", "w_q_down"), (attn + "q_a_proj.weight",), (Q, D), (Q, D), (1, 0)),
        stacked((*at, "attn", "q_norm", "scale"), (attn + "q_a_layernorm.weight",), (Q,), (Q,), (0,)),
        stacked((*at, "attn", "w_q_up"), (attn + "q_b_proj.weight",), (H * (N + E), Q), (H, N + E, Q), (2, 0, 1),
                reorder=head_rows)]


def _expert_maps(m: ModelConfig, at: tuple[str, ...], stacked) -> list[TensorMap]:
    """The router and the experts of an MoE block: the router's (E, D) `gate`, each expert's gate and up
    projections (F, D) into jaxpar's (E, D, 2, F) and its down projection (D, F) into (E, F, D); DeepSeek-V3's
    correction bias (bias balancing's `router_bias`) and shared experts (one MLP of their summed width)."""
    D, E, F = m.d_model, m.moe.experts, m.expert_d_ff
    block, gate, up, down = MOE_TENSORS[moe_family(m)]
    moe, expert = f"model.layers.{{layer}}.{block}.", f"model.layers.{{layer}}.{block}.experts.{{expert}}."
    maps = [stacked((*at, "mlp", "w_router"), (moe + "gate.weight",), (E, D), (E, D), (1, 0)),
            stacked((*at, "mlp", "w_gate_up"), (expert + gate + ".weight", expert + up + ".weight"), (F, D), (F, D),
                    (1, 0), slot_axis=1, experts=E),
            stacked((*at, "mlp", "w_down"), (expert + down + ".weight",), (D, F), (D, F), (1, 0), experts=E)]
    if m.moe.chooses_top_k:  # noisy top-k's noise weight: none in the checkpoint, zeros (the noise is off)
        maps.append(stacked((*at, "mlp", "w_noise"), (), (D, E), (D, E), (0, 1)))
    if m.moe.balance == "bias":
        maps.append(stacked((*at, "mlp", "router_bias"), (moe + "gate.e_score_correction_bias",), (E,), (E,), (0,)))
    if m.moe.shared:
        maps += _mlp_maps((*at, "mlp", "shared"), moe + "shared_experts.", stacked, D, m.moe.shared * F)
    return maps


def _gpt_oss_expert_maps(m: ModelConfig, at: tuple[str, ...], stacked) -> list[TensorMap]:
    """gpt-oss's router (weight and bias) and experts, each kind one tensor per layer stored (in, out): the gate
    and up projections (E, D, 2F) with their columns interleaved (gate_0, up_0, gate_1, ...) into jaxpar's
    (E, D, 2, F), their biases (E, 2F) likewise, the down projection (E, F, D) and its bias (E, D) as they are."""
    D, E, F = m.d_model, m.moe.experts, m.expert_d_ff
    moe, experts = "model.layers.{layer}.mlp.", "model.layers.{layer}.mlp.experts."
    mlp = (*at, "mlp")
    return [stacked((*mlp, "w_router"), (moe + "router.weight",), (E, D), (E, D), (1, 0)),
            stacked((*mlp, "b_router"), (moe + "router.bias",), (E,), (E,), (0,)),
            stacked((*mlp, "w_gate_up"), (experts + "gate_up_proj",), (E, D, 2 * F), (E, D, F, 2), (0, 1, 3, 2)),
            stacked((*mlp, "b_gate_up"), (experts + "gate_up_proj_bias",), (E, 2 * F), (E, F, 2), (0, 2, 1)),
            stacked((*mlp, "w_down"), (experts + "down_proj",), (E, F, D), (E, F, D), (0, 1, 2)),
            stacked((*mlp, "b_down"), (experts + "down_proj_bias",), (E, D), (E, D), (0, 1)),
            stacked((*mlp, "w_noise"), (), (D, E), (D, E), (0, 1))]
