"""Data: token sources and deterministic batch sampling."""

from jaxpar.data.corpus import DataError, builtin_text, load_tokens, split_tokens
from jaxpar.data.loader import BatchSampler

__all__ = ["BatchSampler", "DataError", "builtin_text", "load_tokens", "split_tokens"]
