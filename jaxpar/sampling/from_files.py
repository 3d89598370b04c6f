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

from tqdm import tqdm

from jaxpar.data.token_folder import TextCodec
from jaxpar.errors import UserError
from jaxpar.sampling.batched import BatchedGenerator, Shape
from jaxpar.sampling.choice import Sampling
from jaxpar.sampling.command import stop_ids
from jaxpar.sampling.model_source import load_model
from jaxpar.sampling.prompts import PROMPT_FIELD, read_prompts, write_completions


@dataclasses.dataclass(frozen=True)
class Request:
    """What to generate: the prompts file, the output file, rows a batch, new tokens, and how to draw."""

    prompts: str
    out: str
    batch: int = 8
    tokens: int = 64
    sampling: Sampling = Sampling()
    step: int | None = None


def generate_file(source: str, request: Request, settings: list[str] = (), progress: bool = True) -> dict:
    """Write request.out's completions of request.prompts; returns counts and speed."""
    records = read_prompts(request.prompts)
    if request.tokens < 1:
        raise UserError(f"--tokens must be at least 1, got {request.tokens}.")
    loaded = load_model(source, request.step, list(settings), request.batch, "generation", progress)
    model, params, origin = loaded.model, loaded.params, loaded.origin
    cfg, session = model.cfg, model.session
    codec = TextCodec(loaded.tokenizer)
    prompts = [codec.encode(r[PROMPT_FIELD]) for r in records]
    shape = Shape(request.batch, max(len(p) for p in prompts), request.tokens)
    generator = BatchedGenerator(model.graphdef, cfg.model, session.precision, shape, request.sampling,
                                 stop_ids(origin), model.layout)
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
