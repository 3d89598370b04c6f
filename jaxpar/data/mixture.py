"""Weighted mixtures of tokenized folders (`data.mixture`, such as `web:0.7,code:0.3`).

Each row of step n's batch draws its source by weight and then its row within that source, all from
the generator seeded by (train.seed, n), so any step's batch is rebuilt from its index alone and a
resumed run continues exactly. Every source is cut into rows as data.packing says; the rows carry
their source's index (PackedRows.source_B), so the step reports each source's loss, and validation
measures each source on its own held-out documents.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from jaxpar.data.packed_rows import PackedRows
from jaxpar.data.token_folder import TOKENIZER, is_token_folder
from jaxpar.errors import DataError


def check_sources(mixture: tuple[tuple[str, float], ...]) -> None:
    """Every source is a tokenized folder, all with the same tokenizer; raises DataError."""
    digests = {}
    for folder, _ in mixture:
        if not is_token_folder(folder):
            raise DataError(f"data.mixture names '{folder}', which is not a folder `jaxpar tokenize` wrote.")
        digests[folder] = hashlib.sha256((Path(folder) / TOKENIZER).read_bytes()).hexdigest()
    if len(set(digests.values())) > 1:
        raise DataError(f"the folders of data.mixture were tokenized with different tokenizers "
                        f"({', '.join(digests)}); tokenize them all with one (--tokenizer).")


class MixtureSampler:
    """Rows drawn from several samplers by weight: a start is (source, that sampler's start)."""

    def __init__(self, samplers: list, mixture: tuple[tuple[str, float], ...], batch_size: int, seed: int):
        self.samplers, self.batch_size, self.seed = samplers, batch_size, seed
        self.names = [folder for folder, _ in mixture]
        self.weights = np.asarray([w for _, w in mixture])

    def starts(self, step: int) -> np.ndarray:
        """(batch_size, 2): each row's source and its start in that source."""
        rng = np.random.default_rng((self.seed, step))
        source_B = rng.choice(len(self.samplers), size=self.batch_size, p=self.weights)
        starts_B = np.zeros(self.batch_size, np.int64)
        for s, sampler in enumerate(self.samplers):
            starts_B[source_B == s] = sampler.draw(rng, int(np.sum(source_B == s)))
        return np.stack([source_B, starts_B], axis=1)

    def validation_starts(self, count: int) -> dict[str, np.ndarray]:
        """Each source's own fixed validation rows, by source name."""
        return {name: np.stack([np.full_like(starts, s), starts], axis=-1)
                for s, (name, sampler) in enumerate(zip(self.names, self.samplers))
                for starts in [sampler.fixed_starts(count)]}

    def windows(self, starts: np.ndarray) -> PackedRows:
        parts = {s: self.samplers[s].windows(starts[starts[:, 0] == s, 1]) for s in np.unique(starts[:, 0])}
        order = np.argsort(np.argsort(starts[:, 0], kind="stable"), kind="stable")  # back to the rows' order
        fields = ("tokens_BT", "segments_BT", "positions_BT", "mask_BT")
        joined = {f: np.concatenate([getattr(parts[s], f) for s in sorted(parts)])[order] for f in fields}
        return PackedRows(**joined, source_B=starts[:, 0].astype(np.int32), sources=len(self.samplers))

    def efficiency(self, starts: np.ndarray) -> float:
        return float(sum(self.samplers[s].efficiency(starts[starts[:, 0] == s, 1]) * np.sum(starts[:, 0] == s)
                         for s in np.unique(starts[:, 0])) / len(starts))

    def shares(self, starts: np.ndarray) -> dict[str, float]:
        """Each source's share of these rows."""
        return {name: float(np.mean(starts[:, 0] == s)) for s, name in enumerate(self.names)}


def mixture_samplers(mixture, data, model, train) -> tuple[MixtureSampler, MixtureSampler]:
    """(train, validation) mixtures over the (folder, weight) pairs, each folder cut as data.packing says."""
    from jaxpar.data.packing import packed_samplers

    check_sources(mixture)
    pairs = [packed_samplers(data, model, train, folder) for folder, _ in mixture]
    return tuple(MixtureSampler([p[i] for p in pairs], mixture, train.batch_size, train.seed) for i in range(2))
