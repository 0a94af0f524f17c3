"""Tensors, compute declarations and reductions."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

import numpy as np

from compiler_core.loop.ir import Expr, Var, as_expr


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
