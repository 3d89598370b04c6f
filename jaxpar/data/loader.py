"""Deterministic batches: window starts drawn from a generator seeded by (seed, step).

Any step's batch can be rebuilt from its index alone, so a run resumes at the same
data position without saving an iterator.
"""

from __future__ import annotations

import numpy as np


class BatchSampler:
    """Random windows of seq_len+1 tokens from a token array, reproducible per step."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, seed: int):
        self.tokens, self.seq_len, self.batch_size, self.seed = tokens, seq_len, batch_size, seed
        width = seq_len + 1
        # a tokenized folder's shards are read through grain; an array is sliced
        self._read = (tokens.window_reader(width) if hasattr(tokens, "window_reader")
                      else lambda start: np.asarray(tokens[start:start + width]))

    def starts(self, step: int) -> np.ndarray:
        """Where the batch_size windows of optimizer step `step` begin (cheap: no tokens are read)."""
        return self.draw(np.random.default_rng((self.seed, step)), self.batch_size)

    def draw(self, rng: np.random.Generator, count: int) -> np.ndarray:
        """`count` window starts drawn with `rng` (a mixture draws each source's rows this way)."""
        return rng.integers(0, len(self.tokens) - self.seq_len - 1, size=count)

    def batch(self, step: int) -> np.ndarray:
        """The (batch_size, seq_len+1) int32 batch for optimizer step `step`."""
        return self.windows(self.starts(step))

    def windows(self, starts: np.ndarray) -> np.ndarray:
        """Stack token windows beginning at `starts`."""
        return np.stack([self._read(s) for s in starts]).astype(np.int32)

    def validation_starts(self, count: int) -> dict[str, np.ndarray]:
        """The validation batches' starts by source: one source, named '' (a mixture names each)."""
        return {"": self.fixed_starts(count)}

    def fixed_starts(self, count: int) -> np.ndarray:
        """(count, batch_size) starts of evenly spaced windows covering the array (for validation)."""
        last = len(self.tokens) - self.seq_len - 1
        return np.linspace(0, last, count * self.batch_size).astype(np.int64).reshape(count, self.batch_size)
