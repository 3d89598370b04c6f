"""PipeDream-2BW without a flush: the steady window of the 1F1B stream, a run's idle fraction, the
compiled program's memory, and a resume from between any two steps with the microbatches in flight.
Its layouts against the single-device reference are verified with the other schedules'
(tests/test_pipeline.py)."""

import json

import numpy as np
import pytest
from helpers import SMALL_MODEL, steps_saved

from jaxpar.parallel.schedules import (
    Action,
    build,
    carried_stash_size,
    run_idle_fraction,
    run_tables,
    steady_window,
    two_steps,
)

GRID = [(S, M) for S in (2, 3, 4, 8) for M in (S, S + 1, 2 * S, 8) if M >= S]


@pytest.mark.parametrize("S, M", GRID)
def test_a_run_of_windows_does_every_microbatch_once_in_dependency_order(S, M):
    """Fill, steady windows and drain, laid end to end: each step's M microbatches get a forward and a
    backward on every stage, once, each after what it depends on; no window holds another step's than its
    own and the one before; a stage's backwards (and forwards) come in microbatch order."""
    steps = 4
    when, tick = {}, 0
    for t, table in enumerate(run_tables(S, M, steps)):
        assert table.idle_fraction == 0.0 or t in (0, steps)  # only the fill and the drain idle
        for row in table.ticks:
            for s, action in enumerate(row):
                if action is not None:
                    assert action.chunk == s and -M <= action.microbatch < M
                    micro = t * M + action.microbatch  # numbered over the run: step t's own are tM .. tM + M-1
                    key = Action(action.kind, micro, action.chunk)
                    assert key not in when
                    when[key] = tick
            tick += 1
    assert len(when) == 2 * steps * M * S
    # a run is one pipeline of N x M microbatches: the seed's (d-1)/(m+d-1) with m = N x M
    assert run_idle_fraction(run_tables(S, M, steps)) == pytest.approx((S - 1) / (steps * M + S - 1))
    for (kind, i, k), at in when.items():
        if kind == "F" and k > 0:
            assert when[Action("F", i, k - 1)] < at
        if kind == "B":
            assert when[Action("F", i, k)] < at and (k == S - 1 or when[Action("B", i, k + 1)] < at)
        if i > 0:
            assert when[Action(kind, i - 1, k)] < at  # microbatch order on each stage


def test_the_bubble_is_gone_in_the_steady_state():
    """S=4, M=8, F=B=1: a middle step idles not at all (1F1B: 3/11); a run of N steps idles at most
    1F1B's idle x 2/N + 0.02, since only its first step fills and the drain after its last empties."""
    S, M = 4, 8
    one_f_one_b = build("1f1b", S, M).idle_fraction
    assert one_f_one_b == pytest.approx(3 / 11)
    assert steady_window(S, M).idle_fraction == 0.0 <= 0.02
    for steps in (1, 2, 3, 10, 100):
        assert run_idle_fraction(run_tables(S, M, steps)) <= one_f_one_b * 2 / steps + 0.02, steps
    # at most S microbatches in flight per stage, in slots that keep their place from one step to the next
    assert max(two_steps(S, M).in_flight(s) for s in range(S)) <= S
    assert all(carried_stash_size(S, m) <= S and m % carried_stash_size(S, m) == 0 for m in (4, 8, 12))


