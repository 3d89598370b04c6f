"""End to end: the default model learns, and the run leaves its files behind."""

import json

import pytest
from helpers import SMALL_MODEL, run_jaxpar_at_level_1
from test_verify import LAYOUTS

REQUIRED_METRICS = {"step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s"}
# A layout tests/test_verify.py verifies in the same shape: its step comes from the compilation cache.
VERIFIED = LAYOUTS["data=8, zero 2, remat full"]


@pytest.mark.slow
def test_default_model_loss_falls_on_data4_tensor2(tmp_path):
    run_dir = tmp_path / "run"
    done = run_jaxpar_at_level_1("train", "configs/default.yaml", "train.steps=40", "train.log_every=5",
                                 f"run.dir={run_dir}", "--no-progress")
    out = done.stdout
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 5, 10, 15, 20, 25, 30, 35, 40]
    assert all(REQUIRED_METRICS <= set(r) for r in records)
    assert records[-1]["loss"] < 0.75 * records[0]["loss"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["val_loss"] < records[0]["loss"] and summary["final_loss"] == records[-1]["loss"]
    assert summary["layout"] == "data=4 tensor=2" and summary["config"]["mesh"]["tensor"] == 2
    assert summary["sample"].startswith("The ") and len(summary["sample"]) > 40
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "validation loss" in out and "sample:" in out


@pytest.mark.slow
def test_same_seed_same_run(session_for):
    """Two runs of the same config produce identical losses (deterministic data and init)."""
    import jax

    from jaxpar.train.trainer import Trainer

    runs = []
    for _ in range(2):
        session = session_for("train.steps=3", *SMALL_MODEL, *VERIFIED)
        trainer = Trainer(session)
        state, losses = trainer.init(), []
        for index in range(3):
            state, metrics = trainer.step(state, trainer.put_batch(session.train_data.batch(index)))
            losses.append(metrics["loss"])
        runs.append(jax.device_get(losses))
    assert runs[0] == runs[1]
