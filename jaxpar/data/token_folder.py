"""A tokenized folder (`jaxpar tokenize` writes it; `data.source=DIR` reads it): tokenizer.json, the
token ids as memory-mapped uint16 or uint32 shards, and meta.json (vocab size, dtype, token count,
the shards, the hash of the inputs).

Reading checks everything a shard's bytes can get wrong before anything is compiled: a missing
shard, a size that is not the listed token count in the listed dtype (a wrong dtype or a file cut
short), and a model vocabulary too small for the tokenizer. Windows are read through grain's
random-access `MapDataset` over the shards, so a window may span two shards, and each process
reads only the rows its devices hold (jaxpar.train.trainer.Trainer.put_windows).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from jaxpar.config.sources import token_source
from jaxpar.errors import DataError

META, TOKENIZER = "meta.json", "tokenizer.json"
# a Hugging Face tokenizer's settings beside its tokenizer.json (special tokens, chat template), kept with it
TOKENIZER_CONFIG = "tokenizer_config.json"
COMPANION_FILES = (TOKENIZER_CONFIG, "special_tokens_map.json")
EOD = "<|endoftext|>"  # the end-of-document token a tokenizer jaxpar trains reserves
EOS_NAMES = (EOD, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")  # an applied tokenizer's own, if any
FORMAT = "jaxpar-tokens-1"
SHARD_FORMAT = "jaxpar-token-shard-1"  # one --shard task's part of a folder (jaxpar.tokenize.assembly)
DTYPES = ("uint16", "uint32")


def is_token_folder(source: str) -> bool:
    """Whether data.source names a folder `jaxpar tokenize` wrote (one with a meta.json). A name the
    system cannot look up (too long, say) names none; reading it says why (corpus.load_tokens)."""
    try:
        return source != "builtin" and Path(source, META).is_file()
    except OSError:
        return False


def token_dtype(vocab_size: int) -> str:
    """The smallest dtype of DTYPES that holds ids below `vocab_size`."""
    return "uint16" if vocab_size <= 2 ** 16 else "uint32"


class ShardedTokens:
    """One token sequence over memory-mapped shards, or a contiguous part of it (a view: slicing
    reads nothing). np.asarray(view) reads it."""

    def __init__(self, shards: list[np.ndarray], start: int = 0, stop: int | None = None):
        self._shards = shards
        self._ends = np.cumsum([len(s) for s in shards])
        self._start, self._stop = start, int(self._ends[-1]) if stop is None else stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, part: slice) -> ShardedTokens:
        start, stop, step = part.indices(len(self))
        if step != 1:
            raise ValueError("a token view takes contiguous slices only")
        return ShardedTokens(self._shards, self._start + start, self._start + max(start, stop))

    def __array__(self, dtype=None, copy=None):
        pieces, begin = [], 0
        for shard, end in zip(self._shards, self._ends):
            lo, hi = max(self._start, begin), min(self._stop, int(end))
            if lo < hi:
                pieces.append(np.asarray(shard[lo - begin:hi - begin]))
            begin = int(end)
        whole = np.concatenate(pieces) if pieces else np.zeros(0, self._shards[0].dtype)
        return whole if dtype is None else whole.astype(dtype)

    def window_reader(self, width: int):
        """read(start) -> the `width` tokens from `start`, through a grain MapDataset."""
        import grain

        tokens = self
        starts = len(self) - width + 1

        class Windows:  # grain's random-access source protocol: __len__ and __getitem__
            def __len__(self):
                return starts

            def __getitem__(self, start):
                return np.asarray(tokens[start:start + width])

        dataset = grain.MapDataset.source(Windows())
        return lambda start: dataset[int(start)]


def read_meta(folder: Path) -> dict:
    try:
        meta = json.loads((folder / META).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"data.source '{folder}': its {META} cannot be read ({type(e).__name__}).") from None
    if isinstance(meta, dict) and meta.get("format") == SHARD_FORMAT:
        raise DataError(f"data.source '{folder}' is one part of a `jaxpar tokenize --shard` run; join the parts "
                        f"with `jaxpar tokenize --merge` and train on the result.")
    fields = {"format": str, "vocab_size": int, "dtype": str, "tokens": int, "shards": list}
    if (not isinstance(meta, dict) or any(not isinstance(meta.get(k), t) for k, t in fields.items())
            or meta["format"] != FORMAT):
        raise DataError(f"data.source '{folder}': {META} is not one `jaxpar tokenize` wrote "
                        f"(it needs format '{FORMAT}', vocab_size, dtype, tokens and shards).")
    return meta


def open_token_folder(source: str, vocab_size: int) -> ShardedTokens:
    """The folder's tokens, checked against its meta.json and model.vocab_size; raises DataError."""
    folder = Path(source)
    meta = read_meta(folder)
    if meta["dtype"] not in DTYPES:
        raise DataError(f"data.source '{folder}': {META} gives dtype {meta['dtype']!r}; it must be one of "
                        f"{', '.join(DTYPES)}.")
    if meta["vocab_size"] > vocab_size:
        raise DataError(f"data.source '{folder}' was tokenized with a vocabulary of {meta['vocab_size']}, more "
                        f"than model.vocab_size={vocab_size}; set model.vocab_size={meta['vocab_size']}.")
    if not (folder / TOKENIZER).is_file():
        raise DataError(f"data.source '{folder}' has no {TOKENIZER}.")
    itemsize = np.dtype(meta["dtype"]).itemsize
    shards = []
    for entry in meta["shards"]:
        path = folder / str(entry.get("file", "")) if isinstance(entry, dict) else None
        count = entry.get("tokens") if isinstance(entry, dict) else None
        if path is None or not isinstance(count, int):
            raise DataError(f"data.source '{folder}': {META} lists a shard without its file and token count.")
        if not path.is_file():
            raise DataError(f"data.source '{folder}': shard {path.name} listed in {META} is missing.")
        size = path.stat().st_size
        if size != count * itemsize:
            raise DataError(f"data.source '{folder}': shard {path.name} is {size} bytes, but {META} says {count} "
                            f"{meta['dtype']} tokens ({count * itemsize} bytes): a wrong dtype or a file cut short.")
        if count:
            shards.append(np.memmap(path, dtype=meta["dtype"], mode="r"))
    total = sum(len(s) for s in shards)
    if total != meta["tokens"] or not shards:
        raise DataError(f"data.source '{folder}': its shards hold {total} tokens, but {META} says {meta['tokens']}.")
    return ShardedTokens(shards)


