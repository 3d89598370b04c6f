"""Batched generation (jaxpar.sampling): the same tokens as one prompt at a time on every layout, as
transformers' greedy generate on its own checkpoints, the same draws on every layout, each row's stop,
and `jaxpar generate --prompts`."""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.config import precision
from jaxpar.config.presets import load_config
from jaxpar.interop import hf
from jaxpar.model.transformer import Transformer
from jaxpar.sampling.batched import BatchedGenerator, Shape
from jaxpar.sampling.choice import Sampling, choose, row_keys

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
TINY = ("model.d_model=64", "model.n_layers=2", "model.d_ff=256", "model.seq_len=64")
# A flip of a greedy token between two programs is rounding only where the reference's two best
# logits are this close (fp32 logits of order 1; the programs differ in reduction order alone).
NEAR_TIE = 1e-4
GREEDY = Sampling()


def _prompts(count: int, seed: int = 0, lengths: tuple[int, ...] = (1, 2, 7, 16)) -> list[list[int]]:
    """Random byte prompts of a few lengths (one program each for the one-at-a-time reference)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 256, size=int(n)).tolist() for n in rng.choice(lengths, size=count)]


def _layout_generator(session, shape: Shape, sampling: Sampling = GREEDY):
    from jaxpar.train.trainer import Trainer

    trainer = Trainer(session)
    params = trainer.to_model_order(trainer.weights(trainer.init().params))
    generator = BatchedGenerator(trainer.graphdef, session.cfg.model, session.precision, shape, sampling,
                                 layout=trainer.layout)
    return trainer, params, generator


def _flip_margin(model, prompt: list[int], expected: list[int], got: list[int]) -> float | None:
    """None when the tokens agree; else the gap between the reference's two best logits where they first
    differ (its full forward pass over everything before)."""
    first = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), None)
    if first is None and len(expected) == len(got):
        return None
    first = min(len(expected), len(got)) if first is None else first
    logits_V = model(jnp.asarray([prompt + expected[:first]], jnp.int32))[0, -1]
    top2 = jax.lax.top_k(logits_V, 2)[0]
    return float(top2[0] - top2[1])


@pytest.mark.slow
def test_batched_greedy_equals_one_prompt_at_a_time(session_for):
    """32 prompts of 1 to 16 tokens, left-padded into one batch on data=8 and on data=4 x tensor=2, give
    token for token what each gives alone on one device (a flip only at a near-tie of the reference's
    logits). The layouts start from the same weights (the seed's)."""
    from jaxpar.sampling.single import generate_ids

    prompts, expected = _prompts(32), None
    for mesh in (("mesh.data=8", "mesh.tensor=1"), ("mesh.data=4", "mesh.tensor=2")):
        session = session_for(*TINY, *mesh)
        trainer, params, generator = _layout_generator(session, Shape(32, 16, 24))
        batched = generator(params, prompts)
        if expected is None:
            host = jax.device_get(params)
            model = nnx.merge(trainer.graphdef, host)
            expected = [generate_ids(trainer.graphdef, host, session.cfg.model, p, 24)[len(p):] for p in prompts]
        for prompt, alone, got in zip(prompts, expected, batched):
            margin = _flip_margin(model, prompt, alone, got)
            assert margin is None or margin < NEAR_TIE, (mesh, prompt, alone, got, margin)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_batched_greedy_equals_transformers_generate(name):
    """The fixtures' 6 prompts (3 to 20 tokens) in one left-padded batch give transformers' greedy tokens
    (greedy.json: 32 new tokens each, one prompt at a time, made by make_fixtures.py greedy)."""
    model, cfg = hf.load(FIXTURES / name)
    golden = json.loads((FIXTURES / name / "greedy.json").read_text())
    graphdef, params = nnx.split(model)
    shape = Shape(8, max(map(len, golden["prompts"])), golden["new_tokens"])
    got = BatchedGenerator(graphdef, cfg.model, precision.of(cfg), shape, Sampling())(params, golden["prompts"])
    for tokens, expected, gaps in zip(got, golden["completions"], golden["top2_gaps"]):
        first = next((i for i, (a, b) in enumerate(zip(expected, tokens)) if a != b), None)
        assert first is None or gaps[first] < NEAR_TIE, (expected, tokens)
        assert len(tokens) == len(expected)


@pytest.mark.slow
def test_sampled_tokens_are_the_same_on_every_layout_and_in_any_batch(session_for):
    """With a seed, temperature, top-k and top-p, a prompt draws the same tokens on one device, on
    data=8 and on data=4 x tensor=2, and wherever it sits in the batch (its row id keys the draws)."""
    sampling, prompts = Sampling(0.9, 40, 0.95, seed=7), _prompts(16, seed=1)
    drawn = []
    for mesh in (("mesh.data=1", "mesh.tensor=1", "run.devices=1"), ("mesh.data=8", "mesh.tensor=1"),
                 ("mesh.data=4", "mesh.tensor=2")):
        _, params, generator = _layout_generator(session_for(*TINY, *mesh), Shape(16, 16, 12), sampling)
        drawn.append(generator(params, prompts))
        reversed_rows = generator(params, prompts[::-1], rows=list(range(16))[::-1])
        assert reversed_rows[::-1] == drawn[-1]
    assert drawn[0] == drawn[1] == drawn[2]
    greedy = [t[0] for t in drawn[0]]
    assert len(set(greedy)) > 1  # the draws differ from row to row


def test_top_k_and_top_p_keep_only_their_tokens():
    """Every draw lies in the row's top k; top_p keeps the fewest likeliest tokens reaching p; top_k=1
    and a tiny top_p are greedy."""
    logits_BV = jax.random.normal(jax.random.PRNGKey(0), (64, 50)) * 3
    order_BV = jnp.argsort(-logits_BV, axis=-1)
    keys = row_keys(0, jnp.arange(64), 3)
    drawn = choose(logits_BV, Sampling(1.0, top_k=5), keys)
    assert bool(jnp.all(jnp.any(order_BV[:, :5] == drawn[:, None], axis=1)))
    greedy = choose(logits_BV, Sampling(), keys)
    assert bool(jnp.all(choose(logits_BV, Sampling(1.0, top_k=1), keys) == greedy))
    assert bool(jnp.all(choose(logits_BV, Sampling(1.0, top_p=1e-6), keys) == greedy))
    probs_BV = jax.nn.softmax(logits_BV)
    nucleus = choose(logits_BV, Sampling(1.0, top_p=0.5), keys)
    ranks = jnp.argmax(order_BV == nucleus[:, None], axis=1)
    mass_before = jnp.take_along_axis(jnp.cumsum(jnp.take_along_axis(probs_BV, order_BV, 1), 1) -
                                      jnp.take_along_axis(probs_BV, order_BV, 1), ranks[:, None], 1)
    assert bool(jnp.all(mass_before < 0.5))


def test_each_row_stops_at_its_end_token():
    """A row ends at the first end token it draws (kept as its last token); the others go on."""
    model, cfg = hf.load(FIXTURES / "qwen2")
    golden = json.loads((FIXTURES / "qwen2" / "greedy.json").read_text())
    graphdef, params = nnx.split(model)
    stop = golden["completions"][0][3]  # the first prompt's 4th greedy token
    shape = Shape(8, 20, 32)
    got = BatchedGenerator(graphdef, cfg.model, precision.of(cfg), shape, Sampling(), frozenset({stop}))(
        params, golden["prompts"])
    for tokens, expected in zip(got, golden["completions"]):
        cut = expected.index(stop) + 1 if stop in expected else len(expected)
        assert tokens == expected[:cut]
    assert len(got[0]) == golden["completions"][0].index(stop) + 1 < shape.new_tokens


def _write_prompts(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "id": i}) + "\n" for i, p in enumerate(prompts)))
    return path


