"""verify's judgement of a mixture-of-experts layout's routing, replayed in the reference.

The layout's step records every decision (jaxpar.model.routing_trace), and the reference step
takes those decisions instead of its own, so both train along the same discrete path and
their weights can be compared at the usual tolerance. The reference's routers also report
where their own decision would have differed (a flip) and by how much their scores preferred
it (the margin, a relative gap). A flip within the precision policy's tie tolerance is a tie:
two scores that the layouts' different summation orders (or the policy's rounding) can swap.
A flip beyond it is a bug, and so is a decision the reference does not reproduce when it
replays it (a token kept or dropped at capacity differently under the same choices).
"""

from __future__ import annotations

import numpy as np

WORST_REPORTED = 5  # the flips with the largest margins that the result lists


class RoutingCheck:
    """Ties and flips over a run's steps. every: layers per MoE layer (every every-th of the units' layers);
    tolerance: the policy's tie tolerance; first: the layers before the units (model.moe.first_dense)."""

    def __init__(self, every: int, tolerance: float, first: int = 0, max_tie_share: float = 0.0):
        self.every, self.tolerance, self.first, self.max_tie_share = every, tolerance, first, max_tie_share
        self.ties = self.flips = self.decisions = 0
        self.worst: list[dict] = []

    @staticmethod
    def _summed(metrics, key: str) -> np.ndarray:
        """A traced per-token metric (U, R, L, ...) as summed over the U MoE layers: the step reports it
        averaged over them."""
        values = np.asarray(metrics[key], np.float64)
        return values * values.shape[0]

    def codes(self, metrics) -> np.ndarray:
        """The decisions a step's metrics hold, (U, R, L, E) integers (rounded to the integers they are)."""
        return np.rint(self._summed(metrics, "moe_routing_codes"))

    def replay_input(self, codes_URLE: np.ndarray) -> np.ndarray:
        """The decisions as the reference step takes them: per row, (R, U, L, E) in fp32."""
        return np.ascontiguousarray(codes_URLE.transpose(1, 0, 2, 3), np.float32)

    def add(self, step: int, codes_URLE: np.ndarray, ref_metrics) -> None:
        """Judge one step: the layout's decisions, and the reference's metrics after replaying them."""
        flipped = np.rint(self._summed(ref_metrics, "moe_routing_flips")) > 0
        margins = self._summed(ref_metrics, "moe_routing_margins")
        unreproduced = np.any(self.codes(ref_metrics) != codes_URLE, axis=-1)
        margins = np.where(unreproduced, np.inf, margins)
        flipped |= unreproduced
        tie = flipped & (margins <= self.tolerance)
        self.decisions += flipped.size
        self.ties += int(np.count_nonzero(tie))
        self.flips += int(np.count_nonzero(flipped & ~tie))
        for unit, row, position in zip(*np.nonzero(flipped)):
            margin = float(margins[unit, row, position])
            layer = self.first + int(unit) * self.every + self.every - 1
            self.worst.append({"step": step + 1, "layer": layer, "row": int(row), "position": int(position),
                               "margin": None if np.isinf(margin) else margin})
        self.worst = sorted(self.worst, key=_severity, reverse=True)[:WORST_REPORTED]

    @property
    def tie_share(self) -> float:
        """The ties' share of the decisions judged (a token's choice in one MoE layer at one step)."""
        return self.ties / max(self.decisions, 1)

    @property
    def ok(self) -> bool:
        """No flip, and no more ties than clean layouts make in this precision: many small-margin changes are a
        bug whose margins are small (a balancing bias's sign, a capacity order), not rounding: every check of
        judged() within its bound (a flip's margin lies beyond the tolerance, and flips lead the worst margins)."""
        return all(value <= bound for values, bound in self.judged().values() for value in values.values())

    def judged(self) -> dict[str, tuple[dict, float]]:
        """{check: ({what: value}, its bound)} for verify's verdict: the largest margins among the changed decisions
        (a flip: beyond the tie tolerance; a decision the replay did not reproduce: inf), and the ties' share."""
        margins = {f"step {f['step']} layer {f['layer']} row {f['row']} position {f['position']}":
                   np.inf if f["margin"] is None else f["margin"] for f in self.worst}
        return {"routing_margin": (margins, self.tolerance),
                "routing_tie_share": ({"decisions": self.tie_share}, self.max_tie_share)}

    def report(self) -> dict:
        """routing_changes {ties, flips, decisions, tie_share}, the tie tolerance and the ties' largest share,
        and the flips with the largest margins (a margin of None: the reference did not reproduce the
        layout's decision when replaying it)."""
        return {"routing_changes": {"ties": self.ties, "flips": self.flips, "decisions": self.decisions,
                                    "tie_share": self.tie_share},
                "tie_tolerance": self.tolerance, "max_tie_share": self.max_tie_share, "worst_margins": self.worst}


def _severity(flip: dict) -> float:
    return np.inf if flip["margin"] is None else flip["margin"]
