"""The run's own settings: its folder and data source, seed, checkpoints, validation split, the
mixture of tokenized folders (data.mixture), the distributed runtime's heartbeat, and Weights & Biases."""

from __future__ import annotations

import netrc
import os
from importlib.util import find_spec
from urllib.parse import urlparse

from jaxpar.config import Config, quoted
from jaxpar.config.sources import parse_mixture
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
    elif run.wandb and run.wandb_mode == "online" and not _wandb_key():
        yield ("run.wandb_mode=online needs a W&B login (wandb login, or WANDB_API_KEY), and this machine has "
               "none; log in, or set run.wandb_mode=offline and upload later with wandb sync.")


def _wandb_key() -> bool:
    """Whether W&B will find an API key where `wandb login` leaves it: WANDB_API_KEY, else the netrc entry
    of its host (WANDB_BASE_URL's, api.wandb.ai by default), read without importing wandb."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") in ("offline", "disabled", "dryrun"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):  # no netrc file, or one it cannot read
        return False


def _mixture(data) -> Checks:
    if not parse_mixture(data.mixture):
        return
    if data.packing == "none":
        yield "data.mixture mixes documents from tokenized folders; set data.packing=pack (or concat)."
    if data.source != "builtin":
        yield f"data.mixture takes the place of data.source; leave data.source unset, not {data.source!r}."