def has_loss_mask(source: str) -> bool:
    """Whether data.source is a folder `jaxpar tokenize --sft`, `--chat` or `--preference` wrote (its tokens come
    with a loss mask)."""
    return is_token_folder(source) and read_meta(Path(source)).get("loss_mask") is True


def open_mask(source: str, meta: dict) -> ShardedTokens:
    """A fine-tuning folder's loss mask (uint8 per token, 1 where the loss counts it), shard by shard
    beside the tokens, each checked to hold exactly its shard's token count."""
    folder, shards = Path(source), []
    for entry in meta["shards"]:
        name = entry.get("mask") if isinstance(entry, dict) else None
        path = folder / str(name)
        if not isinstance(name, str) or not path.is_file() or path.stat().st_size != entry["tokens"]:
            raise DataError(f"data.source '{folder}': a loss-mask shard listed in {META} is missing or does not hold "
                            f"one byte per token of its shard.")
        if entry["tokens"]:
            shards.append(np.memmap(path, dtype=np.uint8, mode="r"))
    return ShardedTokens(shards)


def tokenizer_folder(data, from_hf: str) -> Path | None:
    """The folder holding the tokenizer of a model trained on the data config `data`: its tokenized
    folder (data.source, or a mixture's), else the Hugging Face checkpoint the model came from
    (model.from_hf=`from_hf`, when it has one); None for a model of bytes."""
    source = token_source(data)
    if is_token_folder(source):
        return Path(source)
    if from_hf and (Path(from_hf) / TOKENIZER).is_file():
        return Path(from_hf)
    return None


