"""Helpers the test modules share: runs of `jaxpar train` in this process and what they leave.

Every run is the tiny preset with one metrics line per step. The learning-rate schedule spans 40
steps whatever train.steps is, so a run of any length follows the same trajectory as the
uninterrupted 40-step `reference` run (a fixture in conftest.py).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

# A model small enough that a verify of two layouts runs in seconds, big enough to show every layout's
# property: 4 layers of 4 heads of 16, 32 positions, the default batch of 32.
SMALL_MODEL = ("model.d_model=64", "model.d_ff=256", "model.seq_len=32")

# No text sample at the end of a run: no test of these runs reads one (test_moe and test_token_data do).
BASE = ["configs/tiny_test.yaml", "train.log_every=1", "train.lr_schedule_steps=40", "train.eval_batches=1",
        "train.sample_tokens=0"]
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


def steps_saved(cfg, steps: int, finished_after: bool = False) -> list[int]:
    """The steps a run of `steps` steps under `cfg` checkpoints (jaxpar.train.saves.Saves, with nothing
    saved for real), its last step finished after it (2BW's drain: jaxpar.train.pacing.OneBehind) or not."""
    from types import SimpleNamespace

    from jaxpar.train.pacing import InStep, OneBehind
    from jaxpar.train.saves import Saves

    written = []
    checkpoints = SimpleNamespace(save=lambda step, state, trainer: written.append(step))
    local = SimpleNamespace(every=0, due=lambda step: False)
    timeline = SimpleNamespace(save=lambda step, seconds, kind: None)
    pacing = OneBehind(drain=None) if finished_after else InStep()
    saves = Saves(cfg, SimpleNamespace(pacing=pacing), checkpoints, local, timeline, lambda seconds: None)
    for step in range(1, steps + 1):
        if saves.due(step, stopping=False):
            saves.save(step, None, stopping=False)
    saves.final(steps, None)
    return written


def copy_of(run_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run_dir, target)
    return target


def resumed_run_matches(capsys, tmp_path: Path, settings: list[str], steps: int, cut: int) -> bool:
    """Whether a run of `steps` steps cut at a checkpoint at `cut` and resumed logs exactly the metrics
    of the uninterrupted run (both train in this process with BASE and `settings`)."""
    whole, resumed = tmp_path / "whole", tmp_path / "cut"
    assert train_here(capsys, whole, *settings, f"train.steps={steps}")[0] == 0
    assert train_here(capsys, resumed, *settings, f"train.steps={cut}", f"checkpoint.every={cut}")[0] == 0
    assert train_here(capsys, resumed, *settings, f"train.steps={steps}")[0] == 0
    return metrics(resumed) == metrics(whole)


def compile_level_flag(level: int) -> str:
    return f"--xla_backend_optimization_level={level}"


TESTS_COMPILE_LEVEL = 0  # the tests' level: conftest.py sets it and says why


def _at_level_1(command: list[str]) -> subprocess.CompletedProcess:
    flags = os.environ["XLA_FLAGS"].replace(compile_level_flag(TESTS_COMPILE_LEVEL), compile_level_flag(1))
    return subprocess.run(command, capture_output=True, text=True, env={**os.environ, "XLA_FLAGS": flags},
                          timeout=600)


def run_jaxpar_at_level_1(*args: str) -> subprocess.CompletedProcess:
    """`python -m jaxpar ...` with XLA's backend optimisation level 1 instead of the tests' level 0
    (conftest.py): for runs of tens of steps, whose time goes into the steps, not the compiles."""
    return _at_level_1([sys.executable, "-m", "jaxpar", *args])


def run_jaxpar_commands_at_level_1(*commands: list[str]) -> subprocess.CompletedProcess:
    """Several `jaxpar` commands one after the other in one process at level 1, like
    run_jaxpar_at_level_1: jax is imported once. The exit code is the largest of theirs."""
    script = ("import json, sys\nfrom jaxpar.cli import main\n"
              "sys.exit(max([main(args) for args in json.loads(sys.argv[1])]))")
    return _at_level_1([sys.executable, "-c", script, json.dumps(commands)])


def train_at_level_1(run_dir: Path, *overrides: str) -> tuple[int, str]:
    """`jaxpar train` with BASE, like `train_here`, in a process at XLA's level 1 (for runs of hundreds of
    steps); returns the exit code and stderr."""
    done = run_jaxpar_at_level_1("train", "--no-progress", *BASE, f"run.dir={run_dir}", *overrides)
    return done.returncode, done.stderr


def steps_on_random_tokens(trainer, state, steps: int, seed: int = 0):
    """`steps` steps of `trainer` from `state` on random token rows (train.batch_size x seq_len + 1):
    (the state, the last step's metrics)."""
    import numpy as np

    rng, cfg = np.random.default_rng(seed), trainer.cfg
    for _ in range(steps):
        tokens = rng.integers(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.model.seq_len + 1), dtype=np.int32)
        state, metrics = trainer.step(state, trainer.put_batch(tokens))
    return state, metrics


def frozen_leaves(params) -> dict:
    """Every Frozen weight of a state by path (model.lora): (its stored integers on the host, its metadata)."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxpar.model.adapters import Frozen

    return {path: (np.asarray(jax.device_get(v.get_value())), v.get_metadata())
            for path, v in nnx.to_flat_state(params) if isinstance(v, Frozen)}


def tokenizer_with_template(tokenizer_json: Path, folder: Path, template: str | None) -> Path:
    """A tokenizer folder `folder` holding `tokenizer_json`, with `template` as its tokenizer_config.json's
    chat_template (None: no template)."""
    folder.mkdir()
    shutil.copy(tokenizer_json, folder / "tokenizer.json")
    if template:
        (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return folder
