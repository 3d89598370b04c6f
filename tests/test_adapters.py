"""LoRA adapters (model.lora): every layout trains them to the single-device reference's numbers, the
base weights stay bit for bit what they were and hold no optimizer state, and bad settings are one
sentence."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import SMALL_MODEL, frozen_leaves, resumed_run_matches, steps_on_random_tokens

from jaxpar.cli import main
from jaxpar.model.adapters import Frozen, decode
from jaxpar.plan.memory import measure_step, shard_bytes
from jaxpar.train.trainer import Trainer
from jaxpar.verify.run import verify

ADAPTERS = ("model.lora.rank=4", "model.mlp=swiglu", "train.steps=3", "model.n_layers=4")
MOE = ("model.moe.experts=4", "model.moe.mlp=swiglu", "model.lora.targets=q,k,v,o,gate,up,down,experts")
LLAMA = Path(__file__).parent / "fixtures" / "hf" / "llama"
# every target on each: the gated MLP's gate, up and down, attention's q, k, v and o (data=4 x tensor=2 with
# ZeRO-3 runs them over a quantized base in tests/test_qlora.py; 1F1B, GPipe and context=2 x tensor=2 under
# DPO in tests/test_preference_step.py)
LAYOUTS = {  # dropout's masks too: each row's are the same whichever device, microbatch or stage holds it
    "data=2 x stage=4, interleaved, 8 layers, dropout": [
        "mesh.data=2", "mesh.stage=4", "parallel.pipeline.schedule=interleaved", "parallel.pipeline.virtual=2",
        "model.n_layers=8", "model.lora.dropout=0.1"],
    "data=2 x stage=4, 2bw": ["mesh.data=2", "mesh.stage=4", "parallel.pipeline.schedule=2bw"],
    "data=2 x expert=4, adapters on the experts": ["mesh.data=2", "mesh.expert=4", *MOE],
}
@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_adapters_match_single_device(layout, session_for):
    result = verify(session_for(*SMALL_MODEL, *ADAPTERS, *LAYOUTS[layout]), log=lambda line: None)
    assert result["ok"], result
    assert result["loss_max_rel_err"] <= 1e-5 and result["param_max_rel_err"] <= 1e-4


def test_base_weights_stay_bit_for_bit_and_hold_no_optimizer_state(session_for):
    """20 steps on a Hugging Face checkpoint: its weights come out as they went in, and the optimizer
    state is AdamW's two moments of the adapters alone."""
    from jaxpar.interop.hf_weights import load_params
    trainer = Trainer(session_for(f"model.from_hf={LLAMA}", "model.lora.rank=4", "mesh.data=4", "mesh.tensor=2",
                                  "parallel.zero=3", "train.batch_size=8", "model.seq_len=32"))
    state = trainer.init()
    before = {path: bits for path, (bits, _) in frozen_leaves(state.params).items()}
    state, metrics = steps_on_random_tokens(trainer, state, 20)
    after = {path: bits for path, (bits, _) in frozen_leaves(state.params).items()}
    assert before.keys() == after.keys() and len(before) > 0
    for path in before:
        assert before[path].dtype.kind == "u" and np.array_equal(before[path], after[path]), path
    frozen_shardings = nnx.split_state(trainer.param_shardings, Frozen, nnx.LoRAParam)[0]
    source, _ = load_params(trainer.session.hf_checkpoint, trainer.cfg.model, frozen_shardings, progress=False)
    for path, v in nnx.to_flat_state(source):
        np.testing.assert_array_equal(np.asarray(decode(after[path], "float32")), np.asarray(v.get_value()))
    adapters = nnx.split_state(state.params, Frozen, nnx.LoRAParam)[1]
    adapter_shardings = nnx.split_state(trainer.state_shardings.params, Frozen, nnx.LoRAParam)[1]
    adapter_bytes = shard_bytes(adapters, adapter_shardings)
    plan = measure_step(trainer)  # what `jaxpar plan` reports, from the compiled step
    assert abs(plan["opt_state_bytes"] - 2 * adapter_bytes) <= 0.05 * 2 * adapter_bytes, (plan, adapter_bytes)
    assert plan["grads_bytes"] == shard_bytes(adapters, trainer.layout.named(trainer.layout.grad_specs(adapters)))
    assert float(metrics["grad_norm"]) > 0


