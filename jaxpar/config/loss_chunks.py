"""Which chunk counts `train.loss_chunks` may take on a sequence, and the one it takes when set
to 0 (automatic). Pure Python, like jaxpar.config: validation reads it before jax starts.

The automatic count follows Liger-Kernel's fused linear cross-entropy: about V / D chunks, so that
one chunk's logits (V columns a token) are no larger than the hidden states they come from (D a
token), per tensor rank (the logits are split over `tensor` by vocabulary, the hidden states
are not). A chunk keeps at least MIN_CHUNK_TOKENS tokens per device: each chunk reads the whole
output weight, and a matmul of M rows does about M FLOPs per byte of a bf16 weight it reads, so
M = 512 keeps it above a GPU's FLOP-per-byte ratio (an H100: 989 TFLOP/s over 3.35 TB/s, ~300).
When the logits are no larger than the hidden states, the count is 1: chunks would save little.
"""

from __future__ import annotations

MIN_CHUNK_TOKENS = 512


def fits(chunks: int, seq_len: int, sequence_split: int) -> bool:
    """Whether `chunks` strided chunks cut a sequence of seq_len evenly, each chunk splitting over
    the `sequence_split` ranks that hold parts of the sequence (sequence parallelism: mesh.tensor)."""
    return chunks >= 1 and seq_len % chunks == 0 and (seq_len // chunks) % sequence_split == 0


def sequence_split(cfg, sizes: dict[str, int]) -> int:
    """How many ranks hold parts of one sequence: mesh.tensor under sequence parallelism, else 1."""
    return sizes["tensor"] if cfg.parallel.sequence else 1


def automatic(cfg, sizes: dict[str, int], tokens_per_device: int) -> int:
    """train.loss_chunks=0 for a config on a mesh of axis `sizes`: the fewest chunks that make one
    chunk's logits per device no larger than the hidden states, at most as many as leave
    MIN_CHUNK_TOKENS tokens per device in each chunk (tokens_per_device: of one microbatch), among
    the counts that fit the sequence."""
    m, split = cfg.model, sequence_split(cfg, sizes)
    wanted = -(-m.padded_vocab // (sizes["tensor"] * m.d_model))
    most = max(tokens_per_device // MIN_CHUNK_TOKENS, 1)
    usable = [c for c in range(1, min(most, m.seq_len) + 1) if fits(c, m.seq_len, split)] or [1]
    return next((c for c in usable if c >= wanted), usable[-1])
