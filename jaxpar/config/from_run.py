"""model.from_run: start from an earlier run's newest checkpoint. Its model's shape comes from the config
that run saved beside the checkpoint (checkpoints/<step>/meta/metadata, plain JSON), as model.from_hf's
comes from config.json; the weights are read by jaxpar.interop.saved_run.read_run_weights."""

from __future__ import annotations

import json
from pathlib import Path

from jaxpar.config import Config, ConfigError, apply_overrides, flatten_dict

# What the run chose that is not the model's shape: how it trained and computed, not what it is.
NOT_SHAPE = ("lora.", "from_hf", "from_run", "attention", "flash_block_q", "flash_block_kv",
             "moe.capacity_factor", "moe.group_size", "moe.aux_loss_weight", "moe.z_loss_weight", "moe.noise",
             "moe.balance", "moe.bias_rate")


def newest_step(folder: Path) -> int:
    """The newest complete checkpoint's step under <folder>/checkpoints; one sentence when there is none."""
    checkpoints = folder / "checkpoints"
    steps = sorted(int(d.name) for d in checkpoints.iterdir() if d.name.isdigit()
                   and (d / "commit_success.txt").is_file()) if checkpoints.is_dir() else []
    if not steps:
        raise ConfigError(f"model.from_run={str(folder)!r} holds no complete checkpoint (a run saves its final "
                          f"state in <run.dir>/checkpoints).")
    return steps[-1]


def saved_config(folder: Path, step: int | None = None) -> dict:
    """The config the run saved with its checkpoint at `step` (default: the newest), as a nested dict, read
    as plain JSON (so nothing starts jax before its devices are set up)."""
    meta = folder / "checkpoints" / str(newest_step(folder) if step is None else step) / "meta" / "metadata"
    try:
        return json.loads(meta.read_text(encoding="utf-8"))["config"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ConfigError(f"cannot read the config model.from_run's checkpoint saved at {meta} ({e}).") from None


def resolve_run(cfg: Config, given: set[str] = frozenset()) -> Config:
    """The config with model.from_run's model shape filled in (unchanged without one); a given model.* key
    that differs is a contradiction, said in one sentence."""
    folder = cfg.model.from_run
    if not folder:
        return cfg
    if cfg.model.from_hf:
        raise ConfigError("model.from_hf and model.from_run both name the starting weights; give one.")
    theirs = flatten_dict(saved_config(Path(folder))["model"])
    if theirs.get("lora.rank", 0):
        raise ConfigError(f"model.from_run={folder!r} trained adapters; write its weights merged (jaxpar export-hf "
                          f"{folder} --merge --out DIR) and start from model.from_hf=DIR.")
    wanted = {f"model.{k}": v for k, v in theirs.items() if not k.startswith(NOT_SHAPE)}
    if theirs.get("positions") == "rope":
        wanted.pop("model.seq_len", None)  # rotary positions take any length
    now, defaults = flatten_dict(cfg.to_dict()), flatten_dict(Config().to_dict())
    clash = [k for k, v in wanted.items() if k in now and now[k] != v and (k in given or now[k] != defaults[k])]
    if clash:
        raise ConfigError(f"the config sets {clash[0]}={now[clash[0]]}, but model.from_run={folder!r} trained "
                          f"{wanted[clash[0]]}; drop it, since the run fixes the model's shape.")
    return apply_overrides(cfg, {k: v for k, v in wanted.items() if k in now})
