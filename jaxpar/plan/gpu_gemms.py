"""How XLA:GPU compiles the step's matmuls, read from its compiled HLO text (`compiled.as_text()`).

After XLA:GPU's passes a dot is one of:
  * a GEMM fusion: `fusion(...), kind=kCustom, calls=%c` whose backend_config names the emitter,
    `"kind":"__triton_gemm"` or `"__triton_nested_gemm_fusion"` (Triton), `"__cudnn$fusion"` (cuDNN's
    GEMM fusions), `"__custom_fusion"` (CUTLASS); the dot sits in %c (or a computation %c calls);
  * a library call: `custom-call(...), custom_call_target="__cublas$gemm"` (cuBLAS),
    `"__cublas$lt$matmul"` or `"__cublas$lt$matmul$f8"` (cuBLASLt; f8 operands with their scales),
    its result the first element of a (result, workspace) tuple;
  * a dot left in an ordinary fusion or computation (kind `fused` or `dot`).
cuDNN's other calls (`"__cudnn$fmha..."`: fused attention) are listed with the GEMMs, kind `cudnn`.

Each GEMM is reported with the element types its multiply takes (`operands`: the dot's operands, after
any conversion fused into the kernel), the types it reads from memory (`reads`: the widest buffer behind
each operand; an fp8 weight converted to bf16 inside a Triton GEMM reads f8 but multiplies bf16), its
result type, the shapes "lhs x rhs -> result", executions per step (loops multiplied out as
jaxpar.plan.collectives counts collectives: every branch of a conditional each time it runs) and its
FLOPs per step (2 x result elements x contracted size; none for attention calls). `custom_calls` counts
every custom call's executions per step by target. Deviceless compiles cannot autotune: XLA:GPU then
keeps its default choice (a Triton GEMM wherever Triton takes the dot), where a GPU could pick cuBLAS.
"""

from __future__ import annotations

import json
import math
import re

from jaxpar.plan.hlo import OPERAND, Instruction, Module, array_shapes, dot_flops, lhs_contracting, parse

_FUSION_KINDS = (("__triton", "triton"), ("__cudnn", "cudnn"), ("__custom_fusion", "cutlass"))
_LIBRARY_CALLS = (("__cublas$lt$", "cublaslt"), ("__cublas$", "cublas"), ("__cudnn$", "cudnn"))
_DOTS = ("dot", "scaled-dot")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_BACKEND_KIND = re.compile(r'"fusion_backend_config":\{"kind":"([^"]+)"')
_CALLS = re.compile(r"\bcalls=%([^\s,)}]+)")


def _dims(shape: str) -> tuple[str, tuple[int, ...]]:
    """(element type, dims) of the first array in a shape (a tuple's first element)."""
    found = array_shapes(shape)
    return found[0] if found else ("?", ())


def _operands(inst: Instruction) -> list[str]:
    """The names of an instruction's operands: the %names before the first `)` at depth 0."""
    depth, end = 0, len(inst.rest)
    for i, char in enumerate(inst.rest):
        depth += (char == "(") - (char == ")")
        if depth < 0:
            end = i
            break
    return OPERAND.findall(inst.rest[:end])


def _reads(name: str, by_name: dict[str, Instruction]) -> str:
    """The element type of the largest buffer behind operand `name` in its computation (the parameters and
    constants it is computed from): what the kernel reads for it."""
    seen, todo, best = set(), [name], (-1, "?")
    while todo:
        inst = by_name.get(todo.pop())
        if inst is None or inst.name in seen:
            continue
        seen.add(inst.name)
        if inst.op in ("parameter", "constant") or not _operands(inst):
            dtype, dims = _dims(inst.shape)
            best = max(best, (math.prod(dims), dtype))
        todo.extend(_operands(inst))
    return best[1]


def _dot_entry(kind: str, dot: Instruction, by_name: dict[str, Instruction]) -> dict:
    names = _operands(dot)[:2]
    shapes = [_dims(by_name[n].shape) if n in by_name else ("?", ()) for n in names]
    result = _dims(dot.shape)
    contracting = lhs_contracting(dot) or []
    lhs = shapes[0][1] if shapes else ()
    operands = [t for t, _ in shapes]
    reads = operands if kind == "dot" else [_reads(n, by_name) for n in names]  # a fusion reads its parameters
    return {"kind": kind, "operands": operands, "reads": reads,
            "result": result[0], "shape": _shape_text([d for _, d in shapes], result[1]),
            "flops": dot_flops(lhs, result[1], contracting)}


def _shape_text(operands: list[tuple[int, ...]], result: tuple[int, ...]) -> str:
    text = lambda dims: "[" + ",".join(map(str, dims)) + "]"  # noqa: E731
    return " x ".join(map(text, operands)) + " -> " + text(result)


