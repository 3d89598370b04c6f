"""Config fuzzing: whatever a user types, the CLI either accepts it or refuses it with one sentence.

Random overrides (real keys with wrong types, zero, negative, huge, non-finite, empty and random
values; unknown keys; random YAML presets) go through the CLI's own entry point, `jaxpar.cli.main`,
in-process, up to the point where it would start compiling: the config is loaded, devices are
set up, the config is validated, the data is loaded and split, and the mesh is built. There the
Trainer is replaced by a stub that records the accepted config. A refusal must be exit code 2 with
one line on stderr; any other exception fails the test. A few drawn refusals also run through the
real console script in a subprocess.
"""

import contextlib
import dataclasses
import io
import math
import os
import subprocess
import sys
import typing
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

import jaxpar.plan.step_plan  # noqa: F401  (imported before the Trainer is patched, see TRAINER_NAMES)
import jaxpar.train.loop  # noqa: F401
import jaxpar.verify.run  # noqa: F401
from jaxpar.cli import main
from jaxpar.config import Config, _leaf_types, all_keys

# This module's fixtures are built once, on one pytest-xdist worker
pytestmark = pytest.mark.xdist_group("test_config_fuzz")

settings.register_profile("config_fuzz", deadline=None, derandomize=True, database=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
# JAXPAR_FUZZ_EXAMPLES=5000 fuzzes longer (still deterministic); CI runs the default.
EXAMPLES = int(os.environ.get("JAXPAR_FUZZ_EXAMPLES", "200"))
FUZZ = settings(settings.get_profile("config_fuzz"), max_examples=EXAMPLES)
SUBPROCESS = settings(settings.get_profile("config_fuzz"), max_examples=3)

KEYS = all_keys()
TYPES = _leaf_types(Config)
TEXT_KEYS = [k for k in KEYS if TYPES[k] is str or typing.get_origin(TYPES[k]) is typing.Union]  # paths, hosts, devices


class Accepted(Exception):
    """Raised by the stub Trainer: the CLI got past every check and would now compile."""


class StubTrainer:
    def __init__(self, session, model=None, rules=None, trace_routing=False, trace_gradients=False):
        raise Accepted(session.cfg)


# Data files the fuzzer may point at, next to an empty working folder three levels down, where
# relative paths (and '.', '..') land.
SCRATCH_FILES = ["empty.txt", "short.txt", "odd.bin", "empty.bin", "folder", "folder/a.txt", "no_text", "tokens.bin"]
DATA = "../../../"


@pytest.fixture(scope="module")
def cwd(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fuzz")
    (root / "empty.txt").write_text("")
    (root / "short.txt").write_text("just a few words of text")
    (root / "odd.bin").write_bytes(b"abc")
    (root / "empty.bin").write_bytes(b"")
    (root / "folder").mkdir()
    (root / "folder" / "a.txt").write_text("hello world " * 2000)
    (root / "no_text").mkdir()
    np.arange(20_000, dtype=np.uint16).tofile(root / "tokens.bin")
    work = root / "cwd" / "inner" / "most"
    work.mkdir(parents=True)
    assert (work / DATA / "tokens.bin").is_file()
    return work


# Where train, verify and plan look the Trainer up (imported here first, so that the patch
# never becomes a module's own binding).
TRAINER_NAMES = ("jaxpar.train.trainer.Trainer", "jaxpar.train.loop.Trainer", "jaxpar.verify.run.Trainer",
                 "jaxpar.plan.step_plan.Trainer")


def run_cli(command: str, args: list[str], cwd: Path) -> tuple[int | None, str, object]:
    """`jaxpar <command> <args>` in-process up to compilation: (exit code or None if accepted, stderr, cfg)."""
    err = io.StringIO()
    with contextlib.ExitStack() as stack:
        stack.enter_context(contextlib.chdir(cwd))
        stack.enter_context(contextlib.redirect_stderr(err))
        for name in TRAINER_NAMES:
            stack.enter_context(mock.patch(name, StubTrainer))
        try:
            code = main([command, *args])
        except Accepted as accepted:
            return None, err.getvalue(), accepted.args[0]
    return code, err.getvalue(), None


def assert_one_sentence(err: str) -> None:
    lines = err.splitlines()
    assert len(lines) == 1, f"the refusal is not one line: {err!r}"
    line = lines[0]
    assert line.startswith("jaxpar: error: ") and line.endswith((".", "?")), line
    assert "Traceback" not in err


# ---- what the fuzzer draws -------------------------------------------------------------------

# Layouts that pass on 8 devices with the default model, so that the drawn overrides reach the
# cross-field, data and mesh checks rather than stopping at the first type error.
LAYOUTS = [
    [], ["mesh.data=8"], ["mesh.data=4", "mesh.tensor=2"], ["mesh.data=2", "mesh.tensor=2", "mesh.stage=2"],
    ["mesh.data=4", "mesh.stage=2", "parallel.pipeline.schedule=interleaved", "parallel.pipeline.virtual=2"],
    ["mesh.data=2", "mesh.expert=4", "model.moe.experts=4"],
    ["mesh.data=8", "model.moe.experts=8", "model.moe.router=topk", "model.moe.noise=false"],
    ["run.devices=1", "model.d_model=64", "model.n_layers=2", "model.seq_len=32", "train.batch_size=4"],
    ["run.devices=2", "parallel.zero=3"],
]
# Values of the right type that are zero, negative, huge, tiny or not finite.
BAD_NUMBERS = ["0", "-0", "-1", "-2", "-8", str(2 ** 31), str(2 ** 63), str(-2 ** 63 - 1), str(2 ** 64),
               str(10 ** 30), "9" * 400, "9" * 5000, "0.0", "-0.0", "-1e-3", "1e-320", "5e-324", "1e308", "1e400",
               "-1e400", "nan", "NaN", "-nan", "inf", "-inf", "Infinity", "1_000", "0x10", "0o7", "1e3", "1.5"]
# Values of the wrong type, odd YAML, and odd text.
WRONG_TYPES = ["", " ", "abc", "true", "false", "yes", "no", "on", "null", "~", "[1, 2]", "[]", "{a: 1}", "{}",
               "2020-01-01", "2020-13-45", "12:30:00", "!!float abc", "!!int x", "!!binary x", "&a [*a]", "'quoted'",
               "\"q\"", "[", "{", "- x", ": x", "a: b", "#comment", "%YAML", "\\", "=", "==", "a=b", "é", "\t",
               "\n", "a\nb", "x" * 5000, "auto", "builtin", "fp16", "topk", "interleaved", "data,stage"]
SMALL_INTS = ["1", "2", "3", "4", "6", "8", "16", "32", "64", "128", "256", "512", "-1"]
FRACTIONS = ["0.0", "0.001", "0.01", "0.05", "0.1", "0.5", "0.9", "0.99", "1.0", "1.25", "2.0", "3e-3"]


def plain_text(min_size=0, max_size=12):
    """Printable text without path separators or NUL (so it can also be a command-line argument)."""
    return st.text(st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/\\\x00"),
                   min_size=min_size, max_size=max_size)


# Paths: empty, odd, too long, missing, and every scratch file.
PATHS = ["builtin", "", " ", ".", "..", "missing.txt", "missing.bin", "dir.bin", "\x00", "a\x00b.txt",
         "x" * 5000 + ".txt", "x" * 300 + "/y.bin", "runs/x", "\n", "a\nb.txt"] + [DATA + f for f in SCRATCH_FILES]


def plausible_values(key: str) -> list[str]:
    """Values of the right type that a user might well give."""
    typ = TYPES[key]
    if typing.get_origin(typ) is typing.Literal:
        return [str(v) for v in typing.get_args(typ)]
    if typ is bool:
        return ["true", "false"]
    if typ is int:
        return SMALL_INTS
    if typ is float:
        return FRACTIONS
    if key == "data.source":
        return ["builtin", DATA + "tokens.bin", DATA + "folder", DATA + "folder/a.txt"]
    if key == "mesh.hosts":
        return ["data,stage", "data", "stage,data", "tensor", "data, expert"]
    if key == "run.devices":
        return ["auto", "1", "2", "4", "8"]
    return ["runs/x", "out"]


@st.composite
def plausible(draw) -> str:
    key = draw(st.sampled_from(KEYS))
    return f"{key}={draw(st.sampled_from(plausible_values(key)))}"


@st.composite
def poison(draw, printable: bool = False) -> str:
    """One argument that may well be wrong: a real key with a bad value, an unknown key, a stray word."""
    kind = draw(st.sampled_from(["bad number"] * 4 + ["wrong type"] * 2 + ["path"] * 2 + ["random"] * 2
                                + ["unknown", "near", "section", "stray"]))
    text = plain_text() if printable else st.text(max_size=12)
    key = draw(st.sampled_from(KEYS))
    if kind == "bad number":
        value = draw(st.one_of(st.sampled_from(BAD_NUMBERS), st.floats().map(repr),
                               st.integers(-10 ** 20, 10 ** 20).map(str)))
    elif kind == "wrong type":
        value = draw(st.sampled_from(WRONG_TYPES))
    elif kind == "path":
        key = draw(st.sampled_from(TEXT_KEYS))
        value = draw(st.sampled_from(PATHS))
    elif kind == "random":
        value = draw(text)
    elif kind == "unknown":
        key, value = draw(text), draw(st.sampled_from(SMALL_INTS + WRONG_TYPES))
    elif kind == "near":  # a real key with a typo
        at = draw(st.integers(0, len(key) - 1))
        key, value = f"{key[:at]}{draw(plain_text(1, 2))}{key[at + 1:]}", draw(st.sampled_from(SMALL_INTS))
    elif kind == "section":
        key = draw(st.sampled_from(["model", "model.moe", "train", "mesh", "parallel.pipeline", ""]))
        value = draw(st.sampled_from(SMALL_INTS + WRONG_TYPES))
    else:
        return draw(st.sampled_from(["nonsense", "=", "=5", "  =1", "x.yaml", "missing.yml", "a==b", "train.steps"]))
    assume(not key.startswith("-"))  # an option, which argparse answers with its usage
    if printable:
        assume("\x00" not in key + value)
    return f"{key}={value}"


@st.composite
def arguments(draw, printable: bool = False, poisons: tuple[int, int] = (0, 2)) -> list[str]:
    """A plausible layout, some plausible overrides and some poisoned ones, in a random order."""
    args = list(draw(st.sampled_from(LAYOUTS)))
    args += draw(st.lists(plausible(), max_size=3))
    args += draw(st.lists(poison(printable), min_size=poisons[0], max_size=poisons[1]))
    return draw(st.permutations(args))


def yaml_values():
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-10 ** 30, 10 ** 30), st.floats(),
                        st.text(max_size=8), st.sampled_from([0, -1, 1, 8, 2 ** 63, "", "auto", "2020-13-45"]))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.text(max_size=6), inner, max_size=3), max_leaves=6)


