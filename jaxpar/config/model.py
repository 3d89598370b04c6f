"""The model.* section: the decoder-only transformer's shape, its attention and MLP variants, and the
sections for experts, adapters, latent attention and multi-token prediction."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from jaxpar.config.adapters import LoRAConfig
from jaxpar.config.mla import MLAConfig
from jaxpar.config.moe import MoEConfig
from jaxpar.config.mtp import MTPConfig


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder-only transformer."""

    vocab_size: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 0  # key/value heads (grouped-query attention; 1: multi-query); 0: as many as n_heads
    head_dim: int = 0  # width of one attention head; 0: d_model / n_heads (Qwen 3 sets its own)
    d_ff: int = 512
    seq_len: int = 128
    positions: Literal["rope", "learned"] = "rope"
    rope_theta: float = 10000.0  # base of the rotary angles (Llama 3: 500000)
    # rotary frequencies rescaled for a longer context: linear (all divided by rope_factor), or llama3 (Llama
    # 3.1/3.2: wavelengths beyond original_context / low_freq_factor divided by rope_factor, those under
    # original_context / high_freq_factor kept, the band between interpolated)
    rope_scaling: Literal["none", "linear", "llama3", "yarn"] = "none"
    rope_factor: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    # yarn (gpt-oss, DeepSeek-V3): wavelengths between original_context / beta_fast and / beta_slow rotations
    # ramp from kept to divided by rope_factor; cos and sin scaled by the attention factor (rope_mscale terms)
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0  # yarn's attention factor: mscale(factor, rope_mscale) / mscale(factor, mscale_all_dim)
    rope_mscale_all_dim: float = 0.0
    rope_truncate: bool = True  # yarn: the ramp's bounds rounded to whole dimensions (gpt-oss: false)
    rope_local_theta: float = 0.0  # rotary base of the local layers, unscaled (Gemma 3: 10000); 0: rope_theta
    norm_eps: float = 1e-5  # RMSNorm's epsilon
    qkv_bias: bool = False  # biases on the query, key and value projections (Qwen 2/2.5)
    qk_norm: bool = False  # RMSNorm of each query and key head before the rotary positions (Qwen 3)
    out_bias: bool = False  # a bias on the attention's output projection (gpt-oss)
    # sliding-window attention: a query sees itself and the window - 1 positions before it (0: every earlier one)
    window: int = 0
    # which layers the window applies to, a letter per layer repeated over the depth: l local (windowed), g global
    # ('lllllg': Gemma 3, 'lg': gpt-oss); empty: every layer local when window > 0
    attention_pattern: str = ""
    sinks: bool = False  # a learned logit per head that takes a share of every softmax and adds nothing (gpt-oss)
    attn_softcap: float = 0.0  # attention scores squashed to cap * tanh(s / cap) (Gemma 2); 0: off
    final_softcap: float = 0.0  # the output logits squashed likewise (Gemma 2); 0: off
    attn_scale: float = 0.0  # what the scores q.k are multiplied by; 0: 1 / sqrt(head size)
    norm_offset: bool = False  # RMSNorm scales by (1 + w), its weight stored as the offset from 1 (Gemma)
    sandwich_norm: bool = False  # a norm after each sublayer's output as well as before its input (Gemma 2/3)
    embed_scale: bool = False  # the token embeddings multiplied by sqrt(d_model) (Gemma)
    # gelu: gelu(x W_up); swiglu: silu(x W_gate) * (x W_up) (Llama); geglu: tanh-approximated gelu(x W_gate) * (x W_up)
    mlp: Literal["gelu", "swiglu", "geglu"] = "gelu"
    # dot: the L x L scores; flash: blockwise, O(L) memory on any backend; cudnn: jax.nn.dot_product_attention's
    # cuDNN kernel (GPU, bf16/fp16); auto: cudnn where it runs, else flash over several blocks, else dot
    attention: Literal["dot", "flash", "cudnn", "auto"] = "dot"
    flash_block_q: int = 512  # query positions per flash block (at most seq_len)
    flash_block_kv: int = 512  # key positions per flash block (at most seq_len)
    tie_embeddings: bool = True
    # the embedding and output rows are vocab_size rounded up to a multiple of this (say mesh.tensor, for
    # tensor parallelism); the padded rows are never looked up, their logits never win, and export drops them
    vocab_multiple: int = 1
    # a Hugging Face checkpoint folder (config.json + *.safetensors): the shape comes from its config.json
    # and the first step starts from its weights
    from_hf: str = ""
    # an earlier run's folder: the shape from its config and the first step from its newest checkpoint's weights
    from_run: str = ""
    moe: MoEConfig = MoEConfig()
    lora: LoRAConfig = LoRAConfig()
    mla: MLAConfig = MLAConfig()
    mtp: MTPConfig = MTPConfig()

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_heads, or n_heads when it is 0."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        """Width of one attention head: head_dim, or d_model / n_heads when it is 0."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def expert_d_ff(self) -> int:
        """Hidden width of each routed and shared expert: model.moe.d_ff, or model.d_ff when it is 0."""
        return self.moe.d_ff or self.d_ff

    @property
    def padded_vocab(self) -> int:
        """Rows of the embedding and of the output: vocab_size rounded up to a multiple of vocab_multiple."""
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    @property
    def unit_blocks(self) -> int:
        """Blocks per scanned unit: a period of the MoE layers (every moe.every-th) and of the local and
        global pattern, so that each block of a unit has the same kind in every unit."""
        every = self.moe.every if self.moe.experts else 1
        period = len(self.attention_pattern) if self.window and self.attention_pattern else 1
        return math.lcm(max(every, 1), period)

    @property
    def gated_mlp(self) -> bool:
        """Whether the dense MLP has a gate (swiglu, geglu): a fused gate and up weight."""
        return self.mlp != "gelu"

    @property
    def has_layer_units(self) -> bool:
        """Whether the scanned unit is a group of blocks (jaxpar.model.transformer.LayerUnit: an MoE model,
        or several blocks a period) rather than one block; its weights then sit under blocks/blocks/<j>."""
        return bool(self.moe.experts) or self.unit_blocks > 1

    @property
    def unit_layers(self) -> int:
        """The layers stacked in units: all but the dense first ones (moe.first_dense)."""
        return self.n_layers - self.moe.first_dense

    @property
    def units(self) -> int:
        """How many units the layers stack into (the scan's length)."""
        return self.unit_layers // self.unit_blocks

    def block_is_moe(self, block: int) -> bool:
        """Whether block `block` of a unit (or of the model) holds the experts: every moe.every-th."""
        return bool(self.moe.experts) and (block + 1) % self.moe.every == 0

    @property
    def moe_blocks_per_unit(self) -> int:
        return sum(self.block_is_moe(j) for j in range(self.unit_blocks))

    def layer_is_local(self, layer: int) -> bool:
        """Whether model layer `layer` attends through the window (model.window, model.attention_pattern)."""
        if not self.window:
            return False
        return not self.attention_pattern or self.attention_pattern[layer % len(self.attention_pattern)] == "l"

    def flash_blocks(self) -> tuple[int, int]:
        """The flash block sizes (query, key) this sequence length uses: the configured ones, at most seq_len."""
        return min(self.flash_block_q, self.seq_len), min(self.flash_block_kv, self.seq_len)
