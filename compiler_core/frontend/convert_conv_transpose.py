"""ConvTranspose: auto_pad and output_shape resolved into explicit pads and output size."""

from __future__ import annotations

from compiler_core.frontend.convert_utils import Converter, all_inputs, all_outputs


def convert_conv_transpose(ctx, node, attrs):
    x, w = ctx.type(node.input[0]), ctx.type(node.input[1])
    nsp = x.rank - 2
    kernel = tuple(attrs.get("kernel_shape") or w.shape[2:])
    strides = tuple(attrs.get("strides") or (1,) * nsp)
    dilations = tuple(attrs.get("dilations") or (1,) * nsp)
    output_padding = tuple(attrs.get("output_padding") or (0,) * nsp)
    auto_pad = attrs.get("auto_pad", "NOTSET")
    requested = attrs.get("output_shape")
    if requested is not None:
        requested = tuple(requested)[-nsp:]
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        requested = tuple(x.shape[2 + i] * strides[i] for i in range(nsp))
    natural = [
        strides[i] * (x.shape[2 + i] - 1) + output_padding[i] + (kernel[i] - 1) * dilations[i] + 1
        for i in range(nsp)
    ]
    if requested is not None:
        begins, ends = [], []
        for i in range(nsp):
            total = natural[i] - requested[i]
            if auto_pad == "SAME_UPPER":
                begins.append(total // 2)
                ends.append(total - total // 2)
            else:
                begins.append(total - total // 2)
                ends.append(total // 2)
        pads = tuple(begins + ends)
        out_spatial = requested
    else:
        pads = (
            (0,) * (2 * nsp)
            if auto_pad == "VALID"
            else tuple(attrs.get("pads") or (0,) * (2 * nsp))
        )
        out_spatial = tuple(natural[i] - pads[i] - pads[i + nsp] for i in range(nsp))
    ctx.emit(
        "ConvTranspose",
        all_inputs(node),
        all_outputs(node),
        pads=pads,
        strides=strides,
        dilations=dilations,
        group=attrs.get("group", 1),
        output_shape=out_spatial,
    )


CONVERTERS: dict[str, dict[int, Converter]] = {"ConvTranspose": {1: convert_conv_transpose}}
