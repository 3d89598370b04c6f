"""The two sides of benchmarks/peer_maxtext.py, one training run at a time.

Here: the shape both sides train and the layouts (each mesh spelled for jaxpar and for MaxText);
MaxText's virtual environment, created once in a cache folder and reused; each side's command
line; and the tokens/s of one run, read from jaxpar's metrics.jsonl or from MaxText's log.
peer_maxtext.py runs these in rounds and reports them (table, chart, JSON line); its docstring
says what is measured and how.

Standard library only, like common.py: jaxpar and MaxText run as subprocesses, so this runs on any
Python, jaxpar or not.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
MAXTEXT_REQUIREMENT = "maxtext[tpu]==0.2.5"
DEFAULT_CACHE = Path.home() / ".cache" / "jaxpar" / "maxtext-0.2.5"
DEVICES = 8

# The shape both sides train (see peer_maxtext.py's docstring for the MLP equivalence).
VOCAB, D_MODEL, HEADS, LAYERS, SEQ, BATCH = 32000, 256, 4, 4, 256, 8
JAXPAR_D_FF, MAXTEXT_MLP_DIM = 1536, 1024


@dataclass(frozen=True)
class Layout:
    """One mesh, spelled for both sides."""

    name: str
    title: str
    jaxpar: dict
    maxtext: dict
    heads: int = HEADS  # attention heads of D_MODEL // heads each

    @property
    def head_dim(self) -> int:
        return D_MODEL // self.heads


def _maxtext_mesh(fsdp=1, tensor=1, data=1, pipeline=1, microbatches=None) -> dict:
    mesh = {"ici_fsdp_parallelism": fsdp, "ici_tensor_parallelism": tensor,
            "ici_data_parallelism": data, "ici_pipeline_parallelism": pipeline}
    if microbatches:
        mesh["num_pipeline_microbatches"] = microbatches
    return mesh


LAYOUTS = {layout.name: layout for layout in (
    Layout("fsdp8", "fsdp 8", {"parallel.zero": 3, "mesh.data": 8},
           _maxtext_mesh(fsdp=8)),
    Layout("fsdp4_tp2", "fsdp 4 x tensor 2", {"parallel.zero": 3, "mesh.data": 4, "mesh.tensor": 2},
           _maxtext_mesh(fsdp=4, tensor=2)),
    Layout("data8", "data 8", {"parallel.zero": 0, "mesh.data": 8},
           _maxtext_mesh(data=8)),
    # MaxText's pipeline needs each microbatch to divide by the fsdp size: 8 / 2 = 4 rows over fsdp 4.
    Layout("fsdp4_pp2", "fsdp 4 x pipeline 2 (gpipe, 2 microbatches)",
           {"parallel.zero": 3, "mesh.data": 4, "mesh.stage": 2,
            "parallel.pipeline.schedule": "gpipe", "parallel.pipeline.microbatches": 2},
           _maxtext_mesh(fsdp=4, pipeline=2, microbatches=2)),
    # Heads cannot be split across more tensor shards than there are (both sides refuse 4 heads
    # over 8), so this layout alone has 8 heads of 32: the same parameters and FLOPs.
    Layout("tp8", "tensor 8 (8 heads of 32)", {"parallel.zero": 0, "mesh.data": 1, "mesh.tensor": 8},
           _maxtext_mesh(tensor=8), heads=8),
)}


class BenchFailed(Exception):
    """One side failed on one layout; the message is one line."""


# ---------------------------------------------------------------- the MaxText environment

def _runs_312(python: str) -> bool:
    """Whether `python` really runs (a pyenv shim may not) and is 3.12 or newer."""
    try:
        done = subprocess.run([python, "-c", "import sys; sys.exit(sys.version_info < (3, 12))"],
                              capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def find_python(explicit: str | None) -> str:
    """A Python 3.12+ interpreter for MaxText's environment, found the way run.sh finds one.

    3.12 comes first: maxtext[tpu] pulls pytype 2024.10.11, which has wheels up to cp312 only and
    is compiled from source (a C++ toolchain, minutes) on 3.13.
    """
    if explicit:
        if not _runs_312(explicit):
            raise SystemExit(f"peer_maxtext: --python {explicit} does not run as Python 3.12 or newer.")
        return explicit
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates = [sys.executable] if sys.version_info[:2] == (3, 12) else []
    candidates += ["python3.12", *sorted(str(p) for p in pyenv.glob("3.12*/bin/python3"))]
    candidates += [sys.executable] if sys.version_info >= (3, 12) else []
    candidates += ["python3.13", "python3", "python"]
    candidates += sorted(str(p) for p in pyenv.glob("3.1[3-9]*/bin/python3"))
    candidates += sorted(str(p) for d in ("/usr/local/bin", "/usr/bin") for p in Path(d).glob("python3.1[2-9]"))
    for candidate in candidates:
        if _runs_312(candidate):
            return candidate
    raise SystemExit("peer_maxtext: MaxText needs Python 3.12 or newer and none was found on PATH or in "
                     "pyenv's versions; pass --python /path/to/python3.12.")


def _venv_python(cache: Path) -> Path:
    return cache / "venv" / "bin" / "python"


def ensure_maxtext(cache: Path, python: str | None) -> Path:
    """The MaxText environment's interpreter, creating the environment and installing MaxText on first use."""
    stamp, venv_python = cache / "installed", _venv_python(cache)
    if stamp.is_file() and stamp.read_text().strip() == MAXTEXT_REQUIREMENT and venv_python.is_file():
        return venv_python
    base = find_python(python)
    cache.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    say(f"peer_maxtext: creating {cache / 'venv'} with {base} and installing {MAXTEXT_REQUIREMENT} "
         f"(about 10 minutes and 2.8 GB, once)")
    _check_call([base, "-m", "venv", "--clear", str(cache / "venv")], "creating the virtual environment")
    _check_call([str(venv_python), "-m", "pip", "install", "--disable-pip-version-check", MAXTEXT_REQUIREMENT],
                f"pip install {MAXTEXT_REQUIREMENT}")
    stamp.write_text(MAXTEXT_REQUIREMENT + "\n")
    say(f"peer_maxtext: installed {MAXTEXT_REQUIREMENT} in {time.perf_counter() - started:.0f} s "
         f"({_size_gb(cache / 'venv'):.1f} GB)")
    return venv_python


