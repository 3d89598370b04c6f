"""`jaxpar generate SOURCE --prompts prompts.jsonl --out completions.jsonl --batch B [key=value ...]`:
completions for a file of prompts, B at a time, on the mesh the overrides choose (as `train` does).

SOURCE is a run folder (the weights of its newest checkpoint, or --step, and the tokenizer it trained
with) or a Hugging Face checkpoint folder. The weights are read straight onto the layout's shardings;
the prompts run in batches of B rows through one compiled program (jaxpar.sampling.batched) whose
prompt slots are the file's longest prompt.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from flax import nnx
from tqdm import tqdm

from jaxpar.config import Config, apply_overrides, flatten_dict
from jaxpar.config.from_run import newest_step, saved_config
from jaxpar.config.mesh import resolve_mesh
from jaxpar.config.presets import load_config, parse_override
from jaxpar.config.rl import RLConfig
from jaxpar.data.token_folder import TextCodec, tokenizer_folder
from jaxpar.errors import UserError
from jaxpar.interop.hf_weights import load_params
from jaxpar.runtime.devices import setup_devices
from jaxpar.sampling.batched import BatchedGenerator, Shape
from jaxpar.sampling.choice import Sampling
from jaxpar.sampling.command import refuse_expert_choice, stop_ids
from jaxpar.sampling.prompts import PROMPT_FIELD, read_prompts, write_completions
from jaxpar.session import on_devices
from jaxpar.train.saved_run import SavedRun
from jaxpar.train.trainer import Trainer

# What a generation override may choose: where the model runs, not what it is.
LAYOUT_SECTIONS = ("mesh.", "parallel.", "run.devices", "train.precision")


@dataclasses.dataclass(frozen=True)
class Request:
    """What to generate: the prompts file, the output file, rows a batch, new tokens, and how to draw."""

    prompts: str
    out: str
    batch: int = 8
    tokens: int = 64
    sampling: Sampling = Sampling()
    step: int | None = None


def _layout_overrides(settings: list[str]) -> dict[str, str]:
    pairs = dict(map(parse_override, settings))
    for key in pairs:
        if not key.startswith(LAYOUT_SECTIONS):
            raise UserError(f"generate takes overrides of the layout ({', '.join(LAYOUT_SECTIONS)}); {key} is the "
                            f"checkpoint's own.")
    return pairs


def _source(source: str, step: int | None, overrides: dict[str, str]):
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


def _checked(cfg: Config, batch: int, tokens: int) -> Config:
    """The config for a generation of `batch` rows; one sentence for what cannot generate."""
    if batch < 1 or tokens < 1:
        raise UserError(f"--batch and --tokens must be at least 1, got {batch} and {tokens}.")
    if cfg.mesh.stage > 1 or cfg.mesh.context > 1:
        raise UserError("generation runs on meshes without stages or context parallelism; set mesh.stage=1 and "
                        "mesh.context=1.")
    refuse_expert_choice(cfg)
    # how the run trained is not how it generates: one batch of `batch` rows, no objective's settings
    train = dataclasses.replace(cfg.train, batch_size=batch, grad_accum=1, objective="sft")
    return dataclasses.replace(cfg, train=train, rl=RLConfig())


def generate_file(source: str, request: Request, settings: list[str] = (), progress: bool = True) -> dict:
    """Write request.out's completions of request.prompts; returns counts and speed."""
    records = read_prompts(request.prompts)
    cfg, saved, origin = _source(source, request.step, _layout_overrides(list(settings)))
    cfg = _checked(cfg, request.batch, request.tokens)
    tokenizer = origin if origin is not None and (origin / "tokenizer.json").is_file() else None
    codec = TextCodec(tokenizer_folder(cfg.data, str(tokenizer or "")))
    prompts = [codec.encode(r[PROMPT_FIELD]) for r in records]
    devices = setup_devices(cfg)
    sizes = resolve_mesh(cfg.mesh, len(devices))
    if request.batch % (sizes["data"] * sizes["expert"]):
        raise UserError(f"--batch {request.batch} must split evenly over the mesh's rows (mesh.data x mesh.expert "
                        f"= {sizes['data']} x {sizes['expert']}).")
    session = on_devices(cfg, devices)
    trainer = Trainer(session)
    params = _weights(trainer, saved)
    shape = Shape(request.batch, max(len(p) for p in prompts), request.tokens)
    generator = BatchedGenerator(trainer.graphdef, cfg.model, session.precision, shape, request.sampling,
                                 stop_ids(origin), trainer.layout)
    out, start, new = [], time.perf_counter(), 0
    with tqdm(total=len(records), unit="prompt", disable=not progress, desc="generate") as bar:
        for first in range(0, len(records), request.batch):
            chunk = range(first, min(first + request.batch, len(records)))
            completions = generator(params, [prompts[i] for i in chunk], list(chunk))
            for i, ids in zip(chunk, completions):
                stopped = bool(ids) and ids[-1] in generator.stop_ids
                out.append({**records[i], "completion": codec.decode(ids), "new_tokens": len(ids), "stopped": stopped})
                new += len(ids)
            bar.update(len(chunk))
    seconds = time.perf_counter() - start
    write_completions(request.out, out)
    return {"prompts": len(records), "new_tokens": new, "seconds": seconds, "tokens_per_s": new / seconds,
            "layout": session.mesh_name(), "out": request.out}


def _weights(trainer: Trainer, saved) -> nnx.State:
    """The weights on the layout's shardings: a run's checkpoint, or model.from_hf's files."""
    if saved is None:
        return load_params(trainer.session.hf_checkpoint, trainer.cfg.model, trainer.param_shardings)[0]
    folder, step = saved
    run = SavedRun(folder)
    try:
        return run.params(step, trainer.cfg, trainer.param_shardings)
    finally:
        run.close()
