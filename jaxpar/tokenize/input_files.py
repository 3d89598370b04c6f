"""The files `jaxpar tokenize --input` names, in order, and how each is opened as a stream.

An input is a file, a folder (its files of the known kinds, sorted by name), a glob (its matches,
sorted), or a Hugging Face `datasets` folder written by `save_to_disk` (its Arrow files, in the order
its state.json lists them). Kinds: .txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet and .arrow.
Compressed files are read as streams; a file cut short ends in a DataError naming it.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import zlib
from collections.abc import Iterator
from pathlib import Path

import zstandard

from jaxpar.errors import DataError

KINDS = (".jsonl.gz", ".jsonl.zst", ".jsonl", ".txt", ".parquet", ".arrow")  # longest suffix first
RECORD_KINDS = (".jsonl.gz", ".jsonl.zst", ".jsonl", ".parquet", ".arrow")  # a record per line or row
DATASET_STATE = "state.json"  # what `datasets`' save_to_disk writes beside its Arrow files
ARROW_BATCH_ROWS = 1024


@dataclasses.dataclass(frozen=True)
class InputFile:
    path: str
    kind: str  # one of KINDS
    size: int


def kind_of(path: Path) -> str | None:
    name = path.name
    return next((kind for kind in KINDS if name.endswith(kind)), None)


def expand_inputs(names: list[str]) -> list[InputFile]:
    """Every input file, in the order given (a folder's and a glob's sorted); raises DataError for a name
    that is nothing, a glob that matches nothing, or a file of an unknown kind."""
    files: list[Path] = []
    for name in names:
        path = Path(name)
        if path.is_dir():
            files.extend(_folder_files(path))
        elif path.is_file():
            files.append(path)
        elif glob.has_magic(name):
            matches = sorted(Path(m) for m in glob.glob(name, recursive=True) if Path(m).is_file())
            if not matches:
                raise DataError(f"--input '{name}' matches no file.")
            files.extend(matches)
        else:
            raise DataError(f"--input '{name}' is not a file, a folder or a glob.")
    inputs = []
    for path in files:
        kind = kind_of(path)
        if kind is None or kind == ".arrow" and not (path.parent / DATASET_STATE).is_file():
            raise DataError(f"--input '{path}' is not a .txt, .jsonl, .jsonl.gz, .jsonl.zst or .parquet file, nor "
                            f"a folder `datasets` saved.")
        inputs.append(InputFile(str(path), kind, path.stat().st_size))
    return inputs


def _folder_files(folder: Path) -> list[Path]:
    """A `datasets` folder's Arrow files in its own order, else the folder's files of known kinds, sorted."""
    state = folder / DATASET_STATE
    if state.is_file():
        try:
            listed = [entry["filename"] for entry in json.loads(state.read_text(encoding="utf-8"))["_data_files"]]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            raise DataError(f"--input '{folder}': its {DATASET_STATE} does not list the Arrow files of a folder "
                            f"`datasets` saved.") from None
        missing = [name for name in listed if not (folder / name).is_file()]
        if missing or not listed:
            raise DataError(f"--input '{folder}': the Arrow file {missing[0] if missing else '(none)'} its "
                            f"{DATASET_STATE} lists is missing.")
        return [folder / name for name in listed]
    files = sorted(p for p in folder.iterdir() if p.is_file() and kind_of(p) not in (None, ".arrow"))
    if not files:
        raise DataError(f"--input '{folder}' holds no .txt, .jsonl, .jsonl.gz, .jsonl.zst or .parquet file.")
    return files


def text_lines(source: InputFile) -> Iterator[bytes]:
    """The lines of a .jsonl (compressed or not) or .txt file, as bytes, streamed."""
    try:
        if source.kind == ".jsonl.zst":
            yield from _lines_of(_zstd_blocks(source.path))
            return
        with gzip.open(source.path, "rb") if source.kind == ".jsonl.gz" else open(source.path, "rb") as f:
            yield from f
    except (EOFError, OSError, zlib.error, zstandard.ZstdError) as e:
        raise DataError(f"--input '{source.path}' cannot be read to its end: cut short or corrupt "
                        f"({type(e).__name__}).") from None


def _zstd_blocks(path: str) -> Iterator[bytes]:
    """A .zst file's decompressed bytes, frame after frame; EOFError when the last frame is cut short (the
    library's stream reader would just stop there)."""
    with open(path, "rb") as f:
        frame, fed = zstandard.ZstdDecompressor().decompressobj(), False
        while chunk := f.read(1 << 20):
            while chunk:
                yield frame.decompress(chunk)
                fed = True
                if not frame.eof:
                    break
                chunk = frame.unused_data
                frame, fed = zstandard.ZstdDecompressor().decompressobj(), False
        if fed:
            raise EOFError("the last zstd frame ends before its end")


def _lines_of(blocks: Iterator[bytes]) -> Iterator[bytes]:
    """Lines (with their ends) across blocks of bytes."""
    rest = b""
    for block in blocks:
        lines = (rest + block).split(b"\n")
        rest = lines.pop()
        yield from (line + b"\n" for line in lines)
    if rest:
        yield rest


def record_columns(source: InputFile) -> list[str]:
    """The column names of a .parquet or .arrow file (read from its schema)."""
    import pyarrow
    import pyarrow.parquet as pq

    try:
        if source.kind == ".parquet":
            return list(pq.ParquetFile(source.path).schema_arrow.names)
        with pyarrow.memory_map(source.path) as f:
            return list(pyarrow.ipc.open_stream(f).schema.names)
    except (OSError, pyarrow.ArrowException) as e:
        raise DataError(f"--input '{source.path}' is not a {source.kind[1:].capitalize()} file pyarrow can read "
                        f"({type(e).__name__}).") from None


def record_batches(source: InputFile, names: list[str]) -> Iterator[dict[str, list]]:
    """A .parquet or .arrow file's rows in batches, as {column: values}, streamed."""
    import pyarrow
    import pyarrow.parquet as pq

    try:
        if source.kind == ".parquet":
            for batch in pq.ParquetFile(source.path).iter_batches(batch_size=ARROW_BATCH_ROWS, columns=names):
                yield {name: batch.column(name).to_pylist() for name in names}
            return
        with pyarrow.memory_map(source.path) as f:
            for batch in pyarrow.ipc.open_stream(f):
                yield {name: batch.column(name).to_pylist() for name in names}
    except (OSError, pyarrow.ArrowException) as e:
        raise DataError(f"--input '{source.path}' cannot be read to its end: cut short or corrupt "
                        f"({type(e).__name__}).") from None
