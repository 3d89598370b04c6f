"""Test setup: 8 emulated CPU devices, set before jax is imported anywhere."""

import os
import tempfile
from pathlib import Path

from helpers import BASE, TESTS_COMPILE_LEVEL, compile_level_flag, metrics  # imports no jax

# XLA's backend optimisation level 0 (its default is 3): compiling is most of a test's time. Measured on
# 2 cores: a verify's compiles take 11.7 s at level 3, 5.8 s at level 1 and 4.4 s at level 0, and the
# default model's step 0.63, 0.65 and 1.12 s. The few tests that train for tens of steps (the default
# model) or hundreds (a tiny one) run `jaxpar train` in a subprocess at level 1 (helpers.run_jaxpar_at_level_1).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8 "
                           + compile_level_flag(TESTS_COMPILE_LEVEL)).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
# XLA's persistent compilation cache, fresh for each run of the suite (and its subprocesses): many tests
# compile the same program, and compiling is most of their time. Results are the same; only the second
# compile is skipped. verify compiles afresh (jaxpar.verify.run._compiled_afresh) and keeps its references.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # made once, by the first process (workers inherit it)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxpar-tests-xla-cache-")
# jaxpar's own cache (the machine's matmul rate, cpu profiles, compiled plans) fresh for the run too, beside
# XLA's: nothing read from an earlier run, nothing left in the user's ~/.cache.
os.environ["XDG_CACHE_HOME"] = os.path.join(os.environ["JAX_COMPILATION_CACHE_DIR"], "jaxpar-cache")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# Nothing downloads at run time: lm-eval's tasks read local files only (a hub dataset fails at once).
os.environ["HF_DATASETS_OFFLINE"] = os.environ["HF_HUB_OFFLINE"] = "1"
# W&B's own logs and settings beside jaxpar's cache, not in the user's ~/.cache/wandb and ~/.config/wandb
for _name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
    os.environ[_name] = os.path.join(os.environ["JAX_COMPILATION_CACHE_DIR"], _name.lower())

import pytest  # noqa: E402

from jaxpar.config.presets import load_config  # noqa: E402


@pytest.fixture
def session_for(tmp_path):
    """Build a prepared Session from key=value overrides (run.dir inside tmp_path)."""
    from jaxpar.train.run_session import prepare

    def build(*overrides: str):
        return prepare(load_config(None, [f"run.dir={tmp_path / 'run'}", *overrides]))

    return build


# ---------------------------------------------------------------- checkpoint runs, built once per session
# for test_checkpoint.py and test_checkpoint_resilience.py (see helpers.py)


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


@pytest.fixture(scope="module")
def trainer():
    """A trainer for the layout of `ten_steps`, shared by tests that only restore."""
    from jaxpar.config.presets import load_config
    from jaxpar.train.run_session import prepare
    from jaxpar.train.trainer import Trainer

    session = prepare(load_config(BASE[0], BASE[1:]))
    return Trainer(session)


def pytest_collection_modifyitems(config, items):
    """Longest first, so that pytest-xdist's workers finish together: the tests that start processes,
    then the other slow ones, then the quick ones (each in the order of its file)."""
    items.sort(key=lambda item: (item.get_closest_marker("distributed") is None,
                                 item.get_closest_marker("slow") is None))


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most 4 (each emulates 8 devices and compiles on its own)."""
    return max(1, min(os.cpu_count() or 1, 4))


def pytest_sessionfinish(session, exitstatus):
    """Remove this run's compilation cache (only one this conftest made: it is named after the run),
    once, in the process that made it: pytest-xdist's workers inherit it and share it."""
    import shutil

    if hasattr(session.config, "workerinput"):
        return
    folder = os.environ.get("JAX_COMPILATION_CACHE_DIR", "")
    if os.path.basename(folder).startswith("jaxpar-tests-xla-cache-"):
        shutil.rmtree(folder, ignore_errors=True)