def test_generate_command_writes_completions(tmp_path, capsys):
    """`jaxpar generate HF_DIR --prompts --out --batch` on data=2 writes every prompt's record with its
    completion, in the file's order, each as the one-device batch gives it."""
    from jaxpar.cli import main

    prompts = _write_prompts(tmp_path / "p.jsonl", ["the quick", "hello", "a longer prompt than the others", "x"])
    out = tmp_path / "c.jsonl"
    args = ["generate", str(FIXTURES / "qwen2"), "--prompts", str(prompts), "--tokens", "6", "--no-progress"]
    assert main([*args, "--out", str(out), "--batch", "2", "mesh.data=2", "run.devices=2"]) == 0
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in records] == [0, 1, 2, 3] and all(r["new_tokens"] == 6 for r in records)
    assert "4 completions" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "one.jsonl"), "--batch", "4", "mesh.data=1", "run.devices=1"]) == 0
    assert [json.loads(line)["completion"] for line in (tmp_path / "one.jsonl").read_text().splitlines()] == \
        [r["completion"] for r in records]


@pytest.mark.parametrize("extra, message", [
    (["--top-p", "0"], "--top-p must be in"),
    (["--top-p", "1.5"], "--top-p must be in"),
    (["--top-k", "-1"], "--top-k must be"),
    (["--batch", "3", "mesh.data=2", "run.devices=2"], "must split evenly"),
    (["model.d_model=8"], "is the checkpoint's own"),
    (["mesh.data=1", "mesh.stage=2", "run.devices=2"], "without stages"),
])
def test_generate_command_refuses_bad_flags(tmp_path, capsys, extra, message):
    from jaxpar.cli import main

    prompts = _write_prompts(tmp_path / "p.jsonl", ["the quick"])
    args = ["generate", str(FIXTURES / "qwen2"), "--prompts", str(prompts), "--out", str(tmp_path / "c.jsonl"),
            "--no-progress", *extra]
    assert main(args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "c.jsonl").exists()