def tokenizer_json(path: str | Path) -> Path:
    """The tokenizer.json that `path` names: the file itself, or the one inside a folder (a Hugging
    Face checkpoint, a tokenized folder); raises DataError when there is none."""
    path = Path(path)
    if path.is_dir():
        if not (path / TOKENIZER).is_file():
            raise DataError(f"the folder '{path}' holds no {TOKENIZER}.")
        return path / TOKENIZER
    if not path.is_file():
        raise DataError(f"--tokenizer '{path}' is neither a {TOKENIZER} file nor a folder holding one.")
    return path


def tokenizer_settings(folder: Path | None) -> dict:
    """The tokenizer_config.json beside a tokenizer (special tokens, chat template), {} where there is none."""
    config = folder / TOKENIZER_CONFIG if folder is not None else None
    if config is None or not config.is_file():
        return {}
    try:
        settings = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise DataError(f"{config} is not JSON.") from None
    return settings if isinstance(settings, dict) else {}


def special_token(settings: dict, key: str) -> str | None:
    """A special token's text from tokenizer settings ('eos_token', ...): a string, or {'content': ...}."""
    value = settings.get(key)
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def tokenizer_vocab(path: Path) -> int:
    """The ids a tokenizer.json can produce: one more than its largest id, added tokens included."""
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
        vocab = spec["model"]["vocab"]
        ids = list(vocab.values()) if isinstance(vocab, dict) else range(len(vocab))
        added = [t["id"] for t in spec.get("added_tokens") or []]
        return max([*ids, *added], default=-1) + 1
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise DataError(f"{path} is not a tokenizer.json the tokenizers library wrote.") from None


def end_of_document(tokenizer, settings: dict) -> int | None:
    """The id that ends every document: a trained tokenizer's EOD, else the applied tokenizer's
    end-of-sequence token (its settings' eos_token, else a usual name), else None."""
    eos = special_token(settings, "eos_token")
    for name in ([eos] if eos else []) + list(EOS_NAMES):
        if tokenizer.token_to_id(name) is not None:
            return tokenizer.token_to_id(name)
    return None


def added_token_id(path: Path, content: str) -> int | None:
    """The id of the special token `content` among a tokenizer.json's added tokens, None without it."""
    try:
        added = json.loads(path.read_text(encoding="utf-8")).get("added_tokens") or []
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        raise DataError(f"{path} is not a tokenizer.json the tokenizers library wrote.") from None
    return next((t["id"] for t in added if isinstance(t, dict) and t.get("content") == content), None)


class TextCodec:
    """Text <-> token ids for prompts and samples: bytes (UTF-8) for text sources, else a tokenizer
    (a tokenizer.json, or a folder holding one). Encoding adds the tokenizer's own special tokens (a
    checkpoint's BOS), as its model saw at the start of every sequence."""

    def __init__(self, tokenizer: Path | None = None):
        self._tokenizer = None
        if tokenizer is not None:
            from tokenizers import Tokenizer

            self._tokenizer = Tokenizer.from_file(str(tokenizer_json(tokenizer)))

    def encode(self, text: str, special: bool = True) -> list[int]:
        """The ids of `text`; special=False leaves out the special tokens the tokenizer adds (a BOS)."""
        if self._tokenizer is None:
            return list(text.encode("utf-8"))
        return self._tokenizer.encode(text, add_special_tokens=special).ids

    def token_to_id(self, token: str) -> int | None:
        """The id of one token of the vocabulary (a special token's text), None for bytes or a token it lacks."""
        return None if self._tokenizer is None else self._tokenizer.token_to_id(token)

    def decode(self, ids: list[int], skip_special: bool = True) -> str:
        """The text of `ids`; skip_special=False keeps the special tokens' text (an end-of-sequence's)."""
        if self._tokenizer is None:
            return bytes(ids).decode("utf-8", errors="replace")
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special)
