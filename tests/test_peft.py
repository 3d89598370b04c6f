"""LoRA adapters in and out as the peft library stores them, against fixtures peft made
(tests/fixtures/hf/llama_lora: an adapter on every projection of the llama fixture, with peft's fp32
logits; make_fixtures.py's `lora`)."""

import json
from pathlib import Path

import numpy as np
import pytest

from jaxpar.cli import main
from jaxpar.interop import hf
from jaxpar.interop.safetensors import SafetensorsFile

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
BASE, ADAPTER = FIXTURES / "llama", FIXTURES / "llama_lora"
GOLDEN = np.load(ADAPTER / "golden.npz")
TOLERANCE = 1e-4


def _logits_error(model) -> float:
    logits = np.asarray(model(GOLDEN["tokens"]))[..., :GOLDEN["logits"].shape[-1]]
    return float(np.abs(logits - GOLDEN["logits"]).max())


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    file = SafetensorsFile(folder / "adapter_model.safetensors")
    return {name: file.read(name, tuple((0, d) for d in file.shape(name))) for name in file.entries}


@pytest.fixture(scope="module")
def adapted():
    return hf.load(BASE, adapter=ADAPTER)


def test_a_peft_adapter_gives_peft_logits(adapted):
    model, cfg = adapted
    assert cfg.model.lora.rank == 4 and cfg.model.lora.alpha == 8
    assert _logits_error(model) <= TOLERANCE
    base, _ = hf.load(BASE)
    assert _logits_error(base) > 0.1  # the adapter moves the logits: the check can fail


def test_written_adapter_is_the_one_peft_wrote(adapted, tmp_path):
    """peft loads the written files as its own: the same tensor names, shapes and values, and the same
    rank, alpha and target modules."""
    model, cfg = adapted
    hf.save_adapter(model, cfg, tmp_path / "out")
    ours, theirs = _tensors(tmp_path / "out"), _tensors(ADAPTER)
    assert ours.keys() == theirs.keys()
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name])
    written, made = (json.loads((d / "adapter_config.json").read_text()) for d in (tmp_path / "out", ADAPTER))
    for key in ("peft_type", "r", "lora_alpha", "target_modules", "bias", "fan_in_fan_out", "use_dora"):
        assert written[key] == made[key], key


def test_merged_weights_give_peft_logits(adapted, tmp_path):
    model, cfg = adapted
    hf.save(model, cfg, tmp_path / "merged")
    merged, merged_cfg = hf.load(tmp_path / "merged")
    assert merged_cfg.model.lora.rank == 0
    assert _logits_error(merged) <= TOLERANCE


def test_a_run_from_a_peft_adapter_exports_it_back(tmp_path, capsys):
    """model.lora.from_peft starts the adapters from peft's; one step at a learning rate of 1e-30 (the first step
    learns, so 0 would need a warmup; an update of 1e-30 is below every adapter weight's rounding) keeps them,
    and export-hf --adapter and --merge write them back."""
    run = tmp_path / "run"
    assert main(["train", "configs/default.yaml", f"model.from_hf={BASE}", f"model.lora.from_peft={ADAPTER}",
                 "model.lora.rank=4", "model.lora.alpha=8", "train.steps=1", "train.lr=1e-30",
                 "train.batch_size=8", "train.sample_tokens=0", "train.eval_batches=1", "mesh.data=4",
                 "mesh.tensor=2", f"run.dir={run}", "--no-progress"]) == 0
    assert main(["export-hf", str(run), "--out", str(tmp_path / "adapter"), "--adapter", "--no-progress"]) == 0
    ours, theirs = _tensors(tmp_path / "adapter"), _tensors(ADAPTER)
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name])
    assert main(["export-hf", str(run), "--out", str(tmp_path / "merged"), "--merge", "--dtype", "fp32",
                 "--no-progress"]) == 0
    assert _logits_error(hf.load(tmp_path / "merged")[0]) <= TOLERANCE
    capsys.readouterr()
    assert main(["export-hf", str(run), "--out", str(tmp_path / "plain")]) == 2
    assert "--adapter" in capsys.readouterr().err


@pytest.mark.parametrize("settings, words", [
    ([f"model.from_hf={FIXTURES / 'qwen2'}", "model.lora.rank=4", "model.lora.alpha=8"], "another base model"),
    ([f"model.from_hf={BASE}", "model.lora.rank=8", "model.lora.alpha=8"], "set them to the adapter's"),
    ([f"model.from_hf={BASE}", "model.lora.rank=4", "model.lora.alpha=8", "model.lora.targets=q,v"],
     "names q_proj, v_proj"),
])
def test_an_adapter_for_another_model_is_one_sentence(settings, words, tmp_path, capsys):
    code = main(["train", "configs/default.yaml", *settings, f"model.lora.from_peft={ADAPTER}", "train.steps=1",
                 "train.batch_size=8", f"run.dir={tmp_path}", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and words in err and "Traceback" not in err, err
