"""Muon against AdamW on the quick-start model: the same seed, weights and batches, each optimizer at its
learning rate; final losses and both loss curves.

Usage:
    python benchmarks/muon_vs_adamw.py [key=value ...] [--steps N] [--muon-lr LR ...] [--out FILE.json]

Model: configs/default.yaml (what `bash run.sh train` trains: jaxpar's default model, 4 layers, d_model 128,
batch 32 x 128, on mesh.data=4 x mesh.tensor=2, 8 emulated CPU devices), N steps (default 300), then the
key=value overrides. AdamW runs at train.lr (default 3e-3); Muon (train.optimizer=muon) at each --muon-lr
(default: the guide's recommendation, docs/layouts.md#muon-trainoptimizermuon), one run each: several make
a sweep, none leaves AdamW alone. Both follow the same warmup and cosine schedule.
Printed: a markdown table (the mean of the last 10 steps' training losses, the last step's, and the
validation loss on train.eval_batches held-out batches at the end), then one JSON line with every number;
the loss curves go to --out (default benchmarks/results/muon_vs_adamw.json). Not a timing benchmark.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from common import RESULTS, load_settings, markdown

GUIDE_MUON_LR = 1e-2  # the learning rate docs/layouts.md recommends for Muon on this model


def run(cfg, devices) -> dict:
    """One run of `cfg` from fresh weights on jaxpar's batches: each step's training loss and the final
    validation loss."""
    from jaxpar.train.run_session import prepare
    from jaxpar.train.run_summary import validation_loss
    from jaxpar.train.trainer import Trainer

    session = prepare(cfg, devices)
    trainer = Trainer(session)
    state, losses = trainer.init(), []
    for index in range(cfg.train.steps):
        state, metrics = trainer.step(state, trainer.put_windows(session.train_data, session.train_data.starts(index)))
        losses.append(float(metrics["loss"]))
    return {"optimizer": cfg.train.optimizer, "lr": cfg.train.lr, "losses": losses,
            "final_loss": sum(losses[-10:]) / 10, "last_loss": losses[-1],
            "val_loss": float(validation_loss(trainer, state.params, session))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("settings", nargs="*", help="key=value overrides")
    parser.add_argument("--steps", type=int, default=300, help="training steps of each run (default %(default)s)")
    parser.add_argument("--muon-lr", type=float, nargs="*", default=[GUIDE_MUON_LR],
                        help="Muon's peak learning rates, one run each (default %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS / "muon_vs_adamw.json", help="the loss curves (JSON)")
    args = parser.parse_args()
    base = load_settings(["configs/default.yaml", f"train.steps={args.steps}", "train.sample_tokens=0",
                          *args.settings])
    from jaxpar.runtime.devices import setup_devices

    devices = setup_devices(base)
    results = []
    for optimizer, lr in [("adamw", base.train.lr)] + [("muon", lr) for lr in args.muon_lr]:
        print(f"muon_vs_adamw: {optimizer} at lr {lr:g}, {args.steps} steps", file=sys.stderr, flush=True)
        results.append(run(base.replace(**{"train.optimizer": optimizer, "train.lr": lr}), devices))
    adamw = results[0]
    rows = [[r["optimizer"], f"{r['lr']:g}", f"{r['final_loss']:.4f}", f"{r['final_loss'] / adamw['final_loss']:.3f}",
             f"{r['last_loss']:.4f}", f"{r['val_loss']:.4f}", f"{r['val_loss'] / adamw['val_loss']:.3f}"]
            for r in results]
    print(markdown(["optimizer", "peak lr", "final loss (mean of last 10)", "vs AdamW", "last step's loss",
                    "validation loss", "vs AdamW"], rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"steps": args.steps, "runs": results}))
    print(json.dumps({"steps": args.steps, "runs": [{k: v for k, v in r.items() if k != "losses"} for r in results]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
