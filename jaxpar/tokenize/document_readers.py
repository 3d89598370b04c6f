"""What a document is in each of `jaxpar tokenize`'s inputs, and every check of the inputs that can be made
before reading them.

.txt: a document per file, or per blank-line-separated block (split='paragraphs').
.jsonl (also .jsonl.gz, .jsonl.zst): a document per line, the text in `field`.
.parquet, and the Arrow files of a `datasets` folder: a document per row, the text in `column`.
Fine-tuning (`sft`): each record gives a (prompt, response) pair instead; for chats (`chat`), a list
of messages, each a {"role", "content"} mapping. Preference pairs (`preference`): each record gives
two documents, first the chosen then the rejected one: (prompt, chosen) and (prompt, rejected) pairs,
or with `chat` two message lists that differ only in their last message, the assistant's response.

jaxpar.tokenize.work_units reads the files in pieces and yields each document as (content, ends):
content a str, a (prompt, response) pair of strs, or a list of messages; ends whether the document
ends with it (a long .txt file comes in pieces cut at line ends). Every malformed record is a
DataError naming the file and the line or row.
"""

from __future__ import annotations

import dataclasses

from jaxpar.errors import DataError
from jaxpar.tokenize.chat import ASSISTANT
from jaxpar.tokenize.input_files import RECORD_KINDS, InputFile, record_columns


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


def check_inputs(inputs: list[InputFile], spec: DocumentSpec) -> None:
    """Every mistake in the inputs that can be seen before reading them, as one DataError sentence."""
    if spec.split not in ("file", "paragraphs"):
        raise DataError(f"--split must be 'file' or 'paragraphs', got {spec.split!r}.")
    _check_kind(spec)
    for source in inputs:
        if spec.masked and source.kind == ".txt":
            flag = ("--preference reads prompts with a chosen and a rejected response" if spec.preference
                    else "--sft reads prompt/response pairs" if spec.sft else "--chat reads message lists")
            raise DataError(f"{flag} from .jsonl, .parquet or Arrow files, not '{source.path}'.")
        if source.kind in RECORD_KINDS and not all(spec.names()):
            flag = "--field" if source.kind.startswith(".jsonl") else "--column"
            raise DataError(f"--input '{source.path}' needs {flag} NAME: which {flag[2:]} holds the text.")
        if source.kind in (".parquet", ".arrow"):
            columns = record_columns(source)
            for name in dict.fromkeys(spec.names()):
                if name not in columns:
                    raise DataError(f"--input '{source.path}' has no column '{name}' (it has "
                                    f"{', '.join(columns)}).")


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


def record(values: dict, spec: DocumentSpec, where: str):
    """A record's content ({field: value}; `where` names it in errors): a text, a (prompt, response) pair,
    a chat's messages, or a preference record's two documents."""
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
