"""The split backward of the zero-bubble schedules: a chunk's backward cut into B, what the
previous stage waits for (the cotangent of the chunk's input), and W, the weight gradients that
nobody waits for, with nothing computed twice.

Both halves come from the one backward program JAX writes for the chunk (its pullback traced to
a jaxpr). B is every equation the input's cotangent depends on; W is the rest of what the weight
gradients depend on. The equations are divided, not copied, so B and W together execute exactly
the fused backward's work. What W reads that B computed (each weight matmul's output cotangent,
which B computes on its way to the input's cotangent) is handed from B to W: `crossing`. The
layer scan is divided the same way, recursively: the B scan emits, layer by layer, the values its
W scan reads. Calls (jit, checkpoint, custom derivatives) are inlined; any other control flow
(cond, while, shard_map) stays whole, on B's side when B needs any of its results.

A gradient whose W part would hold no matmul (norm scales, biases, the embedding's scatter-add,
zeros) is computed in B instead: it costs elementwise work there, where its inputs are at hand,
and would otherwise keep activations alive until W.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
from jax._src import core

# Call-like primitives whose body is inlined (the backward is not differentiated again).
_INLINED = frozenset({"jit", "pjit", "closed_call", "core_call", "checkpoint", "remat", "remat2", "custom_jvp_call",
                      "custom_vjp_call"})
# What the W half is for: a gradient whose W part has none of these is computed in B.
_MATMULS = frozenset({"dot_general", "ragged_dot", "ragged_dot_general", "conv_general_dilated"})


@dataclasses.dataclass
class _Op:
    """One equation with its inputs and outputs renamed to ids (ints) or literals; a scan keeps its
    body as a program and its (consts, carry, xs) counts."""

    eqn: core.JaxprEqn
    ins: list
    outs: list[int]
    body: _Program | None = None
    parts: tuple[int, int, int] = (0, 0, 0)


@dataclasses.dataclass
class _Program:
    inputs: list[int]
    outputs: list
    ops: list[_Op]
    consts: dict[int, object]


class _Flattener:
    """A closed jaxpr as a _Program, calls inlined; every variable gets a fresh id (an inlined body
    used twice gets two sets)."""

    def __init__(self):
        self.ids = itertools.count()

    def program(self, closed) -> _Program:
        env, consts, ops = {}, {}, []
        for v, c in zip(closed.jaxpr.constvars, closed.consts):
            env[v] = i = next(self.ids)
            consts[i] = c
        inputs = [self._define(env, v) for v in closed.jaxpr.invars]
        self._eqns(closed.jaxpr.eqns, env, ops, consts)
        return _Program(inputs, [self._ref(env, v) for v in closed.jaxpr.outvars], ops, consts)

    def _define(self, env, v) -> int:
        env[v] = i = next(self.ids)
        return i

    @staticmethod
    def _ref(env, v):
        return v if isinstance(v, core.Literal) else env[v]

    def _eqns(self, eqns, env, ops, consts):
        for eqn in eqns:
            ins = [self._ref(env, v) for v in eqn.invars]
            inner = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            if eqn.primitive.name in _INLINED and inner is not None:
                self._inline(inner, ins, eqn.outvars, env, ops, consts)
                continue
            outs = [self._define(env, v) for v in eqn.outvars]
            if eqn.primitive.name == "scan":
                n = len(eqn.invars)
                parts = tuple(len(list(p)) for p in eqn.params["ft_in"].update(list(range(n))).unpack())
                ops.append(_Op(eqn, ins, outs, self.program(eqn.params["jaxpr"]), parts))
            else:
                ops.append(_Op(eqn, ins, outs))

    def _inline(self, inner, ins, outvars, env, ops, consts):
        closed = inner  # a jaxpr with its consts (jax >= 0.11 has no separate ClosedJaxpr)
        inner_env = {}
        for v, c in zip(closed.jaxpr.constvars, getattr(closed, "consts", ())):
            inner_env[v] = i = next(self.ids)
            consts[i] = c
        inner_env.update(zip(closed.jaxpr.invars, ins))
        self._eqns(closed.jaxpr.eqns, inner_env, ops, consts)
        for outer, v in zip(outvars, closed.jaxpr.outvars):
            if not isinstance(outer, core.DropVar):
                env[outer] = self._ref(inner_env, v)


@dataclasses.dataclass
class _ScanB:
    """B's part of a scan: the scan outputs it computes (carries first), its body's B part, and the
    body values it emits per iteration for W (`emit`, as the new outer ids `emit_ids`)."""

    outs: list[int]
    body: _Part
    emit: list[int] = dataclasses.field(default_factory=list)
    emit_ids: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _ScanW:
    """W's part of a scan: the outputs it computes, its body's W part, and what B's part emits."""

    outs: list[int]
    body: _Part
    b: _ScanB | None
    emit: list[int]
    emit_ids: list[int]


