"""Preference data (`jaxpar tokenize --preference`, with or without --chat): each record is two
documents, prompt + chosen then prompt + rejected, masked as --sft masks a pair; packed rows keep each
pair whole (chosen at an even document id), the train/validation split falls between pairs, a pair
longer than a row is left out with a warning, and every bad input ends in one sentence."""

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import tokenizer_with_template
from test_pack_plan import reference_plan

from jaxpar.cli import main
from jaxpar.config.objectives import OBJECTIVES
from jaxpar.config.presets import load_config
from jaxpar.data.documents import Documents, load_documents, split_documents
from jaxpar.data.pack_plan import pack_plan
from jaxpar.data.packing import PackSampler, packed_samplers
from jaxpar.data.preference import check_preference_source, is_preference_data
from jaxpar.data.token_folder import TextCodec
from jaxpar.errors import DataError
from jaxpar.tokenize.document_readers import DocumentSpec
from jaxpar.tokenize.folder import tokenize

pytestmark = pytest.mark.xdist_group("test_preference_data")

VOCAB = 300
SEQ = 48
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PREFERENCE = DocumentSpec(preference=True, prompt="prompt", chosen="chosen", rejected="rejected")


def records(count: int = 24) -> list[dict]:
    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, int(rng.integers(3, 8)))) for _ in range(3 * count)]
    found = [{"prompt": f"key {words[i]} ->", "chosen": f" {words[count + i]}.",
              "rejected": f" {words[2 * count + i]}!"} for i in range(count)]
    found[3]["rejected"] = found[3]["chosen"]  # the same response twice is a pair too
    return found


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("preference")
    tokenize([str(write_jsonl(root / "pairs.jsonl", records()))], str(root / "tok"), vocab_size=VOCAB,
             progress=False, spec=PREFERENCE)
    return root / "tok"


