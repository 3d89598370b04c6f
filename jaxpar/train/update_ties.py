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

from jaxpar.train.checkpoint_fit import flat_by_path

# Measured (fp32, GRPO on the small model, data=4 x tensor=2, ZeRO-3): the layout's step-1 gradients differ
# from the reference's by up to 1.1e-5 of their tensor's RMS gradient. An error d in a gradient moves Adam's
# update by about d / sqrt(v) of lr, so from a root of 2^-12 (2.4e-4) of the RMS up it moves by under 5% of
# lr; 222 of the model's 215k elements lie below it, and without them the weights agree to 1.0e-5 (2^-14: 53
# elements, 1.4e-5; none: 1.3e-4, one wo element moved by 0.24 lr).
# Reduced precisions compare against fp32 at tolerances that already cover their rounding of every update.
TIE_TOLERANCE = 2.0 ** -12


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

    def __init__(self, initial_params: dict[str, np.ndarray]):
        self.initial = initial_params  # the reference's weights before its first step, by path
        self.ties: dict[str, np.ndarray] = {}  # path -> elements that were ties after some step

    def add(self, opt_state) -> None:
        """Mark the elements whose second-moment root after this step is nonzero and within the tie
        tolerance."""
        for key, nu in _second_moments(opt_state).items():
            # an element with no gradient yet (an embedding row no batch used) has no update to judge
            tied = (nu > 0) & (np.sqrt(nu) < TIE_TOLERANCE * np.sqrt(np.mean(nu, dtype=np.float64)))
            self.ties[key] = self.ties[key] | tied if key in self.ties else tied

    def split(self, key: str, params: np.ndarray, ref_params: np.ndarray):
        """(the layout's and the reference's weights of tensor `key` without its ties, whether its ties lie
        within twice the farthest the reference moved any of its weights)."""
        tied = self.ties.get(key)
        if tied is None or not tied.any():
            return params, ref_params, True
        reach = 2 * np.max(np.abs(ref_params - self.initial[key]))
        within = bool(np.all(np.abs(params[tied] - ref_params[tied]) <= reach))
        return params[~tied], ref_params[~tied], within

    def count(self) -> int:
        """How many elements were judged as ties."""
        return int(sum(np.count_nonzero(tied) for tied in self.ties.values()))