@st.composite
def preset(draw):
    """A YAML preset with typed (possibly wrong) values, unknown keys and odd sections."""
    data: dict = {}
    for key in draw(st.lists(st.sampled_from(KEYS + ["model.nope", "nope.key", "model"]), max_size=4)):
        section, _, name = key.partition(".")
        value = draw(st.one_of(yaml_values(), st.sampled_from(plausible_values(key) if key in TYPES else ["1"])
                               .map(lambda v: yaml.safe_load(v) if v.strip() else v)))
        if not name:
            data[section] = value
            continue
        node = data.setdefault(section, {})
        if not isinstance(node, dict):
            continue
        for part in name.split(".")[:-1]:
            node = node.setdefault(part, {}) if isinstance(node.get(part, {}), dict) else {}
        node[name.split(".")[-1]] = value
    if draw(st.integers(0, 4)) == 0:
        data["extends"] = draw(st.one_of(yaml_values(), st.sampled_from(["default.yaml", "missing.yaml", "", "."])))
    return data


# ---- the properties --------------------------------------------------------------------------

def check(command: str, args: list[str], cwd: Path) -> None:
    code, err, cfg = run_cli(command, args, cwd)
    if code is None:  # accepted: the config is what validation let through
        assert err == ""
        leaves = list(_leaves(cfg))
        assert all(math.isfinite(x) for x in leaves if isinstance(x, float)), cfg
        assert all(-2 ** 63 <= x < 2 ** 63 for x in leaves if isinstance(x, int)), cfg
        return
    assert code == 2, (code, err)
    assert_one_sentence(err)


