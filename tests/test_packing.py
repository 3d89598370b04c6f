"""Packed rows (`data.packing`): each document inside a row is computed as if it ran alone, the loss
is the mean over its documents' tokens, and every layout trains packed rows to the single device's
numbers."""

import dataclasses
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import SMALL_MODEL, tokenizer_with_template

from jaxpar.config.precision import POLICIES
from jaxpar.config.presets import load_config
from jaxpar.data.documents import Documents
from jaxpar.data.packing import ConcatSampler, PackSampler
from jaxpar.laid_out.forward import token_loss
from jaxpar.model import Transformer
from jaxpar.model.flash import flash_attention
from jaxpar.model.segments import Segments
from jaxpar.tokenize.document_readers import DocumentSpec
from jaxpar.verify.run import verify

SEQ = 32
VOCAB = 256


def random_documents(seed: int = 0, count: int = 40) -> Documents:
    """Documents of 1 to 20 tokens, and two of 45 (longer than a row of SEQ + 1, so `pack` cuts them)."""
    rng = np.random.default_rng(seed)
    lengths = np.concatenate([rng.integers(1, 21, size=count), [45, 45]])
    return Documents(rng.integers(0, VOCAB, size=int(lengths.sum())).astype(np.int32), np.cumsum(lengths))


def model_for(attention: str, positions: str):
    cfg = load_config(None, ["model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.d_ff=64",
                             f"model.seq_len={SEQ}", f"model.vocab_size={VOCAB}", f"model.attention={attention}",
                             "model.flash_block_q=8", "model.flash_block_kv=8", f"model.positions={positions}"])
    return nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(0)))


def documents_in(batch):
    """(row, positions in the row) of each document piece of a packed batch (padding left out)."""
    pieces = []
    for row in range(batch.tokens_BT.shape[0]):
        for segment in np.unique(batch.segments_BT[row, :-1]):
            where = np.flatnonzero(batch.segments_BT[row, :-1] == segment)
            if batch.mask_BT[row, where].any():
                pieces.append((row, where))
    return pieces


CASES = [("dot", "rope", "pack"), ("flash", "rope", "concat"), ("dot", "learned", "concat"),
         ("flash", "learned", "pack")]


@pytest.mark.parametrize("attention,positions,packing", CASES)
def test_each_packed_document_computes_as_if_alone(attention, positions, packing):
    graphdef, params = model_for(attention, positions)
    sampler_type = PackSampler if packing == "pack" else ConcatSampler
    sampler = sampler_type(random_documents(), SEQ, batch_size=4, seed=1)
    batch = sampler.windows(sampler.starts(0))
    logits = jax.jit(lambda p, tokens, segments: nnx.merge(graphdef, p)(tokens, segments))
    packed_BLV = np.asarray(logits(params, batch.inputs_BL, batch.segments()))
    alone = jax.jit(lambda p, tokens: nnx.merge(graphdef, p)(tokens))
    losses, worst = [], 0.0
    for row, where in documents_in(batch):
        tokens = batch.inputs_BL[row, where]
        own_LV = np.asarray(alone(params, jnp.asarray(np.pad(tokens, (0, SEQ - len(tokens))))[None]))[0, :len(where)]
        worst = max(worst, float(np.abs(packed_BLV[row, where] - own_LV).max()))
        # the document's own next-token losses: targets of the same document (not the next one's first token)
        segments_T, mask_T = batch.segments_BT[row], batch.mask_BT[row]
        counted = (segments_T[where + 1] == segments_T[where]) & (mask_T[where + 1] > 0)
        log_probs = np.asarray(jax.nn.log_softmax(own_LV))
        losses += list(-log_probs[np.flatnonzero(counted), batch.targets_BL[row, where][counted]])
    assert worst <= 1e-5, worst
    assert len(documents_in(batch)) > 4  # several documents share rows
    packed_loss = float(token_loss(graphdef, params, jax.tree.map(jnp.asarray, batch), POLICIES["fp32"]))
    assert abs(packed_loss - np.mean(losses)) <= 1e-5 * abs(packed_loss)

    # The test can fail: without the document mask documents differ, and with learned positions without
    # the position restart too (RoPE depends on relative positions only: inside one document a shift of
    # every position changes nothing).
    segments = batch.segments()
    no_restart = Segments(segments.ids_BL, jnp.broadcast_to(jnp.arange(SEQ), segments.ids_BL.shape))
    for broken in [Segments(jnp.zeros_like(segments.ids_BL), segments.positions_BL)] + (
            [no_restart] if positions == "learned" else []):
        off_BLV = np.asarray(logits(params, batch.inputs_BL, broken))
        assert max(np.abs(off_BLV[row, where] - packed_BLV[row, where]).max()
                   for row, where in documents_in(batch)) > 1e-3


