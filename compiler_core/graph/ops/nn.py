"""Neural-network operators: convolution, pooling, dense algebra, normalizations.

Spatial attributes are canonical after import: `pads` (begins then ends), `strides` and
`dilations` always have one entry per spatial axis; `auto_pad` has been resolved.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from compiler_core.graph.ir import OpKind, TensorType
from compiler_core.graph.ops.base import OpDef, ShapeError, broadcast_shapes, opdef, same_as
from compiler_core.graph.ops.layout import (
    PLAIN,
    block_of,
    blocked_shape,
    plain_shape,
    to_blocked,
    to_plain,
)


def spatial_params(node, nsp: int):
    pads = node.attr("pads", (0,) * (2 * nsp))
    strides = node.attr("strides", (1,) * nsp)
    dilations = node.attr("dilations", (1,) * nsp)
    return tuple(pads), tuple(strides), tuple(dilations)


def window_output_size(size, kernel, pad_begin, pad_end, stride, dilation, ceil_mode=False):
    extent = (kernel - 1) * dilation + 1
    span = size + pad_begin + pad_end - extent
    if span < 0:
        raise ShapeError(f"window of extent {extent} exceeds padded input {size}")
    out = (math.ceil(span / stride) if ceil_mode else span // stride) + 1
    # ONNX: with ceil_mode, a last window that would start in the end padding is dropped.
    if ceil_mode and (out - 1) * stride >= size + pad_begin:
        out -= 1
    return out


def _windows(x, kernel, pads, strides, dilations, fill, out_sizes):
    """(N, C, *out, *kernel) view of every window, padded with `fill`."""
    nsp = len(kernel)
    ext = [(k - 1) * d + 1 for k, d in zip(kernel, dilations, strict=True)]
    # Pad enough at the end for every output window (ceil mode may read past the pads).
    ends = [
        max(pads[i + nsp], (out_sizes[i] - 1) * strides[i] + ext[i] - x.shape[2 + i] - pads[i])
        for i in range(nsp)
    ]
    widths = [(0, 0), (0, 0)] + [(pads[i], ends[i]) for i in range(nsp)]
    xp = np.pad(x, widths, constant_values=fill)
    win = sliding_window_view(xp, ext, axis=tuple(range(2, 2 + nsp)))
    index = (
        (slice(None), slice(None))
        + tuple(slice(0, (o - 1) * s + 1, s) for o, s in zip(out_sizes, strides, strict=True))
        + tuple(slice(None, None, d) for d in dilations)
    )
    return win[index]


# --- convolution -------------------------------------------------------------------------------


def conv_layouts(node) -> tuple[int, int]:
    """Channel blocks of a Conv's data and output (0: plain NCHW), set by the layout pass."""
    return (
        block_of(node.attr("data_layout", PLAIN)),
        block_of(node.attr("out_layout", PLAIN)),
    )


def _data_channels(node, types) -> int:
    """The real input channels of a Conv that reads blocked (maybe padded) data."""
    return types[1].shape[1] * node.attr("group", 1)


def _conv_rule(node, types):
    data_block, out_block = conv_layouts(node)
    if data_block or out_block:
        channels = _data_channels(node, types) if data_block else 0
        plain = TensorType(plain_shape(types[0].shape, data_block, channels), types[0].dtype)
        (out,) = _plain_conv_rule(node, [plain, *types[1:]])
        return [TensorType(blocked_shape(out.shape, out_block), out.dtype)]
    return _plain_conv_rule(node, types)


def _plain_conv_rule(node, types):
    x, w = types[0], types[1]
    nsp = x.rank - 2
    group = node.attr("group", 1)
    if w.rank != x.rank or x.shape[1] != w.shape[1] * group or w.shape[0] % group:
        raise ShapeError(f"weight {w} does not fit input {x} with group={group}")
    pads, strides, dilations = spatial_params(node, nsp)
    out = [
        window_output_size(
            x.shape[2 + i], w.shape[2 + i], pads[i], pads[i + nsp], strides[i], dilations[i]
        )
        for i in range(nsp)
    ]
    return [TensorType((x.shape[0], w.shape[0], *out), x.dtype)]


