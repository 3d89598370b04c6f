"""Attention variants (model.window, attention_pattern, sinks, attn_softcap, attn_scale, out_bias) in every
kernel: dot, flash, cuDNN's argument mapping, decode with a key/value cache and context parallelism, against
an attention written here from scratch (the whole L x L matrix with explicit masks, the sink column and the
tanh cap); the windowed flash kernel's work and memory from the compiled program; and the config checks."""

import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from jaxpar.cli import main
from jaxpar.config import ModelConfig
from jaxpar.config.precision import POLICIES
from jaxpar.config.presets import load_config
from jaxpar.features.model import checks
from jaxpar.model.attention import Attention, KVCache, attend, cudnn_attention, dot_attention
from jaxpar.model.flash import flash_attention
from jaxpar.model.scores import ScoreOptions
from jaxpar.model.segments import Segments
from jaxpar.parallel import context
from jaxpar.plan.hlo import matmul_flops, parse
from jaxpar.verify.run import verify


def reference(q, k, v, window=0, softcap=0.0, scale=0.0, sinks=None, ids=None):
    """Causal attention of q (B, L, H, K) over k (B, L, G, K), v (B, L, G, V), in fp32, from scratch."""
    H, G, L = q.shape[2], k.shape[2], q.shape[1]
    k, v = (jnp.repeat(x.astype(jnp.float32), H // G, axis=2) for x in (k, v))
    s = jnp.einsum("blhk,bphk->bhlp", q.astype(jnp.float32), k) * (scale or 1 / math.sqrt(q.shape[-1]))
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    query, key = np.arange(L)[:, None], np.arange(L)[None, :]
    visible = (key <= query) & ((query - key < window) if window else True)
    visible = jnp.asarray(visible)[None] if ids is None else visible[None] & (ids[:, :, None] == ids[:, None, :])
    s = jnp.where(visible[:, None], s, -jnp.inf)
    if sinks is not None:  # a column of each head's sink logit, its probability dropped
        column = jnp.broadcast_to(sinks[None, :, None, None], (*s.shape[:3], 1))
        p = jax.nn.softmax(jnp.concatenate([s, column], axis=-1), axis=-1)[..., :-1]
    else:
        p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhlp,bphv->blhv", p, v)


def inputs(B=2, L=64, H=4, G=4, K=8, V=8, seed=0, spread=1.0):
    keys = jax.random.split(jax.random.key(seed), 5)
    q = spread * jax.random.normal(keys[0], (B, L, H, K))
    k = spread * jax.random.normal(keys[1], (B, L, G, K))
    v = jax.random.normal(keys[2], (B, L, G, V))
    sinks = jax.random.normal(keys[3], (H,))
    weight = jax.random.normal(keys[4], (B, L, H, V))
    return q, k, v, sinks, weight


def documents(B, L, per_row, seed=1):
    return jnp.stack([jnp.sort(jax.random.randint(jax.random.key(seed + r), (L,), 0, per_row)) for r in range(B)])


def rel_err(a, b):
    return float(jnp.linalg.norm((a - b).ravel()) / jnp.linalg.norm(b.ravel()))


def check_against_reference(run, q, k, v, sinks, weight, ref_kwargs, grad_tol=2e-6):
    """run(q, k, v, sinks) against the reference: the output, and the gradients of q, k, v and the sinks
    of a weighted sum of it."""
    def loss(fn):
        return lambda *args: jnp.sum(fn(*args) * weight)

    def ref(q, k, v, sinks):
        return reference(q, k, v, sinks=sinks, **ref_kwargs)

    use_sinks = sinks is not None
    argnums = (0, 1, 2, 3) if use_sinks else (0, 1, 2)
    out, grads = jax.jit(jax.value_and_grad(loss(run), argnums=argnums))(q, k, v, sinks)
    want, want_grads = jax.jit(jax.value_and_grad(loss(ref), argnums=argnums))(q, k, v, sinks)
    np.testing.assert_allclose(jax.jit(run)(q, k, v, sinks), jax.jit(ref)(q, k, v, sinks), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out, want, rtol=1e-5)
    for name, got, expected in zip("qkvs", grads, want_grads):
        assert got.dtype == jnp.float32
        assert rel_err(got, expected) < grad_tol, (name, rel_err(got, expected))


# (window, softcap, scale, sinks, documents per row, value width, flash blocks): the window a multiple of the
# blocks or not, shorter than a block or most of the sequence (where flash keeps the causal schedule)
VARIANTS = {
    "window 16, blocks 16": (16, 0.0, 0.0, False, 1, 8, (16, 16)),
    "window 20, blocks 8 x 16": (20, 0.0, 0.0, False, 1, 8, (8, 16)),
    "window 5, blocks 16 x 8": (5, 0.0, 0.0, False, 1, 8, (16, 8)),
    "window 40, blocks 32 (causal schedule)": (40, 0.0, 0.0, False, 1, 8, (32, 32)),
    "window 12 + three documents a row": (12, 0.0, 0.0, False, 3, 8, (8, 16)),
    "sinks": (0, 0.0, 0.0, True, 1, 8, (16, 16)),
    "sinks + window 9 + two documents": (9, 0.0, 0.0, True, 2, 8, (16, 8)),
    "softcap": (0, 2.0, 0.0, False, 1, 8, (16, 32)),
    "scale": (0, 0.0, 0.7, False, 1, 8, (32, 16)),
    "values 12 wide": (0, 0.0, 0.0, False, 1, 12, (16, 16)),
    "everything": (24, 3.0, 0.5, True, 2, 12, (8, 16)),
}


# the quick tier runs these; the others are marked slow (the whole suite runs them all)
QUICK_VARIANTS = ("everything",)
QUICK_CONTEXT = ()  # tests/test_context.py's quick tests run context attention; these cases, the whole suite


def tiered(names, quick) -> list:
    """pytest params of `names`, those not in `quick` marked slow."""
    return [pytest.param(n, id=n, marks=() if n in quick else pytest.mark.slow) for n in names]


def _variant(name):
    window, softcap, scale, use_sinks, per_row, V, blocks = VARIANTS[name]
    q, k, v, sinks, weight = inputs(V=V, spread=2.0 if softcap else 1.0)
    ids = documents(q.shape[0], q.shape[1], per_row) if per_row > 1 else None
    ref_kwargs = dict(window=window, softcap=softcap, scale=scale, ids=ids)
    args = (q, k, v, sinks if use_sinks else None, weight)
    return ScoreOptions(window, softcap, scale), args, ids, ref_kwargs, blocks


@pytest.mark.parametrize("variant", tiered(VARIANTS, QUICK_VARIANTS))
def test_flash_matches_the_reference(variant):
    options, args, ids, ref_kwargs, (bq, bkv) = _variant(variant)

    def run(q, k, v, sinks):
        return flash_attention(q, k, v, block_q=bq, block_kv=bkv, segment_ids_BL=ids, options=options, sinks_H=sinks)

    check_against_reference(run, *args, ref_kwargs)


@pytest.mark.parametrize("variant", tiered(VARIANTS, ("everything",)))
def test_dot_matches_the_reference(variant):
    options, args, ids, ref_kwargs, blocks = _variant(variant)
    segments = None if ids is None else Segments(ids, jnp.zeros_like(ids))

    def run(q, k, v, sinks):
        return attend(q, k, v, segments, options, "dot", blocks, sinks)

    check_against_reference(run, *args, ref_kwargs)


@pytest.mark.parametrize("kernel", [pytest.param("dot", marks=pytest.mark.slow), "flash"])
def test_attend_reads_grouped_heads_with_values_of_their_own_width(kernel):
    """What latent attention calls: 2 key/value heads for 4 query heads, values 6 wide against keys 8 wide."""
    q, k, v, sinks, weight = inputs(G=2, V=6)
    options = ScoreOptions(window=11, softcap=4.0)

    def run(q, k, v, sinks):
        return attend(q, k, v, None, options, kernel, (16, 8), sinks)

    check_against_reference(run, q, k, v, sinks, weight, dict(window=11, softcap=4.0))


def test_the_window_skips_key_blocks_it_never_reaches():
    """NaN keys and values in every block wholly before a query block's window must not reach its rows (a
    masked block would pass them on as 0 * NaN), nor its gradients."""
    q, k, v, _, _ = inputs()
    window, block = 16, 16  # query block 3 (48-63) sees keys 33-63: blocks 2 and 3 alone
    poisoned = [x.at[:, :32].set(jnp.nan) for x in (k, v)]
    options = ScoreOptions(window=window)
    out = flash_attention(q, *poisoned, block_q=block, block_kv=block, options=options)
    assert bool(jnp.isfinite(out[:, 48:]).all())
    np.testing.assert_allclose(out[:, 48:], reference(q, k, v, window=window)[:, 48:], rtol=1e-5, atol=1e-6)
    dq = jax.grad(lambda q: jnp.sum(flash_attention(q, *poisoned, block_q=block, block_kv=block,
                                                    options=options)[:, 48:]))(q)
    assert bool(jnp.isfinite(dq[:, 48:]).all())


def test_cudnn_gets_the_window_and_scale_it_is_given():
    """cuDNN's local_window_size and scale, checked through jax's XLA implementation of the same call."""
    q, k, v, _, _ = inputs(G=2)
    ids = documents(2, 64, 3)
    out = cudnn_attention(q, k, v, Segments(ids, jnp.zeros_like(ids)), ScoreOptions(window=10, scale=0.3),
                          implementation="xla")
    np.testing.assert_allclose(out, reference(q, k, v, window=10, scale=0.3, ids=ids), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- the layer: decode, sinks, output bias

def _layer(**model):
    cfg = ModelConfig(d_model=32, n_heads=4, n_kv_heads=2, seq_len=24, **model)
    attn = Attention(cfg, rngs=nnx.Rngs(0), local=True)
    if attn.sinks is not None:
        attn.sinks[...] = jax.random.normal(jax.random.key(7), attn.sinks.shape)
    return cfg, attn


@pytest.mark.slow  # the quick tier decodes through test_mla's latent cache
def test_decode_with_a_cache_matches_the_whole_sequence_through_the_window():
    cfg, attn = _layer(window=5, sinks=True, attn_softcap=3.0)
    x = jax.random.normal(jax.random.key(1), (2, cfg.seq_len, cfg.d_model))
    whole = attn(x)
    cache, outs = KVCache.empty(2, cfg.seq_len, cfg, jnp.float32), []
    for start, stop in ((0, 7), *((p, p + 1) for p in range(7, cfg.seq_len))):  # a prompt, then one at a time
        out, cache = attn.decode(x[:, start:stop], cache)
        outs.append(out)
    np.testing.assert_allclose(jnp.concatenate(outs, axis=1), whole, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_decode_of_left_padded_rows_matches_each_row_alone():
    cfg, attn = _layer(window=4, sinks=True)
    pads = (0, 3)
    x = jax.random.normal(jax.random.key(2), (2, cfg.seq_len, cfg.d_model))
    padded = jnp.stack([jnp.concatenate([jnp.zeros((p, cfg.d_model)), x[b, :cfg.seq_len - p]]) for b, p in
                        enumerate(pads)])
    cache = KVCache.empty(2, cfg.seq_len, cfg, jnp.float32, jnp.asarray(pads))
    out, cache = attn.decode(padded[:, :10], cache)
    rest, _ = attn.decode(padded[:, 10:], cache)
    out = jnp.concatenate([out, rest], axis=1)
    for b, p in enumerate(pads):
        alone = attn(x[b:b + 1, :cfg.seq_len - p])[0]
        np.testing.assert_allclose(out[b, p:], alone, rtol=1e-5, atol=1e-6)


def test_sinks_split_like_the_heads_and_the_output_bias_is_added_once():
    _, attn = _layer(sinks=True, out_bias=True)
    assert attn.sinks.shape == (4,) and attn.sinks.get_metadata()["out_sharding"] == ("heads",)
    assert attn.b_o.shape == (32,) and attn.b_o.get_metadata()["out_sharding"] == ("embed",)
    x = jax.random.normal(jax.random.key(3), (2, 24, 32))
    before = attn(x)
    attn.b_o[...] = jnp.arange(32.0)
    np.testing.assert_allclose(attn(x) - before, jnp.broadcast_to(jnp.arange(32.0), before.shape), atol=1e-5)


# ---------------------------------------------------------------- context parallelism

CONTEXT_CASES = {  # (attention, balanced, key/value heads, documents per row, window, softcap, scale, sinks, V)
    "ring, balanced, window 12, sinks, GQA": ("ring", True, 2, 1, 12, 0.0, 0.0, True, 8),
    "all-gather, unbalanced, window 20, softcap, scale, values 12 wide": ("allgather", False, 4, 1, 20, 2.0, 0.5,
                                                                         False, 12),
    "ring, unbalanced, window 5, sinks, two documents": ("ring", False, 4, 2, 5, 0.0, 0.0, True, 8),
    "all-gather, balanced, MQA, window 40, softcap, sinks, three documents": ("allgather", True, 1, 3, 40, 3.0, 0.0,
                                                                              True, 8),
}


@pytest.mark.parametrize("case", tiered(CONTEXT_CASES, QUICK_CONTEXT))
def test_context_attention_matches_the_reference(case):
    mode, balance, G, per_row, window, softcap, scale, use_sinks, V = CONTEXT_CASES[case]
    C, B, L = 4, 2, 64
    mesh = jax.make_mesh((C,), ("context",), axis_types=(AxisType.Auto,), devices=jax.devices()[:C])
    layout = types.SimpleNamespace(mesh=mesh, context_attention=mode, balanced_context=balance)
    q, k, v, sinks, weight = inputs(B, L, 4, G, 8, V, spread=2.0 if softcap else 1.0)
    ids = documents(B, L, per_row)
    order, split = context.device_order(L, C, balance), NamedSharding(mesh, PartitionSpec(None, "context"))
    inverse = np.argsort(order)
    options = ScoreOptions(window, softcap, scale)

    def run(q, k, v, sinks):
        permuted = [jax.device_put(x[:, order], split) for x in (q, k, v)]
        ids_split = jax.device_put(ids[:, order], split) if per_row > 1 else None
        return context.attention(layout, *permuted, ids_split, (8, 4), options, sinks)[:, inverse]

    ref_kwargs = dict(window=window, softcap=softcap, scale=scale, ids=ids if per_row > 1 else None)
    check_against_reference(run, q, k, v, sinks if use_sinks else None, weight, ref_kwargs)


@pytest.mark.parametrize("balance", [False, True])
def test_the_context_schedule_skips_block_pairs_out_of_the_window(balance):
    """Unbalanced, the ranks' blocks are the sequence's blocks in order: the schedule computes exactly the
    block pairs with a key inside some query's window. Balanced, as many in all, spread more evenly."""
    L, C, b, window = 1024, 4, 32, 100
    count = lambda w: sum(context.blocks_per_rank(L, C, balance, (b, b), w))  # noqa: E731
    n = L // b
    seen = sum(1 for i in range(n) for j in range(i + 1) if i * b - (j * b + b - 1) < window)
    assert count(window) == seen < count(0) // 3
    assert count(L) == count(0) == n * (n + 1) // 2


# ---------------------------------------------------------------- flash's work and memory, compiled

def _compiled(fn, *args):
    return jax.jit(fn).lower(*args).compile()


def _attention_training(attention, L, H=2, K=16):
    """The compiled forward + backward of a weighted sum of attention's output, B=1."""
    shape = jax.ShapeDtypeStruct((1, L, H, K), jnp.float32)
    loss = lambda q, k, v: jnp.sum(attention(q, k, v) * v)  # noqa: E731
    return _compiled(jax.grad(loss, argnums=(0, 1, 2)), shape, shape, shape)


def _forward_only(attention, L, H=2, K=16):
    shape = jax.ShapeDtypeStruct((1, L, H, K), jnp.float32)
    return _compiled(attention, shape, shape, shape)


def _flash(block, window=0):
    return lambda q, k, v: flash_attention(q, k, v, block_q=block, block_kv=block, options=ScoreOptions(window))


def _flops(compiled):
    return matmul_flops(parse(compiled.as_text()))


def test_windowed_flash_work_is_a_fraction_of_full_attention():
    """Seq 32768, window 4096 (the issue's acceptance): flash's executed matmul FLOPs, the loops' trip counts
    multiplied out, against dense dot attention's L x L. Forward alone with the default 512 blocks, and
    forward + backward with 64 blocks: backward recomputes the scores (5 matmuls a block pair against dot's
    4), so there the partly visible blocks at a window's edges must be small. The causal flash schedule's
    loops have no trip count known when compiling, so against it the block pairs visited are compared."""
    L, W = 32768, 4096
    dot_forward = _flops(_forward_only(dot_attention, L))
    dot_training = _flops(_attention_training(dot_attention, L))
    forward_512 = _flops(_forward_only(_flash(512, W), L)) / dot_forward
    training_512 = _flops(_attention_training(_flash(512, W), L)) / dot_training
    training_64 = _flops(_attention_training(_flash(64, W), L)) / dot_training
    n = L // 512
    against_causal = n * (W // 512 + 1) / (n * (n + 1) // 2)  # block pairs: windowed / causal flash schedule
    print(f"windowed flash / dot attention FLOPs: forward {forward_512:.4f} (blocks 512), forward + backward "
          f"{training_512:.4f} (blocks 512), {training_64:.4f} (blocks 64); block pairs against causal flash "
          f"(blocks 512) {against_causal:.4f}")
    assert forward_512 == (W + 512) / L and forward_512 <= 0.15 and training_64 <= 0.15, (forward_512, training_64)


@pytest.mark.slow
def test_windowed_flash_temporaries_do_not_grow_with_the_sequence_beyond_its_buffers():
    """Window 4096, blocks 512, forward + backward at 8k, 16k and 32k positions: beyond the O(L) buffers of
    backward (the fp32 dQ accumulator, the log-sum-exp and D = rowsum(dO * O): 4K + 8 bytes a position and
    head) the temporaries stay the same, and forward's do not grow at all. Dot attention's quadruple with
    each doubling."""
    B, H, K, W, block = 1, 2, 16, 4096, 512
    lengths = (8192, 16384, 32768)
    training = [_attention_training(_flash(block, W), L, H, K).memory_analysis().temp_size_in_bytes for L in lengths]
    forward = [_forward_only(_flash(block, W), L, H, K).memory_analysis().temp_size_in_bytes for L in lengths]
    beyond = [t - B * L * H * (4 * K + 8) for t, L in zip(training, lengths)]
    dot = [_attention_training(dot_attention, L, H, K).memory_analysis().temp_size_in_bytes for L in (4096, 8192)]
    print(f"temp bytes at {lengths}: windowed flash forward + backward {training}, beyond the O(L) buffers "
          f"{beyond}, forward {forward}; dot at 4096, 8192: {dot}")
    assert max(beyond) <= 1.01 * min(beyond) and len(set(forward)) == 1, (training, forward)
    assert training[2] / training[1] <= 2 and dot[1] / dot[0] >= 3.9, (training, dot)


# ---------------------------------------------------------------- config checks

BAD = {
    "negative window": (["model.window=-1"], "model.window must be 0 (every earlier position) or positive, got -1."),
    "window beyond the sequence": (["model.window=200"], "model.window=200 is longer than model.seq_len=128"),
    "pattern letters": (["model.window=8", "model.attention_pattern=lgx"], "may hold only the letters l"),
    "pattern length": (["model.window=8", "model.attention_pattern=lgg"], "its length 3 must divide model.n_layers=4"),
    "pattern without a window": (["model.attention_pattern=lg"], "but model.window=0; set model.window as well."),
    "negative softcap": (["model.attn_softcap=-1"], "model.attn_softcap and model.attn_scale must be 0"),
    "sinks with cudnn": (["model.attention=cudnn", "train.precision=bf16", "model.sinks=true"],
                         "model.attention=cudnn has no soft cap or sinks"),
    "softcap with cudnn": (["model.attention=cudnn", "train.precision=bf16", "model.attn_softcap=50"],
                           "model.attention=cudnn has no soft cap or sinks"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_variants_are_refused_in_one_sentence(case):
    overrides, words = BAD[case]
    errors = list(checks(load_config(None, overrides), {}))
    assert len(errors) == 1 and words in errors[0] and errors[0].endswith("."), errors
    assert not list(checks(load_config(None, ["model.window=128", "model.attention_pattern=lllg",
                                              "model.sinks=true", "model.attn_softcap=50"]), {}))



def test_the_cli_refuses_a_bad_window_before_compiling(tmp_path, capsys):
    assert main(["plan", f"run.dir={tmp_path / 'run'}", "model.window=-4"]) == 2
    assert capsys.readouterr().err.strip() == ("jaxpar: error: model.window must be 0 (every earlier position) or "
                                               "positive, got -4.")

# ---------------------------------------------------------------- whole layouts against one device

TINY = ("model.d_model=64", "model.n_layers=2", "model.d_ff=128", "model.seq_len=64", "train.batch_size=4",
        "train.steps=3", "model.window=12", "model.attention_pattern=lg", "model.sinks=true")
VERIFIED = {  # the reference is one device with dot attention
    "flash 8/16, soft cap, output bias, data=4 x tensor=2": (
        "model.attention=flash", "model.flash_block_q=8", "model.flash_block_kv=16", "model.attn_softcap=5",
        "model.out_bias=true", "mesh.data=4", "mesh.tensor=2"),
    "ring, balanced, data=2 x context=4": ("mesh.data=2", "mesh.context=4"),
    "all-gather, unbalanced, GQA kv=2, soft cap, context=4": (
        "mesh.data=1", "mesh.context=4", "run.devices=4", "parallel.context_attention=allgather",
        "parallel.context_balance=false", "model.n_kv_heads=2", "model.attn_softcap=5"),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(VERIFIED))
def test_windowed_attention_with_sinks_matches_one_device(layout, session_for):
    result = verify(session_for(*TINY, *VERIFIED[layout]), log=lambda line: None)
    loss_tol, param_tol = POLICIES["fp32"].tolerances
    assert result["ok"], result
    assert result["loss_max_rel_err"] <= loss_tol and result["param_max_rel_err"] <= param_tol, result