def _leaves(obj):
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        yield from _leaves(value) if dataclasses.is_dataclass(value) else (value,)


# Each crash the fuzzer found, kept as an explicit example (all are refusals now).
FOUND = [
    ["model.vocab_size=2020-13-45"],  # YAML reads an impossible date: ValueError
    ["train.lr=!!float abc"],  # YAML's float tag on text: ValueError
    ["0\r0=1"],  # a control character in an unknown key split the message over two lines
    ["data.source=a\nb.txt"],  # a newline in a path split the message over two lines
    ["model.vocab_size=" + "9" * 400],  # accepted, then too large for any array
    ["train.lr=nan"], ["run.heartbeat_timeout=inf"], ["model.moe.capacity_factor=1e400"],  # accepted non-finite
    ["data.source=" + "x" * 5000 + ".txt"],  # OSError: file name too long
    [f"data.source={DATA}empty.bin"],  # numpy cannot memory-map an empty file: ValueError
    ["model.seq_len=100000", "data.val_fraction=5e-324"],  # the message divided by ~0: OverflowError
    ["data.source="],  # accepted, then read every .txt file under the working folder
]


@pytest.mark.fuzz
@FUZZ
@given(command=st.sampled_from(["plan", "train", "verify"]), args=arguments())
def test_random_overrides_are_accepted_or_refused_in_one_sentence(cwd, command, args):
    check(command, args, cwd)


