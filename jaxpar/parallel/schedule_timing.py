"""A schedule table in time, given what each action costs (pure Python).

The table's ticks count every action as one unit. Here each action takes its own cost (F, B and W
of the zero-bubble paper; a fused backward of 1F1B-type schedules costs B + W), and each stage
runs its actions in the table's order, each as soon as the stage is free and its inputs are
done (`timeline`). From that: the idle fraction over the whole step, and the paper's bubble, the
idle time inside one stage's own span (from its first action to its last), which leaves out the
ticks a later stage waits for its first input.

`lockstep_seconds` is the step as jaxpar's SPMD program runs it: every tick of the table is one
`lax.switch` on every device followed by the stages' `ppermute`, so a tick lasts as long as its
slowest stage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from jaxpar.parallel.schedules import Action, Table, theoretical_idle_fraction


@dataclasses.dataclass(frozen=True)
class Costs:
    """What a forward, an input backward (B) and a weight backward (W) of one chunk cost."""

    forward: float = 1.0
    backward: float = 1.0
    weight: float = 1.0

    def of(self, table: Table) -> Callable[[Action], float]:
        """The cost of each action of `table`: a backward that is not split costs B + W."""
        fused = self.backward + (0.0 if table.split_backward else self.weight)
        by_kind = {"F": self.forward, "B": fused, "W": self.weight}
        return lambda action: by_kind[action.kind]


def timeline(table: Table, cost: Callable[[Action], float]) -> list[list[tuple[Action, float, float]]]:
    """Per stage, (action, start, end) in the table's order: each action starts when its stage is
    free and the actions it depends on have ended."""
    end: dict[Action, float] = {}
    free = [0.0] * table.stages
    out: list[list[tuple[Action, float, float]]] = [[] for _ in range(table.stages)]
    last = table.stages * table.virtual - 1
    for row in table.ticks:  # ticks respect every dependency, so each one's inputs are timed already
        for s, action in enumerate(row):
            if action is None:
                continue
            # (an input from before the table, 2BW's previous step, is done when the table starts)
            start = max([free[s]] + [end.get(d, 0.0) for d in _inputs(action, last)])
            end[action] = free[s] = start + cost(action)
            out[s].append((action, start, end[action]))
    return out


def _inputs(action: Action, last_chunk: int) -> list[Action]:
    i, k = action.microbatch, action.chunk
    if action.kind == "F":
        return [Action("F", i, k - 1)] if k > 0 else []
    if action.kind == "W":
        return [Action("B", i, k)]
    return [Action("F", i, k)] + ([Action("B", i, k + 1)] if k < last_chunk else [])


def idle_fraction(table: Table, cost: Callable[[Action], float]) -> float:
    """Idle stage-time over all stage-time from the step's first action to its last."""
    spans = timeline(table, cost)
    makespan = max(end for stage in spans for _, _, end in stage)
    busy = sum(end - start for stage in spans for _, start, end in stage)
    return 1.0 - busy / (table.stages * makespan)


def bubble(table: Table, cost: Callable[[Action], float]) -> float:
    """The paper's bubble: the most idle time inside one stage's span (first action to last)."""
    worst = 0.0
    for stage in timeline(table, cost):
        span = stage[-1][2] - stage[0][1]
        worst = max(worst, span - sum(end - start for _, start, end in stage))
    return worst


def paper_bubble(schedule: str, stages: int, costs: Costs) -> float:
    """Qi et al.'s bubble formulas, with `costs` those of one chunk's actions: (S-1)(F+B+W) for
    1F1B-type schedules (interleaved too: its chunks are v times smaller), (S-1)(F+B-W) for ZB-H1
    (when W <= F + B), and none for ZB-V (with at least 2S-1 microbatches) or 2BW's steady state."""
    F, B, W = costs.forward, costs.backward, costs.weight
    if schedule in ("zbv", "2bw"):  # 2bw: in the steady state, its pipeline never drains
        return 0.0
    if schedule == "zb-h1":
        return (stages - 1) * max(F + B - W, 0.0)
    return (stages - 1) * (F + B + W)


def formula_idle_fraction(schedule: str, stages: int, microbatches: int, virtual: int = 1) -> float:
    """The idle fraction over the whole step with every action one tick: (S-1)/(v*M+S-1) for GPipe and
    the 1F1B family; for ZB-H1, 3M ticks of work per stage and the paper's bubble of S-1 ticks,
    (S-1)/(3M+S-1); for ZB-V (two chunks per stage, 6M ticks of work, no bubble inside a stage's
    span from M >= 2S-1 on), (S-1)/(6M+S-1): only the S-1 ticks the last stage waits for its first
    input. No schedule whose stages all start after their first input arrives can idle less. 2BW's
    steady state idles not at all: the next step's warm-up fills the step's cool-down."""
    if schedule == "2bw":
        return 0.0
    if schedule == "zb-h1":
        return (stages - 1) / (3 * microbatches + stages - 1)
    if schedule == "zbv":
        return (stages - 1) / (6 * microbatches + stages - 1)
    return theoretical_idle_fraction(stages, microbatches, virtual)


def lockstep_seconds(table: Table, cost: Callable[[Action], float]) -> float:
    """The step as the SPMD program runs it: the sum over ticks of the slowest stage's action."""
    return sum(max((cost(a) for a in row if a is not None), default=0.0) for row in table.ticks)
