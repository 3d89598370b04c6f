"""The code's shape, checked as code: no import cycles, short chains of module-level imports, a short
top level, small modules and functions, and one place for each decision (the precision policy,
ZeRO's capabilities)."""

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "jaxpar"
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 60
# 11 since the laid-out model (jaxpar.laid_out) became a floor between the session and train/: one more hop on
# the longest way up (plan -> train -> laid_out -> session -> features -> config).
MAX_IMPORT_CHAIN, MAX_TOP_LEVEL_MODULES = 11, 10


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    out = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, known: dict) -> set[str]:
    """The package's modules that `path` imports anywhere (module level, inside functions, under
    TYPE_CHECKING): `from pkg import sub` names the submodule, `from mod import name` the module."""
    return set().union(*(_named(node, known) for node in ast.walk(ast.parse(path.read_text()))))


def _named(node: ast.AST, known: dict) -> set[str]:
    """The package's modules an import statement names (see `imports`); none for other statements."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names if alias.name in known}
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in known:
        subs = {f"{node.module}.{alias.name}" for alias in node.names} & known.keys()
        return subs | ({node.module} if len(subs) < len(node.names) else set())
    return set()


def module_level_imports(path: Path, known: dict) -> set[str]:
    """The package's modules that importing `path` imports: its statements outside functions (in
    `if`, `try`, `with` and class bodies too), except those under `if TYPE_CHECKING`."""
    found = set()

    def visit(statements):
        for node in statements:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
                continue
            found.update(_named(node, known))
            for block in ("body", "orelse", "finalbody", "handlers"):
                visit(getattr(node, block, None) or [])

    visit(ast.parse(path.read_text()).body)
    return found


def longest_chain(graph: dict[str, set[str]]) -> tuple[str, ...]:
    """The longest path of an acyclic import graph, as the modules along it."""
    longest: dict[str, tuple[str, ...]] = {}

    def chain(v):
        if v not in longest:
            longest[v] = (v, *max((chain(w) for w in sorted(graph[v])), key=len, default=()))
        return longest[v]

    return max((chain(v) for v in sorted(graph)), key=len, default=())


def import_graph(package: Path) -> dict[str, set[str]]:
    known = modules(package)
    return {name: module_level_imports(path, known) - {name} for name, path in known.items()}


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


def test_module_level_import_chains_stay_short():
    chain = longest_chain(import_graph(PACKAGE))
    assert len(chain) <= MAX_IMPORT_CHAIN, " -> ".join(chain)


def test_the_chain_finder_sees_a_deep_chain_and_only_module_level_imports(tmp_path):
    package = tmp_path / "deep"
    (package / "inner").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "inner" / "__init__.py").write_text("")
    names = [f"deep.m{i}" for i in range(MAX_IMPORT_CHAIN)] + ["deep.inner.last"]
    for name, following in zip(names, names[1:] + [None]):
        lines = ["from typing import TYPE_CHECKING", "if TYPE_CHECKING:", "    import deep.m0",
                 "def later():", "    import deep.m0"]  # neither counts: both would close a cycle
        if following is not None:
            parent, _, leaf = following.rpartition(".")
            lines.insert(0, f"from {parent} import {leaf}" if name.endswith("m3") else f"import {following}")
        (tmp_path / (name.replace(".", "/") + ".py")).write_text("\n".join(lines) + "\n")
    chain = longest_chain(import_graph(package))
    assert chain == tuple(names) and len(chain) > MAX_IMPORT_CHAIN


# The modules that may import inside functions, each for a reason docs/code-layout.md gives ("Imports").
LAZY_IMPORTS = {
    # jax must start after the device flags: what the CLI, the launcher or the planner's workers reach first
    "cli.py", "config/precision.py", "plan/calibrate.py", "plan/compiled_cache.py", "runtime/machine.py",
    "plan/search.py", "runtime/devices.py", "runtime/distributed.py", "plan/replan.py", "session.py",
    "sampling/command.py", "train/model_flops.py",
    # a package only some commands need, paid for by those
    "charts.py", "plan/schedule_chart.py", "tokenize/chat.py", "data/corpus.py", "tokenize/input_files.py",
    "data/token_folder.py", "tokenize/folder.py", "train/tensorboard.py", "evals/in_loop.py", "train/wandb_writer.py",
    # mixtures import packing only when a mixture is read (at module level the chain grows by one)
    "data/mixture.py",
}


def test_imports_sit_at_the_top_except_where_docs_say_why():
    lazy = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        if any(isinstance(node, (ast.Import, ast.ImportFrom)) for fn in ast.walk(tree)
               if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) for node in ast.walk(fn)):
            lazy.add(str(path.relative_to(PACKAGE)))
    assert lazy <= LAZY_IMPORTS, sorted(lazy - LAZY_IMPORTS)
    assert all(f"`jaxpar/{name}`" in (PACKAGE.parent / "docs" / "code-layout.md").read_text() for name in LAZY_IMPORTS)


def test_the_top_level_stays_short():
    assert len(sorted(PACKAGE.glob("*.py"))) <= MAX_TOP_LEVEL_MODULES


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
    found = [f"{path.name}: {line.strip()}" for path, text in sources_outside("config/precision.py")
             for line in text.splitlines() if compare.search(line)]
    assert found == []


def test_only_the_layout_compares_the_zero_stage_with_a_number():
    compare = re.compile(r"zero\s*(==|!=|>=|<=|>|<|in|not in)\s*[\d(]|(stage)\s*(>=|<=|>|<)\s*\d")
    found = [f"{path.name}: {line.strip()}" for path, text in sources_outside("config/parallel.py")
             for line in text.splitlines() if compare.search(line) and "zero" in line]
    assert found == []


# train.objective compared with a name: `objective == "dpo"`, `objective in PAIRS`, `"grpo" == x`
OBJECTIVE_COMPARED = re.compile(r"objective(\.name)?\s*(==|!=|\bin\b|\bnot in\b)\s*[\"'(\[A-Z]"
                                r"|[\"'](sft|dpo|simpo|orpo|grpo)[\"']\s*(==|!=|\bin\b)")


def test_only_the_objectives_module_compares_the_objective_with_a_name():
    found = [f"{path.name}: {line.strip()}" for path, text in sources_outside("config/objectives.py")
             for line in text.splitlines() if OBJECTIVE_COMPARED.search(line)]
    assert found == []


def test_the_objective_check_sees_a_comparison():
    lines = ['if t.objective == "dpo":', "if objective not in PREFERENCE_OBJECTIVES:", 'if "grpo" == name:',
             "if cfg.train.objective != 'sft':", "if objective_of(cfg).samples:", "objective = training_objective(cfg)"]
    assert [bool(OBJECTIVE_COMPARED.search(line)) for line in lines] == [True, True, True, True, False, False]

# The floors, bottom to top: a module imports (anywhere: at module level, inside functions, for type
# checking) only modules of its own floor or below. docs/code-layout.md says what each holds.
FLOORS = ("errors", "charts", "config", "features", "runtime", "model", "data", "tokenize", "parallel", "interop",
          "session", "laid_out", "sampling", "evals", "rl", "train", "verify", "plan", "cli", "__main__", "jaxpar")


def floor(module: str) -> str:
    """The floor of a dotted module name: its package under jaxpar, or the top module's own name."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(package: Path = PACKAGE) -> set[tuple[str, str]]:
    known = modules(package)
    rank = {name: level for level, name in enumerate(FLOORS)}
    return {(name, imported) for name, path in known.items() for imported in imports(path, known)
            if rank[floor(name)] < rank[floor(imported)]}


