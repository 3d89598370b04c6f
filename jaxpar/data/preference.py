"""Preference data (`jaxpar tokenize --preference`): a folder whose documents come in pairs, document 2k
the chosen one (prompt + chosen response) and 2k + 1 its rejected partner (prompt + rejected
response); its meta.json says `"preference": true`.

Pairs stay whole: `data.packing=pack` places each pair as one unit, its two documents consecutive in
one row, chosen first (so within a row the chosen document has an even id and the rejected one the
next odd id); a pair longer than a row is left out, with a warning. The train/validation split falls
between pairs. Which data a train.objective needs is checked here, before anything is compiled.
Pure Python and NumPy (no jax).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from jaxpar.config.objectives import Objective
from jaxpar.config.sources import parse_mixture
from jaxpar.data.token_folder import is_token_folder, read_meta
from jaxpar.errors import DataError


def is_preference_folder(source: str) -> bool:
    """Whether `source` names a folder that `jaxpar tokenize --preference` wrote."""
    return is_token_folder(source) and read_meta(Path(source)).get("preference") is True


def data_sources(data) -> list[str]:
    """The folders (or 'builtin') a data config reads: data.mixture's, else data.source."""
    return [folder for folder, _ in parse_mixture(data.mixture)] or [data.source]


def is_preference_data(data) -> bool:
    """Whether the data config's rows are preference pairs (every source a preference folder)."""
    return all(is_preference_folder(source) for source in data_sources(data))


def check_preference_source(data, objective: Objective) -> None:
    """The data fit train.objective and data.packing: the objectives that train on pairs (dpo, simpo,
    orpo) need preference folders, the others none, and pairs need data.packing=pack; raises DataError."""
    sources = data_sources(data)
    pairs = [source for source in sources if is_preference_folder(source)]
    if objective.trains_pairs and len(pairs) < len(sources):
        plain = next(source for source in sources if source not in pairs)
        raise DataError(f"train.objective={objective.name} trains on preference pairs, and '{plain}' is not a folder "
                        f"that `jaxpar tokenize --preference` wrote.")
    if not objective.trains_pairs and pairs:
        raise DataError(f"'{pairs[0]}' holds preference pairs (chosen, then rejected), which train.objective="
                        f"{objective.name} would learn both of; train it with train.objective=dpo, simpo or orpo.")
    if pairs:
        check_pair_packing(pairs[0], data.packing)


def check_pair_packing(source: str, packing: str) -> None:
    """Preference pairs need data.packing=pack (concat would cut pairs, none mix their documents)."""
    if packing != "pack":
        raise DataError(f"'{source}' holds preference pairs, which need data.packing=pack to keep each pair whole "
                        f"in one row, not data.packing={packing}.")


def fitting_pairs(lengths: np.ndarray, width: int) -> np.ndarray:
    """The pairs k (documents 2k and 2k + 1) that fit a row of `width` tokens together, in order.
    Longer pairs are left out with a warning on stderr; a DataError when none fits."""
    lengths = np.asarray(lengths, np.int64)
    totals = lengths[0::2] + lengths[1::2]
    kept = np.flatnonzero(totals <= width)
    if len(kept) == 0:
        raise DataError(f"all {len(totals)} preference pairs are longer than a row of model.seq_len + 1 = {width} "
                        f"tokens (the shortest has {int(totals.min())}); raise model.seq_len or shorten the pairs.")
    if len(kept) < len(totals):
        print(f"jaxpar: warning: {len(totals) - len(kept)} of {len(totals)} preference pairs are longer than a row "
              f"of model.seq_len + 1 = {width} tokens and are left out (the longest has {int(totals.max())}).",
              file=sys.stderr)
    return kept
