"""Where `jaxpar tokenize` does its work, and with how many processes.

The folder is filled under a hidden name beside --out (.NAME.partial), with a record of the job
(units/job.json: the inputs with their sizes and modification times, the settings, the tokenizer). A
rerun of the same job continues there, skipping the units that finished; a rerun of another job, or
after the inputs changed, starts again. Finished, the folder is renamed to --out. A user error
(a bad record, a compressed file cut short) removes it: there is nothing to continue.

Units are encoded in this process (workers=1) or by `workers` spawned processes, each with its own
copy of the tokenizer and its own thread (a pool of processes scales where one tokenizer's threads,
held up by Python's reading and parsing, do not).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from multiprocessing import get_context
from pathlib import Path

from tqdm import tqdm

from jaxpar.data.folders import write_atomically
from jaxpar.data.token_folder import COMPANION_FILES, META, TOKENIZER
from jaxpar.errors import DataError
from jaxpar.tokenize.unit_encoding import UNITS, UnitEncoder, unit_record
from jaxpar.tokenize.work_units import WorkUnit

JOB = "job.json"


class PartialFolder:
    """The hidden folder a run fills beside `out`, continued by a rerun of the same job (`key`)."""

    def __init__(self, out: Path, key: dict):
        self.out, self.key = out, key
        self.path = out.parent / f".{out.name}.partial"
        self.tokenizer: Path | None = None  # the tokenizer.json saved in it, once saved

    @contextlib.contextmanager
    def opened(self):
        """Yield the folder to fill, continuing an interrupted run of the same job; a DataError removes it."""
        self._prepare()
        try:
            yield self.path
        except DataError:
            shutil.rmtree(self.path, ignore_errors=True)
            raise

    def _prepare(self) -> None:
        job = self.path / UNITS / JOB
        if self.path.exists():
            try:
                same = json.loads(job.read_text()) == json.loads(json.dumps(self.key))
            except (OSError, json.JSONDecodeError):
                same = False
            if same:
                for leftover in (self.path / UNITS).glob("*.tmp"):
                    leftover.unlink()
                finished = len(list((self.path / UNITS).glob("[0-9]*.json")))
                print(f"tokenize: continuing the interrupted run in {self.path} ({finished} unit(s) done)",
                      file=sys.stderr)
                if (self.path / TOKENIZER).is_file():
                    self.tokenizer = self.path / TOKENIZER
                return
            print(f"tokenize: starting again: {self.path} holds an interrupted run of other inputs or settings",
                  file=sys.stderr)
            shutil.rmtree(self.path)
        (self.path / UNITS).mkdir(parents=True)
        write_atomically(job, json.dumps(self.key))

    def save_tokenizer(self, tokenizer, checkpoint: Path | None) -> None:
        """Save the tokenizer (and the settings files beside an applied one, for export) into the folder."""
        for companion in COMPANION_FILES:  # a checkpoint's tokenizer settings travel with it, for export
            if checkpoint is not None and (checkpoint / companion).is_file():
                shutil.copyfile(checkpoint / companion, self.path / companion)
        write_atomically(self.path / TOKENIZER, tokenizer.to_str(pretty=True))  # the bytes tokenizer.save writes
        self.tokenizer = self.path / TOKENIZER

    def done(self, unit: WorkUnit) -> bool:
        return unit_record(self.path, unit.index).is_file()

    def finish(self, meta: dict, keep_units: bool = False) -> dict:
        """Rename the finished folder to --out. keep_units: a --shard task's part, whose units' ends and records
        stay for --merge, with `meta` (its shard meta) written; else meta.json is already there."""
        if keep_units:
            (self.path / META).write_text(json.dumps(meta, indent=2) + "\n")
            (self.path / UNITS / JOB).unlink()
        else:
            shutil.rmtree(self.path / UNITS)
        if self.out.exists():
            self.out.rmdir()  # empty: checked before the run
        os.replace(self.path, self.out)
        return meta


class _Meter:
    """The progress bar: input bytes (MB/s) and tokens per second."""

    def __init__(self, bar: tqdm):
        self.bar, self.tokens, self.start = bar, 0, time.perf_counter()

    def add(self, size: int, tokens: int) -> None:
        self.tokens += tokens
        self.bar.update(size)
        rate = self.tokens / max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(f"{rate / 1e3:,.0f}k tokens/s", refresh=False)


def encode_units(encoder: UnitEncoder, units: list[WorkUnit], work: Path, partial: PartialFolder, workers: int,
                 progress: bool) -> None:
    """Encode the units not yet done into `work`, in this process or with `workers` processes."""
    todo = [u for u in units if not partial.done(u)]
    total = sum(u.end - u.begin for u in units)
    with tqdm(total=total, initial=total - sum(u.end - u.begin for u in todo), unit="B", unit_scale=True,
              desc="tokenize", disable=not progress, file=sys.stderr) as bar:
        meter = _Meter(bar)
        if workers == 1 or len(todo) <= 1:
            for unit in todo:
                _encode_here(encoder, unit, work, meter)
        else:
            _encode_in_pool(encoder, todo, work, workers, meter)


def _encode_here(encoder: UnitEncoder, unit: WorkUnit, work: Path, meter: _Meter) -> None:
    size, counted = unit.end - unit.begin, 0

    def step(text_bytes: int, tokens: int) -> None:
        nonlocal counted
        shown = min(text_bytes, size - counted)  # text is about as long as its file's bytes, never counted past
        counted += shown
        meter.add(shown, tokens)

    encoder.write(unit, work, step)
    meter.add(size - counted, 0)


_worker_encoder: UnitEncoder | None = None


def _start_worker(encoder: UnitEncoder) -> None:
    global _worker_encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread a process: the processes share the cores
    _worker_encoder = encoder


def _encode_unit(unit: WorkUnit, work: Path) -> int:
    return _worker_encoder.write(unit, work)["tokens"]


def _encode_in_pool(encoder: UnitEncoder, units: list[WorkUnit], work: Path, workers: int, meter: _Meter) -> None:
    with ProcessPoolExecutor(max_workers=min(workers, len(units)), mp_context=get_context("spawn"),
                             initializer=_start_worker, initargs=(encoder,)) as pool:
        futures = {pool.submit(_encode_unit, unit, work): unit for unit in units}
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                if future.exception() is not None:
                    for other in pending:
                        other.cancel()
                    raise future.exception()
                unit = futures[future]
                meter.add(unit.end - unit.begin, future.result())
