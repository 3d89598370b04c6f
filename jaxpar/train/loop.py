"""The training loop: dispatch step N, then read step N-1's metrics (async dispatch stays busy)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from jaxpar.session import Session
from jaxpar.train.report import append_jsonl, plot_loss, write_json_atomic
from jaxpar.train.sample import greedy_sample
from jaxpar.train.trainer import Trainer

SAMPLE_PROMPT = "The "
SAMPLE_TOKENS = 160


def validation_loss(trainer: Trainer, params, session: Session) -> float:
    """Mean loss over fixed, evenly spaced windows of the held-out split."""
    batches = session.val_data.fixed_batches(session.cfg.train.eval_batches)
    losses = [trainer.eval_loss(params, trainer.put_batch(b)) for b in batches]
    return float(np.mean(jax.device_get(losses)))


def _layout(session: Session) -> str:
    return " ".join(f"{axis}={size}" for axis, size in session.mesh_sizes.items() if size > 1) or "single device"


def train(session: Session, progress: bool = True) -> dict:
    """Train, write metrics.jsonl, summary.json and loss.png under run.dir; return the summary."""
    cfg = session.cfg
    t = cfg.train
    trainer = Trainer(cfg, session.mesh())
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    metrics_path = run_dir / "metrics.jsonl"
    metrics_path.unlink(missing_ok=True)
    tokens_per_step = t.batch_size * cfg.model.seq_len
    print(f"jaxpar: training {cfg.model.n_layers}-layer d={cfg.model.d_model} model on {_layout(session)} "
          f"({len(session.devices)} {session.devices[0].platform} devices), {t.steps} steps", file=sys.stderr)

    state = trainer.init()
    bar = tqdm(total=t.steps, desc="train", unit="step", disable=not progress, file=sys.stderr, dynamic_ncols=True)
    records: list[dict] = []
    last_time = time.perf_counter()

    def finish(step: int, metrics) -> None:
        nonlocal last_time
        values = {k: float(v) for k, v in jax.device_get(metrics).items()}
        now = time.perf_counter()
        step_time, last_time = now - last_time, now
        record = {"step": step, **values, "step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time}
        records.append(record)
        if step % t.log_every == 0 or step in (1, t.steps):
            append_jsonl(metrics_path, record)
        bar.set_postfix(loss=f"{values['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
        bar.update(1)

    pending = None
    for index in range(t.steps):
        state, metrics = trainer.step(state, trainer.put_batch(session.train_data.batch(index)))
        if pending is not None:
            finish(*pending)
        pending = (index + 1, metrics)
    finish(*pending)
    bar.close()

    val_loss = validation_loss(trainer, state.params, session)
    sample = greedy_sample(trainer.graphdef, state.params, SAMPLE_PROMPT, SAMPLE_TOKENS, cfg.model.seq_len)
    steady = [r["tokens_per_s"] for r in records[1:]] or [records[0]["tokens_per_s"]]
    summary = {
        "steps": t.steps,
        "first_loss": records[0]["loss"],
        "final_loss": records[-1]["loss"],
        "val_loss": val_loss,
        "tokens_per_s_median": statistics.median(steady),
        "layout": _layout(session),
        "sample": sample,
        "config": cfg.to_dict(),
    }
    write_json_atomic(run_dir / "summary.json", summary)
    plot_loss(records, val_loss, run_dir / "loss.png")
    return summary
