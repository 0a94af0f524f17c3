"""Converters for the transformer operators."""

from __future__ import annotations

from compiler_core.frontend.convert_utils import Converter, all_inputs, all_outputs
from compiler_core.frontend.onnx import onnx_dtype_name

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


CONVERTERS: dict[str, dict[int, Converter]] = {
    "Attention": {23: convert_attention},
    "RMSNormalization": {23: convert_rms_norm},
    "RotaryEmbedding": {23: convert_rotary},
    "Swish": {24: convert_swish},
}