@dataclasses.dataclass
class _Part:
    """The ops of one half (op index -> None: the whole op, or a scan's share), the values it defines,
    the program inputs it reads and the other half's values it reads (`crossing`)."""

    ops: dict[int, object]
    defined: set[int]
    reads: set[int]
    crossing: set[int]


def _refs(atoms) -> list[int]:
    return [a for a in atoms if isinstance(a, int)]


def _plan(prog: _Program, wanted: set[int], available: set[int], b_part: _Part | None, ids) -> _Part:
    """The ops that compute `wanted` ids, given the values `available` (B's, when planning W, with
    b_part its plan)."""
    needed = set(wanted) - available
    part = _Part({}, set(), set(), set())
    producer = {o: i for i, op in enumerate(prog.ops) for o in op.outs}
    for i in reversed(range(len(prog.ops))):
        op = prog.ops[i]
        outs = [j for j, o in enumerate(op.outs) if o in needed and o not in available]
        if not outs:
            continue
        if op.body is None:
            part.ops[i], reads = None, _refs(op.ins)
            part.defined.update(op.outs)
        else:
            share = _scan_share(op, outs, b_part.ops.get(i) if b_part else None, b_part is not None, ids)
            part.ops[i], reads = share, share.reads
            part.defined.update(op.outs[j] for j in share.outs)
            if isinstance(share, _ScanW):
                part.crossing.update(share.emit_ids)
        for r in reads:
            if r in available:
                part.crossing.add(r)
            elif r in producer:
                needed.add(r)
            elif r not in prog.consts:
                part.reads.add(r)
    part.reads.update(o for o in _refs(wanted) if o in prog.inputs)
    part.crossing.update(o for o in wanted if o in available)
    return part


def _scan_share(op: _Op, outs: list[int], b_share: _ScanB | None, for_w: bool, ids):
    """A scan's share of one half: the body's part for the outputs `outs` (positions: carries, then
    ys), grown to a fixed point over the carries it reads; `.reads` are the outer ins it reads."""
    nC, nK, _ = op.parts
    body = op.body
    position = {v: p for p, v in enumerate(body.inputs)}
    b_carries = {k for k in b_share.outs if k < nK} if b_share else set()
    available, b_body = set(), None
    if for_w and b_share is not None:
        b_body = b_share.body
        available = b_body.defined | {body.inputs[nC + k] for k in b_carries}
    want = set(outs)
    while True:
        part = _plan(body, set(_refs([body.outputs[j] for j in want])), available, b_body, ids)
        read_carries = {position[r] - nC for r in part.reads if nC <= position[r] < nC + nK}
        grown = want | (read_carries - b_carries)
        if grown == want:
            break
        want = grown
    carries = sorted(k for k in want if k < nK)
    reads = [op.ins[p] for p in sorted(position[r] for r in part.reads) if not nC <= p < nC + nK]
    reads += [op.ins[nC + k] for k in carries]
    if for_w:
        emit = sorted(part.crossing)
        share = _ScanW(sorted(want), part, b_share, emit, [next(ids) for _ in emit])
    else:
        share = _ScanB(sorted(want), part)
    share.reads = _refs(reads)
    return share


