"""Gemma 3 (text), gpt-oss and DeepSeek-V3 checkpoints made by transformers 5.25 (tests/fixtures/hf, made by
make_fixtures.py with families.py) load with transformers' own fp32 logits on one device, on data=4 x tensor=2
with ZeRO-3 and (the mixtures of experts) on data=2 x expert=4, export bit for bit, and refuse what jaxpar
cannot represent in one sentence; a broken mapping (a swapped norm, dropped sinks, a missing soft-cap, the
rotary rows left interleaved) moves the logits far past the tolerance. Mistral's sliding window is
honoured: an edited copy of its fixture with a window of 8 matches transformers' logits."""

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from test_hf import FIXTURES, LOGIT_TOLERANCE, broken_copy, golden, layout_logits, read_all, rewrite_config

from jaxpar.cli import main

NEW = ("gemma3_text", "gpt_oss", "deepseek_v3")
MOE = ("gpt_oss", "deepseek_v3")  # their routers keep every golden token off near-ties (make_fixtures.py)
FAR = 100 * LOGIT_TOLERANCE  # how far a broken mapping must move the logits (it moves them by units)


def one_device_error(name: str, folder: Path | None = None) -> float:
    """max |jaxpar's logits - transformers'| on the golden tokens, the checkpoint loaded on one device."""
    from jaxpar.interop import hf

    model, _ = hf.load(folder or FIXTURES / name)
    tokens, expected = golden(name)
    return float(np.max(np.abs(np.asarray(model(jnp.asarray(tokens, jnp.int32))) - expected)))


@pytest.mark.parametrize("name", NEW)
def test_load_matches_transformers_on_one_device(name):
    assert one_device_error(name) <= LOGIT_TOLERANCE
    if name in MOE:  # the comparison's premise: no token's routing hangs on a near-tie
        assert np.load(FIXTURES / name / "golden.npz")["near_ties"] == 0


LAYOUTS = {"data=4 x tensor=2, ZeRO-3": ["mesh.data=4", "mesh.tensor=2", "parallel.zero=3"],
           "data=2 x expert=4": ["mesh.data=2", "mesh.expert=4"]}
CASES = [(name, "data=4 x tensor=2, ZeRO-3") for name in NEW] + [(name, "data=2 x expert=4") for name in MOE]


@pytest.mark.slow  # the quick tier checks each family on one device
@pytest.mark.parametrize("name, layout", CASES)
def test_load_matches_transformers_on_layouts(name, layout):
    """Each device reads its own slices of the checkpoint (the trainer's loader) and the layout's forward
    gives transformers' logits."""
    logits, expected = layout_logits(f"model.from_hf={FIXTURES / name}", *LAYOUTS[layout])
    assert np.max(np.abs(logits - expected)) <= LOGIT_TOLERANCE


@pytest.mark.parametrize("name", NEW)
def test_import_then_export_is_bit_for_bit(name, tmp_path):
    from jaxpar.interop import hf

    model, cfg = hf.load(FIXTURES / name)
    hf.save(model, cfg, tmp_path / "out")
    original, exported = read_all(FIXTURES / name), read_all(tmp_path / "out")
    assert sorted(original) == sorted(exported)
    for key, value in original.items():
        assert exported[key].dtype == value.dtype and np.array_equal(exported[key], value), key
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    source = json.loads((FIXTURES / name / "config.json").read_text())
    assert {k: v for k, v in written.items() if k != "torch_dtype"} == {k: v for k, v in source.items() if k != "dtype"}


