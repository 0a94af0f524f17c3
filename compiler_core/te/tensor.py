"""Tensors, compute declarations and reductions."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import numpy as np

from compiler_core.loop.ir import INDEX, Binary, Const, Expr, Select, Var, as_expr, maximum
from compiler_core.loop.transform import walk_exprs


def identifier(name: str) -> str:
    """A name usable as a symbol in generated code."""
    clean = re.sub(r"[^0-9a-zA-Z_]", "_", name)
    return clean if clean and not clean[0].isdigit() else f"t_{clean}"


@dataclasses.dataclass(frozen=True, eq=False)
class Tensor:
    name: str
    shape: tuple[int, ...]
    dtype: str
    op: ComputeOp | None = None  # None: a placeholder (an input)

    def __getitem__(self, indices) -> TensorRead:
        if not isinstance(indices, tuple):
            indices = (indices,)
        if len(indices) != len(self.shape):
            raise IndexError(f"tensor {self.name!r} has rank {len(self.shape)}, not {len(indices)}")
        return TensorRead(self, tuple(as_expr(i) for i in indices))

    @property
    def is_placeholder(self) -> bool:
        return self.op is None


@dataclasses.dataclass(frozen=True, eq=False)
class TensorRead(Expr):
    """A read of a tensor element; lowering turns it into a Load of the tensor's buffer."""

    CHILD_FIELDS = ("indices",)

    tensor: Tensor
    indices: tuple[Expr, ...]

    @property
    def dtype(self) -> str:  # type: ignore[override]
        return self.tensor.dtype


@dataclasses.dataclass(frozen=True)
class ReduceAxis(Var):
    """A reduction variable: usable in index expressions, with its extent."""

    extent: int = 0

    @property
    def var(self) -> Var:
        return Var(self.name, self.dtype)


