"""The Python API for a module of one's own: the Python API guide's example (docs/python-api.md) runs as written
and agrees with one device; a module without the block protocol trains whole and is refused per-layer features."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from test_docs import marked_block

from jaxpar.config import ConfigError
from jaxpar.config.presets import load_config
from jaxpar.model import constrain
from jaxpar.train.run_session import prepare
from jaxpar.verify.run import verify

GUIDE = Path(__file__).resolve().parent.parent / "docs" / "python-api.md"


def guide_example() -> str:
    block = marked_block(GUIDE, "test_python_api")
    assert block.language == "python", f"the Python API guide's marked example is {block.language}, not python"
    return block.text


@pytest.mark.slow
def test_the_guide_example_runs_and_agrees_with_one_device(capsys):
    namespace = {"__name__": "readme_example"}
    exec(compile(guide_example(), "docs/python-api.md", "exec"), namespace)
    result = namespace["result"]
    assert result["ok"] and result["layout"] == "data=4 tensor=2 zero=3 fp32", result
    assert result["loss_max_rel_err"] <= 1e-5 and result["param_max_rel_err"] <= 1e-4
    # its own logical name really splits the MLP over tensor (and ZeRO-3 over data)
    from jaxpar.train.trainer import Trainer

    trainer = Trainer(namespace["session"],
                      model=lambda rngs: namespace["ParallelLM"](namespace["cfg"].model, rngs=rngs),
                      rules={"ffn_hidden": "tensor"})
    assert tuple(trainer.state_shardings.params["blocks"]["mlp"]["w_in"].get_value().spec) == (
        "stage", None, None, ("tensor", "data"))


@pytest.mark.slow
def test_the_guide_model_pipelines_with_remat(tmp_path):
    """The block protocol is all a pipeline needs: the guide's model on data=2 x tensor=2 x stage=2."""
    namespace = {"__name__": "readme_example"}
    exec(compile(guide_example().split("# ZeRO-3 on data=4")[0], "docs/python-api.md", "exec"), namespace)
    session = prepare(load_config(None, [f"run.dir={tmp_path}", "mesh.data=2", "mesh.tensor=2", "mesh.stage=2",
                                         "parallel.zero=1", "train.remat=full", "train.steps=3", "model.d_model=64",
                                         "model.n_layers=2", "model.d_ff=256", "model.seq_len=64",
                                         "train.batch_size=16"]))
    result = verify(session, model=lambda rngs: namespace["ParallelLM"](session.cfg.model, rngs=rngs),
                    rules={"ffn_hidden": "tensor"}, log=lambda line: None)
    assert result["ok"] and result["loss_max_rel_err"] <= 1e-5 and result["param_max_rel_err"] <= 1e-4, result


class WholeLM(nnx.Module):
    """A model with only __call__: embedding, one tanh layer with its own hidden name, tied logits."""

    def __init__(self, cfg, *, rngs):
        init = lambda shape, names: nnx.Param(0.02 * jax.random.normal(rngs.params(), shape),  # noqa: E731
                                              out_sharding=names, eager_sharding=False)
        self.embedding = init((cfg.vocab_size, cfg.d_model), ("vocab", "embed"))
        self.w = init((cfg.d_model, cfg.d_ff), ("embed", "hidden"))
        self.v = init((cfg.d_ff, cfg.d_model), ("hidden", "embed"))

    def __call__(self, tokens_BL):
        x = jnp.take(self.embedding[...], tokens_BL, axis=0)
        h = constrain(jnp.tanh(x @ self.w[...]), ("batch", "seq", "hidden"))
        return jnp.einsum("BLD,VD->BLV", x + h @ self.v[...], self.embedding[...])


def _tiny(tmp_path, *overrides):
    return prepare(load_config("configs/tiny_test.yaml", [f"run.dir={tmp_path}", "train.steps=3", *overrides]))


@pytest.mark.parametrize("layout", [["parallel.zero=3"],
                                    ["parallel.zero=2", "train.grad_accum=2", "train.precision=bf16"]])
def test_a_module_without_the_block_protocol_trains_whole(tmp_path, layout):
    session = _tiny(tmp_path, *layout)
    model = lambda rngs: WholeLM(session.cfg.model, rngs=rngs)  # noqa: E731
    result = verify(session, model=model, rules={"hidden": "tensor"}, log=lambda line: None)
    assert result["ok"], result


@pytest.mark.parametrize("setting, words", [("train.remat=full", "train.remat=full needs the model's layers"),
                                            ("mesh.stage=2", "mesh.stage > 1 needs the model's layers"),
                                            ("train.loss_chunks=2", "train.loss_chunks=2 needs the model's layers")])
def test_per_layer_features_need_the_block_protocol(tmp_path, setting, words):
    from jaxpar.train.trainer import Trainer

    session = _tiny(tmp_path, setting, *(["mesh.data=2"] if "stage" in setting else []))
    with pytest.raises(ConfigError, match=re.escape(words)):
        Trainer(session, model=lambda rngs: WholeLM(session.cfg.model, rngs=rngs))