def test_every_package_has_a_floor():
    assert {floor(name) for name in modules()} == set(FLOORS)


def test_imports_run_down_the_floors_only():
    assert upward_imports() == set()


def test_the_floor_check_sees_an_import_upward(tmp_path):
    package = tmp_path / "jaxpar"
    for name in ("__init__.py", "model/__init__.py", "model/layers.py", "train/__init__.py", "train/step.py"):
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text("")
    (package / "train" / "step.py").write_text("from jaxpar.model.layers import Dense\n")  # down: fine
    (package / "model" / "layers.py").write_text("def later():\n    from jaxpar.train.step import x\n")
    assert upward_imports(package) == {("jaxpar.model.layers", "jaxpar.train.step")}


# What runs a model without training it imports nothing of training, anywhere (issue 64's acceptance; the floors
# hold it too, and this says it in so many words).
BELOW_TRAINING = ("laid_out", "sampling", "evals", "rl", "interop")


@pytest.mark.parametrize("package", BELOW_TRAINING)
def test_what_runs_a_model_imports_nothing_of_training(package):
    known = modules()
    upward = {name: sorted(m for m in imports(path, known) if m == "jaxpar.train" or m.startswith("jaxpar.train."))
              for name, path in known.items() if name.startswith(f"jaxpar.{package}")}
    assert not {name: found for name, found in upward.items() if found}


def test_the_training_import_check_sees_one(tmp_path):
    package = tmp_path / "jaxpar"
    (package / "rl").mkdir(parents=True)
    (package / "train").mkdir()
    for name in ("__init__.py", "rl/__init__.py", "train/__init__.py", "train/step.py"):
        (package / name).write_text("")
    (package / "rl" / "rollout.py").write_text("def later():\n    from jaxpar.train.step import x\n")
    known = modules(package)
    assert imports(package / "rl" / "rollout.py", known) == {"jaxpar.train.step"}
