"""`jaxpar generate RUN_DIR|HF_DIR --prompt TEXT`: what a trained or imported model says (and the
flags and end tokens `--prompts`, jaxpar.sampling.from_files, shares).

A run folder gives the weights of its newest checkpoint (or --step) and decodes with the
tokenizer it trained with; a Hugging Face folder gives its own weights and tokenizer. Either runs
on one device with a key/value cache (jaxpar.sampling.single), and stops at the checkpoint's
end-of-sequence ids.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from jaxpar.errors import UserError

MAX_TEMPERATURE = 100.0


def stop_ids(folder: Path | None) -> frozenset[int]:
    """The end-of-sequence ids a checkpoint names (config.json, generation_config.json), if any."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = folder / name if folder is not None else None
        if path is not None and path.is_file():
            try:
                eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
                continue  # the tokens still come; only the early stop is lost
            ids.update(e for e in (eos if isinstance(eos, list) else [eos]) if isinstance(e, int))
    return frozenset(ids)


def refuse_expert_choice(cfg) -> None:
    """One sentence for a model generation cannot run: expert_choice routing is not causal."""
    if cfg.model.moe.experts and cfg.model.moe.router == "expert_choice":
        raise UserError("expert_choice routing looks at the whole routing group, so the model is not causal and "
                        "cannot generate one token at a time.")


def check_flags(args) -> None:
    """One sentence for flags that do not go together or are out of range (before anything loads)."""
    if (args.prompt is None) == (args.prompts is None):
        raise UserError("give either --prompt TEXT or --prompts FILE.jsonl (with --out).")
    if args.prompts is not None and not args.out:
        raise UserError("--prompts needs --out FILE.jsonl, where the completions go.")
    if args.prompt is not None and (args.settings or args.top_k or args.top_p != 1):
        raise UserError("--top-k, --top-p and key=value overrides go with --prompts (batched generation).")
    _check_numbers(args.tokens, args.temperature)
    if not 0 < args.top_p <= 1:
        raise UserError(f"--top-p must be in (0, 1], got {args.top_p}.")
    if args.top_k < 0:
        raise UserError(f"--top-k must be 0 (the whole vocabulary) or more, got {args.top_k}.")


def _check_numbers(tokens: int, temperature: float) -> None:
    if tokens < 1:
        raise UserError(f"--tokens must be at least 1, got {tokens}.")
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise UserError(f"--temperature must be between 0 (greedy) and {MAX_TEMPERATURE:g}, got {temperature}.")


def generate(source: str, prompt: str, tokens: int, temperature: float = 0.0, seed: int = 0,
             step: int | None = None) -> dict:
    """Generate from the run or Hugging Face folder `source`; returns the text and how it was made."""
    import jax
    from flax import nnx

    from jaxpar.data.token_folder import TextCodec, tokenizer_folder
    from jaxpar.interop import hf
    from jaxpar.interop.saved_run import SavedRun
    from jaxpar.model.transformer import Transformer
    from jaxpar.sampling.single import generate_ids

    _check_numbers(tokens, temperature)
    folder = Path(source)
    if (folder / "config.json").is_file():
        model, cfg = hf.load(folder)
        graphdef, params = nnx.split(model)
        tokenizer, where = (folder if (folder / "tokenizer.json").is_file() else None), folder
    elif (folder / "checkpoints").is_dir():
        run = SavedRun(folder)
        try:
            step = run.step(step)
            cfg = run.config(step)
            params = run.params(step, cfg, jax.sharding.SingleDeviceSharding(jax.devices()[0]))
        finally:
            run.close()
        graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))))
        tokenizer = tokenizer_folder(cfg.data, cfg.model.from_hf)
        where = Path(cfg.model.from_hf) if cfg.model.from_hf else None
    else:
        raise UserError(f"{source} is neither a run folder (with checkpoints/) nor a Hugging Face checkpoint "
                        f"(with config.json).")
    refuse_expert_choice(cfg)
    codec = TextCodec(tokenizer)
    prompt_ids = codec.encode(prompt)
    if not prompt_ids:
        raise UserError("--prompt must not be empty.")
    if cfg.model.positions == "learned" and len(prompt_ids) + tokens > cfg.model.seq_len:
        raise UserError(f"the model has learned positions for {cfg.model.seq_len} tokens; the prompt's "
                        f"{len(prompt_ids)} plus --tokens {tokens} do not fit.")
    start = time.perf_counter()
    ids = generate_ids(graphdef, params, cfg.model, prompt_ids, tokens, temperature, seed, stop_ids(where))
    seconds = time.perf_counter() - start
    new = len(ids) - len(prompt_ids)
    return {"text": codec.decode(ids), "prompt_tokens": len(prompt_ids), "new_tokens": new,
            "tokens_per_s": new / seconds, "step": step}
