"""Multi-head latent attention (model.mla; jaxpar.model.mla): the forward equals an independent NumPy
implementation, decoding in the absorbed form from a cache of latents equals the full forward, the cache
holds kv_rank + rope_dim numbers a token and layer (as `jaxpar plan` reports), layouts train to the
single-device reference's numbers, and ranks that do not fit are refused in one sentence."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.cli import main
from jaxpar.config import ModelConfig
from jaxpar.config.mla import MLAConfig
from jaxpar.config.precision import POLICIES
from jaxpar.model.mla import LatentAttention, LatentCache
from jaxpar.model.segments import Segments
from jaxpar.model.transformer import Transformer
from jaxpar.plan.decode_cache import decode_cache
from jaxpar.sampling.batched import BatchedGenerator, Shape
from jaxpar.sampling.choice import Sampling
from jaxpar.sampling.single import generate_ids
from jaxpar.train.trainer import Trainer
from jaxpar.verify.run import verify

R, Q, E, N, V = 16, 12, 4, 8, 6  # kv_rank, q_rank, rope_dim, nope_dim, v_dim: v narrower than q/k
MLA = (f"model.mla.kv_rank={R}", f"model.mla.q_rank={Q}", f"model.mla.rope_dim={E}", f"model.mla.nope_dim={N}",
       f"model.mla.v_dim={V}")
TINY = ("model.d_model=32", "model.n_layers=4", "model.n_heads=4", "model.d_ff=64", "model.seq_len=32",
        "train.batch_size=8", *MLA)


def _cfg(q_rank: int = Q, **model) -> ModelConfig:
    return ModelConfig(d_model=32, n_heads=4, n_layers=2, d_ff=64, seq_len=16, vocab_size=64,
                       mla=MLAConfig(kv_rank=R, q_rank=q_rank, rope_dim=E, nope_dim=N, v_dim=V), **model)


# ---------------------------------------------------------------- an independent NumPy implementation

def _rms(x, scale, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _rotate(x, positions_BL, theta):
    """Half-split rotary over the last axis of x (B, L, H, E) at per-row positions, in float64."""
    half = x.shape[-1] // 2
    angle = positions_BL[..., None] / theta ** (np.arange(half) * 2 / x.shape[-1])  # (B, L, E/2)
    cos, sin = np.cos(angle)[:, :, None], np.sin(angle)[:, :, None]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def numpy_mla(w: dict, cfg: ModelConfig, x, positions_BL, visible_BLP, rotate=None):
    """softmax(scale q.k) v per head with q, k, v built from the latents as DeepSeek-V2 defines them;
    rotate(x, positions): the rotary positions (default plain RoPE of base model.rope_theta)."""
    eps = cfg.norm_eps
    rotate = rotate or (lambda a, positions: _rotate(a, positions, cfg.rope_theta))
    if "w_q" in w:
        q = np.einsum("bld,dhk->blhk", x, w["w_q"])
    else:
        q = np.einsum("blq,qhk->blhk", _rms(x @ w["w_q_down"], w["q_norm"], eps), w["w_q_up"])
    down = x @ w["w_kv_down"]
    latent, k_rope = _rms(down[..., :R], w["kv_norm"], eps), rotate(down[..., None, R:], positions_BL)
    kv = np.einsum("blr,rhm->blhm", latent, w["w_kv_up"])
    k = np.concatenate([kv[..., :N], np.broadcast_to(k_rope, (*kv.shape[:3], E))], axis=-1)
    q = np.concatenate([q[..., :N], rotate(q[..., N:], positions_BL)], axis=-1)
    scores = np.einsum("blhk,bphk->bhlp", q, k) * (cfg.attn_scale or (N + E) ** -0.5)
    scores = np.where(visible_BLP[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("blhv,hvd->bld", np.einsum("bhlp,bphv->blhv", probs, kv[..., N:]), w["wo"])


def _weights(module: LatentAttention) -> dict:
    """The module's weights as float64 arrays, with its norms' scales set away from 1 first."""
    for i, norm in enumerate((module.q_norm, module.kv_norm)):
        if norm is not None:
            norm.scale.set_value(1 + 0.3 * jax.random.normal(jax.random.key(10 + i), norm.scale.shape))
    named = {"w_q": module.w_q, "w_q_down": module.w_q_down, "w_q_up": module.w_q_up, "w_kv_down": module.w_kv_down,
             "w_kv_up": module.w_kv_up, "wo": module.wo, "q_norm": module.q_norm and module.q_norm.scale,
             "kv_norm": module.kv_norm.scale}
    return {k: np.asarray(v[...], np.float64) for k, v in named.items() if v is not None}


@pytest.mark.parametrize(("q_rank", "attn_scale", "packed"), [(Q, 0.0, False), (0, 0.0, True), (Q, 0.3, True)],
                         ids=["query latent", "queries from the width, packed rows", "attn_scale, packed rows"])
def test_forward_equals_numpy(q_rank, attn_scale, packed):
    cfg = _cfg(q_rank, attn_scale=attn_scale)
    module = LatentAttention(cfg, rngs=nnx.Rngs(0))
    w = _weights(module)
    x = jax.random.normal(jax.random.key(1), (2, 9, cfg.d_model))
    causal = np.tril(np.ones((9, 9), bool))[None].repeat(2, 0)
    positions, segments, visible = np.arange(9)[None].repeat(2, 0), None, causal
    if packed:  # row 0: documents of 3, 4 and 2 tokens; row 1: one of 9
        ids = np.asarray([[0, 0, 0, 1, 1, 1, 1, 2, 2], [0] * 9])
        positions = np.asarray([[0, 1, 2, 0, 1, 2, 3, 0, 1], list(range(9))])
        segments = Segments(jnp.asarray(ids), jnp.asarray(positions))
        visible = causal & (ids[:, :, None] == ids[:, None])
    got = np.asarray(module(x, segments))
    want = numpy_mla(w, cfg, np.asarray(x, np.float64), positions.astype(np.float64), visible)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


@pytest.mark.slow
def test_yarn_scales_the_rotated_query_and_key():
    """With yarn the rotated dimensions are multiplied by the attention factor (0.1 ln 4 + 1 here) as
    transformers multiplies its cos and sin: the NumPy reference with that factor on its rotation."""
    cfg = _cfg(rope_scaling="yarn", rope_factor=4.0, rope_original_context=4)
    module = LatentAttention(cfg, rngs=nnx.Rngs(0))
    w, factor = _weights(module), 0.1 * np.log(4.0) + 1
    frequencies = np.asarray(module.frequencies, np.float64)
    assert module.rope_factor == pytest.approx(factor)

    def rotate(x, positions_BL):  # the library's yarn frequencies (tested against transformers'), scaled
        angle = positions_BL[..., None] * frequencies
        cos, sin = (np.cos(angle) * factor)[:, :, None], (np.sin(angle) * factor)[:, :, None]
        x1, x2 = np.split(x, 2, axis=-1)
        return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)

    x = jax.random.normal(jax.random.key(1), (2, 7, cfg.d_model))
    positions, visible = np.arange(7.0)[None].repeat(2, 0), np.tril(np.ones((7, 7), bool))[None].repeat(2, 0)
    want = numpy_mla(w, cfg, np.asarray(x, np.float64), positions, visible, rotate)
    np.testing.assert_allclose(np.asarray(module(x)), want, rtol=2e-5, atol=2e-6)


# ---------------------------------------------------------------- decoding from the latent cache

@pytest.mark.slow  # the quick tier counts the latent cache (test_the_plan_counts_the_decoding_cache)
@pytest.mark.parametrize("q_rank", [Q, 0])
def test_decoding_from_the_latent_cache_equals_the_full_forward(q_rank):
    """A 5-token prefill, then one token at a time, through the whole model: the logits of the full
    forward, in fp32 rounding; and the cache is the latents and shared keys alone."""
    cfg = _cfg(q_rank)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(2), (3, 12), 0, cfg.vocab_size)
    full = model(tokens)
    caches = model.empty_caches(cfg, 3, 12)
    assert isinstance(caches, LatentCache)
    assert caches.latent_BPR.shape == (cfg.n_layers, 3, 12, R) and caches.k_rope_BPE.shape == (cfg.n_layers, 3, 12, E)
    logits, caches = model.decode(tokens[:, :5], caches)
    steps = [logits]
    for t in range(5, 12):
        logits, caches = model.decode(tokens[:, t:t + 1], caches)
        steps.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(steps, 1)), np.asarray(full), rtol=1e-5, atol=1e-5)
    assert int(caches.length[0]) == 12


@pytest.mark.slow
def test_left_padded_rows_decode_as_if_alone():
    """Rows that start at a later slot (a left-padded prompt) give the logits they give alone."""
    cfg = _cfg()
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    tokens = jax.random.randint(jax.random.key(3), (2, 8), 1, cfg.vocab_size)
    starts = jnp.asarray([0, 3])
    logits, caches = model.decode(tokens, model.empty_caches(cfg, 2, 10, starts_B=starts))
    logits_next, _ = model.decode(tokens[:, -1:], caches)
    alone = model(jnp.concatenate([tokens[1:, 3:], tokens[1:, -1:]], axis=1))
    np.testing.assert_allclose(np.asarray(logits[1, 3:]), np.asarray(alone[0, :5]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(logits_next[1, 0]), np.asarray(alone[0, 5]), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_batched_generation_on_a_tensor_layout_equals_one_device(session_for):
    """8 left-padded prompts generated at once on data=4 x tensor=2 (heads split, latents replicated) give
    what each gives alone on one device, token for token (a flip only where the reference's two best
    logits are within rounding)."""
    session = session_for(*TINY, "model.vocab_size=256", "mesh.data=4", "mesh.tensor=2")
    trainer = Trainer(session)
    params = trainer.to_model_order(trainer.weights(trainer.init().params))
    generator = BatchedGenerator(trainer.graphdef, session.cfg.model, session.precision, Shape(8, 8, 10),
                                 Sampling(), layout=trainer.layout)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 256, size=int(n)).tolist() for n in (1, 3, 8, 5, 8, 2, 7, 4)]
    host = jax.device_get(params)
    model = nnx.merge(trainer.graphdef, host)
    for prompt, got in zip(prompts, generator(params, prompts)):
        alone = generate_ids(trainer.graphdef, host, session.cfg.model, prompt, 10)[len(prompt):]
        first = next((i for i, (a, b) in enumerate(zip(alone, got)) if a != b), None)
        if first is not None:
            top2 = jax.lax.top_k(model(jnp.asarray([prompt + alone[:first]]))[0, -1], 2)[0]
            assert float(top2[0] - top2[1]) < 1e-4, (prompt, alone, got)
        assert first is not None or alone == got


# ---------------------------------------------------------------- the cache's size in the plan

@pytest.mark.parametrize("mla", [True, False], ids=["latent", "ordinary (grouped-query)"])
def test_the_plan_counts_the_decoding_cache(mla, session_for):
    """Latent attention caches kv_rank + rope_dim numbers a token and layer; ordinary attention a key and
    a value per key/value head (2 x kv_heads x head_size)."""
    base = [s for s in TINY if mla or not s.startswith("model.mla")]
    session = session_for(*base, "mesh.data=4", "mesh.tensor=2", *([] if mla else ["model.n_kv_heads=2"]))
    entry = decode_cache(Trainer(session))["decode_cache"]
    m, numbers = session.cfg.model, (R + E if mla else 2 * 2 * 8)
    assert entry["bytes_per_token_per_layer"] == numbers * 4
    assert entry["total_bytes"] == m.n_layers * numbers * 4 * session.cfg.train.batch_size * m.seq_len


@pytest.mark.slow  # the quick tier counts the cache from the model (test_the_plan_counts_the_decoding_cache)
def test_jaxpar_plan_reports_the_latent_cache(tmp_path, capsys):
    assert main(["plan", f"run.dir={tmp_path / 'run'}", *TINY, "mesh.data=4", "mesh.tensor=2"]) == 0
    out = capsys.readouterr().out
    entry = json.loads(out.strip().splitlines()[-1])["decode_cache"]
    assert entry["bytes_per_token_per_layer"] == (R + E) * 4 and entry["total_bytes"] == 4 * (R + E) * 4 * 8 * 32
    assert f"{'decode cache per token, layer':<32}{(R + E) * 4:>18,d}" in out


# ---------------------------------------------------------------- layouts against one device

LAYOUTS = {
    "data=2 x tensor=2 x stage=2": ("mesh.data=2", "mesh.tensor=2", "mesh.stage=2"),
    "flash, data=2 x tensor=2 x context=2": ("mesh.data=2", "mesh.tensor=2", "mesh.context=2", "model.attention=flash",
                                             "model.flash_block_q=8", "model.flash_block_kv=8"),
    "no query latent, sequence + zero=3, data=4 x tensor=2": ("model.mla.q_rank=0", "parallel.sequence=true",
                                                              "parallel.zero=3", "mesh.data=4", "mesh.tensor=2"),
    "experts, data=2 x tensor=2 x expert=2": ("model.moe.experts=4", "mesh.data=2", "mesh.tensor=2", "mesh.expert=2"),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_single_device(layout, session_for):
    result = verify(session_for(*TINY, "train.steps=2", *LAYOUTS[layout]), log=lambda line: None)
    loss_tol, param_tol = POLICIES["fp32"].tolerances
    assert result["ok"], result
    assert result["loss_max_rel_err"] <= loss_tol and result["param_max_rel_err"] <= param_tol, result


# ---------------------------------------------------------------- what is refused

BAD = {
    "odd rope_dim": (["model.mla.rope_dim=3"], "model.mla.rope_dim must be positive and even"),
    "no rope_dim": (["model.mla.rope_dim=0"], "model.mla.rope_dim must be positive and even"),
    "no nope_dim": (["model.mla.nope_dim=0"], "model.mla.nope_dim must be positive, got 0."),
    "no v_dim": (["model.mla.v_dim=-1"], "model.mla.v_dim must be positive, got -1."),
    "negative q_rank": (["model.mla.q_rank=-2"], "model.mla.q_rank must be 0 (queries from the model width)"),
    "negative kv_rank": (["model.mla.kv_rank=-1"], "model.mla.kv_rank must be 0 (ordinary attention) or positive"),
    "kv_rank wider than the model": (["model.mla.kv_rank=64"], "model.mla.kv_rank=64 is wider than model.d_model=32"),
    "q_rank wider than the model": (["model.mla.q_rank=33"], "model.mla.q_rank=33 is wider than model.d_model=32"),
    "latent fields without kv_rank": (["model.mla.kv_rank=0"], "model.mla.q_rank is set but model.mla.kv_rank is 0"),
    "learned positions": (["model.positions=learned"], "model.mla needs model.positions=rope"),
    "grouped-query heads": (["model.n_kv_heads=2"], "leave model.n_kv_heads at 0, got 2."),
    "qk norm": (["model.qk_norm=true"], "model.mla does not combine with model.qk_norm"),
    "window": (["model.window=8"], "model.mla does not combine with model.window"),
    "cudnn": (["model.attention=cudnn", "train.precision=bf16"], "model.mla does not run on cuDNN's fused kernel"),
    "adapters": (["model.lora.rank=4"], "model.lora does not take adapters on latent attention's weights"),
    "heads over tensor": (["mesh.data=2", "mesh.tensor=4", "model.n_heads=2"],
                          "model.n_heads=2 is not divisible by mesh.tensor=4"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_mla_settings_exit_2_with_one_sentence(case, tmp_path, capsys):
    args, message = BAD[case]
    run_dir = tmp_path / "run"
    assert main(["train", f"run.dir={run_dir}", *TINY, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err, err
    assert len(err.splitlines()) == 1 and err.startswith("jaxpar: error: ") and err.endswith(".")
    assert not run_dir.exists()
