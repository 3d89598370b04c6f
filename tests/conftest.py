"""Test setup: 8 emulated CPU devices, set before jax is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ["JAX_PLATFORMS"] = "cpu"

import pytest  # noqa: E402

from jaxpar.presets import load_config  # noqa: E402


@pytest.fixture
def session_for(tmp_path):
    """Build a prepared Session from key=value overrides (run.dir inside tmp_path)."""
    from jaxpar.session import prepare

    def build(*overrides: str):
        return prepare(load_config(None, [f"run.dir={tmp_path / 'run'}", *overrides]))

    return build


# ---------------------------------------------------------------- checkpoint runs
# Shared by test_checkpoint.py and test_checkpoint_resilience.py, which import the helpers from here.
# Every run is the tiny preset with one metrics line per step. The learning-rate schedule spans 40
# steps whatever train.steps is, so a run of any length follows the same trajectory as the
# uninterrupted 40-step `reference` run. `reference` and `ten_steps` are built once for both files.

import json  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

BASE = ["configs/tiny_test.yaml", "train.log_every=1", "train.lr_schedule_steps=40", "train.eval_batches=1"]
# step_time_s and tokens_per_s are wall-clock; everything else must match exactly.
DETERMINISTIC = ("step", "loss", "grad_norm", "lr", "loss_scale", "skipped_steps")


def metrics(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: json.loads(line)[k] for k in DETERMINISTIC} for line in lines]


def checkpoint_steps(run_dir: Path) -> list[int]:
    folder = run_dir / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.exists() else []


def partial_saves(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir() if ".orbax-checkpoint-tmp" in p.name)


def train_here(capsys, run_dir: Path, *overrides: str) -> tuple[int, str]:
    """`jaxpar train` in this process; returns the exit code and stderr."""
    from jaxpar.cli import main

    code = main(["train", "--no-progress", *BASE, f"run.dir={run_dir}", *overrides])
    return code, capsys.readouterr().err


@pytest.fixture(scope="session")
def reference(tmp_path_factory) -> list[dict]:
    """Metrics of the uninterrupted 40-step run on the default layout (data=4 x tensor=2)."""
    from jaxpar.cli import main

    run_dir = tmp_path_factory.mktemp("reference") / "run"
    assert main(["train", "--no-progress", *BASE, "train.steps=40", f"run.dir={run_dir}"]) == 0
    return metrics(run_dir)


@pytest.fixture(scope="session")
def ten_steps(tmp_path_factory) -> Path:
    """A 10-step run with checkpoints at steps 5 and 10; tests copy it before changing it."""
    from jaxpar.cli import main

    run_dir = tmp_path_factory.mktemp("ten_steps") / "run"
    assert main(["train", "--no-progress", *BASE, "train.steps=10", "checkpoint.every=5", f"run.dir={run_dir}"]) == 0
    return run_dir


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run_dir, target)
    return target


@pytest.fixture(scope="module")
def trainer():
    """A trainer for the layout of `ten_steps`, shared by tests that only restore."""
    from jaxpar.presets import load_config
    from jaxpar.session import prepare
    from jaxpar.train.trainer import Trainer

    session = prepare(load_config(BASE[0], BASE[1:]))
    return Trainer(session)


def resumed_run_matches(capsys, tmp_path: Path, settings: list[str], steps: int, cut: int) -> bool:
    """Whether a run of `steps` steps cut at a checkpoint at `cut` and resumed logs exactly the metrics
    of the uninterrupted run (both train in this process with BASE and `settings`)."""
    whole, resumed = tmp_path / "whole", tmp_path / "cut"
    assert train_here(capsys, whole, *settings, f"train.steps={steps}")[0] == 0
    assert train_here(capsys, resumed, *settings, f"train.steps={cut}", f"checkpoint.every={cut}")[0] == 0
    assert train_here(capsys, resumed, *settings, f"train.steps={steps}")[0] == 0
    return metrics(resumed) == metrics(whole)
