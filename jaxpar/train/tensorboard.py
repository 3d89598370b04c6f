"""run.tensorboard=true: the metrics of metrics.jsonl as TensorBoard event files under
<run.dir>/tensorboard (tensorboardX's writer), so `tensorboard --logdir runs/` shows them."""

from __future__ import annotations

import math
from pathlib import Path


class TensorBoardWriter:
    """Scalars for each logged step: `train/<metric>` for the step's metrics, `validation/loss`
    for the validation loss. On a resume from step `start`, TensorBoard drops what the earlier
    run wrote from that step on (purge_step), since those steps are trained again."""

    def __init__(self, run_dir: Path, start: int):
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(logdir=str(run_dir / "tensorboard"), purge_step=start or None)

    def record(self, record: dict) -> None:
        step = record["step"]
        for key, value in record.items():
            if key == "step" or isinstance(value, (list, bool)) or not math.isfinite(value):
                continue  # per-expert lists and flags are not scalars
            self._writer.add_scalar("validation/loss" if key == "val_loss" else f"train/{key}", value, step)

    def validation(self, step: int, loss: float) -> None:
        self._writer.add_scalar("validation/loss", loss, step)

    def summary(self, summary: dict) -> None:
        """Nothing: TensorBoard keeps scalars by step, and the summary (summary.json) is the run's, not a step's."""

    def close(self) -> None:
        self._writer.close()
