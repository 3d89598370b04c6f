"""A small reader for compiled HLO text: computations, their instructions, and how many times
each computation runs per step (while-loop trip counts multiplied through the call graph).

XLA's own `cost_analysis()` counts a loop body once, whatever its trip count, so per-step
figures for scanned layers have to be multiplied out here.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>\S+)\s.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%(?P<name>\S+)\s*=\s*(?P<shape>.+?)\s+(?P<op>[a-z][\w-]*)\((?P<rest>.*)$")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_ARRAY = re.compile(r"\b([a-z]+\d*(?:e\d+m\d+(?:fn)?)?)\[([\d,]*)\]")
DTYPE_BYTES = {"f64": 8, "f32": 4, "s32": 4, "u32": 4, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "s8": 1,
               "u8": 1, "pred": 1, "s64": 8, "u64": 8, "f8e4m3fn": 1, "f8e5m2": 1}


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: its name, result shape text, opcode and the rest of the line."""

    name: str
    shape: str
    op: str
    rest: str


@dataclasses.dataclass
class Module:
    """Parsed HLO: computations by name, the entry's name, and calls between computations."""

    computations: dict[str, list[Instruction]]
    entry: str
    calls: dict[str, list[tuple[str, int]]]  # callee -> [(caller, times per caller run)]

    @functools.cached_property
    def _memo(self) -> dict[str, int]:
        return {}

    def executions(self, computation: str) -> int:
        """How many times `computation` runs per execution of the entry computation."""
        if computation == self.entry:
            return 1
        if computation not in self._memo:
            self._memo[computation] = sum(self.executions(caller) * times
                                          for caller, times in self.calls.get(computation, []))
        return self._memo[computation]


def array_shapes(shape_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in a shape (a tuple shape gives several)."""
    return [(dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ARRAY.findall(shape_text) if dtype in DTYPE_BYTES]


def nbytes(shape_text: str) -> int:
    """Total bytes of the arrays in a shape."""
    return sum(math.prod(dims) * DTYPE_BYTES[dtype] for dtype, dims in array_shapes(shape_text))


def parse(hlo_text: str) -> Module:
    """Split HLO text into computations and record who calls whom, and how often."""
    computations: dict[str, list[Instruction]] = {}
    calls: dict[str, list[tuple[str, int]]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        if m := _COMPUTATION.match(line):
            current = m.group("name")
            computations[current] = []
            if line.startswith("ENTRY"):
                entry = current
            continue
        m = _INSTRUCTION.match(line)
        if not m or current is None:
            continue
        inst = Instruction(m.group("name"), m.group("shape"), m.group("op"), m.group("rest"))
        computations[current].append(inst)
        trips = _TRIP_COUNT.search(inst.rest)
        n = int(trips.group(1)) if trips else 1
        for key, callee in re.findall(r"\b(body|condition|calls|to_apply)=%([^\s,)}]+)", inst.rest):
            times = n if key == "body" else n + 1 if key == "condition" else 1
            calls.setdefault(callee, []).append((current, times))
        if branches := re.search(r"branch_computations=\{([^}]*)\}", inst.rest):
            for callee in re.findall(r"%([^\s,}]+)", branches.group(1)):
                calls.setdefault(callee, []).append((current, 1))  # upper bound: every branch counted
    return Module(computations, entry, calls)


def lhs_contracting(inst: Instruction) -> list[int] | None:
    """A dot's contracted dimensions of its left operand (None: not written, not a dot)."""
    found = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", inst.rest)
    return [int(d) for d in found.group(1).split(",") if d] if found else None


def dot_flops(lhs_dims: tuple[int, ...], out_dims: tuple[int, ...], contracting: list[int]) -> int:
    """A matmul's FLOPs, a dot's or a library GEMM's: 2 x output elements x contracted size."""
    return 2 * math.prod(out_dims) * math.prod(lhs_dims[d] for d in contracting if d < len(lhs_dims))


def matmul_flops(module: Module, root: str | None = None) -> float:
    """2 x output elements x contracted size for every dot, times its executions per step
    (per run of computation `root` and what it calls, when given)."""
    if root is not None:
        module = Module(module.computations, root, module.calls)
    total = 0.0
    for name, instructions in module.computations.items():
        shapes = {inst.name: inst.shape for inst in instructions}
        for inst in instructions:
            if inst.op != "dot":
                continue
            lhs = re.match(r"\s*%?([^\s,)]+)", inst.rest)
            contracting = lhs_contracting(inst)
            lhs_shapes = array_shapes(shapes.get(lhs.group(1), "")) if lhs else []
            if not lhs_shapes or contracting is None:
                continue
            total += float(dot_flops(lhs_shapes[0][1], array_shapes(inst.shape)[0][1], contracting)
                           * module.executions(name))
    return total


def conditionals(module: Module, scope: str) -> list[tuple[str, list[str]]]:
    """(calling computation, branch computations in index order) of every conditional whose innermost
    name scope is `scope` (also as autodiff wraps it: jvp(scope), transpose(jvp(scope))), not those
    nested in its branches under a scope of their own."""
    named = re.compile(rf'op_name="[^"]*[/(]{re.escape(scope)}\)*/cond"')
    found = []
    for name, instructions in module.computations.items():
        for inst in instructions:
            if inst.op != "conditional" or not named.search(inst.rest):
                continue
            branches = re.search(r"branch_computations=\{([^}]*)\}", inst.rest)
            if branches:
                found.append((name, re.findall(r"%([^\s,}]+)", branches.group(1))))
    return found


def taking(module: Module, choices: dict[str, int]) -> Module:
    """The module as it runs where each conditional named by a scope of `choices` takes the branch given
    there: its other branches are not called."""
    calls = {callee: list(callers) for callee, callers in module.calls.items()}
    for scope, chosen in choices.items():
        for caller, branches in conditionals(module, scope):
            for k, branch in enumerate(branches):
                if k != chosen:
                    calls[branch] = [(c, times) for c, times in calls.get(branch, []) if c != caller]
    return Module(module.computations, module.entry, calls)


# Instructions that write no memory of their own (views, control flow, the state threaded
# through loops), or whose cost another term counts (dots: compute; collectives: communication).
_NOT_WRITTEN = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "while", "conditional", "call",
                "after-all", "partition-id", "replica-id", "dot", "convolution", "copy-start", "copy-done",
                "send", "recv", "send-done", "recv-done", "optimization-barrier"}
