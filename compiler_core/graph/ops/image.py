"""Image operators. Resize is separable: along each resized axis the output is a fixed weight
matrix (out x in) applied to the input, which is how the reference computes it."""

from __future__ import annotations

import numpy as np

from compiler_core.graph.ir import OpKind, TensorType
from compiler_core.graph.ops.base import OpDef, opdef


def source_coordinates(node, axis: int, in_len: int, out_len: int, scale: float) -> np.ndarray:
    """Where each output position samples the input, per the coordinate transformation."""
    x = np.arange(out_len, dtype=np.float64)
    mode = node.attr("coordinate_transformation_mode", "half_pixel")
    # The corner-aligned modes use the unrounded output length, scale * input length.
    exact_len = scale * in_len
    if mode == "align_corners":
        return np.zeros_like(x) if exact_len == 1 else x * (in_len - 1) / (exact_len - 1)
    if mode == "asymmetric":
        return x / scale
    if mode == "pytorch_half_pixel":
        return np.full_like(x, -0.5) if exact_len == 1 else (x + 0.5) / scale - 0.5
    if mode == "half_pixel":
        return (x + 0.5) / scale - 0.5
    if mode == "half_pixel_symmetric":
        adjustment = out_len / (scale * in_len)
        offset = in_len / 2 * (1 - adjustment)
        return offset + (x + 0.5) / scale - 0.5
    if mode == "tf_crop_and_resize":
        start, end = node.attr("roi")[axis]
        if exact_len == 1:
            return np.full_like(x, (end - start) * (in_len - 1) / 2 + start * (in_len - 1))
        return start * (in_len - 1) + x * (end - start) * (in_len - 1) / (exact_len - 1)
    raise ValueError(f"unknown coordinate_transformation_mode {mode!r}")


def _nearest_taps(node, ratio):
    mode = node.attr("nearest_mode", "round_prefer_floor")
    integral = ratio == 1.0
    if mode == "round_prefer_floor":
        right = ratio > 0.5
    elif mode == "round_prefer_ceil":
        right = ratio >= 0.5
    elif mode == "floor":
        right = np.zeros_like(ratio, bool)
    elif mode == "ceil":
        right = np.ones_like(ratio, bool)
    else:
        raise ValueError(f"unknown nearest_mode {mode!r}")
    right = right | integral
    return 0, np.stack([~right, right], axis=1).astype(np.float64)


def _cubic(distance, a):
    d = np.abs(distance)
    near = ((a + 2) * d - (a + 3)) * d * d + 1
    far = ((a * d - 5 * a) * d + 8 * a) * d - 4 * a
    return np.where(d <= 1, near, np.where(d < 2, far, 0.0))


def _filter_taps(node, ratio, scale):
    """(first tap offset, weights[out, taps]) for linear and cubic, with antialiasing."""
    mode = node.attr("mode", "nearest")
    support = 1 if mode == "linear" else 2
    shrink = min(scale, 1.0) if node.attr("antialias", 0) else 1.0
    start = int(np.floor(-support / shrink) + 1)
    offsets = np.arange(start, 1 - start + 1)  # taps relative to x0 = x - ratio
    distance = (offsets[None, :] - ratio[:, None]) * shrink
    if mode == "linear":
        weights = np.clip(1 - np.abs(distance), 0, 1)
    else:
        weights = _cubic(distance, node.attr("cubic_coeff_a", -0.75))
    if shrink != 1.0:
        weights = weights / weights.sum(axis=1, keepdims=True)
    return start, weights


def axis_weights(node, axis: int, in_len: int, out_len: int, scale: float):
    """(weight matrix [out, in], mask of outputs that fall outside a crop-and-resize roi)."""
    x = source_coordinates(node, axis, in_len, out_len, scale)
    floor = np.floor(x)
    ratio = np.where(x == floor, 1.0, x - floor)  # in (0, 1]: the left neighbour is preferred
    left = (x - ratio).astype(np.int64)
    if node.attr("mode", "nearest") == "nearest":
        start, taps = _nearest_taps(node, ratio)
    else:
        start, taps = _filter_taps(node, ratio, scale)
    index = left[:, None] + start + np.arange(taps.shape[1])[None, :]
    if node.attr("exclude_outside", 0):
        taps = np.where((index >= 0) & (index < in_len), taps, 0.0)
        taps = taps / taps.sum(axis=1, keepdims=True)
    matrix = np.zeros((out_len, in_len))
    rows = np.repeat(np.arange(out_len), taps.shape[1])
    np.add.at(matrix, (rows, np.clip(index, 0, in_len - 1).reshape(-1)), taps.reshape(-1))
    outside = np.zeros(out_len, bool)
    if node.attr("coordinate_transformation_mode", "") == "tf_crop_and_resize":
        outside = (x < 0) | (x > in_len - 1)
    return matrix, outside


