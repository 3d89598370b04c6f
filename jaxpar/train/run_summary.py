"""What a run measures of its model apart from the steps: the validation loss (every train.eval_every steps and
at the end), and the finished run's summary (summary.json, loss.png, a text sample, the machine and MFU)."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxpar.charts import plot_loss
from jaxpar.runtime import machine
from jaxpar.runtime.distributed import is_secondary
from jaxpar.runtime.goodput import TIMELINE, current_job, goodput
from jaxpar.runtime.jsonl import read_jsonl
from jaxpar.sampling.single import sample_text
from jaxpar.session import Session
from jaxpar.train.model_flops import utilization
from jaxpar.train.report import write_json_atomic
from jaxpar.train.sinks import MetricSinks
from jaxpar.train.trainer import Trainer

SAMPLE_PROMPT = "The "


def validation_losses(trainer: Trainer, params, session: Session) -> dict[str, list]:
    """The loss of each batch of fixed, evenly spaced windows of the held-out split, dispatched
    (device arrays: reading them waits), by source: '' alone, or each folder of a mixture."""
    sampler = session.val_data
    return {name: [trainer.eval_loss(params, trainer.put_windows(sampler, s)) for s in starts]
            for name, starts in sampler.validation_starts(session.cfg.train.eval_batches).items()}


def validation_metrics(losses: dict[str, list], session: Session) -> dict[str, float]:
    """'val_loss' (a mixture's: its sources' losses weighted as the mixture draws them) and, for a
    mixture, 'val_loss/<folder>' for each source."""
    means = {name: float(np.mean(jax.device_get(batches))) for name, batches in losses.items()}
    if not session.mixture:
        return {"val_loss": means[""]}
    weighted = sum(w * means[name] for name, w in session.mixture)
    return {"val_loss": weighted, **{f"val_loss/{name}": means[name] for name, _ in session.mixture}}


def validation_loss(trainer: Trainer, params, session: Session) -> float:
    """Mean loss over fixed, evenly spaced windows of the held-out split (of every source, by weight)."""
    return validation_metrics(validation_losses(trainer, params, session), session)["val_loss"]




def _reward_summary(records: list[dict]) -> dict:
    """A GRPO run's first and last mean reward, and the share of its time spent sampling ({} otherwise)."""
    rewarded = [r for r in records if "reward_mean" in r]
    if not rewarded:
        return {}
    timed = rewarded[1:] or rewarded  # the first step compiles both programs
    share = sum(r["generate_s"] for r in timed) / max(sum(r["step_time_s"] for r in timed), 1e-9)
    return {"first_reward": rewarded[0]["reward_mean"], "final_reward": rewarded[-1]["reward_mean"],
            "generate_share": min(share, 1.0)}


def _utilization(session: Session, trainer: Trainer, tokens_per_s: float | None) -> dict:
    """The machine (jaxpar.runtime.machine) and the MFU of the median tokens/s (jaxpar.train.model_flops.utilization).
    On a CPU, one 2048^3 matmul in the compute dtype is timed on the machine's first run, then read from
    the cache."""
    compute = session.precision.compute
    record = machine.cached_describe(session.devices, (compute,) if session.devices[0].platform == "cpu" else ())
    if tokens_per_s is None or trainer.model is not None:  # no step timed, or a model of its own (FLOPs unknown)
        return {"machine": record, "mfu": None}
    return {"machine": record, **utilization(session.cfg, tokens_per_s, session.devices, compute, record)}


def summarize(session: Session, trainer: Trainer, state, every_step: list[dict], records: list[dict],
              sinks: MetricSinks) -> dict:
    """every_step: the run's rows (those an earlier attempt logged, then this one's `records`).
    Validation loss, a sample, summary.json and loss.png (and the validation loss and summary in the
    run's sinks) for a finished run."""
    cfg, run_dir, primary = session.cfg, Path(session.cfg.run.dir), not is_secondary()
    # GRPO holds out no windows: its progress is the reward in metrics.jsonl
    val_loss = None if session.val_data is None else validation_loss(trainer, state.params, session)
    if val_loss is not None:
        sinks.validation(cfg.train.steps, val_loss)
    # An interleaved pipeline stores its stacked layers permuted; the sampler runs the plain model.
    params = trainer.to_model_order(jax.jit(trainer.weights)(state.params))
    moe = cfg.model.moe
    if cfg.train.sample_tokens == 0:
        sample = None
    elif moe.experts and moe.router == "expert_choice":
        sample = None  # each expert picks tokens from the whole group, so generation cannot be causal
        if primary:
            print("jaxpar: no text sample: expert_choice routing looks at the whole routing group, so the model is "
             "not causal and cannot generate one token at a time.", file=sys.stderr)
    else:
        # Every process takes part (the weights span them all); the prompt is replicated on the mesh.
        sample = sample_text(trainer.graphdef, params, cfg.model, SAMPLE_PROMPT, cfg.train.sample_tokens,
                             session.codec, trainer.replicated)
    # The first step of a process includes compilation, so the median leaves it out.
    # Steps that also measured the validation loss took longer, so they are left out too.
    timed = [r for r in records[1:] if "val_loss" not in r] or records[1:]
    steady = [r["tokens_per_s"] for r in (timed or records or every_step)]
    summary = {
        "steps": cfg.train.steps,
        "first_loss": every_step[0]["loss"] if every_step else None,
        "final_loss": every_step[-1]["loss"] if every_step else None,
        "val_loss": val_loss,
        "tokens_per_s_median": statistics.median(steady) if steady else None,
        "layout": session.mesh_name(),
        "goodput": goodput(current_job(read_jsonl(run_dir / TIMELINE)), time.time()) if primary else None,
        "sample": sample,
        "config": cfg.to_dict(),
        **_reward_summary(every_step),
    }
    if primary:
        summary.update(_utilization(session, trainer, summary["tokens_per_s_median"]))
        write_json_atomic(run_dir / "summary.json", summary)
        sinks.summary(summary)
        plot_loss(every_step, val_loss, run_dir / "loss.png")
    return summary
