"""Your data: `jaxpar tokenize` (a byte-level BPE trained offline), training on the tokenized folder
with periodic validation, exact resumes, the folder's checks before compiling, and TensorBoard."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from helpers import resumed_run_matches, run_jaxpar_at_level_1, train_here

from jaxpar.cli import main

REQUIRED_METRICS = {"step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s"}

# This module's fixtures are built once, on one pytest-xdist worker
pytestmark = pytest.mark.xdist_group("test_token_data")


@pytest.fixture(scope="module")
def docs_and_tokens(tmp_path_factory):
    """The built-in corpus as a text file, and its folder tokenized with a 2048-token BPE."""
    from jaxpar.data import builtin_text

    root = tmp_path_factory.mktemp("tokens")
    docs = root / "docs.txt"
    docs.write_text(builtin_text(), encoding="utf-8")
    assert main(["tokenize", "--input", str(docs), "--vocab-size", "2048", "--out", str(root / "tok"),
                 "--no-progress"]) == 0
    return docs, root / "tok"


def test_tokenize_writes_a_lossless_folder(docs_and_tokens):
    from tokenizers import Tokenizer

    docs, tok = docs_and_tokens
    meta = json.loads((tok / "meta.json").read_text())
    assert meta["vocab_size"] == 2048 and meta["dtype"] == "uint16" and len(meta["inputs_sha256"]) == 64
    ids = np.concatenate([np.fromfile(tok / s["file"], np.uint16) for s in meta["shards"]])
    assert len(ids) == meta["tokens"] and 0 < ids.max() < 2048
    assert Tokenizer.from_file(str(tok / "tokenizer.json")).decode(ids.tolist()) == docs.read_text(encoding="utf-8")


@pytest.mark.slow
def test_default_model_learns_from_a_tokenized_folder_with_periodic_validation(docs_and_tokens, tmp_path):
    """The quick start's model and layout (data=4 x tensor=2) end to end on a tokenized folder, at a
    quarter of its batch (2 rows a device; in 60 steps the loss falls to 0.82x the first; 0.78x when
    documents were encoded line by line, which cut the same text into 4% more tokens, each carrying less;
    the run took 44 s of CPU against 64 s at half the batch with 8 validation batches): validation on 2
    batches every 20 steps; the loss falls and the run leaves its files behind. (Learning on the built-in
    corpus is asserted by tests/test_precision.py's fp32 and fp16 curves.)"""
    _, tok = docs_and_tokens
    run = tmp_path / "run"
    done = run_jaxpar_at_level_1("train", "configs/default.yaml", f"data.source={tok}", "model.vocab_size=2048",
                                 "train.batch_size=8", "train.steps=60", "train.log_every=5", "train.eval_every=20",
                                 "train.eval_batches=2", f"run.dir={run}", "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, *range(5, 61, 5)]
    assert all(REQUIRED_METRICS <= set(r) for r in rows)
    assert [r["step"] for r in rows if "val_loss" in r] == [20, 40, 60]
    assert rows[-1]["loss"] < 0.85 * rows[0]["loss"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["val_loss"] < rows[0]["loss"] and summary["final_loss"] == rows[-1]["loss"]
    assert summary["layout"] == "data=4 tensor=2" and summary["config"]["mesh"]["tensor"] == 2
    # decoded by the tokenizer, not as bytes
    assert summary["sample"].startswith("The ") and len(summary["sample"]) > 40
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "validation loss" in done.stdout and "sample:" in done.stdout
    # the machine the tokens/s came from, and the MFU against its measured fp32 matmul rate
    machine = summary["machine"]
    assert machine["processor"] and machine["platform"] == "cpu" and machine["native_bf16"] in (True, False)
    assert summary["peak_flops"] == machine["matmul_flops"]["float32"] > 0
    assert summary["mfu"] == pytest.approx(summary["model_flops_per_token"] * summary["tokens_per_s_median"]
                                           / summary["peak_flops"]) and summary["mfu"] > 0
    assert f"MFU {summary['mfu']:.1%} (measured 2048^3 float32 matmul)" in done.stdout


@pytest.mark.slow
def test_resume_on_token_files_repeats_the_same_batches(docs_and_tokens, tmp_path, capsys):
    _, tok = docs_and_tokens
    assert resumed_run_matches(capsys, tmp_path, [f"data.source={tok}", "model.vocab_size=2048"], steps=4, cut=2)


def _broken(tok: Path, tmp_path: Path, damage) -> Path:
    copy = tmp_path / "tok"
    shutil.copytree(tok, copy)
    damage(copy, json.loads((copy / "meta.json").read_text()))
    return copy


def _rewrite_meta(**changes):
    def damage(folder, meta):
        (folder / "meta.json").write_text(json.dumps({**meta, **changes}))
    return damage


@pytest.mark.parametrize("damage, vocab, words", [
    (lambda folder, meta: (folder / meta["shards"][0]["file"]).unlink(), 2048, "is missing"),
    (_rewrite_meta(dtype="uint32"), 2048, "a wrong dtype or a file cut short"),
    (lambda folder, meta: (folder / meta["shards"][0]["file"]).write_bytes(b"\0" * 10), 2048, "file cut short"),
    (lambda folder, meta: None, 1024, "set model.vocab_size=2048"),
    (lambda folder, meta: (folder / "meta.json").write_text("{not json"), 2048, "cannot be read"),
])
def test_a_bad_data_folder_exits_2_in_one_sentence_before_compiling(docs_and_tokens, tmp_path, capsys, damage, vocab,
                                                                    words):
    _, tok = docs_and_tokens
    folder = _broken(tok, tmp_path, damage)
    run = tmp_path / "run"
    code = main(["train", "configs/tiny_test.yaml", f"data.source={folder}", f"model.vocab_size={vocab}",
                 f"run.dir={run}", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and words in err and len(err.splitlines()) == 1, err
    assert not run.exists()  # nothing written


@pytest.mark.parametrize("args, words", [
    (["--vocab-size", "100"], "--vocab-size must be between 258"),
    (["--vocab-size", "512", "--tokenizer", "{tmp}/none.json"], "is neither a tokenizer.json file nor a folder"),
])
def test_tokenize_refuses_bad_arguments(docs_and_tokens, tmp_path, capsys, args, words):
    docs, _ = docs_and_tokens
    out = tmp_path / "out"
    code = main(["tokenize", "--input", str(docs), "--out", str(out), *[a.format(tmp=tmp_path) for a in args]])
    err = capsys.readouterr().err.strip()
    assert code == 2 and words in err and len(err.splitlines()) == 1 and not out.exists(), err


def test_tokenize_applies_an_existing_tokenizer_and_never_overwrites(docs_and_tokens, tmp_path, capsys):
    docs, tok = docs_and_tokens
    again = tmp_path / "again"
    assert main(["tokenize", "--input", str(docs), "--tokenizer", str(tok / "tokenizer.json"), "--out", str(again),
                 "--no-progress"]) == 0
    first = json.loads((tok / "meta.json").read_text())["shards"][0]["file"]
    assert (again / first).read_bytes() == (tok / first).read_bytes()
    assert main(["tokenize", "--input", str(docs), "--vocab-size", "512", "--out", str(again)]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err


def test_tensorboard_event_files_load_with_tensorboards_reader(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    assert train_here(capsys, run, "train.steps=6", "train.eval_every=3", "run.tensorboard=true")[0] == 0
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [
        (r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in rows]
    assert [e.step for e in events.Scalars("validation/loss")] == [3, 6, 6]  # every 3 steps, and the final one
