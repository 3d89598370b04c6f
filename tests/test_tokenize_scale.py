"""`jaxpar tokenize` at corpus scale: worker processes, --shard tasks joined by --merge and reruns of a
killed run all give the one-process folder byte for byte; every input kind (folders, globs, .jsonl.gz,
.jsonl.zst, Parquet, a `datasets` folder) gives the same documents; bad input is one sentence."""

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from helpers import resumed_run_matches

from jaxpar.cli import main
from jaxpar.data import builtin_text
from jaxpar.tokenize.document_readers import DocumentSpec
from jaxpar.tokenize.folder import tokenize

TOKENIZER = Path(__file__).parent / "fixtures" / "hf" / "qwen2"
UNIT = 1 << 16  # the smallest unit: a few hundred KB of records make several
TEXT = DocumentSpec(field="text")

pytestmark = pytest.mark.xdist_group("test_tokenize_scale")


def _records() -> list[dict]:
    return [{"text": p, "id": i} for i, p in enumerate(builtin_text().split("\n\n")) if p.strip()]


def _write_jsonl(path: Path, records: list[dict], opener=open) -> Path:
    with opener(path, "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return path


def _tokenize(inputs, out: Path, **options) -> dict:
    return tokenize([str(i) for i in inputs], str(out), tokenizer_file=str(TOKENIZER), progress=False, spec=TEXT,
                    unit_bytes=UNIT, **options)


def _folder_bytes(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _stream(folder: Path) -> tuple[np.ndarray, np.ndarray]:
    """A folder's whole token stream and its document ends."""
    meta = json.loads((folder / "meta.json").read_text())
    tokens = np.concatenate([np.fromfile(folder / s["file"], meta["dtype"]) for s in meta["shards"]])
    return tokens, np.fromfile(folder / "documents.bin", np.int64)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The built-in corpus's paragraphs as JSONL records, and its folder tokenized by one process."""
    root = tmp_path_factory.mktemp("corpus")
    records = _records()
    source = _write_jsonl(root / "docs.jsonl", records)
    _tokenize([source], root / "one")
    return root, records, source, root / "one"


def test_the_folder_is_the_tokenizers_own_encoding_of_each_document(corpus):
    """Independently of jaxpar's batching: each record's text encoded alone, then the end-of-document id."""
    from tokenizers import Tokenizer

    _, records, _, one = corpus
    tokenizer = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    eod = json.loads((one / "meta.json").read_text())["eod_id"]
    expected = [tokenizer.encode(r["text"], add_special_tokens=False).ids + [eod] for r in records]
    tokens, ends = _stream(one)
    assert tokens.tolist() == [i for ids in expected for i in ids]
    assert ends.tolist() == np.cumsum([len(ids) for ids in expected]).tolist()


def test_workers_and_merged_shards_give_the_one_process_folder_byte_for_byte(corpus, tmp_path):
    root, _, source, one = corpus
    assert len(json.loads((one / "meta.json").read_text())["shards"]) >= 6  # several units
    _tokenize([source], tmp_path / "two", workers=2)
    assert _folder_bytes(tmp_path / "two") == _folder_bytes(one)
    parts = [tmp_path / f"part{i}" for i in range(4)]
    for i, part in enumerate(parts):
        _tokenize([source], part, shard=(i, 4))
    assert main(["tokenize", "--merge", *map(str, parts), "--out", str(tmp_path / "merged")]) == 0
    assert _folder_bytes(tmp_path / "merged") == _folder_bytes(one)


def _datasets_folder(folder: Path, records: list[dict]) -> Path:
    """What `datasets`' save_to_disk writes: Arrow stream files listed in state.json."""
    folder.mkdir()
    halves = [records[:len(records) // 2], records[len(records) // 2:]]
    names = [f"data-{k:05d}-of-00002.arrow" for k in range(2)]
    for name, half in zip(names, halves):
        table = pa.Table.from_pylist(half)
        with pa.OSFile(str(folder / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table, max_chunksize=100)
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": n} for n in names]}))
    (folder / "dataset_info.json").write_text("{}")
    return folder


def test_every_input_kind_gives_the_same_documents(corpus, tmp_path):
    root, records, _, one = corpus
    half = len(records) // 2
    halves = tmp_path / "halves"
    halves.mkdir()
    _write_jsonl(halves / "a.jsonl", records[:half])
    _write_jsonl(halves / "b.jsonl", records[half:])
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "docs.parquet", row_group_size=500)
    inputs = {"gzip": [_write_jsonl(tmp_path / "docs.jsonl.gz", records, gzip.open)],
              "zstd": [_write_jsonl(tmp_path / "docs.jsonl.zst", records, _zstd_open)],
              "parquet": [tmp_path / "docs.parquet"], "datasets": [_datasets_folder(tmp_path / "ds", records)],
              "folder": [halves], "glob": [halves / "*.jsonl"]}
    expected = _stream(one)
    for kind, paths in inputs.items():
        spec = DocumentSpec(field="text")
        tokenize([str(p) for p in paths], str(tmp_path / kind), tokenizer_file=str(TOKENIZER), progress=False,
                 spec=spec, unit_bytes=UNIT)
        tokens, ends = _stream(tmp_path / kind)
        assert np.array_equal(tokens, expected[0]) and np.array_equal(ends, expected[1]), kind


def test_a_long_text_file_ends_its_document_however_it_is_cut(tmp_path, monkeypatch):
    """.txt files, a document each, read in pieces cut at line ends (here every 64 bytes, so that the last
    line of the first file crosses a cut): each ends with the end-of-document id, and decodes to its text."""
    from tokenizers import Tokenizer

    import jaxpar.tokenize.work_units as work_units

    monkeypatch.setattr(work_units, "CHUNK_BYTES", 64)
    texts = ["short line\n" * 5 + "a last line much longer than the sixty-four bytes of a piece, with no end",
             "the second file\n"]
    files = [tmp_path / f"{i}.txt" for i in range(2)]
    for path, text in zip(files, texts):
        path.write_text(text)
    tokenize([str(f) for f in files], str(tmp_path / "tok"), tokenizer_file=str(TOKENIZER), progress=False)
    tokens, ends = _stream(tmp_path / "tok")
    eod = json.loads((tmp_path / "tok" / "meta.json").read_text())["eod_id"]
    tokenizer = Tokenizer.from_file(str(TOKENIZER / "tokenizer.json"))
    assert len(ends) == 2 and ends[-1] == len(tokens) and tokens[ends[0] - 1] == eod == tokens[-1]
    assert [tokenizer.decode(tokens[a:b - 1].tolist()) for a, b in zip([0, ends[0]], ends)] == texts


def test_a_rerun_with_another_unit_size_starts_again(corpus, tmp_path, monkeypatch, capsys):
    """Interrupted after two units, then run again with units of another size: the finished units name other
    bytes now, so the rerun starts again, and its folder is a fresh run's."""
    import jaxpar.tokenize.folder as tokenize_module

    _, _, source, _ = corpus
    encode_units = tokenize_module.encode_units

    def two_then_interrupted(encoder, units, *rest):
        encode_units(encoder, units[:2], *rest)
        raise KeyboardInterrupt

    monkeypatch.setattr(tokenize_module, "encode_units", two_then_interrupted)
    with pytest.raises(KeyboardInterrupt):
        _tokenize([source], tmp_path / "out")
    monkeypatch.undo()
    tokenize([str(source)], str(tmp_path / "out"), tokenizer_file=str(TOKENIZER), progress=False, spec=TEXT,
             unit_bytes=2 * UNIT)
    assert "starting again" in capsys.readouterr().err
    tokenize([str(source)], str(tmp_path / "fresh"), tokenizer_file=str(TOKENIZER), progress=False, spec=TEXT,
             unit_bytes=2 * UNIT)
    assert _folder_bytes(tmp_path / "out") == _folder_bytes(tmp_path / "fresh")


def _zstd_open(path, mode, encoding):
    import io

    return io.TextIOWrapper(zstandard.ZstdCompressor().stream_writer(open(path, "wb")), encoding=encoding)


@pytest.mark.slow
def test_a_run_killed_at_random_moments_continues_to_the_same_folder(corpus, tmp_path):
    """SIGKILL (the whole process group, as a scheduler does) at three random moments of a run, each drawn as a
    number of finished units (up to half of them) and a few milliseconds more, so that every run is cut short
    however fast this machine is; each rerun continues the interrupted one and gives the uninterrupted
    folder byte for byte."""
    root, records, _, _ = corpus
    source = _write_jsonl(tmp_path / "big.jsonl", records * 8)
    command = [sys.executable, "-m", "jaxpar", "tokenize", "--input", str(source), "--field", "text",
               "--tokenizer", str(TOKENIZER), "--unit-mb", str(UNIT / 1e6), "--no-progress"]
    subprocess.run([*command, "--out", str(tmp_path / "whole"), "--workers", "2"], check=True, capture_output=True)
    expected = _folder_bytes(tmp_path / "whole")
    units = sum(name.startswith("tokens-") for name in expected)  # one shard a unit here
    rng = np.random.default_rng(0)
    for attempt in range(3):
        out = tmp_path / f"killed{attempt}"
        progress = tmp_path / f".{out.name}.partial" / "units"
        run = subprocess.Popen([*command, "--out", str(out), "--workers", "2"], start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        finished = int(rng.integers(0, units // 2))
        while run.poll() is None and not ((progress / "job.json").exists()
                                          and len(list(progress.glob("[0-9]*.json"))) >= finished):
            time.sleep(0.002)
        time.sleep(rng.uniform(0.0, 0.01))
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
        assert not out.exists()  # cut short
        rerun = subprocess.run([*command, "--out", str(out)], capture_output=True, text=True)
        assert rerun.returncode == 0 and "continuing the interrupted run" in rerun.stderr, rerun.stderr
        assert _folder_bytes(out) == expected
        assert not (tmp_path / f".{out.name}.partial").exists()


def _cut_short(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _bad_inputs(tmp_path: Path, records: list[dict]) -> dict:
    gz = _write_jsonl(tmp_path / "cut.jsonl.gz", records, gzip.open)
    _cut_short(gz)
    zst = _write_jsonl(tmp_path / "cut.jsonl.zst", records, _zstd_open)
    _cut_short(zst)
    pq.write_table(pa.Table.from_pylist([{"body": r["text"]} for r in records[:10]]), tmp_path / "body.parquet")
    return {"glob": ([str(tmp_path / "*.jsonl.bz2")], "matches no file"),
            "gzip cut short": ([str(gz)], "cannot be read to its end: cut short or corrupt"),
            "zstd cut short": ([str(zst)], "cannot be read to its end: cut short or corrupt"),
            "parquet without the field": ([str(tmp_path / "body.parquet")], "has no column 'text'")}


@pytest.mark.parametrize("case", ["glob", "gzip cut short", "zstd cut short", "parquet without the field",
                                  "shard 4/4", "shard 1", "unit-mb nan"])
def test_bad_input_is_one_sentence_and_leaves_nothing(corpus, tmp_path, capsys, case):
    _, records, source, _ = corpus
    if case.startswith("shard"):
        inputs, words, extra = [str(source)], "--shard must be i/n with 0 <= i < n", ["--shard", case.split()[1]]
    elif case.startswith("unit-mb"):
        inputs, words, extra = [str(source)], "--unit-mb must be a number of MB", ["--unit-mb", "nan"]
    else:
        (inputs, words), extra = _bad_inputs(tmp_path, records[:2000])[case], []
    out = tmp_path / "out"
    code = main(["tokenize", "--input", *inputs, "--field", "text", "--tokenizer", str(TOKENIZER), "--out", str(out),
                 "--no-progress", *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and words in err and len(err.splitlines()) == 1, err
    assert not out.exists() and not (tmp_path / ".out.partial").exists()


def test_merge_refuses_parts_of_different_tokenizers_and_training_refuses_a_part(corpus, tmp_path, capsys):
    _, _, source, _ = corpus
    parts = [tmp_path / "part0", tmp_path / "part1"]
    _tokenize([source], parts[0], shard=(0, 2))
    tokenize([str(source)], str(parts[1]), tokenizer_file=str(TOKENIZER.parent / "llama"), progress=False, spec=TEXT,
             unit_bytes=UNIT, shard=(1, 2))
    capsys.readouterr()
    assert main(["tokenize", "--merge", *map(str, parts), "--out", str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err.strip()
    assert "was tokenized with another tokenizer" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "merged").exists()
    (parts[1] / "tokenizer.json").unlink()
    assert main(["tokenize", "--merge", *map(str, parts), "--out", str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err.strip()
    assert "it is not a whole --shard part" in err and len(err.splitlines()) == 1
    assert main(["train", "configs/tiny_test.yaml", f"data.source={parts[0]}", "model.vocab_size=512",
                 f"run.dir={tmp_path / 'run'}", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "join the parts with `jaxpar tokenize --merge`" in err and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_training_on_a_merged_folder_resumes_exactly(corpus, tmp_path, capsys):
    _, _, source, _ = corpus
    parts = [tmp_path / f"part{i}" for i in range(2)]
    for i, part in enumerate(parts):
        _tokenize([source], part, shard=(i, 2))
    assert main(["tokenize", "--merge", *map(str, parts), "--out", str(tmp_path / "merged")]) == 0
    settings = [f"data.source={tmp_path / 'merged'}", "model.vocab_size=512", "data.packing=pack"]
    assert resumed_run_matches(capsys, tmp_path, settings, steps=4, cut=2)
