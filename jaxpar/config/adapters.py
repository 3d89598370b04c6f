"""The model.lora section: low-rank adapters on frozen weights (LoRA; QLoRA with a 4-bit base), the
feature's checks and layout in jaxpar.features.adapters."""

from __future__ import annotations

import dataclasses
from typing import Literal

# What model.lora.targets may name: the attention and MLP projections, and every routed expert's matrices.
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "experts")


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """rank r > 0 puts W + (alpha / r) A B on every target weight W: A (inputs x r) drawn small, B (r x outputs)
    zero, so the first step computes the base model; only A and B train."""
    rank: int = 0  # 0: no adapters, every weight trains
    alpha: float = 16.0
    dropout: float = 0.0  # on each projection adapter's input, while training (p of zeroing an element)
    targets: str = "q,k,v,o,gate,up,down"  # a comma list of LORA_TARGETS (gate: where the MLP has one, swiglu)
    # how the frozen weights are stored: fp32 or bf16 bits; int8 or nf4 (QLoRA): the projections quantized in
    # blocks of 64 with a bf16 scale each (1.03 or 0.53 bytes a weight), the embeddings and norms bf16
    base_dtype: Literal["fp32", "bf16", "int8", "nf4"] = "fp32"
    from_peft: str = ""  # a PEFT adapter folder (adapter_config.json + adapter_model.safetensors) to start from

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def target_set(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.targets.split(",") if t.strip())

    @property
    def scale(self) -> float:
        """alpha / rank: what the adapters' product is multiplied by."""
        return self.alpha / self.rank if self.rank else 0.0
