"""The documents of `jaxpar tokenize`'s inputs, read as a stream (never a whole file at once).

`.txt`: a document per file, or per blank-line-separated block (split='paragraphs').
`.jsonl`: a document per line, the text in `field`.
`.parquet`: a document per row, the text in `column`, read in record batches with pyarrow.
Fine-tuning (`sft`): each JSONL line or Parquet row gives a (prompt, response) pair instead; for
chats (`chat`), a list of messages, each a {"role", "content"} mapping. Preference pairs
(`preference`): each record gives two documents, first the chosen then the rejected one: (prompt,
chosen) and (prompt, rejected) pairs, or with `chat` two message lists that differ only in their last
message, the assistant's response.

Each is yielded as (content, ends): content a str, a (prompt, response) pair of strs, or a list of
messages; ends whether the document ends with it (a long .txt file comes in pieces cut at line ends).
Every malformed input is a DataError naming the file and the line or row.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

from jaxpar.data.chat import ASSISTANT
from jaxpar.errors import DataError

CHUNK_BYTES = 1 << 22  # text read per piece
PARQUET_BATCH_ROWS = 1024
SUFFIXES = (".txt", ".jsonl", ".parquet")


@dataclasses.dataclass(frozen=True)
class DocumentSpec:
    """How inputs become documents: split ('file' or 'paragraphs', for .txt), field (.jsonl) or column
    (.parquet) of the text (of the messages, for chats), and for fine-tuning the prompt and response
    fields (columns), or chats; for preference pairs the prompt (not with chats), chosen and rejected
    fields."""

    split: str = "file"
    field: str | None = None
    sft: bool = False
    prompt: str | None = None
    response: str | None = None
    chat: bool = False
    preference: bool = False
    chosen: str | None = None
    rejected: str | None = None

    def names(self) -> tuple[str, ...]:
        """The fields (columns) each record must have."""
        if self.preference:
            return (self.chosen, self.rejected) if self.chat else (self.prompt, self.chosen, self.rejected)
        return (self.prompt, self.response) if self.sft else (self.field,)

    @property
    def masked(self) -> bool:
        """Whether the documents carry a loss mask (fine-tuning pairs, chats or preference pairs)."""
        return self.sft or self.chat or self.preference


def check_inputs(inputs: list[str], spec: DocumentSpec) -> None:
    """Every mistake in the inputs that can be seen before reading them, as one DataError sentence."""
    if spec.split not in ("file", "paragraphs"):
        raise DataError(f"--split must be 'file' or 'paragraphs', got {spec.split!r}.")
    _check_kind(spec)
    for name in inputs:
        path = Path(name)
        if not path.is_file():
            raise DataError(f"--input '{name}' is not a file.")
        if path.suffix not in SUFFIXES:
            raise DataError(f"--input '{name}' is not a .txt, .jsonl or .parquet file.")
        if spec.masked and path.suffix == ".txt":
            flag = ("--preference reads prompts with a chosen and a rejected response" if spec.preference
                    else "--sft reads prompt/response pairs" if spec.sft else "--chat reads message lists")
            raise DataError(f"{flag} from .jsonl or .parquet files, not '{name}'.")
        if path.suffix != ".txt" and not all(spec.names()):
            flag = "--field" if path.suffix == ".jsonl" else "--column"
            raise DataError(f"--input '{name}' needs {flag} NAME: which {flag[2:]} holds the text.")
        if path.suffix == ".parquet":
            _check_columns(path, spec.names())


def _check_kind(spec: DocumentSpec) -> None:
    """The fine-tuning flags: one kind of set, with the fields it reads."""
    if spec.sft and (spec.chat or spec.preference):
        raise DataError(f"--sft and {'--preference' if spec.preference else '--chat'} are two kinds of fine-tuning "
                        f"set; give one.")
    if spec.sft and not (spec.prompt and spec.response):
        raise DataError("--sft needs both --field-prompt and --field-response (the fields of the prompt and of the "
                        "response the loss is on).")
    if (spec.chosen or spec.rejected) and not spec.preference:
        raise DataError("--field-chosen and --field-rejected name the responses of --preference pairs; add "
                        "--preference.")
    if spec.preference and spec.response:
        raise DataError("--preference reads two responses, --field-chosen and --field-rejected, not --field-response.")
    if spec.preference and spec.chat and spec.prompt:
        raise DataError("--preference --chat takes the prompt from the conversations themselves (every message "
                        "before the last), so drop --field-prompt.")
    if spec.preference and not all(spec.names()):
        raise DataError("--preference needs --field-prompt, --field-chosen and --field-rejected (the fields of the "
                        "prompt and of the chosen and rejected responses).")


def _check_columns(path: Path, names: tuple[str, ...]) -> None:
    import pyarrow
    import pyarrow.parquet as pq

    try:
        schema = pq.ParquetFile(path).schema_arrow
    except (OSError, pyarrow.ArrowException) as e:
        raise DataError(f"--input '{path}' is not a Parquet file pyarrow can read ({e}).") from None
    for name in names:
        if name not in schema.names:
            raise DataError(f"--input '{path}' has no column '{name}' (it has {', '.join(schema.names)}).")


def documents(path: Path, spec: DocumentSpec) -> Iterator[tuple[str | tuple[str, str], bool]]:
    """The documents of one input file, in order, as (content, ends) pieces."""
    if path.suffix == ".txt" and spec.split == "file":
        yield from _file_pieces(path)
        return
    reader = {".jsonl": _jsonl, ".parquet": _parquet}.get(path.suffix)
    for content in (reader(path, spec) if reader else _paragraphs(path)):
        if spec.preference:  # a record's two documents: the chosen one, then the rejected one
            yield from ((half, True) for half in content)
        else:
            yield content, True


def _file_pieces(path: Path) -> Iterator[tuple[str, bool]]:
    """A whole file as one document, in pieces of about CHUNK_BYTES cut at line ends."""
    with path.open("r", encoding="utf-8", errors="replace", newline="") as f:
        text = f.read(CHUNK_BYTES)
        while text:
            text += f.readline()  # finish the line, so no word is cut
            following = f.read(CHUNK_BYTES)
            yield text, not following
            text = following


def _paragraphs(path: Path) -> Iterator[str]:
    """Blocks of text separated by one or more blank lines."""
    block: list[str] = []
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.strip():
                block.append(line)
            elif block:
                yield "".join(block)
                block = []
    if block:
        yield "".join(block)


def _record(values: dict, spec: DocumentSpec, where: str):
    if spec.chat and not spec.preference:
        return _messages(values.get(spec.field), spec.field, where)
    for name in spec.names() if not spec.chat else ():
        if not isinstance(values.get(name), str):
            missing = name not in values
            raise DataError(f"{where} {'has no' if missing else 'has a non-text'} field '{name}'.")
    if spec.preference:
        return _pair(values, spec, where)
    return (values[spec.prompt], values[spec.response]) if spec.sft else values[spec.field]


def _pair(values: dict, spec: DocumentSpec, where: str) -> list:
    """A preference record's two documents, chosen then rejected: (prompt, response) pairs, or the two
    conversations, which must share every message but the last, the assistant's (non-empty) response."""
    if not spec.chat:
        _non_empty(values, spec, where)
        return [(values[spec.prompt], values[spec.chosen]), (values[spec.prompt], values[spec.rejected])]
    chats = {}
    for name in spec.names():
        if name not in values:
            raise DataError(f"{where} has no field '{name}'.")
        chats[name] = _messages(values[name], name, where)
        if chats[name][-1]["role"] != ASSISTANT:
            raise DataError(f"{where}: the last message of '{name}' is not the {ASSISTANT}'s, so '{name}' has no "
                            f"response.")
    _non_empty({name: chat[-1]["content"] for name, chat in chats.items()}, spec, where)
    if chats[spec.chosen][:-1] != chats[spec.rejected][:-1]:
        raise DataError(f"{where}: '{spec.chosen}' and '{spec.rejected}' differ before their last message; the two "
                        f"conversations of a pair share their prompt and differ only in the {ASSISTANT}'s response.")
    return [chats[spec.chosen], chats[spec.rejected]]


