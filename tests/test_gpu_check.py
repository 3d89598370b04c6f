"""benchmarks/gpu_check.py, the prepared GPU check, in its --dry-run: the same code on the CPU with tiny
models, so that a session lent a GPU finds it working. Its figures are checked for what they are: measured
(a loss that moved, a step that took time), not for a speed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # 39 s, the quick tier's longest test: a benchmark's smoke run, not a module of jaxpar
def test_the_dry_run_measures_every_row_and_verifies(tmp_path):
    results = tmp_path / "RESULTS.md"
    done = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--dry-run", "--results", str(results)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["dry_run"] and report["device"] == "cpu"
    rows = {(r["model"], r["precision"]): r for r in report["rows"]}
    assert set(rows) == {(m, p) for m in ("gpu_300m", "llama3.2-1b shape") for p in ("bf16", "fp8")}
    for row in rows.values():
        assert row["median_step_ms"] > 0 and row["tokens_per_s"] > 0 and row["program_bytes"] > row["temp_bytes"] > 0
        assert 0 < row["final_loss"] < 20
    assert [v["matmul_precision"] for v in report["verify"]] == ["default", "highest"]
    assert all(v["ok"] for v in report["verify"])
    text = results.read_text()
    assert "### GPU check (" in text and "dry run" in text and "| fp8 |" in text
