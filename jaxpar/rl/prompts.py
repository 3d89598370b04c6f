"""GRPO's prompts: a JSONL file of records with a `prompt` field (data.source=prompts.jsonl; the other
fields go to the reward), or a folder `jaxpar tokenize` wrote, each document a prompt (without the end
token tokenize closes it with).

Every prompt must leave room in a training row for rl.max_new_tokens: at most model.seq_len + 1 -
max_new_tokens tokens, checked for all of them before anything compiles. Each rollout takes the next
batch_size / group_size prompts of a shuffled order (a new shuffle each pass, from train.seed), so a
resumed run samples the prompts it would have.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import numpy as np

from jaxpar.config import Config
from jaxpar.data.documents import load_documents
from jaxpar.data.token_folder import TextCodec, is_token_folder, read_meta
from jaxpar.errors import DataError
from jaxpar.sampling.prompts import PROMPT_FIELD, read_prompts, shortened


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """records: each prompt's record (text and fields); ids: its tokens; seed: the shuffles'."""

    records: list[dict]
    ids: list[list[int]]
    seed: int

    @classmethod
    def load(cls, cfg: Config, codec: TextCodec) -> PromptSet:
        source = cfg.data.source
        if is_token_folder(source):
            docs = load_documents(source, cfg.model.vocab_size)
            starts = np.concatenate([[0], docs.ends[:-1]])
            end = read_meta(Path(source)).get("eod_id")  # a prompt goes on where a document would stop
            ids = [np.asarray(docs.tokens[s:e]).tolist() for s, e in zip(starts, docs.ends)]
            ids = [i[:-1] if i and i[-1] == end else i for i in ids]
            records = [{PROMPT_FIELD: codec.decode(i)} for i in ids]
        elif source.endswith(".jsonl"):
            records = read_prompts(source)
            ids = [codec.encode(r[PROMPT_FIELD]) for r in records]
        else:
            raise DataError(f"train.objective=grpo reads prompts from a .jsonl file of records with a "
                            f"{PROMPT_FIELD!r} field or a tokenized folder; data.source={source!r} is neither.")
        room = cfg.model.seq_len + 1 - cfg.rl.max_new_tokens
        for record, prompt in zip(records, ids):
            if not prompt or len(prompt) > room:
                raise DataError(f"the prompt {shortened(record[PROMPT_FIELD])} has {len(prompt)} tokens, but a row "
                                f"holds model.seq_len + 1 = {cfg.model.seq_len + 1} with rl.max_new_tokens="
                                f"{cfg.rl.max_new_tokens} of them for the completion (room for {room}).")
        return cls(records, ids, cfg.train.seed)

    def longest(self) -> int:
        return max(len(i) for i in self.ids)

    def take(self, rollout: int, count: int) -> list[int]:
        """The indices of rollout `rollout`'s `count` prompts: the next ones of the passes' shuffles."""
        n, picked = len(self.ids), []
        for position in range(rollout * count, (rollout + 1) * count):
            epoch, at = divmod(position, n)
            picked.append(int(_order(self.seed, epoch, n)[at]))
        return picked


@functools.lru_cache(maxsize=4)
def _order(seed: int, epoch: int, n: int) -> np.ndarray:
    """Pass `epoch`'s shuffle of n prompts."""
    return np.random.default_rng((seed, epoch)).permutation(n)
