"""The model.mla section: multi-head latent attention (DeepSeek-V2/V3, Kimi K2), keys and values
rebuilt from a compressed latent that is all the decoding cache holds (jaxpar.model.mla)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    """kv_rank > 0 turns it on. Each head's query and key have nope_dim dimensions without positions
    and rope_dim rotated ones, the rotated key shared by all heads; each head's value has v_dim."""
    kv_rank: int = 0  # width of the key/value latent (kv_lora_rank); 0: ordinary attention
    q_rank: int = 0  # width of the query latent (q_lora_rank); 0: queries projected straight from the model width
    rope_dim: int = 0  # rotated dimensions per head (qk_rope_head_dim)
    nope_dim: int = 0  # dimensions per head without positions (qk_nope_head_dim)
    v_dim: int = 0  # value width per head (v_head_dim)

    @property
    def enabled(self) -> bool:
        return self.kv_rank > 0

    @property
    def qk_dim(self) -> int:
        """Width of one head's query and key: the unrotated and rotated dimensions together."""
        return self.nope_dim + self.rope_dim
