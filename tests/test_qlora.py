"""QLoRA (model.lora.base_dtype int8 or nf4): the projections' frozen weights stored quantized and packed, one
variable each, read back as quantize.py dequantizes them; every layout trains to the single-device reference's
numbers, the packed weights never change, a checkpoint's weights are quantized as read, and XLA counts
0.53 bytes a weight."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import frozen_leaves, steps_on_random_tokens

from jaxpar.cli import main
from jaxpar.config.presets import load_config
from jaxpar.model import quantize as q
from jaxpar.model.adapters import QUANTIZED, Frozen, decode, encode, read_as
from jaxpar.model.transformer import Transformer
from jaxpar.train.trainer import Trainer
from jaxpar.verify.run import verify

# d_model 256: four blocks of 64 along 'embed', so ZeRO-3 over data=4 splits that axis one block a device
MODEL = ("model.d_model=256", "model.d_ff=256", "model.seq_len=32", "model.n_layers=2", "model.mlp=swiglu",
         "model.lora.rank=4", "train.batch_size=8")
ZERO3 = ("mesh.data=4", "mesh.tensor=2", "parallel.zero=3")


def hand_made(w: np.ndarray, name: str, kind: str, axis: int | None) -> np.ndarray:
    """What a weight of a quantized base reads back as, computed with quantize.py alone: the projections
    quantized and dequantized, every other weight rounded to bf16."""
    if name in QUANTIZED:
        codes, scales = q.quantize(jnp.asarray(w), kind, axis)
        return np.asarray(q.dequantize(codes, scales, kind, axis, jnp.float32))
    return np.asarray(jnp.asarray(w).astype(jnp.bfloat16).astype(jnp.float32))


@pytest.mark.parametrize("kind", ["nf4", pytest.param("int8", marks=pytest.mark.slow)])
def test_quantized_base_matches_single_device(kind, session_for):
    """LoRA on every target (the gated MLP's too) over a quantized base on data=4 x tensor=2 with ZeRO-3, and
    the adapters' dropout: each row's masks are the same whichever device holds it."""
    session = session_for(*MODEL, *ZERO3, f"model.lora.base_dtype={kind}", "model.lora.dropout=0.1", "train.steps=3")
    trainer = Trainer(session)
    blocked = [path for path, plan in trainer.layout.weights.items() if path[-1] in QUANTIZED
               and plan.zero_dim is not None and plan.names[plan.zero_dim[0]] == "embed"]
    assert blocked, "ZeRO-3 splits no quantized weight along its blocks: the case this test is for"
    result = verify(session, log=lambda line: None)
    assert result["ok"], result
    assert result["loss_max_rel_err"] <= 1e-5 and result["param_max_rel_err"] <= 1e-4


@pytest.mark.slow
def test_first_step_equals_the_hand_dequantized_model(session_for):
    """An nf4 base reads back exactly as quantize.py's dequantize (its norms and embedding as bf16): its
    packed weights decode to those of an fp32 base quantized and dequantized by hand, and the first step's
    loss is the same to the last bit."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 256, (8, 33), dtype=np.int32)
    nf4 = Trainer(session_for(*MODEL, "model.lora.base_dtype=nf4"))
    fp32 = Trainer(session_for(*MODEL, "model.lora.base_dtype=fp32"))
    nf4_state, fp32_state = nf4.init(), fp32.init()
    stored = frozen_leaves(nf4_state.params)
    assert {path for path, (_, meta) in stored.items() if "quantized" in meta} == {
        path for path in stored if path[-1] in QUANTIZED}

    def by_hand(path, v):
        if not isinstance(v, Frozen):
            return v
        bits, meta = stored[path]
        axis = meta["quantized"][1] if "quantized" in meta else None
        weight = hand_made(np.asarray(v[...]), path[-1], "nf4", axis)
        np.testing.assert_array_equal(np.asarray(decode(jnp.asarray(bits), "float32", meta.get("quantized"))),
                                      weight)
        return v.replace(jax.device_put(encode(weight, "float32"), v.get_value().sharding))

    flat = nnx.to_flat_state(fp32_state.params)
    params = nnx.from_flat_state([(path, by_hand(path, v)) for path, v in flat])
    losses = [float(trainer.step(state, trainer.put_batch(tokens))[1]["loss"])
              for trainer, state in ((nf4, nf4_state), (fp32, dataclasses.replace(fp32_state, params=params)))]
    assert losses[0] == losses[1]


@pytest.mark.slow
def test_a_checkpoint_is_quantized_as_read_and_stays_bit_for_bit(session_for, tmp_path):
    """A Llama-family checkpoint (grouped-query attention: w_q and w_kv apart) on data=4 x tensor=2 with ZeRO-3:
    read onto the layout in floats, then packed in place (each device its own blocks); 3 steps later every
    frozen weight is what quantize.py makes of the checkpoint's."""
    from jaxpar.interop import hf
    from jaxpar.interop.hf_weights import load_params

    shape = ("model.d_model=256", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=256", "model.mlp=swiglu",
             "model.n_layers=2", "model.tie_embeddings=false")
    cfg = load_config(None, list(shape))
    hf.save(Transformer(cfg.model, rngs=nnx.Rngs(5)), cfg, tmp_path / "llama")
    trainer = Trainer(session_for(f"model.from_hf={tmp_path / 'llama'}", "model.lora.rank=4", "model.seq_len=32",
                                  "model.lora.base_dtype=nf4", "train.batch_size=8", *ZERO3))
    state = trainer.init()
    before = frozen_leaves(state.params)
    state, metrics = steps_on_random_tokens(trainer, state, 3)
    assert float(metrics["grad_norm"]) > 0
    after = frozen_leaves(state.params)
    assert {"w_q", "w_kv", "wo", "w_gate_up", "w_down"} <= {path[-1] for path, (_, m) in after.items()
                                                           if "quantized" in m}
    frozen_shardings = nnx.split_state(trainer.param_shardings, Frozen, nnx.LoRAParam)[0]
    source, _ = load_params(trainer.session.hf_checkpoint, trainer.cfg.model, frozen_shardings, progress=False)
    for path, v in nnx.to_flat_state(source):
        bits, meta = after[path]
        assert bits.dtype == np.uint16 and np.array_equal(before[path][0], bits), path
        if "quantized" in meta:
            np.testing.assert_array_equal(bits, np.asarray(q.pack(jnp.asarray(v.get_value()), *meta["quantized"])))
        axis = meta["quantized"][1] if "quantized" in meta else None
        np.testing.assert_array_equal(np.asarray(decode(jnp.asarray(bits), "float32", meta.get("quantized"))),
                                      hand_made(np.asarray(v.get_value()), path[-1], "nf4", axis))


def stored_bytes_per_weight(*settings: str, embeddings: bool = True) -> float:
    """The bytes XLA's memory analysis counts for the frozen weights of a model as a program's arguments,
    per weight of the float model (the embedding and head left out unless `embeddings`)."""
    cfg = load_config(None, ["model.lora.rank=4", *settings])
    frozen = nnx.state(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))), Frozen)
    leaves = [v for path, v in nnx.to_flat_state(frozen)
              if embeddings or path[-1] not in ("embedding", "head")]
    weights = sum(int(np.prod(decode(v.get_value(), "float32", v.get_metadata().get("quantized")).shape))
                  for v in leaves)

    def read_all(values):
        return sum(jnp.sum(v[...]) for v in values)

    compiled = jax.jit(read_all).lower(leaves).compile()
    return compiled.memory_analysis().argument_size_in_bytes / weights


