"""Loop-IR verifier: small named checks; a failure names the check and prints the function."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from compiler_core.loop.ir import (
    Allocate,
    Buffer,
    For,
    ForKind,
    Load,
    Prefetch,
    PrimFunc,
    Stmt,
    Store,
    Var,
)
from compiler_core.loop.printer import format_func
from compiler_core.loop.transform import stmt_exprs, walk_exprs, walk_stmts


class LoopVerificationError(ValueError):
    def __init__(self, check: str, problems: list[str], func: PrimFunc):
        listing = "\n".join(f"  - {p}" for p in problems[:20])
        super().__init__(f"loop IR check {check!r} failed:\n{listing}\n{format_func(func)}")
        self.check = check


def _scoped(func: PrimFunc) -> Iterator[tuple[Stmt, frozenset[str], frozenset[Buffer]]]:
    """Every statement with the loop variables and buffers in scope where it stands."""
    stack = [(func.body, frozenset(), frozenset(func.params))]
    while stack:
        stmt, names, buffers = stack.pop()
        yield stmt, names, buffers
        if isinstance(stmt, For):
            stack.append((stmt.body, names | {stmt.var.name}, buffers))
        elif isinstance(stmt, Allocate):
            stack.append((stmt.body, names, buffers | {stmt.buffer}))
        else:
            children = [c for c in stmt.children() if isinstance(c, Stmt)]
            stack.extend((c, names, buffers) for c in children)


def vars_bound(func: PrimFunc) -> Iterator[str]:
    for stmt, names, _ in _scoped(func):
        for e in stmt_exprs(stmt):
            for x in walk_exprs(e):
                if isinstance(x, Var) and x.name not in names:
                    yield f"variable {x.name!r} used outside any loop that binds it"


def buffers_in_scope(func: PrimFunc) -> Iterator[str]:
    for stmt, _, buffers in _scoped(func):
        used = [stmt.buffer] if isinstance(stmt, (Store, Prefetch)) else []
        for e in stmt_exprs(stmt):
            used += [x.buffer for x in walk_exprs(e) if isinstance(x, Load)]
        for buffer in used:
            if buffer not in buffers:
                yield f"buffer {buffer.name!r} used where it is neither a parameter nor allocated"


def index_ranks(func: PrimFunc) -> Iterator[str]:
    for stmt in walk_stmts(func.body):
        accesses = [stmt] if isinstance(stmt, Store) else []
        for e in stmt_exprs(stmt):
            accesses += [x for x in walk_exprs(e) if isinstance(x, Load)]
        for access in accesses:
            if len(access.indices) != len(access.buffer.shape):
                yield f"{access.buffer.name!r} indexed with {len(access.indices)} indices"


def store_types(func: PrimFunc) -> Iterator[str]:
    for stmt in walk_stmts(func.body):
        if isinstance(stmt, Store) and stmt.value.dtype != stmt.buffer.dtype:
            buffer = stmt.buffer
            yield f"store of {stmt.value.dtype} into {buffer.dtype} buffer {buffer.name!r}"


def loops_well_formed(func: PrimFunc) -> Iterator[str]:
    seen: set[str] = set()
    for stmt in walk_stmts(func.body):
        if not isinstance(stmt, For):
            continue
        if stmt.extent <= 0:
            yield f"loop {stmt.var.name!r} has extent {stmt.extent}"
        if stmt.var.name in seen:
            yield f"loop variable {stmt.var.name!r} is bound twice"
        seen.add(stmt.var.name)
        if stmt.kind == ForKind.VECTORIZED and any(
            isinstance(s, For) for s in walk_stmts(stmt.body)
        ):
            yield f"vectorized loop {stmt.var.name!r} is not innermost"


CHECKS: dict[str, Callable[[PrimFunc], Iterator[str]]] = {
    "vars_bound": vars_bound,
    "buffers_in_scope": buffers_in_scope,
    "index_ranks": index_ranks,
    "store_types": store_types,
    "loops_well_formed": loops_well_formed,
}


def verify(func: PrimFunc) -> PrimFunc:
    for name, check in CHECKS.items():
        problems = list(check(func))
        if problems:
            raise LoopVerificationError(name, problems, func)
    return func
