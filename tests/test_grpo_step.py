"""train.objective=grpo end to end: the step's loss and gradient are the paper's formulas on fixed
completions; with the completions replayed, layouts verify against one device; the reward rises on a
task the model cannot do at first; and bad input is one sentence before anything compiles."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import SMALL_MODEL

from jaxpar.cli import main
from jaxpar.config.presets import load_config
from jaxpar.data.packed_rows import PackedRows
from jaxpar.laid_out.forward import RowInputs
from jaxpar.model.moe_step import ExpertTerms
from jaxpar.model.transformer import Transformer
from jaxpar.rl.grpo import group_advantages
from jaxpar.rl.rollout import training_rows
from jaxpar.train.run_session import prepare
from jaxpar.train.step import objective
from jaxpar.verify.run import verify

CLIP, KL_BETA = 0.2, 0.1


def write_prompts(folder, count: int = 24) -> str:
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"item {i} costs ", "answer": str(i)}) + "\n"
                            for i in range(count)))
    return str(path)


def grpo_settings(prompts: str, *extra: str) -> list[str]:
    """GRPO on the small model: 8 prompts x 4 completions of 8 tokens, a length reward (graded, so every
    group has advantages)."""
    return [*SMALL_MODEL, "train.objective=grpo", f"data.source={prompts}", "rl.max_new_tokens=8",
            "rl.reward=length", "rl.target_length=5", "train.warmup=0", "train.sample_tokens=0", *extra]


# ---------------------------------------------------------------- the step against the paper's formulas


def _paper_loss(logits_BLV, tokens_BT, counted_BL, sampled_BL, reference_BL, advantages_B):
    """DeepSeekMath (Shao et al. 2024) eq. 3 with the k3 KL of eq. 4 in plain jax.numpy:
    -1/G sum_i 1/|o_i| sum_t [min(r A, clip(r, 1 - eps, 1 + eps) A) - beta (pi_ref/pi - log(pi_ref/pi) - 1)],
    r = pi / pi_old, over each completion's tokens o_i."""
    logp_BL = jnp.take_along_axis(jax.nn.log_softmax(logits_BLV, axis=-1), tokens_BT[:, 1:, None], axis=2)[..., 0]
    ratio_BL = jnp.exp(logp_BL - sampled_BL)
    A_B1 = advantages_B[:, None]
    surrogate_BL = jnp.minimum(ratio_BL * A_B1, jnp.clip(ratio_BL, 1 - CLIP, 1 + CLIP) * A_B1)
    log_ref_over_pi_BL = reference_BL - logp_BL
    kl_BL = jnp.exp(log_ref_over_pi_BL) - log_ref_over_pi_BL - 1
    per_token_BL = jnp.where(counted_BL, surrogate_BL - KL_BETA * kl_BL, 0.0)
    per_completion_B = jnp.sum(per_token_BL, axis=1) / jnp.maximum(jnp.sum(counted_BL, axis=1), 1)
    return -jnp.mean(per_completion_B)


