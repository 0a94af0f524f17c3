"""Launch configuration of a device kernel, read off its bound loops."""

from __future__ import annotations

from compiler_core.loop.ir import BLOCK_TAGS, THREAD_TAGS, For, ForKind, PrimFunc
from compiler_core.loop.transform import walk_stmts

Dims = tuple[int, int, int]


def bound_extents(func: PrimFunc) -> dict[str, int]:
    """Each binding tag's extent; a tag bound twice must be bound with one extent."""
    extents: dict[str, int] = {}
    for stmt in walk_stmts(func.body):
        if isinstance(stmt, For) and stmt.kind == ForKind.THREAD_BINDING:
            known = extents.setdefault(stmt.binding, stmt.extent)
            if known != stmt.extent:
                raise ValueError(
                    f"{func.name}: {stmt.binding} is bound with extents {known} and {stmt.extent}"
                )
    return extents


def launch_dims(func: PrimFunc) -> tuple[Dims, Dims]:
    """(grid, block): blockIdx.x/y/z and threadIdx.x/y/z extents, 1 where a tag is unbound."""
    extents = bound_extents(func)
    grid = tuple(extents.get(tag, 1) for tag in BLOCK_TAGS)
    block = tuple(extents.get(tag, 1) for tag in THREAD_TAGS)
    return grid, block  # type: ignore[return-value]


def threads_per_block(func: PrimFunc) -> int:
    x, y, z = launch_dims(func)[1]
    return x * y * z