@pytest.mark.slow
def test_first_step_computes_the_base_model(session_for):
    """B starts at zero: the first loss with adapters is the base model's, to the last bit."""
    rng = np.random.default_rng(1)
    settings = (f"model.from_hf={LLAMA}", "mesh.data=4", "mesh.tensor=2", "train.batch_size=8", "model.seq_len=32")
    tokens = rng.integers(0, 264, (8, 33), dtype=np.int32)
    losses = []
    for extra in ((), ("model.lora.rank=4",)):
        trainer = Trainer(session_for(*settings, *extra))
        _, metrics = trainer.step(trainer.init(), trainer.put_batch(tokens))
        losses.append(float(metrics["loss"]))
    assert losses[0] == losses[1]


@pytest.mark.slow
def test_a_run_with_adapters_resumes_exactly(capsys, tmp_path):
    """Frozen integer weights and an optimizer state with nothing for them go through a checkpoint."""
    settings = [*SMALL_MODEL, "model.lora.rank=4", "model.lora.base_dtype=nf4", "mesh.data=4", "mesh.tensor=2",
                "train.lr_schedule_steps=4"]
    assert resumed_run_matches(capsys, tmp_path, settings, steps=4, cut=2)


@pytest.mark.slow
def test_dropout_acts_while_training_only(session_for):
    """The adapters' dropout changes what the adapters learn, and nothing else: evaluation sees no mask."""
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 256, (8, 33), dtype=np.int32)
    results = []
    for dropout in (0.0, 0.5):
        trainer = Trainer(session_for(*SMALL_MODEL, "model.lora.rank=4", "model.n_layers=2", "mesh.data=4",
                                      "mesh.tensor=2", "train.batch_size=8", f"model.lora.dropout={dropout}"))
        state = trainer.init()
        before = float(trainer.eval_loss(state.params, trainer.put_batch(tokens)))
        for _ in range(2):
            state, _ = trainer.step(state, trainer.put_batch(tokens))
        adapters = nnx.split_state(state.params, Frozen, nnx.LoRAParam)[1]
        results.append((before, np.concatenate([np.ravel(x) for x in jax.tree.leaves(jax.device_get(adapters))])))
    assert results[0][0] == results[1][0]  # evaluation: no dropout (and B = 0 at the start)
    assert not np.allclose(results[0][1], results[1][1])


@pytest.mark.parametrize("settings, words", [
    (["model.lora.rank=-1"], "model.lora.rank must be 0"),
    (["model.lora.targets=q,v"], "model.lora.rank is 0"),
    (["model.lora.rank=4", "model.lora.targets=q,x"], "unknown target 'x'"),
    (["model.lora.rank=4", "model.lora.targets=experts"], "has none"),
    (["model.lora.rank=4", "model.lora.alpha=0"], "model.lora.alpha must be positive"),
    (["model.lora.rank=100000"], "exceeds the q weight's smaller side"),
    (["model.lora.rank=4", "model.lora.dropout=1"], "model.lora.dropout must be at least 0 and below 1"),
])
def test_bad_adapter_settings_are_one_sentence(settings, words, capsys):
    extra = [] if any(s.startswith("model.lora.rank") for s in settings) else ["model.lora.rank=0"]
    assert main(["train", "configs/tiny_test.yaml", *extra, *settings]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_llama_8b_with_adapters_plans_within_one_80_gb_device(capsys):
    """Llama 3.1 8B with rank-16 adapters on every projection, seq 4096, full remat, on one device, read
    from the compiled step: within 80 GB on a bf16 base, and the NF4 base's weights a third of that."""
    plans = {}
    for base in ("bf16", "nf4"):
        assert main(["plan", "configs/llama3_8b.yaml", "run.devices=1", "mesh.data=1", "model.lora.rank=16",
                     f"model.lora.base_dtype={base}", "model.seq_len=4096", "train.batch_size=1",
                     "train.remat=full"]) == 0
        plans[base] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    bf16, nf4 = plans["bf16"], plans["nf4"]
    assert bf16["argument_bytes"] + bf16["temp_bytes"] <= 80e9
    for plan in plans.values():  # AdamW's two moments of the adapters, which are all that has a gradient
        assert abs(plan["opt_state_bytes"] - 2 * plan["grads_bytes"]) <= 0.05 * 2 * plan["grads_bytes"]
    frozen_bf16, frozen_nf4 = (p["params_bytes"] - p["grads_bytes"] for p in (bf16, nf4))
    assert frozen_nf4 < 0.4 * frozen_bf16
