"""The packing plan (jaxpar.data.pack_plan): the same rows, pieces and row order as the sequential
first-fit below (the specification, kept here as plain Python), for documents and preference pairs;
the rows PackSampler builds from it; the plan kept in the token folder; the built-in corpus packed
at least 99% full."""

import json

import numpy as np
import pytest

from jaxpar.config.presets import load_config
from jaxpar.data import pack_plan as plans
from jaxpar.data.documents import Documents, load_documents, split_documents
from jaxpar.data.pack_plan import PACK_BUFFER, pack_plan
from jaxpar.data.packing import PackSampler, packed_samplers
from jaxpar.data.token_folder import FORMAT, META, TOKENIZER


def reference_plan(lengths, width: int, seed: int, pairs: bool = False) -> list[list[tuple[int, int, int]]]:
    """The specification: units (documents cut at `width`; or each pair that fits, its two documents
    whole) shuffled with `seed`, each into the first open row with room for it; when none has room
    and PACK_BUFFER rows are open, the fullest (the first of equals) closes. The closed rows in
    closing order, then the open ones in the order they opened."""
    if pairs:
        units = [[(2 * k, 0, int(lengths[2 * k])), (2 * k + 1, 0, int(lengths[2 * k + 1]))]
                 for k in range(len(lengths) // 2) if lengths[2 * k] + lengths[2 * k + 1] <= width]
    else:
        units = [[(d, o, min(width, int(n) - o))] for d, n in enumerate(lengths) for o in range(0, int(n), width)]
    order = np.random.default_rng(seed).permutation(len(units))
    open_rows: list[list] = []  # [free room, pieces]
    closed: list[list] = []
    for i in order:
        unit, size = units[i], sum(piece[2] for piece in units[i])
        for row in open_rows:
            if row[0] >= size:
                row[0] -= size
                row[1].extend(unit)
                break
        else:
            if len(open_rows) == PACK_BUFFER:
                fullest = min(range(len(open_rows)), key=lambda r: open_rows[r][0])
                closed.append(open_rows.pop(fullest)[1])
            open_rows.append([width - size, list(unit)])
    return closed + [row[1] for row in open_rows]


def rows_of(plan) -> list[list[tuple[int, int, int]]]:
    return [plan.row(r) for r in range(len(plan))]


def random_lengths(rng, count: int, width: int, pairs: bool) -> np.ndarray:
    """Short, row-sized and longer documents; for pairs, short enough that most pairs fit."""
    high = width if pairs else 3 * width
    kind = rng.integers(0, 3, size=count)
    return np.where(kind == 0, rng.integers(1, max(2, width // 8), size=count), rng.integers(1, high, size=count))


@pytest.mark.parametrize("pairs", [False, True], ids=["documents", "pairs"])
def test_the_plan_is_the_sequential_first_fit(pairs, capsys):
    checked = 0
    for case in range(40):
        rng = np.random.default_rng(case)
        width = int(rng.choice([2, 3, 7, 33, 100, 513, 4097]))
        count = 2 * int(rng.integers(1, 1500))
        lengths = random_lengths(rng, count, width, pairs)
        if pairs and (lengths[0::2] + lengths[1::2] > width).all():
            continue
        want = reference_plan(lengths, width, case, pairs)
        assert rows_of(pack_plan(lengths, width, case, pairs)) == want, (case, width, count)
        checked += len(want) > PACK_BUFFER  # the buffer filled and rows closed
    assert checked >= 20
    capsys.readouterr()


def test_the_plan_of_todays_corpora_and_heavy_tailed_lengths(capsys):
    """The built-in corpus's parts at three row widths, tests/test_packing.py's random documents, and
    lognormal lengths (mean 1000, a few longer than a row of 4097) as documents and as pairs."""
    builtin = load_documents("builtin", 256)
    corpora = [(np.diff(part.ends, prepend=0), seq_len + 1, False) for seq_len in (64, 128, 512)
               for part in split_documents(builtin, 0.1, seq_len)]
    rng = np.random.default_rng(0)
    corpora.append((np.concatenate([rng.integers(1, 21, size=1000), [45, 45]]), 33, False))
    heavy = np.ceil(np.random.default_rng(1).lognormal(np.log(1000) - 0.72, 1.2, 30000)).astype(np.int64)
    corpora += [(heavy, 4097, False), (heavy // 2, 4097, True)]
    for seed in (0, 1):
        for lengths, width, pairs in corpora:
            assert rows_of(pack_plan(lengths, width, seed, pairs)) == reference_plan(lengths, width, seed, pairs)
    capsys.readouterr()


def test_the_plan_of_equal_sizes_and_empty_documents():
    """Ties everywhere (every unit the same size: the first of the fullest closes) and documents of no
    tokens (no piece); an empty corpus plans no row."""
    for width, size in [(33, 11), (33, 16), (10, 10), (7, 1)]:
        lengths = np.full(3000, size)
        lengths[::7] = 0
        assert rows_of(pack_plan(lengths, width, 5)) == reference_plan(lengths, width, 5)
    assert len(pack_plan(np.zeros(0, np.int64), 9, 0)) == 0


def reference_windows(docs: Documents, rows: list, width: int, pad_id: int = 0) -> list[tuple]:
    """(tokens, segments, positions, mask) of each row: its pieces' tokens, each piece a segment from
    position 0, then the padding, its own segment, out of the loss."""
    out = []
    for row in rows:
        parts = [[], [], [], []]
        for segment, (doc, offset, length) in enumerate(row):
            begin = int(docs.starts[doc]) + offset
            mask = np.ones(length) if docs.mask is None else np.asarray(docs.mask[begin:begin + length])
            for part, values in zip(parts, (docs.tokens[begin:begin + length], np.full(length, segment),
                                            np.arange(length), mask)):
                part.append(values)
        pad = width - sum(len(t) for t in parts[0])
        for part, values in zip(parts, (np.full(pad, pad_id), np.full(pad, len(row)), np.arange(pad), np.zeros(pad))):
            part.append(values)
        out.append(tuple(np.concatenate(part).astype(np.int32) for part in parts))
    return out


@pytest.mark.parametrize("pairs", [False, True], ids=["documents", "pairs"])
def test_sampler_rows_hold_the_plans_pieces(pairs):
    rng = np.random.default_rng(3)
    width = 65
    lengths = random_lengths(rng, 600, width, pairs)
    tokens = rng.integers(0, 1000, size=int(lengths.sum())).astype(np.int32)
    mask = rng.integers(0, 2, size=len(tokens)).astype(np.uint8) if pairs else None
    docs = Documents(tokens, np.cumsum(lengths), mask, pairs)
    sampler = PackSampler(docs, width - 1, batch_size=4, seed=7, pad_id=3)
    rows = reference_plan(lengths, width, 7, pairs)
    picks = np.concatenate([np.arange(len(rows)), rng.integers(0, len(rows), size=50)])
    batch = sampler.windows(picks)
    for name, field in zip(("tokens", "segments", "positions", "mask"), range(4)):
        got = getattr(batch, f"{name}_BT")
        want = np.stack([reference_windows(docs, [rows[r]], width, pad_id=3)[0][field] for r in picks])
        assert got.dtype == np.int32 and np.array_equal(got, want), name
    used = sum(n for r in picks for *_, n in rows[r])
    assert sampler.efficiency(picks) == used / (len(picks) * width)


def write_token_folder(folder, lengths, rng) -> None:
    """A token folder in the format jaxpar.data.token_folder reads: one uint16 shard and documents.bin."""
    folder.mkdir()
    tokens = rng.integers(0, 300, size=int(lengths.sum())).astype(np.uint16)
    tokens.tofile(folder / "shard-0.bin")
    np.cumsum(lengths).astype(np.int64).tofile(folder / "documents.bin")
    (folder / TOKENIZER).write_text("{}")
    (folder / META).write_text(json.dumps({
        "format": FORMAT, "vocab_size": 300, "dtype": "uint16", "tokens": len(tokens),
        "shards": [{"file": "shard-0.bin", "tokens": len(tokens)}],
        "documents": {"file": "documents.bin", "count": len(lengths)}}))


def folder_samplers(folder, seq_len: int = 32, seed: int = 0):
    cfg = load_config(None, [f"data.source={folder}", "data.packing=pack", "model.vocab_size=300",
                             f"model.seq_len={seq_len}", f"train.seed={seed}", "data.val_fraction=0.2"])
    return packed_samplers(cfg.data, cfg.model, cfg.train)


def cached(folder) -> list:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("pack-plan-"))


def test_the_token_folder_keeps_the_plan_and_reuses_it(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    folder = tmp_path / "tok"
    write_token_folder(folder, rng.integers(1, 80, size=400), rng)
    train, val = folder_samplers(folder)
    assert len(cached(folder)) == 2  # the train part's and the validation part's
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]
    lengths = np.diff(train.docs.ends, prepend=0)
    assert rows_of(train.plan) == reference_plan(lengths, 33, 0)

    def planned_again(*args):
        raise AssertionError("planned again")

    monkeypatch.setattr(plans, "pack_plan", planned_again)
    again, _ = folder_samplers(folder)  # read, not planned
    assert rows_of(again.plan) == rows_of(train.plan)
    assert np.array_equal(again.windows(np.arange(5)).tokens_BT, train.windows(np.arange(5)).tokens_BT)
    monkeypatch.undo()
    folder_samplers(folder, seed=1)  # another seed, and another row width: plans of their own
    folder_samplers(folder, seq_len=40)
    assert len(cached(folder)) == 6
    (folder / cached(folder)[0]).write_bytes(b"not a plan")  # unreadable: planned again and replaced
    for name in cached(folder):
        plan = plans.read_plan(folder / name)
        assert plan is None or len(plan) > 0
    assert len(folder_samplers(folder)[0].plan) > 0 and len(folder_samplers(folder, seed=1)[0].plan) > 0
    assert all(plans.read_plan(folder / name) is not None for name in cached(folder))


def test_a_folder_that_cannot_be_written_still_trains(tmp_path, monkeypatch, capsys):
    rng = np.random.default_rng(1)
    folder = tmp_path / "tok"
    write_token_folder(folder, rng.integers(1, 80, size=400), rng)
    before = sorted(p.name for p in folder.iterdir())
    folder.chmod(0o555)

    def refused(source, target):  # root writes into a read-only folder: refuse the rename as the system would
        raise PermissionError(13, "Permission denied", str(target))

    monkeypatch.setattr(plans.os, "replace", refused)
    try:
        train, _ = folder_samplers(folder)
    finally:
        folder.chmod(0o755)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(f"the packing plan is not kept in '{folder}' (Permission denied)" in e for e in err)
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing left behind
    lengths = np.diff(train.docs.ends, prepend=0)
    assert rows_of(train.plan) == reference_plan(lengths, 33, 0)
    batch = train.windows(train.starts(0))
    assert batch.tokens_BT.shape == (train.batch_size, 33) and batch.mask_BT.sum() > 0


@pytest.mark.parametrize("seq_len", [128, 512])
def test_the_builtin_corpus_packs_at_least_99_percent_full(seq_len):
    """The default seq_len (128) and a longer one: every row of the train part, padding counted."""
    train, _ = split_documents(load_documents("builtin", 256), 0.1, seq_len)
    sampler = PackSampler(train, seq_len, batch_size=4, seed=0)
    assert sampler.efficiency(np.arange(len(sampler.plan))) >= 0.99
