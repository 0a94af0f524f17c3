"""Converters for image operators: Resize (and the older Upsample) with static sizes, grid
sampling, RoiAlign, MaxUnpool (a scatter of flat indices) and NonMaxSuppression (whose output
shape depends on the data, so it is evaluated here into a constant)."""

from __future__ import annotations

import numpy as np

from compiler_core.frontend.common import UnsupportedError
from compiler_core.frontend.convert_utils import Converter, emit_reshape, input_at, ints

RESIZE_ATTRS = {
    "mode": "nearest",
    "coordinate_transformation_mode": "half_pixel",
    "nearest_mode": "round_prefer_floor",
    "cubic_coeff_a": -0.75,
    "exclude_outside": 0,
    "extrapolation_value": 0.0,
    "antialias": 0,
}


def _output_geometry(node, attrs, in_shape, scales, sizes, axes):
    """Full output shape and per-axis scale factors, from scales or sizes."""
    rank = len(in_shape)
    out_scales = [1.0] * rank
    out_shape = list(in_shape)
    policy = attrs.get("keep_aspect_ratio_policy", "stretch")  # read always: unused with scales
    if sizes is not None:
        ratios = [sizes[k] / in_shape[a] for k, a in enumerate(axes)]
        if policy == "stretch":
            for k, a in enumerate(axes):
                out_scales[a], out_shape[a] = ratios[k], int(sizes[k])
        else:
            scale = min(ratios) if policy == "not_larger" else max(ratios)
            for a in axes:
                out_scales[a] = scale
                out_shape[a] = int(np.floor(in_shape[a] * scale + 0.5))
    else:
        for k, a in enumerate(axes):
            out_scales[a] = float(scales[k])
            out_shape[a] = int(np.floor(in_shape[a] * scales[k]))
    return tuple(out_shape), tuple(out_scales)


def convert_resize(ctx, node, attrs):
    x = ctx.type(node.input[0])
    rank = x.rank
    axes = tuple(a % rank for a in (attrs.get("axes") or range(rank)))
    values = {k: attrs.get(k, v) for k, v in RESIZE_ATTRS.items()}
    roi_name, scales_name, sizes_name = input_at(node, 1), input_at(node, 2), input_at(node, 3)
    scales = sizes = None
    if scales_name and ctx.type(scales_name).size:
        scales = ctx.value(scales_name, "Resize scales").astype(np.float64).tolist()
    if sizes_name and ctx.type(sizes_name).size:
        sizes = ctx.value(sizes_name, "Resize sizes").astype(np.int64).tolist()
    if scales is None and sizes is None:
        raise UnsupportedError(f"node {node.name!r}: Resize needs scales or sizes")
    out_shape, out_scales = _output_geometry(node, attrs, x.shape, scales, sizes, axes)
    if values["coordinate_transformation_mode"] == "tf_crop_and_resize":
        roi = ctx.value(roi_name, "Resize roi").astype(np.float64).tolist()
        full = [(0.0, 1.0)] * rank
        for k, a in enumerate(axes):
            full[a] = (roi[k], roi[k + len(axes)])
        values["roi"] = tuple(full)
    elif roi_name:
        ctx.value(roi_name, "Resize roi")  # unused by this mode, but it must be static
    ctx.emit(
        "Resize", [node.input[0]], [node.output[0]], sizes=out_shape, scales=out_scales, **values
    )


def convert_upsample(ctx, node, attrs):
    """Upsample (opset 9): asymmetric coordinates, nearest rounds down."""
    x = ctx.type(node.input[0])
    scales = ctx.value(node.input[1], "Upsample scales").astype(np.float64).tolist()
    out_shape = tuple(int(np.floor(d * s)) for d, s in zip(x.shape, scales, strict=True))
    mode = attrs.get("mode", "nearest")
    ctx.emit(
        "Resize",
        [node.input[0]],
        [node.output[0]],
        sizes=out_shape,
        scales=tuple(scales),
        mode=mode,
        coordinate_transformation_mode="asymmetric",
        nearest_mode="floor",
    )


