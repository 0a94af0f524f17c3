"""Loop IR: typed buffers, loops with kinds, loads and stores, allocations, conditionals.

One immutable node family per level: `Expr` for values (index arithmetic and data math),
`Stmt` for effects. Every loop runs from 0 to `extent`. Python operators on expressions build
IR, which is what tensor-expression bodies are written with.

Every node names its child fields in `CHILD_FIELDS`; `children()` and `with_children()` are
generic over them, so that rewriting, walking and simplifying need no per-node code and a new
node is one class here (plus its meaning in the printer, interpreter and code generators).

GPU kernels use the same nodes: loops bound to `blockIdx.x` ... `threadIdx.z`
(`ForKind.THREAD_BINDING`), buffers in `shared` scope (one copy per thread block), `Barrier`
(every thread of the block waits), and `Call` for warp intrinsics (`shfl_down`, `shfl_xor`).
"""

from __future__ import annotations

import dataclasses
import enum
import operator
from typing import Any, ClassVar

import numpy as np

INDEX = "int64"


class ForKind(enum.Enum):
    SERIAL = "serial"
    PARALLEL = "parallel"
    VECTORIZED = "vectorized"
    UNROLLED = "unrolled"
    # A GPU loop whose iterations are blocks or threads: `For.binding` names which.
    THREAD_BINDING = "thread_binding"


BLOCK_TAGS = ("blockIdx.x", "blockIdx.y", "blockIdx.z")
THREAD_TAGS = ("threadIdx.x", "threadIdx.y", "threadIdx.z")
BINDINGS = BLOCK_TAGS + THREAD_TAGS
SCOPES = ("global", "local", "workspace", "shared")


class Node:
    """What every IR node shares: its children (expressions and statements) in field order."""

    CHILD_FIELDS: ClassVar[tuple[str, ...]] = ()

    def children(self) -> tuple:
        found: list = []
        for field in self.CHILD_FIELDS:
            value = getattr(self, field)
            if isinstance(value, tuple):
                found.extend(value)
            elif value is not None:
                found.append(value)
        return tuple(found)

    def with_children(self, children):
        """The same node over `children` (in `children()` order); itself when none changed."""
        children = tuple(children)
        changes, k = {}, 0
        for field in self.CHILD_FIELDS:
            value = getattr(self, field)
            if isinstance(value, tuple):
                changes[field] = children[k : k + len(value)]
                k += len(value)
            elif value is not None:
                changes[field] = children[k]
                k += 1
        if k != len(children):
            raise ValueError(f"{type(self).__name__} has {k} children, not {len(children)}")
        if all(
            new is old
            or isinstance(new, tuple)
            and all(a is b for a, b in zip(new, old, strict=True))
            for new, old in ((changes[f], getattr(self, f)) for f in changes)
        ):
            return self
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Buffer:
    """A typed n-d array. `scope`: global (a kernel argument), local (registers/stack, one per
    thread), workspace (carved from the module's preallocated workspace) or shared (GPU: one
    per thread block, visible to all its threads)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    scope: str = "global"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        if self.scope not in SCOPES:
            raise ValueError(f"buffer {self.name!r}: unknown scope {self.scope!r}")

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * np.dtype(self.dtype).itemsize

    def __getitem__(self, indices) -> Load:
        if not isinstance(indices, tuple):
            indices = (indices,)
        return Load(self, tuple(as_expr(i) for i in indices))


# --- expressions -------------------------------------------------------------------------------


class Expr(Node):
    """Base of every expression; subclasses are frozen dataclasses with a `dtype`."""

    dtype: str

    def _bin(self, op, other, swap=False):
        other = as_expr(other, self.dtype if not isinstance(other, Expr) else None)
        a, b = (other, self) if swap else (self, other)
        return Binary(op, a, b)

    def __add__(self, o):
        return self._bin("add", o)

    def __radd__(self, o):
        return self._bin("add", o, swap=True)

    def __sub__(self, o):
        return self._bin("sub", o)

    def __rsub__(self, o):
        return self._bin("sub", o, swap=True)

    def __mul__(self, o):
        return self._bin("mul", o)

    def __rmul__(self, o):
        return self._bin("mul", o, swap=True)

    def __truediv__(self, o):
        return self._bin("div", o)

    def __rtruediv__(self, o):
        return self._bin("div", o, swap=True)

    def __floordiv__(self, o):
        return self._bin("floordiv", o)

    def __mod__(self, o):
        return self._bin("mod", o)

    def __neg__(self):
        return Unary("neg", self)

    def __lt__(self, o):
        return self._bin("lt", o)

    def __le__(self, o):
        return self._bin("le", o)

    def __gt__(self, o):
        return self._bin("gt", o)

    def __ge__(self, o):
        return self._bin("ge", o)

    def equals(self, o):
        """The IR comparison `self == o` (Python's == stays structural equality)."""
        return self._bin("eq", o)


@dataclasses.dataclass(frozen=True)
class Var(Expr):
    name: str
    dtype: str = INDEX


@dataclasses.dataclass(frozen=True)
class Const(Expr):
    value: Any
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "value", np.dtype(self.dtype).type(self.value).item())


