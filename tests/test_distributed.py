"""Multi-process runs with real processes: `jaxpar launch` on 127.0.0.1, gloo collectives on CPU.

Each launched run is two processes with 4 emulated CPU devices each, compared with one
process holding all 8 devices (metrics.jsonl losses within 1e-6 relative, fp32).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxpar import distributed
from jaxpar.config import ConfigError, MeshConfig
from jaxpar.distributed import CoordinatorFailed, ProcessSetup, StopAgreement, from_environment
from jaxpar.errors import EXIT_LOST
from jaxpar.validation import host_split

TINY = ["model.d_model=64", "model.n_layers=2", "model.seq_len=64", "train.batch_size=16", "train.log_every=1",
        "train.eval_batches=2"]
TIMEOUT_S = 300


def _jaxpar(*args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxpar", *args], capture_output=True, text=True, timeout=timeout)


def _train(run_dir: Path, *settings: str, processes: int = 1) -> subprocess.CompletedProcess:
    command = ["train", "--no-progress", *TINY, *settings, f"run.dir={run_dir}"]
    if processes > 1:
        command = ["launch", "--processes", str(processes), "--devices-per-process", str(8 // processes), "--",
                   *command]
    result = _jaxpar(*command)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines)}


def _assert_same_losses(got: dict[int, float], want: dict[int, float]) -> None:
    assert sorted(got) == sorted(want)
    for step, loss in want.items():
        assert abs(got[step] - loss) <= 1e-6 * abs(loss), (step, got[step], loss)


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_match_one_process_data_x_tensor(tmp_path):
    settings = ["mesh.data=2", "mesh.tensor=4", "train.steps=4"]
    single = _train(tmp_path / "one", *settings)
    double = _train(tmp_path / "two", *settings, processes=2)
    # tensor stays inside each process; the two processes split the data axis
    assert "2 processes over data=2" in double.stderr
    assert "[1] jaxpar: training" not in double.stderr  # only process 0 reports
    _assert_same_losses(_losses(tmp_path / "two"), _losses(tmp_path / "one"))
    assert "final train loss" in double.stdout and "final train loss" in single.stdout


@pytest.mark.slow
@pytest.mark.distributed
def test_pipeline_across_processes_and_checkpoints_cross_process_counts(tmp_path):
    """One process trains 6 steps (the reference, checkpoints at 2, 4 and 6). Its step-2 checkpoint
    is resumed by 2 processes, with the stages across them, up to step 4; their step-4 checkpoint is
    resumed by 1 process up to step 6. Every step's loss is the reference's."""
    # no text sample at the end of each of the three runs: nothing here reads it, and the other runs write one
    settings = ["mesh.data=2", "mesh.tensor=2", "mesh.stage=2", "mesh.hosts=stage", "parallel.pipeline.microbatches=2",
                "checkpoint.every=2", "train.lr_schedule_steps=6", "train.sample_tokens=0"]
    _train(tmp_path / "one", *settings, "train.steps=6")
    reference = _losses(tmp_path / "one")

    run = tmp_path / "one_to_two_to_one"
    shutil.copytree(tmp_path / "one", run)
    for step in ("4", "6"):
        shutil.rmtree(run / "checkpoints" / step)
    double = _train(run, *settings, "train.steps=4", processes=2)
    assert "2 processes over stage=2" in double.stderr
    assert "resuming from the checkpoint at step 2" in double.stderr
    _assert_same_losses(_losses(run), {step: loss for step, loss in reference.items() if step <= 4})

    single = _train(run, *settings, "train.steps=6")  # from the checkpoint the 2 processes wrote
    assert "resuming from the checkpoint at step 4" in single.stderr
    _assert_same_losses(_losses(run), reference)


@pytest.mark.slow
@pytest.mark.distributed
def test_damaged_checkpoint_is_set_aside_by_process_0_and_every_process_falls_back(tmp_path):
    settings = ["mesh.data=2", "mesh.tensor=4", "train.steps=2", "checkpoint.every=1"]
    run_dir = tmp_path / "run"
    _train(run_dir, *settings)
    written = _losses(run_dir)
    (run_dir / "checkpoints" / "2" / "meta" / "metadata").unlink()
    resumed = _train(run_dir, *settings, processes=2)
    warnings = [line for line in resumed.stderr.splitlines() if "jaxpar: warning:" in line]
    assert len(warnings) == 1 and warnings[0].startswith("[0] jaxpar: warning: the checkpoint at step 2 ")
    assert "[0] jaxpar: resuming from the checkpoint at step 1 " in resumed.stderr
    assert (run_dir / "damaged_checkpoints" / "2").is_dir()
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()) == [1, 2]
    _assert_same_losses(_losses(run_dir), written)


def _child_pid(run_dir: Path, process_id: int) -> int | None:
    """The pid of the launched `jaxpar train` process with JAXPAR_PROCESS_ID=process_id for run_dir."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"run.dir={run_dir}".encode() in cmdline and f"JAXPAR_PROCESS_ID={process_id}".encode() in environ:
            return int(entry.name)
    return None


