"""run.wandb=true: the metrics of metrics.jsonl, the config, the final validation loss and the summary
(machine, goodput, MFU, sample) as a Weights & Biases run, kept under <run.dir>/wandb. With
run.wandb_mode=offline nothing leaves the machine: `wandb sync <run.dir>/wandb/offline-run-*` uploads
the run folders later."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

from jaxpar.config import Config
from jaxpar.errors import UserError
from jaxpar.runtime import machine
from jaxpar.train.report import write_json_atomic

RUN_FILE = "jaxpar-run.json"  # under <run.dir>/wandb: the W&B run id and the last step W&B holds


class WandbUnavailable(UserError):
    """W&B refused to start the run (no login, no connection in online mode, a bad project)."""


class WandbWriter:
    """One W&B run per training run in run.dir, named after the run folder. History: each logged row at
    its step (per-expert lists as `key/0`, `key/1`, ...; flags as 0 or 1), and the final `val_loss`.
    Summary: the summary's numbers flattened (`goodput/productive_s`, `machine/cores`, ...), the
    machine in words (`machine/line`) and the text sample; the config is the run's W&B config.

    Resumes: a resume (`start` > 0) continues the same W&B run (its id is kept in <run.dir>/wandb,
    resume="allow"); a start from step 0 opens a new one, as metrics.jsonl starts over too. W&B keeps
    a run's history in step order and cannot take back rows, so after a resume the steps trained again
    (up to the last step the earlier attempt logged) are not sent again: W&B keeps their first values,
    which an exact resume reproduces anyway except for timings (step_time_s, tokens_per_s). Steps past
    that point, and the summary, come from the resumed attempt. Offline, each attempt is its own
    offline-run-* folder with the same id, and `wandb sync` uploads them in order into one run."""

    def __init__(self, cfg: Config, run_dir: Path, start: int):
        import wandb

        folder = run_dir / "wandb"
        folder.mkdir(parents=True, exist_ok=True)
        kept = _read_run_file(folder / RUN_FILE) if start > 0 else {}
        self._run_file = folder / RUN_FILE
        self._run_id = kept.get("id") or secrets.token_hex(4)  # W&B ids: lowercase letters and digits
        self._sent = kept.get("step", -1)  # the last step W&B holds: rows up to it are not sent again
        self._last_row: dict | None = None  # this attempt's last row: W&B still takes values at its step
        try:
            self._run = wandb.init(project=cfg.run.wandb_project, mode=cfg.run.wandb_mode, dir=str(run_dir),
                                   config=cfg.to_dict(), name=run_dir.resolve().name, id=self._run_id,
                                   resume="allow")
        except wandb.Error as e:  # UsageError (no login), CommError (no connection), ...
            reason = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
            raise WandbUnavailable(
                f"run.wandb=true could not start a W&B run in {cfg.run.wandb_mode} mode ({reason}); log in with "
                f"`wandb login`, or set run.wandb_mode=offline and upload later with `wandb sync`.") from e
        write_json_atomic(self._run_file, {"id": self._run_id, "step": self._sent})  # the id, for a resume

    def record(self, record: dict) -> None:
        step = record["step"]
        if step <= self._sent:
            return  # trained again after a resume: W&B holds this step already
        values = _flat({k: v for k, v in record.items() if k != "step"})
        self._run.log(values, step=step)
        self._sent, self._last_row = step, {"step": step, **values}

    def validation(self, step: int, loss: float) -> None:
        """`val_loss` at `step`, unless that step's row carried one already (the same weights and windows)."""
        open_row = self._last_row is not None and self._last_row["step"] == step
        if step < self._sent or (step == self._sent and (not open_row or "val_loss" in self._last_row)):
            return  # W&B holds this step's val_loss, or has closed the step (an earlier attempt logged it)
        self._run.log({"val_loss": loss}, step=step)
        self._sent = step

    def summary(self, summary: dict) -> None:
        numbers = {k: v for k, v in summary.items() if k != "config"}
        flat = _flat(numbers)
        if isinstance(summary.get("machine"), dict):
            flat["machine/line"] = machine.line(summary["machine"])
        self._run.summary.update({k: v for k, v in flat.items() if v is not None})

    def close(self) -> None:
        self._run.finish()
        write_json_atomic(self._run_file, {"id": self._run_id, "step": self._sent})


def _flat(values: dict, prefix: str = "") -> dict:
    """Nested dicts and lists as `key/inner` and `key/0` entries, flags as 0 or 1."""
    flat = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flat(value, f"{name}/"))
        elif isinstance(value, (list, tuple)):
            flat.update(_flat(dict(enumerate(value)), f"{name}/"))
        else:
            flat[name] = int(value) if isinstance(value, bool) else value
    return flat


def _read_run_file(path: Path) -> dict:
    """The kept id and last step of the run folder's W&B run; nothing when there is none or it is damaged."""
    try:
        kept = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    valid = isinstance(kept, dict) and isinstance(kept.get("id"), str) and isinstance(kept.get("step"), int)
    return kept if valid else {}