def folder_documents(tok: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each document of a tokenized folder as (ids, mask)."""
    meta = json.loads((tok / "meta.json").read_text())
    ids = np.concatenate([np.fromfile(tok / s["file"], meta["dtype"]) for s in meta["shards"]])
    mask = np.concatenate([np.fromfile(tok / s["mask"], np.uint8) for s in meta["shards"]])
    ends = np.fromfile(tok / "documents.bin", np.int64)
    return [(ids[a:b], mask[a:b]) for a, b in zip(np.concatenate([[0], ends[:-1]]), ends)]


def test_each_record_is_a_chosen_then_a_rejected_document(folder):
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["preference"] is True and meta["loss_mask"] is True
    docs, codec, eod = folder_documents(folder), TextCodec(folder), meta["eod_id"]
    assert len(docs) == 2 * len(records())
    for k, record in enumerate(records()):
        chosen, rejected = docs[2 * k], docs[2 * k + 1]
        for (ids, mask), response in ((chosen, record["chosen"]), (rejected, record["rejected"])):
            assert ids[-1] == eod and mask[-1] == 1
            prompt = int(np.argmax(mask))  # the mask: 0 on the prompt, then 1 to the end
            assert prompt > 0 and (mask[:prompt] == 0).all() and (mask[prompt:] == 1).all()
            assert codec.decode([int(i) for i in ids[:prompt]]) == record["prompt"]
            assert codec.decode([int(i) for i in ids[prompt:-1]]) == response
        assert np.array_equal(chosen[0][chosen[1] == 0], rejected[0][rejected[1] == 0])  # one prompt, twice


@pytest.mark.parametrize("template", [CHATML, None], ids=["chat template", "no template"])
def test_conversations_count_only_their_last_response(template, folder, tmp_path, capsys):
    """--preference --chat (fields 'chosen' and 'rejected' by default): an earlier assistant message is
    prompt; only the last one, the response the two conversations differ in, is counted."""
    tokenizer = tokenizer_with_template(folder / "tokenizer.json", tmp_path / "tokenizer", template)
    prompt = [{"role": "user", "content": "key abc ->"}, {"role": "assistant", "content": " xyz."},
              {"role": "user", "content": "and def?"}]
    row = {"chosen": prompt + [{"role": "assistant", "content": " uvw."}],
           "rejected": prompt + [{"role": "assistant", "content": " no!"}]}
    path = write_jsonl(tmp_path / "chats.jsonl", [row, row])
    assert main(["tokenize", "--input", str(path), "--preference", "--chat", "--tokenizer", str(tokenizer),
                 "--out", str(tmp_path / "tok"), "--no-progress"]) == 0
    assert "2 preference pairs" in capsys.readouterr().out
    docs, codec = folder_documents(tmp_path / "tok"), TextCodec(tokenizer)
    assert len(docs) == 4
    given = set()
    for (ids, mask), response in zip(docs, [" uvw.", " no!"] * 2):
        counted = codec.decode([int(i) for i, m in zip(ids[:-1], mask[:-1]) if m])
        assert counted == (f"{response}<|im_end|>\n" if template else f"{response}\n")
        assert mask[-1] == 1 and (np.diff(mask.astype(int)) >= 0).all()  # prompt first, then the response
        given.add(codec.decode([int(i) for i, m in zip(ids, mask) if not m]))
    assert given == {"<|im_start|>user\nkey abc -><|im_end|>\n<|im_start|>assistant\n xyz.<|im_end|>\n"
                     "<|im_start|>user\nand def?<|im_end|>\n<|im_start|>assistant\n" if template
                     else "user: key abc ->\nassistant:  xyz.\nuser: and def?\nassistant: "}


def pair_documents(lengths: list[int], seed: int = 0) -> Documents:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, VOCAB, size=sum(lengths)).astype(np.int32)
    mask = np.ones(sum(lengths), np.uint8)
    return Documents(tokens, np.cumsum(lengths).astype(np.int64), mask, pairs=True)


def test_packed_rows_hold_whole_pairs_chosen_first(folder):
    docs = load_documents(str(folder), VOCAB)
    assert docs.pairs and len(docs) % 2 == 0
    sampler = PackSampler(docs, SEQ, batch_size=4, seed=3)
    rows = [sampler.plan.row(r) for r in range(len(sampler.plan))]
    placed = [piece for row in rows for piece in row]
    lengths = np.diff(np.concatenate([[0], docs.ends]))
    assert rows == reference_plan(lengths, SEQ + 1, 3, pairs=True)  # tests/test_pack_plan.py's specification
    assert sorted(d for d, _, _ in placed) == list(range(len(docs)))  # every document once, whole
    assert all(offset == 0 and length == lengths[d] for d, offset, length in placed)
    for row in rows:
        assert [d % 2 for d, _, _ in row] == [0, 1] * (len(row) // 2)  # pairs, chosen then its rejected
        assert all(row[i + 1][0] == row[i][0] + 1 for i in range(0, len(row), 2))
    assert [d for d, _, _ in placed[::2]] != sorted(d for d, _, _ in placed[::2])  # pairs shuffled
    batch = sampler.windows(np.arange(len(rows)))
    for r, row in enumerate(rows):
        segments = batch.segments_BT[r]
        for s, (d, _, length) in enumerate(row):  # document ids from 0 in each row: chosen even, rejected odd
            where = np.flatnonzero(segments == s)
            assert len(where) == length and (s % 2) == (d % 2)
            assert np.array_equal(batch.tokens_BT[r, where], np.asarray(docs.tokens[docs.starts[d]:docs.ends[d]]))
        padding = segments >= len(row)
        assert (segments[padding] == len(row)).all() and (batch.mask_BT[r, padding] == 0).all()


def test_the_split_falls_between_pairs(folder):
    rng = np.random.default_rng(1)
    docs = pair_documents(list(rng.integers(5, 40, size=40)))
    for fraction in np.linspace(0.05, 0.6, 23):
        train, val = split_documents(docs, float(fraction), 16)
        assert len(train) % 2 == 0 and len(val) % 2 == 0 and train.pairs and val.pairs
        assert int(val.ends[-1]) >= fraction * int(docs.ends[-1])
    train, val = split_documents(load_documents(str(folder), VOCAB), 0.2, SEQ)
    assert len(train) % 2 == 0 and len(val) % 2 == 0 and len(val) >= 2
    with pytest.raises(DataError, match="the corpus has 1 preference pairs"):
        split_documents(pair_documents([30, 30]), 0.5, 16)


def test_a_pair_longer_than_a_row_is_left_out_with_a_warning(capsys):
    docs = pair_documents([5, 6, 30, 10, 4, 4, 20, 12])  # pair 1 (40 tokens) does not fit a row of 33
    plan = pack_plan(np.diff(np.concatenate([[0], docs.ends])), 33, seed=0, pairs=True)
    err = capsys.readouterr().err.strip()
    assert err == ("jaxpar: warning: 1 of 4 preference pairs are longer than a row of model.seq_len + 1 = 33 "
                   "tokens and are left out (the longest has 40).")
    assert sorted(plan.piece_doc.tolist()) == [0, 1, 4, 5, 6, 7]
    with pytest.raises(DataError, match=r"^all 2 preference pairs are longer than a row of model.seq_len \+ 1 = 8 "):
        pack_plan(np.asarray([5, 6, 30, 10]), 8, seed=0, pairs=True)


def data_config(tmp: Path, *overrides: str):
    return load_config(None, [f"run.dir={tmp / 'run'}", f"model.vocab_size={VOCAB}", f"model.seq_len={SEQ}",
                              "data.val_fraction=0.2", *overrides])


def test_the_objective_and_packing_must_fit_the_data(folder, tmp_path):
    plain = tmp_path / "plain"
    tokenize([str(write_jsonl(tmp_path / "docs.jsonl", [{"text": r["prompt"]} for r in records()]))], str(plain),
             tokenizer_file=str(folder), progress=False, spec=DocumentSpec(field="text"))
    for objective in ("dpo", "simpo", "orpo"):
        check_preference_source(data_config(tmp_path, f"data.source={folder}", "data.packing=pack").data,
                                OBJECTIVES[objective])
    cases = [
        (plain, "dpo", "pack", "train.objective=dpo trains on preference pairs, and"),
        ("builtin", "orpo", "pack", "'builtin' is not a folder that `jaxpar tokenize --preference` wrote"),
        (folder, "sft", "pack", "holds preference pairs (chosen, then rejected), which train.objective=sft"),
        (folder, "dpo", "none", "need data.packing=pack to keep each pair whole in one row, not data.packing=none"),
        (folder, "simpo", "concat", "not data.packing=concat"),
    ]
    for source, objective, packing, message in cases:
        cfg = data_config(tmp_path, f"data.source={source}", f"data.packing={packing}")
        with pytest.raises(DataError) as e:
            check_preference_source(cfg.data, OBJECTIVES[objective])
        assert message in str(e.value) and str(e.value).count(". ") == 0, str(e.value)
    check_preference_source(data_config(tmp_path, f"data.source={plain}", "data.packing=none").data, OBJECTIVES["sft"])
    mixed = data_config(tmp_path, f"data.mixture={folder}:1,{plain}:1", "data.packing=pack").data
    assert not is_preference_data(mixed)
    with pytest.raises(DataError, match=f"'{plain}' is not a folder"):
        check_preference_source(mixed, OBJECTIVES["dpo"])
    cfg = data_config(tmp_path, f"data.source={folder}", "data.packing=concat")
    with pytest.raises(DataError, match="need data.packing=pack"):
        packed_samplers(cfg.data, cfg.model, cfg.train)
    cfg = data_config(tmp_path, f"data.source={folder}", "data.packing=pack")
    assert is_preference_data(cfg.data) and all(s.pairs for s in packed_samplers(cfg.data, cfg.model, cfg.train))


GOOD = {"prompt": "a", "chosen": "b", "rejected": "c"}
TALK = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"}]
FIELDS = ["--field-prompt", "prompt", "--field-chosen", "chosen", "--field-rejected", "rejected"]
BAD = [
    ("missing field", [GOOD, {"prompt": "a", "chosen": "b"}], FIELDS, "line 2 has no field 'rejected'."),
    ("empty response", [GOOD, {**GOOD, "chosen": "  "}], FIELDS, "line 2 has an empty 'chosen' response."),
    ("no fields", [GOOD], [], "--preference needs --field-prompt, --field-chosen and --field-rejected"),
    ("with --sft", [GOOD], ["--sft", *FIELDS], "--sft and --preference are two kinds of fine-tuning set"),
    ("with --field-response", [GOOD], [*FIELDS, "--field-response", "x"], "not --field-response."),
    ("prompts differ", [{"chosen": TALK, "rejected": [{"role": "user", "content": "ho"}, TALK[1]]}], ["--chat"],
     "line 1: 'chosen' and 'rejected' differ before their last message"),
    ("not a response", [{"chosen": TALK, "rejected": TALK[:1]}], ["--chat"],
     "line 1: the last message of 'rejected' is not the assistant's"),
    ("empty chat response", [{"chosen": TALK, "rejected": [TALK[0], {**TALK[1], "content": ""}]}], ["--chat"],
     "line 1 has an empty 'rejected' response."),
    ("chat without a list", [{"chosen": TALK}], ["--chat"], "line 1 has no field 'rejected'."),
    ("chat with a prompt field", [GOOD], ["--chat", "--field-prompt", "p"], "so drop --field-prompt."),
]


@pytest.mark.parametrize("rows,flags,message", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_inputs_end_in_one_sentence(rows, flags, message, tmp_path, capsys):
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    assert main(["tokenize", "--input", str(path), "--vocab-size", str(VOCAB), "--out", str(tmp_path / "tok"),
                 "--no-progress", "--preference", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # nothing written


def test_a_preference_objective_on_plain_documents_is_one_sentence_before_compiling(capsys):
    from jaxpar.cli import main

    assert main(["train", "configs/tiny_test.yaml", "train.objective=simpo", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "train.objective=simpo trains on preference pairs" in err and len(err.strip().splitlines()) == 1
