"""Evaluating models with EleutherAI's lm-evaluation-harness, an optional extra (pip install 'jaxpar[eval]'):
scoring.py log-likelihoods on a layout, harness.py lm-eval's LM interface, tasks.py which tasks and running
them, command.py `jaxpar eval` and evaluate_model, in_loop.py train.eval_tasks. This module and in_loop.py (which
imports the others only for a run that names tasks) import without lm-eval installed."""

from __future__ import annotations

from importlib.util import find_spec


def lm_eval_missing(what: str) -> str | None:
    """One sentence when lm-eval is not installed (`what` needs it), else None."""
    if find_spec("lm_eval") is None:
        return f"{what} needs lm-eval, which is not installed: pip install 'jaxpar[eval]'."
    return None
