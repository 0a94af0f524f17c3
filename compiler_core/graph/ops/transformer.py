"""Transformer operators: Attention, LinearAttention, RMSNormalization, RotaryEmbedding, Swish."""

from __future__ import annotations

import numpy as np

from compiler_core.graph.ir import OpKind, TensorType
from compiler_core.graph.ops.base import OpDef, ShapeError, opdef, same_as


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
        offsets = nonpad.reshape(-1) - q_len  # never with a past cache (the type rule)
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


class _Arithmetic:
    """Arithmetic in an operator's element type, carried out on float64 values.

    float32 and float64 results are left wide: rounding them at every step changes nothing
    the tolerance sees. Half-precision types are rounded after every step, as a kernel computing
    in that type (and ONNX's definition) does; bfloat16's 8-bit mantissa makes the difference
    visible. Products accumulate wide and round once, as matrix units do.
    """

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)
        self.narrow = self.dtype.itemsize < 4

    def __call__(self, values) -> np.ndarray:
        values = np.asarray(values, np.float64)
        return values.astype(self.dtype).astype(np.float64) if self.narrow else values

    def matmul(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self(np.matmul(a, b))

    def sum_last(self, values: np.ndarray) -> np.ndarray:
        """Sum over the last axis.

        float16 sums accumulate wide and round once (as numpy's and most kernels' do); bfloat16
        sums accumulate in bfloat16, one rounded addition at a time, as numpy's bfloat16 does.
        """
        if self.dtype.name != "bfloat16":
            return self(values.sum(axis=-1, keepdims=True))
        total = values[..., :1]
        for j in range(1, values.shape[-1]):
            total = self(total + values[..., j : j + 1])
        return total

    def softmax(self, scores: np.ndarray, allowed: np.ndarray) -> np.ndarray:
        """Softmax over the last axis; a row with no allowed key is all zeros (not NaN)."""
        masked = np.where(allowed, scores, -np.inf)
        peak = np.max(masked, axis=-1, keepdims=True)
        peak = np.where(np.isfinite(peak), peak, 0.0)
        e = np.where(allowed, self(np.exp(self(masked - peak))), 0.0)
        total = self.sum_last(e)
        return self(np.divide(e, total, out=np.zeros_like(e), where=total > 0))


def _attention(node, inputs):
    q, k, v = inputs[0], inputs[1], inputs[2]
    mask, past_key, past_value, nonpad = (_optional(inputs, i) for i in (3, 4, 5, 6))
    dtype = q.dtype
    arith = _Arithmetic(dtype)
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
    queries = q4.astype(np.float64)
    keys = np.repeat(k4, group, axis=1).astype(np.float64)
    values = np.repeat(v4, group, axis=1).astype(np.float64)
    # The spec scales Q and K by sqrt(scale) each, before the product, against overflow.
    root = arith(np.sqrt(_attention_scale(node, head_size)))
    scores = arith.matmul(arith(queries * root), np.swapaxes(arith(keys * root), -1, -2))
    stages = [scores]  # qk_matmul_output modes: 0 raw, 1 softcapped, 2 with bias, 3 softmax
    softcap = node.attr("softcap", 0.0)
    if softcap > 0:
        scores = arith(softcap * arith(np.tanh(arith(scores / softcap))))
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
            scores = arith(scores + mask)
    allowed = np.broadcast_to(allowed, scores.shape)
    stages.append(np.where(allowed, scores, -np.inf))
    precision = node.attr("softmax_precision", None)
    softmax_arith = arith if precision is None else _Arithmetic(precision)
    # A float mask of -inf disallows a key just as a False boolean does.
    probabilities = arith(
        softmax_arith.softmax(softmax_arith(scores), allowed & (scores > -np.inf))
    )
    stages.append(probabilities)
    y = arith.matmul(probabilities, values)
    if was_3d:
        y = y.transpose(0, 2, 1, 3).reshape(batch, q_len, -1)
    mode = node.attr("qk_matmul_output_mode", 0)
    return [
        y.astype(dtype),
        present_key.astype(dtype),
        present_value.astype(dtype),
        stages[mode].astype(dtype),
    ]


def _attention_scale(node, head_size: int) -> float:
    scale = node.attr("scale", None)
    return 1.0 / np.sqrt(head_size) if scale is None else scale


def _optional(inputs, index):
    return inputs[index] if len(inputs) > index else None


def _heads_shape(t: TensorType, heads: int | None, what: str) -> tuple[int, int, int, int]:
    """(batch, heads, sequence, head size) of a 3-D packed or 4-D Attention operand."""
    if t.rank == 4:
        return t.shape
    if t.rank != 3 or not heads or t.shape[2] % heads:
        raise ShapeError(f"{what} {t} cannot be split into {heads} heads")
    b, s, hd = t.shape
    return b, heads, s, hd // heads


ATTENTION_TYPES = ("float16", "bfloat16", "float32", "float64")


def _attention_rule(node, types):
    q, k, v = types[0], types[1], types[2]
    precision = node.attr("softmax_precision", q.dtype)
    if q.dtype not in ATTENTION_TYPES or precision not in ATTENTION_TYPES:
        raise ShapeError(
            f"Attention computes in a float type ({', '.join(ATTENTION_TYPES)}), not "
            f"{q.dtype} with a softmax in {precision}"
        )
    given = [bool(name) for name in (*node.inputs, "", "", "", "")[:7]]
    if given[4] != given[5]:
        raise ShapeError("past_key and past_value come together: one was given without the other")
    if given[6] and given[4]:
        raise ShapeError(
            "nonpad_kv_seqlen (an external cache's key lengths) cannot be combined with "
            "past_key / past_value (an internal cache)"
        )
    past_key = types[4] if given[4] else None
    b, q_heads, q_len, _ = _heads_shape(q, node.attr("q_num_heads", None), "query")
    _, kv_heads, k_len, head_size = _heads_shape(k, node.attr("kv_num_heads", None), "key")
    _, _, _, v_size = _heads_shape(v, node.attr("kv_num_heads", None), "value")
    if kv_heads == 0 or q_heads % kv_heads:
        raise ShapeError(f"{q_heads} query heads do not group over {kv_heads} key/value heads")
    total = k_len + (past_key.shape[2] if past_key is not None else 0)
    if given[3] and types[3].shape[-1] > total:
        raise ShapeError(f"attn_mask {types[3]} covers more keys than the {total} there are")
    y = (b, q_len, q_heads * v_size) if q.rank == 3 else (b, q_heads, q_len, v_size)
    shapes = [y, (b, kv_heads, total, head_size), (b, kv_heads, total, v_size)]
    shapes.append((b, q_heads, q_len, total))
    return [TensorType(shape, q.dtype) for shape in shapes]


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


def _split_heads(x: np.ndarray, heads: int) -> np.ndarray:
    """(B, T, H*D) -> (B, H, T, D) in float64."""
    b, t, hd = x.shape
    return x.reshape(b, t, heads, hd // heads).transpose(0, 2, 1, 3).astype(np.float64)


def _per_step(x: np.ndarray | None, kv_heads: int) -> np.ndarray | None:
    """A (B, T, H*X) or (B, T, X) gate -> (B, H or 1, T, X) in float64, X per key or 1."""
    if x is None:
        return None
    b, t, packed = x.shape
    heads = kv_heads if packed % kv_heads == 0 else 1
    return x.reshape(b, t, heads, packed // heads).transpose(0, 2, 1, 3).astype(np.float64)


def _linear_attention(node, inputs):
    query, key, value = inputs[0], inputs[1], inputs[2]
    past_state, decay, beta = (_optional(inputs, i) for i in (3, 4, 5))
    q_heads, kv_heads = node.attr("q_num_heads"), node.attr("kv_num_heads")
    rule = node.attr("update_rule", "gated_delta")
    gated, delta = rule in ("gated", "gated_delta"), rule in ("delta", "gated_delta")
    q = _split_heads(query, q_heads)
    k, v = _split_heads(key, kv_heads), _split_heads(value, kv_heads)
    batch, _, steps, d_k = q.shape
    d_v = v.shape[-1]
    # Query heads share their key/value head in contiguous groups, as in Attention.
    q = q.reshape(batch, kv_heads, q_heads // kv_heads, steps, d_k)
    scale = node.attr("scale", 0.0) or 1.0 / np.sqrt(d_k)
    decay_factor = np.exp(_per_step(decay, kv_heads)) if gated else None
    rate = _per_step(beta, kv_heads) if delta else None
    state = np.zeros((batch, kv_heads, d_k, d_v))
    if past_state is not None:
        state = past_state.astype(np.float64)
    outputs = np.zeros((batch, kv_heads, q.shape[2], steps, d_v))
    for t in range(steps):
        k_t, v_t = k[:, :, t], v[:, :, t]
        if gated:  # a per-key (or per-head) factor on the rows of every state matrix
            state = state * decay_factor[:, :, t, :, None]
        if delta:  # write only what the (decayed) state does not already predict for k_t
            predicted = np.einsum("bhkv,bhk->bhv", state, k_t)
            v_t = rate[:, :, t] * (v_t - predicted)
        state = state + k_t[..., :, None] * v_t[..., None, :]
        outputs[:, :, :, t] = scale * np.einsum("bhgk,bhkv->bhgv", q[:, :, :, t], state)
    out = outputs.reshape(batch, q_heads, steps, d_v).transpose(0, 2, 1, 3)
    state_dtype = query.dtype if past_state is None else past_state.dtype
    return [out.reshape(batch, steps, -1).astype(query.dtype), state.astype(state_dtype)]


def _linear_attention_rule(node, types):
    query, value = types[0], types[2]
    past_state = types[3] if len(types) > 3 else None
    q_heads, kv_heads = node.attr("q_num_heads"), node.attr("kv_num_heads")
    if query.rank != 3 or value.rank != 3 or query.shape[2] % q_heads:
        raise ShapeError(f"query {query} / value {value} are not packed (B, T, H*D) tensors")
    if q_heads % kv_heads or value.shape[2] % kv_heads:
        raise ShapeError(f"{q_heads} query heads do not group over {kv_heads} key/value heads")
    batch, steps = query.shape[:2]
    d_k, d_v = query.shape[2] // q_heads, value.shape[2] // kv_heads
    state_dtype = query.dtype if past_state is None else past_state.dtype
    return [
        TensorType((batch, steps, q_heads * d_v), query.dtype),
        TensorType((batch, kv_heads, d_k, d_v), state_dtype),
    ]


OPS: dict[str, OpDef] = {
    "Attention": opdef("Attention", OpKind.OPAQUE, _attention_rule, _attention),
    "RMSNormalization": opdef("RMSNormalization", OpKind.OPAQUE, same_as(0), _rms_norm),
    "RotaryEmbedding": opdef("RotaryEmbedding", OpKind.OPAQUE, same_as(0), _rotary),
    "LinearAttention": opdef(
        "LinearAttention", OpKind.OPAQUE, _linear_attention_rule, _linear_attention
    ),
    "Swish": opdef("Swish", OpKind.ELEMWISE, same_as(0), _swish),
}
