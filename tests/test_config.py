"""Config parsing, presets and validation: pure Python, no jax."""

import subprocess
import sys

import pytest

from jaxpar.config import Config, ConfigError, MeshConfig, all_keys
from jaxpar.config.mesh import resolve_mesh
from jaxpar.config.presets import load_config
from jaxpar.features.validation import validate


def test_public_key_names_are_stable():
    contract = {"model.vocab_size", "model.d_model", "model.n_layers", "model.n_heads", "model.d_ff",
                "model.seq_len", "mesh.data", "mesh.tensor", "mesh.expert", "mesh.stage", "train.steps",
                "train.batch_size", "train.grad_accum", "train.lr", "train.warmup", "train.precision",
                "train.seed", "train.log_every", "data.source", "run.dir", "run.devices"}
    assert contract <= set(all_keys())


def test_overrides_are_typed():
    cfg = load_config(None, ["train.steps=7", "train.lr=1e-3", "model.tie_embeddings=false", "run.devices=4",
                             "train.precision=bf16"])
    assert cfg.train.steps == 7 and cfg.train.lr == 1e-3 and cfg.model.tie_embeddings is False
    assert cfg.run.devices == 4 and cfg.train.precision == "bf16"
    assert load_config(None, ["run.devices=auto"]).run.devices == "auto"


@pytest.mark.parametrize("override, message", [
    ("model.d_modle=3", "did you mean 'model.d_model'"),
    ("train.steps=abc", "train.steps expects an integer"),
    ("train.precision=fp4", "train.precision must be one of fp32, bf16"),
    ("train.lr=fast", "train.lr expects a number"),
    ("nonsense", "neither a .yaml file nor a key=value"),
])
def test_bad_overrides_say_what_is_wrong(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_presets_extend_a_base(tmp_path):
    (tmp_path / "base.yaml").write_text("model:\n  d_model: 64\n  n_heads: 2\ntrain:\n  steps: 5\n")
    (tmp_path / "child.yaml").write_text("extends: base.yaml\ntrain:\n  steps: 9\n")
    cfg = load_config(str(tmp_path / "child.yaml"), ["train.lr=0.01"])
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.train.steps, cfg.train.lr) == (64, 2, 9, 0.01)
    assert cfg.model.n_layers == Config().model.n_layers


def test_shipped_presets_load_and_validate():
    from jaxpar.config import CONFIG_DIR

    presets = sorted(CONFIG_DIR.glob("*.yaml"))
    assert presets
    for path in presets:
        cfg = load_config(str(path))
        validate(cfg, 8 if cfg.run.devices == "auto" else cfg.run.devices)


def test_mesh_resolution():
    assert resolve_mesh(MeshConfig(data=-1, tensor=2), 8) == {"data": 4, "tensor": 2, "expert": 1, "stage": 1,
                                                                 "context": 1}
    with pytest.raises(ConfigError, match="multiply to 6 but there are 8 devices"):
        resolve_mesh(MeshConfig(data=3, tensor=2), 8)
    with pytest.raises(ConfigError, match="only one mesh axis may be -1"):
        resolve_mesh(MeshConfig(data=-1, tensor=-1), 8)


def test_config_module_does_not_import_jax():
    code = "import jaxpar, jaxpar.config, jaxpar.cli, sys; print('jax' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_a_mixture_given_as_a_yaml_mapping_is_the_mixture_given_as_text(tmp_path):
    preset = tmp_path / "mix.yaml"
    preset.write_text("data:\n  packing: pack\n  mixture: {web: 0.7, code/python: 3}\n")
    from_yaml = load_config(str(preset))
    assert from_yaml == load_config(None, ["data.packing=pack", "data.mixture=web:0.7,code/python:3"])
    assert from_yaml == load_config(None, {"data": {"packing": "pack", "mixture": {"web": 0.7, "code/python": 3}}})
    assert from_yaml == load_config(None, ["data.packing=pack", "data.mixture={web: 0.7, code/python: 3}"])


@pytest.mark.parametrize("mapping", ["{web: lots}", "{web: 0.7, code: -1}", "{web: true}", "{'a,b': 1}"])
def test_a_malformed_mixture_mapping_is_refused_in_one_sentence(tmp_path, mapping):
    preset = tmp_path / "mix.yaml"
    preset.write_text(f"data:\n  mixture: {mapping}\n")
    with pytest.raises(ConfigError) as refusal:
        load_config(str(preset))
    message = str(refusal.value)
    assert message.startswith("data.mixture") and "\n" not in message and message.endswith(".")


@pytest.mark.parametrize("value", ["{web: lots}", "{web:0.7,code:0.3}", "{web: [0.7"])
def test_a_malformed_mixture_mapping_on_the_command_line_is_refused_in_one_sentence(value):
    with pytest.raises(ConfigError) as refusal:
        load_config(None, [f"data.mixture={value}"])
    message = str(refusal.value)
    assert message.startswith("data.mixture") and "\n" not in message and message.endswith(".")
