"""model.from_run: a run starts from an earlier run's newest checkpoint, its model's shape read from the
config that run saved; what contradicts it, or a run of adapters, is one sentence."""

import jax
import numpy as np
import pytest
from helpers import train_here

from jaxpar.cli import main
from jaxpar.config.presets import load_config
from jaxpar.interop.checkpoint_files import flat_by_path
from jaxpar.interop.saved_run import SavedRun
from jaxpar.model.adapters import Frozen
from jaxpar.train.run_session import prepare
from jaxpar.train.trainer import Trainer

SHAPE = ("model.d_model=32", "model.n_layers=2", "model.d_ff=64", "model.seq_len=32")


@pytest.fixture(scope="module")
def earlier(tmp_path_factory):
    """A 3-step run of a model shaped unlike the defaults."""
    from jaxpar.cli import main

    run = tmp_path_factory.mktemp("earlier") / "run"
    assert main(["train", "--no-progress", *SHAPE, "train.steps=3", "train.sample_tokens=0",
                 "train.eval_batches=1", f"run.dir={run}"]) == 0
    return run


def test_a_run_starts_from_the_earlier_runs_weights_and_shape(earlier, tmp_path):
    cfg = load_config(None, [f"model.from_run={earlier}", f"run.dir={tmp_path / 'next'}"])
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.d_ff) == (32, 2, 64)
    trainer = Trainer(prepare(cfg))
    params = flat_by_path(jax.device_get(trainer.init().params))
    saved = SavedRun(earlier)
    try:
        one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        expected = flat_by_path(jax.device_get(saved.params(3, cfg, one_device)))
    finally:
        saved.close()
    assert params.keys() == expected.keys()
    assert all(np.array_equal(params[k], expected[k]) for k in params)


def test_adapters_go_on_the_earlier_runs_weights(earlier, tmp_path):
    """With model.lora the earlier weights are the frozen base (DPO and GRPO start so)."""
    cfg = load_config(None, [f"model.from_run={earlier}", "model.lora.rank=2", f"run.dir={tmp_path / 'next'}"])
    state = Trainer(prepare(cfg)).init()
    frozen = [v for v in jax.tree.leaves(state.params, is_leaf=lambda x: isinstance(x, Frozen))
              if isinstance(v, Frozen)]
    assert frozen  # the earlier run's weights, frozen


@pytest.mark.parametrize("extra, message", [
    (("model.d_model=64",), "trained 32; drop it"),
    (("model.from_hf=tests/fixtures/hf/llama",), "give one"),
])
def test_contradictions_are_one_sentence(earlier, tmp_path, capsys, extra, message):
    assert main(["train", "--no-progress", f"model.from_run={earlier}", *extra, f"run.dir={tmp_path}"]) == 2
    assert message in capsys.readouterr().err


def test_a_run_of_adapters_is_refused(tmp_path, capsys):
    code, _ = train_here(capsys, tmp_path / "lora", "model.lora.rank=2", "train.steps=2")
    assert code == 0
    assert main(["train", "--no-progress", f"model.from_run={tmp_path / 'lora'}", f"run.dir={tmp_path}/x"]) == 2
    assert "--merge" in capsys.readouterr().err


def test_a_folder_without_checkpoints_is_one_sentence(tmp_path, capsys):
    assert main(["train", "--no-progress", f"model.from_run={tmp_path}", f"run.dir={tmp_path}/x"]) == 2
    assert "holds no complete checkpoint" in capsys.readouterr().err
