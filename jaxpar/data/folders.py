"""Output folders that appear whole or not at all."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path


def is_free(target: Path) -> bool:
    """Whether `target` can be written as a new folder: it does not exist, or is an empty folder."""
    return not target.exists() or (target.is_dir() and not any(target.iterdir()))


@contextlib.contextmanager
def new_folder(target: Path):
    """Yield a temporary folder beside `target` to fill; on success it is renamed to `target` (which must
    be free: see `is_free`), on any error or interruption it is removed. Either way no reader ever sees
    a half-written `target`."""
    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    work.chmod(0o777 & ~umask)  # mkdtemp's folder is private; the result is an ordinary folder
    try:
        yield work
        if target.exists():
            target.rmdir()  # empty (is_free)
        os.replace(work, target)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise


def write_atomically(path: Path, text: str) -> None:
    """Write `path` whole or not at all, even across a machine's crash (a temporary file beside it, on
    disk before it is renamed)."""
    temporary = path.with_name(path.name + ".tmp")
    write_durably(temporary, text.encode())
    os.replace(temporary, path)


def write_durably(path: Path, data) -> None:
    """Write `data` (bytes, or an array's buffer) to `path` and wait until it is on disk: a record written
    after it may then say that it is complete."""
    with open(path, "wb") as f:
        f.write(memoryview(data))
        f.flush()
        os.fsync(f.fileno())