_COLLECTIVE_PREFIXES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute",
                        "ragged-all-to-all")


def _fused(module: Module) -> tuple[set[str], set[str]]:
    """(computations fused into another instruction, those among them that hold a dot)."""
    fused, with_dot = set(), set()
    for instructions in module.computations.values():
        for inst in instructions:
            if inst.op == "fusion" or "to_apply=" in inst.rest:
                fused.update(re.findall(r"\b(?:calls|to_apply)=%([^\s,)}]+)", inst.rest))
    for name in fused:
        if any(i.op in ("dot", "convolution") for i in module.computations.get(name, [])):
            with_dot.add(name)
    return fused, with_dot


OPERAND = re.compile(r"%([^\s,)}]+)")  # an operand's %name in an instruction's text


def _in_place_bytes(inst: Instruction, shapes: dict[str, Instruction]) -> int | None:
    """The bytes of the update when `inst` is (a view of) a dynamic-update-slice, which XLA does
    in place, writing only the update: None otherwise."""
    while inst.op in ("bitcast", "reshape") and (names := OPERAND.findall(inst.rest)) and names[0] in shapes:
        inst = shapes[names[0]]
    if inst.op != "dynamic-update-slice":
        return None
    names = OPERAND.findall(inst.rest)
    return nbytes(shapes[names[1]].shape) if len(names) > 1 and names[1] in shapes else None


def written_bytes(module: Module, root: str | None = None) -> float:
    """Bytes the step's non-matmul work writes to memory, times executions (per run of `root`
    when given): the result of every unfused instruction and fusion, less views, control flow,
    dots (and fusions around them) and collectives; a dynamic-update-slice (or a fusion ending
    in one) writes only its update. A proxy for elementwise memory traffic."""
    fused, with_dot = _fused(module)
    if root is not None:
        module = Module(module.computations, root, module.calls)
    by_name = {name: {i.name: i for i in instructions} for name, instructions in module.computations.items()}
    total = 0.0
    for name, instructions in module.computations.items():
        if name in fused:
            continue
        runs = None
        for inst in instructions:
            if inst.op in _NOT_WRITTEN or inst.op.startswith(_COLLECTIVE_PREFIXES):
                continue
            written = _in_place_bytes(inst, by_name[name])
            if inst.op == "fusion":
                callees = re.findall(r"\bcalls=%([^\s,)}]+)", inst.rest)
                if set(callees) & with_dot:
                    continue
                body = module.computations.get(callees[0], []) if callees else []
                written = _in_place_bytes(body[-1], by_name[callees[0]]) if body else None  # the root comes last
            runs = module.executions(name) if runs is None else runs
            total += (nbytes(inst.shape) if written is None else written) * runs
    return total


Kinds = list[tuple[int, dict[str, int]] | None]


def executed_cost(module: Module, scope: str, kinds: Kinds, kind_runs: list[list[int]], cost) -> list[float]:
    """`cost(module, root=None)` (matmul_flops, written_bytes) per step as each device runs it,
    one figure per device.

    `cost` counts every branch of a conditional each time the conditional runs. For the
    conditionals named by `scope`, device d runs kind k of work kind_runs[d][k] times per step
    instead, each costed from the compiled branch that runs it (see `branch_costs`).
    Everything else runs on every device as counted.
    """
    for caller, _ in conditionals(module, scope):
        runs = module.executions(caller)
        for taken in kind_runs:
            if sum(taken) != runs:
                raise ValueError(f"the schedule takes {sum(taken)} branches of a conditional that runs {runs} times")
    per_kind, outside = branch_costs(module, scope, kinds, cost)
    return [outside + sum(n * amount for n, amount in zip(taken, per_kind)) for taken in kind_runs]


def branch_costs(module: Module, scope: str, kinds: Kinds, cost) -> tuple[list[float], float]:
    """(`cost` of one run of each kind of work, `cost` per step of everything else), per device: what a
    schedule's table is timed with. kinds[k] is the branch of the conditionals named by `scope` that
    runs kind k, and the branch that each conditional nested in it takes, by scope (None: a kind never
    run, costed 0)."""
    per_kind = [0.0] * len(kinds)
    outside = cost(module)
    for caller, branches in conditionals(module, scope):
        runs = module.executions(caller)
        outside -= runs * sum(cost(module, root=branch) for branch in branches)
        for k, kind in enumerate(kinds):
            if kind is not None:
                index, choices = kind
                per_kind[k] += cost(taking(module, choices), root=branches[index])
    return per_kind, outside
