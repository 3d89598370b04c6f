"""Checkpoints under interruption and damage: SIGKILL at any moment (between saves, during a save,
while resuming), SIGTERM and SIGINT, each kind of damaged checkpoint set aside for the previous
one, which errors count as damage, restore errors that are not damage, and trimming metrics.jsonl
on a fallback.

Every run is the tiny preset with one metrics line per step, and its metrics must equal those of
the uninterrupted 40-step reference run; the runs, the reference and the helpers are in
conftest.py, shared with test_checkpoint.py.
"""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import BASE, checkpoint_steps, copy_of, metrics, partial_saves, train_here

from jaxpar.interop.checkpoint_files import is_damage
from jaxpar.train.checkpoint import Checkpoints

# The session's checkpoint runs (conftest.py) are made once, on one pytest-xdist worker
pytestmark = pytest.mark.xdist_group("checkpoint_runs")

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 120


# `jaxpar <args>` in a process whose Orbax holds the save of step <argv[1]> open: its data is written but
# its folder is renamed from the temporary name only after 600 s, so a test can kill the process mid-save.
_HOLDING_A_SAVE = """
import asyncio, sys
import orbax.checkpoint as ocp
from jaxpar.cli import main

held_step, args = sys.argv[1], sys.argv[2:]
rename = ocp.path.atomicity.AtomicRenameTemporaryPath
finalize = rename.finalize

async def held_finalize(self, *a, **k):
    if self.get_final().name == held_step:
        await asyncio.sleep(600)
    await finalize(self, *a, **k)

rename.finalize = held_finalize
sys.exit(main(args))
"""


