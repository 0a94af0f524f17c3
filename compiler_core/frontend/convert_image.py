"""Converters for image operators: Resize (and the older Upsample) with static sizes."""

from __future__ import annotations

import numpy as np

from compiler_core.frontend.convert_utils import Converter, input_at
from compiler_core.frontend.onnx import UnsupportedError

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
    if sizes is not None:
        policy = attrs.get("keep_aspect_ratio_policy", "stretch")
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


CONVERTERS: dict[str, dict[int, Converter]] = {
    "GridSample": {16: convert_grid_sample},
    "Resize": {11: convert_resize},
    "Upsample": {9: convert_upsample},
}
