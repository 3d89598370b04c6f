"""Where a run's tokens come from, read from the data config: data.source, or data.mixture's folders
(parsed here, with no other import, so the config's checks and the token folders can use it)."""

from __future__ import annotations

import math

from jaxpar.errors import ConfigError


def parse_mixture(text: str) -> tuple[tuple[str, float], ...]:
    """'web:0.7,code:0.3' -> (('web', 0.7), ('code', 0.3)), the weights normalized to sum to 1;
    () for ''. Raises ConfigError for a malformed entry, a weight that is not a positive number, or a
    folder named twice."""
    if not text.strip():
        return ()
    entries = []
    for entry in text.split(","):
        folder, _, weight = entry.strip().rpartition(":")
        try:
            value = float(weight)
        except ValueError:
            value = None
        if not folder or value is None or not math.isfinite(value) or value <= 0:
            raise ConfigError(f"data.mixture entries are FOLDER:WEIGHT with a positive weight, got {entry.strip()!r}.")
        entries.append((folder, value))
    names = [folder for folder, _ in entries]
    if len(set(names)) != len(names):
        raise ConfigError(f"data.mixture names a folder twice: {text!r}.")
    total = sum(w for _, w in entries)
    return tuple((folder, w / total) for folder, w in entries)


def mixture_text(mapping: dict) -> str:
    """A mixture given as a mapping {FOLDER: WEIGHT} (a YAML preset's `mixture: {web: 0.7, code: 0.3}`) in
    the string form 'web:0.7,code:0.3', checked as that form is. Raises ConfigError."""
    entries = []
    for folder, weight in mapping.items():
        if isinstance(weight, bool) or not isinstance(weight, int | float) or "," in str(folder):
            hint = " (YAML wants a space after each colon)" if weight is None and ":" in str(folder) else ""
            raise ConfigError(f"data.mixture maps each folder to a positive weight, as {{web: 0.7, code: 0.3}} or "
                              f"'web:0.7,code:0.3', got {folder!r}: {weight!r}{hint}.")
        entries.append(f"{folder}:{weight!r}")
    text = ",".join(entries)
    parse_mixture(text)
    return text


def token_source(data) -> str:
    """The source whose tokenizer the run's ids are in: a mixture's first folder (all share one
    tokenizer), else data.source."""
    mixture = parse_mixture(data.mixture)
    return mixture[0][0] if mixture else data.source
