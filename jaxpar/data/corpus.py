"""Token sources: the built-in English corpus, text files (byte-level), uint16 token files and
tokenized folders (jaxpar.data.token_folder)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from jaxpar.errors import DataError

BYTE_VOCAB = 256


def builtin_topics() -> list[str]:
    """Python's own documentation topics (pydoc_data.topics), in name order: ~460 KB of English in
    about 90 documents, always installed."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


def builtin_text() -> str:
    """The built-in corpus as one text: its topics separated by blank lines."""
    return "\n\n".join(builtin_topics())


def _text_tokens(text: str) -> np.ndarray:
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def load_tokens(source: str, vocab_size: int) -> np.ndarray:
    """All tokens of a source as a 1-D array (memory-mapped for .bin files and tokenized folders)."""
    try:
        return _load_tokens(source, vocab_size)
    except OSError as e:  # a name too long, no permission, a device file, ...
        raise DataError(f"data.source {source!r} cannot be read ({e.strerror or type(e).__name__}).") from None


def _load_tokens(source: str, vocab_size: int) -> np.ndarray:
    from jaxpar.data.token_folder import is_token_folder, open_token_folder

    if is_token_folder(source):
        return open_token_folder(source, vocab_size)
    if source == "builtin" or not source.endswith(".bin"):
        if vocab_size < BYTE_VOCAB:
            raise DataError(f"text is tokenized as bytes, so model.vocab_size must be at least {BYTE_VOCAB}, "
                            f"got {vocab_size}.")
        return _text_tokens(builtin_text() if source == "builtin" else _read_text(Path(source)))
    path = Path(source)
    if not path.is_file():
        raise DataError(f"data.source '{source}' does not exist.")
    if path.stat().st_size % 2:
        raise DataError(f"data.source '{source}' has an odd byte count, so it is not a file of uint16 tokens.")
    if path.stat().st_size == 0:
        raise DataError(f"data.source '{source}' is empty.")
    tokens = np.memmap(path, dtype=np.uint16, mode="r")
    if tokens.size and int(tokens.max()) >= vocab_size:
        raise DataError(f"data.source '{source}' holds token {int(tokens.max())}, outside "
                        f"model.vocab_size={vocab_size}.")
    return tokens


def _read_text(path: Path) -> str:
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise DataError(f"data.source folder '{path}' contains no .txt files.")
        return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)
    if not path.is_file():
        raise DataError(f"data.source '{path}' does not exist.")
    return path.read_text(encoding="utf-8", errors="replace")


def split_tokens(tokens: np.ndarray, val_fraction: float, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Train and validation parts (validation is the tail); each must fit a full window."""
    n_val = int(len(tokens) * val_fraction)
    need = seq_len + 2
    if len(tokens) - n_val < need or n_val < need:
        raise DataError(f"the corpus has {len(tokens)} tokens, too few for windows of model.seq_len={seq_len} "
                        f"in both the train and validation parts (data.val_fraction={val_fraction} leaves "
                        f"{len(tokens) - n_val} and {n_val} tokens, and each part needs at least {need}).")
    return tokens[: len(tokens) - n_val], tokens[len(tokens) - n_val:]
