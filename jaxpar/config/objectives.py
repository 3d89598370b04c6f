"""train.objective, as what the rest of jaxpar asks of it: what a batch's rows hold, where a preference
reference comes from, how verify judges it. The one module that compares train.objective with a name
(tests/test_structure.py holds it, as it holds the precision policy's); what an objective does in the
step is jaxpar.train.objectives. Pure Python (no jax): the config's checks read it before jax starts.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Rows = Literal["windows", "pairs", "completions"]


@dataclasses.dataclass(frozen=True)
class Objective:
    """One train.objective.

    rows: what a batch's rows hold: windows of documents (sft), whole preference pairs, the chosen then
    the rejected response (dpo, simpo, orpo), or GRPO's prompts with completions sampled from the current
    weights. reference_without_adapters: the preference loss compares the policy with the same model with
    its adapters off (dpo). margin: the loss is a function of a margin between a pair's log-probabilities
    (dpo, simpo), which fp8's rounding moves by more than a share of the loss (jaxpar.config.precision)."""

    name: str
    rows: Rows
    reference_without_adapters: bool = False
    margin: bool = False

    @property
    def plain(self) -> bool:
        """Next-token cross-entropy over windows (sft): no pairs, no sampling, no metrics of its own."""
        return self.rows == "windows"

    @property
    def trains_pairs(self) -> bool:
        return self.rows == "pairs"

    @property
    def samples(self) -> bool:
        """Each step's rows are completions sampled from the current weights and scored (GRPO): no validation
        windows, a reward, the rl section."""
        return self.rows == "completions"


OBJECTIVES = {
    "sft": Objective("sft", "windows"),
    "dpo": Objective("dpo", "pairs", reference_without_adapters=True, margin=True),
    "simpo": Objective("simpo", "pairs", margin=True),
    "orpo": Objective("orpo", "pairs"),
    "grpo": Objective("grpo", "completions"),
}


def objective_of(cfg) -> Objective:
    """The objective of a Config (train.objective, one of OBJECTIVES' names: the config's type holds it)."""
    return OBJECTIVES[cfg.train.objective]