def start_training(run_dir: Path, *overrides: str, hold_save_of: int | None = None) -> tuple[subprocess.Popen, Path]:
    """`python -m jaxpar train` as a separate process (so it can be killed); stderr goes to a file.
    With `hold_save_of`, that step's save never completes (see _HOLDING_A_SAVE)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    err_path = run_dir.parent / f"{run_dir.name}-stderr-{time.monotonic_ns()}.txt"
    jaxpar = ["-m", "jaxpar"] if hold_save_of is None else ["-c", _HOLDING_A_SAVE, str(hold_save_of)]
    with err_path.open("w") as err:
        proc = subprocess.Popen([sys.executable, *jaxpar, "train", "--no-progress", *BASE, f"run.dir={run_dir}",
                                 *overrides], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err)
    return proc, err_path


def wait_for(condition, proc: subprocess.Popen, what: str):
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if condition():
            return
        assert proc.poll() is None, f"the training process ended (code {proc.returncode}) before {what}"
        time.sleep(0.01)
    proc.kill()
    pytest.fail(f"timed out waiting for {what}")


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0



@pytest.mark.slow
def test_sigkill_at_any_moment_resumes_from_the_newest_complete_checkpoint(tmp_path, reference):
    run_dir = tmp_path / "run"
    settings = ("train.steps=20", "checkpoint.every=5")  # the held save of step 20 is the run's last

    # 1. Killed between saves, after step 12 has been logged (the async save of step 10 may be unfinished).
    proc, _ = start_training(run_dir, *settings)
    wait_for(lambda: logged_steps(run_dir) >= 12, proc, "step 12")
    proc.kill()
    proc.wait()
    newest = checkpoint_steps(run_dir)[-1]

    # 2. Killed during the save of step 20 (held open), after save 15 completed.
    proc, err_path = start_training(run_dir, *settings, hold_save_of=20)
    wait_for(lambda: any(p.startswith("20.") for p in partial_saves(run_dir)), proc, "the save of step 20")
    time.sleep(3)  # a save that is not held completes within this time
    assert checkpoint_steps(run_dir)[-1] == 15, "the save of step 20 was not held open"
    proc.kill()
    proc.wait()
    assert f"resuming from the checkpoint at step {newest} " in err_path.read_text()
    assert checkpoint_steps(run_dir)[-1] == 15 and partial_saves(run_dir)  # the partial save is on disk

    # 3. Killed while starting up again: the partial step 20 must not be picked up.
    proc, err_path = start_training(run_dir, *settings)
    wait_for(lambda: "resuming from the checkpoint" in err_path.read_text(), proc, "the resume")
    proc.kill()
    proc.wait()
    assert "resuming from the checkpoint at step 15 " in err_path.read_text()

    # 4. Run to the end: nothing is lost beyond the steps since the checkpoint, and nothing is left half-written.
    proc, err_path = start_training(run_dir, *settings)
    assert proc.wait(timeout=TIMEOUT_S) == 0, err_path.read_text()
    assert "resuming from the checkpoint at step 15 " in err_path.read_text()
    assert metrics(run_dir) == reference[:20]
    assert checkpoint_steps(run_dir) == [10, 15, 20] and partial_saves(run_dir) == []


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_stop_signal_checkpoints_the_current_step_and_exits_0(sig, tmp_path, capsys, reference):
    run_dir = tmp_path / "run"
    proc, err_path = start_training(run_dir, "train.steps=40")  # periodic checkpoints are off
    wait_for(lambda: logged_steps(run_dir) >= 5, proc, "step 5")
    proc.send_signal(sig)
    assert proc.wait(timeout=TIMEOUT_S) == 0, err_path.read_text()
    last = metrics(run_dir)[-1]["step"]
    assert checkpoint_steps(run_dir) == [last] and partial_saves(run_dir) == []
    assert (f"jaxpar: stopped by {sig.name} after step {last}; the checkpoint at step {last} is in "
            f"{run_dir / 'checkpoints'}, and the same command resumes from it.") in err_path.read_text()
    # The checkpoint holds the current step exactly.
    code, err = train_here(capsys, run_dir, f"train.steps={last + 2}")
    assert code == 0 and f"resuming from the checkpoint at step {last} " in err
    assert metrics(run_dir) == reference[:last + 2]


def _truncate_largest_array_file(step_dir: Path) -> None:
    largest = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    with largest.open("r+b") as f:
        f.truncate(largest.stat().st_size // 2)


def _delete_metadata_file(step_dir: Path) -> None:
    (step_dir / "meta" / "metadata").unlink()


def _largest_array_file(step_dir: Path) -> Path:
    return max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


def _delete_largest_array_file(step_dir: Path) -> None:
    _largest_array_file(step_dir).unlink()


def _garbage_in_largest_array_file(step_dir: Path) -> None:
    path = _largest_array_file(step_dir)
    path.write_bytes(np.random.default_rng(0).bytes(path.stat().st_size))


def _cut_meta_json(step_dir: Path) -> None:
    path = step_dir / "meta" / "metadata"
    path.write_text(path.read_text()[:100])


def _meta_json_without_its_fields(step_dir: Path) -> None:
    (step_dir / "meta" / "metadata").write_text('{"step": 10}')


def _delete_state_folder(step_dir: Path) -> None:
    shutil.rmtree(step_dir / "state")


DAMAGE = {"truncated array file": _truncate_largest_array_file, "missing array file": _delete_largest_array_file,
          "garbage in array file": _garbage_in_largest_array_file, "missing meta file": _delete_metadata_file,
          "unparsable meta": _cut_meta_json, "meta without its fields": _meta_json_without_its_fields,
          "missing state folder": _delete_state_folder}


@pytest.mark.parametrize("damage", DAMAGE.values(), ids=DAMAGE.keys())
def test_each_kind_of_damage_is_set_aside_for_the_previous_checkpoint(damage, tmp_path, ten_steps, trainer):
    run_dir = copy_of(ten_steps, tmp_path)
    damage(run_dir / "checkpoints" / "10")
    warnings = []
    checkpoints = Checkpoints(run_dir / "checkpoints", keep=3)
    restored = checkpoints.restore_latest(trainer, warnings.append)
    checkpoints.close()
    assert restored.step == 5
    assert len(warnings) == 1 and warnings[0].startswith(f"the checkpoint at step 10 in {run_dir / 'checkpoints'} "
                                                         "is damaged and cannot be read (")
    assert checkpoint_steps(run_dir) == [5] and (run_dir / "damaged_checkpoints" / "10").is_dir()


def test_only_missing_cut_short_or_garbled_files_count_as_damage():
    def raised_from(cause: Exception) -> Exception:
        try:
            raise Exception("Encountered error while reading array index: (slice(0, 2, 1),).") from cause
        except Exception as e:  # noqa: BLE001 - Orbax's own wrapper type
            return e

    # What Orbax and TensorStore raised when a checkpoint was damaged on purpose.
    assert is_damage(FileNotFoundError(2, "No such file or directory"))
    assert is_damage(IsADirectoryError(21, "Is a directory"))
    assert is_damage(json.JSONDecodeError("Expecting value", '{"step": ', 9))
    assert is_damage(UnicodeDecodeError("utf-8", b"\xc5", 0, 1, "invalid continuation byte"))
    assert is_damage(KeyError("Item \"state\" was not found in the checkpoint. Available items: ['meta']"))
    assert is_damage(ValueError('NOT_FOUND: Error opening "zarr" driver: Metadata at "step/.zarray" does not exist'))
    assert is_damage(ValueError('DATA_LOSS: Error reading "step/.zarray": Error decoding b-tree node'))
    assert is_damage(raised_from(ValueError("OUT_OF_RANGE: Error reading \"x/0.0\": Requested byte range [3, 9) is "
                                            "not valid for value of size 4")))
    assert is_damage(raised_from(ValueError('FAILED_PRECONDITION: Error reading "x/0.0": ZSTD_decompressStream() '
                                            'failed: Unknown frame descriptor')))
    # Anything else is not: a bug, out of memory, a sharding error.
    assert not is_damage(KeyError("spec"))
    assert not is_damage(TypeError("unsupported operand type(s) for +: 'int' and 'str'"))
    assert not is_damage(ValueError("One of pjit outputs was given the sharding of NamedSharding(...), which implies "
                                    "that the global size of its dimension 0 should be divisible by 8"))
    assert not is_damage(raised_from(ValueError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate")))
    assert not is_damage(MemoryError())
    assert not is_damage(OSError(12, "Cannot allocate memory"))


@pytest.mark.slow
@pytest.mark.parametrize("damage", [_truncate_largest_array_file, _delete_metadata_file], ids=["truncated", "missing"])
def test_damaged_checkpoint_is_reported_and_skipped(damage, tmp_path, capsys, ten_steps, reference):
    run_dir = copy_of(ten_steps, tmp_path)
    damage(run_dir / "checkpoints" / "10")
    code, err = train_here(capsys, run_dir, "train.steps=12", "checkpoint.every=5")
    assert code == 0
    warnings = [line for line in err.splitlines() if line.startswith("jaxpar: warning:")]
    assert len(warnings) == 1 and warnings[0].endswith(".")
    assert warnings[0].startswith(f"jaxpar: warning: the checkpoint at step 10 in {run_dir / 'checkpoints'} is "
                                  "damaged and cannot be read (")
    assert f"falling back to step 5, and the damaged one is moved to {run_dir / 'damaged_checkpoints' / '10'}." \
        in warnings[0]
    assert "resuming from the checkpoint at step 5 " in err
    assert metrics(run_dir) == reference[:12]
    assert checkpoint_steps(run_dir) == [5, 10, 12] and (run_dir / "damaged_checkpoints" / "10").is_dir()


@pytest.mark.parametrize("error", [
    ValueError("One of pjit outputs was given the sharding of NamedSharding(mesh=Mesh('data': 8), spec=P('data',)), "
               "which implies that its dimension 0 is divisible by 8"),
    RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.0GiB")], ids=["sharding", "memory"])
def test_an_error_that_is_not_damage_ends_the_run_and_moves_nothing(error, tmp_path, capsys, ten_steps, monkeypatch):
    run_dir = copy_of(ten_steps, tmp_path)
    before = (run_dir / "metrics.jsonl").read_bytes()

    def failing_restore(*args, **kwargs):
        raise error

    monkeypatch.setattr(ocp.CheckpointManager, "restore", failing_restore)
    code, err = train_here(capsys, run_dir, "train.steps=12", "checkpoint.every=5")
    assert code == 1
    assert err.strip().splitlines() == [
        f"jaxpar: error: restoring the checkpoint at step 10 in {run_dir / 'checkpoints'} failed with "
        f"{type(error).__name__}: {error}, which is not damage to the checkpoint, so every checkpoint stays where it "
        "is; fix the cause and run the same command again."]
    assert checkpoint_steps(run_dir) == [5, 10] and not (run_dir / "damaged_checkpoints").exists()
    assert (run_dir / "metrics.jsonl").read_bytes() == before


def test_a_fallback_trims_metrics_to_the_restored_step_and_keeps_the_file(tmp_path):
    from jaxpar.config.presets import load_config
    from jaxpar.train.loop import trim_metrics

    cfg = load_config(BASE[0], [*BASE[1:], "train.steps=10"])
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": step, "loss": 10.0 - step}) + "\n" for step in range(1, 11)))
    assert [r["step"] for r in trim_metrics(path, 4, cfg)] == [1, 2, 3, 4]
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": step, "loss": 10.0 - step} for step in range(1, 5)]
    assert trim_metrics(path, 0, cfg) == [] and path.read_text() == ""  # step 0: emptied, not deleted


@pytest.mark.slow
def test_a_restart_reads_the_in_memory_copy_and_not_the_shared_checkpoint(tmp_path, capsys, reference):
    from jaxpar.train.local_copy import run_folder

    run_dir = tmp_path / "run"
    settings = ("checkpoint.every=4", "checkpoint.local_every=1")
    try:
        proc, _ = start_training(run_dir, "train.steps=40", *settings)
        wait_for(lambda: logged_steps(run_dir) >= 6, proc, "step 6")
        proc.kill()
        proc.wait()
        # the newest complete copy (an older one is deleted only after it, so a kill in between leaves both)
        newest = max(int(p.name) for p in (run_folder(run_dir) / "process-0" / "own").iterdir() if p.name.isdigit())
        shared = checkpoint_steps(run_dir)
        assert newest >= 5 and all(step < newest for step in shared)
        for step in shared:  # a restore that read these would set them aside as damaged
            shutil.rmtree(run_dir / "checkpoints" / str(step) / "state")
        code, err = train_here(capsys, run_dir, "train.steps=10", *settings)
        assert code == 0, err
        assert f"jaxpar: resuming from the in-memory copy at step {newest} in {run_folder(run_dir)}" in err
        assert "damaged" not in err and not (run_dir / "damaged_checkpoints").exists()
        assert metrics(run_dir) == reference[:10]
        assert not run_folder(run_dir).exists()  # a finished run removes its copies
    finally:
        shutil.rmtree(run_folder(run_dir), ignore_errors=True)  # host memory, even when the test fails