@pytest.mark.parametrize("name", NEW)
def test_a_new_config_reads_back_as_the_model(name, tmp_path):
    """Exported without its source (a model of jaxpar's own), a model writes its family's config.json in the
    published spelling, which reads back as the same model with the same tensors. (transformers 5.25 loads
    these three folders to logits within 8.6e-6 of the fixtures': make_fixtures.py check, run by hand.)"""
    from jaxpar.config import flatten_dict
    from jaxpar.config.hf_config import model_settings
    from jaxpar.interop import hf

    model, cfg = hf.load(FIXTURES / name)
    own = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, from_hf=""))
    hf.save(model, own, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == name and "rope_parameters" not in written
    flat = flatten_dict(own.to_dict())
    assert {k: v for k, v in model_settings(written, Path("config.json")).items() if flat[k] != v} == {}
    original, exported = read_all(FIXTURES / name), read_all(tmp_path / "out")
    assert sorted(original) == sorted(exported) and all(np.array_equal(exported[k], v) for k, v in original.items())


# ---------------------------------------------------------------- broken mappings


def with_maps(monkeypatch, change) -> None:
    """The loader's tensor table with change(tensor_map) applied to each entry."""
    from jaxpar.interop import hf_names

    original = hf_names.tensor_maps
    monkeypatch.setattr("jaxpar.interop.hf_weights.tensor_maps", lambda m: [change(t) for t in original(m)])


def with_settings(monkeypatch, **changes) -> None:
    """The config reader's model.* values with `changes` (dotted keys, '.' spelled '__')."""
    from jaxpar.config import hf_config

    settings = hf_config.model_settings
    changed = {k.replace("__", "."): v for k, v in changes.items()}
    monkeypatch.setattr(hf_config, "model_settings", lambda hf_, where: {**settings(hf_, where), **changed})


def renamed(old_to_new: dict[str, str]):
    """A change that renames the source tensors: the first `old` part found in a name becomes its `new`."""
    def rename(name: str) -> str:
        old = next((o for o in old_to_new if o in name), None)
        return name if old is None else name.replace(old, old_to_new[old])

    return lambda t: dataclasses.replace(t, sources=tuple(rename(s) for s in t.sources))


def dropped(last: str):
    """A change that reads the parameter named `last` as zeros (no source tensor)."""
    return lambda t: dataclasses.replace(t, sources=()) if t.path[-1] == last else t


BROKEN = {
    "gemma3_text: pre-feedforward and post-attention norms swapped": ("gemma3_text", lambda mp: with_maps(mp, renamed(
        {"pre_feedforward_layernorm": "post_attention_layernorm",
         "post_attention_layernorm": "pre_feedforward_layernorm"}))),
    "gemma3_text: the final soft-cap dropped": ("gemma3_text", lambda mp: with_settings(mp, model__final_softcap=0.0)),
    "gemma3_text: the (1 + w) norms read as w": ("gemma3_text", lambda mp: with_settings(mp, model__norm_offset=False)),
    "gemma3_text: 1/sqrt(head size) for query_pre_attn_scalar": (
        "gemma3_text", lambda mp: with_settings(mp, model__attn_scale=0.0)),
    "gpt_oss: sinks dropped (read as zeros)": ("gpt_oss", lambda mp: with_maps(mp, dropped("sinks"))),
    "gpt_oss: gate and up columns read as halves, not interleaved": (
        "gpt_oss", lambda mp: with_maps(mp, lambda t: dataclasses.replace(t, split=(8, 32, 2, 16), perm=(0, 1, 2, 3))
                                        if t.path[-1] == "w_gate_up" else t)),
    "gpt_oss: the router bias dropped": ("gpt_oss", lambda mp: with_maps(mp, dropped("b_router"))),
    "deepseek_v3: rotary rows left interleaved": (
        "deepseek_v3", lambda mp: with_maps(mp, lambda t: dataclasses.replace(t, reorder=None))),
    "deepseek_v3: the correction bias dropped": ("deepseek_v3", lambda mp: with_maps(mp, dropped("router_bias"))),
    "deepseek_v3: the mscale^2 softmax factor dropped": (
        "deepseek_v3", lambda mp: with_settings(mp, model__attn_scale=0.0)),
}


# the quick tier breaks one mapping of each family; the whole suite all of them
QUICK_BREAKS = ("gemma3_text: pre-feedforward and post-attention norms swapped",
                "gpt_oss: sinks dropped (read as zeros)", "deepseek_v3: rotary rows left interleaved")


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in QUICK_BREAKS else pytest.mark.slow) for c in BROKEN])
def test_a_broken_mapping_fails(case, monkeypatch):
    name, breaking = BROKEN[case]
    breaking(monkeypatch)
    assert one_device_error(name) > FAR


# ---------------------------------------------------------------- Mistral's window


def small_window(folder: Path) -> None:
    rewrite_config(folder, sliding_window=8)


def test_mistral_imports_its_window():
    from jaxpar.config.hf_config import config_for

    m = config_for(FIXTURES / "mistral").model
    assert (m.window, m.attention_pattern) == (4096, "")


