"""ConvTranspose and DeformConv: auto_pad and output_shape resolved into explicit pads, every
default made an explicit attribute, and ConvTranspose's output size fixed at import; Col2Im:
its image and block shapes (constant inputs) made attributes."""

from __future__ import annotations

from compiler_core.frontend.common import UnsupportedError
from compiler_core.frontend.convert_utils import Converter, all_inputs, all_outputs, ints


def _kernel(node, attrs, weight) -> tuple[int, ...]:
    kernel = tuple(attrs.get("kernel_shape") or weight.shape[2:])
    if kernel != tuple(weight.shape[2:]):
        raise UnsupportedError(
            f"node {node.name!r} ({node.op_type}): kernel_shape {list(kernel)} does not match "
            f"the weight's shape {list(weight.shape)}"
        )
    return kernel


def _split_padding(total: int, auto_pad: str) -> tuple[int, int]:
    """ONNX puts the odd pixel at the end for SAME_UPPER, at the start otherwise."""
    if auto_pad == "SAME_UPPER":
        return total // 2, total - total // 2
    return total - total // 2, total // 2


def convert_conv_transpose(ctx, node, attrs):
    x, w = ctx.type(node.input[0]), ctx.type(node.input[1])
    nsp = x.rank - 2
    kernel = _kernel(node, attrs, w)
    strides = tuple(attrs.get("strides") or (1,) * nsp)
    dilations = tuple(attrs.get("dilations") or (1,) * nsp)
    output_padding = tuple(attrs.get("output_padding") or (0,) * nsp)
    auto_pad = attrs.get("auto_pad", "NOTSET")
    explicit_pads = tuple(attrs.get("pads") or (0,) * (2 * nsp))
    requested = attrs.get("output_shape")
    if auto_pad not in ("NOTSET", "VALID", "SAME_UPPER", "SAME_LOWER"):
        raise UnsupportedError(f"node {node.name!r} (ConvTranspose): auto_pad {auto_pad!r}")

    # The size before any padding is cropped away; output_padding extends the end.
    natural = [
        strides[i] * (x.shape[2 + i] - 1) + output_padding[i] + (kernel[i] - 1) * dilations[i] + 1
        for i in range(nsp)
    ]
    if requested is not None:
        # Only the spatial sizes matter; some exporters write the full output shape.
        requested = tuple(requested)[-nsp:]
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        requested = tuple(x.shape[2 + i] * strides[i] for i in range(nsp))

    if requested is not None:
        # A requested output size decides the pads; explicit pads are then ignored.
        splits = [_split_padding(natural[i] - requested[i], auto_pad) for i in range(nsp)]
        pads = tuple(s[0] for s in splits) + tuple(s[1] for s in splits)
        out_spatial = requested
    else:
        pads = (0,) * (2 * nsp) if auto_pad == "VALID" else explicit_pads
        out_spatial = tuple(natural[i] - pads[i] - pads[i + nsp] for i in range(nsp))
    if any(size <= 0 for size in out_spatial):
        raise UnsupportedError(
            f"node {node.name!r} (ConvTranspose): output size {list(out_spatial)} is not positive"
        )
    ctx.emit(
        "ConvTranspose",
        all_inputs(node),
        all_outputs(node),
        pads=pads,
        strides=strides,
        dilations=dilations,
        group=attrs.get("group", 1),
        output_padding=output_padding,
        output_shape=out_spatial,
    )


def convert_deform_conv(ctx, node, attrs):
    x, w = ctx.type(node.input[0]), ctx.type(node.input[1])
    nsp = x.rank - 2
    _kernel(node, attrs, w)  # the kernel size is the weight's; checked, not carried
    strides = tuple(attrs.get("strides") or (1,) * nsp)
    dilations = tuple(attrs.get("dilations") or (1,) * nsp)
    pads = tuple(attrs.get("pads") or (0,) * (2 * nsp))
    ctx.emit(
        "DeformConv",
        all_inputs(node),
        all_outputs(node),
        pads=pads,
        strides=strides,
        dilations=dilations,
        group=attrs.get("group", 1),
        offset_group=attrs.get("offset_group", 1),
    )


def convert_col2im(ctx, node, attrs):
    image = ints(ctx.value(node.input[1], "Col2Im image_shape"))
    block = ints(ctx.value(node.input[2], "Col2Im block_shape"))
    nsp = len(image)
    ctx.emit(
        "Col2Im",
        [node.input[0]],
        all_outputs(node),
        image_shape=image,
        block_shape=block,
        pads=tuple(attrs.get("pads") or (0,) * (2 * nsp)),
        strides=tuple(attrs.get("strides") or (1,) * nsp),
        dilations=tuple(attrs.get("dilations") or (1,) * nsp),
    )


CONVERTERS: dict[str, dict[int, Converter]] = {
    "Col2Im": {18: convert_col2im},
    "ConvTranspose": {1: convert_conv_transpose},
    "DeformConv": {19: convert_deform_conv},
}