def test_flash_never_reads_the_blocks_of_earlier_documents():
    """Every row's second document starts at 16: the key blocks before it are not read for its queries
    (NaNs put there do not reach them), and its outputs equal dot attention's."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 32, 2, 8)), jnp.float32) for _ in range(3))
    ids = jnp.asarray(np.repeat([[0] * 16 + [1] * 16], 2, axis=0))
    poisoned = [x.at[:, :16].set(jnp.nan) for x in (k, v)]
    out = flash_attention(q, *poisoned, block_q=8, block_kv=8, segment_ids_BL=ids)
    from jaxpar.model.attention import dot_attention

    expected = dot_attention(q, k, v, Segments(ids, ids).visible_BLP()[:, None])
    assert np.isfinite(np.asarray(out[:, 16:])).all()
    np.testing.assert_allclose(out[:, 16:], expected[:, 16:], atol=1e-6)


def test_pack_fills_rows_and_keeps_every_document_token_once():
    docs = random_documents(count=1000)
    sampler = PackSampler(docs, SEQ, batch_size=4, seed=1)
    rows = [sampler.plan.row(r) for r in range(len(sampler.plan))]
    placed = sorted((d, o, n) for row in rows for d, o, n in row)
    lengths = np.diff(np.concatenate([[0], docs.ends]))
    assert sum(n for _, _, n in placed) == lengths.sum()
    assert all(sum(n for *_, n in row) <= SEQ + 1 for row in rows)
    everything = sampler.windows(np.arange(len(rows)))
    assert sampler.efficiency(np.arange(len(rows))) > 0.97
    assert int(everything.mask_BT.sum()) == lengths.sum()  # padding is out of the loss and the counts


# Packed rows on the layouts that treat the batch differently; the first with a tokenized folder.
LAYOUTS = {
    "data=4 x tensor=2, zero 3, pack, tokenized folder": ["mesh.data=4", "mesh.tensor=2", "parallel.zero=3",
                                                        "data.packing=pack"],
    "sequence parallel, flash, concat": ["mesh.data=4", "mesh.tensor=2", "parallel.sequence=true",
                                         "model.attention=flash", "model.flash_block_q=8",
                                         "model.flash_block_kv=8", "data.packing=concat"],
    "data=2 x stage=4 1f1b, learned positions, pack": ["mesh.data=2", "mesh.stage=4",
                                                       "parallel.pipeline.schedule=1f1b", "model.positions=learned",
                                                       "data.packing=pack"],
    "data=2 x tensor=2 x expert=2 MoE, pack": ["mesh.data=2", "mesh.tensor=2", "mesh.expert=2",
                                               "model.moe.experts=4", "data.packing=pack"],
}


@pytest.fixture(scope="module")
def token_folder(tmp_path_factory):
    """The built-in corpus's topics as JSONL documents, tokenized with a 512-token vocabulary."""
    import json

    from jaxpar.data.corpus import builtin_topics
    from jaxpar.tokenize.folder import tokenize

    root = tmp_path_factory.mktemp("packed")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in builtin_topics()[:40]))
    tokenize([str(root / "docs.jsonl")], str(root / "tok"), vocab_size=512, progress=False,
             spec=DocumentSpec(field="text"))
    return root / "tok"


