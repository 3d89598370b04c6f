"""verify's power as a table: every fault of tests/fault_catalog.py, injected on the layout side, in every precision
where its code runs, and the check that caught it (or "not caught").

Usage:
    python benchmarks/verify_faults.py [--quick] [--faults NAME,NAME] [--precisions fp32,bf16]

--quick runs the catalog's quick faults in fp32 only (the quick tier of tests/test_verify_faults.py). Printed: a
header line (commit, date, CPU and whether it has AVX-512 BF16: a near-tie can flip with the CPU's arithmetic),
then a markdown table with a column per precision: the check that failed worst ("routing": a routing decision
flipped; for fp8, whose verify runs the layout in fp32 as well, "; own:" and the worst of the fp8 comparison's own
checks, "-" where only the fp32 pass failed), "not caught", "clean fails: CHECK" where the layout fails verify
without the fault as well (each layout is verified clean first, once per precision: a catch there would prove
nothing), or "-" where the fault's code does not run; then the total time.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

# before jax starts: 8 emulated CPU devices, as the tests have them (tests/conftest.py), and the tests' compile level
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0").strip()
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the catalog lives beside its test

from common import git_commit, markdown  # noqa: E402

PRECISIONS = ("fp32", "bf16", "fp8", "fp16")


def cpu_line() -> str:
    """The CPU's model name and whether it has native bf16 (avx512_bf16), from /proc/cpuinfo."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "cpu: unknown"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                 "unknown")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    return f"cpu: {model}, {os.cpu_count()} cores, avx512_bf16: {'yes' if 'avx512_bf16' in flags else 'no'}"


def named_faults(listed: str, known) -> tuple[list[str], str]:
    """The fault names of a comma list, and what is left over that names none. A name may hold a comma
    ('gradient x3, experts'): pieces are joined until they make a known name."""
    names, piece = [], ""
    for part in listed.split(","):
        piece = f"{piece},{part}" if piece else part
        if piece.strip() in known:
            names.append(piece.strip())
            piece = ""
    return names, piece


def _outcome(fault, precision: str, run_dir: Path) -> dict | str:
    """verify's result for (fault, precision), or the error's line where its layout fails to run."""
    from fault_catalog import run

    try:
        return run(fault, precision, run_dir)
    except Exception as error:  # noqa: BLE001 - a fault whose layout fails to run is reported, not fatal
        return f"error: {type(error).__name__}: {str(error).splitlines()[0][:80]}"


_clean_failures: dict = {}  # (layout, data, precision) -> None where the clean layout verifies, else its cell


def clean_failure(fault, precision: str, run_dir: Path) -> str | None:
    """None where the fault's layout verifies without the fault in `precision`, else what it gave: a fault
    "caught" on a layout that fails clean is no evidence, and the table says so ("clean fails: ...")."""
    from fault_catalog import first_check

    key = (fault.layout, fault.data, precision)
    if key not in _clean_failures:
        clean = dataclasses.replace(fault, name=f"{fault.name} (clean)", breaks=lambda original: original)
        result = _outcome(clean, precision, run_dir)
        _clean_failures[key] = (result if isinstance(result, str) else
                                None if result["ok"] else f"clean fails: {first_check(result)}")
    return _clean_failures[key]


def verdict(fault, precision: str, run_dir: Path) -> str:
    """The table's cell for one (fault, precision): the check that caught it, "not caught", "clean fails: ..."
    where the layout fails without the fault too, or the error."""
    from fault_catalog import caught, first_check

    failure = clean_failure(fault, precision, run_dir / "clean")
    if failure is not None:
        return failure
    result = _outcome(fault, precision, run_dir)
    if isinstance(result, str):
        return result
    if not caught(result):
        return "not caught"
    if "logic" not in result:
        return first_check(result)
    # fp8's verify: which of its two comparisons caught the fault (its fp32 pass's checks are named "fp32 ...")
    logic = f"{result['logic']['precision']} "
    own = next((failure["check"] for failure in result["failures"] if not failure["check"].startswith(logic)), "-")
    return f"{first_check(result)}; own: {own}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="only the quick faults, in fp32")
    parser.add_argument("--faults", default="", help="a comma list of fault names (default: all)")
    parser.add_argument("--precisions", default="", help="a comma list of precisions (default: each fault's)")
    args = parser.parse_args()
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="jaxpar-faults-xla-cache-"))
    import fault_catalog

    faults = fault_catalog.FAULTS
    if args.faults:
        names, unknown = named_faults(args.faults, fault_catalog.BY_NAME)
        if unknown:
            parser.error(f"no fault named {unknown!r}")
        faults = [fault_catalog.BY_NAME[name] for name in names]
    if args.quick:
        faults = [fault for fault in faults if fault.quick]
    wanted = tuple(args.precisions.split(",")) if args.precisions else PRECISIONS
    wanted = ("fp32",) if args.quick else wanted
    columns = [p for p in PRECISIONS if p in wanted and any(p in fault.precisions for fault in faults)]
    print(f"commit {git_commit()}, {datetime.datetime.now().isoformat(timespec='seconds')}, {cpu_line()}", flush=True)
    start, rows = time.perf_counter(), []
    with tempfile.TemporaryDirectory(prefix="jaxpar-faults-") as scratch:
        for i, fault in enumerate(faults):
            cells = []
            for precision in columns:
                if precision not in fault.precisions:
                    cells.append("-")
                    continue
                began = time.perf_counter()
                cells.append(verdict(fault, precision, Path(scratch) / f"{i}-{precision}"))
                print(f"  {fault.name} {precision}: {cells[-1]} ({time.perf_counter() - began:.0f} s)",
                      file=sys.stderr, flush=True)
            rows.append([fault.name, fault.area, " ".join(fault.layout), fault.what, *cells])
    print(markdown(["fault", "area", "layout", "what", *columns], rows))
    missed = sum(row.count("not caught") for row in rows)
    void = sum(cell.startswith("clean fails") for row in rows for cell in row)
    print(f"\n{len(faults)} faults, {missed} (fault, precision) cases not caught, {void} on a layout that fails "
          f"clean; "
          f"{time.perf_counter() - start:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
