"""Open weights in and out: tiny Llama, Mistral, Qwen 2, Qwen 3, Mixtral and Qwen3-MoE checkpoints made by
the transformers library (tests/fixtures/hf, with the script that made them) load onto every layout with
transformers' own logits, train, export bit for bit, and refuse bad input in one sentence."""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxpar.cli import main
from jaxpar.config.presets import load_config

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
DENSE = ("llama", "mistral", "qwen2", "qwen3")
MOE = ("mixtral", "qwen3_moe")  # their routers keep every golden token off bf16 near-ties (make_fixtures.py)
FAMILIES = DENSE + MOE
LOGIT_TOLERANCE = 1e-4  # max abs, fp32, against transformers


def golden(name: str):
    data = np.load(FIXTURES / name / "golden.npz")
    return data["tokens"], data["logits"]


@pytest.mark.parametrize("name", FAMILIES)
def test_load_matches_transformers_on_one_device(name):
    from jaxpar.interop import hf

    model, cfg = hf.load(FIXTURES / name)
    tokens, expected = golden(name)
    logits = np.asarray(model(jnp.asarray(tokens, jnp.int32)))
    assert logits.shape == expected.shape
    assert np.max(np.abs(logits - expected)) <= LOGIT_TOLERANCE
    if name in MOE:  # the comparison's premise: jaxpar's bf16 ranking and transformers' fp32 one agree
        assert np.load(FIXTURES / name / "golden.npz")["near_ties"] == 0


def layout_logits(*settings: str) -> tuple[np.ndarray, np.ndarray]:
    """Logits of the golden tokens (tiled to a batch of 8) on the layout `settings` builds, after
    loading the checkpoint through the trainer (each device its own slices), and transformers'."""
    from jaxpar.model import layout_hooks
    from jaxpar.parallel import eval_hooks
    from jaxpar.train.run_session import prepare
    from jaxpar.train.trainer import Trainer

    name = next(s for s in settings if s.startswith("model.from_hf=")).rsplit("/", 1)[1]
    trainer = Trainer(prepare(load_config(None, list(settings))))
    state = trainer.init()

    def forward(params, tokens_BL):
        with layout_hooks(eval_hooks(trainer.layout)):
            return nnx.merge(trainer.graphdef, trainer.to_model_order(params))(tokens_BL)

    tokens, expected = golden(name)
    batch = np.tile(tokens, (4, 1)).astype(np.int32)
    logits = jax.jit(forward, in_shardings=(trainer.state_shardings.params, trainer.batch_sharding))(
        state.params, trainer.put_batch(batch))
    return np.asarray(jax.device_get(logits))[..., :expected.shape[-1]], np.tile(expected, (4, 1, 1))


