"""The training loop's numbers (train.*), gradient accumulation (train.grad_accum), rematerialization
of the layers' activations (train.remat), the optimizer (train.optimizer, and Muon's train.muon_weights),
and the logits and loss in chunks of the sequence (train.loss_chunks: which counts it may take, and the
one it takes when set to 0).

The automatic chunk count follows Liger-Kernel's fused linear cross-entropy: about V / D chunks, so
that one chunk's logits (V columns a token) are no larger than the hidden states they come from
(D a token), per tensor rank (the logits are split over `tensor` by vocabulary, the hidden states
are not). A chunk keeps at least MIN_CHUNK_TOKENS tokens per device: each chunk reads the whole
output weight, and a matmul of M rows does about M FLOPs per byte of a bf16 weight it reads, so
M = 512 keeps it above a GPU's FLOP-per-byte ratio (an H100: 989 TFLOP/s over 3.35 TB/s, ~300).
When the logits are no larger than the hidden states, the count is 1: chunks would save little.
"""

from __future__ import annotations

from jaxpar.config import Config
from jaxpar.config.objectives import objective_of
from jaxpar.features.data import routed_tokens_per_device
from jaxpar.features.feature import Checks, Switch, unless

SWITCHES = (
    Switch("train.grad_accum", unless(1, "grad_accum={value}"), reference=1, searched=True, with_local_sgd=False),
    Switch("train.remat", unless("none", "remat={value}"), reference="none", searched=True),
    Switch("train.optimizer", unless("adamw", "{value}")),
    Switch("train.loss_chunks", unless(1, "loss_chunks={value}"), reference=1),  # checked against the whole logits
)
MIN_CHUNK_TOKENS = 512


def checks(cfg: Config, sizes: dict[str, int]) -> Checks:
    t = cfg.train
    for key in ("steps", "batch_size", "grad_accum", "log_every", "eval_batches"):
        if getattr(t, key) <= 0:
            yield f"train.{key} must be positive, got {getattr(t, key)}."
    if t.eval_every < 0:
        yield f"train.eval_every must be 0 (at the end only) or positive, got {t.eval_every}."
    if t.sample_tokens < 0:
        yield f"train.sample_tokens must be 0 (no sample) or more, got {t.sample_tokens}."
    if t.lr <= 0 or t.warmup < 0 or t.clip_norm <= 0 or t.weight_decay < 0:
        yield "train.lr and train.clip_norm must be positive, train.warmup and train.weight_decay non-negative."
    if t.lr_schedule_steps < 0:
        yield f"train.lr_schedule_steps must be 0 (follow train.steps) or positive, got {t.lr_schedule_steps}."
    yield from _objective(cfg)
    yield from _muon(cfg)
    chunks, seq_len, split = t.loss_chunks, cfg.model.seq_len, sequence_split(cfg, sizes)
    if chunks < 0 or (chunks and not fits(chunks, seq_len, split)):
        tensor = f" into chunks divisible by mesh.tensor={split} (sequence parallelism)" if split > 1 else ""
        yield f"train.loss_chunks={chunks} must be 0 (automatic) or divide model.seq_len={seq_len}{tensor}."


def _objective(cfg: Config) -> Checks:
    """train.objective's settings; DPO's reference is the model with its adapters off (jaxpar.train.preference)."""
    t, objective = cfg.train, objective_of(cfg)
    if objective.reference_without_adapters and not cfg.model.lora.enabled:
        yield (f"train.objective={objective.name} takes its reference from the base model with the adapters off, so "
               "it needs model.lora.rank > 0 (a reference pass stored beside the tokens is not built yet).")
    if not objective.plain and t.preference.beta <= 0:
        yield f"train.preference.beta must be positive, got {t.preference.beta}."


def _muon(cfg: Config) -> Checks:
    """train.optimizer=muon's settings; which weights it may take is checked on the model's shapes, before
    compiling (jaxpar.train.muon.check_muon_weights)."""
    t = cfg.train
    if t.muon_weights != "all" and t.optimizer != "muon":
        yield f"train.muon_weights picks Muon's matrices, so it needs train.optimizer=muon (got {t.optimizer})."
    if not any(entry.strip() for entry in t.muon_weights.split(",")):
        yield "train.muon_weights names no weight; give all, or a comma list of weight names such as w_qkv,wo."
    if t.optimizer == "muon" and cfg.model.lora.enabled:
        yield ("train.optimizer=muon orthogonalises whole weight matrices, and model.lora trains low-rank adapters "
               "instead; use train.optimizer=adamw with model.lora.")


def fits(chunks: int, seq_len: int, sequence_split: int) -> bool:
    """Whether `chunks` strided chunks cut a sequence of seq_len evenly, each chunk splitting over
    the `sequence_split` ranks that hold parts of the sequence (sequence parallelism: mesh.tensor)."""
    return chunks >= 1 and seq_len % chunks == 0 and (seq_len // chunks) % sequence_split == 0


def sequence_split(cfg: Config, sizes: dict[str, int]) -> int:
    """How many ranks hold parts of one sequence: mesh.tensor under sequence parallelism, else 1."""
    return sizes["tensor"] if cfg.parallel.sequence else 1


def automatic_loss_chunks(cfg: Config, sizes: dict[str, int], tokens_per_device: int) -> int:
    """train.loss_chunks=0 for a config on a mesh of axis `sizes`: the fewest chunks that make one
    chunk's logits per device no larger than the hidden states, at most as many as leave
    MIN_CHUNK_TOKENS tokens per device in each chunk (tokens_per_device: of one microbatch), among
    the counts that fit the sequence."""
    m, split = cfg.model, sequence_split(cfg, sizes)
    wanted = -(-m.padded_vocab // (sizes["tensor"] * m.d_model))
    most = max(tokens_per_device // MIN_CHUNK_TOKENS, 1)
    usable = [c for c in range(1, min(most, m.seq_len) + 1) if fits(c, m.seq_len, split)] or [1]
    return next((c for c in usable if c >= wanted), usable[-1])


def derive(cfg: Config, sizes: dict[str, int]) -> Config:
    """train.loss_chunks=0 becomes automatic_loss_chunks' count for this mesh."""
    if cfg.train.loss_chunks:
        return cfg
    chunks = automatic_loss_chunks(cfg, sizes, routed_tokens_per_device(cfg, sizes))
    return cfg.replace(**{"train.loss_chunks": chunks})
