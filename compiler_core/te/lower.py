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
from compiler_core.te.tensor import Reduction, Tensor, TensorRead

COMBINERS = {"sum": "add", "prod": "mul", "max": "max", "min": "min"}
FLOATS = ("float16", "bfloat16", "float32", "float64")


def _reads(expr: Expr) -> list[Tensor]:
    found: list[Tensor] = []

    def visit(e):
        if isinstance(e, TensorRead) and e.tensor not in found:
            found.append(e.tensor)

    map_expr(expr.source if isinstance(expr, Reduction) else expr, lambda e: visit(e))
    return found


def stages_of(outputs: Sequence[Tensor]) -> list[Tensor]:
    """Compute tensors reachable from `outputs`, producers before consumers."""
    order: list[Tensor] = []
    seen: set[int] = set()

    def visit(t: Tensor) -> None:
        if id(t) in seen or t.is_placeholder:
            return
        seen.add(id(t))
        for dep in _reads(t.op.body):
            visit(dep)
        order.append(t)

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


def stage_nest(t: Tensor, buffers: dict[int, Buffer]) -> Stmt:
    op = t.op
    buf = buffers[id(t)]
    spatial = list(zip(op.axes, t.shape, strict=True))
    reduction = op.reduction
    if any(extent == 0 for extent in t.shape):
        return Block(())  # an empty tensor: nothing to compute
    if reduction is None:
        return _nest(spatial, Store(buf, op.axes, _to_loads(op.body, buffers)))
    if any(axis.extent == 0 for axis in reduction.axes):  # reducing nothing: the initial value
        return _nest(spatial, Store(buf, op.axes, Const(reduction.init, t.dtype)))
    # Reduce axes are renamed per stage so that two stages never share a loop variable.
    renamed = {a.name: Var(f"{t.name}_{a.name}") for a in reduction.axes}
    source = map_expr(
        reduction.source, lambda e: renamed.get(e.name) if isinstance(e, Var) else None
    )
    update = _combine(reduction.combiner, Load(buf, op.axes), _to_loads(source, buffers))
    # The initial value is stored on the first reduction step, inside the nest: the nest stays
    # perfect, so any loop order is legal (every element still sees its first step first).
    first = None
    for var in renamed.values():
        is_zero = Binary("eq", var, Const(0, INDEX))
        first = is_zero if first is None else Binary("and", first, is_zero)
    init = Store(buf, op.axes, Const(reduction.init, t.dtype))
    body = seq(IfThenElse(first, init), Store(buf, op.axes, update))
    reduce_loops = [(renamed[a.name], a.extent) for a in reduction.axes]
    return _nest(spatial + reduce_loops, body)


def lower(inputs: Sequence[Tensor], outputs: Sequence[Tensor], name: str = "kernel") -> PrimFunc:
    buffers: dict[int, Buffer] = {}
    for t in inputs:
        if not t.is_placeholder:
            raise ValueError(f"input {t.name!r} is not a placeholder")
        buffers[id(t)] = Buffer(t.name, t.shape, t.dtype)
    stages = stages_of(outputs)
    output_ids = {id(t) for t in outputs}
    for t in stages:
        scope = "global" if id(t) in output_ids else "workspace"
        buffers[id(t)] = Buffer(t.name, t.shape, t.dtype, scope)
    body = seq(*[stage_nest(t, buffers) for t in stages])
    for t in reversed(stages):
        if id(t) not in output_ids:
            body = Allocate(buffers[id(t)], body)
    params = tuple(buffers[id(t)] for t in list(inputs) + list(outputs))
    return PrimFunc(name, params, body)
