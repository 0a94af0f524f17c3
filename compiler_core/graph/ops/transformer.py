"""Transformer operators: Attention, RMSNormalization, RotaryEmbedding, Swish, SwiGLU."""

from __future__ import annotations

import numpy as np

from compiler_core.graph.ir import OpKind
from compiler_core.graph.ops.base import OpDef, evaluated, opdef, same_as


def _to_heads(x: np.ndarray, heads: int | None) -> tuple[np.ndarray, bool]:
    """(B, S, H*D) -> (B, H, S, D); 4-D inputs pass through. Returns (tensor, was_3d)."""
    if x.ndim == 4:
        return x, False
    b, s, hd = x.shape
    return x.reshape(b, s, heads, hd // heads).transpose(0, 2, 1, 3), True


def _allowed_keys(node, q_len, k_len, batch, past_len, nonpad):
    """Boolean (B, 1, Sq, Sk) mask of the keys each query may attend."""
    rows = np.arange(q_len)[:, None]
    cols = np.arange(k_len)[None, :]
    allowed = np.ones((batch, 1, q_len, k_len), bool)
    if nonpad is not None:
        valid = cols[None] < nonpad.reshape(-1, 1, 1)
        allowed &= valid[:, None]
        offsets = nonpad.reshape(-1) - q_len if past_len is None else np.full(batch, past_len)
    else:
        offsets = np.full(batch, past_len or 0)
    left, right = node.attr("left_window_size", -1), node.attr("right_window_size", -1)
    for b in range(batch):
        position = rows + offsets[b]
        if node.attr("is_causal", 0):
            allowed[b, 0] &= cols <= position
        if left >= 0:
            allowed[b, 0] &= cols >= position - left
        if right >= 0:
            allowed[b, 0] &= cols <= position + right
    return allowed


def _softmax_rows(scores: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Softmax over the last axis; a row with no allowed key is all zeros (not NaN)."""
    masked = np.where(allowed, scores, -np.inf)
    peak = np.max(masked, axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    e = np.where(allowed, np.exp(masked - peak), 0.0)
    total = e.sum(axis=-1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0)


def _attention(node, inputs):
    q, k, v = inputs[0], inputs[1], inputs[2]
    mask = inputs[3] if len(inputs) > 3 else None
    past_key = inputs[4] if len(inputs) > 4 else None
    past_value = inputs[5] if len(inputs) > 5 else None
    nonpad = inputs[6] if len(inputs) > 6 else None
    dtype = q.dtype
    q4, was_3d = _to_heads(q, node.attr("q_num_heads", None))
    k4, _ = _to_heads(k, node.attr("kv_num_heads", None))
    v4, _ = _to_heads(v, node.attr("kv_num_heads", None))
    past_len = None
    if past_key is not None:
        past_len = past_key.shape[2]
        k4 = np.concatenate([past_key, k4], axis=2)
        v4 = np.concatenate([past_value, v4], axis=2)
    present_key, present_value = k4, v4
    batch, q_heads, q_len, head_size = q4.shape
    kv_heads, k_len = k4.shape[1], k4.shape[2]
    group = q_heads // kv_heads
    keys = np.repeat(k4, group, axis=1).astype(np.float64)
    values = np.repeat(v4, group, axis=1).astype(np.float64)
    scale = node.attr("scale", None)
    scale = 1.0 / np.sqrt(head_size) if scale is None else scale
    scores = np.matmul(q4.astype(np.float64), np.swapaxes(keys, -1, -2)) * scale
    stages = [scores]  # qk_matmul_output modes: 0 raw, 1 softcapped, 2 with bias, 3 softmax
    softcap = node.attr("softcap", 0.0)
    if softcap > 0:
        scores = softcap * np.tanh(scores / softcap)
    stages.append(scores)
    allowed = _allowed_keys(node, q_len, k_len, batch, past_len, nonpad)
    if mask is not None:
        if mask.shape[-1] < k_len:  # a mask shorter than the padded cache: the rest is padding
            pad = [(0, 0)] * (mask.ndim - 1) + [(0, k_len - mask.shape[-1])]
            fill = False if mask.dtype == bool else -np.inf
            mask = np.pad(mask, pad, constant_values=fill)
        if mask.dtype == bool:
            allowed = allowed & mask
        else:
            scores = scores + mask.astype(np.float64)
    allowed = np.broadcast_to(allowed, scores.shape)
    stages.append(np.where(allowed, scores, -np.inf))
    precision = node.attr("softmax_precision", None)
    if precision is not None:
        scores = scores.astype(precision).astype(np.float64)
    # A float mask of -inf disallows a key just as a False boolean does.
    probabilities = _softmax_rows(scores, allowed & (scores > -np.inf))
    stages.append(probabilities)
    y = np.matmul(probabilities, values)
    if was_3d:
        y = y.transpose(0, 2, 1, 3).reshape(batch, q_len, -1)
    mode = node.attr("qk_matmul_output_mode", 0)
    return [
        y.astype(dtype),
        present_key.astype(dtype),
        present_value.astype(dtype),
        stages[mode].astype(dtype),
    ]


def _rms_norm(node, inputs):
    x, scale = inputs[0], inputs[1]
    axis = node.attr("axis", -1) % x.ndim
    v = x.astype(np.float64)
    mean_square = np.mean(v * v, axis=tuple(range(axis, x.ndim)), keepdims=True)
    out = v / np.sqrt(mean_square + node.attr("epsilon", 1e-5)) * scale
    return [out.astype(x.dtype)]


def _rotary(node, inputs):
    x, cos_cache, sin_cache = inputs[0], inputs[1], inputs[2]
    positions = inputs[3] if len(inputs) > 3 else None
    interleaved = node.attr("interleaved", 0)
    original_shape = x.shape
    if x.ndim == 3:  # (B, S, H*D) -> (B, S, H, D)
        heads = node.attr("num_heads", 0)
        x = x.reshape(x.shape[0], x.shape[1], heads, -1)
    else:  # (B, H, S, D) -> (B, S, H, D)
        x = x.transpose(0, 2, 1, 3)
    head_size = x.shape[-1]
    rotary_dim = node.attr("rotary_embedding_dim", 0) or head_size
    if positions is not None:
        cos = cos_cache[positions]
        sin = sin_cache[positions]
    else:
        cos, sin = cos_cache, sin_cache
    half = rotary_dim // 2
    cos = cos[..., :half][:, :, None, :]
    sin = sin[..., :half][:, :, None, :]
    rotate, keep = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        x1, x2 = rotate[..., 0::2], rotate[..., 1::2]
    else:
        x1, x2 = rotate[..., :half], rotate[..., half:]
    r1 = x1 * cos - x2 * sin
    r2 = x2 * cos + x1 * sin
    if interleaved:
        rotated = np.stack([r1, r2], axis=-1).reshape(rotate.shape)
    else:
        rotated = np.concatenate([r1, r2], axis=-1)
    out = np.concatenate([rotated, keep], axis=-1)
    out = out.reshape(original_shape) if len(original_shape) == 3 else out.transpose(0, 2, 1, 3)
    return [out.astype(inputs[0].dtype)]


def _swish(node, inputs):
    x = inputs[0]
    alpha = node.attr("alpha", 1.0)
    v = x.astype(np.float64)
    return [(v / (1.0 + np.exp(-alpha * v))).astype(x.dtype)]


OPS: dict[str, OpDef] = {
    "Attention": opdef("Attention", OpKind.OPAQUE, evaluated(_attention), _attention),
    "RMSNormalization": opdef("RMSNormalization", OpKind.OPAQUE, same_as(0), _rms_norm),
    "RotaryEmbedding": opdef("RotaryEmbedding", OpKind.OPAQUE, same_as(0), _rotary),
    "Swish": opdef("Swish", OpKind.ELEMWISE, same_as(0), _swish),
}