@dataclasses.dataclass(frozen=True, eq=False)
class Reduction(Expr):
    """combiner over `axes` of `source`, starting from `init` (sum: 0, max: -inf, ...).
    The axes bind variables; only `source` is a child."""

    CHILD_FIELDS = ("source",)

    combiner: str
    source: Expr
    axes: tuple[ReduceAxis, ...]

    @property
    def dtype(self) -> str:  # type: ignore[override]
        return self.source.dtype

    @property
    def init(self):
        dtype = np.dtype(self.dtype)
        if self.combiner == "sum":
            return 0
        if self.combiner == "prod":
            return 1
        if dtype.kind == "b":
            return self.combiner == "min"  # max of no booleans is False, min is True
        if self.combiner == "max":
            return -np.inf if dtype.kind == "f" else np.iinfo(dtype).min
        if self.combiner == "min":
            return np.inf if dtype.kind == "f" else np.iinfo(dtype).max
        raise ValueError(f"unknown combiner {self.combiner!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class ComputeOp:
    name: str
    axes: tuple[Var, ...]
    body: Expr

    @property
    def reduction(self) -> Reduction | None:
        return self.body if isinstance(self.body, Reduction) else None


def placeholder(shape: Sequence[int], dtype: str, name: str) -> Tensor:
    return Tensor(identifier(name), tuple(int(d) for d in shape), dtype)


def reduce_axis(extent: int, name: str = "k") -> ReduceAxis:
    return ReduceAxis(identifier(name), extent=int(extent))


def compute(
    shape: Sequence[int], fn: Callable[..., Expr], name: str, dtype: str | None = None
) -> Tensor:
    name = identifier(name)
    axes = tuple(Var(f"{name}_i{k}") for k in range(len(shape)))
    body = as_expr(fn(*axes))
    op = ComputeOp(name, axes, body)
    return Tensor(name, tuple(int(d) for d in shape), dtype or body.dtype, op)


def _reduce(combiner: str, source: Expr, axes) -> Reduction:
    axes = tuple(axes) if isinstance(axes, (list, tuple)) else (axes,)
    return Reduction(combiner, as_expr(source), axes)


def reduce_sum(source: Expr, axes) -> Reduction:
    return _reduce("sum", source, axes)


def reduce_max(source: Expr, axes) -> Reduction:
    return _reduce("max", source, axes)


def reduce_prod(source: Expr, axes) -> Reduction:
    return _reduce("prod", source, axes)


def reduce_min(source: Expr, axes) -> Reduction:
    return _reduce("min", source, axes)


# --- loop-carried state ------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class RecurrenceOp:
    """A serial loop over `steps` time steps that carries states from one step to the next.

    Each state is a tensor [steps, *shape] whose row t is the state after step t. A step is
    a chain of ordinary stages (`stages`, producers first, each over its own axes) that read
    the previous row through `Previous` and tensors computed before the loop; its last stages
    (`updates`, one per state, named like their state) write row t. Lowered, it is one loop
    over t around the step's loop nests, so a 512-step recurrence is as small as a 4-step one.

    `recurrence()` builds it and fills it once; it is not frozen because the states read
    themselves (the step's stages refer to the state tensors that refer to this op).
    """

    name: str
    time: Var
    steps: int
    inits: tuple[Tensor, ...]
    states: tuple[Tensor, ...] = ()
    stages: tuple[Tensor, ...] = ()  # the step's stages in order; the updates are among them
    updates: tuple[Tensor, ...] = ()
    outside: tuple[Tensor, ...] = ()  # tensors computed before the loop that the step reads


class Previous:
    """The state before step t: the initial value at t = 0, else row t - 1 of the state."""

    def __init__(self, state: Tensor, init: Tensor, time: Var):
        self.state, self.init, self.time = state, init, time

    def __getitem__(self, indices) -> Expr:
        indices = indices if isinstance(indices, tuple) else (indices,)
        # The row index is clamped so that the unselected load at t = 0 stays in bounds.
        row = maximum(self.time - Const(1, INDEX), Const(0, INDEX))
        first = Binary("eq", self.time, Const(0, INDEX))
        return Select(first, self.init[indices], self.state[(row, *indices)])


class NestedRecurrenceError(ValueError):
    """A recurrence declared inside another's step: one loop level is what lowering knows."""


_open_steps: list[str] = []  # the recurrences whose step is being declared, outermost first


def recurrence(
    steps: int,
    inits: Sequence[Tensor],
    step: Callable[[Var, list[Previous]], Sequence[Callable[..., Expr]]],
    name: str,
) -> list[Tensor]:
    """States [steps, *init.shape] of a loop-carried computation.

    `step(t, previous)` declares one step: it may build stages with `compute` that read
    `previous[k][...]`, tensors computed outside, and the time `t`; it returns, per state, the
    body of the new state (a function of the state's axes, like a `compute` body).
    """
    if steps < 1:
        raise ValueError(f"recurrence {name!r}: {steps} steps")
    name = identifier(name)
    op = RecurrenceOp(name, Var(f"{name}_t"), int(steps), tuple(inits))
    op.states = tuple(
        Tensor(f"{name}_s{k}", (int(steps), *init.shape), init.dtype, op)
        for k, init in enumerate(inits)
    )
    previous = [Previous(s, i, op.time) for s, i in zip(op.states, op.inits, strict=True)]
    if _open_steps:
        raise NestedRecurrenceError(
            f"recurrence {name!r} is declared inside the step of {_open_steps[-1]!r}; nested "
            "recurrences are not supported"
        )
    _open_steps.append(name)
    try:
        bodies = list(step(op.time, previous))
    finally:
        _open_steps.pop()
    if len(bodies) != len(op.states):
        raise ValueError(f"recurrence {name!r}: {len(bodies)} updates for {len(op.states)} states")
    op.updates = tuple(
        compute(init.shape, body, state.name, init.dtype)
        for body, init, state in zip(bodies, op.inits, op.states, strict=True)
    )
    op.stages, op.outside = _step_stages(op)
    return list(op.states)


def _step_stages(op: RecurrenceOp) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """The stages that run inside the loop (they read a state, the time or another such
    stage), producers first, and the tensors outside it that they read."""
    inside: dict[int, bool] = {}
    order: list[Tensor] = []
    outside: list[Tensor] = []

    def visit(t: Tensor) -> bool:
        if id(t) in inside:
            return inside[id(t)]
        if t.op is op:
            return True
        if not isinstance(t.op, ComputeOp):
            inside[id(t)] = False
            return False
        reads = tensor_reads(t.op.body)
        flags = [visit(r) for r in reads]
        is_inside = any(flags) or _mentions(t.op.body, op.time)
        inside[id(t)] = is_inside
        if is_inside:
            order.append(t)
            outside.extend(r for r, f in zip(reads, flags, strict=True) if not f)
        return is_inside

    for update in op.updates:
        if not visit(update):  # a state that does not depend on the step still runs in it
            order.append(update)
            outside.extend(tensor_reads(update.op.body))
    unique_outside = list({id(t): t for t in outside if t.op is not op}.values())
    return tuple(order), tuple(unique_outside)


def tensor_reads(expr: Expr) -> list[Tensor]:
    """The tensors an expression reads, in first-read order."""
    found: dict[int, Tensor] = {}
    for e in walk_exprs(expr.source if isinstance(expr, Reduction) else expr):
        if isinstance(e, TensorRead):
            found.setdefault(id(e.tensor), e.tensor)
    return list(found.values())


def _mentions(expr: Expr, var: Var) -> bool:
    source = expr.source if isinstance(expr, Reduction) else expr
    return any(isinstance(e, Var) and e.name == var.name for e in walk_exprs(source))
