"""The model.mtp section: multi-token prediction (DeepSeek-V3), extra heads trained to predict
tokens further ahead."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class MTPConfig:
    """depth D > 0 adds D sequential modules after the last block; module d predicts token t + 1 + d
    from module d - 1's output and token t + d's embedding, sharing the embedding and output head.
    Their mean cross-entropy, times weight, joins the loss."""
    depth: int = 0
    weight: float = 0.3