LAYOUTS = {
    "data=4 x tensor=2": ["mesh.data=4", "mesh.tensor=2"],
    "tensor=8": ["mesh.data=1", "mesh.tensor=8", "model.vocab_multiple=8"],  # qwen2's 300 rows are padded
    "data=2 x stage=4": ["mesh.data=2", "mesh.stage=4"],
    "ZeRO-3 on data=4 x expert=2": ["mesh.data=4", "mesh.expert=2", "parallel.zero=3"],
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", DENSE)
def test_load_matches_transformers_on_layouts(name, layout):
    logits, expected = layout_logits(f"model.from_hf={FIXTURES / name}", *LAYOUTS[layout])
    assert np.max(np.abs(logits - expected)) <= LOGIT_TOLERANCE


# Experts split over `expert` (each device reads its own experts), and beside tensor parallelism.
MOE_LAYOUTS = {"ZeRO-3 on data=4 x expert=2": LAYOUTS["ZeRO-3 on data=4 x expert=2"],
               "data=2 x tensor=2 x expert=2": ["mesh.data=2", "mesh.tensor=2", "mesh.expert=2"]}


@pytest.mark.slow
@pytest.mark.parametrize("layout", MOE_LAYOUTS)
@pytest.mark.parametrize("name", MOE)
def test_moe_checkpoints_match_transformers_on_layouts(name, layout):
    logits, expected = layout_logits(f"model.from_hf={FIXTURES / name}", *MOE_LAYOUTS[layout])
    assert np.max(np.abs(logits - expected)) <= LOGIT_TOLERANCE


def test_a_broken_mapping_fails(monkeypatch):
    """The comparison can fail: gate and up swapped in the tensor table, or the llama3 rope scaling
    dropped, moves the logits far beyond the tolerance."""
    from jaxpar.interop import hf, hf_names

    tokens, expected = golden("llama")
    original = hf_names.tensor_maps

    def swapped(m):
        maps = original(m)
        return [t if t.path[-1] != "w_gate_up" else type(t)(t.path, t.sources[::-1], t.source_shape, t.split, t.perm,
                                                            t.layers, t.slot_axis, t.pad) for t in maps]

    monkeypatch.setattr("jaxpar.interop.hf_weights.tensor_maps", swapped)
    model, cfg = hf.load(FIXTURES / "llama")
    assert np.max(np.abs(np.asarray(model(jnp.asarray(tokens, jnp.int32))) - expected)) > 100 * LOGIT_TOLERANCE
    monkeypatch.undo()

    from jaxpar.config import hf_config

    settings = hf_config.model_settings
    monkeypatch.setattr(hf_config, "model_settings",
                        lambda hf_, where: {**settings(hf_, where), "model.rope_scaling": "none"})
    model, cfg = hf.load(FIXTURES / "llama")
    assert cfg.model.rope_scaling == "none"
    assert np.max(np.abs(np.asarray(model(jnp.asarray(tokens, jnp.int32))) - expected)) > 100 * LOGIT_TOLERANCE


def test_a_broken_expert_mapping_fails(monkeypatch):
    """Each expert's gate (w1) and up (w3) projections swapped moves Mixtral's logits far beyond the
    tolerance."""
    from jaxpar.interop import hf, hf_names

    original = hf_names.tensor_maps
    monkeypatch.setattr("jaxpar.interop.hf_weights.tensor_maps", lambda m: [
        dataclasses.replace(t, sources=t.sources[::-1]) if t.experts and t.slot_axis is not None else t
        for t in original(m)])
    model, cfg = hf.load(FIXTURES / "mixtral")
    tokens, expected = golden("mixtral")
    assert np.max(np.abs(np.asarray(model(jnp.asarray(tokens, jnp.int32))) - expected)) > 100 * LOGIT_TOLERANCE


# ---------------------------------------------------------------- round trips


def read_all(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint folder, whole, with its stored dtype."""
    from jaxpar.interop.safetensors import Checkpoint

    checkpoint = Checkpoint(folder)
    return {name: checkpoint.read(name, tuple((0, n) for n in checkpoint.shape(name))) for name in checkpoint.where}


@pytest.mark.parametrize("name", FAMILIES)
def test_import_then_export_is_bit_for_bit(name, tmp_path):
    from jaxpar.interop import hf

    model, cfg = hf.load(FIXTURES / name)
    files = hf.save(model, cfg, tmp_path / "out")
    original, exported = read_all(FIXTURES / name), read_all(tmp_path / "out")
    assert sorted(original) == sorted(exported)
    for key, value in original.items():
        assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key
    assert {"config.json", "tokenizer.json", "generation_config.json"} <= set(files)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    source = json.loads((FIXTURES / name / "config.json").read_text())
    assert {k: v for k, v in written.items() if k != "torch_dtype"} == {k: v for k, v in source.items() if k != "dtype"}


@pytest.mark.slow
def test_train_export_and_import_again_gives_the_trained_weights(tmp_path):
    """qwen2 on data=2 x tensor=4 with its 300-row vocabulary padded to 304: 5 steps, export in fp32 (the
    padding dropped), import again: every parameter equals the checkpoint's, bit for bit."""
    from jaxpar.interop import hf
    from jaxpar.interop.saved_run import SavedRun

    run, out = tmp_path / "run", tmp_path / "hf"
    assert main(["train", f"model.from_hf={FIXTURES / 'qwen2'}", "mesh.data=2", "mesh.tensor=4",
                 "model.vocab_multiple=8", "train.steps=5", "checkpoint.every=5", "train.sample_tokens=8",
                 "model.seq_len=32", "train.batch_size=8", f"run.dir={run}", "--no-progress"]) == 0
    assert main(["export-hf", str(run), "--out", str(out), "--dtype", "fp32", "--no-progress"]) == 0
    assert read_all(out)["model.embed_tokens.weight"].shape == (300, 32)
    saved = SavedRun(run)
    cfg = saved.config(5)
    trained = saved.params(5, cfg, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    saved.close()
    again, _ = hf.load(out, **{"model.vocab_multiple": 8})
    before, _ = hf.load(FIXTURES / "qwen2", **{"model.vocab_multiple": 8})
    flat = lambda state: {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}  # noqa: E731
    trained, again, before = flat(trained), flat(nnx.state(again, nnx.Param)), flat(nnx.state(before, nnx.Param))
    assert trained.keys() == again.keys() == before.keys()
    for path, value in trained.items():
        assert np.array_equal(value, again[path]), path
        assert not np.array_equal(value, before[path]), path  # training moved every parameter that came back


@pytest.mark.slow
def test_training_from_an_import_verifies(capsys):
    """The issue's verify: ZeRO-3 on data=4 x tensor=2 from the llama fixture, fp32 tolerance."""
    code = main(["verify", f"model.from_hf={FIXTURES / 'llama'}", "mesh.data=4", "mesh.tensor=2", "parallel.zero=3"])
    result = json.loads(capsys.readouterr().out)
    assert code == 0 and result["ok"] and result["loss_max_rel_err"] <= 1e-5 and result["param_max_rel_err"] <= 1e-4


# ---------------------------------------------------------------- memory


@pytest.mark.parametrize("name, layout", [("mistral", ["mesh.data=8", "parallel.zero=3"]),
                                          ("mistral", ["mesh.data=1", "mesh.tensor=8"]),
                                          ("mixtral", ["mesh.data=1", "mesh.expert=8", "parallel.zero=3"])])
def test_each_device_reads_only_its_own_slices(name, layout):
    """On ZeRO-3 over 8 devices, on tensor=8 and with Mixtral's experts over expert=8, every parameter
    that the layout shards is read in slices: each device reads exactly the bytes of its shard of each
    tensor (not the whole tensor; its own experts' tensors alone), and what all devices read together is
    the checkpoint once, plus the replicated tensors."""
    from jaxpar.interop.hf_names import tensor_maps
    from jaxpar.interop.hf_weights import load_params
    from jaxpar.model.axes import path_names
    from jaxpar.train.run_session import prepare
    from jaxpar.train.trainer import Trainer

    session = prepare(load_config(None, [f"model.from_hf={FIXTURES / name}", *layout]))
    trainer = Trainer(session)
    m = session.cfg.model
    _, per_device = load_params(session.hf_checkpoint, m, trainer.param_shardings, progress=False)
    maps = {t.path: t for t in tensor_maps(m)}
    expected = dict.fromkeys(per_device, 0)
    whole = 0
    for path, sharding in jax.tree_util.tree_flatten_with_path(
            trainer.param_shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
        tensor_map, sharding = maps[path_names(path)], sharding.get_value()
        if not tensor_map.sources:  # the router's noise weight: not in the checkpoint, made as zeros
            continue
        whole += int(np.prod(tensor_map.shape)) * 4
        for device, index in sharding.addressable_devices_indices_map(tensor_map.shape).items():
            expected[device.id] += int(np.prod([len(range(*s.indices(n)))
                                                for s, n in zip(index, tensor_map.shape)])) * 4
    assert per_device == expected
    assert max(per_device.values()) < whole / 4  # most of the model is split 8 ways


# ---------------------------------------------------------------- bad input


def broken_copy(tmp_path: Path, name: str, damage) -> Path:
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    damage(folder)
    return folder


def rewrite_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def misshapen(folder: Path) -> None:
    from jaxpar.interop.safetensors import write_file

    tensors = read_all(folder)
    tensors["model.layers.1.mlp.up_proj.weight"] = tensors["model.layers.1.mlp.up_proj.weight"][:-1]
    (folder / "model.safetensors").unlink()
    write_file(folder / "model.safetensors", [(n, t.shape) for n, t in tensors.items()], np.dtype(np.float32),
               tensors.__getitem__)


def bigger_tokenizer(folder: Path) -> None:
    spec = json.loads((folder / "tokenizer.json").read_text())
    spec["added_tokens"].append({**spec["added_tokens"][0], "id": 400, "content": "<|extra|>"})
    (folder / "tokenizer.json").write_text(json.dumps(spec))


BAD_CHECKPOINTS = {
    "no config.json": ("llama", lambda f: (f / "config.json").unlink(), "has no config.json"),
    "unsupported model type": ("llama", lambda f: rewrite_config(f, model_type="gpt2"), "has model_type 'gpt2'"),
    "unsupported rope type": ("llama", lambda f: rewrite_config(f, rope_scaling={"rope_type": "yarn", "factor": 4.0}),
                              "rope scaling of type 'yarn'"),
    "missing shard": ("mistral", lambda f: (f / "model-00002-of-00005.safetensors").unlink(),
                      "shard model-00002-of-00005.safetensors listed in"),
    "cut-short shard": ("mistral", lambda f: (f / "model-00003-of-00005.safetensors").write_bytes(
        (f / "model-00003-of-00005.safetensors").read_bytes()[:-100]), "is cut short"),
    "misshapen tensor": ("llama", misshapen, "model.layers.1.mlp.up_proj.weight in"),
    "tokenizer larger than the vocabulary": ("qwen2", bigger_tokenizer, "produces ids up to 400"),
    "output bias": ("llama", lambda f: rewrite_config(f, attention_bias=True), "has attention_bias=true"),
    "missing expert tensor": ("mixtral", lambda f: without(f, "model.layers.2.block_sparse_moe.experts.5.w3.weight"),
                              "lacks the tensor model.layers.2.block_sparse_moe.experts.5.w3.weight"),
    "experts no model.moe.every places": ("qwen3_moe", lambda f: rewrite_config(f, mlp_only_layers=[1]),
                                          "experts are in layers [3] (decoder_sparse_step=2, mlp_only_layers=[1])"),
    "a Qwen2-MoE's gated shared expert": ("qwen3_moe", lambda f: rewrite_config(f, model_type="qwen2_moe"),
                                          "sigmoid gate (shared_expert_gate)"),
    "experts that do not divide over expert": ("mixtral", lambda f: rewrite_config(f, num_local_experts=6),
                                               "model.moe.experts=6 is not divisible by mesh.expert=4",
                                               "mesh.expert=4"),
}


def without(folder: Path, name: str) -> None:
    from jaxpar.interop.safetensors import write_file

    tensors = read_all(folder)
    del tensors[name]
    (folder / "model.safetensors").unlink()
    write_file(folder / "model.safetensors", [(n, t.shape) for n, t in tensors.items()], np.dtype(np.float32),
               tensors.__getitem__)


@pytest.mark.parametrize("case", BAD_CHECKPOINTS)
def test_bad_checkpoints_end_in_one_sentence(case, tmp_path, capsys):
    name, damage, words, *settings = BAD_CHECKPOINTS[case]
    folder = broken_copy(tmp_path, name, damage)
    code = main(["train", f"model.from_hf={folder}", *settings, f"run.dir={tmp_path / 'run'}", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and words in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name, keys, words", [
    ("qwen3", ["model.d_model=64", "model.qk_norm=false"], "model.d_model=64, model.qk_norm=False"),
    ("mixtral", ["model.moe.router=topk", "model.moe.noise=true"],
     "has model.moe.router=dropless, model.moe.noise=False"),
])
def test_a_key_that_contradicts_the_checkpoint_is_refused(name, keys, words, capsys):
    code = main(["plan", f"model.from_hf={FIXTURES / name}", *keys])
    err = capsys.readouterr().err.strip()
    assert code == 2 and words in err and len(err.splitlines()) == 1, err


def test_both_spellings_of_a_qwen3_moe_config_read_alike():
    """Published Qwen3-MoE files say num_experts and rope_theta; transformers 5 writes num_local_experts
    and rope_parameters."""
    from jaxpar.config.hf_config import model_settings, read_config

    published = read_config(FIXTURES / "qwen3_moe")
    written = {k: v for k, v in published.items() if k not in ("num_experts", "rope_theta", "rope_scaling")}
    written.update(num_local_experts=published["num_experts"],
                   rope_parameters={"rope_type": "default", "rope_theta": published["rope_theta"]})
    settings = model_settings(published, Path("config.json"))
    assert settings == model_settings(written, Path("config.json"))
    assert {k: settings[k] for k in ("model.moe.experts", "model.moe.every", "model.moe.top_k", "model.moe.d_ff",
                                     "model.d_ff", "model.moe.renormalize")} == {
        "model.moe.experts": 8, "model.moe.every": 2, "model.moe.top_k": 3, "model.moe.d_ff": 16, "model.d_ff": 48,
        "model.moe.renormalize": False}


# Every MLP an MoE (Mixtral's shape: its one width, intermediate_size, is the experts')
MOE_MODEL = {"model.mlp": "swiglu", "model.d_ff": 64, "model.moe.experts": 4, "model.moe.every": 1,
             "model.moe.router": "dropless", "model.moe.mlp": "swiglu", "model.moe.d_ff": 64, "model.moe.noise": False}


@pytest.mark.parametrize("family, keys", [("mixtral", {}), ("qwen3_moe", {
    "model.qk_norm": True, "model.moe.every": 2, "model.d_ff": 96, "model.moe.renormalize": False})])
def test_a_new_moe_config_reads_back_as_the_model(family, keys):
    """An MoE model of jaxpar's own exports with a new config.json of its family, which imports as the same
    model."""
    from jaxpar.config import Config, apply_overrides, flatten_dict
    from jaxpar.config.hf_config import hf_config, model_settings

    m = apply_overrides(Config(), {**MOE_MODEL, **keys}).model
    written = hf_config(m, "float32")
    assert written["model_type"] == family
    flat = flatten_dict(Config(model=m).to_dict())
    assert {k: v for k, v in model_settings(written, Path("config.json")).items()
            if flat[k] != v and not (k == "model.n_kv_heads" and v == m.kv_heads)} == {}


@pytest.mark.parametrize("keys, words", [({"model.moe.mlp": "gelu"}, "model.moe.mlp=gelu"),
                                         ({"model.moe.router": "switch"}, "model.moe.router=switch"),
                                         ({"model.moe.shared": 1}, "model.moe.shared=1"),
                                         ({"model.moe.balance": "bias"}, "model.moe.balance=bias"),
                                         ({"model.moe.every": 2}, "model.moe.every > 1")])
def test_export_refuses_experts_no_family_holds(keys, words):
    from jaxpar.config import Config, apply_overrides
    from jaxpar.config.hf_config import CheckpointError, family_of

    with pytest.raises(CheckpointError, match="has no Hugging Face family") as error:
        family_of(apply_overrides(Config(), {**MOE_MODEL, **keys}).model)
    assert words in str(error.value)


@pytest.mark.slow
def test_export_refuses_a_model_no_family_holds(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "configs/tiny_test.yaml", "train.steps=2", "checkpoint.every=2", "train.sample_tokens=0",
                 f"run.dir={run}", "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["export-hf", str(run), "--out", str(tmp_path / "out")]) == 2
    assert "model.mlp=gelu" in capsys.readouterr().err and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- tokenizer and generation


def test_tokenize_with_a_checkpoints_tokenizer_and_generate(tmp_path, capsys):
    """`jaxpar tokenize --tokenizer DIR` encodes with the checkpoint's tokenizer.json (no BOS per line),
    training on it runs, and `jaxpar generate` decodes with it from the run and from the checkpoint."""
    from tokenizers import Tokenizer

    text = tmp_path / "docs.txt"
    text.write_text("the quick brown fox jumps over the lazy dog.\n" * 400)
    tok, run = tmp_path / "tok", tmp_path / "run"
    assert main(["tokenize", "--input", str(text), "--tokenizer", str(FIXTURES / "qwen2"), "--out", str(tok),
                 "--no-progress"]) == 0
    ids = np.fromfile(tok / json.loads((tok / "meta.json").read_text())["shards"][0]["file"], np.uint16)
    tokenizer = Tokenizer.from_file(str(FIXTURES / "qwen2" / "tokenizer.json"))
    assert tokenizer.decode(ids.tolist()) == text.read_text()
    assert main(["train", f"model.from_hf={FIXTURES / 'qwen2'}", f"data.source={tok}", "train.steps=4",
                 "checkpoint.every=4", "model.seq_len=32", "train.batch_size=8", f"run.dir={run}",
                 "--no-progress"]) == 0
    capsys.readouterr()
    for source in (run, FIXTURES / "qwen2"):
        assert main(["generate", str(source), "--prompt", "the quick", "--tokens", "6"]) == 0
        captured = capsys.readouterr()
        assert captured.out.startswith("the quick") and "new tokens after" in captured.err


def test_the_key_value_cache_generates_what_the_whole_sequence_does():
    """Greedy ids with the cache are the argmax of the whole sequence's logits at every position
    (causal attention: position i's logits see only ids up to i)."""
    from jaxpar.interop import hf
    from jaxpar.sampling.single import generate_ids

    model, cfg = hf.load(FIXTURES / "qwen3")
    graphdef, params = nnx.split(model)
    prompt = [5, 17, 42, 9]
    ids = generate_ids(graphdef, params, cfg.model, prompt, 12)
    assert len(ids) == len(prompt) + 12 and ids[:len(prompt)] == prompt
    logits = model(jnp.asarray([ids], jnp.int32))[0]
    assert [int(i) for i in jnp.argmax(logits[len(prompt) - 1:-1], axis=-1)] == ids[len(prompt):]


# ---------------------------------------------------------------- presets


# The shape fields of the published config.json files (meta-llama/Llama-3.2-1B, Qwen/Qwen2.5-0.5B,
# mistralai/Mistral-7B-v0.3).
PUBLISHED = {
    "llama3_2_1b.yaml": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
                         "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
                         "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
                         "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                          "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                         "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False},
    "qwen2_5_0_5b.yaml": {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
                          "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
                          "hidden_act": "silu", "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
                          "tie_word_embeddings": True, "use_sliding_window": False, "sliding_window": 32768},
    "mistral_7b.yaml": {"model_type": "mistral", "vocab_size": 32768, "hidden_size": 4096, "intermediate_size": 14336,
                        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                        "hidden_act": "silu", "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
                        "tie_word_embeddings": False},
}


@pytest.mark.parametrize("preset", PUBLISHED)
def test_presets_have_the_published_shapes(preset):
    from jaxpar.config import flatten_dict
    from jaxpar.config.hf_config import model_settings

    flat = flatten_dict(load_config(f"configs/{preset}").to_dict())
    wanted = model_settings(PUBLISHED[preset], Path(preset))
    assert {k: flat[k] for k in wanted if flat[k] != wanted[k] and not (k == "model.n_kv_heads" and flat[k] == 0)} == {}
