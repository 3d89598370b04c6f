"""How a strategy's steps line up with the steps of the run: what the loop, the saves and a resume ask of
it, so that none of them knows which strategy runs.

- `InStep` (synchronous training, local SGD, every schedule but 2BW): a step's call applies its own update
  and returns its own metrics; nothing is left to do after the last step.
- `OneBehind` (PipeDream-2BW, jaxpar.train.two_bw_step): a step's call completes the previous step (its
  update and metrics) while its own batch stays in flight; the first step after a start or a drain only
  fills the pipeline, and `finish` (the drain) completes the last step. What it has in flight is saved
  with the state, and only a layout that carries the same can resume a step in flight.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from jaxpar.train.checkpoint_fit import CheckpointMismatch
from jaxpar.train.state import IN_FLIGHT


class InStep:
    """Each step completes itself."""

    behind = 0  # how many steps a step's metrics trail it

    @property
    def finishes(self) -> bool:
        """Whether the last step is completed by `finish`, after it."""
        return self.behind > 0

    def logged(self, step: int, first: bool, metrics) -> int:
        """The step whose metrics the call of step `step` returned (0: none); `first`: the first call after
        a start."""
        return step

    def rows(self, rows: dict, previous: dict) -> dict:
        """What the host knew of the batch whose metrics were returned: this step's `rows`, or the previous
        step's `previous`."""
        return rows

    def completed(self, state, step: int) -> int:
        """The steps whose metrics and update a state saved after `step` steps holds."""
        return step

    def finish(self, state):
        """(the state after the run's last step completed, that step's metrics or None where the step itself
        returned them)."""
        return state, None


class OneBehind(InStep):
    """A step completes the one before it; `drain(state) -> (state, metrics)` completes the last."""

    behind = 1

    def __init__(self, drain: Callable):
        self.drain = drain

    def logged(self, step: int, first: bool, metrics) -> int:
        if first and not jax.device_get(metrics["completed"]):
            return 0  # the first step after a start or a drain only fills the pipeline
        return step - 1

    def rows(self, rows: dict, previous: dict) -> dict:
        return previous

    def completed(self, state, step: int) -> int:
        """One fewer while a batch is in flight (a state saved between steps, not after the drain)."""
        return step - bool(state.in_flight is not None and jax.device_get(state.in_flight.live))

    def finish(self, state):
        return self.drain(state)


# ---------------------------------------------------------------- a checkpoint of OneBehind's state


def in_flight_fits(saved: dict[str, list], expected: dict[str, list]) -> bool:
    """Whether what a 2BW run saved in flight is what this layout carries, array for array."""
    def flight(spec):
        return {k: v for k, v in spec.items() if k.startswith(IN_FLIGHT)}
    return flight(saved) == flight(expected)


def drop_idle_flight(arrays: dict, step: int, where) -> None:
    """Leave out what a 2BW run saved in flight, unless a step is in flight: that only a layout that carries
    the same can finish."""
    if IN_FLIGHT + "live" in arrays and bool(jax.device_get(arrays[IN_FLIGHT + "live"])):
        raise CheckpointMismatch(f"the checkpoint at step {step} in {where} holds a 2bw step in flight, which "
                                 f"only the layout that saved it can finish; resume with that layout (its mesh "
                                 f"and parallel.pipeline settings), or from a checkpoint of a finished run.")
    for key in [k for k in arrays if k.startswith(IN_FLIGHT)]:
        del arrays[key]