def _check_call(command: list[str], what: str) -> None:
    """Run a setup command with its output shown; exit with one line if it fails."""
    if subprocess.run(command).returncode != 0:
        raise SystemExit(f"peer_maxtext: {what} failed (see the output above).")


def _size_gb(path: Path) -> float:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink()) / 1e9


def maxtext_base_yml(cache: Path) -> Path:
    """MaxText's configs/base.yml inside the installed package."""
    found = sorted((cache / "venv" / "lib").glob("python3*/site-packages/maxtext/configs/base.yml"))
    if not found:
        raise SystemExit(f"peer_maxtext: no maxtext/configs/base.yml under {cache / 'venv'}; delete "
                         f"{cache / 'installed'} to reinstall.")
    return found[0]


# ---------------------------------------------------------------- one run of each side

def _env() -> dict:
    """The environment both sides run in: 8 emulated CPU devices."""
    env = dict(os.environ)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={DEVICES}".strip()
    env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    return env


def _run(command: list[str], log: Path, timeout: float, cwd: Path | None = None) -> None:
    """Run a training subprocess with its output in `log`; raise BenchFailed with one line if it fails."""
    with log.open("w") as out:
        try:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=_env(), cwd=cwd,
                                  timeout=timeout)
        except subprocess.TimeoutExpired:
            raise BenchFailed(f"timed out after {timeout:.0f} s (log: {log})") from None
    if done.returncode != 0:
        raise BenchFailed(f"exit status {done.returncode}: {_last_error(log)} (log: {log})")


def _last_error(log: Path) -> str:
    """The most telling line of a failed run's output: the last exception line, else the last line."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Failed)\b.*:", line)]
    picked = (errors or lines or ["no output"])[-1]
    return picked if len(picked) <= 300 else picked[:297] + "..."


PRECISIONS = {"bf16": "bfloat16", "fp32": "float32"}  # jaxpar's train.precision -> MaxText's dtype


def jaxpar_model(layout: Layout) -> dict:
    """jaxpar's settings of the benchmark shape on `layout` (what model FLOPs depend on)."""
    return {"model.vocab_size": VOCAB, "model.d_model": D_MODEL, "model.n_heads": layout.heads,
            "model.n_layers": LAYERS, "model.d_ff": JAXPAR_D_FF, "model.seq_len": SEQ,
            "model.tie_embeddings": "false", "model.positions": "rope"}


