"""Evaluating models with EleutherAI's lm-evaluation-harness, an optional extra (pip install 'jaxpar[eval]'):
scoring.py log-likelihoods on a layout, harness.py lm-eval's LM interface, tasks.py which tasks and running
them, command.py `jaxpar eval` and evaluate_model, in_loop.py train.eval_tasks. This module and in_loop.py (which
imports the others only for a run that names tasks) import without lm-eval installed."""

from __future__ import annotations

from importlib.util import find_spec

YAML_SUFFIXES = (".yaml", ".yml")  # a task named by its file


def task_names(text: str) -> list[str]:
    """'T1,T2' (train.eval_tasks, --tasks) as its task names or paths; [] for none."""
    return [name.strip() for name in text.split(",") if name.strip()]


def tasks_due(step: int, train) -> bool:
    """Whether step `step` of a run with these train.* settings runs its tasks: every train.eval_tasks_every
    steps, or at the last step only when that is 0."""
    if not task_names(train.eval_tasks):
        return False
    return step % train.eval_tasks_every == 0 if train.eval_tasks_every else step == train.steps


def lm_eval_missing(what: str) -> str | None:
    """One sentence when lm-eval is not installed (`what` needs it), else None."""
    if find_spec("lm_eval") is None:
        return f"{what} needs lm-eval, which is not installed: pip install 'jaxpar[eval]'."
    return None