@pytest.mark.parametrize("lines, message", [
    (["not json"], "is not JSON"), (['{"text": "x"}'], "needs a non-empty text field"), ([], "holds no prompts")])
def test_a_bad_prompts_file_gets_one_sentence(tmp_path, capsys, lines, message):
    from jaxpar.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(line + "\n" for line in lines))
    assert main(["generate", str(FIXTURES / "qwen2"), "--prompts", str(prompts), "--out", str(tmp_path / "c"),
                 "--no-progress"]) == 2
    assert message in capsys.readouterr().err


def test_generation_holds_no_copy_of_the_weights():
    """The compiled program's temporaries on a model whose weights outweigh everything else stay well
    under the weights' bytes (a layer's slice, one at a time: no second copy of every weight)."""
    cfg = load_config(None, ["model.mlp=swiglu", "model.d_model=256", "model.d_ff=1024", "model.n_layers=4"])
    graphdef, params = nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(0)))
    generator = BatchedGenerator(graphdef, cfg.model, precision.of(cfg), Shape(4, 8, 8), Sampling())
    rows = jnp.zeros((4,), jnp.int32)
    compiled = generator._program.lower(params, jnp.zeros((4, 8), jnp.int32), rows, rows).compile()
    weights = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(params))
    assert compiled.memory_analysis().temp_size_in_bytes < weights / 2


def test_what_generate_and_eval_run_on_builds_no_train_step(tmp_path):
    """`jaxpar generate --prompts` and `jaxpar eval` load their model with load_model: a laid-out model
    (jaxpar.laid_out) whose construction, weights and generation import no module of jaxpar.train, so no
    train step is built or traced (the Trainer they once built traced 2BW's step)."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hello"}) + "\n")
    script = (
        "import sys\n"
        "from jaxpar.sampling.from_files import Request, generate_file\n"
        "from jaxpar.sampling.model_source import load_model\n"
        f"loaded = load_model({str(FIXTURES / 'llama')!r}, None, ['mesh.data=4', 'mesh.tensor=2'], 4, 'evaluation',"
        " progress=False)\n"
        f"generate_file({str(FIXTURES / 'llama')!r}, Request({str(prompts)!r}, {str(tmp_path / 'out.jsonl')!r},"
        " batch=8, tokens=2), ['mesh.data=8'], progress=False)\n"
        "print(type(loaded.model).__name__, sorted(m for m in sys.modules if m.startswith('jaxpar.train')))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["LaidOutModel", "[]"], done.stdout
    assert json.loads((tmp_path / "out.jsonl").read_text())["new_tokens"] == 2
