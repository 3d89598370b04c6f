"""Runs that heal themselves: `jaxpar launch --restarts` and `--elastic`, the re-planned layout, goodput.

The supervisor's decisions (restart or not, back-off, which slots go on, the events rows, regrowing) are
checked with shell scripts in place of the jaxpar processes; the rows per device an elastic run keeps,
and goodput over a timeline, in plain Python. Two runs of real processes check the acceptance: one that
is killed three times (during the replication of its in-memory copy, between saves, and during an
asynchronous save with checkpoint.keep=1) and must log exactly the losses of an uninterrupted run, and
one that loses a process for good, goes on with the other on a re-planned layout, and grows back.
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from helpers import checkpoint_steps
from test_docs import fenced_blocks

from jaxpar.config import Config, ConfigError
from jaxpar.runtime.elastic import keep_rows, rows_per_device
from jaxpar.runtime.goodput import current_job, goodput
from jaxpar.train.local_copy import run_folder

REPO = Path(__file__).resolve().parent.parent
TINY = ["model.d_model=64", "model.n_layers=2", "model.seq_len=64", "train.batch_size=16", "train.log_every=1",
        "train.eval_batches=2", "train.sample_tokens=0", "train.steps=12", "train.lr_schedule_steps=12"]
TIMEOUT_S = 600


# ------------------------------------------------------------------ the supervisor, with stand-in processes

def _children_run(script: str, tmp_path: Path, monkeypatch) -> None:
    """Make `jaxpar launch` start the shell `script` in place of `python -m jaxpar ...`."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n" + script)
    fake.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(fake))


def _timeline_row(resumed: str) -> str:
    """A shell line that appends the start row process 0 of a real run writes, resuming from `resumed`."""
    return ('[ "$JAXPAR_PROCESS_ID" = 0 ] && echo "{\\"event\\": \\"start\\", \\"t\\": 1, \\"ready_t\\": 2, '
            f'\\"attempt\\": \\"$JAXPAR_ATTEMPT\\", \\"resumed\\": {resumed}, \\"source\\": \\"memory\\", '
            '\\"devices\\": $((4 * JAXPAR_NUM_PROCESSES)), \\"layout\\": \\"data=4\\"}" >> $RUN/timeline.jsonl\n')


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_a_killed_process_restarts_the_run_with_a_line_and_an_events_row_until_the_restarts_run_out(
        tmp_path, monkeypatch, capsys):
    from jaxpar.cli import main

    run_dir = tmp_path / "run"
    # Attempt k resumes from step 2k and reaches step 2k + 3; slot 1 is killed in every attempt.
    _children_run(f"RUN={run_dir}\n" + _timeline_row("$((JAXPAR_ATTEMPT * 2))")
                  + '[ "$JAXPAR_PROCESS_ID" = 0 ] && echo "{\\"event\\": \\"step\\", \\"t\\": 3, \\"step\\": '
                    '$((JAXPAR_ATTEMPT * 2 + 3)), \\"s\\": 1}" >> $RUN/timeline.jsonl\n'
                    'if [ "$JAXPAR_SLOT" = 1 ]; then sleep 0.5; kill -9 $$; fi\nexec sleep 60\n', tmp_path, monkeypatch)
    started = time.monotonic()
    code = main(["launch", "--processes", "2", "--restarts", "2", "--backoff", "0.2", "--grace", "1", "--", "train",
                 "checkpoint.every=1", f"run.dir={run_dir}"])
    err = capsys.readouterr().err.splitlines()
    assert code == 128 + signal.SIGKILL and time.monotonic() - started < 30
    assert [line for line in err if line.startswith("jaxpar launch:")] == [
        "jaxpar launch: process 1 was killed by SIGKILL; restart 1 of 2 in 0.2 s.",
        "jaxpar launch: process 1 was killed by SIGKILL; restart 2 of 2 in 0.4 s.",
        "jaxpar launch: process 1 was killed by SIGKILL.",  # no restart left: as without --restarts
        "jaxpar launch: process 0 did not stop 1 s after process 1 failed; killing it.",
        "jaxpar launch: process 0 was killed by SIGKILL after process 1 was lost.",
        "jaxpar launch: no restarts left (--restarts 2); the run stops here."]
    rows = _events(run_dir)
    assert [(r["event"], r["attempt"], r["step_resumed"], r["steps_lost"], r["restored_from"]) for r in rows] == [
        ("restart", 2, 4, 1, "memory"), ("restart", 3, 6, 1, "memory")]
    assert all(r["cause"] == "process 1 was killed by SIGKILL" and r["processes"] == 2 for r in rows)


