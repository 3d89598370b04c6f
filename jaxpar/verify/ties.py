"""verify's judgement of Adam's near-ties: weights whose update the reference took from a gradient within
rounding of zero.

Adam divides each element's first moment by the root of its second, so its update is about lr whatever the
gradient's size. An element whose gradients so far are all near zero takes that update from a gradient
that is mostly rounding: GRPO's advantages sum to zero in each group, so its gradients are differences of
similar terms, and one of the small model's wo elements took a step-1 gradient of -2.7e-9 on one device and
2.6e-10 under data=4 x tensor=2 (its tensor's RMS gradient: 8.6e-4), a difference of 0.24 lr that alone is
1.3e-4 of the tensor's norm. Which way such an element moves is a near-tie, like a router's: the layout
cannot be asked to reproduce it, so it is judged by its margin. An element whose second-moment root in the
reference is below TIE_TOLERANCE times its tensor's root-mean-square, after any step, is a tie: it is left
out of its tensor's norm-wise error, counted, and only required to lie within twice the farthest the
reference moved any weight of its tensor (an element that went further is wrong, whatever its gradient).
"""

from __future__ import annotations

import numpy as np
import optax

from jaxpar.interop.checkpoint_files import flat_by_path

# Measured (fp32, GRPO on the small model, data=4 x tensor=2, ZeRO-3): the layout's step-1 gradients differ
# from the reference's by up to 1.1e-5 of their tensor's RMS gradient. An error d in a gradient moves Adam's
# update by about d / sqrt(v) of lr, so from a root of 2^-12 (2.4e-4) of the RMS up it moves by under 5% of
# lr; 222 of the model's 215k elements lie below it, and without them the weights agree to 1.0e-5 (2^-14: 53
# elements, 1.4e-5; none: 1.3e-4, one wo element moved by 0.24 lr).
# Reduced precisions compare against fp32 at tolerances that already cover their rounding of every update.
TIE_TOLERANCE = 2.0 ** -12
# Ties are few, and in fp32 mostly go the reference's way; a layout that moves them otherwise is wrong, not tied.
# Their share of the elements is the reference's, bounded by the reference's precision: an fp32 reference's up to
# 0.17% (GRPO on tests/fault_catalog.py's layout, 5 steps), an fp8 reference's, which rounds its gradients to e5m2,
# 0.32% there; twice those, rounded.
MAX_TIE_SHARE = {"fp32": 4e-3, "fp8": 7e-3}
# Where the layout rounds its gradients below fp32 (bf16, fp8, or bf16 reductions: 2^-8 of a gradient and more)
# a tie's gradient, below 2^-12 of its tensor's RMS, is the layout's rounding, and so is its direction: GRPO's
# clean layout in tests/fault_catalog.py reversed 37% (bf16) and 47% (fp8) of its ties over 3 steps, the sweep's
# draw 44 (fp8) 33%, a coin's share. There only their count and their reach are judged.
MAX_REVERSED_SHARE = 0.25
FEWEST_JUDGED = 8  # the reversed share is over at least this many ties: one or two of a handful may go either way


def _second_moments(opt_state) -> dict[str, np.ndarray]:
    """{parameter path: Adam's second moment} for every element an Adam (AdamW's, or Muon's for the weights
    it leaves to AdamW) updates; none for Adafactor, which keeps factored statistics. Only these are copied
    from the device."""
    moments = {}
    for _, nu in optax.tree_utils.tree_get_all_with_path(opt_state, "nu"):
        moments.update({key: np.asarray(value) for key, value in flat_by_path(nu).items()})
    return moments


class UpdateTies:
    """Adam's near-ties in the reference over a run's steps, and the judgement of the weights they touch."""

    def __init__(self, initial_params: dict[str, np.ndarray], reference: str, judge_direction: bool):
        self.initial = initial_params  # the reference's weights before its first step, by path
        # the bound on the tied share (by the reference's train.precision), and whether the ties' direction is the
        # gradient's, not the layout's rounding (MAX_REVERSED_SHARE)
        self.max_share, self.judge_direction = MAX_TIE_SHARE[reference], judge_direction
        self.ties: dict[str, np.ndarray] = {}  # path -> elements that were ties after some step
        self.reached: dict[str, float] = {}  # path -> the tied elements' farthest move beyond the tensor's reach
        self.reversed = self.moved = 0  # tied elements the two sides moved opposite ways, and those moved at all

    def add(self, opt_state) -> None:
        """Mark the elements whose second-moment root after this step is nonzero and within the tie
        tolerance."""
        for key, nu in _second_moments(opt_state).items():
            # an element with no gradient yet (an embedding row no batch used) has no update to judge
            tied = (nu > 0) & (np.sqrt(nu) < TIE_TOLERANCE * np.sqrt(np.mean(nu, dtype=np.float64)))
            self.ties[key] = self.ties[key] | tied if key in self.ties else tied

    def without_ties(self, params: dict, ref_params: dict, initial: dict) -> tuple[dict, dict, dict]:
        """The three {path: weights} without their tied elements (flattened), after judging those."""
        out = ({}, {}, {})
        for key, ref in ref_params.items():
            tied = self.ties.get(key)
            if tied is None or not tied.any():
                for side, value in zip(out, (params[key], ref, initial[key])):
                    side[key] = value
                continue
            self._judge(key, np.asarray(params[key], np.float64), np.asarray(ref, np.float64), initial[key], tied)
            for side, value in zip(out, (params[key], ref, initial[key])):
                side[key] = np.asarray(value)[~tied]
        return out

    def _judge(self, key: str, params, ref, initial, tied) -> None:
        move, ref_move = (params - initial)[tied], (ref - initial)[tied]
        reach = 2 * np.max(np.abs(ref - initial))
        self.reached[key] = float(np.max(np.abs(move - ref_move)) / reach) if reach > 0 else 0.0
        moved = (ref_move != 0) & (move != 0)
        self.moved += int(np.count_nonzero(moved))
        self.reversed += int(np.count_nonzero(moved & (np.sign(move) != np.sign(ref_move))))

    def judged(self) -> dict[str, tuple[dict, float]]:
        """{check: ({what: value}, its bound)}: the tied share of the elements, the share of tied elements moved
        the other way, and each tensor's farthest tied move as a share of twice its farthest update."""
        elements = sum(tied.size for tied in self.ties.values())
        direction = {"tie_reversed_share": ({"ties": self.reversed / max(self.moved, FEWEST_JUDGED)},
                                            MAX_REVERSED_SHARE)} if self.judge_direction else {}
        return {"tie_share": ({"ties": self.count() / max(elements, 1)}, self.max_share), **direction,
                "tie_reach": (self.reached, 1.0)}

    def count(self) -> int:
        """How many elements were judged as ties."""
        return int(sum(np.count_nonzero(tied) for tied in self.ties.values()))
