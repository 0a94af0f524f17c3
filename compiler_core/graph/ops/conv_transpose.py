"""ConvTranspose and DeformConv: the convolutions that are not plain Conv; InterleavePhases,
the data movement that finishes a ConvTranspose decomposed into a Conv; and Col2Im, which
adds image blocks back into an image (the adjoint of the im2col a conv reads through).

ConvTranspose's canonical attributes are pads, strides, dilations, group, output_padding and
output_shape (the resolved spatial output size; it decides the output type). DeformConv's are
pads, strides, dilations, group and offset_group; its kernel size comes from the weight.
Col2Im's are image_shape and block_shape (constant inputs in ONNX), pads, strides and
dilations.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from compiler_core.graph.ir import OpKind, TensorType
from compiler_core.graph.ops.base import OpDef, ShapeError, opdef


def _accumulation_dtype(dtype) -> np.dtype:
    """float32 at least, so half-precision inputs do not lose the sum."""
    return np.result_type(dtype, np.float32)


def _bias_shape(nsp: int) -> tuple[int, ...]:
    return (1, -1) + (1,) * nsp


# --- ConvTranspose ---------------------------------------------------------------------------


def _conv_transpose_rule(node, types):
    x, w = types[0], types[1]
    group = node.attr("group", 1)
    if x.rank < 3 or w.rank != x.rank:
        raise ShapeError(f"input {x} and weight {w} must have the same rank, at least 3")
    if x.shape[1] != w.shape[0] or x.shape[1] % group:
        raise ShapeError(f"weight {w} does not fit input {x} with group {group}")
    out_spatial = tuple(node.attr("output_shape"))
    if len(out_spatial) != x.rank - 2:
        raise ShapeError(f"output_shape {out_spatial} does not match input {x}")
    return [TensorType((x.shape[0], w.shape[1] * group, *out_spatial), x.dtype)]


def _conv_transpose(node, inputs):
    """Each input pixel scatters its channel mix times the kernel into the output.

    One batched matmul mixes channels for every kernel offset at once; each offset's slab is
    then added into the output canvas at a strided position. The canvas is the unpadded
    output; pads crop it (negative pads, from an oversized output_shape, add zero margin).
    """
    x, w = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    nsp = x.ndim - 2
    strides, dilations = node.attr("strides"), node.attr("dilations")
    pads, group = node.attr("pads"), node.attr("group", 1)
    out_spatial = node.attr("output_shape")
    kernel, in_spatial = w.shape[2:], x.shape[2:]
    n, channels = x.shape[:2]
    cg, mg = channels // group, w.shape[1]
    acc = _accumulation_dtype(x.dtype)

    # The canvas starts at -max(0, -pad_begin) in unpadded coordinates and covers the output.
    margin = [max(0, -pads[i]) for i in range(nsp)]
    natural = [
        strides[i] * (in_spatial[i] - 1) + (kernel[i] - 1) * dilations[i] + 1 for i in range(nsp)
    ]
    size = [max(natural[i], pads[i] + out_spatial[i]) + margin[i] for i in range(nsp)]
    canvas = np.zeros((n, group, mg, *size), acc)

    offsets = list(itertools.product(*[range(k) for k in kernel]))
    # x: (n, group, cg, P); w: (group, K * mg, cg) -> mixed: (n, group, K, mg, *in_spatial)
    xs = x.reshape(n, group, cg, -1).astype(acc, copy=False)
    ws = w.reshape(group, cg, mg, -1).transpose(0, 3, 2, 1).reshape(group, -1, cg).astype(acc)
    mixed = np.matmul(ws[None], xs).reshape(n, group, len(offsets), mg, *in_spatial)
    for index, offset in enumerate(offsets):
        start = [margin[i] + offset[i] * dilations[i] for i in range(nsp)]
        window = tuple(
            slice(start[i], start[i] + strides[i] * (in_spatial[i] - 1) + 1, strides[i])
            for i in range(nsp)
        )
        canvas[(slice(None), slice(None), slice(None), *window)] += mixed[:, :, index]

    crop = tuple(
        slice(margin[i] + pads[i], margin[i] + pads[i] + out_spatial[i]) for i in range(nsp)
    )
    out = canvas[(slice(None), slice(None), slice(None), *crop)]
    out = out.reshape(n, group * mg, *out_spatial)
    if bias is not None:
        out = out + bias.astype(acc).reshape(_bias_shape(nsp))
    return [np.ascontiguousarray(out, dtype=x.dtype)]


# --- InterleavePhases -----------------------------------------------------------------------
#
# The stride-phase decomposition of a ConvTranspose (passes/decompose_conv_transpose.py)
# computes every output phase as a channel of one Conv: channel m * S + phase, S = prod(s),
# phase the row-major index of (r1, .., rd), r_i in [0, s_i). This op puts phase r of grid
# row q at canvas position q * s + r and crops the canvas to the output:
#     out[n, m, o..] = x[n, m * S + phase((o + start) % s), (o + start) // s]


def _interleave_rule(node, types):
    x = types[0]
    strides, starts = node.attr("strides"), node.attr("starts")
    out_spatial = tuple(node.attr("output_shape"))
    nsp, phases = x.rank - 2, math.prod(strides)
    if nsp < 1 or not len(strides) == len(starts) == len(out_spatial) == nsp:
        raise ShapeError(f"strides {strides} and starts {starts} do not fit input {x}")
    if x.shape[1] % phases:
        raise ShapeError(f"input {x} has no whole group of {phases} phase channels")
    for i in range(nsp):
        if starts[i] < 0 or starts[i] + out_spatial[i] > x.shape[2 + i] * strides[i]:
            raise ShapeError(f"output {out_spatial} from {starts} leaves the canvas of {x}")
    return [TensorType((x.shape[0], x.shape[1] // phases, *out_spatial), x.dtype)]


def _interleave_phases(node, inputs):
    x = inputs[0]
    strides, starts = node.attr("strides"), node.attr("starts")
    out_spatial = node.attr("output_shape")
    n, channels, *rows = x.shape
    nsp = len(rows)
    split = x.reshape(n, channels // math.prod(strides), *strides, *rows)
    # (n, m, s1.., Q1..) -> (n, m, Q1, s1, Q2, s2, ..)
    perm = (0, 1, *[d for i in range(nsp) for d in (2 + nsp + i, 2 + i)])
    canvas_shape = [q * s for q, s in zip(rows, strides, strict=True)]
    canvas = split.transpose(perm).reshape(n, split.shape[1], *canvas_shape)
    crop = tuple(slice(b, b + size) for b, size in zip(starts, out_spatial, strict=True))
    return [np.ascontiguousarray(canvas[(slice(None), slice(None), *crop)])]


# --- DeformConv ------------------------------------------------------------------------------


def _deform_out_spatial(node, in_spatial, kernel) -> tuple[int, ...]:
    nsp = len(kernel)
    strides, dilations, pads = node.attr("strides"), node.attr("dilations"), node.attr("pads")
    return tuple(
        (in_spatial[i] + pads[i] + pads[i + nsp] - (kernel[i] - 1) * dilations[i] - 1) // strides[i]
        + 1
        for i in range(nsp)
    )


def _deform_conv_rule(node, types):
    x, w, offset = types[0], types[1], types[2]
    mask = types[4] if len(types) > 4 else None
    group, offset_group = node.attr("group", 1), node.attr("offset_group", 1)
    nsp = x.rank - 2
    kernel = w.shape[2:]
    if nsp < 1 or w.rank != x.rank:
        raise ShapeError(f"input {x} and weight {w} must have the same rank, at least 3")
    if x.shape[1] != w.shape[1] * group or w.shape[0] % group or x.shape[1] % offset_group:
        raise ShapeError(f"weight {w} does not fit input {x} with group {group}")
    out_spatial = _deform_out_spatial(node, x.shape[2:], kernel)
    taps = offset_group * math.prod(kernel)
    batch = (x.shape[0],)
    if offset.shape != (*batch, taps * nsp, *out_spatial):
        raise ShapeError(f"offset {offset} does not match {taps} taps over {out_spatial}")
    if mask is not None and mask.shape != (*batch, taps, *out_spatial):
        raise ShapeError(f"mask {mask} does not match {taps} taps over {out_spatial}")
    return [TensorType((x.shape[0], w.shape[0], *out_spatial), x.dtype)]


def _sample(image, positions):
    """Multilinear interpolation of image (n, c, *spatial) at positions (nsp, n, *out).

    Corners outside the image read zero, which is what the spec's zero padding means.
    Returns (n, c, *out).
    """
    n, c, *spatial = image.shape
    nsp = len(spatial)
    flat = image.reshape(n, c, -1)
    out_shape = positions.shape[2:]
    base = np.floor(positions)
    frac = positions - base
    base = base.astype(np.int64)
    result = np.zeros((n, c, math.prod(out_shape)), flat.dtype)
    for corner in itertools.product((0, 1), repeat=nsp):
        weight = np.ones(positions.shape[1:], flat.dtype)
        linear = np.zeros(positions.shape[1:], np.int64)
        inside = np.ones(positions.shape[1:], bool)
        for d in range(nsp):
            coord = base[d] + corner[d]
            weight = weight * (frac[d] if corner[d] else 1 - frac[d])
            inside &= (coord >= 0) & (coord < spatial[d])
            linear = linear * spatial[d] + np.clip(coord, 0, spatial[d] - 1)
        weight = np.where(inside, weight, 0).reshape(n, 1, -1)
        gathered = np.take_along_axis(flat, linear.reshape(n, 1, -1), axis=2)
        result += gathered * weight
    return result.reshape(n, c, *out_shape)


def _deform_conv(node, inputs):
    """Sample every kernel tap at its offset position (im2col with learned offsets), scale by
    the mask, then contract with the weight group by group."""
    x, w, offset = inputs[0], inputs[1], inputs[2]
    bias = inputs[3] if len(inputs) > 3 else None
    mask = inputs[4] if len(inputs) > 4 else None
    strides, dilations, pads = node.attr("strides"), node.attr("dilations"), node.attr("pads")
    group, offset_group = node.attr("group", 1), node.attr("offset_group", 1)
    acc = _accumulation_dtype(x.dtype)
    n, channels, *in_spatial = x.shape
    kernel = w.shape[2:]
    nsp, taps = len(kernel), math.prod(kernel)
    out_spatial = _deform_out_spatial(node, in_spatial, kernel)
    offset = offset.astype(acc).reshape(n, offset_group, taps, nsp, *out_spatial)
    if mask is None:
        mask = np.ones((n, offset_group, taps, *out_spatial), acc)
    mask = mask.astype(acc).reshape(n, offset_group, taps, *out_spatial)

    # Undeformed sampling grid: grid[d][tap, *out] = out * stride - pad + tap * dilation.
    tap_coords = np.array(list(itertools.product(*[range(k) for k in kernel]))).T
    grid = []
    for d in range(nsp):
        along = np.arange(out_spatial[d]) * strides[d] - pads[d]
        along = along.reshape([1] + [-1 if i == d else 1 for i in range(nsp)])
        taps_d = (tap_coords[d] * dilations[d]).reshape([-1] + [1] * nsp)
        grid.append(along + taps_d)

    cog = channels // offset_group
    columns = np.empty((n, channels, taps, *out_spatial), acc)
    for og in range(offset_group):
        image = x[:, og * cog : (og + 1) * cog].astype(acc)
        for tap in range(taps):
            positions = np.stack([grid[d][tap] + offset[:, og, tap, d] for d in range(nsp)])
            sampled = _sample(image, positions)
            columns[:, og * cog : (og + 1) * cog, tap] = sampled * mask[:, og, tap][:, None]

    # columns (n, group, cg * taps, P) contracted with w (group, mg, cg * taps).
    out_channels = w.shape[0]
    cols = columns.reshape(n, group, -1, math.prod(out_spatial))
    weights = w.astype(acc).reshape(group, out_channels // group, -1)
    out = np.matmul(weights[None], cols).reshape(n, out_channels, *out_spatial)
    if bias is not None:
        out = out + bias.astype(acc).reshape(_bias_shape(nsp))
    return [np.ascontiguousarray(out, dtype=x.dtype)]


# --- Col2Im ----------------------------------------------------------------------------------


def col2im_grid(node) -> tuple[int, ...]:
    """Block positions along each spatial axis: where a block of `block_shape` (dilated) fits
    the padded image at the strides."""
    image, block = node.attr("image_shape"), node.attr("block_shape")
    pads, strides, dilations = node.attr("pads"), node.attr("strides"), node.attr("dilations")
    nsp = len(image)
    grid = []
    for d in range(nsp):
        span = image[d] + pads[d] + pads[d + nsp] - dilations[d] * (block[d] - 1) - 1
        if span < 0:
            raise ShapeError(f"block {list(block)} does not fit image {list(image)} padded")
        grid.append(span // strides[d] + 1)
    return tuple(grid)


def _col2im_rule(node, types):
    (x,) = types[:1]
    image, block = tuple(node.attr("image_shape")), tuple(node.attr("block_shape"))
    if x.rank != 3 or len(image) != len(block) or not image:
        raise ShapeError(f"input {x} must be [N, C x block size, L] with image and block ranks")
    size = math.prod(block)
    if size <= 0 or x.shape[1] % size:
        raise ShapeError(f"input {x}: {x.shape[1]} rows are not whole blocks of {size}")
    if math.prod(col2im_grid(node)) != x.shape[2]:
        raise ShapeError(
            f"input {x}: {x.shape[2]} blocks, but {list(block)} blocks fit "
            f"{list(col2im_grid(node))} times in image {list(image)}"
        )
    return [TensorType((x.shape[0], x.shape[1] // size, *image), x.dtype)]


def _col2im(node, inputs):
    """Each block's values added at its place in the padded image, then the pads cropped."""
    x = inputs[0]
    image, block = tuple(node.attr("image_shape")), tuple(node.attr("block_shape"))
    pads, strides, dilations = node.attr("pads"), node.attr("strides"), node.attr("dilations")
    nsp, grid = len(image), col2im_grid(node)
    batch, channels = x.shape[0], x.shape[1] // math.prod(block)
    columns = x.reshape(batch, channels, *block, *grid)
    padded = np.zeros(
        (batch, channels, *(image[d] + pads[d] + pads[d + nsp] for d in range(nsp))), x.dtype
    )
    for offset in itertools.product(*(range(k) for k in block)):
        window = tuple(
            slice(
                offset[d] * dilations[d],
                offset[d] * dilations[d] + strides[d] * (grid[d] - 1) + 1,
                strides[d],
            )
            for d in range(nsp)
        )
        padded[(slice(None), slice(None), *window)] += columns[(slice(None), slice(None), *offset)]
    crop = tuple(slice(pads[d], pads[d] + image[d]) for d in range(nsp))
    return [np.ascontiguousarray(padded[(slice(None), slice(None), *crop)])]


OPS: dict[str, OpDef] = {
    "Col2Im": opdef("Col2Im", OpKind.OUT_ELEMWISE_FUSABLE, _col2im_rule, _col2im),
    "ConvTranspose": opdef(
        "ConvTranspose", OpKind.OUT_ELEMWISE_FUSABLE, _conv_transpose_rule, _conv_transpose
    ),
    "DeformConv": opdef("DeformConv", OpKind.OUT_ELEMWISE_FUSABLE, _deform_conv_rule, _deform_conv),
    "InterleavePhases": opdef(
        "InterleavePhases", OpKind.INJECTIVE, _interleave_rule, _interleave_phases
    ),
}