def _signal_long_run(run_dir: Path, process_id: int, signum: int) -> tuple[subprocess.Popen, str, float]:
    """Launch a 2-process run that would go on for hours, send `signum` to one process after 3 logged
    steps, and return the launcher, its stderr and the seconds it took to end after the signal."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "jaxpar", "launch", "--processes", "2", "--devices-per-process", "4", "--", "train",
         "--no-progress", *TINY, "mesh.data=2", "mesh.tensor=4", "train.steps=100000", "run.heartbeat_timeout=5",
         f"run.dir={run_dir}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (run_dir / "metrics.jsonl").exists() or len(_losses(run_dir)) < 3:
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-3000:]
            time.sleep(0.2)
        os.kill(_child_pid(run_dir, process_id), signum)
        signalled_at = time.monotonic()
        _, err = launcher.communicate(timeout=60)
        return launcher, err, time.monotonic() - signalled_at
    finally:
        if launcher.poll() is None:
            launcher.kill()


@pytest.mark.slow
@pytest.mark.distributed
def test_sigterm_to_one_process_stops_all_at_the_same_step_with_a_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    launcher, err, _ = _signal_long_run(run_dir, 1, signal.SIGTERM)
    assert launcher.returncode == 0, err[-3000:]
    saved = [int(p.name) for p in (run_dir / "checkpoints").iterdir()]
    assert len(saved) == 1 and saved[0] >= 3
    assert f"[0] jaxpar: stopped by a signal to another process after step {saved[0]}" in err


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("victim", [1, 0])
def test_killing_a_process_ends_the_run_with_a_sentence(tmp_path, victim):
    launcher, err, elapsed = _signal_long_run(tmp_path / "run", victim, signal.SIGKILL)
    assert launcher.returncode != 0
    assert elapsed < 60, elapsed
    assert f"jaxpar launch: process {victim} was killed by SIGKILL." in err
    survivor = 1 - victim
    if victim == 1:
        # The survivor's watchdog names the lost process itself, in one sentence.
        assert f"[{survivor}] jaxpar: error: lost process {victim} of 2" in err
        assert "Traceback" not in err
    else:
        # Losing the coordinator makes the JAX runtime abort the survivor; the launcher says so in one sentence.
        assert f"jaxpar launch: process {survivor} was killed by SIGABRT after process {victim} was lost" in err
    assert "Check failure stack trace" not in err  # the runtime's C++ noise is held back


@pytest.mark.distributed
def test_tensor_across_processes_is_refused_in_one_sentence(tmp_path):
    result = _jaxpar("launch", "--processes", "2", "--devices-per-process", "4", "--", "train", "mesh.tensor=8",
                     f"run.dir={tmp_path / 'run'}")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("[0] jaxpar: error: the 2 processes cannot be laid out") and "tensor" in lines[0]
    assert not (tmp_path / "run").exists()


def test_host_split_hands_processes_to_the_named_axes_in_order():
    sizes = {"data": 4, "tensor": 2, "expert": 1, "stage": 2, "context": 1}
    inside = {"tensor": 1, "expert": 1, "context": 1}
    assert host_split(sizes, MeshConfig(), 4) == {"data": 4, "stage": 1, **inside}
    assert host_split(sizes, MeshConfig(hosts="stage,data"), 4) == {"data": 2, "stage": 2, **inside}
    assert host_split(sizes, MeshConfig(hosts="data,stage"), 8) == {"data": 4, "stage": 2, **inside}
    with pytest.raises(ConfigError, match="tensor must stay inside a process"):
        host_split(sizes, MeshConfig(), 16)
    assert host_split(sizes, MeshConfig(hosts="data,stage,tensor"), 16)["tensor"] == 2  # forced
    with pytest.raises(ConfigError, match="mesh.hosts must list"):
        host_split(sizes, MeshConfig(hosts="data,pipeline"), 2)


def test_environment_decides_single_or_multi_process():
    assert from_environment({}) is None
    env = {"JAXPAR_COORDINATOR": "10.0.0.1:1234", "JAXPAR_NUM_PROCESSES": "4", "JAXPAR_PROCESS_ID": "3"}
    assert from_environment(env) == ProcessSetup("10.0.0.1:1234", 4, 3)
    assert from_environment({**env, "JAXPAR_NUM_PROCESSES": "1", "JAXPAR_PROCESS_ID": "0"}) is None
    assert from_environment({"SLURM_NTASKS": "8"}) == ProcessSetup(None, None, None)  # JAX detects the rest
    assert from_environment({"SLURM_NTASKS": "1"}) is None
    with pytest.raises(ConfigError, match="needs all three"):
        from_environment({"JAXPAR_COORDINATOR": "10.0.0.1:1234"})
    with pytest.raises(ConfigError, match="must be between 0"):
        from_environment({**env, "JAXPAR_PROCESS_ID": "4"})


@pytest.mark.slow
@pytest.mark.distributed
def test_verify_across_two_processes_against_a_per_process_reference():
    result = _jaxpar("launch", "--processes", "2", "--devices-per-process", "4", "--", "verify", *TINY,
                     "mesh.data=2", "mesh.tensor=4", "parallel.zero=3")
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [line for line in result.stdout.splitlines() if line.startswith("[")]
    assert len(reports) == 1 and reports[0].startswith("[0] ")  # process 0 reports for the run
    report = json.loads(reports[0][4:])
    assert report["ok"] and report["loss_max_rel_err"] <= 1e-5 and report["param_max_rel_err"] <= 1e-4


@pytest.mark.slow
@pytest.mark.distributed
def test_plan_across_two_processes_prints_its_table_once():
    result = _jaxpar("launch", "--processes", "2", "--devices-per-process", "4", "--", "plan", *TINY, "mesh.data=2",
                     "mesh.tensor=4")
    assert result.returncode == 0, result.stderr[-3000:]
    headers = [line.split() for line in result.stdout.splitlines() if "per device" in line]
    assert headers == [["[0]", "per", "device", "bytes", "MiB"]], headers
    assert not [line for line in result.stdout.splitlines() if line.startswith("[1] ")]
    reports = [json.loads(line[4:]) for line in result.stdout.splitlines() if line.startswith("[0] {")]
    assert len(reports) == 1 and reports[0]["flops"] > 0


def _children_run(script: str, tmp_path: Path, monkeypatch) -> None:
    """Make `jaxpar launch` start the shell `script` in place of `python -m jaxpar ...`."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n" + script)
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))