def test_schedule_cli_draws_two_steady_steps(tmp_path, capsys):
    from jaxpar.cli import main

    out = tmp_path / "2bw.png"
    assert main(["schedule", "--schedule", "2bw", "--stages", "4", "--microbatches", "8", "--steps", "10",
                 "--out", str(out)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    last = json.loads(lines[-1])
    assert last["ticks"] == 2 * 16 and last["idle_fraction"] == last["theoretical_idle_fraction"] == 0.0
    assert last["run_steps"] == 10 and last["run_idle_fraction"] <= last["1f1b_idle_fraction"] * 2 / 10 + 0.02
    assert lines[0].split()[2:4] == ["F8", "B5"]  # stage 0 starts the step's first microbatch, then a backward
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _trainer(*overrides):
    from jaxpar.config.presets import load_config
    from jaxpar.train.run_session import prepare
    from jaxpar.train.trainer import Trainer

    return Trainer(prepare(load_config(None, [*SMALL_MODEL, "mesh.data=2", "mesh.stage=4", *overrides])))


@pytest.mark.slow
def test_compiled_2bw_holds_two_weight_versions_and_at_most_S_microbatches_in_flight():
    """From the compiled programs at S=4, M=8: 2BW's arguments are two versions of the weights, the
    optimizer state and what is in flight, whose stash has at most S slots per stage; its temporaries stay
    within 1.3x those of 1F1B."""
    import jax

    from jaxpar.plan import measure_step

    S, M = 4, 8
    plans = {s: measure_step(_trainer(f"parallel.pipeline.schedule={s}", f"parallel.pipeline.microbatches={M}"))
             for s in ("1f1b", "2bw")}
    trainer = _trainer("parallel.pipeline.schedule=2bw", f"parallel.pipeline.microbatches={M}")
    state = trainer.abstract_state()

    def per_device(tree):
        return sum(int(np.prod(a.sharding.shard_shape(a.shape))) * a.dtype.itemsize for a in jax.tree.leaves(tree))

    stash = state.in_flight.carry[0]
    assert stash.x.shape[1] == carried_stash_size(S, M) <= S  # (devices, slots, chunk, rows, seq, d_model)
    expected = per_device((state.params, state.stale_params, state.opt_state, state.in_flight, state.step,
                           state.loss_scale, trainer.abstract_batch()))
    assert plans["2bw"]["argument_bytes"] == expected + 1  # and whether the step has a batch of its own (a bool)
    assert plans["2bw"]["params_bytes"] == plans["1f1b"]["params_bytes"]
    assert plans["2bw"]["temp_bytes"] <= 1.3 * plans["1f1b"]["temp_bytes"]


def test_resume_from_between_any_two_steps_is_exact(tmp_path):
    """A state saved after each step (a batch in flight) and restored goes on with exactly the losses and
    weights of the run that was never stopped."""
    import jax

    from jaxpar.interop.checkpoint_files import flat_by_path
    from jaxpar.train.checkpoint import Checkpoints

    trainer = _trainer("parallel.pipeline.schedule=2bw", "train.batch_size=16")
    sampler, steps = trainer.session.train_data, 4

    def run(state, start):
        losses = []
        for index in range(start, steps):
            state, metrics = trainer.step(state, trainer.put_windows(sampler, sampler.starts(index)))
            losses.append(float(metrics["loss"]) if bool(metrics["completed"]) else None)
        state, metrics = trainer.pacing.finish(state)
        return losses + [float(metrics["loss"])], flat_by_path(jax.device_get(state.params))

    whole_losses, whole_params = run(trainer.init(), 0)
    assert whole_losses[0] is None and None not in whole_losses[1:]
    for cut in range(1, steps):
        state = trainer.init()
        for index in range(cut):
            state, _ = trainer.step(state, trainer.put_windows(sampler, sampler.starts(index)))
        checkpoints = Checkpoints(tmp_path / str(cut), keep=1)
        checkpoints.save(cut, state, trainer)
        restored = checkpoints.restore_latest(trainer, warn=pytest.fail)
        checkpoints.close()
        assert restored.step == cut and bool(restored.state.in_flight.live)
        losses, params = run(restored.state, cut)
        assert losses == whole_losses[cut:], cut
        for key, value in params.items():
            np.testing.assert_array_equal(value, whole_params[key], err_msg=key)


@pytest.mark.parametrize("overrides, saved", [({}, [6]), ({"checkpoint.every": 3}, [3, 6]),
                                               ({"checkpoint.every": 3, "checkpoint.final": False}, [3, 6]),
                                               ({"checkpoint.final": False}, [])])
def test_the_last_save_waits_for_the_drain(overrides, saved):
    """Under 2BW the state after the last step still has it in flight: its save, periodic or final, is the
    drained state's, made once after the drain."""
    from jaxpar.config import Config

    assert steps_saved(Config().replace(**overrides).replace(**{"train.steps": 6}), 6, finished_after=True) == saved


@pytest.mark.slow
def test_sigkill_between_steps_resumes_with_the_microbatches_in_flight(tmp_path):
    """`jaxpar train` killed (SIGKILL) after the save of step 3, a batch in flight, and run again logs the
    uninterrupted run's metrics exactly."""
    import signal
    import subprocess
    import sys
    import time

    from helpers import BASE, checkpoint_steps, metrics

    settings = [*BASE, *SMALL_MODEL, "model.n_layers=4", "mesh.data=2", "mesh.tensor=1", "mesh.stage=4",
                "parallel.pipeline.schedule=2bw", "train.batch_size=16", "train.steps=6"]

    def train(run_dir, *more):
        return subprocess.Popen([sys.executable, "-m", "jaxpar", "train", "--no-progress", *settings,
                                 f"run.dir={run_dir}", *more], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert train(whole).wait(timeout=300) == 0
    proc = train(cut, "checkpoint.every=1")
    deadline = time.monotonic() + 300
    while 3 not in checkpoint_steps(cut) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert 3 in checkpoint_steps(cut) and 6 not in checkpoint_steps(cut)
    resumed = train(cut, "checkpoint.every=1")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0 and b"resuming from the checkpoint at step" in err
    assert metrics(cut) == metrics(whole)


@pytest.mark.slow  # the quick tier's 2BW: the verify (tests/test_pipeline.py) and the exact resume above
def test_a_drained_run_trained_further_goes_on_as_if_never_drained(tmp_path):
    """A finished run (drained: its last update applied, nothing in flight) that is given more steps logs
    exactly the losses, and ends with the weights, of the run that had those steps from the start."""
    import jax

    from jaxpar.interop.checkpoint_files import flat_by_path

    trainer = _trainer("parallel.pipeline.schedule=2bw", "train.batch_size=16")
    sampler = trainer.session.train_data

    def steps(state, indices):
        losses = []
        for index in indices:
            state, metrics = trainer.step(state, trainer.put_windows(sampler, sampler.starts(index)))
            losses.append(float(metrics["loss"]) if bool(metrics["completed"]) else None)
        state, metrics = trainer.pacing.finish(state)
        return state, losses + [float(metrics["loss"])]

    whole, whole_losses = steps(trainer.init(), range(5))
    first, first_losses = steps(trainer.init(), range(3))
    last, last_losses = steps(first, range(3, 5))
    assert first_losses + last_losses[1:] == whole_losses  # the step after the drain completes nothing
    for key, value in flat_by_path(jax.device_get(last.params)).items():
        np.testing.assert_array_equal(value, flat_by_path(jax.device_get(whole.params))[key], err_msg=key)
