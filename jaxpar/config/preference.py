"""The train.preference section: the preference objectives' settings (train.objective = dpo, simpo
or orpo; the losses in jaxpar.train.preference)."""

from __future__ import annotations

import dataclasses
from typing import Literal


@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
    """beta: DPO's and SimPO's inverse temperature, ORPO's weight of the odds-ratio term (its lambda).
    loss: DPO's form (sigmoid: the paper's; ipo: squared, toward 1 / (2 beta); hinge: max(0, 1 - margin)).
    gamma: SimPO's target reward margin."""
    beta: float = 0.1
    loss: Literal["sigmoid", "ipo", "hinge"] = "sigmoid"
    gamma: float = 0.5