@pytest.mark.parametrize("args", FOUND, ids=lambda args: repr(args)[:40])
def test_what_the_fuzzer_found_is_refused_in_one_sentence(cwd, args):
    code, err, _ = run_cli("train", args, cwd)  # train reads the data before compiling (plan reads none)
    assert code == 2
    assert_one_sentence(err)


@pytest.mark.fuzz
@settings(settings.get_profile("config_fuzz"), max_examples=max(60, EXAMPLES // 3))
@given(data=preset(), args=arguments(poisons=(0, 1)))
@example(data={"extends": 5}, args=[])  # TypeError: a path joined with an int
@example(data={"train": {"steps": 2 ** 64}}, args=[])
def test_random_presets_are_accepted_or_refused_in_one_sentence(cwd, data, args):
    path = cwd / "fuzz.yaml"
    path.write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    check("plan", [str(path), *args], cwd)


@pytest.mark.slow
@pytest.mark.fuzz
@SUBPROCESS
@given(args=arguments(printable=True, poisons=(1, 2)))
@example(args=["data.source=" + "x" * 5000 + ".txt"])
@example(args=["model.seq_len=100000", "data.val_fraction=5e-324"])
def test_drawn_refusals_through_the_console_script(cwd, args):
    """A few drawn refusals, run by the real `jaxpar` executable: exit 2, one line, no traceback,
    and the same sentence as in-process."""
    code, err, _ = run_cli("train", args, cwd)  # refused before training: train reads the data, plan none
    assume(code == 2)
    script = Path(sys.executable).with_name("jaxpar")
    proc = subprocess.run([str(script), "train", *args], capture_output=True, text=True, cwd=cwd, timeout=120,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert_one_sentence(proc.stderr)
    assert proc.stderr == err