def test_launch_kills_the_others_a_grace_period_after_one_process_fails(tmp_path, monkeypatch, capsys):
    from jaxpar.cli import main

    # Stands in for `python -m jaxpar train`: process 1 fails at once, process 0 would run for a minute.
    _children_run('if [ "$JAXPAR_PROCESS_ID" = 1 ]; then echo failed >&2; exit 5; fi\nexec sleep 60\n', tmp_path,
                  monkeypatch)
    started = time.monotonic()
    code = main(["launch", "--processes", "2", "--grace", "1", "--", "train"])
    elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 5 and elapsed < 10, (code, elapsed, err)
    assert err.splitlines() == ["[1] failed", "jaxpar launch: process 1 exited with code 5.",
                                "jaxpar launch: process 0 did not stop 1 s after process 1 failed; killing it.",
                                "jaxpar launch: process 0 was killed by SIGKILL after process 1 was lost."]


def test_launch_hides_interleaved_gloo_lines_and_the_empty_line_they_leave(tmp_path, monkeypatch, capsys):
    from jaxpar.cli import main

    # Gloo's threads share stdout: two messages can arrive as one line and then an empty one.
    _children_run('printf "[Gloo] Rank 0 is connected[Gloo] Rank 2 is connected\\n\\n{}\\n\\nend\\n"\n', tmp_path,
                  monkeypatch)
    assert main(["launch", "--processes", "1", "--", "verify"]) == 0
    assert capsys.readouterr().out.splitlines() == ["[0] {}", "[0] ", "[0] end"]  # the program's own blank line stays


