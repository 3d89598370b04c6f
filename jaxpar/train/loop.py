"""The training loop: resume from the newest checkpoint, dispatch step N then read step N-1's
metrics (async dispatch stays busy), checkpoint, and stop cleanly on SIGTERM/SIGINT (the validation
loss and the finished run's summary: jaxpar.train.run_summary)."""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import jax
from tqdm import tqdm

from jaxpar.config.sources import token_source
from jaxpar.data.token_folder import is_token_folder
from jaxpar.evals.in_loop import TaskEvals
from jaxpar.features.evals import tasks_due
from jaxpar.runtime.distributed import ENV_ATTEMPT, StopAgreement, is_secondary
from jaxpar.runtime.elastic import record_rows
from jaxpar.runtime.goodput import Timeline
from jaxpar.runtime.jsonl import append_jsonl, read_jsonl
from jaxpar.session import Session
from jaxpar.train.checkpoint import Checkpoints
from jaxpar.train.feeds import feed_for
from jaxpar.train.local_copy import LocalCopies
from jaxpar.train.report import write_jsonl_atomic
from jaxpar.train.run_summary import summarize, validation_losses, validation_metrics
from jaxpar.train.saves import Saves, resume
from jaxpar.train.sinks import MetricSinks
from jaxpar.train.trainer import Trainer


class NonFiniteLoss(Exception):
    """The loss or gradient norm became non-finite under train.on_nonfinite=stop (the CLI exits with 1)."""


class StopSignals:
    """While active, SIGTERM or SIGINT asks the loop to finish the current step, save and stop.

    A second signal takes the usual way out (SIGINT raises KeyboardInterrupt, SIGTERM ends
    the process), so a stuck run can still be interrupted.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.received: str | None = None
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def _handle(self, signum, frame) -> None:
        self.received = signal.Signals(signum).name
        self._restore()
        print(f"\njaxpar: {self.received} received; finishing the current step, then saving a checkpoint.",
              file=sys.stderr)

    def _restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def __exit__(self, *exc) -> None:
        self._restore()


def _primary() -> bool:
    """Process 0 writes the run's files, messages and progress bar; the others only compute."""
    return not is_secondary()


def _say(message: str) -> None:
    if _primary():
        print(message, file=sys.stderr)


def _warn(message: str) -> None:
    _say(f"jaxpar: warning: {message}")


def _logged(step: int, cfg) -> bool:
    """Whether step `step` gets a metrics.jsonl line: every log_every steps, plus the first and the last,
    under local SGD every synchronizing step (with the replicas' spread), and every step that measures
    the validation loss (train.eval_every) or runs the tasks (train.eval_tasks_every)."""
    t, sync_every = cfg.train, cfg.parallel.sync_every
    return (step % t.log_every == 0 or step in (1, t.steps) or (sync_every > 1 and step % sync_every == 0)
            or _evaluated(step, t) or tasks_due(step, t))


def _evaluated(step: int, t) -> bool:
    """Whether step `step` measures the validation loss (train.eval_every)."""
    return bool(t.eval_every) and step % t.eval_every == 0


def _kept_metrics(path: Path, step: int, cfg) -> list[dict]:
    """The rows of metrics.jsonl that an uninterrupted run would have logged up to `step`."""
    return [r for r in read_jsonl(path) if r["step"] <= step and _logged(r["step"], cfg)]


def trim_metrics(path: Path, step: int, cfg) -> list[dict]:
    """Cut metrics.jsonl down to its rows up to `step` (empty for step 0, but kept), and return them:
    training goes on from `step`, so the later rows are redone."""
    history = _kept_metrics(path, step, cfg)
    write_jsonl_atomic(path, history)
    return history


def train(session: Session, progress: bool = True, model=None, rules=None, started: float | None = None) -> dict:
    """Train (resuming from <run.dir>/checkpoints when it holds one), write metrics.jsonl, summary.json
    and loss.png under run.dir, and return the summary.

    On SIGTERM/SIGINT the current step is finished and checkpointed, and the returned dict has
    'preempted' (the signal's name) and 'step'. Raises NonFiniteLoss when the loss stops being
    finite under train.on_nonfinite=stop, and CheckpointMismatch (a UserError) before anything
    is compiled when the checkpoint does not fit the config. Raises a RunFailed when a checkpoint
    cannot be restored although it is not damaged (RestoreFailed, nothing moved or trimmed), or
    when the coordinator of a multi-process run stops answering (CoordinatorFailed). The last
    save is on disk before this returns or raises. `model` and `rules`: a module of your own and
    its rules, as for Trainer. `started`: when the process began (time.time()), for goodput.
    """
    cfg = session.cfg
    trainer = Trainer(session, model, rules)
    checkpoints = Checkpoints(Path(cfg.run.dir) / "checkpoints", cfg.checkpoint.keep, cfg.checkpoint.async_)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(checkpoints.close)
        return _train(session, trainer, checkpoints, progress, cleanup, time.time() if started is None else started)