def jaxpar_command(python: str, layout: Layout, steps: int, run_dir: Path, precision: str = "bf16") -> list[str]:
    """`jaxpar train` on the benchmark shape and `layout`, logging every step to run_dir/metrics.jsonl."""
    settings = {
        **jaxpar_model(layout), "mesh.expert": 1, "mesh.tensor": 1, "mesh.stage": 1,
        "train.batch_size": BATCH, "train.precision": precision, "train.remat": "full",
        "train.steps": steps, "train.log_every": 1, "train.eval_batches": 1, "train.sample_tokens": 0,
        "checkpoint.every": 0, "run.dir": str(run_dir), **layout.jaxpar,
    }
    return [python, "-m", "jaxpar", "train", *(f"{k}={v}" for k, v in settings.items()), "--no-progress"]


def jaxpar_facts(python: str, layout: Layout) -> tuple[dict, float]:
    """(the machine's record, jaxpar.runtime.machine: its processor, native bf16 and matmul rates, measured now;
    the model FLOPs per token of the shape, jaxpar.train.model_flops), from jaxpar's interpreter."""
    facts = []
    for module, args in (("jaxpar.runtime.machine", []), ("jaxpar.train.model_flops",
                                                  [f"{k}={v}" for k, v in jaxpar_model(layout).items()])):
        done = subprocess.run([python, "-m", module, *args], capture_output=True, text=True, env=_env(), cwd=REPO,
                              timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"peer_maxtext: {python} -m {module} failed: {done.stderr.strip()[-300:]}")
        facts.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return facts[0], facts[1]["flops_per_token"]


def run_jaxpar(python: str, layout: Layout, steps: int, skip: int, work: Path, timeout: float,
               precision: str = "bf16") -> float:
    """Median tokens/s of one `jaxpar train` run, from step_time_s in metrics.jsonl."""
    run_dir = work / "run"
    _run(jaxpar_command(python, layout, steps, run_dir, precision), work / "jaxpar.log", timeout, cwd=REPO)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise BenchFailed(f"jaxpar wrote no {metrics}")
    try:
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        seconds = [row["step_time_s"] for row in sorted(rows, key=lambda r: r["step"])]
    except (json.JSONDecodeError, KeyError) as e:
        raise BenchFailed(f"{metrics} has no step_time_s per step ({type(e).__name__}: {e})") from None
    return _tokens_per_s(seconds, steps, skip, "jaxpar")


def maxtext_command(python: Path, base_yml: Path, layout: Layout, steps: int, out_dir: Path,
                    precision: str = "bf16") -> list[str]:
    """MaxText's pre-training entry point on the benchmark shape and `layout`, synthetic data, no checkpoints."""
    settings = {
        "run_name": "peer", "base_output_directory": str(out_dir),
        "hardware": "cpu", "skip_jax_distributed_system": True, "attention": "dot_product",
        "dataset_type": "synthetic", "enable_checkpointing": False,
        "enable_goodput_recording": False, "monitor_goodput": False,
        "base_emb_dim": D_MODEL, "base_num_query_heads": layout.heads, "base_num_kv_heads": layout.heads,
        "base_mlp_dim": MAXTEXT_MLP_DIM, "base_num_decoder_layers": LAYERS, "head_dim": layout.head_dim,
        "vocab_size": VOCAB, "max_target_length": SEQ, "per_device_batch_size": BATCH // DEVICES,
        "steps": steps, "dtype": PRECISIONS[precision], "remat_policy": "full", **layout.maxtext,
    }
    return [str(python), "-m", "maxtext.trainers.pre_train.train", str(base_yml),
            *(f"{k}={v}" for k, v in settings.items())]


STEP_LINE = re.compile(r"completed step: (\d+), seconds: ([0-9.eE+-]+)")


def run_maxtext(python: Path, base_yml: Path, layout: Layout, steps: int, skip: int, work: Path,
                timeout: float, precision: str = "bf16") -> float:
    """Median tokens/s of one MaxText run, from its `completed step: N, seconds: S` lines."""
    log = work / "maxtext.log"
    _run(maxtext_command(python, base_yml, layout, steps, work / "out", precision), log, timeout)
    per_step = {int(m[1]): float(m[2]) for m in STEP_LINE.finditer(log.read_text(errors="replace"))}
    return _tokens_per_s([per_step[s] for s in sorted(per_step)], steps, skip, "MaxText")


def _tokens_per_s(seconds: list[float], steps: int, skip: int, side: str) -> float:
    """Global batch * seq over the median step time of steps skip+1 .. steps."""
    if len(seconds) != steps:
        raise BenchFailed(f"{side} reported {len(seconds)} step times, expected {steps}")
    return BATCH * SEQ / statistics.median(seconds[skip:])


def say(message: str) -> None:
    """A progress or warning line on stderr."""
    print(message, file=sys.stderr, flush=True)