@pytest.mark.parametrize("layout", [pytest.param(name, marks=() if i == 0 else pytest.mark.slow)
                                    for i, name in enumerate(LAYOUTS)])
def test_packed_rows_match_single_device(layout, session_for, token_folder):
    source = [f"data.source={token_folder}", "model.vocab_size=512"] if "tokenized" in layout else []
    result = verify(session_for("train.steps=3", *SMALL_MODEL, *source, *LAYOUTS[layout]), log=lambda line: None)
    assert result["ok"], result
    assert result["loss_max_rel_err"] <= 1e-5 and result["param_max_rel_err"] <= 1e-4


# ---------------------------------------------------------------- supervised fine-tuning


def sft_pairs(path, count: int = 16) -> None:
    """Prompt -> response pairs with a learnable mapping: each of `count` keys has its own value."""
    import json

    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, 5)) for _ in range(2 * count)]
    lines = [json.dumps({"prompt": f"key {words[i]} ->", "response": f" {words[count + i]}."}) for i in range(count)]
    path.write_text("\n".join(lines * 4) + "\n")


@pytest.fixture(scope="module")
def sft_folder(tmp_path_factory):
    from jaxpar.tokenize.folder import tokenize

    root = tmp_path_factory.mktemp("sft")
    sft_pairs(root / "pairs.jsonl")
    tokenize([str(root / "pairs.jsonl")], str(root / "tok"), vocab_size=300, progress=False,
             spec=DocumentSpec(sft=True, prompt="prompt", response="response"))
    return root / "tok"


def test_prompt_tokens_never_reach_the_loss(sft_folder, session_for):
    """The loss of a batch is unchanged when the targets of its prompt tokens are scrambled."""
    from jaxpar.laid_out.forward import logits_losses, mean_loss

    def _mean_of(logits_BLV, rows):  # the mean cross-entropy over the counted targets
        return mean_loss(logits_losses(logits_BLV, rows), rows)[0]

    session = session_for(f"data.source={sft_folder}", "model.vocab_size=300", "data.packing=pack",
                          "model.seq_len=32", "data.val_fraction=0.2")
    batch = session.train_data.windows(session.train_data.starts(0))
    assert 0 < batch.mask_BT.mean() < 1  # prompts and responses
    logits_BLV = jnp.asarray(np.random.default_rng(1).normal(size=(*batch.inputs_BL.shape, 300)), jnp.float32)
    scrambled = batch.tokens_BT.copy()
    prompt = batch.mask_BT == 0
    scrambled[prompt] = np.random.default_rng(2).integers(0, 300, size=int(prompt.sum()))
    assert (scrambled != batch.tokens_BT).any()
    loss = [float(_mean_of(logits_BLV, jax.tree.map(jnp.asarray, b).weighted()))
            for b in (batch, dataclasses.replace(batch, tokens_BT=scrambled))]
    assert loss[0] == loss[1]
    # and the test can fail: scrambling the responses' tokens moves it
    responses = dataclasses.replace(batch, tokens_BT=np.where(prompt, batch.tokens_BT, scrambled.T[::-1].T))
    assert float(_mean_of(logits_BLV, jax.tree.map(jnp.asarray, responses).weighted())) != loss[0]


def test_fine_tuning_set_without_packing_is_refused(sft_folder, capsys, tmp_path):
    from helpers import train_here

    code, err = train_here(capsys, tmp_path / "run", f"data.source={sft_folder}", "model.vocab_size=300")
    assert code == 2 and "data.packing=none would put the prompts in the loss" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_fine_tuning_learns_the_responses(sft_folder, tmp_path):
    from helpers import train_at_level_1

    # the warmup and cosine over the run's 80 steps, not BASE's 40: the loss falls to 0.03x the first, where it
    # took 200 steps with BASE's schedule to reach 0.04x
    code, err = train_at_level_1(tmp_path / "run", f"data.source={sft_folder}", "model.vocab_size=300",
                                 "data.packing=pack", "train.steps=80", "train.lr_schedule_steps=80",
                                 "train.log_every=10", "train.sample_tokens=0", "data.val_fraction=0.2")
    assert code == 0, err[-3000:]
    import json

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < 0.1 * rows[0]["loss"], (rows[0]["loss"], rows[-1]["loss"])
    assert 0 < rows[-1]["packing_efficiency"] <= 1