def _conv(node, inputs):
    data_block, out_block = conv_layouts(node)
    if data_block or out_block:
        channels = inputs[1].shape[1] * node.attr("group", 1)
        plain = [to_plain(inputs[0], data_block, channels), *inputs[1:]]
        return [to_blocked(_plain_conv(node, plain)[0], out_block)]
    return _plain_conv(node, inputs)


def _plain_conv(node, inputs):
    x, w = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    nsp = x.ndim - 2
    group = node.attr("group", 1)
    pads, strides, dilations = spatial_params(node, nsp)
    out_sizes = _plain_conv_rule(node, [TensorType.of(x), TensorType.of(w)])[0].shape[2:]
    win = _windows(x, w.shape[2:], pads, strides, dilations, 0, out_sizes)
    n, m = x.shape[0], w.shape[0]
    cg, mg = x.shape[1] // group, m // group
    p, k = int(np.prod(out_sizes)), int(np.prod(w.shape[2:]))
    # (N, C, *out, *k) -> (N, G, P, Cg*K) against (G, Cg*K, Mg): one batched matmul.
    cols = win.reshape(n, group, cg, p, k).transpose(0, 1, 3, 2, 4).reshape(n, group, p, cg * k)
    weights = w.reshape(group, mg, cg * k).transpose(0, 2, 1)
    out = np.matmul(cols, weights)  # (N, G, P, Mg)
    out = out.transpose(0, 1, 3, 2).reshape(n, m, *out_sizes)
    if bias is not None:
        out = out + bias.reshape((1, m) + (1,) * nsp)
    return [out.astype(x.dtype, copy=False)]


# --- pooling -----------------------------------------------------------------------------------


def _pool_out_sizes(node, shape):
    kernel = node.attr("kernel_shape")
    nsp = len(kernel)
    pads, strides, dilations = spatial_params(node, nsp)
    ceil_mode = bool(node.attr("ceil_mode", 0))
    return [
        window_output_size(
            shape[2 + i], kernel[i], pads[i], pads[i + nsp], strides[i], dilations[i], ceil_mode
        )
        for i in range(nsp)
    ]


def _pool_rule(node, types):
    x = types[0]
    out = TensorType((*x.shape[:2], *_pool_out_sizes(node, x.shape)), x.dtype)
    if node.op == "MaxPool":
        return [out, TensorType(out.shape, "int64")]
    return [out]


def _layout_pool_rule(node, types):
    """Pooling in NCHW[b]c (set by the layout pass) is pooling of the plain data, blocked."""
    block = block_of(node.attr("data_layout", PLAIN))
    if not block:
        return _pool_rule(node, types)
    plain = TensorType(plain_shape(types[0].shape, block), types[0].dtype)
    return [TensorType(blocked_shape(t.shape, block), t.dtype) for t in _pool_rule(node, [plain])]


def _in_data_layout(compute):
    def run(node, inputs):
        block = block_of(node.attr("data_layout", PLAIN))
        if not block:
            return compute(node, inputs)
        results = compute(node, [to_plain(inputs[0], block), *inputs[1:]])
        return [to_blocked(r, block) for r in results]

    return run


def _max_pool(node, inputs):
    x = inputs[0]
    kernel = node.attr("kernel_shape")
    nsp = len(kernel)
    pads, strides, dilations = spatial_params(node, nsp)
    out_sizes = _pool_out_sizes(node, x.shape)
    low = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
    win = _windows(x, kernel, pads, strides, dilations, low, out_sizes)
    flat = win.reshape(*win.shape[: 2 + nsp], -1)
    values = flat.max(axis=-1)
    # Indices into the unpadded input, row-major (storage_order=0) or column-major (1).
    pos = np.argmax(flat, axis=-1)
    coords = np.unravel_index(pos, kernel)
    grids = np.meshgrid(*[np.arange(o) for o in out_sizes], indexing="ij")
    spatial = [grids[i] * strides[i] + coords[i] * dilations[i] - pads[i] for i in range(nsp)]
    dims = x.shape[2:]
    if node.attr("storage_order", 0):
        flat_index = np.zeros_like(spatial[0])
        for i in reversed(range(nsp)):
            flat_index = flat_index * dims[i] + spatial[i]
    else:
        flat_index = np.ravel_multi_index(spatial, dims, mode="clip")
    channel = np.arange(x.shape[0] * x.shape[1]).reshape(x.shape[0], x.shape[1], *(1,) * nsp)
    indices = channel * int(np.prod(dims)) + flat_index
    return [values.astype(x.dtype), indices.astype(np.int64)]


