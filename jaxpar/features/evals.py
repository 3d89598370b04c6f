"""Task evaluations during training (train.eval_tasks, train.eval_tasks_every, train.eval_tasks_limit): what a
config gets wrong about them, in one sentence each, before jax starts. Which tasks exist and whether their
datasets read is known only to lm-eval, when the run starts (jaxpar.evals.in_loop)."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

from jaxpar.config import Config
from jaxpar.features.feature import Checks

SWITCHES = ()
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


def checks(cfg: Config, sizes: dict[str, int]) -> Checks:
    t = cfg.train
    for key in ("eval_tasks_every", "eval_tasks_limit"):
        if getattr(t, key) < 0:
            yield f"train.{key} must be 0 or positive, got {getattr(t, key)}."
    names = task_names(t.eval_tasks)
    if not names:
        if t.eval_tasks_every or t.eval_tasks_limit:
            yield "train.eval_tasks_every and train.eval_tasks_limit set how train.eval_tasks run; name the tasks."
        return
    if missing := lm_eval_missing("train.eval_tasks"):
        yield missing
    for name in names:
        if name.endswith(YAML_SUFFIXES) and not Path(name).is_file():
            yield f"train.eval_tasks names the task file {name}, which does not exist."
    if sizes.get("stage", 1) > 1 or sizes.get("context", 1) > 1:
        yield "train.eval_tasks runs on meshes without stages or context parallelism; set mesh.stage=1 and " \
              "mesh.context=1, or evaluate the checkpoints with jaxpar eval."
    if cfg.model.moe.experts and cfg.model.moe.router == "expert_choice":
        yield "train.eval_tasks needs a causal model, and expert_choice routing looks at the whole routing group."