def convert_grid_sample(ctx, node, attrs):
    ctx.emit(
        "GridSample",
        list(node.input),
        list(node.output),
        mode=attrs.get("mode", "linear" if ctx.opset >= 20 else "bilinear"),
        padding_mode=attrs.get("padding_mode", "zeros"),
        align_corners=attrs.get("align_corners", 0),
    )


def _affine_base_grid(sizes, align_corners: bool, dtype) -> np.ndarray:
    """Homogeneous positions [x, y, (z,) 1] of every output point, x varying fastest."""
    axes = []
    for size in sizes:
        if align_corners:
            axes.append(np.linspace(-1.0, 1.0, size) if size > 1 else np.zeros(1))
        else:  # pixel centres of a grid spanning [-1, 1] edge to edge
            axes.append((2 * np.arange(size) + 1) / size - 1)
    mesh = np.meshgrid(*axes, indexing="ij")  # outermost axis (D or H) first
    coords = [m.reshape(-1) for m in reversed(mesh)]  # x first, as theta's columns expect
    return np.stack(coords + [np.ones_like(coords[0])], axis=1).astype(dtype)


def convert_affine_grid(ctx, node, attrs):
    """grid[n] = base @ theta[n]^T: one batched MatMul against a constant position table."""
    theta = ctx.type(node.input[0])
    size = ints(ctx.value(node.input[1], "AffineGrid size"))
    spatial = size[2:]
    if len(spatial) != theta.shape[1] or theta.shape[0] != size[0]:
        raise UnsupportedError(
            f"node {node.name!r}: AffineGrid theta {theta.shape} does not match size {size}"
        )
    base = _affine_base_grid(spatial, bool(attrs.get("align_corners", 0)), theta.dtype)
    positions = ctx.add_constant(base, prefix="affine_grid_base")
    theta_t = ctx.emit("Transpose", [node.input[0]], 1, perm=(0, 2, 1))
    points = ctx.emit("MatMul", [positions, theta_t], 1)
    emit_reshape(ctx, points, (size[0], *spatial, len(spatial)), node.output[0])


def convert_roi_align(ctx, node, attrs):
    # Opset 16 introduced half_pixel as the default; before it, rois had no pixel shift.
    default_mode = "half_pixel" if ctx.opset >= 16 else "output_half_pixel"
    ctx.emit(
        "RoiAlign",
        list(node.input),
        list(node.output),
        mode=attrs.get("mode", "avg"),
        output_height=attrs.get("output_height", 1),
        output_width=attrs.get("output_width", 1),
        sampling_ratio=attrs.get("sampling_ratio", 0),
        spatial_scale=attrs.get("spatial_scale", 1.0),
        coordinate_transformation_mode=attrs.get("coordinate_transformation_mode", default_mode),
    )


def _unpooled_shape(x_shape, kernel, strides, pads):
    nsp = len(kernel)
    spatial = [
        (size - 1) * s - (pads[d] + pads[d + nsp]) + k
        for d, (size, k, s) in enumerate(zip(x_shape[2:], kernel, strides, strict=True))
    ]
    return (*x_shape[:2], *spatial)


def convert_max_unpool(ctx, node, attrs):
    """Scatter X into a zero tensor at the flat positions I, then pad to output_shape.

    The indices address the shape the pooling parameters imply (as MaxPool produced them);
    an explicit output_shape extends (or trims) that tensor at the end of each axis.
    """
    x = ctx.type(node.input[0])
    kernel = tuple(attrs.get("kernel_shape"))
    nsp = len(kernel)
    strides = tuple(attrs.get("strides") or (1,) * nsp)
    pads = tuple(attrs.get("pads") or (0,) * (2 * nsp))
    implied = _unpooled_shape(x.shape, kernel, strides, pads)
    target = implied
    if input_at(node, 2):
        target = ints(ctx.value(node.input[2], "MaxUnpool output_shape"))
    total = int(np.prod(implied, dtype=np.int64))
    zero = ctx.add_constant(np.zeros((), x.dtype), prefix="max_unpool_zero")
    flat_zeros = ctx.emit("Expand", [zero], 1, shape=(total,))
    flat_x = emit_reshape(ctx, node.input[0], (x.size,))
    flat_i = emit_reshape(ctx, node.input[1], (x.size,))
    flat = ctx.emit("ScatterElements", [flat_zeros, flat_i, flat_x], 1, axis=0, reduction="none")
    if tuple(target) == implied:
        emit_reshape(ctx, flat, implied, node.output[0])
        return
    unpooled = emit_reshape(ctx, flat, implied)
    growth = tuple(t - i for t, i in zip(target, implied, strict=True))
    ctx.emit("Pad", [unpooled], [node.output[0]], pads=(0,) * len(target) + growth)