def test_a_window_shorter_than_the_sequence_matches_transformers(tmp_path, monkeypatch):
    """mistral/ with sliding_window 8 (24 tokens): transformers' logits of that copy (mistral_window8.npz, made
    with transformers 5.25 from the edited copy; make_fixtures.py check of jaxpar's logits passes at 1.4e-5)
    are 16 away from the full-attention ones, and jaxpar's match them; without the window it fails."""
    folder = broken_copy(tmp_path, "mistral", small_window)
    windowed = np.load(FIXTURES / "mistral_window8.npz")
    assert np.array_equal(windowed["tokens"], golden("mistral")[0])
    assert np.max(np.abs(windowed["logits"] - golden("mistral")[1])) > FAR
    from jaxpar.interop import hf

    def error() -> tuple[int, float]:
        model, cfg = hf.load(folder)
        logits = np.asarray(model(jnp.asarray(windowed["tokens"], jnp.int32)))
        return cfg.model.window, float(np.max(np.abs(logits - windowed["logits"])))

    window, windowed_error = error()
    assert window == 8 and windowed_error <= LOGIT_TOLERANCE
    monkeypatch.setattr("jaxpar.config.hf_config.window_settings", lambda hf_, where: {})
    window, unwindowed_error = error()
    assert window == 0 and unwindowed_error > FAR


# ---------------------------------------------------------------- reading config.json


def settings(name: str, **changes) -> dict:
    from jaxpar.config.hf_config import model_settings, read_config

    return model_settings({**read_config(FIXTURES / name), **changes}, Path("config.json"))


def test_gemma3_reads_both_spellings_alike_and_mirrors_transformers():
    """The fixture's published spelling (rope_theta, rope_scaling, rope_local_base_freq, sliding_window_pattern)
    and transformers 5's (layer_types, rope_parameters nested by layer type, a stale _sliding_window_pattern)
    read alike; attn_logit_softcapping (20 in the fixture) is not applied, as transformers 5.25's Gemma 3
    does not apply it."""
    published = settings("gemma3_text")
    assert {k: published[k] for k in ("model.window", "model.attention_pattern", "model.rope_theta",
                                      "model.rope_scaling", "model.rope_factor", "model.rope_local_theta",
                                      "model.final_softcap", "model.attn_softcap", "model.attn_scale")} == {
        "model.window": 8, "model.attention_pattern": "lllg", "model.rope_theta": 1000.0,
        "model.rope_scaling": "linear", "model.rope_factor": 4.0, "model.rope_local_theta": 100.0,
        "model.final_softcap": 30.0, "model.attn_softcap": 0.0, "model.attn_scale": 24 ** -0.5}
    from jaxpar.config.hf_config import read_config

    config = read_config(FIXTURES / "gemma3_text")
    for key in ("rope_theta", "rope_scaling", "rope_local_base_freq", "sliding_window_pattern"):
        config.pop(key)
    config.update(_sliding_window_pattern=6, layer_types=["sliding_attention"] * 3 + ["full_attention"],
                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000.0},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})
    from jaxpar.config.hf_config import model_settings

    assert model_settings(config, Path("config.json")) == published


def test_a_layer_pattern_that_repeats_nowhere_is_one_unit_of_every_layer():
    """gemma-3-1b's 26 layers (every sixth global, by the default sliding_window_pattern 6) repeat with no
    shorter period: the unit is all of them."""
    m = settings("gemma3_text", num_hidden_layers=26, sliding_window_pattern=6)
    assert m["model.attention_pattern"] == ("lllllg" * 4 + "ll")
    assert settings("gemma3_text", num_hidden_layers=12, sliding_window_pattern=6)["model.attention_pattern"] == (
        "lllllg")


def test_gpt_oss_and_deepseek_read_both_spellings_alike():
    """Published rope_theta beside rope_scaling (DeepSeek's with `type`) against transformers 5's one
    rope_parameters dict; DeepSeek's derived head_dim (= qk_rope_head_dim) is no head width."""
    for name, extra in (("gpt_oss", {}), ("deepseek_v3", {"head_dim": 4, "qk_head_dim": 12})):
        from jaxpar.config.hf_config import model_settings, read_config

        config = read_config(FIXTURES / name)
        published = model_settings(config, Path("config.json"))
        scaling = {("rope_type" if k == "type" else k): v for k, v in config.pop("rope_scaling").items()}
        config.update(rope_parameters={**scaling, "rope_theta": config.pop("rope_theta")}, **extra)
        assert model_settings(config, Path("config.json")) == published
    deepseek = settings("deepseek_v3")
    assert deepseek["model.attn_scale"] == pytest.approx(12 ** -0.5 * (0.1 * 0.8 * np.log(40) + 1) ** 2, rel=1e-12)
    assert (deepseek["model.rope_mscale"], deepseek["model.rope_mscale_all_dim"], deepseek["model.rope_truncate"]) == (
        1.0, 0.8, True)
    gpt_oss = settings("gpt_oss")
    assert (gpt_oss["model.moe.swiglu_alpha"], gpt_oss["model.moe.swiglu_limit"], gpt_oss["model.rope_truncate"],
            gpt_oss["model.attention_pattern"]) == (1.702, 1.0, False, "lg")