def test_an_elastic_run_leaves_out_an_unhealthy_slot_and_grows_back_once_it_is_healthy(tmp_path, monkeypatch, capsys):
    from jaxpar.cli import main

    run_dir, down = tmp_path / "run", tmp_path / "down"
    down.mkdir()
    # Attempt 1: slot 1 breaks (its health check fails from now on) and dies. Attempt 2, on slot 0 alone: slot 1
    # recovers after half a second, and the process stops when asked (SIGTERM). Attempt 3, on both, finishes.
    _children_run(f"RUN={run_dir}\nDOWN={down}\n" + _timeline_row("$JAXPAR_ATTEMPT")
                  + 'echo "attempt $JAXPAR_ATTEMPT: process $JAXPAR_PROCESS_ID of $JAXPAR_NUM_PROCESSES in slot '
                    '$JAXPAR_SLOT"\n'
                    'if [ "$JAXPAR_ATTEMPT" = 1 ] && [ "$JAXPAR_SLOT" = 1 ]; then touch $DOWN/1; kill -9 $$; fi\n'
                    'if [ "$JAXPAR_ATTEMPT" = 2 ]; then trap "kill \\$!; exit 0" TERM; sleep 0.5; rm $DOWN/1; '
                    'sleep 60 & wait; fi\n'
                    'if [ "$JAXPAR_ATTEMPT" = 3 ]; then exit 0; fi\nexec sleep 60\n', tmp_path, monkeypatch)
    code = main(["launch", "--processes", "2", "--devices-per-process", "4", "--restarts", "1", "--backoff", "0",
                 "--elastic", "--health-check", f"test ! -e {down}/$JAXPAR_SLOT", "--regrow-after", "1", "--",
                 "train", "checkpoint.every=1", f"run.dir={run_dir}"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    # the attempts in order; the two processes of one attempt print in whichever order they are scheduled
    # (a loaded host once printed slot 1's line first)
    printed = [line for line in captured.out.splitlines() if "attempt" in line]
    attempts = [int(line.split()[2].rstrip(":")) for line in printed]
    assert attempts == sorted(attempts) and sorted(printed) == sorted([
        "[0] attempt 1: process 0 of 2 in slot 0", "[1] attempt 1: process 1 of 2 in slot 1",
        "[0] attempt 2: process 0 of 1 in slot 0",
        "[0] attempt 3: process 0 of 2 in slot 0", "[1] attempt 3: process 1 of 2 in slot 1"]), printed
    assert [line for line in captured.err.splitlines() if line.startswith("jaxpar launch:")] == [
        "jaxpar launch: process 1 was killed by SIGKILL; restart 1 of 1 in 0 s on 1 process (slot 1 fails its "
        "health check: left out).",
        "jaxpar launch: slot 1 is healthy again; the run stops at a checkpoint and goes on with 2 processes."]
    rows = _events(run_dir)
    assert [(r["event"], r["attempt"], r["processes"], r["slots"], r["devices"]) for r in rows] == [
        ("shrink", 2, 1, [0], 4), ("regrow", 3, 2, [0, 1], 8)]


def test_without_a_health_check_a_slot_that_fails_again_on_restart_is_left_out(tmp_path, monkeypatch, capsys):
    from jaxpar.cli import main

    run_dir = tmp_path / "run"
    _children_run(f"RUN={run_dir}\n" + _timeline_row("0")
                  + 'if [ "$JAXPAR_SLOT" = 1 ]; then kill -9 $$; fi\n'
                    'if [ "$JAXPAR_NUM_PROCESSES" = 1 ]; then exit 0; fi\nexec sleep 60\n', tmp_path, monkeypatch)
    code = main(["launch", "--processes", "2", "--devices-per-process", "4", "--restarts", "2", "--backoff", "0",
                 "--elastic", "--", "train", "checkpoint.every=1", f"run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert [line for line in err.splitlines() if line.startswith("jaxpar launch:")] == [
        "jaxpar launch: process 1 was killed by SIGKILL; restart 1 of 2 in 0 s.",
        "jaxpar launch: process 1 was killed by SIGKILL; restart 2 of 2 in 0 s on 1 process (slot 1 failed again "
        "on restart: left out)."]
    assert [r["event"] for r in _events(run_dir)] == ["restart", "shrink"]


def test_a_failure_that_a_restart_would_repeat_ends_the_run_as_without_restarts(tmp_path, monkeypatch, capsys):
    from jaxpar.cli import main

    _children_run('if [ "$JAXPAR_PROCESS_ID" = 1 ]; then exit 1; fi\nexit 0\n', tmp_path, monkeypatch)
    code = main(["launch", "--processes", "2", "--restarts", "3", "--", "train", "checkpoint.every=1",
                 f"run.dir={tmp_path / 'run'}"])
    assert code == 1
    assert capsys.readouterr().err.splitlines() == ["jaxpar launch: process 1 exited with code 1."]
    assert not (tmp_path / "run" / "events.jsonl").exists()


# ------------------------------------------------------------------------------------ plain Python

def test_goodput_counts_each_kept_step_once_and_charges_restarts_recomputed_steps_and_saves():
    def attempt(t: float, ready: float, resumed: int, steps: list[tuple[int, float]], saves=(), finished=None):
        rows = [{"event": "start", "t": t, "ready_t": ready, "resumed": resumed}]
        clock = ready
        for step, seconds in steps:
            clock += seconds
            rows.append({"event": "step", "t": clock, "step": step, "s": seconds})
        rows += [{"event": "save", "t": clock, "step": steps[-1][0], "s": s} for s in saves]
        if finished is not None:
            rows.append({"event": "end", "t": clock, "step": steps[-1][0], "finished": finished})
        return rows

    older_job = attempt(-50, -45, 0, [(1, 3.0), (2, 1.0)], finished=True)  # a finished run: not this job's
    # Attempt 1 starts at 0, is ready at 2, compiles 4 s into its first step and runs steps 1-4 at 1 s each; it
    # saves once (0.5 s) and dies after step 4 (t=10), having saved step 2. Attempt 2 starts at 11, is ready at
    # 14, resumes from step 2, compiles 3 s into its first step and runs steps 3-6.
    first = attempt(0, 2, 0, [(1, 5.0), (2, 1.0), (3, 1.0), (4, 1.0)], saves=[0.5])
    second = attempt(11, 14, 2, [(3, 4.0), (4, 1.0), (5, 1.0), (6, 1.0)], finished=True)
    parts = goodput(current_job(older_job + first + second), now=25.0)
    assert parts["productive_s"] == pytest.approx(6.0)  # steps 1, 2 (attempt 1) and 3-6 (attempt 2), 1 s each
    assert parts["recomputed_steps"] == 2 and parts["recomputed_s"] == pytest.approx(2.0)  # steps 3 and 4, twice
    assert parts["startup_s"] == pytest.approx(2 + 4)  # ready, then the first step's compilation
    # from attempt 1's last row to attempt 2's start, its getting ready and its compilation
    assert parts["restarts"] == 1 and parts["restart_s"] == pytest.approx(1 + 3 + 3)
    assert parts["checkpoint_saves"] == 1 and parts["checkpoint_s"] == pytest.approx(0.5)
    assert parts["wall_s"] == pytest.approx(25.0) and parts["goodput"] == pytest.approx(6.0 / 25.0)
    assert parts["other_s"] == pytest.approx(25 - 6 - 2 - 6 - 7 - 0.5)


def test_an_elastic_run_keeps_each_devices_rows_and_says_when_the_batch_cannot_be_kept():
    cfg = Config().replace(**{"train.batch_size": 16})
    assert rows_per_device(cfg, {"data": 8, "tensor": 1, "expert": 1, "stage": 1}) == 2
    assert keep_rows(cfg, 4, rows=2) == {"train.grad_accum": 2}  # data=4 (mesh.data=-1 fills the devices)
    assert keep_rows(cfg, 8, rows=2) == {"train.grad_accum": 1}
    staged = cfg.replace(**{"mesh.stage": 2, "parallel.pipeline.microbatches": 2})
    assert keep_rows(staged, 4, rows=2) == {"parallel.pipeline.microbatches": 4}  # data=2 x stage=2
    assert keep_rows(cfg.replace(**{"mesh.data": 2, "mesh.tensor": 4}), 4, rows=8) is None  # not as written
    with pytest.raises(ConfigError, match="its 3 rows per device do not divide it over data=4"):
        keep_rows(cfg.replace(**{"train.batch_size": 18}), 4, rows=3)


# ------------------------------------------------------------------------- runs of real processes

# Each launched process runs this in place of `python -m jaxpar`: it holds the replication of the in-memory
# copy of step N while <hold>/replicate-N exists, and the asynchronous save of step N (before its folder's
# final rename) while <hold>/save-N exists, marking each with a holding-... file, so that a test can kill a
# process right there.
_HOOKS = """
import asyncio, os, sys, time
from pathlib import Path

import orbax.checkpoint as ocp
from jaxpar.train import local_copy

hold = Path(os.environ["JAXPAR_TEST_HOLD"])


def held(what, who=""):
    if (hold / what).exists():
        (hold / f"holding-{what}{who}").touch()
        return True
    return False


replicate = local_copy.LocalCopies._replicate


def held_replicate(self, step, own):
    if held(f"replicate-{step}", f"-{self.process}"):
        time.sleep(600)
    return replicate(self, step, own)


local_copy.LocalCopies._replicate = held_replicate
rename = ocp.path.atomicity.AtomicRenameTemporaryPath
finalize = rename.finalize


async def held_finalize(self, *args, **kwargs):
    if held(f"save-{self.get_final().name}"):
        await asyncio.sleep(600)
    await finalize(self, *args, **kwargs)


rename.finalize = held_finalize
from jaxpar.cli import main  # noqa: E402

sys.exit(main(sys.argv[3:]))  # after '-m jaxpar'
"""


def _launch(tmp_path: Path, run_dir: Path, flags: list[str], *settings: str) -> subprocess.Popen:
    """`jaxpar launch --processes 2 --devices-per-process 4 FLAGS -- train TINY SETTINGS`, its processes run
    through _HOOKS; stderr goes to <run_dir>.err."""
    hooks, wrapper, hold = tmp_path / "hooks.py", tmp_path / "python-with-hooks", tmp_path / "hold"
    hooks.write_text(_HOOKS)
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {hooks} \"$@\"\n")
    wrapper.chmod(0o755)
    hold.mkdir(exist_ok=True)
    args = ["launch", "--processes", "2", "--devices-per-process", "4", *flags, "--", "train", "--no-progress", *TINY,
            *settings, f"run.dir={run_dir}"]
    script = f"import sys; sys.executable = {str(wrapper)!r}; from jaxpar.cli import main; sys.exit(main({args!r}))"
    with open(f"{run_dir}.err", "w") as err:
        return subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, "JAXPAR_TEST_HOLD": str(hold)}, start_new_session=True)


