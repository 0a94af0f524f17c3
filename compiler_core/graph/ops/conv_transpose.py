"""ConvTranspose (canonical attributes: pads, strides, dilations, group, output_padding,
and the resolved spatial output shape)."""

from __future__ import annotations

import itertools

import numpy as np

from compiler_core.graph.ir import OpKind, TensorType
from compiler_core.graph.ops.base import OpDef, ShapeError, opdef


def _rule(node, types):
    x, w = types[0], types[1]
    group = node.attr("group", 1)
    if x.shape[1] != w.shape[0]:
        raise ShapeError(f"weight {w} does not fit input {x}")
    out = (x.shape[0], w.shape[1] * group, *node.attr("output_shape"))
    return [TensorType(out, x.dtype)]


def _conv_transpose(node, inputs):
    x, w = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    nsp = x.ndim - 2
    strides, dilations = node.attr("strides"), node.attr("dilations")
    pads, group = node.attr("pads"), node.attr("group", 1)
    out_spatial = node.attr("output_shape")
    kernel = w.shape[2:]
    n, channels = x.shape[:2]
    cg, mg = channels // group, w.shape[1]
    # Every input position scatters a kernel-sized patch: accumulate on the full canvas, then
    # crop the padding away. Extra room covers output_padding at the end.
    full = [
        max(
            strides[i] * (x.shape[2 + i] - 1) + (kernel[i] - 1) * dilations[i] + 1,
            pads[i] + out_spatial[i],
        )
        for i in range(nsp)
    ]
    canvas = np.zeros((n, mg * group, *full), np.float64)
    for g in range(group):
        xg = x[:, g * cg : (g + 1) * cg].astype(np.float64)
        for offset in itertools.product(*[range(k) for k in kernel]):
            wg = w[(slice(g * cg, (g + 1) * cg), slice(None), *offset)].astype(np.float64)
            patch = np.einsum("nc...,cm->nm...", xg, wg)
            index = tuple(
                slice(
                    offset[i] * dilations[i],
                    offset[i] * dilations[i] + strides[i] * (x.shape[2 + i] - 1) + 1,
                    strides[i],
                )
                for i in range(nsp)
            )
            canvas[(slice(None), slice(g * mg, (g + 1) * mg), *index)] += patch
    crop = tuple(slice(pads[i], pads[i] + out_spatial[i]) for i in range(nsp))
    out = canvas[(slice(None), slice(None), *crop)]
    if bias is not None:
        out = out + bias.reshape((1, -1) + (1,) * nsp)
    return [np.ascontiguousarray(out).astype(x.dtype)]


OPS: dict[str, OpDef] = {
    "ConvTranspose": opdef("ConvTranspose", OpKind.OUT_ELEMWISE_FUSABLE, _rule, _conv_transpose),
}
