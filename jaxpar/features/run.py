"""The run's own settings: its folder and data source, seed, checkpoints, validation split, the
mixture of tokenized folders (data.mixture), the distributed runtime's heartbeat, and Weights & Biases."""

from __future__ import annotations

from importlib.util import find_spec

from jaxpar.config import Config, quoted
from jaxpar.data.sources import parse_mixture
from jaxpar.features.feature import Checks

MAX_SEED = 2 ** 63 - 1  # numpy wants a non-negative seed, jax one that fits in 64 bits
MAX_HEARTBEAT_S = 86_400  # the distributed runtime takes whole seconds in a C int
WANDB_PROJECT_FORBIDDEN = '/\\#?%:'  # characters W&B refuses in a project name
MAX_WANDB_PROJECT = 128


def checks(cfg: Config, sizes: dict[str, int]) -> Checks:
    if not 0 < cfg.run.heartbeat_timeout <= MAX_HEARTBEAT_S:
        yield (f"run.heartbeat_timeout must be positive and at most {MAX_HEARTBEAT_S} seconds, "
               f"got {cfg.run.heartbeat_timeout}.")
    for key, path in (("data.source", cfg.data.source), ("run.dir", cfg.run.dir)):
        if not path.strip() or not path.isprintable():
            yield f"{key} must be a non-empty path without control characters, got {path!r}."
    if not 0 <= cfg.train.seed <= MAX_SEED:
        yield f"train.seed must be between 0 and 2**63 - 1, got {cfg.train.seed}."
    if min(cfg.checkpoint.every, cfg.checkpoint.local_every) < 0 or cfg.checkpoint.keep <= 0:
        yield ("checkpoint.every and checkpoint.local_every must be 0 (off) or positive, and "
               "checkpoint.keep positive.")
    if not 0 < cfg.data.val_fraction < 1:
        yield f"data.val_fraction must be between 0 and 1, got {cfg.data.val_fraction}."
    yield from _mixture(cfg.data)
    yield from _wandb(cfg.run)


def _wandb(run) -> Checks:
    project = run.wandb_project
    if (not project.strip() or not project.isprintable() or len(project) > MAX_WANDB_PROJECT
            or any(c in WANDB_PROJECT_FORBIDDEN for c in project)):
        yield (f"run.wandb_project must be a name of 1 to {MAX_WANDB_PROJECT} printable characters without "
               f"{' '.join(WANDB_PROJECT_FORBIDDEN)}, got {quoted(project)}.")
    if run.wandb and find_spec("wandb") is None:
        yield "run.wandb=true needs the wandb package, which is not installed: pip install 'jaxpar[wandb]'."


def _mixture(data) -> Checks:
    if not parse_mixture(data.mixture):
        return
    if data.packing == "none":
        yield "data.mixture mixes documents from tokenized folders; set data.packing=pack (or concat)."
    if data.source != "builtin":
        yield f"data.mixture takes the place of data.source; leave data.source unset, not {data.source!r}."