def _library_entry(kind: str, inst: Instruction, by_name: dict[str, Instruction]) -> dict:
    """A cuBLAS/cuBLASLt GEMM (its first two operands; an f8 one's scales follow) or a cuDNN call (its
    first operands, as many as share the first one's element type: attention's q, k, v)."""
    names = _operands(inst)
    shapes = [_dims(by_name[n].shape) if n in by_name else ("?", ()) for n in names]
    result = _dims(inst.shape)
    flops = None
    if kind == "cudnn":
        shapes = [s for s in shapes if s[0] == shapes[0][0]][:3] if shapes else []
    else:
        shapes = shapes[:2]
        config = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', inst.rest)
        contracting = [int(d) for d in re.findall(r"\d+", config.group(1))] if config else []
        flops = dot_flops(shapes[0][1] if shapes else (), result[1], contracting)
    reads = [t for t, _ in shapes]  # a library call reads its operands as they are
    return {"kind": kind, "operands": reads, "reads": reads, "result": result[0],
            "shape": _shape_text([d for _, d in shapes], result[1]), "flops": flops}


def _fusion_kind(inst: Instruction) -> str:
    found = _BACKEND_KIND.search(inst.rest)
    backend = found.group(1) if found else ""
    return next((kind for prefix, kind in _FUSION_KINDS if backend.startswith(prefix)), "fused")


def _dots_under(module: Module, computation: str) -> list[tuple[Instruction, dict[str, Instruction]]]:
    """Every dot in `computation` and the computations its fusions call, with its computation's names."""
    found, todo, seen = [], [computation], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in module.computations:
            continue
        seen.add(name)
        instructions = module.computations[name]
        by_name = {i.name: i for i in instructions}
        found += [(i, by_name) for i in instructions if i.op in _DOTS]
        todo += [callee for i in instructions if i.op == "fusion" for callee in _CALLS.findall(i.rest)]
    return found


def _fused_computations(module: Module) -> set[str]:
    return {callee for instructions in module.computations.values() for i in instructions if i.op == "fusion"
            for callee in _CALLS.findall(i.rest)}


def kernels(hlo: str | Module) -> dict:
    """{"gemms": [...], "custom_calls": {target: executions per step}} of a compiled XLA:GPU program (see the
    module's docstring); equal GEMMs (kind, types and shapes) are one entry, their counts and FLOPs summed."""
    module = parse(hlo) if isinstance(hlo, str) else hlo
    inside = _fused_computations(module)
    entries, calls = [], {}
    for name, instructions in module.computations.items():
        if name in inside:
            continue  # reached through the fusion that calls it
        runs = module.executions(name)
        by_name = {i.name: i for i in instructions}
        for inst in instructions:
            found = []
            if inst.op == "fusion":
                kind = _fusion_kind(inst)
                found = [_dot_entry(kind, dot, names) for dot, names in _dots_under(module, _callee(inst))]
            elif inst.op in _DOTS:
                found = [_dot_entry("dot", inst, by_name)]
            elif inst.op == "custom-call" and (target := _TARGET.search(inst.rest)):
                calls[target.group(1)] = calls.get(target.group(1), 0) + runs
                kind = next((k for prefix, k in _LIBRARY_CALLS if target.group(1).startswith(prefix)), None)
                found = [_library_entry(kind, inst, by_name)] if kind else []
            entries += [{**entry, "count": runs} for entry in found if runs]
    return {"gemms": _merged(entries), "custom_calls": dict(sorted(calls.items()))}


def _callee(fusion: Instruction) -> str:
    """The computation a fusion instruction calls."""
    callee = _CALLS.search(fusion.rest)
    return callee.group(1) if callee else ""


def _merged(entries: list[dict]) -> list[dict]:
    merged: dict[str, dict] = {}
    for e in entries:
        key = json.dumps([e["kind"], e["operands"], e["reads"], e["result"], e["shape"]])
        flops = None if e["flops"] is None else e["flops"] * e["count"]
        if key in merged:
            merged[key]["count"] += e["count"]
            merged[key]["flops"] = None if flops is None else merged[key]["flops"] + flops
        else:
            merged[key] = {**e, "flops": flops}
    return sorted(merged.values(), key=lambda e: (e["kind"], -(e["flops"] or 0), e["shape"]))


def table(gemms: list[dict], custom_calls: dict[str, int]) -> str:
    """The GEMMs grouped by kind and element types (distinct shapes, executions and FLOPs per step, the
    share of all GEMM FLOPs), then the custom calls by target."""
    groups: dict[tuple, list[dict]] = {}
    for g in gemms:
        groups.setdefault((g["kind"], " x ".join(g["operands"]), " x ".join(g["reads"]), g["result"]), []).append(g)
    total = sum(g["flops"] or 0 for g in gemms) or 1
    lines = [f"{'GEMM kind':<10}{'operands':<22}{'reads':<22}{'result':<8}{'shapes':>7}{'per step':>10}"
             f"{'FLOPs/step':>13}{'share':>8}"]
    for (kind, operands, reads, result), rows in sorted(groups.items()):
        flops = sum(r["flops"] or 0 for r in rows)
        runs = sum(r["count"] for r in rows)
        lines.append(f"{kind:<10}{operands:<22}{reads:<22}{result:<8}{len(rows):>7d}{runs:>10d}{flops:>13.4g}"
                     f"{flops / total:>8.1%}")
    if not gemms:
        lines.append("(no matmuls)")
    calls = ", ".join(f"{target} x{count}" for target, count in custom_calls.items()) or "none"
    lines.append(f"custom calls per step: {calls}")
    lines.append("(operands: what the multiply takes; reads: what the kernel loads for them; per step: loops "
                 "multiplied out)")
    return "\n".join(lines)