def _box_corners(boxes: np.ndarray, center_point_box: int) -> np.ndarray:
    """[..., (y_min, x_min, y_max, x_max)] from either box encoding."""
    if center_point_box:
        x, y, w, h = np.moveaxis(boxes, -1, 0)
        return np.stack([y - h / 2, x - w / 2, y + h / 2, x + w / 2], axis=-1)
    y1, x1, y2, x2 = np.moveaxis(boxes, -1, 0)  # any two diagonal corners
    return np.stack(
        [np.minimum(y1, y2), np.minimum(x1, x2), np.maximum(y1, y2), np.maximum(x1, x2)], axis=-1
    )


def _iou(box: np.ndarray, others: np.ndarray) -> np.ndarray:
    top_left = np.maximum(box[:2], others[:, :2])
    bottom_right = np.minimum(box[2:], others[:, 2:])
    intersection = np.prod(np.clip(bottom_right - top_left, 0, None), axis=1)
    area = np.prod(box[2:] - box[:2])
    areas = np.prod(others[:, 2:] - others[:, :2], axis=1)
    union = area + areas - intersection
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(union > 0, intersection / union, 0.0)


def _greedy_nms(boxes, scores, limit, iou_threshold, score_threshold) -> list[int]:
    """Indices kept for one batch and class, best score first."""
    candidates = np.argsort(-scores, kind="stable")
    if score_threshold is not None:  # strictly above, as onnxruntime and the reference do
        candidates = candidates[scores[candidates] > score_threshold]
    kept: list[int] = []
    for index in candidates:
        if len(kept) >= limit:
            break
        if not kept or np.all(_iou(boxes[index], boxes[kept]) <= iou_threshold):
            kept.append(int(index))
    return kept


def _scalar_input(ctx, node, index, purpose, default):
    name = input_at(node, index)
    value = np.asarray(ctx.value(name, purpose)).reshape(-1) if name else ()
    return value[0].item() if len(value) else default


def convert_non_max_suppression(ctx, node, attrs):
    boxes = ctx.value(node.input[0], "NonMaxSuppression boxes (its output shape depends on them)")
    scores = ctx.value(node.input[1], "NonMaxSuppression scores (its output depends on them)")
    limit = _scalar_input(ctx, node, 2, "NonMaxSuppression max_output_boxes_per_class", 0)
    iou_threshold = _scalar_input(ctx, node, 3, "NonMaxSuppression iou_threshold", 0.0)
    score_threshold = _scalar_input(ctx, node, 4, "NonMaxSuppression score_threshold", None)
    corners = _box_corners(boxes.astype(np.float64), attrs.get("center_point_box", 0))
    selected = [
        (batch, cls, index)
        for batch in range(scores.shape[0])
        for cls in range(scores.shape[1])
        for index in _greedy_nms(
            corners[batch], scores[batch, cls], limit, iou_threshold, score_threshold
        )
    ]
    ctx.add_constant(np.array(selected, np.int64).reshape(-1, 3), name=node.output[0])


CONVERTERS: dict[str, dict[int, Converter]] = {
    "AffineGrid": {20: convert_affine_grid},
    "GridSample": {16: convert_grid_sample},
    "MaxUnpool": {9: convert_max_unpool},
    "NonMaxSuppression": {10: convert_non_max_suppression},
    "Resize": {11: convert_resize},
    "RoiAlign": {10: convert_roi_align},
    "Upsample": {9: convert_upsample},
}