def _resize(node, inputs):
    x = inputs[0]
    out_shape = node.attr("sizes")
    scales = node.attr("scales")
    result = x.astype(np.float64)
    outside = np.zeros(out_shape, bool)
    for axis, (in_len, out_len) in enumerate(zip(x.shape, out_shape, strict=True)):
        if in_len == out_len and scales[axis] == 1.0 and node.attr("roi", None) is None:
            continue
        matrix, out_of_roi = axis_weights(node, axis, in_len, out_len, scales[axis])
        result = np.moveaxis(np.tensordot(result, matrix, axes=([axis], [1])), -1, axis)
        if out_of_roi.any():
            shape = [1] * len(out_shape)
            shape[axis] = out_len
            outside = outside | out_of_roi.reshape(shape)
    result = np.where(outside, node.attr("extrapolation_value", 0.0), result)
    if x.dtype.kind in "iu":
        result = np.round(result)
    return [result.astype(x.dtype)]


def _resize_rule(node, types):
    return [TensorType(tuple(node.attr("sizes")), types[0].dtype)]


OPS: dict[str, OpDef] = {
    "Resize": opdef("Resize", OpKind.INJECTIVE, _resize_rule, _resize),
}


# --- GridSample ----------------------------------------------------------------------------


def _reflect(x: np.ndarray, twice_low: float, twice_high: float) -> np.ndarray:
    if twice_low == twice_high:
        return np.zeros_like(x)
    low, span = twice_low / 2, (twice_high - twice_low) / 2
    x = np.abs(x - low)
    extra, flips = np.fmod(x, span), np.floor(x / span)
    return np.where(flips % 2 == 0, extra + low, span - extra + low)


def _pad_coordinate(x: np.ndarray, size: int, padding: str, align: bool) -> np.ndarray:
    """Border and reflection padding act on the sampling coordinate."""
    if padding == "border":
        return np.clip(x, 0, size - 1)
    if padding == "reflection":
        bounds = (0, 2 * (size - 1)) if align else (-1, 2 * size - 1)
        return np.clip(_reflect(x, *bounds), 0, size - 1)
    return x


def _unnormalize(g: np.ndarray, size: int, align: bool) -> np.ndarray:
    return (g + 1) / 2 * (size - 1) if align else ((g + 1) * size - 1) / 2


def _sample(x: np.ndarray, batch: np.ndarray, taps: list[np.ndarray]) -> np.ndarray:
    """x[n, :, taps...] for every output point, zero where a tap is out of bounds."""
    sizes = x.shape[2:]
    inside = np.ones(taps[0].shape, bool)
    clipped = []
    for tap, size in zip(taps, sizes, strict=True):
        inside &= (tap >= 0) & (tap < size)
        clipped.append(np.clip(tap, 0, size - 1))
    values = x[(batch, slice(None), *clipped)]  # (N, *out, C)
    values = np.where(inside[..., None], values, 0.0)
    return np.moveaxis(values, -1, 1)


def _grid_sample(node, inputs):
    x, grid = inputs[0].astype(np.float64), inputs[1].astype(np.float64)
    nsp = x.ndim - 2
    sizes = x.shape[2:]
    mode = {"bilinear": "linear", "bicubic": "cubic"}.get(
        node.attr("mode", "linear"), node.attr("mode", "linear")
    )
    padding = node.attr("padding_mode", "zeros")
    align = bool(node.attr("align_corners", 0))
    # grid's last axis lists coordinates innermost-dimension first (x, y, ...).
    coords = [_unnormalize(grid[..., nsp - 1 - d], sizes[d], align) for d in range(nsp)]
    batch = np.arange(x.shape[0]).reshape((-1,) + (1,) * (grid.ndim - 2))
    if mode == "nearest":
        taps = [
            np.rint(_pad_coordinate(c, s, padding, align)).astype(np.int64)
            for c, s in zip(coords, sizes, strict=True)
        ]
        out = _sample(x, batch, taps)
    elif mode == "linear":
        coords = [_pad_coordinate(c, s, padding, align) for c, s in zip(coords, sizes, strict=True)]
        out = 0.0
        for corner in np.ndindex(*(2,) * nsp):
            weight, taps = 1.0, []
            for d, bit in enumerate(corner):
                low = np.floor(coords[d])
                frac = coords[d] - low
                weight = weight * (frac if bit else 1 - frac)
                taps.append((low + bit).astype(np.int64))
            out = out + _sample(x, batch, taps) * weight[:, None]
    else:
        a = -0.75
        out = 0.0
        for corner in np.ndindex(*(4,) * nsp):
            weight, taps = 1.0, []
            for d, k in enumerate(corner):
                low = np.floor(coords[d])
                t = coords[d] - low
                distance = np.abs(t - (k - 1))
                weight = weight * np.where(
                    distance <= 1,
                    ((a + 2) * distance - (a + 3)) * distance * distance + 1,
                    ((a * distance - 5 * a) * distance + 8 * a) * distance - 4 * a,
                )
                tap = _pad_coordinate(low + k - 1, sizes[d], padding, align)
                taps.append(
                    np.rint(tap).astype(np.int64)
                    if padding != "zeros"
                    else (low + k - 1).astype(np.int64)
                )
            out = out + _sample(x, batch, taps) * weight[:, None]
    return [np.asarray(out).astype(inputs[0].dtype)]


