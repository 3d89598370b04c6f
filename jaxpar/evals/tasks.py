"""Which lm-eval tasks to run, and running them.

A task is named three ways: a path to a task YAML of your own, the name of one of jaxpar's own tasks
(configs/evals/<name>.yaml), or a name lm-eval knows (its registry: hellaswag, arc_easy, mmlu, ...). A YAML's
relative `dataset_kwargs.data_files` are read from its own folder, so a task and its JSONL travel together
and run offline. An unknown name gets the closest names lm-eval knows; a task whose dataset cannot be read
(offline, or a file that is not there) gets one sentence, before any model runs.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import io
import logging
import os
import sys
from pathlib import Path

import datasets
import lm_eval
import yaml
from lm_eval.api.task import Task
from lm_eval.tasks import TaskManager
from lm_eval.tasks._yaml_loader import load_yaml

from jaxpar.config import CONFIG_DIR
from jaxpar.errors import UserError
from jaxpar.features.evals import YAML_SUFFIXES, task_names

OWN_TASKS = CONFIG_DIR / "evals"
BOOTSTRAP_ITERS = 100_000  # lm-eval's own default


def parse_tasks(text: str) -> list[str]:
    """'T1,T2' as task names or paths; one sentence for an empty list."""
    names = task_names(text)
    if not names:
        raise UserError("give at least one task: --tasks NAME[,NAME...] (a task YAML, or a name lm-eval knows).")
    return names


def load_tasks(names: list[str], progress: bool = True) -> list[Task]:
    """The lm-eval tasks of `names` (YAML paths, jaxpar's own names, lm-eval's names), their datasets read
    (with datasets' progress bars, or none)."""
    if not progress:
        datasets.disable_progress_bars()
    return [task for name in names for task in _load(name)]


def _load(name: str) -> list[Task]:
    spec = _spec(name)
    manager = TaskManager(include_defaults=False) if isinstance(spec, dict) else _registry()
    try:
        loaded = manager.load(spec)["tasks"]
    except OSError as e:  # a file that is not there, no connection, offline mode: datasets' errors are OSErrors
        raise UserError(f"the dataset of task {name} cannot be read ({_first_line(e)}); offline, a task reads a "
                        f"local file (dataset_path: json with dataset_kwargs.data_files).") from None
    except ValueError as e:  # datasets' word for a split or a configuration the dataset does not have
        raise UserError(f"task {name} cannot be built ({_first_line(e)}).") from None
    return list(loaded.values())


def _spec(name: str) -> str | dict:
    """A YAML (given, or jaxpar's own) as its config with data files found beside it; else the name."""
    path = Path(name)
    if name.endswith(YAML_SUFFIXES) or path.is_file():
        if not path.is_file():
            raise UserError(f"the task file {name} does not exist.")
        return _config(path)
    if (OWN_TASKS / f"{name}.yaml").is_file():
        return _config(OWN_TASKS / f"{name}.yaml")
    known = _registry().all_tasks
    if name not in known:
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
        hint = f"; the closest are {', '.join(close)}" if close else ""
        raise UserError(f"lm-eval has no task {name!r}{hint} (or give a path to a task YAML).")
    return name


def _config(path: Path) -> dict:
    try:
        config = load_yaml(path)
    except (OSError, ValueError, ImportError, yaml.YAMLError) as e:
        raise UserError(f"the task file {path} cannot be read ({_first_line(e)}).") from None
    if not isinstance(config.get("task"), str):
        raise UserError(f"the task file {path} names no task (a 'task:' line).")
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if files is not None:
        config["dataset_kwargs"] = {**config["dataset_kwargs"], "data_files": _beside(files, path.parent)}
    return config


def _beside(files, folder: Path):
    """data_files (a path, a list, or a split -> path(s) mapping) with relative paths read from `folder`."""
    if isinstance(files, dict):
        return {split: _beside(f, folder) for split, f in files.items()}
    if isinstance(files, list):
        return [_beside(f, folder) for f in files]
    return str(folder / files) if isinstance(files, str) and "://" not in files else files


@functools.cache
def _registry() -> TaskManager:
    """lm-eval's index of its own tasks (a few seconds to build, so only when a name needs it)."""
    return TaskManager()


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0].rstrip(".") if text else type(error).__name__


def evaluate(lm, tasks: list[Task], limit: int | None = None, num_fewshot: int | None = None,
             log_samples: bool = False, quiet: bool = False, bootstrap_iters: int = BOOTSTRAP_ITERS) -> dict:
    """lm-eval's simple_evaluate of `tasks` with `lm`: its results dict (with the samples if asked), in every
    process of a run (each scores every request, as the compiled programs span them all). quiet: without
    lm-eval's progress bars (it has no switch for them; its warnings still show, through logging).
    bootstrap_iters: the resamples of the standard errors that have no formula (perplexities, F1, BLEU)."""
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    # lm-eval would fork a pool for its bootstrap (not safe in a process running XLA's threads), print to
    # stdout (where jaxpar eval's JSON goes), and return nothing where a launcher set LOCAL_RANK to another rank
    os.environ["DISABLE_MULTIPROC"] = "1"
    with (contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext(),
          contextlib.redirect_stdout(sys.stderr), _local_rank_zero()):
        return lm_eval.simple_evaluate(model=lm, tasks=tasks, limit=limit, num_fewshot=num_fewshot,
                                       log_samples=log_samples, bootstrap_iters=bootstrap_iters,
                                       task_manager=TaskManager(include_defaults=False))


@contextlib.contextmanager
def _local_rank_zero():
    """LOCAL_RANK=0 while lm-eval runs (it returns results only there), as it was after."""
    before = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["LOCAL_RANK"]
        else:
            os.environ["LOCAL_RANK"] = before