def test_the_steps_loss_and_gradient_are_the_papers_formulas():
    """On fixed completions (8 prompts x 4), rewards and log-probabilities of the sampling and reference
    policies (moved so that ratios leave the clip range both ways), the step's objective and its gradient
    equal eq. 3 computed from the whole model's logits, to 1e-6."""
    cfg = load_config(None, [*SMALL_MODEL, "model.n_layers=2", "train.objective=grpo", f"rl.clip={CLIP}",
                             f"rl.kl_beta={KL_BETA}", "train.batch_size=32"])
    graphdef, params = nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    T = cfg.model.seq_len + 1
    prompts = [rng.integers(1, 256, int(rng.integers(2, 9))).tolist() for _ in range(8) for _ in range(4)]
    completions = [rng.integers(1, 256, int(rng.integers(1, 12))).tolist() for _ in range(32)]
    advantages = group_advantages(rng.random(32).astype(np.float32), 4)
    rows = training_rows(prompts, completions, advantages, T)
    logits = nnx.merge(graphdef, params)(jnp.asarray(rows.tokens_BT[:, :-1]))
    logp = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), rows.tokens_BT[:, 1:, None], 2)[..., 0]
    batch = PackedRows(*(jnp.asarray(a) for a in (rows.tokens_BT, rows.segments_BT, rows.positions_BT, rows.mask_BT)),
                       advantages_B=jnp.asarray(advantages),
                       sampled_BL=jnp.asarray(logp + rng.normal(0, 0.3, logp.shape), jnp.float32),
                       reference_BL=jnp.asarray(logp + rng.normal(0, 0.5, logp.shape), jnp.float32))
    counted = np.asarray(batch.target_mask_BL())
    experts = ExpertTerms.build(cfg.model.moe, 0, cfg.model.n_layers, 1, trace_routing=False)

    def jaxpar_loss(p):
        return objective(nnx.merge(graphdef, p), batch, RowInputs(segments=batch.segments()), cfg, experts)

    def paper_loss(p):
        logits_BLV = nnx.merge(graphdef, p)(batch.tokens_BT[:, :-1])
        return _paper_loss(logits_BLV, rows.tokens_BT, counted, batch.sampled_BL, batch.reference_BL, advantages)

    (loss, stats), grads = jax.jit(jax.value_and_grad(jaxpar_loss, has_aux=True))(params)
    expected, expected_grads = jax.jit(jax.value_and_grad(paper_loss))(params)
    assert 0.05 < float(stats["clip_fraction"]) < 0.95 and float(stats["kl"]) > 0
    assert abs(float(loss) - float(expected)) <= 1e-6 * max(1.0, abs(float(expected))), (loss, expected)
    flat, flat_expected = jax.tree.leaves(grads), jax.tree.leaves(expected_grads)
    for g, e in zip(flat, flat_expected):
        assert float(jnp.max(jnp.abs(g - e))) <= 1e-6 * max(1.0, float(jnp.max(jnp.abs(e))))


# ---------------------------------------------------------------- layouts, with the completions replayed


@pytest.mark.slow  # GRPO's quick representative is the step against the paper's formulas
@pytest.mark.parametrize("extra", [pytest.param((), id="data=4 x tensor=2, zero 3"),
                                   pytest.param(("model.lora.rank=4",), id="with adapters")])
def test_grpo_verifies_with_the_completions_replayed(tmp_path, extra):
    """The layout samples each step's completions; the single-device reference trains on the same ones
    (scoring them with its own weights); losses and weights agree at fp32 tolerance."""
    settings = grpo_settings(write_prompts(tmp_path), "mesh.data=4", "mesh.tensor=2", "parallel.zero=3",
                             "train.steps=3", f"run.dir={tmp_path / 'run'}", *extra)
    result = verify(prepare(load_config(None, settings)), log=lambda _: None)
    assert result["ok"], result


# ---------------------------------------------------------------- it learns


