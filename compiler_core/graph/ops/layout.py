"""Blocked activation layouts: NCHW[b]c, the layout CPU convolutions keep between them.

A layout is a string: plain "NCW", "NCHW" or "NCDHW" (1, 2 or 3 spatial axes), or blocked
"NCW16c", "NCHW16c", "NCDHW16c" (channels split into blocks of 16, the block innermost:
[N, C/16, *spatial, 16]). `LayoutTransform` converts a value between the two; the layout
pass inserts it only at the edges of a chain of blocked convolutions.
"""

from __future__ import annotations

import re

import numpy as np

from compiler_core.graph.ir import OpKind, TensorType
from compiler_core.graph.ops.base import OpDef, ShapeError, opdef

PLAIN = "NCHW"
# Spatial axes by their count: the letters after "NC" in a layout's name.
SPATIAL = {1: "W", 2: "HW", 3: "DHW"}
_LAYOUT = re.compile(r"^NC(W|HW|DHW)(?:(\d+)c)?$")


def block_of(layout: str) -> int:
    """Channels per block of `layout` (0 for a plain one: NCW, NCHW, NCDHW)."""
    match = _LAYOUT.match(layout)
    if not match or (match.group(2) is not None and int(match.group(2)) < 1):
        raise ShapeError(
            f"unknown activation layout {layout!r} (expected NCW, NCHW or NCDHW, plain or "
            "with a channel block such as NCHW8c)"
        )
    return int(match.group(2) or 0)


def blocked_layout(block: int, rank: int = 4) -> str:
    """The name of the layout with `block` channels per block (0: plain) for data of `rank`
    axes in plain form ([N, C, *spatial])."""
    if rank - 2 not in SPATIAL:
        raise ShapeError(f"no activation layout for {rank}-D data (1 to 3 spatial axes)")
    name = f"NC{SPATIAL[rank - 2]}"
    return f"{name}{block}c" if block else name


def blocked_shape(shape, block: int) -> tuple[int, ...]:
    """The [N, C, *spatial] shape in NCHW[block]c."""
    if not block:
        return tuple(shape)
    n, c, *spatial = shape
    if c % block:
        raise ShapeError(f"{c} channels do not split into blocks of {block}")
    return (n, c // block, *spatial, block)


def plain_shape(shape, block: int) -> tuple[int, ...]:
    if not block:
        return tuple(shape)
    n, outer, *spatial, inner = shape
    if inner != block:
        raise ShapeError(f"shape {tuple(shape)} is not in NCHW{block}c")
    return (n, outer * block, *spatial)


def to_blocked(x: np.ndarray, block: int) -> np.ndarray:
    if not block:
        return x
    n, c, *spatial = x.shape
    split = x.reshape(n, c // block, block, *spatial)
    return np.ascontiguousarray(np.moveaxis(split, 2, -1))


def to_plain(x: np.ndarray, block: int) -> np.ndarray:
    if not block:
        return x
    n, outer, *spatial, inner = x.shape
    return np.ascontiguousarray(np.moveaxis(x, -1, 2)).reshape(n, outer * inner, *spatial)


def _transform_rule(node, types):
    (x,) = types
    source, target = block_of(node.attr("src_layout")), block_of(node.attr("dst_layout"))
    if x.rank < 3:
        raise ShapeError(f"LayoutTransform needs [N, C, ...] data, got {x}")
    return [TensorType(blocked_shape(plain_shape(x.shape, source), target), x.dtype)]


def _transform(node, inputs):
    source, target = block_of(node.attr("src_layout")), block_of(node.attr("dst_layout"))
    return [to_blocked(to_plain(inputs[0], source), target)]


OPS: dict[str, OpDef] = {
    "LayoutTransform": opdef("LayoutTransform", OpKind.INJECTIVE, _transform_rule, _transform),
}
