"""Every save a run makes, timed: the shared checkpoint every checkpoint.every steps, when the run stops,
and when it completes (unless checkpoint.final=false); the in-memory copy every checkpoint.local_every
steps; and the resume that reads the newer of the two. What a save holds training for is a `save` row of
the timeline, and it is left out of the next step's time (jaxpar.runtime.goodput)."""

from __future__ import annotations

import time
from collections.abc import Callable

from jaxpar.runtime.goodput import Timeline
from jaxpar.train.checkpoint import Checkpoints, Restored, state_spec
from jaxpar.train.local_copy import LocalCopies


def resume(checkpoints: Checkpoints, local: LocalCopies, trainer, warn: Callable[[str], None]
           ) -> tuple[Restored | None, str, str]:
    """The newest state to go on from, where it came from ('memory', 'checkpoint' or 'init') and the folder
    it was read from: the in-memory copy when it is complete and no older than the newest shared
    checkpoint, which is then not read at all; else the shared checkpoints (jaxpar.train.checkpoint)."""
    if local.every:
        shared = checkpoints.steps()
        restored = local.restore(trainer, shared[-1] if shared else None, str(checkpoints.directory))
        if restored is not None:
            checkpoints.last_step = restored.step
            return restored, "memory", str(local.run)
    restored = checkpoints.restore_latest(trainer, warn)
    return restored, "checkpoint" if restored is not None else "init", str(checkpoints.directory)


class Saves:
    """The saves of one attempt of a run, each timed into `timeline`; `exclude(seconds)` takes a save's
    time out of the step being timed."""

    def __init__(self, cfg, trainer, checkpoints: Checkpoints, local: LocalCopies, timeline: Timeline,
                 exclude: Callable[[float], None]):
        self.cfg, self.trainer, self.checkpoints, self.local = cfg, trainer, checkpoints, local
        self.timeline, self.exclude = timeline, exclude
        self.every = cfg.checkpoint.every

    def due(self, step: int, stopping: bool) -> bool:
        """Whether step `step` is saved (read its metrics first: only a finite step is saved). A last step
        that is finished after it (jaxpar.train.pacing) waits for that (`final`)."""
        if self.trainer.pacing.finishes and step == self.cfg.train.steps:
            return False
        return stopping or self._periodic(step) or self.local.due(step)

    def _periodic(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0)

    def save(self, step: int, state, stopping: bool) -> None:
        if stopping or self._periodic(step):
            self._timed(step, "checkpoint", lambda: self.checkpoints.save(step, state, self.trainer))
        if self.local.due(step):
            meta = {"step": step, "seed": self.cfg.train.seed, "config": self.cfg.to_dict(), "spec": state_spec(state)}
            self._timed(step, "memory", lambda: self.local.save(step, state, meta))

    def final(self, step: int, state) -> None:
        """The last step's checkpoint (checkpoint.final), unless a periodic one was just written (where the
        last step is finished after it, the periodic one waited for that: it is this one)."""
        periodic, final = self._periodic(step), self.cfg.checkpoint.final
        if (final or periodic) if self.trainer.pacing.finishes else (final and not periodic):
            self._timed(step, "checkpoint", lambda: self.checkpoints.save(step, state, self.trainer))

    def _timed(self, step: int, kind: str, save: Callable[[], None]) -> None:
        began = time.perf_counter()
        save()
        seconds = time.perf_counter() - began
        self.timeline.save(step, seconds, kind)
        self.exclude(seconds)

    def done(self) -> None:
        """The run is over and its last checkpoint on disk: the in-memory copies are no longer needed."""
        self.checkpoints.wait()
        if self.local.every:
            self.local.remove()