@pytest.mark.parametrize("changes, pattern, window", [
    ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0, "layer_types": None}, "", 16),
    ({"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2, "layer_types": None}, "ggll", 16),
    ({"use_sliding_window": True, "sliding_window": 16,
      "layer_types": ["sliding_attention", "full_attention"] * 2}, "lg", 16),
    ({"use_sliding_window": False, "sliding_window": 16, "max_window_layers": 0, "layer_types": None}, "", 0),
])
def test_qwen_windows_follow_use_sliding_window_and_the_layer_types(changes, pattern, window):
    m = settings("qwen2", **changes)
    assert (m["model.window"], m["model.attention_pattern"]) == (window, pattern)


# ---------------------------------------------------------------- refusals


def nested_local_rope(folder: Path) -> None:
    rewrite_config(folder, rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000.0},
                                            "sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                                  "rope_theta": 100.0}})


YARN = json.loads((FIXTURES / "gpt_oss" / "config.json").read_text())["rope_scaling"]
BAD = {
    "a multimodal Gemma 3": ("gemma3_text", {"model_type": "gemma3"}, "jaxpar imports the text-only gemma3_text"),
    "bidirectional attention": ("gemma3_text", {"use_bidirectional_attention": True},
                                "attends both ways (use_bidirectional_attention=true)"),
    "another activation": ("gemma3_text", {"hidden_activation": "gelu"}, "uses hidden_activation 'gelu'"),
    "scaled local rope": ("gemma3_text", nested_local_rope, "scales the sliding layers' rope (linear)"),
    "layer_types of the wrong length": ("gpt_oss", {"layer_types": ["sliding_attention"] * 3},
                                        "layer_types must list sliding_attention or full_attention for each of its 4"),
    "a layer kind jaxpar lacks": ("gpt_oss", {"layer_types": ["chunked_attention"] * 4}, "layer_types must list"),
    "MXFP4 experts": ("gpt_oss", {"quantization_config": {"quant_method": "mxfp4"}},
                      "holds mxfp4 weights (quantization_config)"),
    "an explicit yarn attention_factor": ("gpt_oss", {"rope_scaling": {**YARN, "attention_factor": 1.2}},
                                          "sets attention_factor=1.2, which jaxpar derives"),
    "no swiglu limit": ("gpt_oss", {"swiglu_limit": None}, "has swiglu_limit=None and swiglu_alpha=1.702"),
    "FP8 weights": ("deepseek_v3", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
                    "holds fp8 weights (quantization_config)"),
    "half-split rope rows": ("deepseek_v3", {"rope_interleave": False}, "has rope_interleave=false"),
    "softmax scores": ("deepseek_v3", {"scoring_func": "softmax"}, "has scoring_func='softmax'"),
    "another latent norm epsilon": ("deepseek_v3", {"rms_norm_eps": 1e-5}, "latent norms at 1e-06"),
    "attention biases": ("deepseek_v3", {"attention_bias": True}, "latent attention has no biases"),
    "fewer key/value heads": ("deepseek_v3", {"num_key_value_heads": 4}, "num_key_value_heads=4 beside"),
    "a key the checkpoint contradicts: Gemma's attention soft-cap": (
        "gemma3_text", {}, "the config sets model.attn_softcap=20.0, but", "model.attn_softcap=20"),
    "a key the checkpoint contradicts: MTP on DeepSeek-V3": (
        "deepseek_v3", {}, "the config sets model.mtp.depth=1, but", "model.mtp.depth=1"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_checkpoints_end_in_one_sentence(case, tmp_path, capsys):
    name, damage, words, *keys = BAD[case]
    folder = broken_copy(tmp_path, name, damage if callable(damage) else lambda f: rewrite_config(f, **damage))
    code = main(["train", f"model.from_hf={folder}", *keys, f"run.dir={tmp_path / 'run'}", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and words in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def model_of(name: str, **keys):
    from jaxpar.config.hf_config import config_for

    m = config_for(FIXTURES / name).model
    return dataclasses.replace(m, from_hf="", **keys)


@pytest.mark.parametrize("name, keys, words", [
    ("gemma3_text", {"attn_softcap": 20.0}, "model.attn_softcap=20.0"),
    ("gemma3_text", {"sandwich_norm": False}, "no model.sandwich_norm"),
    ("gemma3_text", {"attn_scale": 0.3}, "model.attn_scale=0.3 (not 1/sqrt of a whole number)"),
    ("gpt_oss", {"sinks": False}, "no model.sinks"),
    ("gpt_oss", {"out_bias": False}, "model.qkv_bias without model.out_bias"),
    ("deepseek_v3", {"attn_scale": 0.0}, "(its rope settings imply 0.48"),
    ("deepseek_v3", {"norm_eps": 1e-5}, "model.norm_eps=1e-05 (its latent norms' is 1e-06)"),
])
def test_export_refuses_a_model_its_family_cannot_hold(name, keys, words):
    from jaxpar.config.hf_config import CheckpointError, family_of

    with pytest.raises(CheckpointError, match="has no Hugging Face family") as error:
        family_of(model_of(name, **keys))
    assert words in str(error.value) and name in str(error.value)


def test_export_keeps_a_window_only_where_the_family_has_one():
    """Mistral (a window on every layer) takes Llama's weights with a window; Mixtral cannot hold a pattern of
    local and global layers; Qwen 2 can (layer_types)."""
    from jaxpar.config.hf_config import CheckpointError, family_of

    assert family_of(model_of("llama", window=16)) == "mistral" and family_of(model_of("mistral", window=0)) == "llama"
    assert family_of(model_of("qwen2", window=16, attention_pattern="lg")) == "qwen2"
    with pytest.raises(CheckpointError, match="model.attention_pattern='lg'"):
        family_of(model_of("mixtral", window=16, attention_pattern="lg"))


@pytest.mark.slow
@pytest.mark.parametrize("name, layout", [("gpt_oss", ["mesh.data=2", "mesh.expert=4"]),
                                          ("deepseek_v3", ["mesh.data=4", "mesh.tensor=2", "parallel.zero=3"])])
def test_train_export_and_import_again_gives_the_trained_weights(name, layout, tmp_path):
    """4 steps from the checkpoint, `jaxpar export-hf` in fp32, import again: every parameter equals the run's,
    bit for bit (DeepSeek's correction bias moved by bias balancing included)."""
    import jax
    from flax import nnx

    from jaxpar.interop import hf
    from jaxpar.interop.saved_run import SavedRun

    run, out = tmp_path / "run", tmp_path / "hf"
    assert main(["train", f"model.from_hf={FIXTURES / name}", *layout, "train.steps=4", "checkpoint.every=4",
                 "train.sample_tokens=0", "model.seq_len=32", "train.batch_size=8", f"run.dir={run}",
                 "--no-progress"]) == 0
    assert main(["export-hf", str(run), "--out", str(out), "--dtype", "fp32", "--no-progress"]) == 0
    saved = SavedRun(run)
    trained = saved.params(4, saved.config(4), jax.sharding.SingleDeviceSharding(jax.devices()[0]))
    saved.close()
    again, _ = hf.load(out)
    before, _ = hf.load(FIXTURES / name)
    flat = lambda state: {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(state)}  # noqa: E731
    trained, again, before = flat(trained), flat(nnx.state(again, nnx.Param)), flat(nnx.state(before, nnx.Param))
    assert trained.keys() == again.keys()
    for path, value in trained.items():
        assert np.array_equal(value, again[path]), path
    kept = [path for path, value in trained.items() if np.array_equal(value, before[path])]
    assert kept and all(path[-1] == "w_noise" for path in kept), kept  # the noise is off: its weight stays zero


def test_a_final_soft_cap_is_gemmas_alone():
    """A Llama with a final soft-cap is not exported as a Llama without one."""
    from jaxpar.config.hf_config import CheckpointError, family_of

    with pytest.raises(CheckpointError, match="other settings are gemma3_text's"):
        family_of(model_of("llama", final_softcap=30.0))
