"""A scheduled group function -> device kernels.

A CPU kernel runs its stages one after another in one function; on a GPU, a stage that reads
what another stage of the group wrote needs every block of the writer to have finished, which
only a kernel boundary guarantees. So each top-level loop nest of the scheduled function
becomes a device kernel, and the group's intermediate (workspace) buffers become scratch
buffers in device memory that the plan allocates. A nest with no bound loop (a single
element) runs as a kernel of one thread.
"""

from __future__ import annotations

import dataclasses

from compiler_core.loop.ir import (
    Allocate,
    Block,
    Buffer,
    For,
    ForKind,
    Load,
    PrimFunc,
    Stmt,
    Store,
    Var,
)
from compiler_core.loop.transform import map_stmt, stmt_exprs, walk_exprs, walk_stmts


@dataclasses.dataclass(frozen=True)
class DeviceKernel:
    """One launch: its function (parameters are global buffers) and what each parameter is:
    ("param", k) for the group function's k-th parameter, ("scratch", name) for one of the
    group's intermediate buffers."""

    func: PrimFunc
    args: tuple[tuple[str, object], ...]


def _top_level(body: Stmt) -> tuple[list[Buffer], list[Stmt]]:
    scratch = []
    while isinstance(body, Allocate):
        if body.buffer.scope != "workspace":
            raise ValueError(f"buffer {body.buffer.name!r} ({body.buffer.scope}) at kernel level")
        scratch.append(body.buffer)
        body = body.body
    return scratch, list(body.stmts) if isinstance(body, Block) else [body]


def _buffers_used(stmt: Stmt) -> set[Buffer]:
    used = set()
    for s in walk_stmts(stmt):
        if isinstance(s, Store):
            used.add(s.buffer)
        for e in stmt_exprs(s):
            used |= {x.buffer for x in walk_exprs(e) if isinstance(x, Load)}
    return used


def _is_bound(stmt: Stmt) -> bool:
    return any(isinstance(s, For) and s.kind == ForKind.THREAD_BINDING for s in walk_stmts(stmt))


def _single_thread(stmt: Stmt, name: str) -> Stmt:
    thread = For(Var(f"{name}_tx"), 1, stmt, ForKind.THREAD_BINDING, "threadIdx.x")
    return For(Var(f"{name}_bx"), 1, thread, ForKind.THREAD_BINDING, "blockIdx.x")


def _as_global(stmt: Stmt, scratch: dict[Buffer, Buffer]) -> Stmt:
    def load(e):
        if isinstance(e, Load) and e.buffer in scratch:
            return Load(scratch[e.buffer], e.indices)
        return None

    def store(s):
        if isinstance(s, Store) and s.buffer in scratch:
            return Store(scratch[s.buffer], s.indices, s.value)
        return None

    return map_stmt(stmt, load, store)


def device_kernels(func: PrimFunc) -> tuple[list[DeviceKernel], list[Buffer]]:
    """The kernels of a scheduled group function, in launch order, and its scratch buffers
    (in global scope, as the kernels see them)."""
    scratch, nests = _top_level(func.body)
    globals_ = {b: dataclasses.replace(b, scope="global") for b in scratch}
    kernels = []
    nests = [n for n in nests if not (isinstance(n, Block) and not n.stmts)]
    for k, nest in enumerate(nests):
        name = func.name if len(nests) == 1 else f"{func.name}_{k}"
        if not _is_bound(nest):
            nest = _single_thread(nest, name)
        used = _buffers_used(nest)
        params, args = [], []
        for index, buffer in enumerate(func.params):
            if buffer in used:
                params.append(buffer)
                args.append(("param", index))
        for buffer in scratch:
            if buffer in used:
                params.append(globals_[buffer])
                args.append(("scratch", buffer.name))
        body = _as_global(nest, globals_)
        kernels.append(DeviceKernel(PrimFunc(name, tuple(params), body), tuple(args)))
    return kernels, [globals_[b] for b in scratch]
