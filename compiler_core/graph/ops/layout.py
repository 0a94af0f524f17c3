"""Blocked activation layouts: NCHW[b]c, the layout CPU convolutions keep between them.

A layout is a string: plain "NCW", "NCHW" or "NCDHW" (1, 2 or 3 spatial axes), or blocked
"NCW16c", "NCHW16c", "NCDHW16c" (channels split into blocks of 16, the block innermost:
[N, ceil(C/16), *spatial, 16]). `LayoutTransform` converts a value between the two; the layout
pass inserts it only at the edges of a chain of blocked convolutions.

Channels that do not fill the last block are padded: the blocked form has whole blocks, and
the lanes past the real channels ("padding lanes") hold finite values of no meaning. A
conversion to blocked writes zeros there; a blocked conv gives them zero filters (so its output
there is its epilogue applied to zero) and reads its input's padding lanes with zero weights;
a conversion back to plain crops them. The plain channel count travels as the
`LayoutTransform`'s `channels` attribute, since the blocked shape rounds it up.
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


def blocks_for(channels: int, block: int) -> int:
    """Blocks of `block` channels that hold `channels` (the last one padded)."""
    return -(-channels // block)


def block_cost(channels: int, block: int, fma_lanes: int) -> int:
    """Cycles of FMAs per pixel and input channel of a conv with `channels` outputs in blocks
    of `block`: a vector instruction per block (the padding lanes computed too), each taking
    as many passes as it has `fma_lanes` groups. 24 channels: 3 blocks of 8 on Zen 4 (where
    16 lanes take two passes), 2 blocks of 16 on Zen 5 (one pass: 8-lane blocks ran the
    1x1 convs of MobileNetV2's 24-channel layers at half its rate)."""
    return blocks_for(channels, block) * -(-block // fma_lanes)


def blocked_shape(shape, block: int) -> tuple[int, ...]:
    """The [N, C, *spatial] shape in NCHW[block]c (C rounded up to whole blocks)."""
    if not block:
        return tuple(shape)
    n, c, *spatial = shape
    return (n, blocks_for(c, block), *spatial, block)


def plain_shape(shape, block: int, channels: int = 0) -> tuple[int, ...]:
    """The plain shape of NCHW[block]c data holding `channels` real channels (0: all its
    lanes, whole blocks)."""
    if not block:
        return tuple(shape)
    n, outer, *spatial, inner = shape
    if inner != block:
        raise ShapeError(f"shape {tuple(shape)} is not in NCHW{block}c")
    if channels and blocks_for(channels, block) != outer:
        raise ShapeError(f"{channels} channels do not fill {outer} blocks of {block}")
    return (n, channels or outer * block, *spatial)


def to_blocked(x: np.ndarray, block: int) -> np.ndarray:
    """Plain -> NCHW[block]c, zeros in the padding lanes."""
    if not block:
        return x
    n, c, *spatial = x.shape
    padding = blocks_for(c, block) * block - c
    if padding:
        x = np.concatenate([x, np.zeros((n, padding, *spatial), x.dtype)], axis=1)
    split = x.reshape(n, -1, block, *spatial)
    return np.ascontiguousarray(np.moveaxis(split, 2, -1))


def to_plain(x: np.ndarray, block: int, channels: int = 0) -> np.ndarray:
    """NCHW[block]c -> plain, the first `channels` channels (0: every lane)."""
    if not block:
        return x
    n, outer, *spatial, inner = x.shape
    plain = np.ascontiguousarray(np.moveaxis(x, -1, 2)).reshape(n, outer * inner, *spatial)
    return np.ascontiguousarray(plain[:, :channels]) if channels else plain


def transform_blocks(node) -> tuple[int, int, int]:
    """(source block, target block, plain channels; 0: whole blocks) of a LayoutTransform."""
    return (
        block_of(node.attr("src_layout")),
        block_of(node.attr("dst_layout")),
        node.attr("channels", 0),
    )


def _transform_rule(node, types):
    (x,) = types
    source, target, channels = transform_blocks(node)
    if x.rank < 3:
        raise ShapeError(f"LayoutTransform needs [N, C, ...] data, got {x}")
    plain = plain_shape(x.shape, source, channels)
    return [TensorType(blocked_shape(plain, target), x.dtype)]


def _transform(node, inputs):
    source, target, channels = transform_blocks(node)
    return [to_blocked(to_plain(inputs[0], source, channels), target)]


OPS: dict[str, OpDef] = {
    "LayoutTransform": opdef("LayoutTransform", OpKind.INJECTIVE, _transform_rule, _transform),
}
