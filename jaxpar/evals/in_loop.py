"""train.eval_tasks: lm-eval tasks run during training, every train.eval_tasks_every steps (0: at the last step
only), on the weights of that step where the training state holds them, their metrics logged in that step's
metrics row as `eval/<task>/<metric>`.

The tasks and their datasets are read when the run starts (one sentence for an unknown task or an unreadable
dataset, before the first step); the rows of a batch are the mesh's data x expert rows, repeated to at least
MIN_ROWS. lm-eval is imported only by a run that names tasks.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

import jax

from jaxpar.features.evals import task_names, tasks_due
from jaxpar.laid_out.model import LaidOutModel
from jaxpar.session import Session

MIN_ROWS = 8


class TaskEvals:
    """due(step): whether step `step` runs the tasks; run(params) -> ({'eval/<task>/<metric>': value}, seconds
    the tasks took once the step had finished)."""

    def __init__(self, session: Session, model: LaidOutModel):
        self.model, self.train = model, session.cfg.train
        if task_names(self.train.eval_tasks):
            self.tasks, self.lm = _open(session, model)

    def due(self, step: int) -> bool:
        return tasks_due(step, self.train)

    def run(self, params) -> tuple[dict[str, float], float]:
        from jaxpar.evals.command import task_metrics
        from jaxpar.evals.tasks import evaluate

        jax.block_until_ready(params)  # the step's own time stays the step's
        started = time.perf_counter()
        weights = self.model.to_model_order(self._weights(params))
        self.lm.model = dataclasses.replace(self.lm.model, params=weights)
        # no bootstrapped standard errors: the metrics row keeps the metrics alone
        results = evaluate(self.lm, self.tasks, self.train.eval_tasks_limit or None, quiet=True, bootstrap_iters=0)
        scores = {f"eval/{task}/{metric}": value for task, metrics in task_metrics(results).items()
                  for metric, value in metrics.items()}
        return scores, time.perf_counter() - started

    @functools.cached_property
    def _weights(self):
        return jax.jit(self.model.weights)


def _open(session: Session, model: LaidOutModel):
    """(the tasks, their datasets read; the lm-eval model, its weights set before each run)."""
    from jaxpar.evals.harness import EvalModel, JaxparLM
    from jaxpar.evals.tasks import load_tasks, parse_tasks

    tasks = load_tasks(parse_tasks(session.cfg.train.eval_tasks), progress=False)
    rows = session.mesh_sizes["data"] * session.mesh_sizes["expert"]
    lm = JaxparLM(EvalModel.of_config(model.graphdef, None, session.cfg, session.precision, model.layout,
                                      rows * math.ceil(MIN_ROWS / rows)))
    lm.check(tasks)
    return tasks, lm