def _end(launcher: subprocess.Popen, run_dir: Path) -> None:
    """Kill what is left of a launched run (the launcher and its processes: one process group) and its
    in-memory copies, whether the test passed or not."""
    try:
        os.killpg(launcher.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    launcher.wait()
    shutil.rmtree(run_folder(run_dir), ignore_errors=True)


def _logged(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def _wait_for(condition, launcher: subprocess.Popen, what: str, run_dir: Path) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not condition():
        if launcher.poll() is not None or time.monotonic() > deadline:
            launcher.kill()
            pytest.fail(f"{what}: the launcher ended or timed out; {Path(f'{run_dir}.err').read_text()[-3000:]}")
        time.sleep(0.1)


def _kill_slot(run_dir: Path, slot: int) -> None:
    """SIGKILL the launched `jaxpar train` process of `slot` for run_dir."""
    for entry in Path("/proc").iterdir():
        try:
            cmdline, environ = (entry / "cmdline").read_bytes(), (entry / "environ").read_bytes().split(b"\0")
        except (OSError, NotADirectoryError):
            continue
        if f"run.dir={run_dir}".encode() in cmdline and f"JAXPAR_SLOT={slot}".encode() in environ:
            os.kill(int(entry.name), signal.SIGKILL)
            return
    pytest.fail(f"no process of slot {slot}")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    """The losses of the 12-step run on 2 processes x 4 devices (data=8), never interrupted."""
    run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
    result = subprocess.run([sys.executable, "-m", "jaxpar", "launch", "--processes", "2", "--devices-per-process", "4",
                             "--", "train", "--no-progress", *TINY, f"run.dir={run_dir}"], cwd=REPO,
                            capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stderr[-3000:]
    return _losses(run_dir)


# Both real-process runs compare with the module's `uninterrupted` run; xdist_group keeps them on one worker,
# which computes it once.
@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.xdist_group("elastic_processes")
def test_three_kills_during_replication_between_saves_and_during_a_save_lose_nothing(tmp_path, uninterrupted):
    run_dir, hold, rng = tmp_path / "run", tmp_path / "hold", random.Random()
    hold.mkdir()
    (hold / "replicate-3").touch()
    launcher = _launch(tmp_path, run_dir, ["--restarts", "3", "--backoff", "0.5"], "checkpoint.every=2",
                       "checkpoint.keep=1", "checkpoint.local_every=1")
    try:
        # 1. While both processes pass their in-memory copies of step 3 to each other.
        _wait_for(lambda: len(list(hold.glob("holding-replicate-3-*"))) == 2, launcher, "replication", run_dir)
        _kill_slot(run_dir, rng.randrange(2))
        (hold / "replicate-3").unlink()
        # 2. At a random moment a step or two after the restart.
        _wait_for(lambda: (run_dir / "events.jsonl").exists() and _logged(run_dir)[-1:] >= [4], launcher, "step 4",
                  run_dir)
        time.sleep(rng.uniform(0, 1.5))
        _kill_slot(run_dir, rng.randrange(2))
        # 3. During the asynchronous save of the next checkpoint but one, with checkpoint.keep=1.
        target = max(_logged(run_dir)[-1:] + [4]) // 2 * 2 + 4
        (hold / f"save-{target}").touch()
        _wait_for(lambda: (hold / f"holding-save-{target}").exists(), launcher, f"the save of step {target}", run_dir)
        held_back = checkpoint_steps(run_dir)
        _kill_slot(run_dir, rng.randrange(2))
        (hold / f"save-{target}").unlink()
        assert launcher.wait(timeout=TIMEOUT_S) == 0, Path(f"{run_dir}.err").read_text()[-3000:]
    finally:
        _end(launcher, run_dir)
    assert held_back == [target - 2]  # the one checkpoint kept is not deleted before the next is complete
    assert _losses(run_dir) == uninterrupted  # exactly
    rows = _events(run_dir)
    assert [r["event"] for r in rows] == ["restart"] * 3 and all(r["processes"] == 2 for r in rows)
    assert (rows[0]["step_resumed"], rows[0]["restored_from"]) == (3, "memory")
    assert all(r["step_resumed"] >= (target if i == 2 else 3) and r["steps_lost"] >= 0 for i, r in enumerate(rows))
    parts = json.loads((run_dir / "summary.json").read_text())["goodput"]
    assert 0 < parts["goodput"] < 1 and parts["restarts"] == 3 and parts["restart_s"] > 0
    assert parts["checkpoint_saves"] > 12 and parts["checkpoint_s"] > 0
    assert parts["recomputed_steps"] == sum(r["steps_lost"] for r in rows)
    assert not run_folder(run_dir).exists()  # the finished run's in-memory copies are gone


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.xdist_group("elastic_processes")
def test_an_elastic_run_goes_on_with_the_process_left_and_grows_back(tmp_path, uninterrupted):
    run_dir, down = tmp_path / "run", tmp_path / "down"
    down.mkdir()
    launcher = _launch(tmp_path, run_dir, ["--restarts", "2", "--backoff", "0.5", "--elastic", "--min-processes", "1",
                                           "--health-check", f"test ! -e {down}/$JAXPAR_SLOT", "--regrow-after", "1"],
                       "checkpoint.every=2")
    try:
        _wait_for(lambda: _logged(run_dir)[-1:] >= [3], launcher, "step 3", run_dir)
        (down / "1").touch()  # slot 1 is broken for good
        _kill_slot(run_dir, 1)
        _wait_for(lambda: "on data=4 (4 cpu devices)" in Path(f"{run_dir}.err").read_text()
                  and len(_logged(run_dir)) >= 6, launcher, "two steps on 4 devices", run_dir)
        (down / "1").unlink()  # repaired
        # checked at once (else within --regrow-after): on a fast host the 12 steps could end before
        os.kill(launcher.pid, signal.SIGUSR1)
        assert launcher.wait(timeout=TIMEOUT_S) == 0, Path(f"{run_dir}.err").read_text()[-3000:]
    finally:
        _end(launcher, run_dir)
    err = Path(f"{run_dir}.err").read_text()
    assert ("[0] jaxpar: elastic: on 4 devices, train.grad_accum=2 (the config's mesh, the global batch of 16 at 2 "
            "rows a device).") in err
    rows = _events(run_dir)
    assert [(r["event"], r["processes"], r["devices"], r["layout"]) for r in rows] == [
        ("shrink", 1, 4, "data=4 grad_accum=2 fp32"), ("regrow", 2, 8, "data=8 fp32")]
    losses = _losses(run_dir)
    assert sorted(losses) == sorted(uninterrupted)
    for step, loss in uninterrupted.items():
        assert abs(losses[step] - loss) <= 1e-5 * abs(loss), (step, losses[step], loss)


# ------------------------------------------------------------------ the cluster recipes in docs/failures.md

def _recipes() -> tuple[str, dict]:
    blocks = fenced_blocks(REPO / "docs" / "failures.md")
    script = next(b.text for b in blocks if b.language == "bash" and b.text.startswith("#!/bin/bash\n#SBATCH"))
    manifest = next(yaml.safe_load(b.text) for b in blocks if b.language == "yaml" and "kind: JobSet" in b.text)
    return script, manifest


def test_the_slurm_script_is_valid_bash_that_requeues_and_trains_elastically(tmp_path):
    script, _ = _recipes()
    (tmp_path / "job.sh").write_text(script)
    checked = subprocess.run(["bash", "-n", str(tmp_path / "job.sh")], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    assert "#SBATCH --requeue" in script and "scontrol requeue" in script and "jaxpar train --elastic" in script


def test_the_jobset_manifest_has_what_a_jobset_needs():
    _, manifest = _recipes()
    assert manifest["apiVersion"].startswith("jobset.x-k8s.io/") and manifest["kind"] == "JobSet"
    assert manifest["metadata"]["name"] and manifest["spec"]["failurePolicy"]["maxRestarts"] >= 1
    (workers,) = manifest["spec"]["replicatedJobs"]
    job = workers["template"]["spec"]
    assert job["completionMode"] == "Indexed" and job["parallelism"] == job["completions"]
    assert job["backoffLimit"] == 0  # a failed pod fails its Job, so the JobSet's failure policy restarts them all
    pod = job["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    (container,) = pod["containers"]
    assert container["image"] and container["command"][:3] == ["jaxpar", "train", "--elastic"]
    env = {e["name"]: e for e in container["env"]}
    assert int(env["JAXPAR_NUM_PROCESSES"]["value"]) == job["parallelism"] * workers["replicas"]
    assert env["JAXPAR_PROCESS_ID"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    # pod 0 of the JobSet's headless service: <jobset>-<job>-<job index>-<pod index>.<jobset>
    host, port = env["JAXPAR_COORDINATOR"]["value"].rsplit(":", 1)
    name = manifest["metadata"]["name"]
    assert host == f"{name}-{workers['name']}-0-0.{name}" and port.isdigit()


def test_an_elastic_start_keeps_the_configs_mesh_when_it_fits_and_else_takes_the_planners_layout(
        tmp_path, monkeypatch, capsys):
    import jax

    from jaxpar.plan import replan as replan_module

    (tmp_path / "elastic.json").write_text(json.dumps({"rows_per_device": 2, "devices": 8}))
    base = Config().replace(**{"train.batch_size": 16, "run.dir": str(tmp_path)})
    fits, searched = [True], []
    monkeypatch.setattr(replan_module, "_fits", lambda layout, devices, budget: fits[0])
    best = {"mesh.data": 2, "mesh.tensor": 2, "train.grad_accum": 4}
    monkeypatch.setattr(replan_module, "_planned",
                        lambda cfg, devices, budget: searched.append(len(devices)) or (best, "data=2 tensor=2"))
    four = jax.devices()[:4]

    kept = replan_module.replan(base, four)  # mesh.data=-1: data=4, and grad_accum=2 keeps 2 rows a device
    assert (kept.mesh.data, kept.train.grad_accum, searched) == (-1, 2, [])
    assert capsys.readouterr().err == ("jaxpar: elastic: on 4 devices, train.grad_accum=2 (the config's mesh, the "
                                       "global batch of 16 at 2 rows a device).\n")
    written = base.replace(**{"mesh.data": 2, "mesh.tensor": 4})  # 8 devices as written
    planned = replan_module.replan(written, four)
    assert (planned.mesh.data, planned.mesh.tensor, planned.train.grad_accum, searched) == (2, 2, 4, [4])
    assert "mesh.data=2 mesh.tensor=4 does not lay out on 4 devices, so the planner's " \
           "best layout that fits: data=2 tensor=2" in capsys.readouterr().err
    fits[0] = False  # the config's mesh lays out, but over the memory budget
    assert replan_module.replan(base, four).train.grad_accum == 4 and searched == [4, 4]
    assert "does not fit" in capsys.readouterr().err
    assert replan_module.replan(base, jax.devices()) == base.replace(**{"train.grad_accum": 1})  # as recorded


def test_an_elastic_replan_searches_the_mesh_and_microbatches_with_the_recipe_held():
    from jaxpar.plan.replan import held_settings
    from jaxpar.plan.search import enumerate_layouts

    written = Config().replace(**{"model.n_layers": 4, "train.batch_size": 16, "mesh.data": 2, "mesh.tensor": 4,
                                  "parallel.zero": 3, "train.remat": "full"})
    ladders = enumerate_layouts(written, 4, held_settings(written))
    assert [(rungs[0]["mesh.data"], rungs[0]["mesh.tensor"]) for rungs in ladders] == [(4, 1), (2, 2), (1, 4)]
    rungs = [rung for ladder in ladders for rung in ladder]
    assert all(r["parallel.zero"] == 3 and r["train.remat"] == "full" and r["mesh.stage"] == 1 for r in rungs)
    assert len(enumerate_layouts(written, 4, {})) > 10 * len(ladders)  # what the whole search would compile
    staged = written.replace(**{"mesh.data": 1, "mesh.stage": 2, "parallel.pipeline.schedule": "1f1b",
                                "parallel.pipeline.microbatches": 4})
    rungs = [rung for ladder in enumerate_layouts(staged, 4, held_settings(staged)) for rung in ladder]
    assert {r.get("parallel.pipeline.schedule") for r in rungs} == {None, "1f1b"}  # with stages, as written
