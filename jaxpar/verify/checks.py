"""verify's judgement, tensor by tensor: what a layout can get wrong, each at the precision policy's tolerance.

- the gradients of every step (at the first, both sides take them at the same weights on the same batch; later
  the weights differ by the rounding the other checks bound): each tensor's gradient against the reference's,
  relative to the reference's (a scale, a sign, a missing or doubled reduction, a tensor whose gradient never
  arrives, gradients on the wrong version of the weights: all fail, in every precision, whatever the optimizer);
- the gradient norm at every step, before clipping (AdamW cannot see a constant scale and clipping hides it
  from the weights; the norm shows it at once);
- each tensor's update, its change from the start after the run: Δ_layout against Δ_reference, relative to
  ‖Δ_reference‖ and not to the tensor, so a tensor that does not move, or moves a fraction of what it should,
  fails however large its weights are;
- where the policy gauges its own rounding (fp8: jaxpar.config.precision.FP8_ROUNDING_SHARE), the whole gradient's
  distance from the reference as a share of that rounding at every step (rounding_share): fp8 against an fp8
  reference differs by rounding flips of about half of fp8's own effect, so a layout that lost its fp8 GEMMs, or
  quantizes by other scales, is within every tensor's tolerance but twice as far as a clean layout here;
- the weights themselves, relative to each tensor (param_max_rel_err, as before, over the tensors that start
  nonzero), which the update check contains and which stays for comparison with earlier runs.

A tensor whose reference gradient (update) is a smaller share of the whole step's than the policy's error_floor
is judged against that share instead of its own size: below it, its difference is the rounding of the other
tensors' sums (an untouched embedding row, a LoRA A while its B is still near zero), not a wrong gradient.
Every check reports its worst tensor; `failures` lists the worst offences of every check, largest first.
"""

from __future__ import annotations

import numpy as np

WORST_REPORTED = 5  # the failing tensors the result lists


def _norm(x: np.ndarray) -> float:
    return float(np.linalg.norm(np.asarray(x, np.float64)))


def _errors(layout: dict, reference: dict, floor: float) -> dict[str, float]:
    """{tensor: ‖layout - reference‖ / ‖reference‖}, each denominator at least `floor` times the whole tree's
    norm (the precision policy's error_floor; a tensor both sides leave at exactly zero: 0)."""
    whole = float(np.sqrt(sum(_norm(value) ** 2 for value in reference.values())))
    errors = {}
    for key, ref in reference.items():
        diff, size = _norm(np.asarray(layout[key], np.float64) - ref), max(_norm(ref), floor * whole)
        errors[key] = diff / size if size > 0 else (0.0 if diff == 0 else np.inf)
    return errors


def gradient_errors(grads: dict, ref_grads: dict, floor: float) -> dict[str, float]:
    """Each tensor's gradient error (the trainable tensors: a frozen one has no gradient)."""
    return _errors(grads, {key: np.asarray(value) for key, value in ref_grads.items() if np.size(value)}, floor)


def update_errors(params: dict, ref_params: dict, initial: dict, floor: float) -> dict[str, float]:
    """Each tensor's update error: (params - initial) against (ref_params - initial)."""
    return _errors({key: np.asarray(params[key], np.float64) - initial[key] for key in ref_params},
                   {key: np.asarray(ref, np.float64) - initial[key] for key, ref in ref_params.items()}, floor)


def rounding_share(grads: dict, ref_grads: dict, gauge_grads: dict) -> float:
    """‖layout - reference‖ / ‖gauge - reference‖ over the whole gradient: how much of the policy's own rounding
    (the gauge: the reference's gradient at the same weights in the gauge's precision) the layout differs by."""
    keys = [key for key, value in ref_grads.items() if np.size(value)]

    def distance(side: dict) -> float:
        return float(np.sqrt(sum(_norm(np.asarray(side[key], np.float64) - np.asarray(ref_grads[key], np.float64)) ** 2
                                 for key in keys)))

    layout, rounding = distance(grads), distance(gauge_grads)
    return layout / rounding if rounding > 0 else (0.0 if layout == 0 else np.inf)


def norm_errors(norms: list[float], ref_norms: list[float]) -> list[float]:
    """The gradient norm's relative error at each step (a non-finite norm: inf)."""
    return [abs(a - b) / max(abs(b), 1e-30) if np.isfinite(a) else np.inf for a, b in zip(norms, ref_norms)]


def worst_first(failures: list[dict]) -> list[dict]:
    """Failures ordered by their error relative to their tolerance, the largest first."""
    return sorted(failures, key=lambda f: f["error"] / f["tolerance"], reverse=True)


class Verdict:
    """The checks' worst errors and the failures among them, gathered check by check."""

    def __init__(self):
        self.worst: dict[str, float] = {}
        self.failures: list[dict] = []

    def add(self, check: str, errors: dict, tolerance: float) -> None:
        """Record check `check` over {what: error} (tensors, or 'step N') against `tolerance`."""
        self.worst[check] = max(errors.values(), default=0.0)
        self.failures += [{"check": check, "where": where, "error": float(error), "tolerance": tolerance}
                          for where, error in errors.items() if not error <= tolerance]

    def add_steps(self, check: str, errors: list[float], tolerance: float, first: int = 1) -> None:
        """Record check `check` over one error a step, the first of them step `first`."""
        self.add(check, {f"step {first + i}": error for i, error in enumerate(errors)}, tolerance)

    def report(self) -> dict:
        """{check: its worst error, ..., 'failures': the worst offences, largest relative to tolerance first}."""
        worst = worst_first(self.failures)[:WORST_REPORTED]
        return {**self.worst, "failures": worst}

    @property
    def ok(self) -> bool:
        return not self.failures
