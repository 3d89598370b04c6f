"""Where a run's metrics go besides metrics.jsonl: TensorBoard (run.tensorboard) and Weights & Biases
(run.wandb). The loop hands every logged row, the final validation loss and the summary to MetricSinks,
which passes them to each writer the config turns on (written by the primary process only)."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from jaxpar.config import Config
from jaxpar.train.tensorboard import TensorBoardWriter
from jaxpar.train.wandb_writer import WandbWriter


class MetricWriter(Protocol):
    def record(self, record: dict) -> None: ...

    def validation(self, step: int, loss: float) -> None: ...

    def summary(self, summary: dict) -> None: ...

    def close(self) -> None: ...


class MetricSinks:
    """The writers of one run. `start`: the step the run resumes from (a writer drops what an earlier
    run logged from there on, since those steps are trained again)."""

    def __init__(self, writers: list[MetricWriter]):
        self.writers = writers

    @classmethod
    def open(cls, cfg: Config, run_dir: Path, start: int, primary: bool) -> MetricSinks:
        writers: list[MetricWriter] = []
        if primary and cfg.run.wandb:  # first: it may refuse to start (no login), before another writer opens
            writers.append(WandbWriter(cfg, run_dir, start))
        if primary and cfg.run.tensorboard:
            writers.append(TensorBoardWriter(run_dir, start))
        return cls(writers)

    def record(self, record: dict) -> None:
        for writer in self.writers:
            writer.record(record)

    def validation(self, step: int, loss: float) -> None:
        for writer in self.writers:
            writer.validation(step, loss)

    def summary(self, summary: dict) -> None:
        for writer in self.writers:
            writer.summary(summary)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()