class _Coordinator:
    """The coordinator's key-value store as StopAgreement sees it: each failing call raises the runtime's error
    for the next status in `set_errors` or `get_errors`, as the real one does."""

    def __init__(self, stop_at: str | None = None, set_errors=(), get_errors=()):
        self.stop_at, self.set_errors, self.get_errors, self.gets = stop_at, list(set_errors), list(get_errors), 0

    @staticmethod
    def _error(status: str) -> Exception:
        from jax.errors import JaxRuntimeError

        return JaxRuntimeError(f"{status}: injected. Additional GRPC error information from remote target")

    def key_value_set(self, key: str, value: str) -> None:
        if self.set_errors:
            raise self._error(self.set_errors.pop(0))
        self.stop_at = value

    def key_value_try_get(self, key: str) -> str:
        self.gets += 1
        if self.get_errors:
            raise self._error(self.get_errors.pop(0))
        if self.stop_at is None:
            raise self._error("NOT_FOUND")
        return self.stop_at


def _agreement(monkeypatch, coordinator: _Coordinator) -> StopAgreement:
    monkeypatch.setattr(distributed, "_client", lambda: coordinator)
    monkeypatch.setattr(distributed, "_RETRY_SLEEP_S", 0.0)
    agreement = StopAgreement()
    agreement.multi = True  # as in a multi-process run, whose coordinator is `coordinator`
    return agreement


def test_stop_agreement_takes_not_found_as_no_stop_yet_and_already_exists_as_an_earlier_publisher(monkeypatch):
    assert not _agreement(monkeypatch, _Coordinator()).should_stop(3, signalled=False)
    ours = _agreement(monkeypatch, _Coordinator())
    assert [ours.should_stop(step, signalled=True) for step in (3, 4, 5)] == [False, False, True]
    theirs = _agreement(monkeypatch, _Coordinator(stop_at="7", set_errors=["ALREADY_EXISTS"]))
    assert [theirs.should_stop(step, signalled=True) for step in (3, 4, 5, 6, 7)] == [False] * 4 + [True]


def test_stop_agreement_retries_a_failing_coordinator_then_ends_the_run_in_one_sentence(monkeypatch):
    coordinator = _Coordinator(get_errors=["UNAVAILABLE"])
    assert not _agreement(monkeypatch, coordinator).should_stop(3, signalled=False)
    assert coordinator.gets == 2  # a second try got the answer
    coordinator = _Coordinator(get_errors=["UNAVAILABLE"] * distributed._TRIES)
    with pytest.raises(CoordinatorFailed) as failed:
        _agreement(monkeypatch, coordinator).should_stop(3, signalled=False)
    assert coordinator.gets == distributed._TRIES
    assert str(failed.value) == (f"reading the stop step from the coordinator failed {distributed._TRIES} times "
                                 "(UNAVAILABLE: injected); process 0 stops, resume from the last checkpoint.")
    assert failed.value.exit_code == EXIT_LOST