def _grid_sample_rule(node, types):
    x, grid = types[0], types[1]
    return [TensorType((x.shape[0], x.shape[1], *grid.shape[1:-1]), x.dtype)]


OPS["GridSample"] = opdef("GridSample", OpKind.INJECTIVE, _grid_sample_rule, _grid_sample)


# --- RoiAlign ------------------------------------------------------------------------------


def _roi_axis_samples(start, length, bins, ratio, size):
    """Bilinear taps of the sampling points along one axis of one roi.

    Returns (low index, high index, low weight, high weight), each [bins, samples]. A point
    more than one pixel outside the map contributes nothing (both weights zero); points within
    that margin are clamped to the edge, as Caffe2 and onnxruntime do.
    """
    samples = ratio if ratio > 0 else max(int(np.ceil(length / bins)), 1)
    step = length / bins
    offsets = (np.arange(samples) + 0.5) * step / samples
    y = start + np.arange(bins)[:, None] * step + offsets[None, :]
    valid = (y >= -1.0) & (y <= size)
    y = np.maximum(y, 0.0)
    low = np.minimum(np.floor(y), size - 1).astype(np.int64)
    high = np.minimum(low + 1, size - 1)
    y = np.where(low >= size - 1, low, y)
    frac = y - low
    return low, high, np.where(valid, 1 - frac, 0.0), np.where(valid, frac, 0.0)


def _roi_geometry(node, roi):
    """(y start, x start, height, width) of a roi on the feature map."""
    scale = node.attr("spatial_scale", 1.0)
    half_pixel = node.attr("coordinate_transformation_mode", "half_pixel") == "half_pixel"
    x1, y1, x2, y2 = (float(v) * scale - (0.5 if half_pixel else 0.0) for v in roi)
    height, width = y2 - y1, x2 - x1
    if not half_pixel:  # the legacy mode forces rois to be at least one pixel large
        height, width = max(height, 1.0), max(width, 1.0)
    return y1, x1, height, width


def _roi_average(image, ys, xs):
    """Mean over the sampling points: separable, one weight matrix per axis."""

    def weights(low, high, w_low, w_high, size):
        matrix = np.zeros((low.shape[0], size))
        rows = np.arange(low.shape[0])[:, None]
        np.add.at(matrix, (np.broadcast_to(rows, low.shape), low), w_low)
        np.add.at(matrix, (np.broadcast_to(rows, high.shape), high), w_high)
        return matrix / low.shape[1]

    wy = weights(*ys, image.shape[1])
    wx = weights(*xs, image.shape[2])
    return np.einsum("ph,chw,qw->cpq", wy, image, wx)


def _roi_max(image, ys, xs):
    """Max over the sampling points of each weighted corner value (onnxruntime's definition)."""
    best = None
    for y_index, y_weight in ((ys[0], ys[2]), (ys[1], ys[3])):
        for x_index, x_weight in ((xs[0], xs[2]), (xs[1], xs[3])):
            # [C, bins_y, samples_y, bins_x, samples_x]
            values = image[:, y_index[:, :, None, None], x_index[None, None, :, :]]
            weighted = values * (y_weight[:, :, None, None] * x_weight[None, None, :, :])
            best = weighted if best is None else np.maximum(best, weighted)
    return best.max(axis=(2, 4))


def _roi_align(node, inputs):
    x, rois, batch_indices = inputs
    out_h, out_w = node.attr("output_height", 1), node.attr("output_width", 1)
    ratio = node.attr("sampling_ratio", 0)
    pool = _roi_max if node.attr("mode", "avg") == "max" else _roi_average
    image_h, image_w = x.shape[2:]
    out = np.zeros((rois.shape[0], x.shape[1], out_h, out_w))
    for r, (roi, batch) in enumerate(zip(rois, batch_indices, strict=True)):
        y1, x1, height, width = _roi_geometry(node, roi)
        ys = _roi_axis_samples(y1, height, out_h, ratio, image_h)
        xs = _roi_axis_samples(x1, width, out_w, ratio, image_w)
        out[r] = pool(x[int(batch)].astype(np.float64), ys, xs)
    return [out.astype(x.dtype)]


def _roi_align_rule(node, types):
    x, rois = types[0], types[1]
    shape = (rois.shape[0], x.shape[1], node.attr("output_height", 1), node.attr("output_width", 1))
    return [TensorType(shape, x.dtype)]


OPS["RoiAlign"] = opdef("RoiAlign", OpKind.OPAQUE, _roi_align_rule, _roi_align)