def _link(prog: _Program, w: _Part) -> None:
    """Tell each of B's scan shares what its W share reads from it (through nested scans)."""
    for i, share in w.ops.items():
        if isinstance(share, _ScanW):
            if share.b is not None:
                share.b.emit, share.b.emit_ids = share.emit, share.emit_ids
            _link(prog.ops[i].body, share.body)


def _has_matmul(prog: _Program, part: _Part) -> bool:
    for i, share in part.ops.items():
        op = prog.ops[i]
        if share is None and op.eqn.primitive.name in _MATMULS:
            return True
        if share is not None and _has_matmul(op.body, share.body):
            return True
    return False


def _read(prog: _Program, env: dict, atom):
    if isinstance(atom, core.Literal):
        return atom.val
    return env[atom] if atom in env else prog.consts[atom]


def _run(prog: _Program, part: _Part, env: dict) -> None:
    """Evaluate the ops of `part` in program order, reading and writing `env` (id -> value)."""
    for i, op in enumerate(prog.ops):
        if i not in part.ops:
            continue
        share = part.ops[i]
        if share is not None:
            _run_scan(prog, op, share, env)
            continue
        eqn = op.eqn
        args = [_read(prog, env, a) for a in op.ins]
        with eqn.ctx.manager:
            out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
        env.update(zip(op.outs, out if eqn.primitive.multiple_results else [out]))


def _run_scan(prog: _Program, op: _Op, share, env: dict) -> None:
    """One half's share of a scan as a `lax.scan` of the body's part. B's share also emits, stacked
    per iteration, the body values W's share reads; W's share takes them in with its xs."""
    nC, nK, nX = op.parts
    body, reads = op.body, share.body.reads
    carries = [k for k in share.outs if k < nK]
    ys = [j for j in share.outs if j >= nK]
    const_at = [p for p in range(nC) if body.inputs[p] in reads]
    xs_at = [p for p in range(nC + nK, nC + nK + nX) if body.inputs[p] in reads]
    is_w = isinstance(share, _ScanW)
    xs_ids = [body.inputs[p] for p in xs_at] + (share.emit if is_w else [])
    emitted = [] if is_w else share.emit
    consts = [_read(prog, env, op.ins[p]) for p in const_at]
    init = [_read(prog, env, op.ins[nC + k]) for k in carries]
    xs = [_read(prog, env, op.ins[p]) for p in xs_at] + ([env[e] for e in share.emit_ids] if is_w else [])

    def step(carry, x):
        body_env = {body.inputs[p]: c for p, c in zip(const_at, consts)}
        body_env.update(zip([body.inputs[nC + k] for k in carries], carry))
        body_env.update(zip(xs_ids, x))
        _run(body, share.body, body_env)
        new = [_read(body, body_env, body.outputs[k]) for k in carries]
        return new, [_read(body, body_env, body.outputs[j]) for j in ys] + [body_env[e] for e in emitted]

    p = op.eqn.params
    with op.eqn.ctx.manager:
        carry, stacked = jax.lax.scan(step, init, xs, length=p["length"], reverse=p["reverse"], unroll=p["unroll"])
    env.update(zip([op.outs[k] for k in carries], carry))
    env.update(zip([op.outs[j] for j in ys] + ([] if is_w else share.emit_ids), stacked))