class _StepLog:
    """Reads each step's metrics (after the next step is dispatched), times the step, writes the logged
    rows to metrics.jsonl (and the run's other sinks), moves the progress bar, and stops a run whose loss is no
    longer finite."""

    def __init__(self, session: Session, metrics_path: Path, sinks: MetricSinks, bar, checkpoints: Checkpoints,
                 timeline: Timeline):
        cfg = session.cfg
        self.timeline = timeline
        self.cfg, self.metrics_path, self.sinks, self.bar, self.checkpoints = cfg, metrics_path, sinks, bar, checkpoints
        self.session = session
        self.tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
        # a policy with loss scaling skips non-finite steps instead
        self.stop_on_nonfinite = cfg.train.on_nonfinite == "stop" and not session.precision.loss_scaling
        self.records: list[dict] = []
        self.last_time = time.perf_counter()

    def finish(self, step: int, metrics, val_losses=None, rows: dict | None = None, scores: dict | None = None) -> None:
        """Read and log step `step`'s metrics; `rows`: what the host knows of packed rows (their
        packing_efficiency, the share of token slots holding document tokens, which tokens/s counts
        alone; a mixture's share/<folder>); `scores`: the tasks' metrics (train.eval_tasks)."""
        values = {k: v.tolist() for k, v in jax.device_get(metrics).items()}  # scalars, or lists (per expert)
        values.pop("completed", None)  # the pacing's own, not a metric (jaxpar.train.pacing)
        if val_losses is not None:
            values.update(validation_metrics(val_losses, self.session))
        values.update(scores or {})
        if "source_loss" in values:  # a mixture: each source's mean loss over its counted targets
            losses, targets = values.pop("source_loss"), values.pop("source_targets")
            values.update({f"loss/{name}": loss / count for (name, _), loss, count
                           in zip(self.session.mixture, losses, targets) if count > 0})
        if not values.pop("synced", True):  # local SGD: the replicas' spread is measured when they synchronize
            del values["replica_spread"]
        now = time.perf_counter()
        step_time, self.last_time = now - self.last_time, now
        self.timeline.step(step, step_time)
        rows = rows or {}
        if "generate_s" in rows:  # GRPO: sampling's share of the step (jaxpar.train.feeds.RolloutFeed)
            rows = {**rows, "generate_share": min(rows["generate_s"] / step_time, 1.0)}
        real = self.tokens_per_step * rows.get("packing_efficiency", 1.0)
        record = {"step": step, **values, "step_time_s": step_time, "tokens_per_s": real / step_time, **rows}
        self.records.append(record)
        if _logged(step, self.cfg) and _primary():
            append_jsonl(self.metrics_path, record)
            self.sinks.record(record)
        self.bar.set_postfix(loss=f"{values['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        self.bar.update(1)
        if self.stop_on_nonfinite:
            for name, key in (("loss", "loss"), ("gradient norm", "grad_norm")):
                if not math.isfinite(values[key]):
                    raise NonFiniteLoss(_nonfinite_message(step, name, values[key], self.checkpoints))

    def exclude(self, seconds: float) -> None:
        """Leave `seconds` (a save) out of the time of the step being timed."""
        self.last_time += seconds


def _announce(session: Session) -> None:
    cfg = session.cfg
    processes = ""
    if jax.process_count() > 1:
        split = session.process_split
        processes = f", {jax.process_count()} processes over " + " x ".join(
            f"{axis}={n}" for axis, n in split.items() if n > 1)
    if cfg.model.from_hf and not is_token_folder(token_source(cfg.data)):
        _warn(f"data.source={cfg.data.source} is read as bytes, but model.from_hf's token ids are its tokenizer's; "
              f"tokenize the text first: jaxpar tokenize --input FILE --tokenizer {cfg.model.from_hf} --out DIR.")
    _say(f"jaxpar: training {cfg.model.n_layers}-layer d={cfg.model.d_model} model on {session.mesh_name()} "
         f"({len(session.devices)} {session.devices[0].platform} devices{processes}), {cfg.train.steps} steps")


def _run_steps(session: Session, trainer: Trainer, saves: Saves, log: _StepLog, state, start: int,
               evals: TaskEvals):
    """Train from step `start` to train.steps, saving as `saves` says and at the end; returns (state, the last
    step taken, the signal that stopped the run or None)."""
    t = session.cfg.train
    stopped_by, step = None, start
    agreement = StopAgreement()  # every process of a multi-process run stops at the same step
    feed, pace = feed_for(session, trainer), trainer.pacing
    with StopSignals() as signals:
        pending, previous_rows = None, {}
        for index in range(start, t.steps):
            batch, rows = feed.batch(index, state)
            state, metrics = trainer.step(state, batch)
            if pending is not None:
                log.finish(*pending)
            step = index + 1
            done = pace.logged(step, index == start, metrics)  # the step whose metrics these are (0: none)
            # dispatched now, on the weights of step `done`; read with its metrics
            val = validation_losses(trainer, state.params, session) if done and _evaluated(done, t) else None
            scores = _task_scores(evals, log, state, done)
            pending = (done, metrics, val, pace.rows(rows, previous_rows), scores) if done else None
            previous_rows = rows
            stopping = agreement.should_stop(step, signals.received is not None)
            stopping = stopping and not (pace.finishes and step == t.steps)  # then `finish` ends the run
            if saves.due(step, stopping):
                # Read this step's metrics first: only a finite step is checkpointed.
                if pending is not None:
                    log.finish(*pending)
                pending = None
                saves.save(step, state, stopping)
            if stopping:
                stopped_by = signals.received or "a signal to another process"
                break
        if pending is not None:
            log.finish(*pending)
    if stopped_by is None and start < t.steps:
        state, metrics = pace.finish(state)
        if metrics is not None:  # the last step's update and metrics came after it
            val = validation_losses(trainer, state.params, session) if _evaluated(t.steps, t) else None
            log.finish(t.steps, metrics, val, previous_rows, _task_scores(evals, log, state, t.steps))
        saves.final(t.steps, state)
    return state, step, stopped_by


def _task_scores(evals: TaskEvals, log: _StepLog, state, step: int) -> dict | None:
    """The tasks' metrics when step `step` runs them (their time left out of the step's), else None."""
    if not (step and evals.due(step)):
        return None
    scores, seconds = evals.run(state.params)
    log.exclude(seconds)
    return scores


def _train(session: Session, trainer: Trainer, checkpoints: Checkpoints, progress: bool,
           cleanup: contextlib.ExitStack, started: float) -> dict:
    cfg = session.cfg
    evals = TaskEvals(session, trainer)  # the tasks' datasets read before anything compiles
    run_dir = Path(cfg.run.dir)
    local = LocalCopies(run_dir, cfg.checkpoint.local_every)
    resumed, source, where = resume(checkpoints, local, trainer, _warn)
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = run_dir / "metrics.jsonl"
    primary = _primary()
    if cfg.run.elastic and primary:
        record_rows(run_dir, cfg, session.mesh_sizes)  # what later starts on other device counts keep
    if resumed is not None:
        state, start = resumed.state, resumed.step
        _say(f"jaxpar: resuming from the {'in-memory copy' if source == 'memory' else 'checkpoint'} at step {start} "
             f"in {where}")
    else:
        state, start = trainer.init(), 0
    logged = trainer.pacing.completed(state, start)  # the steps whose metrics are logged (jaxpar.train.pacing)
    history = trim_metrics(metrics_path, logged, cfg) if primary else _kept_metrics(metrics_path, logged, cfg)
    sinks = MetricSinks.open(cfg, run_dir, start, primary)
    cleanup.callback(sinks.close)
    _announce(session)
    bar = tqdm(total=cfg.train.steps, initial=min(start, cfg.train.steps), desc="train", unit="step",
               disable=not (progress and primary), file=sys.stderr, dynamic_ncols=True)
    timeline = Timeline(run_dir, primary)
    timeline.start(started, start, source, attempt=os.environ.get(ENV_ATTEMPT), devices=len(session.devices),
                   processes=jax.process_count(), layout=session.layout_name())
    log = _StepLog(session, metrics_path, sinks, bar, checkpoints, timeline)
    saves = Saves(cfg, trainer, checkpoints, local, timeline, log.exclude)
    try:
        state, step, stopped_by = _run_steps(session, trainer, saves, log, state, start, evals)
    finally:
        bar.close()
    saves.done()
    timeline.end(step, finished=stopped_by is None)
    if stopped_by is not None:
        _say(f"jaxpar: stopped by {stopped_by} after step {step}; the checkpoint at step {step} is in "
             f"{checkpoints.directory}, and the same command resumes from it.")
        return {"preempted": stopped_by, "step": step, "checkpoint_dir": str(checkpoints.directory)}
    return summarize(session, trainer, state, history + log.records, log.records, sinks)


def _nonfinite_message(step: int, name: str, value: float, checkpoints: Checkpoints) -> str:
    if checkpoints.last_step is None:
        where = "there is no checkpoint to go back to"
    else:
        where = f"the last good checkpoint is step {checkpoints.last_step} in {checkpoints.directory}"
    return (f"training stopped at step {step} because the {name} is {value}; {where} "
            f"(train.on_nonfinite=skip would skip such steps instead).")
