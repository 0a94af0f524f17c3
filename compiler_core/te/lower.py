"""Tensor expressions -> loop IR: one naive loop nest per stage, in dependency order."""

from __future__ import annotations

from collections.abc import Sequence

from compiler_core.loop.ir import (
    INDEX,
    Allocate,
    Binary,
    Block,
    Buffer,
    Const,
    Expr,
    For,
    IfThenElse,
    Load,
    PrimFunc,
    Select,
    Stmt,
    Store,
    Var,
    seq,
)
from compiler_core.loop.transform import map_expr
from compiler_core.te.tensor import RecurrenceOp, Tensor, TensorRead, tensor_reads

COMBINERS = {"sum": "add", "prod": "mul", "max": "max", "min": "min"}
FLOATS = ("float16", "bfloat16", "float32", "float64")


def dependencies(t: Tensor) -> list[Tensor]:
    """What a stage reads: a recurrence's states read the initial values and whatever the
    step reads from outside the loop."""
    if isinstance(t.op, RecurrenceOp):
        return list(t.op.inits) + list(t.op.outside)
    return tensor_reads(t.op.body)


def stages_of(outputs: Sequence[Tensor]) -> list[Tensor]:
    """Compute tensors reachable from `outputs`, producers before consumers."""
    order: list[Tensor] = []
    seen: set[int] = set()

    def visit(t: Tensor) -> None:
        if id(t) in seen or t.is_placeholder:
            return
        # One loop computes all of a recurrence's states, read or not.
        together = t.op.states if isinstance(t.op, RecurrenceOp) else (t,)
        seen.update(id(s) for s in together)
        for dep in dependencies(t):
            visit(dep)
        order.extend(together)

    for t in outputs:
        visit(t)
    return order


def _to_loads(expr: Expr, buffers: dict[int, Buffer]) -> Expr:
    def fn(e):
        if isinstance(e, TensorRead):
            if id(e.tensor) not in buffers:
                raise ValueError(f"tensor {e.tensor.name!r} is read but is not an input")
            return Load(buffers[id(e.tensor)], e.indices)
        return None

    return map_expr(expr, fn)


def _nest(loops: Sequence[tuple[Var, int]], body: Stmt) -> Stmt:
    for var, extent in reversed(loops):
        body = For(var, extent, body)
    return body


def _combine(combiner: str, acc: Expr, value: Expr) -> Expr:
    """The reduction step. A float max (min) is `value > acc ? value : acc`: the same result
    as max(acc, value) (NaN values are skipped; acc, starting at -inf, is never NaN), and one
    vmaxps on x86 instead of maxnum's three-instruction NaN check in the loop's dependency
    chain."""
    if combiner in ("max", "min") and value.dtype in FLOATS:
        return Select(Binary("gt" if combiner == "max" else "lt", value, acc), value, acc)
    return Binary(COMBINERS[combiner], acc, value)


def stage_nest(t: Tensor, buffers: dict[int, Buffer], row: tuple[Expr, ...] = ()) -> Stmt:
    """The stage's loop nest; with `row`, it writes that row of its buffer (a recurrence's
    update writes row t of its state)."""
    op = t.op
    buf = buffers[id(t)]
    at = row + tuple(op.axes)
    spatial = list(zip(op.axes, t.shape, strict=True))
    reduction = op.reduction
    if any(extent == 0 for extent in t.shape):
        return Block(())  # an empty tensor: nothing to compute
    if reduction is None:
        return _nest(spatial, Store(buf, at, _to_loads(op.body, buffers)))
    if any(axis.extent == 0 for axis in reduction.axes):  # reducing nothing: the initial value
        return _nest(spatial, Store(buf, at, Const(reduction.init, t.dtype)))
    # Reduce axes are renamed per stage so that two stages never share a loop variable.
    renamed = {a.name: Var(f"{t.name}_{a.name}") for a in reduction.axes}
    source = map_expr(
        reduction.source, lambda e: renamed.get(e.name) if isinstance(e, Var) else None
    )
    update = _combine(reduction.combiner, Load(buf, at), _to_loads(source, buffers))
    # The initial value is stored on the first reduction step, inside the nest: the nest stays
    # perfect, so any loop order is legal (every element still sees its first step first).
    first = None
    for var in renamed.values():
        is_zero = Binary("eq", var, Const(0, INDEX))
        first = is_zero if first is None else Binary("and", first, is_zero)
    init = Store(buf, at, Const(reduction.init, t.dtype))
    body = seq(IfThenElse(first, init), Store(buf, at, update))
    reduce_loops = [(renamed[a.name], a.extent) for a in reduction.axes]
    return _nest(spatial + reduce_loops, body)


def recurrence_loop(op: RecurrenceOp, buffers: dict[int, Buffer]) -> Stmt:
    """One serial loop over the steps around the step's loop nests."""
    updates = {id(u) for u in op.updates}
    nests = [stage_nest(s, buffers, (op.time,) if id(s) in updates else ()) for s in op.stages]
    return For(op.time, op.steps, seq(*nests))


def lower(inputs: Sequence[Tensor], outputs: Sequence[Tensor], name: str = "kernel") -> PrimFunc:
    buffers: dict[int, Buffer] = {}
    for t in inputs:
        if not t.is_placeholder:
            raise ValueError(f"input {t.name!r} is not a placeholder")
        buffers[id(t)] = Buffer(t.name, t.shape, t.dtype)
    stages = stages_of(outputs)
    output_ids = {id(t) for t in outputs}
    workspace: list[Buffer] = []
    for t in stages:
        scope = "global" if id(t) in output_ids else "workspace"
        buffers[id(t)] = Buffer(t.name, t.shape, t.dtype, scope)
        if scope == "workspace":
            workspace.append(buffers[id(t)])
    for op in _recurrences(stages):
        for state, update in zip(op.states, op.updates, strict=True):
            buffers[id(update)] = buffers[id(state)]  # an update writes its state's row t
        for s in op.stages:
            if id(s) not in buffers:
                buffers[id(s)] = Buffer(s.name, s.shape, s.dtype, "workspace")
                workspace.append(buffers[id(s)])
    nests, lowered = [], set()
    for t in stages:
        if not isinstance(t.op, RecurrenceOp):
            nests.append(stage_nest(t, buffers))
        elif id(t.op) not in lowered:
            lowered.add(id(t.op))
            nests.append(recurrence_loop(t.op, buffers))
    body = seq(*nests)
    for buffer in reversed(workspace):
        body = Allocate(buffer, body)
    params = tuple(buffers[id(t)] for t in list(inputs) + list(outputs))
    return PrimFunc(name, params, body)


def _recurrences(stages: Sequence[Tensor]) -> list[RecurrenceOp]:
    found: dict[int, RecurrenceOp] = {}
    for t in stages:
        if isinstance(t.op, RecurrenceOp):
            found.setdefault(id(t.op), t.op)
    return list(found.values())
