"""`jaxpar tokenize`'s work, cut into units that workers, hosts and reruns share: the same units in the
same order whatever the number of workers or --shard tasks, so every way of running gives one result.

A plain .jsonl or .txt file (a document per file) is cut into byte ranges of UNIT_BYTES; a line
belongs to the range it starts in, so no line is cut. Every other input (compressed, Parquet, Arrow,
paragraph-split .txt) is one unit. Each unit yields its documents (jaxpar.tokenize.document_readers says
what one is) and the SHA-256 of its bytes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterator

from jaxpar.errors import DataError
from jaxpar.tokenize.document_readers import DocumentSpec, record
from jaxpar.tokenize.input_files import InputFile, record_batches, text_lines

# 8 MB (--unit-mb's default): about 2 s of one core's tokenizing, fine enough to share among workers and
# to resume
UNIT_BYTES = 8_000_000
CHUNK_BYTES = 1 << 22  # a long .txt document's text is encoded in pieces of about this, cut at line ends


@dataclasses.dataclass(frozen=True)
class WorkUnit:
    index: int
    source: InputFile
    begin: int  # the unit's bytes of its file: [begin, end)
    end: int

    @property
    def ranged(self) -> bool:
        """Whether the unit is a byte range of a plain text file (its lines are read from the range)."""
        return self.source.kind in (".jsonl", ".txt") and (self.begin, self.end) != (0, self.source.size)


def plan_units(inputs: list[InputFile], spec: DocumentSpec, unit_bytes: int = UNIT_BYTES) -> list[WorkUnit]:
    """The inputs' units, in order: plain .jsonl and .txt files cut every `unit_bytes`, the others whole."""
    units: list[WorkUnit] = []
    for source in inputs:
        cuttable = source.kind == ".jsonl" or source.kind == ".txt" and spec.split == "file"
        starts = range(0, source.size, unit_bytes) if cuttable and source.size else [0]
        for begin in starts:
            end = min(begin + unit_bytes, source.size) if cuttable else source.size
            units.append(WorkUnit(len(units), source, begin, end))
    return units


def unit_digest(unit: WorkUnit) -> str:
    """SHA-256 of the unit's bytes of its file."""
    digest = hashlib.sha256()
    with open(unit.source.path, "rb") as f:
        f.seek(unit.begin)
        left = unit.end - unit.begin
        while left > 0 and (block := f.read(min(left, 1 << 22))):
            digest.update(block)
            left -= len(block)
    return digest.hexdigest()


def _range_lines(unit: WorkUnit) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of every line that starts in the unit's byte range."""
    with open(unit.source.path, "rb") as f:
        if unit.begin:
            f.seek(unit.begin - 1)
            if f.read(1) != b"\n":
                f.readline()  # the line under way began in the unit before
        offset = f.tell()
        while offset < unit.end and (line := f.readline()):
            yield offset, line
            offset += len(line)


def _lines(unit: WorkUnit) -> Iterator[tuple[str, bytes]]:
    """(where, line) of the unit's lines, `where` naming the line for errors."""
    if unit.ranged:
        for offset, line in _range_lines(unit):
            yield f"{unit.source.path} line starting at byte {offset}", line
    else:
        for number, line in enumerate(text_lines(unit.source), 1):
            yield f"{unit.source.path} line {number}", line


def unit_documents(unit: WorkUnit, spec: DocumentSpec) -> Iterator[tuple[object, bool]]:
    """The unit's documents, in order, as (content, ends) pieces."""
    kind = unit.source.kind
    if kind == ".txt":
        yield from (_file_pieces(unit) if spec.split == "file" else ((p, True) for p in _paragraphs(unit)))
        return
    records = _records(unit, spec) if kind in (".parquet", ".arrow") else _jsonl_records(unit, spec)
    for content in records:
        if spec.preference:  # a record's two documents: the chosen one, then the rejected one
            yield from ((half, True) for half in content)
        else:
            yield content, True


def _file_pieces(unit: WorkUnit) -> Iterator[tuple[str, bool]]:
    """A .txt file's text as one document, in pieces of about CHUNK_BYTES cut at line ends; the file's
    last unit ends the document (with an empty piece when its lines all began in the unit before)."""
    piece: list[bytes] = []
    size, yielded = 0, False
    for _, line in _lines(unit):
        piece.append(line)
        size += len(line)
        if size >= CHUNK_BYTES:
            yield b"".join(piece).decode("utf-8", errors="replace"), False
            piece, size, yielded = [], 0, True
    last = unit.end == unit.source.size
    if piece or last and (unit.begin or yielded):  # a document begun (here or before) ends with its file
        yield b"".join(piece).decode("utf-8", errors="replace"), last


def _paragraphs(unit: WorkUnit) -> Iterator[str]:
    """Blocks of text separated by one or more blank lines."""
    block: list[str] = []
    for _, raw in _lines(unit):
        line = raw.decode("utf-8", errors="replace")
        if line.strip():
            block.append(line)
        elif block:
            yield "".join(block)
            block = []
    if block:
        yield "".join(block)


def _jsonl_records(unit: WorkUnit, spec: DocumentSpec) -> Iterator[object]:
    for where, line in _lines(unit):
        if not line.strip():
            continue
        try:
            values = json.loads(line.decode("utf-8", errors="replace"))
        except json.JSONDecodeError:
            raise DataError(f"{where} is not JSON.") from None
        if not isinstance(values, dict):
            raise DataError(f"{where} is not a JSON object.")
        yield record(values, spec, where)


def _records(unit: WorkUnit, spec: DocumentSpec) -> Iterator[object]:
    names, row = list(dict.fromkeys(spec.names())), 0
    for columns in record_batches(unit.source, names):
        for i in range(len(columns[names[0]])):
            yield record({name: columns[name][i] for name in names}, spec, f"{unit.source.path} row {row}")
            row += 1