@pytest.mark.slow
def test_the_reward_rises_on_a_task_the_model_cannot_do_at_first(tmp_path, capsys):
    """From random weights on bytes a completion starts with a digit about 10 times in 256; GRPO takes the
    mean reward of `rl.reward=regex` ^[0-9] halfway or more to 1 within 40 steps."""
    run = tmp_path / "run"
    settings = grpo_settings(write_prompts(tmp_path), "rl.reward=regex", "rl.pattern=^[0-9]", "rl.group_size=8",
                             "train.steps=40", "train.log_every=1", "train.lr=1e-2", f"run.dir={run}")
    assert main(["train", "--no-progress", *settings]) == 0
    rewards = [json.loads(line)["reward_mean"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    first, last = np.mean(rewards[:3]), np.mean(rewards[-5:])
    assert last >= first + 0.5 * (1 - first), rewards
    summary = json.loads((run / "summary.json").read_text())
    assert summary["first_reward"] == rewards[0] and 0 < summary["generate_share"] < 1
    assert "mean reward" in capsys.readouterr().out


# ---------------------------------------------------------------- bad input


REWARDS = {
    "raises.py": "def reward(prompt, completion):\n    raise KeyError('score')\n",
    "text.py": "def reward(prompt, completion):\n    return 'good'\n",
}


@pytest.mark.parametrize("extra, message", [
    (("rl.reward=no_such_module:reward",), "cannot be imported"),
    (("rl.reward=raises:reward",), "(KeyError: 'score') on the prompt 'item"),
    (("rl.reward=text:reward",), "on the prompt 'item"),
    (("rl.group_size=1",), "rl.group_size must be at least 2"),
    (("rl.top_p=0",), "rl.top_p must be in (0, 1]"),
    (("rl.top_p=1.5",), "rl.top_p must be in (0, 1]"),
    (("rl.max_new_tokens=30",), "has 13 tokens, but a row holds"),
    (("mesh.stage=2", "mesh.data=4", "mesh.tensor=1"), "without stages"),
])
def test_bad_input_is_one_sentence(tmp_path, monkeypatch, capsys, extra, message):
    for name, text in REWARDS.items():
        (tmp_path / name).write_text(text)
    monkeypatch.chdir(tmp_path)
    prompts = write_prompts(tmp_path)
    run = tmp_path / "run"
    assert main(["train", "--no-progress", *grpo_settings(prompts, *extra), f"run.dir={run}"]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("jaxpar: error: ")]
    assert len(errors) == 1 and message in errors[0] and "Traceback" not in err, err
    assert not (run / "checkpoints").exists()


# ---------------------------------------------------------------- what a run samples


@pytest.mark.slow
def test_updates_per_batch_train_on_one_sample(tmp_path):
    """rl.updates_per_batch=2: a batch is sampled every other step and trained on twice; the second
    update sees the ratio move from 1 (the weights that sampled it have changed)."""
    run = tmp_path / "run"
    settings = grpo_settings(write_prompts(tmp_path), "rl.updates_per_batch=2", "train.steps=4", "train.log_every=1",
                             "train.lr=1e-2", f"run.dir={run}")
    assert main(["train", "--no-progress", *settings]) == 0
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["generate_s"] > 0 for r in rows] == [True, False, True, False]
    assert rows[1]["reward_mean"] == rows[0]["reward_mean"] and rows[3]["reward_mean"] == rows[2]["reward_mean"]
    assert rows[1]["loss"] != rows[0]["loss"]


@pytest.mark.slow
def test_grpo_on_an_imported_checkpoint_with_prompts_from_a_tokenized_folder(tmp_path):
    """Prompts tokenized with the checkpoint's tokenizer (each document a prompt), adapters on the imported
    weights (the reference: the adapters off), two steps."""
    from jaxpar.rl.prompts import PromptSet

    qwen2 = "tests/fixtures/hf/qwen2"
    folder = tmp_path / "tok"
    assert main(["tokenize", "--no-progress", "--input", write_prompts(tmp_path), "--field", "prompt",
                 "--tokenizer", qwen2, "--out", str(folder)]) == 0
    settings = [f"model.from_hf={qwen2}", "model.lora.rank=2", "train.objective=grpo", f"data.source={folder}",
                "model.seq_len=32", "rl.max_new_tokens=8", "rl.reward=length", "rl.target_length=5",
                "train.sample_tokens=0", "train.steps=2", f"run.dir={tmp_path / 'run'}"]
    prompts = prepare(load_config(None, settings)).train_data
    assert isinstance(prompts, PromptSet) and len(prompts.ids) == 24
    assert prompts.records[3]["prompt"] == "item 3 costs "
    assert main(["train", "--no-progress", *settings]) == 0