def _non_empty(responses: dict, spec: DocumentSpec, where: str) -> None:
    for name in (spec.chosen, spec.rejected):
        if not responses[name].strip():
            raise DataError(f"{where} has an empty '{name}' response.")


def _messages(messages, field: str, where: str) -> list[dict]:
    """A chat's messages, each {"role": str, "content": str}."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise DataError(f"{where}: field '{field}' is not a list of messages, each with a 'role' and a 'content' "
                        f"text.")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _jsonl(path: Path, spec: DocumentSpec) -> Iterator[str | tuple[str, str]]:
    with path.open("r", encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                values = json.loads(line)
            except json.JSONDecodeError:
                raise DataError(f"{path} line {number} is not JSON.") from None
            if not isinstance(values, dict):
                raise DataError(f"{path} line {number} is not a JSON object.")
            yield _record(values, spec, f"{path} line {number}")


def _parquet(path: Path, spec: DocumentSpec) -> Iterator[str | tuple[str, str]]:
    import pyarrow.parquet as pq

    names, row = list(dict.fromkeys(spec.names())), 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=names):
        columns = {name: batch.column(name).to_pylist() for name in names}
        for i in range(batch.num_rows):
            yield _record({name: columns[name][i] for name in names}, spec, f"{path} row {row}")
            row += 1