def _avg_pool(node, inputs):
    x = inputs[0]
    kernel = node.attr("kernel_shape")
    nsp = len(kernel)
    pads, strides, dilations = spatial_params(node, nsp)
    out_sizes = _pool_out_sizes(node, x.shape)
    sums = _windows(x.astype(np.float64), kernel, pads, strides, dilations, 0, out_sizes)
    sums = sums.sum(axis=tuple(range(-nsp, 0)))
    # The divisor counts real elements, plus the explicit pads when count_include_pad=1;
    # padding added only to complete a ceil-mode window never counts.
    if node.attr("count_include_pad", 0):
        region = np.pad(
            np.ones((1, 1, *x.shape[2:])),
            [(0, 0), (0, 0)] + [(pads[i], pads[i + nsp]) for i in range(nsp)],
            constant_values=1,
        )
        shifted = [0] * (2 * nsp)
    else:
        region = np.ones((1, 1, *x.shape[2:]))
        shifted = list(pads)
    counts = _windows(region, kernel, shifted, strides, dilations, 0, out_sizes)
    counts = counts.sum(axis=tuple(range(-nsp, 0)))
    return [(sums / counts).astype(x.dtype)]


def _lp_pool(node, inputs):
    x = inputs[0]
    kernel = node.attr("kernel_shape")
    nsp = len(kernel)
    pads, strides, dilations = spatial_params(node, nsp)
    p = node.attr("p", 2)
    out_sizes = _pool_out_sizes(node, x.shape)
    win = _windows(
        np.abs(x.astype(np.float64)) ** p, kernel, pads, strides, dilations, 0, out_sizes
    )
    return [(win.sum(axis=tuple(range(-nsp, 0))) ** (1.0 / p)).astype(x.dtype)]


# --- dense algebra -----------------------------------------------------------------------------


def _matmul_rule(node, types):
    a, b = types[0].shape, types[1].shape
    if not a or not b:
        raise ShapeError("MatMul operands must have rank >= 1")
    a2 = (1,) + a if len(a) == 1 else a
    b2 = b + (1,) if len(b) == 1 else b
    if a2[-1] != b2[-2]:
        raise ShapeError(f"inner dimensions {a2[-1]} and {b2[-2]} differ")
    batch = broadcast_shapes(a2[:-2], b2[:-2])
    shape = batch + (a2[-2],) * (len(a) > 1) + (b2[-1],) * (len(b) > 1)
    return [TensorType(shape, types[0].dtype)]


def _matmul(node, inputs):
    return [np.matmul(inputs[0], inputs[1])]


def _gemm_rule(node, types):
    a, b = types[0], types[1]
    m, k = a.shape[::-1] if node.attr("transA", 0) else a.shape
    k2, n = b.shape[::-1] if node.attr("transB", 0) else b.shape
    if k != k2:
        raise ShapeError(f"Gemm inner dimensions {k} and {k2} differ")
    if len(types) > 2 and types[2] is not None:
        broadcast_shapes(types[2].shape, (m, n))
    return [TensorType((m, n), a.dtype)]


def _gemm(node, inputs):
    a, b = inputs[0], inputs[1]
    c = inputs[2] if len(inputs) > 2 else None
    a = a.T if node.attr("transA", 0) else a
    b = b.T if node.attr("transB", 0) else b
    out = node.attr("alpha", 1.0) * (a @ b)
    if c is not None:
        out = out + node.attr("beta", 1.0) * c
    return [np.asarray(out).astype(inputs[0].dtype, copy=False)]


def _einsum_rule(node, types):
    # Evaluated on zero-strided views: inputs are never allocated, only the (small) result.
    views = [np.broadcast_to(np.zeros((), _einsum_dtype(t.dtype)), t.shape) for t in types]
    try:
        out = np.einsum(node.attr("equation"), *views)
    except ValueError as err:
        raise ShapeError(f"einsum {node.attr('equation')!r}: {err}") from None
    return [TensorType(np.shape(out), types[0].dtype)]


def _einsum_dtype(dtype):
    # numpy's einsum has no bfloat16 loops: compute those in float32.
    return np.float32 if np.dtype(dtype).name == "bfloat16" else dtype


