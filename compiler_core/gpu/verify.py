"""Checks every device kernel must pass before code is generated for it: named checks, as in
`loop/verify.py`, each yielding problems; a failure names the check, the numbers and the
kernel.

- `launch_fits`: threads per block, grid size, shared memory and per-thread registers within
  the target's limits;
- `bindings_consistent`: a binding tag has one extent wherever it is bound;
- `stores_inside_threads`: every store to global or shared memory happens inside the
  kernel's thread bindings (outside them every thread would perform it);
- `barriers_uniform`: no barrier under a condition inside the thread bindings (threads that
  skip it would wait forever for the others);
- `shared_races`: a shared buffer written by one thread and read by another (or read and
  then overwritten) with no barrier between the two accesses.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

from compiler_core.gpu.launch import bound_extents, launch_dims
from compiler_core.loop.ir import (
    THREAD_TAGS,
    Allocate,
    Barrier,
    Expr,
    For,
    ForKind,
    IfThenElse,
    Load,
    PrimFunc,
    Stmt,
    Store,
    Var,
)
from compiler_core.loop.printer import format_expr, format_func
from compiler_core.loop.transform import stmt_exprs, walk_exprs, walk_stmts
from compiler_core.loop.verify import verify
from compiler_core.target import GpuLimits, Target, gpu_limits

MAX_GRID = (2**31 - 1, 65535, 65535)


class GpuScheduleError(ValueError):
    def __init__(self, check: str, problems: list[str], func: PrimFunc):
        listing = "\n".join(f"  - {p}" for p in problems[:20])
        super().__init__(
            f"GPU check {check!r} failed for {func.name}:\n{listing}\n{format_func(func)}"
        )
        self.check = check
        self.problems = problems


def shared_bytes(func: PrimFunc) -> int:
    return sum(
        s.buffer.nbytes
        for s in walk_stmts(func.body)
        if isinstance(s, Allocate) and s.buffer.scope == "shared"
    )


def local_words(func: PrimFunc) -> int:
    """32-bit registers the kernel's local arrays need (all of them live at once, at most)."""
    return sum(
        -(-s.buffer.nbytes // 4)
        for s in walk_stmts(func.body)
        if isinstance(s, Allocate) and s.buffer.scope == "local"
    )


def launch_fits(func: PrimFunc, limits: GpuLimits) -> Iterator[str]:
    grid, block = launch_dims(func)
    threads, most = math.prod(block), limits.max_threads_per_block
    if threads > most:
        yield f"{threads} threads per block {block} exceed the limit of {most}"
    for axis, (size, largest) in enumerate(zip(grid, MAX_GRID, strict=True)):
        if size > largest:
            yield f"grid dimension {'xyz'[axis]} of {size} blocks exceeds {largest}"
    used, room = shared_bytes(func), limits.max_shared_bytes
    if used > room:
        yield f"{used} bytes of shared memory per block exceed the limit of {room}"
    words = local_words(func)
    if words > limits.max_registers_per_thread:
        yield (
            f"local arrays of {words} 32-bit words per thread exceed the "
            f"{limits.max_registers_per_thread} registers a thread can have"
        )


def bindings_consistent(func: PrimFunc) -> Iterator[str]:
    try:
        bound_extents(func)
    except ValueError as err:
        yield str(err)


def _thread_regions(func: PrimFunc) -> list[For]:
    """The outermost thread-bound loops: the code inside runs once per thread."""
    regions: list[For] = []

    def visit(s: Stmt) -> None:
        if isinstance(s, For) and s.binding in THREAD_TAGS:
            regions.append(s)
            return
        for c in s.children():
            if isinstance(c, Stmt):
                visit(c)

    visit(func.body)
    return regions


def stores_inside_threads(func: PrimFunc) -> Iterator[str]:
    if not any(isinstance(s, For) and s.binding in THREAD_TAGS for s in walk_stmts(func.body)):
        return

    def visit(s: Stmt) -> Iterator[str]:
        if isinstance(s, For) and s.binding in THREAD_TAGS:
            return
        if isinstance(s, Store) and s.buffer.scope in ("global", "shared"):
            yield f"store to {s.buffer.name!r} outside the thread bindings (every thread does it)"
        for c in s.children():
            if isinstance(c, Stmt):
                yield from visit(c)

    yield from visit(func.body)


def barriers_uniform(func: PrimFunc) -> Iterator[str]:
    def visit(s: Stmt, conditions: tuple[Expr, ...]) -> Iterator[str]:
        if isinstance(s, Barrier) and conditions:
            yield f"barrier under the condition {format_expr(conditions[-1])}"
        inner = (*conditions, s.cond) if isinstance(s, IfThenElse) else conditions
        for c in s.children():
            if isinstance(c, Stmt):
                yield from visit(c, inner)

    for region in _thread_regions(func):
        yield from visit(region.body, ())


def _thread_vars(region: For) -> set[str]:
    return {region.var.name} | {
        s.var.name
        for s in walk_stmts(region.body)
        if isinstance(s, For) and s.kind == ForKind.THREAD_BINDING
    }


class _Phase:
    """Shared-memory accesses since the last barrier: buffer -> index tuples, as text."""

    def __init__(self, thread_vars: set[str]):
        self.thread_vars = thread_vars
        self.writes: dict[str, set[tuple[str, ...]]] = {}
        self.reads: dict[str, set[tuple[str, ...]]] = {}

    def private(self, indices: tuple[Expr, ...]) -> bool:
        """Whether an element index names a different element for every thread (it uses
        every thread variable): then only its own thread touches it at this index form."""
        names = {x.name for i in indices for x in walk_exprs(i) if isinstance(x, Var)}
        return self.thread_vars <= names

    def access(self, buffer: str, indices: tuple[Expr, ...], write: bool) -> Iterator[str]:
        key = tuple(format_expr(i) for i in indices)
        private = self.private(indices)
        here = f"{buffer}[{', '.join(key)}]"
        conflicts = [
            ("written after a read of", self.reads),
            ("written after a write of", self.writes),
        ]
        if not write:
            conflicts = [("read after a write of", self.writes)]
        for what, earlier in conflicts:
            for other in earlier.get(buffer, ()):
                if not (private and other == key):  # the same thread's own element is fine
                    there = f"{buffer}[{', '.join(other)}]"
                    yield f"{here} {what} {there} by another thread, with no barrier between"
        (self.writes if write else self.reads).setdefault(buffer, set()).add(key)


def _walk_phases(s: Stmt, phase: _Phase) -> Iterator[str]:
    if isinstance(s, Barrier):
        phase.writes.clear()
        phase.reads.clear()
        return
    if isinstance(s, (Store, IfThenElse)):
        for e in stmt_exprs(s):
            for x in walk_exprs(e):
                if isinstance(x, Load) and x.buffer.scope == "shared":
                    yield from phase.access(x.buffer.name, x.indices, write=False)
        if isinstance(s, Store) and s.buffer.scope == "shared":
            yield from phase.access(s.buffer.name, s.indices, write=True)
    if isinstance(s, For) and s.kind != ForKind.THREAD_BINDING and s.extent > 1:
        # Twice: what the end of one iteration does meets what the start of the next does.
        yield from _walk_phases(s.body, phase)
        yield from _walk_phases(s.body, phase)
        return
    for c in s.children():
        if isinstance(c, Stmt):
            yield from _walk_phases(c, phase)


def shared_races(func: PrimFunc) -> Iterator[str]:
    for region in _thread_regions(func):
        seen: set[str] = set()
        for problem in _walk_phases(region.body, _Phase(_thread_vars(region))):
            if problem not in seen:
                seen.add(problem)
                yield problem


CHECKS: dict[str, Callable[[PrimFunc, GpuLimits], Iterator[str]]] = {
    "launch_fits": launch_fits,
    "bindings_consistent": lambda func, _: bindings_consistent(func),
    "stores_inside_threads": lambda func, _: stores_inside_threads(func),
    "barriers_uniform": lambda func, _: barriers_uniform(func),
    "shared_races": lambda func, _: shared_races(func),
}


def verify_device(func: PrimFunc, target: Target) -> PrimFunc:
    """The loop-IR checks, then the GPU checks for `target`'s limits."""
    verify(func)
    limits = gpu_limits(target)
    for name, check in CHECKS.items():
        problems = list(check(func, limits))
        if problems:
            raise GpuScheduleError(name, problems, func)
    return func
