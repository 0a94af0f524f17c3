"""Converters for the transformer operators."""

from __future__ import annotations

import numpy as np

from compiler_core.frontend.common import UnsupportedError, onnx_dtype_name
from compiler_core.frontend.convert_utils import Converter, all_inputs, all_outputs, input_at

ATTENTION_DEFAULTS = {
    "is_causal": 0,
    "kv_num_heads": None,
    "q_num_heads": None,
    "qk_matmul_output_mode": 0,
    "scale": None,
    "softcap": 0.0,
    "left_window_size": -1,
    "right_window_size": -1,
}


def convert_attention(ctx, node, attrs):
    values = {k: attrs.get(k, v) for k, v in ATTENTION_DEFAULTS.items()}
    precision = attrs.get("softmax_precision")
    if precision is not None:
        values["softmax_precision"] = onnx_dtype_name(precision)
    values = {k: v for k, v in values.items() if v is not None}
    outputs = all_outputs(node) + [""] * (4 - len(node.output))
    ctx.emit("Attention", all_inputs(node), outputs, **values)


def convert_linear_attention(ctx, node, attrs):
    attrs.ignore("chunk_size")  # a tiling hint for chunk-parallel kernels; results are the same
    rule = attrs.get("update_rule", "gated_delta")
    if rule not in ("linear", "gated", "delta", "gated_delta"):
        raise UnsupportedError(f"node {node.name!r} (LinearAttention): update_rule {rule!r}")
    needed = {"gated": (4,), "delta": (5,), "gated_delta": (4, 5)}.get(rule, ())
    for index in needed:
        if not input_at(node, index):
            what = "decay" if index == 4 else "beta"
            raise UnsupportedError(f"node {node.name!r}: update_rule {rule!r} needs {what}")
    q_heads, kv_heads = attrs.get("q_num_heads"), attrs.get("kv_num_heads")
    if not q_heads or not kv_heads:
        raise UnsupportedError(f"node {node.name!r}: q_num_heads and kv_num_heads are required")
    outputs = all_outputs(node) + [""] * (2 - len(node.output))
    ctx.emit(
        "LinearAttention",
        all_inputs(node),
        outputs,
        q_num_heads=q_heads,
        kv_num_heads=kv_heads,
        scale=attrs.get("scale", 0.0),
        update_rule=rule,
    )


def convert_causal_conv(ctx, node, attrs):
    """Depthwise causal convolution as the pattern it fuses: Concat(state, x), Conv, Slice."""
    activation = attrs.get("activation", "none")
    if activation not in ("none", "silu", "swish"):
        raise UnsupportedError(f"node {node.name!r}: activation {activation!r} is not supported")
    x, weight, bias, past = (input_at(node, i) for i in range(4))
    batch, channels, length = ctx.type(x).shape
    carry = ctx.type(weight).shape[2] - 1  # positions of history the kernel reaches back
    padded = x
    if carry > 0:
        if not past:  # no history: the sequence starts after zeros
            zeros = np.zeros((batch, channels, carry), ctx.type(x).dtype)
            past = ctx.add_constant(zeros, prefix="causal_conv_zeros")
        padded = ctx.emit("Concat", [past, x], 1, axis=2)
    inputs = [padded, weight] + ([bias] if bias else [])
    fused = activation != "none"
    conv = ctx.emit(
        "Conv",
        inputs,
        1 if fused else [node.output[0]],
        pads=(0, 0),
        strides=(1,),
        dilations=(1,),
        group=channels,
    )
    if fused:  # SiLU is Swish with alpha 1
        ctx.emit("Swish", [conv], [node.output[0]], alpha=1.0)
    present = node.output[1] if len(node.output) > 1 else ""
    if present:  # the last `carry` positions of the history-extended sequence
        total = length + carry
        ctx.emit("Slice", [padded], [present], starts=(total - carry,), ends=(total,), axes=(2,))


def convert_rms_norm(ctx, node, attrs):
    attrs.ignore("stash_type")
    ctx.emit(
        "RMSNormalization",
        all_inputs(node),
        all_outputs(node),
        axis=attrs.get("axis", -1),
        epsilon=attrs.get("epsilon", 1e-5),
    )


def convert_rotary(ctx, node, attrs):
    ctx.emit(
        "RotaryEmbedding",
        all_inputs(node),
        all_outputs(node),
        interleaved=attrs.get("interleaved", 0),
        num_heads=attrs.get("num_heads", 0),
        rotary_embedding_dim=attrs.get("rotary_embedding_dim", 0),
    )


def convert_swish(ctx, node, attrs):
    ctx.emit("Swish", all_inputs(node), all_outputs(node), alpha=attrs.get("alpha", 1.0))


def convert_swiglu(ctx, node, attrs):
    """Y = Swish_alpha(A) * B, exactly as the spec defines it."""
    gate, linear = node.input[0], node.input[1]
    if ctx.type(gate).shape != ctx.type(linear).shape:
        raise UnsupportedError(f"node {node.name!r} (SwiGLU): A and B differ in shape")
    activated = ctx.emit("Swish", [gate], 1, alpha=attrs.get("alpha", 1.0))
    ctx.emit("Mul", [activated, linear], [node.output[0]])


CONVERTERS: dict[str, dict[int, Converter]] = {
    "Attention": {23: convert_attention},
    "CausalConvWithState": {27: convert_causal_conv},
    "LinearAttention": {27: convert_linear_attention},
    "RMSNormalization": {23: convert_rms_norm},
    "RotaryEmbedding": {23: convert_rotary},
    "SwiGLU": {28: convert_swiglu},
    "Swish": {24: convert_swish},
}