# Comparison operators and what each computes (the interpreter evaluates them with these;
# simplify folds comparisons of constants with them).
COMPARE = {
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
    "eq": operator.eq,
    "ne": operator.ne,
}
COMPARISONS = tuple(COMPARE)
LOGICAL = ("and", "or")
ARITHMETIC = (
    "add",
    "sub",
    "mul",
    "div",
    "floordiv",
    "mod",
    "fmod",
    "min",
    "max",
    "pow",
    "shl",
    "shr",
    "xor",
    "bitand",
    "bitor",
)


@dataclasses.dataclass(frozen=True)
class Binary(Expr):
    CHILD_FIELDS = ("a", "b")
    op: str
    a: Expr
    b: Expr

    def __post_init__(self) -> None:
        if self.op not in ARITHMETIC + COMPARISONS + LOGICAL:
            raise ValueError(f"unknown binary operator {self.op!r}")

    @property
    def dtype(self) -> str:  # type: ignore[override]
        return "bool" if self.op in COMPARISONS + LOGICAL else self.a.dtype


# Math intrinsics the code generators map to LLVM intrinsics or libm calls.
UNARY_OPS = (
    "sign",
    "tan",
    "asin",
    "acos",
    "atan",
    "sinh",
    "cosh",
    "asinh",
    "acosh",
    "atanh",
    "neg",
    "not",
    "abs",
    "exp",
    "log",
    "sqrt",
    "tanh",
    "erf",
    "sigmoid",
    "floor",
    "ceil",
    "round",
    "sin",
    "cos",
    "rsqrt",
)


@dataclasses.dataclass(frozen=True)
class Unary(Expr):
    CHILD_FIELDS = ("a",)
    op: str
    a: Expr

    def __post_init__(self) -> None:
        if self.op not in UNARY_OPS:
            raise ValueError(f"unknown unary operator {self.op!r}")

    @property
    def dtype(self) -> str:  # type: ignore[override]
        return self.a.dtype


@dataclasses.dataclass(frozen=True)
class Select(Expr):
    CHILD_FIELDS = ("cond", "a", "b")
    cond: Expr
    a: Expr
    b: Expr

    @property
    def dtype(self) -> str:  # type: ignore[override]
        return self.a.dtype


@dataclasses.dataclass(frozen=True)
class Cast(Expr):
    CHILD_FIELDS = ("a",)
    dtype: str
    a: Expr


@dataclasses.dataclass(frozen=True)
class Load(Expr):
    CHILD_FIELDS = ("indices",)
    buffer: Buffer
    indices: tuple[Expr, ...]

    @property
    def dtype(self) -> str:  # type: ignore[override]
        return self.buffer.dtype


# Warp intrinsics: (value, lane offset) -> the value held by another lane of the warp.
WARP_INTRINSICS = ("shfl_down", "shfl_xor")
WARP_SIZE = 32


@dataclasses.dataclass(frozen=True)
class Call(Expr):
    """An intrinsic the code generators know by name (the warp shuffles)."""

    CHILD_FIELDS = ("args",)
    name: str
    args: tuple[Expr, ...]
    dtype: str

    def __post_init__(self) -> None:
        if self.name not in WARP_INTRINSICS:
            raise ValueError(f"unknown intrinsic {self.name!r}")


def as_expr(value, dtype: str | None = None) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, (bool, np.bool_)):
        return Const(bool(value), "bool")
    if isinstance(value, (int, np.integer)):
        return Const(int(value), dtype if dtype and dtype != "bool" else INDEX)
    if isinstance(value, (float, np.floating)):
        return Const(float(value), dtype if dtype and np.dtype(dtype).kind == "f" else "float32")
    raise TypeError(f"cannot make a loop-IR expression from {value!r}")


