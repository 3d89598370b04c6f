"""What `jaxpar generate --prompts` and `jaxpar eval` run: a run folder (the weights of its newest checkpoint,
or --step, and the tokenizer it trained with) or a Hugging Face checkpoint folder, its weights read straight
onto the shardings of the layout the key=value overrides choose (as `train` lays a model out)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from flax import nnx

from jaxpar.config import Config, apply_overrides, flatten_dict
from jaxpar.config.from_run import newest_step, saved_config
from jaxpar.config.mesh import resolve_mesh
from jaxpar.config.presets import load_config, parse_override
from jaxpar.config.rl import RLConfig
from jaxpar.data.token_folder import TOKENIZER, tokenizer_folder
from jaxpar.errors import UserError
from jaxpar.interop.hf_weights import load_params
from jaxpar.interop.saved_run import SavedRun
from jaxpar.laid_out.model import LaidOutModel
from jaxpar.runtime.devices import setup_devices
from jaxpar.sampling.command import refuse_expert_choice
from jaxpar.session import on_devices

# What an override may choose: where the model runs, not what it is.
LAYOUT_SECTIONS = ("mesh.", "parallel.", "run.devices", "train.precision")


@dataclasses.dataclass(frozen=True)
class LoadedModel:
    """A model on its layout (no train step is built), its weights (model order), the folder of its
    tokenizer (None: bytes), the folder naming its end tokens (a Hugging Face checkpoint's, or None) and the
    run's checkpoint step (None for a Hugging Face folder)."""

    model: LaidOutModel
    params: nnx.State
    tokenizer: Path | None
    origin: Path | None
    step: int | None


def layout_overrides(settings: list[str]) -> dict[str, str]:
    pairs = dict(map(parse_override, settings))
    for key in pairs:
        if not key.startswith(LAYOUT_SECTIONS):
            raise UserError(f"generate and eval take overrides of the layout ({', '.join(LAYOUT_SECTIONS)}); {key} "
                            f"is the checkpoint's own.")
    return pairs


def load_model(source: str, step: int | None, settings: list[str], batch: int, what: str,
               progress: bool = True) -> LoadedModel:
    """The model of `source` on the layout `settings` choose, for batches of `batch` rows; `what` (generation,
    evaluation) names the work in the one sentence for a layout it cannot run on; progress: a bar while a
    Hugging Face checkpoint's weights load."""
    cfg, saved, origin = _resolve(source, step, layout_overrides(list(settings)))
    cfg = _for_batches(cfg, batch, what)
    tokenizer = origin if origin is not None and (origin / TOKENIZER).is_file() else None
    devices = setup_devices(cfg)
    sizes = resolve_mesh(cfg.mesh, len(devices))
    if batch % (sizes["data"] * sizes["expert"]):
        raise UserError(f"--batch {batch} must split evenly over the mesh's rows (mesh.data x mesh.expert "
                        f"= {sizes['data']} x {sizes['expert']}).")
    model = LaidOutModel(on_devices(cfg, devices))
    folder = tokenizer_folder(cfg.data, str(tokenizer or ""))
    return LoadedModel(model, _weights(model, saved, progress), folder, origin, None if saved is None else saved[1])


def _resolve(source: str, step: int | None, overrides: dict[str, str]):
    """(config to run with, the run's folder and step or None, the folder naming the end tokens and
    tokenizer). Read without starting jax: the devices are set up from the config after."""
    folder = Path(source)
    if (folder / "config.json").is_file():
        cfg = load_config(None, {"model.from_hf": str(folder), **overrides})
        return cfg, None, folder
    if not (folder / "checkpoints").is_dir():
        raise UserError(f"{source} is neither a run folder (with checkpoints/) nor a Hugging Face checkpoint "
                        f"(with config.json).")
    if step is not None and not (folder / "checkpoints" / str(step)).is_dir():
        raise UserError(f"{source} has no checkpoint at step {step}.")
    step = newest_step(folder) if step is None else step
    cfg = apply_overrides(Config(), flatten_dict(saved_config(folder, step)))
    origin = Path(cfg.model.from_hf) if cfg.model.from_hf else None
    # the weights come from the checkpoint: the folder it started from need not be there any more
    return apply_overrides(cfg, {"model.from_hf": "", "model.from_run": "", **overrides}), (folder, step), origin


def _for_batches(cfg: Config, batch: int, what: str) -> Config:
    """The config for batches of `batch` rows; one sentence for a layout they cannot run on."""
    if batch < 1:
        raise UserError(f"--batch must be at least 1, got {batch}.")
    if cfg.mesh.stage > 1 or cfg.mesh.context > 1:
        raise UserError(f"{what} runs on meshes without stages or context parallelism; set mesh.stage=1 and "
                        f"mesh.context=1.")
    refuse_expert_choice(cfg)
    # how the run trained is not how it runs now: one batch of `batch` rows, no objective's settings
    train = dataclasses.replace(cfg.train, batch_size=batch, grad_accum=1, objective="sft")
    return dataclasses.replace(cfg, train=train, rl=RLConfig())


def _weights(model: LaidOutModel, saved, progress: bool) -> nnx.State:
    """The weights on the layout's shardings: a run's checkpoint, or model.from_hf's files."""
    if saved is None:
        return load_params(model.session.hf_checkpoint, model.cfg.model, model.param_shardings,
                           progress=progress)[0]
    folder, step = saved
    run = SavedRun(folder)
    try:
        return run.params(step, model.cfg, model.param_shardings)
    finally:
        run.close()