def _einsum(node, inputs):
    operands = [x.astype(_einsum_dtype(x.dtype), copy=False) for x in inputs]
    out = np.einsum(node.attr("equation"), *operands)
    return [np.asarray(out).astype(inputs[0].dtype, copy=False)]


# --- normalizations ----------------------------------------------------------------------------


def _batch_norm(node, inputs):
    x, scale, bias, mean, var = inputs
    eps = node.attr("epsilon", 1e-5)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    inv = (scale / np.sqrt(var.astype(np.float64) + eps)).reshape(shape)
    out = (x - mean.reshape(shape)) * inv + bias.reshape(shape)
    return [out.astype(x.dtype)]


def _layer_norm_rule(node, types):
    x = types[0]
    axis = node.attr("axis", -1) % x.rank
    stat = TensorType(x.shape[:axis] + (1,) * (x.rank - axis), node.attr("stash_type", x.dtype))
    return [x, stat, stat]


def _layer_norm(node, inputs):
    x, scale = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    axis = node.attr("axis", -1) % x.ndim
    axes = tuple(range(axis, x.ndim))
    v = x.astype(np.float64)
    mean = v.mean(axis=axes, keepdims=True)
    var = ((v - mean) ** 2).mean(axis=axes, keepdims=True)
    inv_std = 1.0 / np.sqrt(var + node.attr("epsilon", 1e-5))
    out = (v - mean) * inv_std * scale
    if bias is not None:
        out = out + bias
    stash = node.attr("stash_type", x.dtype.name)
    return [out.astype(x.dtype), mean.astype(stash), inv_std.astype(stash)]


def _instance_norm(node, inputs):
    x, scale, bias = inputs
    axes = tuple(range(2, x.ndim))
    v = x.astype(np.float64)
    mean = v.mean(axis=axes, keepdims=True)
    var = v.var(axis=axes, keepdims=True)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    out = (v - mean) / np.sqrt(var + node.attr("epsilon", 1e-5))
    return [(out * scale.reshape(shape) + bias.reshape(shape)).astype(x.dtype)]


def _lrn(node, inputs):
    x = inputs[0]
    size = node.attr("size")
    alpha, beta, bias = node.attr("alpha", 1e-4), node.attr("beta", 0.75), node.attr("bias", 1.0)
    sq = x.astype(np.float64) ** 2
    channels = x.shape[1]
    before, after = (size - 1) // 2, size // 2  # floor((size-1)/2), ceil((size-1)/2)
    padded = np.pad(sq, [(0, 0), (before, after)] + [(0, 0)] * (x.ndim - 2))
    window = sum(padded[:, i : i + channels] for i in range(size))
    return [(x / (bias + alpha / size * window) ** beta).astype(x.dtype)]


OPS: dict[str, OpDef] = {
    "Conv": opdef("Conv", OpKind.OUT_ELEMWISE_FUSABLE, _conv_rule, _conv),
    "MaxPool": opdef(
        "MaxPool", OpKind.OUT_ELEMWISE_FUSABLE, _layout_pool_rule, _in_data_layout(_max_pool)
    ),
    "AveragePool": opdef(
        "AveragePool", OpKind.OUT_ELEMWISE_FUSABLE, _layout_pool_rule, _in_data_layout(_avg_pool)
    ),
    "LpPool": opdef("LpPool", OpKind.OUT_ELEMWISE_FUSABLE, _pool_rule, _lp_pool),
    "MatMul": opdef("MatMul", OpKind.OUT_ELEMWISE_FUSABLE, _matmul_rule, _matmul),
    "Gemm": opdef("Gemm", OpKind.OUT_ELEMWISE_FUSABLE, _gemm_rule, _gemm),
    "Einsum": opdef("Einsum", OpKind.OUT_ELEMWISE_FUSABLE, _einsum_rule, _einsum),
    "BatchNormalization": opdef("BatchNormalization", OpKind.BROADCAST, same_as(0), _batch_norm),
    "LayerNormalization": opdef("LayerNormalization", OpKind.OPAQUE, _layer_norm_rule, _layer_norm),
    "InstanceNormalization": opdef(
        "InstanceNormalization", OpKind.OPAQUE, same_as(0), _instance_norm
    ),
    "LRN": opdef("LRN", OpKind.OPAQUE, same_as(0), _lrn),
}