def const(value, dtype: str) -> Const:
    return Const(value, dtype)


def minimum(a, b) -> Expr:
    a = as_expr(a)
    return Binary("min", a, as_expr(b, a.dtype))


def maximum(a, b) -> Expr:
    a = as_expr(a)
    return Binary("max", a, as_expr(b, a.dtype))


def select(cond, a, b) -> Expr:
    a = as_expr(a)
    return Select(as_expr(cond), a, as_expr(b, a.dtype))


def cast(dtype: str, a) -> Expr:
    return Cast(dtype, as_expr(a))


def unary(op: str, a) -> Expr:
    return Unary(op, as_expr(a))


def logical_and(a, b) -> Expr:
    return Binary("and", as_expr(a), as_expr(b))


def logical_or(a, b) -> Expr:
    return Binary("or", as_expr(a), as_expr(b))


# --- statements --------------------------------------------------------------------------------


class Stmt(Node):
    """Base of every statement."""


@dataclasses.dataclass(frozen=True)
class For(Stmt):
    CHILD_FIELDS = ("body",)
    var: Var
    extent: int
    body: Stmt
    kind: ForKind = ForKind.SERIAL
    binding: str | None = None  # with THREAD_BINDING: "blockIdx.x", "threadIdx.y", ...

    def __post_init__(self) -> None:
        object.__setattr__(self, "extent", int(self.extent))
        if (self.kind == ForKind.THREAD_BINDING) != (self.binding is not None):
            raise ValueError(f"loop {self.var.name!r}: a binding goes with THREAD_BINDING")
        if self.binding is not None and self.binding not in BINDINGS:
            raise ValueError(f"loop {self.var.name!r}: unknown binding {self.binding!r}")


@dataclasses.dataclass(frozen=True)
class Store(Stmt):
    CHILD_FIELDS = ("indices", "value")
    buffer: Buffer
    indices: tuple[Expr, ...]
    value: Expr

    def __post_init__(self) -> None:
        object.__setattr__(self, "indices", tuple(as_expr(i) for i in self.indices))


@dataclasses.dataclass(frozen=True)
class Prefetch(Stmt):
    """A hint that the cache line holding element `offset` of `buffer` (counted row-major
    over its whole shape) will be read soon: the CPU code generator asks for it in L2
    (`llvm.prefetch`). It changes no value: the interpreter and the GPU renderers skip it. A
    prefetch cannot fault, but schedules keep the offset inside the buffer all the same."""

    CHILD_FIELDS = ("offset",)
    buffer: Buffer
    offset: Expr


@dataclasses.dataclass(frozen=True)
class Allocate(Stmt):
    CHILD_FIELDS = ("body",)
    buffer: Buffer
    body: Stmt


@dataclasses.dataclass(frozen=True)
class IfThenElse(Stmt):
    CHILD_FIELDS = ("cond", "then", "otherwise")
    cond: Expr
    then: Stmt
    otherwise: Stmt | None = None


@dataclasses.dataclass(frozen=True)
class Block(Stmt):
    CHILD_FIELDS = ("stmts",)
    stmts: tuple[Stmt, ...]

    def __post_init__(self) -> None:
        flat: list[Stmt] = []
        for stmt in self.stmts:
            flat.extend(stmt.stmts if isinstance(stmt, Block) else (stmt,))
        object.__setattr__(self, "stmts", tuple(flat))


@dataclasses.dataclass(frozen=True)
class Barrier(Stmt):
    """GPU: every thread of the block waits here, and sees the shared-memory writes made
    before it (`__syncthreads()`, OpenCL's `barrier(CLK_LOCAL_MEM_FENCE)`)."""


def seq(*stmts: Stmt) -> Stmt:
    block = Block(tuple(s for s in stmts if s is not None))
    return block.stmts[0] if len(block.stmts) == 1 else block


@dataclasses.dataclass(frozen=True)
class PrimFunc:
    """One kernel: its buffer parameters (inputs then outputs) and its body."""

    name: str
    params: tuple[Buffer, ...]
    body: Stmt

    @property
    def key(self) -> str:
        import hashlib

        from compiler_core.loop.printer import format_func

        return hashlib.sha256(format_func(self).encode()).hexdigest()