class SplitBackward:
    """fn(*args) -> (weight gradients, input cotangents), both pytrees, cut in two halves.

    Both halves take the leaves of `args` as a flat list (`jax.tree.leaves(args)`; a leaf a half
    does not read, listed in `b_inputs` and `w_inputs`, may be None). `input_half(leaves)` ->
    (input cotangents, {weight-gradient leaf index: gradient} for the gradients computed in B,
    the crossing values for W); `weight_half(leaves, crossing)` -> {leaf index: gradient} for the
    rest. Gradients that are zeros (of weights `fn` does not use) are in neither. Traced once here;
    both halves can then run wherever the same values are at hand (other branches of a pipeline's
    ticks)."""

    def __init__(self, fn, *args, whole: bool = False):
        """whole: every gradient in B (W empty), still without the zeros."""
        flat = _Flattener()
        closed, (grads, cotangents) = jax.make_jaxpr(fn, return_shape=True)(*args)
        self.prog = prog = flat.program(closed)
        self.in_tree = jax.tree.structure(args)
        self.grads_tree, self.cot_tree = jax.tree.structure(grads), jax.tree.structure(cotangents)
        n = self.grads_tree.num_leaves
        cot_ids = set(_refs(prog.outputs[n:]))
        first = _plan(prog, cot_ids, set(), None, flat.ids)
        # gradients that are zeros (weights the function does not use) are left out of both halves
        nonzero = [g for g in range(n) if not _is_zero(prog, prog.outputs[g])]
        self.in_b = [g for g in nonzero if whole or not _weight_matmuls(prog, prog.outputs[g], first, flat.ids)]
        self.in_w = [g for g in nonzero if g not in self.in_b]
        self.b = _plan(prog, cot_ids | set(_refs(prog.outputs[g] for g in self.in_b)), set(), None, flat.ids)
        self.w = _plan(prog, set(_refs(prog.outputs[g] for g in self.in_w)), self.b.defined, self.b, flat.ids)
        _link(prog, self.w)
        self.crossing = sorted(self.w.crossing)
        self.b_inputs = [p for p, v in enumerate(prog.inputs) if v in self.b.reads]
        self.w_inputs = [p for p, v in enumerate(prog.inputs) if v in self.w.reads]
        self.crossing_shapes = jax.eval_shape(lambda leaves: self.input_half(leaves)[2], jax.tree.leaves(args))

    def input_half(self, leaves: list):
        """(input cotangents, {leaf: gradient computed in B}, crossing values) from the args' leaves."""
        prog = self.prog
        env = {prog.inputs[p]: leaves[p] for p in self.b_inputs}
        _run(prog, self.b, env)
        n = self.grads_tree.num_leaves
        cotangents = self.cot_tree.unflatten([_read(prog, env, o) for o in prog.outputs[n:]])
        return cotangents, {g: _read(prog, env, prog.outputs[g]) for g in self.in_b}, [env[c] for c in self.crossing]

    def weight_half(self, leaves: list, crossing: list) -> dict:
        """{leaf: gradient} of the gradients W computes, from the args' leaves and B's crossing values."""
        prog = self.prog
        env = {prog.inputs[p]: leaves[p] for p in self.w_inputs}
        env.update(zip(self.crossing, crossing))
        _run(prog, self.w, env)
        return {g: _read(prog, env, prog.outputs[g]) for g in self.in_w}


def _weight_matmuls(prog: _Program, out, b: _Part, ids) -> bool:
    """Whether W's part of gradient `out` (given B's part `b`) holds a matmul."""
    if not isinstance(out, int) or out in b.defined or out in prog.inputs:
        return False
    return _has_matmul(prog, _plan(prog, {out}, b.defined, b, ids))


def _is_zero(prog: _Program, out) -> bool:
    """Whether an output is a literal zero or a zero broadcast (JAX's gradient of an unused weight)."""
    if isinstance(out, core.Literal):
        return not out.val
    op = next((op for op in prog.ops if out in op.outs), None)
    return (op is not None and op.eqn.primitive.name == "broadcast_in_dim" and isinstance(op.ins[0], core.Literal)
            and not op.ins[0].val)
