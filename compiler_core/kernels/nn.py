"""Heavy operators: convolution, dense algebra and pooling, as tensor expressions.

Weights are repacked at build time into the layouts the default schedules read with unit
stride: a dense B into NR-wide column panels `[N/NR, K, NR]` (NR two vector registers wide),
conv weights into output channel blocks of one vector `[M/b, C/g, KH, KW, b]`. Padding becomes
its own stage, so the inner loops of a convolution never test bounds.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import string

import numpy as np

from compiler_core.codegen.llvm import one_vector_load
from compiler_core.graph.ir import Node
from compiler_core.graph.ops.conv_transpose import col2im_grid
from compiler_core.graph.ops.layout import block_cost
from compiler_core.graph.ops.nn import conv_layouts, spatial_params
from compiler_core.kernels.base import Builder, KernelContext, KernelError, broadcast_index
from compiler_core.kernels.injective import clamp, flatten, padded_row, unflatten
from compiler_core.kernels.schedules import (
    GEMM_COLUMN_STEP,
    gemm_row_tile,
    nchwc_row_width,
    packed_row_tile,
)
from compiler_core.kernels.strassen import (
    LEVELS,
    STRASSEN,
    STRASSEN2,
    STRASSEN_PACKED,
    combined_weights,
    gemm_algorithms,
    input_sums,
    output_sums,
    packed_input_sums,
)
from compiler_core.kernels.winograd import (
    default_algorithm,
    input_padding,
    spatial_algorithms,
    tile_grid,
    winograd_conv,
    winograd_size,
)
from compiler_core.loop.ir import INDEX, Binary, Cast, Const, Expr, Select, Unary, logical_and
from compiler_core.te import Tensor, compute, reduce_axis, reduce_max, reduce_min, reduce_sum


def _padded(ctx: KernelContext, node: Node, x: Tensor, pads, fill, nsp: int = 0) -> Tensor:
    """`x` padded on its spatial axes 2 .. 2+nsp (all axes after the first two by default;
    a blocked layout passes nsp so its channel-block axis is left alone)."""
    nsp = nsp or len(x.shape) - 2
    if not any(pads):
        return x
    shape = tuple(
        d + pads[k - 2] + pads[k - 2 + nsp] if 2 <= k < 2 + nsp else d
        for k, d in enumerate(x.shape)
    )

    def body(*i):
        source, inside = list(i[:2]), None
        for k in range(nsp):
            s = i[2 + k] - Const(pads[k], INDEX)
            ok = logical_and(s >= Const(0, INDEX), s < Const(x.shape[2 + k], INDEX))
            inside = ok if inside is None else logical_and(inside, ok)
            source.append(clamp(s, x.shape[2 + k]))
        source.extend(i[2 + nsp :])
        return Select(inside, x[tuple(source)], Const(fill, x.dtype))

    return compute(shape, body, ctx.stage_name(node, prefix="pad"))


def _input_channel(o, c, group: int, per_group_out: int, per_group_in: int):
    """The input channel a grouped conv's output channel `o` reads at reduction index `c`:
    affine where it can be (a depthwise conv's is o + c), so that a compute_at of its padded
    input takes one channel plane."""
    if group == 1:
        return c
    first = o if per_group_out == 1 else Binary("floordiv", o, Const(per_group_out, INDEX))
    return (first if per_group_in == 1 else first * Const(per_group_in, INDEX)) + c


def _same_index(*index):
    return index


def _window_index(i, ks, strides, dilations):
    return tuple(
        o * Const(s, INDEX) + k * Const(d, INDEX)
        for o, k, s, d in zip(i, ks, strides, dilations, strict=True)
    )


def _conv(ctx: KernelContext, node: Node):
    if any(conv_layouts(node)):
        return _conv_nchwc(ctx, node)
    x_type, w_type = ctx.type(node.inputs[0]), ctx.type(node.inputs[1])
    if ctx.is_constant(node.inputs[1]) and im2col_conv(
        x_type.shape, w_type.shape, node.attr("group", 1), x_type.dtype
    ):
        return _conv_im2col(ctx, node)
    x = ctx.tensor(node.inputs[0])
    out = ctx.type(node.outputs[0])
    nsp = len(x.shape) - 2
    pads, strides, dilations = spatial_params(node, nsp)
    group = node.attr("group", 1)
    m, cg = w_type.shape[0], w_type.shape[1]
    mg = m // group
    padded = _padded(ctx, node, x, pads, 0.0)
    c = reduce_axis(cg, "rc")
    ks = [reduce_axis(k, f"rk{j}") for j, k in enumerate(w_type.shape[2:])]
    has_bias = len(node.inputs) > 2 and node.inputs[2]

    depthwise = cg == 1 and mg == 1
    block, rows = _plain_conv_block(mg, group, ctx.target.vector_lanes, ctx.target.fma_lanes)
    packed = ctx.is_constant(node.inputs[1]) and block > 0 and not depthwise
    # Output channels per group as computed: a group's filters padded with zeros to whole
    # blocks (each block within one group, so that its lanes read one input channel).
    mg_padded = rows // group if packed else mg
    if packed:
        weights = ctx.constant(node.inputs[1])
        if rows != m:  # zero filters up to whole blocks: their outputs are cropped
            weights = weights.reshape(group, mg, *weights.shape[1:])
            filler = np.zeros((group, mg_padded - mg, *weights.shape[2:]), weights.dtype)
            weights = np.concatenate([weights, filler], axis=1).reshape(rows, *w_type.shape[1:])
        blocks = weights.reshape(rows // block, block, cg, *w_type.shape[2:])
        layout = np.moveaxis(blocks, 1, -1)  # [M/b, C/g, *K, b]
        wp = ctx.packed(node.inputs[1], f"oihw{block}o", layout)

        def weight(o):
            outer = Binary("floordiv", o, Const(block, INDEX))
            lane = Binary("mod", o, Const(block, INDEX))
            return lambda c_, k_: wp[(outer, c_, *k_, lane)]
    else:
        w = ctx.tensor(node.inputs[1])

        def weight(o):
            return lambda c_, k_: w[(o, c_, *k_)]

    # Half precision accumulates in float32 and rounds once, as the reference and ONNX
    # Runtime do; the rounded value is what an epilogue (bias, activation) sees.
    accumulate = "float32" if out.dtype == "float16" else out.dtype

    def body(n, o, *spatial):
        channel = _input_channel(o, c, group, mg_padded, cg)
        source = padded[(n, channel, *_window_index(spatial, ks, strides, dilations))]
        product = source * weight(o)(c, ks)
        return reduce_sum(
            Cast(accumulate, product) if accumulate != out.dtype else product, [c, *ks]
        )

    shape = (out.shape[0], rows if packed else m, *out.shape[2:])
    conv = compute(shape, body, ctx.stage_name(node), accumulate)
    # A real output channel's place among the computed ones: with padding inside the groups
    # (not only after the last), the crop reads each group's first `mg`.
    inner_padding = group > 1 and mg_padded != mg

    def computed(n, o, *spatial):
        if inner_padding:
            within = Binary("mod", o, Const(mg, INDEX))
            o = Binary("floordiv", o, Const(mg, INDEX)) * Const(mg_padded, INDEX) + within
        return (n, o, *spatial)

    ctx.note(
        conv.name,
        layout="packed" if packed else "depthwise" if depthwise else "generic",
        block=block,
    )
    if depthwise and nsp == 2:
        # A window of taps along the output rows (`schedules.depthwise_window_schedule`).
        padded_name = "" if padded is x else padded.name
        ctx.note(conv.name, window="plain", padded=padded_name, width_stride=strides[1])
    if shape != tuple(out.shape) and not inner_padding:
        # (a crop inside the groups gathers channels: it is no epilogue of the conv's tiles)
        ctx.note(conv.name, real_shape=tuple(out.shape))
    if accumulate != out.dtype:
        wide, real = conv, computed
        conv = compute(out.shape, lambda *i: Cast(out.dtype, wide[real(*i)]), ctx.stage_name(node))
        # Cropped by the cast: the stages after it read its real channels as they are.
        shape, computed = out.shape, _same_index
    if not has_bias:
        if shape == tuple(out.shape):
            return [conv]
        return [compute(out.shape, lambda *i: conv[computed(*i)], ctx.stage_name(node, "crop"))]
    bias = ctx.tensor(node.inputs[2])
    return [
        compute(
            out.shape, lambda n, o, *s: conv[computed(n, o, *s)] + bias[o], ctx.stage_name(node)
        )
    ]


# The longest reduction (input channels x taps) a plain conv runs as a GEMM over im2col
# columns: the columns are a [C*K, W] copy of the input per output row, cheap while C*K is a
# few vectors.
IM2COL_MAX_REDUCTION = 32


def im2col_conv(x_shape, w_shape, group: int, dtype: str) -> bool:
    """Whether a plain-layout conv runs as its filters [M, C*K] times the im2col columns of its
    input (`_conv_im2col`): an ungrouped float32 1-D, 2-D or 3-D conv whose reduction is short
    (a raw-audio stem: 1 channel x 10 taps; an RGB stem: 3 x 3x3) and no longer than its
    output channels, so that the columns are no larger than the output. The layout pass keeps
    such a conv's output plain when no reader would take it blocked."""
    if len(x_shape) - 2 not in (1, 2, 3) or group != 1 or dtype != "float32":
        return False
    out_channels, channels, *kernel = w_shape
    return channels * math.prod(kernel) <= min(IM2COL_MAX_REDUCTION, out_channels)


def _conv_im2col(ctx: KernelContext, node: Node):
    """A conv as GEMMs, one per output row: rows are output channels (the filters, [M, C*K],
    broadcast from build-time rows), columns the row's positions, read from panels of the
    input's im2col columns [C*K, W] that a stage of the kernel builds (computed per output
    row by the dense template: a few KB in L1). Vectorized along positions, the tile stores
    the plain output with unit stride; a conv vectorized over channels would scatter each
    vector over M rows or write a blocked output for a transform to unblock (a 1->256
    channel, 16000-sample stem: 0.08 ms of conv, then 0.16 ms of unblocking its 3.3 MB
    output). The product is [N, *rows, M, W]: the output stage reads it transposed."""
    x = ctx.tensor(node.inputs[0])
    out = ctx.type(node.outputs[0])
    nsp = len(out.shape) - 2
    pads, strides, dilations = spatial_params(node, nsp)
    weights = ctx.constant(node.inputs[1])
    m, channels, *kernel = weights.shape
    reduction = channels * math.prod(kernel)
    padded = _padded(ctx, node, x, pads, 0.0)
    batch, *spatial = out.shape[0], *out.shape[2:]
    rows, length = tuple(spatial[:-1]), spatial[-1]
    width = panel_width(length, ctx.target.vector_lanes)
    blocks = -(-length // width)

    def column(n, *index):
        outer, (block, kk, lane) = index[:-3], index[-3:]
        j = Binary("add", Binary("mul", block, Const(width, INDEX)), lane)
        if blocks * width != length:  # the last panel's extra columns repeat the last one
            j = Binary("min", j, Const(length - 1, INDEX))
        channel, *taps = unflatten(kk, (channels, *kernel))
        positions = [
            o * Const(s, INDEX) + k * Const(d, INDEX)
            for o, k, s, d in zip((*outer, j), taps, strides, dilations, strict=True)
        ]
        return padded[(n, channel, *positions)]

    panels = compute(
        (batch, *rows, blocks, reduction, width), column, ctx.stage_name(node, "columns"), x.dtype
    )
    ctx.note(panels.name, materialize=True)
    kk = reduce_axis(reduction, "rk")
    gemm_shape = (batch, *rows, m, length)
    row_bytes = reduction * weights.itemsize
    shape = _tiled_shape(ctx, gemm_shape, width, row_bytes)
    # Zero filters up to whole row tiles: the padded rows read no clamped index.
    rows_of_filters = np.zeros((shape[-2], reduction), weights.dtype)
    rows_of_filters[:m] = weights.reshape(m, reduction)
    filters = ctx.packed(node.inputs[1], f"rows{shape[-2]}", rows_of_filters)

    def body(n, *index):
        outer, i, j = index[:-2], index[-2], index[-1]
        return reduce_sum(filters[(i, kk)] * _panel_read(panels, width, kk, j, (n, *outer)), kk)

    pack = Pack(panels.name, default=True)
    product = _dense_stage(ctx, node, shape, body, gemm_shape, width, pack, a_row_bytes=row_bytes)
    # Each output row's columns are its own: the template computes them in the row's loop.
    ctx.note(
        product.name, layout="im2col", pack_per_batch=bool(rows), epilogue_shape=tuple(out.shape)
    )
    bias = ctx.tensor(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None

    def result(n, o, *position):
        value = product[(n, *position[:-1], o, position[-1])]
        return value + bias[(o,)] if bias is not None else value

    if bias is None and not rows and shape == tuple(out.shape):
        return [product]
    return [compute(out.shape, result, ctx.stage_name(node))]


def _plain_conv_block(
    per_group: int, group: int, lanes: int, fma_lanes: int = 8
) -> tuple[int, int]:
    """(channel block, output channels padded to whole blocks) of a plain-layout conv. With a
    vector's worth of channels (a group's, for a grouped conv) it takes a full vector (`lanes`)
    or 8 lanes, whichever takes the fewest FMA cycles (`block_cost`; ties: the larger), its
    filters padded with zeros to whole blocks, each group's on its own: 58 channels compute
    64, 116 compute 120 (128 where a 16-lane FMA costs one 8-lane one), cropped after (a
    block of 4 that divides 116 ran 1.45x ORT, half a ymm per FMA; ShuffleNet v1's groups of
    68 ran 0.90x in padded blocks of 8 against blocks of 4, and its groups of 34, which no
    block divides, ran 6 GFLOP/s unblocked). With fewer channels, a block that divides them,
    or none (0)."""
    if per_group >= 8:
        block = min((lanes, 8), key=lambda b: (block_cost(per_group, b, fma_lanes), -b))
        return block, -(-per_group // block) * block * group
    return next((b for b in (lanes, 8, 4) if per_group % b == 0), 0), per_group * group


def _conv_nchwc(ctx: KernelContext, node: Node):
    """1-D, 2-D or 3-D convolution writing NC[D][H]W[b]c: out[n, mo, *spatial, mi] (set up by
    the layout pass).

    Weights are packed so the reduction reads them with unit stride, one vector of `b` output
    channels per step: [M/b, Cg/ib, *K, ib, b] for blocked data (plain or grouped convs),
    [M/b, C, *K, b] for plain data and [M/b, *K, b] for a depthwise conv (whose data is
    blocked too). A grouped conv reads the input blocks of its output block's group.

    The register tile runs along the last spatial axis; when that row has no good divisor (a
    prime length, say) the conv computes a row padded to a multiple of a good tile
    (`nchwc_row_width`, one of the schedule's rules) over zero-padded input, and the stage that
    adds the bias keeps the real pixels.
    """
    data_block, block = conv_layouts(node)
    x = ctx.tensor(node.inputs[0])
    weights = ctx.constant(node.inputs[1])
    out = ctx.type(node.outputs[0])
    real_m, real_cg, *kernel = weights.shape
    nsp, group = len(kernel), node.attr("group", 1)
    depthwise = group > 1 and real_cg == 1 and real_m == group
    if group > 1 and not depthwise and data_block != block:
        raise KernelError(f"node {node.name!r}: a grouped blocked conv reads data in its block")
    weights = _padded_filters(weights, out.shape[1] * block, x.shape[1], data_block, group)
    m, cg = weights.shape[:2]
    group_blocks = _group_blocks(m, cg, group, block, data_block, depthwise)
    pads, strides, dilations = spatial_params(node, nsp)
    algorithms = ("direct",)
    if data_block:
        algorithms = spatial_algorithms(kernel, strides, dilations, pads, group, real_cg, real_m)
    out_h, out_w = out.shape[-3:-1]  # NC[D]HW[b]c
    chosen = ctx.choice("conv_algorithm", default_algorithm(algorithms, out_h, out_w, ctx.target))
    if chosen not in algorithms:
        raise KernelError(f"node {node.name!r}: no {chosen!r} conv (it can run {algorithms})")
    if winograd_size(chosen):
        notes = {"algorithms": algorithms, "algorithm": chosen}
        tile = winograd_size(chosen)
        return _winograd(ctx, node, x, weights, tile, pads, data_block, block, notes)
    width = out.shape[-2]
    taps = math.prod(kernel) > 1
    row = nchwc_row_width(width, block, depthwise, m // block, ctx.target, group_blocks, taps)
    # Zero input past the end for the extra pixels of a padded row.
    pads = (*pads[: 2 * nsp - 1], pads[2 * nsp - 1] + (row - width) * strides[-1])
    padded = _padded(ctx, node, x, pads, 0.0, nsp=nsp)
    ks = [reduce_axis(k, f"rk{j}") for j, k in enumerate(kernel)]

    def window(spatial):
        return _window_index(spatial, ks, strides, dilations)

    if depthwise:
        packed = np.moveaxis(weights.reshape(m // block, block, *kernel), 1, -1)
        wp = ctx.packed(node.inputs[1], f"dw_oihw{block}o", packed)

        def body(n, mo, *rest):
            *spatial, mi = rest
            source = padded[(n, mo, *window(spatial), mi)]
            return reduce_sum(source * wp[(mo, *ks, mi)], ks)

    elif group > 1 and cg < data_block:
        wp = ctx.packed(node.inputs[1], f"gdiag{block}", _block_diagonal(weights, block))
        rci = reduce_axis(block, "rci")

        def body(n, mo, *rest):
            # Output block mo holds whole groups, whose inputs are input block mo.
            *spatial, mi = rest
            source = padded[(n, mo, *window(spatial), rci)]
            return reduce_sum(source * wp[(mo, *ks, rci, mi)], [*ks, rci])

    elif data_block:
        in_blocks = cg // data_block  # input channel blocks per group
        out_blocks = m // group // block  # output channel blocks per group
        split = weights.reshape(m // block, block, in_blocks, data_block, *kernel)
        order = (0, 2, *range(4, 4 + nsp), 3, 1)
        wp = ctx.packed(node.inputs[1], f"oihw{data_block}i{block}o", split.transpose(order))
        rco, rci = reduce_axis(in_blocks, "rco"), reduce_axis(data_block, "rci")

        def channel(mo):
            if group == 1:
                return rco
            first = Binary("floordiv", mo, Const(out_blocks, INDEX)) * Const(in_blocks, INDEX)
            return first + rco

        def body(n, mo, *rest):
            *spatial, mi = rest
            source = padded[(n, channel(mo), *window(spatial), rci)]
            return reduce_sum(source * wp[(mo, rco, *ks, rci, mi)], [rco, *ks, rci])

    else:
        packed = np.moveaxis(weights.reshape(m // block, block, cg, *kernel), 1, -1)
        wp = ctx.packed(node.inputs[1], f"oihw{block}o", packed)
        rc = reduce_axis(cg, "rc")

        def body(n, mo, *rest):
            *spatial, mi = rest
            source = padded[(n, rc, *window(spatial))]
            return reduce_sum(source * wp[(mo, rc, *ks, mi)], [rc, *ks])

    shape = (*out.shape[:-2], row, block)
    conv = compute(shape, body, ctx.stage_name(node), out.dtype)
    ctx.note(
        conv.name,
        layout="nchwc_depthwise" if depthwise else "nchwc",
        weights=wp.name,  # the packed weights' parameter, which a schedule may prefetch
        block=block,
        group_blocks=group_blocks,
        algorithms=algorithms,
        algorithm=chosen,
        strides=strides,
        in_width=x.shape[-2],  # a chained depthwise conv's tile reads rows this wide
        plain_data=not data_block,  # each input channel a row of its own
        # What each thread reads in its share, split by rows or by channels (see
        # schedules.rows_before_channels).
        input_bytes=math.prod(x.shape) * np.dtype(x.dtype).itemsize,
        weight_bytes=math.prod(wp.shape) * np.dtype(wp.dtype).itemsize,
    )
    bias = _blocked_bias(ctx, node, m, block)
    if bias is None and row == width:
        return [conv]

    def result(n, mo, *rest):
        value = conv[(n, mo, *rest)]
        return value + bias[(mo, rest[-1])] if bias is not None else value

    return [compute(out.shape, result, ctx.stage_name(node))]


def _blocked_bias(ctx: KernelContext, node: Node, channels: int, block: int) -> Tensor | None:
    """A conv's bias as [M/b, b], zero for the padding lanes (as their filters are), or None."""
    if len(node.inputs) < 3 or not node.inputs[2]:
        return None
    bias = ctx.constant(node.inputs[2])
    values = np.zeros(channels, bias.dtype)
    values[: bias.shape[0]] = bias
    return ctx.packed(node.inputs[2], f"bias{block}", values.reshape(channels // block, block))


def _winograd(
    ctx: KernelContext, node: Node, x: Tensor, weights, tile: int, pads, data_block, block, notes
) -> list[Tensor]:
    """A blocked 3x3 conv, or (1, 3, 3) conv of frames, as Winograd F(tile x tile, 3 x 3) (see
    kernels/winograd.py), `notes` on its GEMM stage. The GEMM's row of tiles is padded to a
    good register tile as a direct conv's row is."""
    out = ctx.type(node.outputs[0])
    frames = len(out.shape) == 6
    out_blocks = weights.shape[0] // block
    positions = (tile + 2) ** 2

    def row_width(tiles: int) -> int:
        gemm_blocks = positions * out_blocks
        return nchwc_row_width(tiles, block, False, gemm_blocks, ctx.target, out_blocks, False)

    grid = tile_grid(*out.shape[-3:-1], tile, row_width)
    if frames:  # pads (front, top, left, back, bottom, right), no padding along depth
        padding = input_padding((pads[1], pads[2], pads[4], pads[5]), *x.shape[-3:-1], grid)
        padded = _frames_padded(ctx, node, x, padding)
        weights = weights.reshape(*weights.shape[:2], 3, 3)
    else:
        padding = input_padding(pads, *x.shape[-3:-1], grid)
        padded = _padded(ctx, node, x, padding, 0.0, nsp=2)
    bias = _blocked_bias(ctx, node, weights.shape[0], block)
    return winograd_conv(
        ctx, node, padded, weights, grid, data_block, block, bias, out.shape, out.dtype, notes
    )


def _frames_padded(ctx: KernelContext, node: Node, x: Tensor, pads) -> Tensor:
    """NCDHW[b]c data as its N * D frames of NCHW[b]c, each padded by `pads` (top, left,
    bottom, right): the input of a conv of frames' Winograd stages, frame d of image n at
    n * D + d."""
    images, blocks, frames, height, width, lanes = x.shape
    top, left, bottom, right = pads
    shape = (images * frames, blocks, height + top + bottom, width + left + right, lanes)

    def body(f, c, y, w, i):
        sy, sx = y - Const(top, INDEX), w - Const(left, INDEX)
        inside = logical_and(
            logical_and(sy >= Const(0, INDEX), sy < Const(height, INDEX)),
            logical_and(sx >= Const(0, INDEX), sx < Const(width, INDEX)),
        )
        n, d = Binary("floordiv", f, Const(frames, INDEX)), Binary("mod", f, Const(frames, INDEX))
        source = (n, c, d, clamp(sy, height), clamp(sx, width), i)
        return Select(inside, x[source], Const(0.0, x.dtype))

    return compute(shape, body, ctx.stage_name(node, prefix="pad"))


def _group_blocks(m: int, cg: int, group: int, block: int, data_block: int, depthwise: bool):
    """Consecutive output blocks that read the same input (a register tile spanning them
    shares each input broadcast): all of them ungrouped, a group's when a group holds whole
    blocks, else 1 (depthwise, or several groups per block: each block reads its own)."""
    if group == 1:
        return m // block
    if depthwise or cg < data_block:
        return 1
    return max(m // group // block, 1)


def _block_diagonal(weights, block: int):
    """The filters of a conv whose groups (g inputs, g outputs each) are smaller than a block,
    as one dense block x block matrix per output block and tap: [M/b, *K, b in, b out], zero
    where an input and an output belong to different groups of the block."""
    m, g, *kernel = weights.shape
    per_block = weights.reshape(m // block, block // g, g, g, *kernel)  # [.., group, out, in]
    dense = np.zeros((m // block, *kernel, block, block), weights.dtype)
    for j in range(block // g):
        within = slice(j * g, (j + 1) * g)
        dense[..., within, within] = np.moveaxis(per_block[:, j], (1, 2), (-1, -2))
    return dense


def _padded_filters(weights, out_channels: int, in_blocks: int, data_block: int, group: int):
    """A blocked conv's filters with zeros up to whole blocks: filters for the padding lanes
    of its output (`out_channels` in all) and, for an ungrouped conv of blocked data, weights
    for the padding lanes of its input (`in_blocks` blocks), which thus contribute nothing."""
    m, cg, *kernel = weights.shape
    in_channels = in_blocks * data_block if data_block and group == 1 else cg
    if (m, cg) == (out_channels, in_channels):
        return weights
    if group > 1 and m != group:
        raise KernelError(f"a grouped conv of {m} filters in {group} groups has no padded form")
    padded = np.zeros((out_channels, in_channels, *kernel), weights.dtype)
    padded[:m, :cg] = weights
    return padded


def panel_width(columns: int, lanes: int) -> int:
    """Columns per packed panel: two vectors when it divides, else one panel of all the columns
    when they are few (rounded up to whole vectors: a 10-lane vector is split into pieces with
    a ragged end, and a 64x1024x10 classifier GEMM ran at 8 GFLOP/s), else two vectors with
    zero-padded columns."""
    panel = 2 * lanes
    if columns % panel == 0 or columns > 2 * panel:
        return panel
    return -(-columns // lanes) * lanes


def _panel_weights(ctx: KernelContext, value: str, transpose: bool, scale: float = 1.0):
    """A constant [..., K, N] (or [..., N, K] with `transpose`) matrix, or stack of them, as
    [..., N/P, K, P] panels."""
    matrix = ctx.constant(value)
    matrix = np.swapaxes(matrix, -1, -2) if transpose else matrix
    if scale != 1.0:
        matrix = matrix * np.asarray(scale, matrix.dtype)
    return packed_panels(ctx, value, f"panel{{}}{'t' if transpose else ''}", matrix)


def packed_panels(ctx: KernelContext, source: str, label: str, matrix: np.ndarray):
    """A build-time [..., K, N] matrix (a transform of constant `source`), or stack of them, as
    [..., N/P, K, P] panels and the panel width P; `label` names the packing, with `{}`
    standing for P."""
    *batch, k, n = matrix.shape
    width = panel_width(n, ctx.target.vector_lanes)
    padded_n = -(-n // width) * width
    if padded_n != n:
        pad = [(0, 0)] * (len(batch) + 1) + [(0, padded_n - n)]
        matrix = np.pad(matrix, pad)
    panels = np.moveaxis(matrix.reshape(*batch, k, padded_n // width, width), -2, -3)
    return ctx.packed(source, label.format(width), panels), width


def _panel_read(panels: Tensor, width: int, kk, j, batch=()):
    block = Binary("floordiv", j, Const(width, INDEX))
    lane = Binary("mod", j, Const(width, INDEX))
    return panels[(*batch, block, kk, lane)]


def _runtime_panels(ctx: KernelContext, node: Node, b: Tensor, transpose: bool) -> Tensor:
    """An activation B ([..., K, N], or [..., N, K] with `transpose`) packed into [..., N/P, K, P]
    panels by a stage of the kernel, so that the GEMM reads B with unit stride as it does a
    packed weight. Columns past N repeat the last one: their products are cropped."""
    *batch_shape, k, n = b.shape
    if transpose:
        k, n = n, k
    width = panel_width(n, ctx.target.vector_lanes)
    blocks = -(-n // width)

    def body(*index):
        batch, (block, kk, lane) = index[:-3], index[-3:]
        j = Binary("add", Binary("mul", block, Const(width, INDEX)), lane)
        if blocks * width != n:
            j = Binary("min", j, Const(n - 1, INDEX))
        return b[(*batch, j, kk) if transpose else (*batch, kk, j)]

    shape = (*batch_shape, blocks, k, width)
    return compute(shape, body, ctx.stage_name(node, "pack"), b.dtype), width


@dataclasses.dataclass(frozen=True)
class Pack:
    """The stage packing an activation B into panels, and whether packing is the default."""

    stage: str
    default: bool


def _dense_b(ctx: KernelContext, node: Node, value: str, transpose: bool, scale: float = 1.0):
    """B of a GEMM as (read(batch, kk, j), panel width, Pack or None, the packed weights'
    parameter or None): a constant 2-D B is packed at build time, any other B by a stage of
    the kernel (`materialize` keeps it a stage of its own; the dense template inlines it with
    `pack=0`)."""
    if ctx.is_constant(value) and ctx.type(value).rank >= 2:
        panels, width = _panel_weights(ctx, value, transpose, scale)
        stacked = ctx.type(value).rank > 2

        def read(batch, kk, j):
            return _panel_read(panels, width, kk, j, batch if stacked else ())

        return read, width, None, panels.name
    b = ctx.tensor(value)
    panels, width = _runtime_panels(ctx, node, b, transpose)
    ctx.note(panels.name, materialize=True)
    # Unpacked, the tile reads B with unit stride when B is an input of the kernel laid out
    # [.., K, N] with at least a panel's columns (the GEMM's columns are then not padded, and
    # a tail tile covers the last ones): packing is then not the default.
    unit_stride = b.is_placeholder and not transpose and b.shape[-1] >= width
    pack = Pack(panels.name, default=not unit_stride)
    return (lambda batch, kk, j: _panel_read(panels, width, kk, j, batch)), width, pack, None


def _tiled_shape(
    ctx: KernelContext, out_shape, width: int, a_row_bytes: int = 0, pack: Pack | None = None
):
    """The GEMM stage's shape: rows padded to a multiple of the default row tile, columns to
    the panel width when they fit one panel, else to the tiles' column step (a partial last
    tile costs no scalar loop; the columns past the last whole tile are a tail tile, see
    `matmul_schedule`), or not at all when B is read where it lies by default (`pack` not
    the default: a tail tile that ends at the last column reads nothing past B's rows).
    `a_row_bytes`: A's row stride, when the tile reads A's rows along K (see gemm_row_tile)."""
    *batch_shape, rows, cols = out_shape
    mr = gemm_row_tile(rows, ctx.target, _panel_vectors(width, ctx), a_row_bytes)
    exact_columns = pack is not None and not pack.default
    if cols <= width:  # one panel (of whole vectors): one tile
        cols = width
    elif not exact_columns:
        step = min(ctx.target.vector_lanes, GEMM_COLUMN_STEP)
        cols = -(-cols // step) * step
    return (*batch_shape, -(-rows // mr) * mr, cols)


def _panel_vectors(width: int, ctx: KernelContext) -> int:
    """Vector registers across a panel: a 3-vector panel (48 columns with AVX-512) leaves room
    for fewer rows of accumulators than the usual two."""
    return max(width // ctx.target.vector_lanes, 1)


def _dense_stage(
    ctx,
    node,
    shape,
    body,
    out_shape,
    width: int,
    pack: Pack | None,
    dtype: str | None = None,
    a_row_bytes: int = 0,
    mr: int = 0,
    weights: str | None = None,
) -> Tensor:
    """The GEMM stage, with the facts its template needs: the panel width, the row tile its
    rows are padded for (`mr`, when the caller chose it), the real output shape (what the
    epilogue crops), the packing, and B's packed constant panels' parameter (`weights`,
    which the template may prefetch a column tile ahead)."""
    dtype = dtype or ctx.type(node.outputs[0]).dtype
    product = compute(shape, body, ctx.stage_name(node), dtype)
    mr = mr or gemm_row_tile(out_shape[-2], ctx.target, _panel_vectors(width, ctx), a_row_bytes)
    ctx.note(product.name, panel=width, mr=mr, real_shape=tuple(out_shape))
    if pack is not None:
        ctx.note(product.name, pack=pack.stage, pack_default=pack.default)
    if weights is not None:
        ctx.note(product.name, weights=weights)
    return product


def constant_product(
    ctx: KernelContext, node: Node, a_at, rows: int, panels: Tensor, width: int, columns: int
) -> Tensor:
    """A [rows, K] x [K, columns] product by packed constant panels, as a GEMM stage the
    dense template schedules (its shape padded to whole tiles: read only the real part).
    `a_at(i, k)` reads A; any op can use it (a recurrence's hidden-state product, say)."""
    kk = reduce_axis(panels.shape[1], "rk")
    shape = _tiled_shape(ctx, (rows, columns), width)

    def body(i, j):
        row = padded_row(i, rows, shape[0])
        return reduce_sum(a_at(row, kk) * _panel_read(panels, width, kk, j), kk)

    real = (rows, columns)
    return _dense_stage(
        ctx, node, shape, body, real, width, None, panels.dtype, weights=panels.name
    )


def _packed_a_product(
    ctx: KernelContext, node: Node, a_at, rows: int, depth: int, b_value: str, transpose: bool,
    scale: float, algorithms: tuple[str, ...],
) -> Tensor:  # fmt: skip
    """A [rows, K] x constant [K, N] GEMM whose A is first packed into row-tile panels
    [rows / mr, K, mr] (GotoBLAS's packed A): a register tile then reads its mr rows' values
    of a reduction step from one line, one stream in all, where the direct GEMM streams mr
    rows of A at once, a row's stride apart (rows a multiple of 4 KB apart share an L1 set,
    which caps the direct tile's rows: `gemm_row_tile`). The packing stage is the dense
    template's to place (`pack_a_at`): inside the row-tile loop, or before the GEMM. Its rows
    past the real ones repeat the last; their products are cropped. Returns the [padded
    rows, N] product, noted as the GEMM stage."""
    b_at, width, _, weights = _dense_b(ctx, node, b_value, transpose, scale)
    mr = packed_row_tile(rows, ctx.target, _panel_vectors(width, ctx))
    tiles = -(-rows // mr)

    def pack(t, k, r):
        return a_at(padded_row(t * Const(mr, INDEX) + r, rows, tiles * mr), k)

    dtype = ctx.type(node.outputs[0]).dtype
    packed = compute((tiles, depth, mr), pack, ctx.stage_name(node, "packa"), dtype)
    ctx.note(packed.name, materialize=True)
    kk = reduce_axis(depth, "rk")
    columns = ctx.type(b_value).shape[0 if transpose else 1]
    shape = _tiled_shape(ctx, (tiles * mr, columns), width)

    def body(i, j):
        return reduce_sum(_panel_row(packed, (), i, kk, mr) * b_at((), kk, j), kk)

    real = (rows, columns)
    product = _dense_stage(ctx, node, shape, body, real, width, None, dtype, mr=mr, weights=weights)
    ctx.note(product.name, pack_a=packed.name, packed_rows=True)
    notes = {"algorithms": algorithms, "algorithm_choice": "gemm_algorithm"}
    ctx.note(product.name, **notes, algorithm=PACKED_A)
    return product


def _panel_row(panels: Tensor, batch: tuple, i, k, mr: int):
    """Row i of A at reduction step k, from A packed into [*batch, rows / mr, K, mr] row-tile
    panels (the packed-A GEMM's, or Strassen's sums packed alike)."""
    tile, row = Binary("floordiv", i, Const(mr, INDEX)), Binary("mod", i, Const(mr, INDEX))
    return panels[(*batch, tile, k, row)]


def _cropped(ctx: KernelContext, node: Node, product: Tensor, out_shape) -> Tensor:
    """The real rows and columns of a padded product (the dense template folds this crop, and
    any epilogue after it, into the tile's store)."""
    if tuple(product.shape) == tuple(out_shape):
        return product
    return compute(tuple(out_shape), lambda *i: product[i], ctx.stage_name(node, "crop"))


def _matmul(ctx: KernelContext, node: Node):
    a_type, b_type = ctx.type(node.inputs[0]), ctx.type(node.inputs[1])
    out = ctx.type(node.outputs[0])
    if b_type.rank < 2:
        return [_matmul_vectors(ctx, node)]
    # A vector A is a GEMM of one row (a dense layer at batch 1): [K] @ [.., K, N].
    a_vector = a_type.rank == 1
    out_shape = (*out.shape[:-1], 1, out.shape[-1]) if a_vector else out.shape
    a = ctx.tensor(node.inputs[0])
    # By a 2-D B, every row of every batch of A is a row of one GEMM.
    rows_shape = (math.prod(out.shape[:-1]), out.shape[-1])
    algorithms = _gemm_algorithms(ctx, node.inputs[1], rows_shape, a_type.shape[-1], not a_vector)
    a_row_bytes = 0 if a_vector else a_type.shape[-1] * np.dtype(a_type.dtype).itemsize
    chosen = _gemm_algorithm(ctx, node, algorithms, rows_shape, a_row_bytes)
    if chosen in LEVELS:
        lead = a_type.shape[:-1]

        def a_at(i, k):  # row i of the GEMM
            return a[(*(unflatten(i, lead) if len(lead) > 1 else (i,)), k)]

        return _strassen(ctx, node, a_at, False, 1.0, None, algorithms, chosen)
    if chosen == PACKED_A:
        lead = a_type.shape[:-1]

        def a_row(i, k):  # row i of the GEMM
            return a[(*(unflatten(i, lead) if len(lead) > 1 else (i,)), k)]

        product = _packed_a_product(
            ctx, node, a_row, rows_shape[0], a_type.shape[-1], node.inputs[1], False, 1.0,
            algorithms,
        )  # fmt: skip
        return [_unfolded(ctx, node, product, out.shape)]
    kk = reduce_axis(a_type.shape[-1], "rk")
    b_at, width, pack, weights = _dense_b(ctx, node, node.inputs[1], transpose=False)
    b_batch = b_type.shape[:-2]
    batch_shape, rows = out_shape[:-2], out_shape[-2]
    shape = _tiled_shape(ctx, out_shape, width, a_row_bytes, pack)

    def body(*index):
        batch, i, j = index[:-2], index[-2], index[-1]
        b_read = b_at(broadcast_index(b_batch, batch_shape, batch), kk, j)
        if a_vector:
            return reduce_sum(a[(kk,)] * b_read, kk)
        row = padded_row(i, rows, shape[-2])
        a_index = (*broadcast_index(a.shape[:-2], batch_shape, batch), row)
        return reduce_sum(a[(*a_index, kk)] * b_read, kk)

    product = _dense_stage(
        ctx, node, shape, body, out_shape, width, pack, a_row_bytes=a_row_bytes, weights=weights
    )
    _note_algorithms(ctx, product, algorithms)
    if a_vector:  # drop the unit row (and any padded columns)
        return [
            compute(
                out.shape,
                lambda *i: product[(*i[:-1], Const(0, INDEX), i[-1])],
                ctx.stage_name(node, "row"),
            )
        ]
    return [_cropped(ctx, node, product, out_shape)]


def _unfolded(ctx: KernelContext, node: Node, product: Tensor, out_shape) -> Tensor:
    """The [padded rows, N] product of a GEMM whose rows are A's leading axes folded, at the
    output's shape (the dense template folds it into the tile's store)."""
    lead = out_shape[:-1]
    return compute(
        tuple(out_shape),
        lambda *i: product[flatten(i[:-1], lead) if len(lead) > 1 else i[0], i[-1]],
        ctx.stage_name(node, "crop"),
    )


def _matmul_vectors(ctx: KernelContext, node: Node):
    """MatMul where an operand is 1-D (numpy's rules: it gains, then loses, a unit axis)."""
    a, b = ctx.tensor(node.inputs[0]), ctx.tensor(node.inputs[1])
    out = ctx.type(node.outputs[0])
    kk = reduce_axis(a.shape[-1], "rk")
    a_vec, b_vec = len(a.shape) == 1, len(b.shape) == 1
    batch_rank = out.rank - (0 if a_vec else 1) - (0 if b_vec else 1)

    def body(*index):
        batch = index[:batch_rank]
        rest = list(index[batch_rank:])
        i = None if a_vec else rest.pop(0)
        j = None if b_vec else rest.pop(0)
        a_index = (
            (kk,)
            if a_vec
            else (broadcast_index(a.shape[:-2], out.shape[:batch_rank], batch) + (i, kk))
        )
        b_index = (
            (kk,)
            if b_vec
            else (broadcast_index(b.shape[:-2], out.shape[:batch_rank], batch) + (kk, j))
        )
        return reduce_sum(a[a_index] * b[b_index], kk)

    return compute(out.shape, body, ctx.stage_name(node), out.dtype)


def _qlinear_matmul(ctx: KernelContext, node: Node):
    """(a - a_zero) (b - b_zero) a_scale b_scale / y_scale + y_zero, rounded and saturated."""
    a, a_scale, a_zero, b, b_scale, b_zero, y_scale, y_zero = (ctx.tensor(v) for v in node.inputs)
    out = ctx.type(node.outputs[0])
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise KernelError(f"node {node.name!r}: QLinearMatMul of vectors has no native kernel")
    kk = reduce_axis(a.shape[-1], "rk")
    f = "float32"
    batch_shape = out.shape[:-2]

    def per_column(t, j):
        return t[(j,)] if t.shape and t.shape[0] > 1 else t[tuple(Const(0, INDEX) for _ in t.shape)]

    def scalar(t):
        return t[tuple(Const(0, INDEX) for _ in t.shape)]

    def product(*index):
        batch, i, j = index[:-2], index[-2], index[-1]
        a_at = a[broadcast_index(a.shape[:-2], batch_shape, batch) + (i, kk)]
        b_at = b[broadcast_index(b.shape[:-2], batch_shape, batch) + (kk, j)]
        left = Cast(f, a_at) - Cast(f, scalar(a_zero))
        right = Cast(f, b_at) - Cast(f, per_column(b_zero, j))
        return reduce_sum(left * right, kk)

    acc = compute(out.shape, product, ctx.stage_name(node), f)
    info = np.iinfo(out.dtype)

    def requantize(*index):
        j = index[-1]
        scale = (
            Cast(f, scalar(a_scale)) * Cast(f, per_column(b_scale, j)) / Cast(f, scalar(y_scale))
        )
        value = Unary("round", acc[index] * scale) + Cast(f, scalar(y_zero))
        low, high = Const(float(info.min), f), Const(float(info.max), f)
        return Cast(out.dtype, Binary("min", Binary("max", value, low), high))

    return compute(out.shape, requantize, ctx.stage_name(node), out.dtype)


def _gemm_algorithms(ctx: KernelContext, b_value: str, out_shape, depth: int, plain_a: bool):
    """The algorithms a GEMM of `out_shape` ([rows, columns]) can run: Strassen's and the
    packed-A form need constant 2-D weights and a plain [..., K] A (see kernels/strassen.py
    and `_packed_a_product`); Strassen's over packed sums where both apply to its products
    (half the rows, depth and columns)."""
    if not (plain_a and ctx.is_constant(b_value) and ctx.type(b_value).rank == 2):
        return ("direct",)
    rows, columns = out_shape[-2], out_shape[-1]
    algorithms = gemm_algorithms(rows, depth, columns, ctx.target.vector_lanes)
    if _packs_a(ctx, rows, depth, columns):
        algorithms += (PACKED_A,)
    if STRASSEN in algorithms and _packs_a(ctx, rows // 2, depth // 2, columns // 2):
        algorithms += (STRASSEN_PACKED,)
    return algorithms


def _packs_a(ctx: KernelContext, rows: int, depth: int, columns: int) -> bool:
    """Whether a GEMM by constant weights may pack A into row-tile panels: two row tiles or
    more, and rows long enough for a tile's strided row streams to cost more than one pass
    over A."""
    packed_rows = packed_row_tile(rows, ctx.target, _gemm_vectors(ctx, columns))
    return rows >= 2 * packed_rows and depth >= PACKED_A_MIN_DEPTH


def _gemm_vectors(ctx: KernelContext, columns: int) -> int:
    """Vector registers across the panel of a GEMM of `columns` by constant weights."""
    return _panel_vectors(panel_width(columns, ctx.target.vector_lanes), ctx)


# The GEMM whose A is packed into row-tile panels first (`_packed_a_product`): an algorithm
# the tuner may pick for a GEMM of at least two row tiles whose rows are long enough for a
# tile's strided row streams to cost more than one pass over A.
PACKED_A = "packed_a"
PACKED_A_MIN_DEPTH = 64
PACKED_A_UNTUNED_ROWS = 256
PACKED_A_UNTUNED_REGISTERS = 16


def _gemm_algorithm(
    ctx: KernelContext, node: Node, algorithms: tuple[str, ...], out_shape, a_row_bytes: int
) -> str:
    """The tuner's choice among `algorithms` (untuned: `_untuned_gemm_algorithm`); A's rows
    `a_row_bytes` apart."""
    rows, columns = out_shape[-2], out_shape[-1]
    untuned = _untuned_gemm_algorithm(ctx, algorithms, rows, a_row_bytes, columns)
    chosen = ctx.choice("gemm_algorithm", untuned)
    if chosen not in algorithms:
        raise KernelError(f"node {node.name!r}: no {chosen!r} GEMM (it can run {algorithms})")
    return chosen


def _untuned_gemm_algorithm(
    ctx: KernelContext, algorithms: tuple[str, ...], rows: int, a_row_bytes: int, columns: int
) -> str:
    """The direct GEMM, but for a GEMM of many rows on a target of 16 vector registers
    (AVX2) whose packed-A form holds more rows in a register tile than the direct form can
    (whose rows, a multiple of 4 KB apart, share an L1 set): packed there. Measured on Zen 3,
    the GEMM alone as a model, default knobs each: 1024^3 16.3 -> 13.8 ms, 2048^3 142 -> 117,
    512^3 2.34 -> 2.06, 256x1024x1024 4.29 -> 3.83; at 64 and 128 rows the two forms part
    by shape (-7% to +9% in the models' in-model checks), so these stay direct. With
    AVX-512's 32 registers the direct tile already runs at the FMA peak: on Zen 4, alone,
    1024^3 228 GFLOP/s direct against 199 packed, 2048^3 223 against 215-220 (the tuner
    still offers the packed form)."""
    if PACKED_A not in algorithms or rows < PACKED_A_UNTUNED_ROWS:
        return "direct"
    if ctx.target.vector_registers > PACKED_A_UNTUNED_REGISTERS:
        return "direct"
    vectors = _gemm_vectors(ctx, columns)
    direct = gemm_row_tile(rows, ctx.target, vectors, a_row_bytes)
    return PACKED_A if packed_row_tile(rows, ctx.target, vectors) > direct else "direct"


def _note_algorithms(ctx: KernelContext, product: Tensor, algorithms: tuple[str, ...]) -> None:
    """Tell the tuner a direct GEMM stage can run other algorithms (its `algorithm` knob)."""
    if len(algorithms) > 1:
        notes = {"algorithms": algorithms, "algorithm_choice": "gemm_algorithm"}
        ctx.note(product.name, **notes, algorithm="direct")


def _strassen(
    ctx, node, a_at, transpose, scale: float, bias_at, algorithms, algorithm: str = STRASSEN
) -> list[Tensor]:
    """A GEMM by constant weights (input 1) as one or two levels of Strassen's algorithm
    (`LEVELS[algorithm]`): the sums of A's blocks (in row-tile panels for STRASSEN_PACKED), the
    7 or 49 products by the build-time sums of B's blocks as one batched GEMM (the group's
    anchor), and the output blocks' sums of products."""
    out = ctx.type(node.outputs[0])
    matrix = ctx.constant(node.inputs[1])
    matrix = matrix.T if transpose else matrix
    if scale != 1.0:
        matrix = matrix * np.asarray(scale, matrix.dtype)
    depth, columns = matrix.shape
    rows, dtype = math.prod(out.shape[:-1]), out.dtype
    levels = LEVELS[algorithm]
    combined = combined_weights(matrix, levels)  # [7^levels, K/s, N/s], s = 2^levels
    block_rows, block_depth, block_columns = (n >> levels for n in (rows, depth, columns))
    label = f"{STRASSEN if levels == 1 else STRASSEN2}{{}}{'t' if transpose else ''}"
    packed, width = packed_panels(ctx, node.inputs[1], label, combined)
    real = (len(combined), block_rows, block_columns)
    kk = reduce_axis(block_depth, "rk")
    if algorithm == STRASSEN_PACKED:
        mr = packed_row_tile(block_rows, ctx.target, _panel_vectors(width, ctx))
        sums = packed_input_sums(ctx, node, a_at, rows, depth, mr, dtype, levels)
        shape = _tiled_shape(ctx, (len(combined), sums.shape[1] * mr, block_columns), width)

        def a_read(p, i):
            return _panel_row(sums, (p,), i, kk, mr)

        row_bytes = 0
    else:
        sums, mr = input_sums(ctx, node, a_at, rows, depth, dtype, levels), 0
        row_bytes = block_depth * np.dtype(dtype).itemsize
        shape = _tiled_shape(ctx, real, width, row_bytes)

        def a_read(p, i):
            return sums[(p, padded_row(i, block_rows, shape[-2]), kk)]

    def body(p, i, j):
        return reduce_sum(a_read(p, i) * _panel_read(packed, width, kk, j, (p,)), kk)

    product = _dense_stage(
        ctx, node, shape, body, real, width, None, dtype, row_bytes, mr, weights=packed.name
    )
    notes = {"algorithms": algorithms, "algorithm_choice": "gemm_algorithm"}
    ctx.note(product.name, **notes, algorithm=algorithm)
    if algorithm == STRASSEN_PACKED:  # its row tile is the panels'
        ctx.note(product.name, packed_rows=True)
    return [output_sums(ctx, node, product, out.shape, bias_at, dtype, levels)]


def _gemm_bias(ctx: KernelContext, node: Node, beta: float):
    """beta * C at an output position (i, j): a Gemm's third input, broadcast."""
    c, out = ctx.tensor(node.inputs[2]), ctx.type(node.outputs[0])

    def at(i, j):
        term = c[broadcast_index(c.shape, out.shape, (i, j))]
        return term * Const(beta, out.dtype) if beta != 1.0 else term

    return at


def _gemm(ctx: KernelContext, node: Node):
    a_value, b_value = node.inputs[0], node.inputs[1]
    out = ctx.type(node.outputs[0])
    alpha, beta = node.attr("alpha", 1.0), node.attr("beta", 1.0)
    trans_a, trans_b = node.attr("transA", 0), node.attr("transB", 0)
    a = ctx.tensor(a_value)
    depth = ctx.type(a_value).shape[0 if trans_a else 1]
    has_c = len(node.inputs) > 2 and node.inputs[2]
    algorithms = _gemm_algorithms(ctx, b_value, out.shape, depth, not trans_a)
    a_row_bytes = 0 if trans_a else depth * np.dtype(ctx.type(a_value).dtype).itemsize
    chosen = _gemm_algorithm(ctx, node, algorithms, out.shape, a_row_bytes)
    if chosen in LEVELS:
        bias_at = _gemm_bias(ctx, node, beta) if has_c else None

        def a_at(i, k):
            return a[i, k]

        return _strassen(ctx, node, a_at, trans_b, alpha, bias_at, algorithms, chosen)
    rows = out.shape[0]
    if chosen == PACKED_A:
        product = _packed_a_product(
            ctx, node, lambda i, k: a[i, k], rows, depth, b_value, bool(trans_b), alpha,
            algorithms,
        )  # fmt: skip
        alpha = 1.0  # folded into the constant panels
    else:
        product, alpha = _direct_gemm(ctx, node, a, depth, a_row_bytes, alpha, algorithms)
    if not has_c and alpha == 1.0:
        return [_cropped(ctx, node, product, out.shape)]
    bias_at = _gemm_bias(ctx, node, beta) if has_c else None

    # At the output's own shape, so it also crops the padded product; the dense template
    # folds it into the tile's store.
    def epilogue(i, j):
        value = product[i, j]
        if alpha != 1.0:
            value = value * Const(alpha, out.dtype)
        return value + bias_at(i, j) if bias_at is not None else value

    return [compute(out.shape, epilogue, ctx.stage_name(node))]


def _direct_gemm(
    ctx: KernelContext, node: Node, a: Tensor, depth: int, a_row_bytes: int, alpha, algorithms
):
    """A Gemm's product read from A where it lies (its rows `a_row_bytes` apart; 0: A
    transposed), and the alpha left to apply (1 when it is folded into constant panels)."""
    out = ctx.type(node.outputs[0])
    b_value, trans_b, trans_a = node.inputs[1], node.attr("transB", 0), node.attr("transA", 0)
    kk = reduce_axis(depth, "rk")
    b_at, width, pack, weights = _dense_b(ctx, node, b_value, bool(trans_b), alpha)
    if pack is None:  # alpha is folded into the constant panels
        alpha = 1.0
    rows = out.shape[0]
    shape = _tiled_shape(ctx, out.shape, width, a_row_bytes, pack)

    def body(i, j):
        row = padded_row(i, rows, shape[0])
        a_at = a[(kk, row) if trans_a else (row, kk)]
        return reduce_sum(a_at * b_at((), kk, j), kk)

    product = _dense_stage(
        ctx, node, shape, body, out.shape, width, pack, a_row_bytes=a_row_bytes, weights=weights
    )
    _note_algorithms(ctx, product, algorithms)
    return product, alpha


def _pool(kind: str) -> Builder:
    def build(ctx: KernelContext, node: Node):
        x = ctx.tensor(node.inputs[0])
        out = ctx.type(node.outputs[0])
        kernel = node.attr("kernel_shape")
        nsp = len(kernel)
        pads, strides, dilations = spatial_params(node, nsp)
        # Ceil mode may read past the end padding: extend it, as the reference does.
        ends = [
            max(
                pads[k + nsp],
                (out.shape[2 + k] - 1) * strides[k]
                + (kernel[k] - 1) * dilations[k]
                + 1
                - x.shape[2 + k]
                - pads[k],
            )
            for k in range(nsp)
        ]
        full_pads = tuple(pads[:nsp]) + tuple(ends)
        lowest = -np.inf if np.dtype(x.dtype).kind == "f" else np.iinfo(x.dtype).min
        low = lowest if kind == "max" else 0.0
        # In NCHW[b]c (the layout pass) a channel-block axis follows the spatial ones.
        padded = _padded(ctx, node, x, full_pads, low, nsp=nsp)
        ks = [reduce_axis(k, f"rk{j}") for j, k in enumerate(kernel)]

        def window(n, c, *rest):
            spatial, block = rest[:nsp], rest[nsp:]
            return padded[(n, c, *_window_index(spatial, ks, strides, dilations), *block)]

        if kind == "max":
            if not any(node.outputs[1:]) and _plain_window(x, strides) and kernel[0] > 1:
                return [_separable_max(ctx, node, x, padded, kernel, strides, dilations)]
            peak = compute(out.shape, lambda *i: reduce_max(window(*i), ks), ctx.stage_name(node))
            if not any(node.outputs[1:]):
                _note_plain_pool(ctx, peak, padded, x, strides)
                return [peak]
            return [peak, _argmax_indices(ctx, node, x.shape, peak, padded, kernel)]
        if kind == "lp":
            p = Const(float(node.attr("p", 2)), x.dtype)
            powered = compute(
                out.shape,
                lambda *i: reduce_sum(Binary("pow", Unary("abs", window(*i)), p), ks),
                ctx.stage_name(node),
            )
            root = Const(1.0 / node.attr("p", 2), x.dtype)
            return [
                compute(out.shape, lambda *i: Binary("pow", powered[i], root), ctx.stage_name(node))
            ]
        total = compute(out.shape, lambda *i: reduce_sum(window(*i), ks), ctx.stage_name(node))
        _note_plain_pool(ctx, total, padded, x, strides)
        counts = _average_divisors(node, x.shape, out.shape, kernel, pads, strides, dilations)
        divisor = ctx.packed(node.outputs[0], "pool_divisor", counts.astype(np.float32))
        return [
            compute(
                out.shape,
                lambda n, c, *s: total[(n, c, *s)] / divisor[tuple(s[:nsp])],
                ctx.stage_name(node),
            )
        ]

    return build


def _separable_max(ctx, node, x: Tensor, padded: Tensor, kernel, strides, dilations) -> Tensor:
    """A 2-d max pool over plain NCHW as two 1-d ones: the max along each padded input row
    the pool reads (its taps `strides[1]` apart, one strided vector load each), then down
    the columns of those row maxima (contiguous loads). A window's kh x kw taps cost kh + kw
    loads a row of outputs shares with its neighbours instead of kh x kw strided loads (3x3
    stride 2 over 64 x 112 x 112, Zen 3, `bench.ab` 20 blocks: 0.50 -> 0.28 ms, ORT 0.37)."""
    shape = ctx.type(node.outputs[0]).shape
    (kh, kw), (sh, sw), (dh, dw) = kernel, strides, dilations
    height = (shape[2] - 1) * sh + (kh - 1) * dh + 1  # the padded rows the pool reads
    across, down = reduce_axis(kw, "rk1"), reduce_axis(kh, "rk0")

    def along_row(n, c, r, x):
        return reduce_max(padded[(n, c, r, *_window_index([x], [across], [sw], [dw]))], [across])

    def down_columns(n, c, y, x):
        return reduce_max(row_max[(n, c, *_window_index([y], [down], [sh], [dh]), x)], [down])

    row_max = compute([*shape[:2], height, shape[3]], along_row, ctx.stage_name(node) + "_rows")
    peak = compute(shape, down_columns, ctx.stage_name(node))
    padded_name = "" if padded is x else padded.name
    ctx.note(peak.name, window="plain", padded=padded_name, rows=row_max.name)
    return peak


def _plain_window(x: Tensor, strides) -> bool:
    """A 2-d window over plain NCHW whose taps along a row load as one vector each."""
    return len(strides) == 2 and len(x.shape) == 4 and one_vector_load(strides[1], x.dtype)


def _note_plain_pool(ctx: KernelContext, pool: Tensor, padded: Tensor, x: Tensor, strides):
    """Mark a pool over the blocked NC[D][H]W[b]c layout for `blocked_pool_schedule`, or a 2-d
    pool over plain NCHW for `plain_window_schedule`, with the stage that pads its input, if
    any. A plain pool only with a stride along the width of at most 4, where a vector of
    window taps is one contiguous load, or one masked load and a shuffle (the codegen's
    strided load: ResNet's 3x3 stride-2 stem pool 0.23 -> 0.13 ms); wider strides would be
    gathered lane by lane, slower than scalar code."""
    padded_name = "" if padded is x else padded.name
    if len(x.shape) == len(strides) + 3:  # NC[D][H]W[b]c: the block is the vector
        ctx.note(pool.name, pool="blocked", padded=padded_name)
    elif _plain_window(x, strides):
        ctx.note(pool.name, window="plain", padded=padded_name)


def _argmax_indices(ctx, node, in_shape, peak, padded, kernel) -> Tensor:
    """MaxPool's Indices: the first maximum of each window (row-major window order, as the
    reference's argmax), as a flat index into the unpadded input, row- or column-major."""
    nsp = len(kernel)
    pads, strides, dilations = spatial_params(node, nsp)
    ks = [reduce_axis(k, f"rk{j}") for j, k in enumerate(kernel)]
    none = Const(int(np.prod(kernel)), INDEX)

    def first_position(n, c, *spatial):
        source = padded[(n, c, *_window_index(spatial, ks, strides, dilations))]
        position = Const(0, INDEX)
        for k, extent in zip(ks, kernel, strict=True):
            position = position * Const(extent, INDEX) + k
        return reduce_min(Select(Binary("eq", source, peak[(n, c, *spatial)]), position, none), ks)

    positions = compute(peak.shape, first_position, ctx.stage_name(node), INDEX)
    dims = in_shape[2:]

    def flat_index(n, c, *spatial):
        position, coords = positions[(n, c, *spatial)], []
        for j in range(nsp):
            inner = int(np.prod(kernel[j + 1 :]))
            k = Binary(
                "mod", Binary("floordiv", position, Const(inner, INDEX)), Const(kernel[j], INDEX)
            )
            coords.append(
                spatial[j] * Const(strides[j], INDEX)
                + k * Const(dilations[j], INDEX)
                - Const(pads[j], INDEX)
            )
        order = reversed(range(nsp)) if node.attr("storage_order", 0) else range(nsp)
        flat = Const(0, INDEX)
        for j in order:
            flat = flat * Const(dims[j], INDEX) + coords[j]
        channel = n * Const(in_shape[1], INDEX) + c
        return channel * Const(int(np.prod(dims)), INDEX) + flat

    return compute(peak.shape, flat_index, ctx.stage_name(node), INDEX)


def _average_divisors(node, in_shape, out_shape, kernel, pads, strides, dilations):
    """How many elements each average-pool window counts (a build-time constant)."""
    nsp = len(kernel)
    include_pad = bool(node.attr("count_include_pad", 0))
    counts = np.ones(out_shape[2 : 2 + nsp], np.float64)
    for k in range(nsp):
        size, o = in_shape[2 + k], np.arange(out_shape[2 + k])
        starts = o * strides[k] - pads[k]
        taps = starts[:, None] + np.arange(kernel[k])[None, :] * dilations[k]
        low, high = (-pads[k], size + pads[k + nsp]) if include_pad else (0, size)
        per_axis = ((taps >= low) & (taps < high)).sum(axis=1)
        shape = [1] * nsp
        shape[k] = len(per_axis)
        counts = counts * per_axis.reshape(shape)
    return counts


def _lrn(ctx: KernelContext, node: Node):
    x = ctx.tensor(node.inputs[0])
    size = node.attr("size")
    alpha, beta, bias = node.attr("alpha", 1e-4), node.attr("beta", 0.75), node.attr("bias", 1.0)
    channels = x.shape[1]
    before = (size - 1) // 2
    r = reduce_axis(size, "rc")

    def square_sum(n, c, *s):
        source = c - Const(before, INDEX) + r
        inside = logical_and(source >= Const(0, INDEX), source < Const(channels, INDEX))
        value = x[(n, clamp(source, channels), *s)]
        return reduce_sum(Select(inside, value * value, Const(0.0, x.dtype)), r)

    sums = compute(x.shape, square_sum, ctx.stage_name(node))

    def body(*i):
        base = Const(bias, x.dtype) + Const(alpha / size, x.dtype) * sums[i]
        return x[i] / _power(base, beta)

    return [compute(x.shape, body, ctx.stage_name(node))]


def _power(base: Expr, exponent: float) -> Expr:
    """base ** exponent for a base > 0. The exponents of the networks that use LRN (0.75 in
    AlexNet, ZFNet and GoogLeNet) as square roots, which vectorize (1 ulp each), where `pow`
    is a libm call per lane (ZFNet's first LRN, 1.1 M values: 6.5 ms on a Zen 3)."""
    if exponent == 1.0:
        return base
    if exponent in (0.5, 0.75):
        root = Unary("sqrt", base)
        return root if exponent == 0.5 else root * Unary("sqrt", root)
    return Binary("pow", base, Const(exponent, base.dtype))


KERNELS: dict[str, Builder] = {
    "Conv": _conv,
    "MatMul": _matmul,
    "Gemm": _gemm,
    "MaxPool": _pool("max"),
    "AveragePool": _pool("avg"),
    "LpPool": _pool("lp"),
    "LRN": _lrn,
}


def _conv_transpose(ctx: KernelContext, node: Node):
    """out[n, m, o] = sum over c and k of x[n, c, (o + pad - k*d) / s] * w[c, m, k], where
    the division is exact and the position inside the input."""
    x = ctx.tensor(node.inputs[0])
    w = ctx.tensor(node.inputs[1])
    out = ctx.type(node.outputs[0])
    nsp = len(x.shape) - 2
    strides, dilations = node.attr("strides"), node.attr("dilations")
    pads, group = node.attr("pads"), node.attr("group", 1)
    cg, mg = x.shape[1] // group, w.shape[1]
    c = reduce_axis(cg, "rc")
    ks = [reduce_axis(k, f"rk{j}") for j, k in enumerate(w.shape[2:])]
    has_bias = len(node.inputs) > 2 and node.inputs[2]
    bias = ctx.tensor(node.inputs[2]) if has_bias else None

    def body(n, m, *o):
        g = Binary("floordiv", m, Const(mg, INDEX))
        channel = g * Const(cg, INDEX) + c
        source, ok = [], None
        for k in range(nsp):
            shifted = o[k] + Const(pads[k], INDEX) - ks[k] * Const(dilations[k], INDEX)
            position = Binary("floordiv", shifted, Const(strides[k], INDEX))
            exact = Binary("mod", shifted, Const(strides[k], INDEX)).equals(Const(0, INDEX))
            inside = logical_and(
                position >= Const(0, INDEX), position < Const(x.shape[2 + k], INDEX)
            )
            cond = logical_and(exact, inside)
            ok = cond if ok is None else logical_and(ok, cond)
            source.append(clamp(position, x.shape[2 + k]))
        value = x[(n, channel, *source)] * w[(channel, Binary("mod", m, Const(mg, INDEX)), *ks)]
        return reduce_sum(Select(ok, value, Const(0.0, x.dtype)), [c, *ks])

    result = compute(out.shape, body, ctx.stage_name(node), out.dtype)
    if bias is None:
        return [result]
    return [
        compute(out.shape, lambda n, m, *o: result[(n, m, *o)] + bias[(m,)], ctx.stage_name(node))
    ]


KERNELS["ConvTranspose"] = _conv_transpose


def _col2im(ctx: KernelContext, node: Node):
    """out[n, c, o] = sum over the block's offsets k of x[n, c x K + flat(k), flat((o + pad -
    k*d) / s)], where the division is exact and the block position inside the grid (K: the
    block's size)."""
    x = ctx.tensor(node.inputs[0])
    out = ctx.type(node.outputs[0])
    block, pads = node.attr("block_shape"), node.attr("pads")
    strides, dilations = node.attr("strides"), node.attr("dilations")
    nsp, grid = len(block), col2im_grid(node)
    ks = [reduce_axis(k, f"rk{j}") for j, k in enumerate(block)]

    def body(n, c, *o):
        offset, position, ok = Const(0, INDEX), Const(0, INDEX), None
        for d in range(nsp):
            offset = offset * Const(block[d], INDEX) + ks[d]
            shifted = o[d] + Const(pads[d], INDEX) - ks[d] * Const(dilations[d], INDEX)
            place = Binary("floordiv", shifted, Const(strides[d], INDEX))
            exact = Binary("mod", shifted, Const(strides[d], INDEX)).equals(Const(0, INDEX))
            inside = logical_and(place >= Const(0, INDEX), place < Const(grid[d], INDEX))
            cond = logical_and(exact, inside)
            ok = cond if ok is None else logical_and(ok, cond)
            position = position * Const(grid[d], INDEX) + clamp(place, grid[d])
        row = c * Const(math.prod(block), INDEX) + offset
        return reduce_sum(Select(ok, x[(n, row, position)], Const(0.0, x.dtype)), ks)

    return [compute(out.shape, body, ctx.stage_name(node), out.dtype)]


KERNELS["Col2Im"] = _col2im


def _einsum(ctx: KernelContext, node: Node):
    """Any explicit or implicit einsum: output letters are loops, the others are summed; an
    ellipsis stands for letters of its own, broadcast numpy's way."""
    operands = [ctx.tensor(v) for v in node.inputs]
    lhs, rhs = _expand_ellipsis(node.attr("equation"), [len(t.shape) for t in operands])
    terms = lhs.split(",")
    sizes: dict[str, int] = {}
    for term, t in zip(terms, operands, strict=True):
        for ch, d in zip(term, t.shape, strict=True):
            sizes[ch] = max(sizes.get(ch, 1), d)
    out = ctx.type(node.outputs[0])
    summed = [ch for ch in sizes if ch not in rhs]
    axes = {ch: reduce_axis(sizes[ch], f"r{ch}") for ch in summed}

    def body(*i):
        letter = dict(zip(rhs, i, strict=True)) | axes
        product = None
        for term, t in zip(terms, operands, strict=True):
            index = (
                letter[ch] if d == sizes[ch] else Const(0, INDEX)  # a broadcast dimension
                for ch, d in zip(term, t.shape, strict=True)
            )
            value = t[tuple(index)]
            product = value if product is None else product * value
        return reduce_sum(product, list(axes.values())) if axes else product

    return [compute(out.shape, body, ctx.stage_name(node), out.dtype)]


def _expand_ellipsis(equation: str, ranks: list[int]) -> tuple[str, str]:
    """(lhs, rhs) with every '...' spelled out in unused letters (right-aligned, as numpy
    broadcasts) and the implicit output made explicit."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    terms = lhs.split(",")
    spare = [ch for ch in string.ascii_letters if ch not in equation]
    covered = [rank - (len(t) - 3) for t, rank in zip(terms, ranks, strict=True) if "..." in t]
    ellipsis = "".join(spare[: max(covered, default=0)])
    terms = [
        t.replace("...", ellipsis[len(ellipsis) - (rank - (len(t) - 3)) :]) if "..." in t else t
        for t, rank in zip(terms, ranks, strict=True)
    ]
    lhs = ",".join(terms)
    if arrow:
        return lhs, rhs.replace("...", ellipsis)
    named = sorted(ch for ch in set(lhs) - set(ellipsis) - {","} if lhs.count(ch) == 1)
    return lhs, ellipsis + "".join(named)


KERNELS["Einsum"] = _einsum
KERNELS["QLinearMatMul"] = lambda ctx, node: [_qlinear_matmul(ctx, node)]


def _matmul_integer(ctx: KernelContext, node: Node):
    """int32 sum of (a - a_zero) (b - b_zero); zero points per tensor, per row of a or per
    column of b."""
    a, b = ctx.tensor(node.inputs[0]), ctx.tensor(node.inputs[1])
    a_zero = ctx.tensor(node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else None
    b_zero = ctx.tensor(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] else None
    out = ctx.type(node.outputs[0])
    if len(a.shape) < 2 or len(b.shape) < 2:
        raise KernelError(f"node {node.name!r}: MatMulInteger of vectors has no native kernel")
    kk = reduce_axis(a.shape[-1], "rk")
    batch_shape = out.shape[:-2]

    def body(*index):
        batch, i, j = index[:-2], index[-2], index[-1]
        a_at = Cast("int32", a[broadcast_index(a.shape[:-2], batch_shape, batch) + (i, kk)])
        b_at = Cast("int32", b[broadcast_index(b.shape[:-2], batch_shape, batch) + (kk, j)])
        return reduce_sum((a_at - _zero_point(a_zero, i)) * (b_at - _zero_point(b_zero, j)), kk)

    return [compute(out.shape, body, ctx.stage_name(node), "int32")]


def _zero_point(t: Tensor | None, position) -> Expr:
    """An integer zero point as int32: absent (0), per tensor, or per row / channel at
    `position` (a 1-D tensor of more than one entry)."""
    if t is None:
        return Const(0, "int32")
    per_entry = t.shape and t.shape[0] > 1
    index = (position,) if per_entry else tuple(Const(0, INDEX) for _ in t.shape)
    return Cast("int32", t[index])


KERNELS["MatMulInteger"] = _matmul_integer


def _integer_conv(ctx: KernelContext, node: Node, x_at: int, w_at: int, zeros: tuple[int, int]):
    """The int32 sum of (x - x_zero) (w - w_zero) over each window: ConvInteger's result and
    QLinearConv's accumulator. A weight zero point is per tensor or per output channel."""
    x, w = ctx.tensor(node.inputs[x_at]), ctx.tensor(node.inputs[w_at])
    x_zero, w_zero = (
        ctx.tensor(node.inputs[k]) if k < len(node.inputs) and node.inputs[k] else None
        for k in zeros
    )
    out_shape = ctx.type(node.outputs[0]).shape
    nsp = len(x.shape) - 2
    pads, strides, dilations = spatial_params(node, nsp)
    group = node.attr("group", 1)
    m, cg = w.shape[0], w.shape[1]
    mg = m // group

    shifted = compute(
        x.shape, lambda *i: Cast("int32", x[i]) - _zero_point(x_zero, None), ctx.stage_name(node)
    )
    padded = _padded(ctx, node, shifted, pads, 0)
    c = reduce_axis(cg, "rc")
    ks = [reduce_axis(k, f"rk{j}") for j, k in enumerate(w.shape[2:])]

    def body(n, o, *spatial):
        channel = _input_channel(o, c, group, mg, cg)
        source = padded[(n, channel, *_window_index(spatial, ks, strides, dilations))]
        weight = Cast("int32", w[(o, c, *ks)]) - _zero_point(w_zero, o)
        return reduce_sum(source * weight, [c, *ks])

    return compute(out_shape, body, ctx.stage_name(node), "int32")


def _conv_integer(ctx: KernelContext, node: Node):
    return [_integer_conv(ctx, node, 0, 1, (2, 3))]


def _qlinear_conv(ctx: KernelContext, node: Node):
    """round(accumulator (+ bias) * x_scale * w_scale[m] / y_scale) + y_zero, saturated; the
    scaling in float64, as the reference does."""
    acc = _integer_conv(ctx, node, 0, 3, (2, 5))
    x_scale, w_scale, y_scale, y_zero = (ctx.tensor(node.inputs[k]) for k in (1, 4, 6, 7))
    bias = ctx.tensor(node.inputs[8]) if len(node.inputs) > 8 and node.inputs[8] else None
    out = ctx.type(node.outputs[0])
    info = np.iinfo(out.dtype)
    f64 = "float64"

    def scalar(t):
        return Cast(f64, t[tuple(Const(0, INDEX) for _ in t.shape)])

    def body(n, o, *spatial):
        value = Cast(f64, acc[(n, o, *spatial)])
        if bias is not None:
            value = value + Cast(f64, bias[(o,)])
        scale_w = (
            Cast(f64, w_scale[(o,)]) if w_scale.shape and w_scale.shape[0] > 1 else scalar(w_scale)
        )
        value = Unary("round", value * (scalar(x_scale) * scale_w / scalar(y_scale)))
        value = value + scalar(y_zero)
        low, high = Const(float(info.min), f64), Const(float(info.max), f64)
        return Cast(out.dtype, Binary("min", Binary("max", value, low), high))

    return [compute(out.shape, body, ctx.stage_name(node), out.dtype)]


KERNELS.update({"ConvInteger": _conv_integer, "QLinearConv": _qlinear_conv})


def _deform_conv(ctx: KernelContext, node: Node):
    """Each kernel tap samples the input at its offset position (multilinear, zero outside),
    scaled by the mask, then contracts with the weight; accumulated in float64 like the
    reference."""
    x, w, offset = (ctx.tensor(v) for v in node.inputs[:3])
    bias = ctx.tensor(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] else None
    mask = ctx.tensor(node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] else None
    out = ctx.type(node.outputs[0])
    f64 = "float64"
    strides, dilations, pads = node.attr("strides"), node.attr("dilations"), node.attr("pads")
    group, offset_group = node.attr("group", 1), node.attr("offset_group", 1)
    kernel = w.shape[2:]
    nsp, taps = len(kernel), math.prod(kernel)
    channels, spatial = x.shape[1], x.shape[2:]
    cg, mg, cog = w.shape[1], w.shape[0] // group, channels // offset_group
    rc = reduce_axis(cg, "rc")
    ks = [reduce_axis(k, f"rk{j}") for j, k in enumerate(kernel)]

    def body(n, m, *o):
        channel = Binary("floordiv", m, Const(mg, INDEX)) * Const(cg, INDEX) + rc
        og = Binary("floordiv", channel, Const(cog, INDEX))
        tap = Const(0, INDEX)
        for k, extent in zip(ks, kernel, strict=True):
            tap = tap * Const(extent, INDEX) + k
        base, frac = [], []
        for d in range(nsp):
            shift = offset[
                (n, (og * Const(taps, INDEX) + tap) * Const(nsp, INDEX) + Const(d, INDEX), *o)
            ]
            start = (
                o[d] * Const(strides[d], INDEX)
                - Const(pads[d], INDEX)
                + ks[d] * Const(dilations[d], INDEX)
            )
            position = Cast(f64, start) + Cast(f64, shift)
            floor = Unary("floor", position)
            base.append(Cast(INDEX, floor))
            frac.append(position - floor)
        sample = None
        for corner in itertools.product((0, 1), repeat=nsp):
            weight, inside, index = None, None, []
            for d in range(nsp):
                part = frac[d] if corner[d] else Const(1.0, f64) - frac[d]
                weight = part if weight is None else weight * part
                coord = base[d] + Const(corner[d], INDEX)
                ok = logical_and(coord >= Const(0, INDEX), coord < Const(spatial[d], INDEX))
                inside = ok if inside is None else logical_and(inside, ok)
                index.append(clamp(coord, spatial[d]))
            value = Select(inside, Cast(f64, x[(n, channel, *index)]), Const(0.0, f64)) * weight
            sample = value if sample is None else sample + value
        if mask is not None:
            sample = sample * Cast(f64, mask[(n, og * Const(taps, INDEX) + tap, *o)])
        return reduce_sum(Cast(f64, w[(m, rc, *ks)]) * sample, [rc, *ks])

    total = compute(out.shape, body, ctx.stage_name(node), f64)

    def result(n, m, *o):
        value = total[(n, m, *o)]
        if bias is not None:
            value = value + Cast(f64, bias[(m,)])
        return Cast(out.dtype, value)

    return [compute(out.shape, result, ctx.stage_name(node), out.dtype)]


KERNELS["DeformConv"] = _deform_conv
