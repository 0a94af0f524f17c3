"""Converters for the transformer operators."""

from __future__ import annotations

import numpy as np

from compiler_core.frontend.common import (
    ModelFormatError,
    UnsupportedError,
    onnx_dtype_name,
)
from compiler_core.frontend.convert_control import inline_graph
from compiler_core.frontend.convert_utils import (
    Converter,
    all_inputs,
    all_outputs,
    emit_reshape,
    input_at,
)

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


def convert_flex_attention(ctx, node, attrs):
    """ai.onnx.preview FlexAttention: softmax(score_mod(Q K^T * scale)), prob_mod, then @ V.

    Without modifiers it is the Attention operator (decomposed by the pipeline). With them, the
    computation is spelled out in the spec's order so each modifier graph is inlined at its
    stage: scores and probabilities in the softmax precision (float32 for 16-bit inputs), the
    output cast back to V's type, as the ONNX reference computes it."""
    where = f"node {node.name!r} (FlexAttention)"
    q, k, v = (input_at(node, i) for i in range(3))
    head = _flex_head_size(ctx, q, k, v, where)
    precision = attrs.get("softmax_precision")
    if precision is not None:
        compute = onnx_dtype_name(precision)
    else:
        compute = "float64" if ctx.type(q).dtype == "float64" else "float32"
    scale = attrs.get("scale", 1.0 / float(np.sqrt(head)))
    score_mod, prob_mod = attrs.get("score_mod"), attrs.get("prob_mod")
    if score_mod is None and prob_mod is None:
        outputs = [node.output[0], "", "", ""]
        ctx.emit("Attention", [q, k, v], outputs, scale=scale, softmax_precision=compute)
        return
    batch, q_heads, length, _ = ctx.type(q).shape
    kv_heads, keys = ctx.type(k).shape[1:3]
    group = q_heads // kv_heads
    # Grouped heads: query head h reads key/value head h // group. The group's query heads are
    # stacked as the rows of one GEMM per key/value head (K and V read once, not repeated);
    # the modifiers see the scores and probabilities per query head, [B, Hq, L, S], as the
    # spec gives them (a reshape of the same values).
    per_head, grouped = (batch, q_heads, length, keys), (batch, kv_heads, group * length, keys)
    q = emit_reshape(ctx, q, (batch, kv_heads, group * length, head)) if group > 1 else q
    # Q and K each scaled by sqrt(scale), the square root taken in float32 (the reference's
    # order: it keeps 16-bit scores in range).
    dtype = ctx.type(q).dtype
    root = ctx.add_constant(np.asarray(np.sqrt(np.float32(scale)), dtype), prefix="flex_scale")
    transposed = ctx.emit("Transpose", [ctx.emit("Mul", [k, root])], perm=(0, 1, 3, 2))
    scores = _cast(ctx, ctx.emit("MatMul", [ctx.emit("Mul", [q, root]), transposed]), compute)
    scores = emit_reshape(ctx, scores, per_head) if group > 1 else scores
    if score_mod is not None:
        scores = _modified(ctx, score_mod, scores, f"{where} score_mod")
    probs = ctx.emit("Softmax", [scores], axis=3)
    if prob_mod is not None:
        probs = _modified(ctx, prob_mod, probs, f"{where} prob_mod")
    probs = emit_reshape(ctx, probs, grouped) if group > 1 else probs
    out = ctx.emit("MatMul", [probs, _cast(ctx, v, compute)])
    if group > 1:
        out = emit_reshape(ctx, out, (batch, q_heads, length, ctx.type(v).shape[3]))
    ctx.emit("Cast", [out], [node.output[0]], to=ctx.type(v).dtype)


def _flex_head_size(ctx, q: str, k: str, v: str, where: str) -> int:
    """Q's head size, once Q [B, Hq, L, E], K [B, Hkv, S, E] and V [B, Hkv, S, Ev] fit."""
    shapes = [ctx.type(x).shape for x in (q, k, v)]
    if any(len(shape) != 4 for shape in shapes):
        raise ModelFormatError(f"{where}: Q, K and V must be rank 4, not {shapes}")
    (_, q_heads, _, head), (_, kv_heads, kv_len, k_head), (_, v_heads, v_len, _) = shapes
    if k_head != head or v_heads != kv_heads or v_len != kv_len or q_heads % kv_heads:
        raise ModelFormatError(
            f"{where}: shapes Q {shapes[0]}, K {shapes[1]}, V {shapes[2]} do not fit: K's head "
            "size must be Q's, V must have K's heads and length, and Q's heads a multiple of K's"
        )
    return head


def _cast(ctx, x: str, dtype: str) -> str:
    return x if ctx.type(x).dtype == dtype else ctx.emit("Cast", [x], to=dtype)


def _modified(ctx, graph, value: str, where: str) -> str:
    """A modifier graph inlined on `value`: one input, one output of the same type."""
    if len(graph.input) != 1 or len(graph.output) != 1:
        raise ModelFormatError(
            f"{where}: a modifier graph takes one input and gives one output, not "
            f"{len(graph.input)} and {len(graph.output)}"
        )
    (result,) = inline_graph(ctx, graph, {graph.input[0].name: value})
    got, given = ctx.type(result), ctx.type(value)
    if got != given:
        raise ModelFormatError(f"{where}: gives {got}, it must give {given}")
    return result


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
    # Operators of the preview domain, keyed by domain and name, by that domain's opset.
    "ai.onnx.preview.FlexAttention": {1: convert_flex_attention},
}