def test_xla_counts_about_half_a_byte_a_weight():
    projections_and_norms = stored_bytes_per_weight("model.d_model=256", "model.lora.base_dtype=nf4",
                                                    embeddings=False)
    assert q.bytes_per_parameter("nf4") < projections_and_norms <= 0.55
    int8 = stored_bytes_per_weight("model.d_model=256", "model.lora.base_dtype=int8", embeddings=False)
    assert q.bytes_per_parameter("int8") < int8 <= 1.05
    tied, untied = (stored_bytes_per_weight("model.d_model=256", "model.lora.base_dtype=nf4",
                                            f"model.tie_embeddings={tie}") for tie in ("true", "false"))
    assert projections_and_norms < tied < untied < 2  # the embedding and head stay bf16


@pytest.mark.slow
def test_frozen_weights_can_read_in_the_compute_dtype():
    """read_as: the same stored integers, read back in bf16 (the float32 read rounded once), and stored again
    as they were (quantizing a dequantized weight gives its codes and scales back)."""
    cfg = load_config(None, ["model.lora.rank=4", "model.d_model=128", "model.lora.base_dtype=nf4"])
    model = nnx.jit(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))()  # one compile, not op by op
    graphdef, params = nnx.split(model)
    bf16 = nnx.merge(graphdef, read_as(params, "bfloat16"))
    for (path, v), (_, w) in zip(nnx.to_flat_state(nnx.state(model, Frozen)),
                                 nnx.to_flat_state(nnx.state(bf16, Frozen))):
        assert w[...].dtype == jnp.bfloat16, path
        np.testing.assert_array_equal(np.asarray(w.get_value()), np.asarray(v.get_value()))
        np.testing.assert_array_equal(np.asarray(w[...]), np.asarray(v[...].astype(jnp.bfloat16)))
        np.testing.assert_array_equal(np.asarray(w.encoded(v[...]).get_value()), np.asarray(v.get_value()))


def test_d_model_must_split_into_blocks(capsys):
    assert main(["train", "configs/tiny_test.yaml", "model.lora.rank=4", "model.lora.base_dtype=nf4",
                 "model.d_model=96", "model.n_heads=4"]) == 2
    err = capsys.readouterr().err
    assert "multiple of 64" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