BAD_INPUTS = [
    ("not json", "{\"text\": \"a\"}\nnot json\n", ["--field", "text"], "line 2 is not JSON"),
    ("missing field", "{\"text\": \"a\"}\n{\"body\": \"b\"}\n", ["--field", "text"], "line 2 has no field 'text'"),
    ("sft without response", "{\"p\": \"a\", \"r\": \"b\"}\n", ["--sft", "--field-prompt", "p"],
     "--sft needs both --field-prompt and --field-response"),
    ("parquet column", None, ["--column", "body"], "has no column 'body'"),
    ("chat that is not messages", "{\"messages\": \"hello\"}\n", ["--chat"],
     "line 1: field 'messages' is not a list of messages"),
]


@pytest.mark.parametrize("name,content,flags,message", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_end_in_one_sentence(name, content, flags, message, tmp_path, capsys):
    from jaxpar.cli import main

    if content is None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "docs.parquet"
        pq.write_table(pa.table({"text": ["a document", "another"]}), path)
    else:
        path = tmp_path / "docs.jsonl"
        path.write_text(content)
    assert main(["tokenize", "--input", str(path), "--vocab-size", "300", "--out", str(tmp_path / "tok"),
                 "--no-progress", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "tok").exists() and [p.name for p in tmp_path.iterdir()] == [path.name]


# ---------------------------------------------------------------- mixtures of tokenized folders


@pytest.fixture(scope="module")
def mixture_folders(tmp_path_factory):
    """'web' and 'code' (half the built-in topics each) with one tokenizer, and 'other' with another."""
    import json

    from jaxpar.data.corpus import builtin_topics
    from jaxpar.tokenize.folder import tokenize

    root, topics = tmp_path_factory.mktemp("mixture"), builtin_topics()
    for name, part in (("web", topics[:45]), ("code", topics[45:])):
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    text = DocumentSpec(field="text")
    tokenize([str(root / "web.jsonl"), str(root / "code.jsonl")], str(root / "shared"), vocab_size=300,
             progress=False, spec=text)
    for name in ("web", "code"):
        tokenize([str(root / f"{name}.jsonl")], str(root / name), tokenizer_file=str(root / "shared"),
                 progress=False, spec=text)
    tokenize([str(root / "code.jsonl")], str(root / "other"), vocab_size=299, progress=False, spec=text)
    return root


@pytest.mark.slow
def test_mixture_draws_by_weight_reports_each_source_and_resumes_exactly(mixture_folders, tmp_path):
    import json

    from helpers import train_at_level_1

    root = mixture_folders
    # A model narrower than the tiny preset's, one layer deep: what is checked is the data (the draws depend on the
    # seed, seq_len and batch, not on the model) and sums over it, and the steps cost half as much
    settings = [f"data.mixture={root / 'web'}:0.7,{root / 'code'}:0.3", "data.packing=pack", "model.vocab_size=300",
                "train.eval_every=50", "train.sample_tokens=0", "model.d_model=32", "model.n_heads=2", "model.d_ff=64",
                "model.n_layers=1"]

    def rows(run):
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k not in ("step_time_s", "tokens_per_s")}
                for line in lines]

    # the whole run checkpoints at 100 and 200; a copy of it without the last checkpoint (and its
    # metrics past step 100, which the resume cuts) trains steps 101 to 200 again
    whole, resumed = tmp_path / "whole", tmp_path / "cut"
    code, err = train_at_level_1(whole, *settings, "train.steps=200", "checkpoint.every=100")
    assert code == 0, err[-3000:]
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "200")
    code, err = train_at_level_1(resumed, *settings, "train.steps=200", "checkpoint.every=100")
    assert code == 0 and "resuming from the checkpoint at step 100" in err, err
    logged = rows(whole)
    assert rows(resumed) == logged and len(logged) == 200  # every metric of every step, the shares too
    web, code = (f"{root / name}" for name in ("web", "code"))
    assert abs(np.mean([r[f"share/{web}"] for r in logged]) - 0.7) <= 0.02
    assert abs(np.mean([r[f"share/{code}"] for r in logged]) - 0.3) <= 0.02
    # the batch loss is a mean over both sources' targets, so it lies between their losses
    assert all(min(r[f"loss/{web}"], r[f"loss/{code}"]) - 1e-6 <= r["loss"] <= max(r[f"loss/{web}"], r[f"loss/{code}"])
               + 1e-6 for r in logged if f"loss/{code}" in r and f"loss/{web}" in r)
    evaluated = [r for r in logged if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [50, 100, 150, 200]
    assert all(abs(0.7 * r[f"val_loss/{web}"] + 0.3 * r[f"val_loss/{code}"] - r["val_loss"]) <= 1e-6
               for r in evaluated)


BAD_MIXTURES = [
    ("negative weight", "{root}/web:-0.5,{root}/code:1", "data.packing=pack", "a positive weight"),
    ("not a tokenized folder", "{root}/web:1,{root}/nowhere:1", "data.packing=pack",
     "which is not a folder `jaxpar tokenize` wrote"),
    ("tokenizers differ", "{root}/web:1,{root}/other:1", "data.packing=pack", "different tokenizers"),
    ("without packing", "{root}/web:1,{root}/code:1", "data.packing=none", "set data.packing=pack"),
]


@pytest.mark.parametrize("name,mixture,packing,message", BAD_MIXTURES, ids=[b[0] for b in BAD_MIXTURES])
def test_bad_mixtures_end_in_one_sentence(name, mixture, packing, message, mixture_folders, capsys, tmp_path):
    from helpers import train_here

    code, err = train_here(capsys, tmp_path / "run", f"data.mixture={mixture.format(root=mixture_folders)}",
                           packing, "model.vocab_size=300")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.mark.parametrize("template", [CHATML, None], ids=["chat template", "no template"])
def test_chats_put_the_assistant_messages_alone_in_the_loss(template, sft_folder, tmp_path):
    """--chat renders each conversation with the tokenizer's template (else `role: content` lines), and
    the loss mask covers exactly the assistant's messages (and the end token)."""
    import json

    from jaxpar.data.token_folder import TextCodec
    from jaxpar.tokenize.folder import tokenize

    tokenizer = tokenizer_with_template(sft_folder / "tokenizer.json", tmp_path / "tokenizer", template)
    chat = [{"role": "user", "content": "key abc ->"}, {"role": "assistant", "content": " xyz."},
            {"role": "user", "content": "and def?"}, {"role": "assistant", "content": " uvw."}]
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": chat}) + "\n")
    meta = tokenize([str(tmp_path / "chats.jsonl")], str(tmp_path / "tok"), tokenizer_file=str(tokenizer),
                    progress=False, spec=DocumentSpec(field="messages", chat=True))
    ids = np.fromfile(tmp_path / "tok" / meta["shards"][0]["file"], np.uint16)
    mask = np.fromfile(tmp_path / "tok" / meta["shards"][0]["mask"], np.uint8)
    codec, eod = TextCodec(tokenizer), meta["eod_id"]
    assert ids[-1] == eod and mask[-1] == 1
    counted = codec.decode([int(i) for i, m in zip(ids[:-1], mask[:-1]) if m])
    given = codec.decode([int(i) for i, m in zip(ids, mask) if not m])
    if template:
        assert counted == " xyz.<|im_end|>\n uvw.<|im_end|>\n"
        assert given == "<|im_start|>user\nkey abc -><|im_end|>\n<|im_start|>assistant\n<|im_start|>user\nand def?" \
                        "<|im_end|>\n<|im_start|>assistant\n"
    else:
        assert counted == " xyz.\n uvw.\n"
        assert given == "user: key abc ->\nassistant: user: and def?\nassistant: "
