"""The code's shape, checked as code: no import cycles, small modules and functions, and one place
for each decision (the precision policy, ZeRO's capabilities)."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "jaxpar"
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, known: dict) -> set[str]:
    """The package's modules that `path` imports anywhere (module level, inside functions, under
    TYPE_CHECKING): `from pkg import sub` names the submodule, `from mod import name` the module."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in known:
            subs = {f"{node.module}.{alias.name}" for alias in node.names} & known.keys()
            found.update(subs or {node.module})
            if len(subs) < len(node.names):  # names that are not submodules come from the module itself
                found.add(node.module)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    known = modules()
    graph = {name: imports(path, known) - {name} for name, path in known.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_modules_and_functions_stay_small(path):
    text = path.read_text()
    assert text.count("\n") <= MAX_MODULE_LINES
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert long == []


def sources_outside(*allowed: str):
    for path in sorted(PACKAGE.rglob("*.py")):
        if str(path.relative_to(PACKAGE)) not in allowed:
            yield path, path.read_text()


def test_only_the_precision_policy_compares_the_precision_with_a_string():
    compare = re.compile(r"precision\s*(==|!=|in|not in)\s*[\"'(\[]"
                         r"|[\"'](fp32|bf16|fp16)[\"']\s*(==|!=)\s*\S*precision")
    found = [f"{path.name}: {line.strip()}" for path, text in sources_outside("precision.py")
             for line in text.splitlines() if compare.search(line)]
    assert found == []


def test_only_the_layout_compares_the_zero_stage_with_a_number():
    compare = re.compile(r"zero\s*(==|!=|>=|<=|>|<|in|not in)\s*[\d(]|(stage)\s*(>=|<=|>|<)\s*\d")
    found = [f"{path.name}: {line.strip()}" for path, text in sources_outside("switches.py")
             for line in text.splitlines() if compare.search(line) and "zero" in line]
    assert found == []
