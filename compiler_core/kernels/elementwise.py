"""Elementwise and broadcast operators as tensor expressions (one scalar formula each)."""

from __future__ import annotations

import math

import numpy as np

from compiler_core.graph.ir import Node
from compiler_core.kernels.base import Builder, KernelContext, KernelError, broadcast_index
from compiler_core.loop.ir import (
    Binary,
    Cast,
    Const,
    Expr,
    Select,
    Unary,
    logical_and,
    maximum,
    minimum,
)
from compiler_core.te import compute, reduce_axis, reduce_max, reduce_min


def _const(value, like: Expr) -> Expr:
    return Const(value, like.dtype)


def _clip(n: Node, x: Expr) -> Expr:
    out = x
    if n.attr("min", None) is not None:
        out = maximum(out, _const(n.attr("min"), x))
    if n.attr("max", None) is not None:
        out = minimum(out, _const(n.attr("max"), x))
    return out


def _gelu(n: Node, x: Expr) -> Expr:
    if n.attr("approximate", "none") == "tanh":
        inner = _const(math.sqrt(2 / math.pi), x) * (x + _const(0.044715, x) * x * x * x)
        return _const(0.5, x) * x * (_const(1.0, x) + Unary("tanh", inner))
    return _const(0.5, x) * x * (_const(1.0, x) + Unary("erf", x * _const(math.sqrt(0.5), x)))


# ln(1 + u) / u on [0, 1], degree 8 (a Chebyshev fit, float32 coefficients, the first exactly
# 1): u times it is ln1p(u) within 2e-7 relative for every float32 u in [0, 1].
LN1P_OVER_U = (
    1.0, -0.49999502301216125, 0.33319270610809326, -0.24844369292259216,
    0.19111430644989014, -0.13674770295619965, 0.07836166769266129, -0.02958850748836994,
    0.005253457929939032,
)  # fmt: skip


def _softplus(n: Node, x: Expr) -> Expr:
    """ln(1 + e^x) as max(x, 0) + ln1p(e^-|x|): e^x overflows past 88.7 (softplus(100) was
    inf). With e = e^-|x| in [0, 1], float32 takes ln1p(e) as e times a polynomial
    (`LN1P_OVER_U`: eight FMAs where a log and a division were: 1.08 of OpenVINO before);
    other types as ln(u) e / (u - 1) with u = 1 + e rounded (Goldberg's form: the ratio puts
    back what rounding u took from e: ln(u) alone was 0.9% off at x = -12 and 0 from
    x = -16.7), and e itself once u rounds to 1."""
    e = Unary("exp", Unary("neg", Unary("abs", x)))
    if x.dtype == "float32":
        series = _const(LN1P_OVER_U[-1], x)
        for coefficient in LN1P_OVER_U[-2::-1]:
            series = series * e + _const(coefficient, x)
        return maximum(x, _const(0.0, x)) + e * series
    u = _const(1.0, x) + e
    tail = Select(u.equals(_const(1.0, x)), e, Unary("log", u) * (e / (u - _const(1.0, x))))
    return maximum(x, _const(0.0, x)) + tail


def _mish(n: Node, x: Expr) -> Expr:
    """x tanh(ln(1 + e^x)) = x n / (n + 2) with n = e^x (e^x + 2), since tanh(ln y) =
    (y^2 - 1) / (y^2 + 1): one exp and a division instead of an exp, a log and a tanh (2.9x
    faster). Past x = 20 the ratio is 1 in float32 and e^x is held there so n stays finite."""
    e = Unary("exp", minimum(x, _const(20.0, x)))
    grown = e * (e + _const(2.0, x))
    return x * grown / (grown + _const(2.0, x))


def _hard_sigmoid(n: Node, x: Expr) -> Expr:
    linear = x * _const(n.attr("alpha", 0.2), x) + _const(n.attr("beta", 0.5), x)
    return minimum(maximum(linear, _const(0.0, x)), _const(1.0, x))


UNARY = {
    "Identity": lambda n, x: x,
    "Relu": lambda n, x: maximum(x, _const(0.0, x)),
    "LeakyRelu": lambda n, x: Select(x >= _const(0.0, x), x, x * _const(n.attr("alpha", 0.01), x)),
    "Clip": _clip,
    "Sigmoid": lambda n, x: Unary("sigmoid", x),
    "Tanh": lambda n, x: Unary("tanh", x),
    "Erf": lambda n, x: Unary("erf", x),
    "Gelu": _gelu,
    "HardSigmoid": _hard_sigmoid,
    "HardSwish": lambda n, x: (
        x * minimum(maximum(x / _const(6.0, x) + _const(0.5, x), _const(0.0, x)), _const(1.0, x))
    ),
    "Sqrt": lambda n, x: Unary("sqrt", x),
    "Exp": lambda n, x: Unary("exp", x),
    "Log": lambda n, x: Unary("log", x),
    "Neg": lambda n, x: Unary("neg", x),
    "Abs": lambda n, x: Unary("abs", x),
    "Reciprocal": lambda n, x: _const(1.0, x) / x,
    "Floor": lambda n, x: Unary("floor", x),
    "Ceil": lambda n, x: Unary("ceil", x),
    "Round": lambda n, x: Unary("round", x),
    "Sin": lambda n, x: Unary("sin", x),
    "Cos": lambda n, x: Unary("cos", x),
    "Softplus": _softplus,
    "Softsign": lambda n, x: x / (_const(1.0, x) + Unary("abs", x)),
    "Elu": lambda n, x: Select(
        x > _const(0.0, x),
        x,
        _const(n.attr("alpha", 1.0), x) * (Unary("exp", x) - _const(1.0, x)),
    ),
    "Not": lambda n, x: Unary("not", x),
    "BitwiseNot": lambda n, x: Binary("xor", x, _all_ones(x)),
    "Celu": lambda n, x: (
        maximum(x, _const(0.0, x))
        + minimum(
            _const(0.0, x),
            _const(n.attr("alpha", 1.0), x)
            * (Unary("exp", x / _const(n.attr("alpha", 1.0), x)) - _const(1.0, x)),
        )
    ),
    "ThresholdedRelu": lambda n, x: Select(x > _const(n.attr("alpha", 1.0), x), x, _const(0.0, x)),
    "Mish": _mish,
    "Sign": lambda n, x: Unary("sign", x),
    "Selu": lambda n, x: (
        _const(n.attr("gamma", 1.0507009873554805), x)
        * Select(
            x > _const(0.0, x),
            x,
            _const(n.attr("alpha", 1.6732632423543772), x) * (Unary("exp", x) - _const(1.0, x)),
        )
    ),
    "Shrink": lambda n, x: Select(
        x < _const(-n.attr("lambd", 0.5), x),
        x + _const(n.attr("bias", 0.0), x),
        Select(
            x > _const(n.attr("lambd", 0.5), x), x - _const(n.attr("bias", 0.0), x), _const(0.0, x)
        ),
    ),
    "Swish": lambda n, x: x * Unary("sigmoid", x * _const(n.attr("alpha", 1.0), x)),
    "Tan": lambda n, x: Unary("tan", x),
    "Asin": lambda n, x: Unary("asin", x),
    "Acos": lambda n, x: Unary("acos", x),
    "Atan": lambda n, x: Unary("atan", x),
    "Sinh": lambda n, x: Unary("sinh", x),
    "Cosh": lambda n, x: Unary("cosh", x),
    "Asinh": lambda n, x: Unary("asinh", x),
    "Acosh": lambda n, x: Unary("acosh", x),
    "Atanh": lambda n, x: Unary("atanh", x),
}


def _all_ones(x: Expr) -> Expr:
    info = np.iinfo(x.dtype)
    return Const(-1 if info.min < 0 else info.max, x.dtype)


def _is_inf(n: Node, x: Expr) -> Expr:
    positive = x.equals(_const(np.inf, x))
    negative = x.equals(_const(-np.inf, x))
    if not n.attr("detect_positive", 1):
        return negative
    if not n.attr("detect_negative", 1):
        return positive
    return Binary("or", positive, negative)


PREDICATES = {
    "IsInf": _is_inf,
    "IsNaN": lambda n, x: Binary("ne", x, x),
}

BINARY = {
    "Add": lambda n, a, b: a + b,
    "Sub": lambda n, a, b: a - b,
    "Mul": lambda n, a, b: a * b,
    "Div": lambda n, a, b: a / b,
    "Pow": lambda n, a, b: Binary("pow", a, Cast(a.dtype, b) if b.dtype != a.dtype else b),
    "PRelu": lambda n, a, b: Select(a >= _const(0.0, a), a, a * b),
    "Equal": lambda n, a, b: a.equals(b),
    "Less": lambda n, a, b: a < b,
    "Greater": lambda n, a, b: a > b,
    "LessOrEqual": lambda n, a, b: a <= b,
    "GreaterOrEqual": lambda n, a, b: a >= b,
    "And": lambda n, a, b: logical_and(a, b),
    "Or": lambda n, a, b: Binary("or", a, b),
    "Xor": lambda n, a, b: Binary("xor", a, b),
    "BitwiseAnd": lambda n, a, b: Binary("bitand", a, b),
    "BitwiseOr": lambda n, a, b: Binary("bitor", a, b),
    "BitwiseXor": lambda n, a, b: Binary("xor", a, b),
    "Mod": lambda n, a, b: Binary("fmod" if n.attr("fmod", 0) else "mod", a, b),
    "BitShift": lambda n, a, b: Binary("shl" if n.attr("direction") == "LEFT" else "shr", a, b),
}

VARIADIC = {"Max": maximum, "Min": minimum, "Sum": lambda a, b: a + b}


def _read(ctx: KernelContext, value: str, out_shape, index):
    t = ctx.tensor(value)
    return t[broadcast_index(t.shape, out_shape, index)]


def _unary_builder(fn) -> Builder:
    def build(ctx: KernelContext, node: Node):
        out = ctx.type(node.outputs[0])
        return [
            compute(
                out.shape,
                lambda *i: fn(node, _read(ctx, node.inputs[0], out.shape, i)),
                ctx.stage_name(node),
                out.dtype,
            )
        ]

    return build


def _nary_builder(fn) -> Builder:
    def build(ctx: KernelContext, node: Node):
        out = ctx.type(node.outputs[0])

        def body(*i):
            values = [_read(ctx, v, out.shape, i) for v in node.inputs]
            return fn(node, *values)

        return [compute(out.shape, body, ctx.stage_name(node), out.dtype)]

    return build


def _variadic_builder(fn) -> Builder:
    def combine(node, *values):
        result = values[0]
        for v in values[1:]:
            result = fn(result, v)
        return result

    return _nary_builder(combine)


def _mean(node, *values):
    total = values[0]
    for v in values[1:]:
        total = total + v
    return total / _const(float(len(values)), total)


def _where(node, cond, a, b):
    return Select(cond, a, b)


def _cast(node, x):
    # Float to int truncates toward zero (fptosi), as ONNX's Cast does.
    return Cast(node.attr("to"), x)


def _batch_norm(ctx: KernelContext, node: Node):
    # Normally folded away by simplify_inference; kept for graphs with non-constant parameters.
    out = ctx.type(node.outputs[0])
    eps = node.attr("epsilon", 1e-5)

    def body(*i):
        x = ctx.tensor(node.inputs[0])[i]
        c = (i[1],)
        scale, bias, mean, var = (ctx.tensor(v)[c] for v in node.inputs[1:5])
        return (x - mean) * scale / Unary("sqrt", var + _const(eps, var)) + bias

    return [compute(out.shape, body, ctx.stage_name(node), out.dtype)]


KERNELS: dict[str, Builder] = {
    **{op: _unary_builder(fn) for op, fn in UNARY.items()},
    **{op: _nary_builder(fn) for op, fn in BINARY.items()},
    **{op: _variadic_builder(fn) for op, fn in VARIADIC.items()},
    **{op: _unary_builder(fn) for op, fn in PREDICATES.items()},
    "Mean": _nary_builder(_mean),
    "Where": _nary_builder(_where),
    "Cast": _unary_builder(_cast),
    "BatchNormalization": _batch_norm,
}


def _quantization_param(ctx: KernelContext, node: Node, value: str, index):
    """A per-tensor (scalar), per-axis (1-D) or blocked (same rank as the data, one entry per
    `block_size` elements along the axis) scale or zero point at an element's index."""
    t = ctx.tensor(value)
    if not t.shape or (len(t.shape) == 1 and t.shape[0] == 1 and len(index) <= 1):
        return t[tuple(Const(0, "int64") for _ in t.shape)]
    axis = node.attr("axis", 1) % len(index)
    block = node.attr("block_size", 0)
    if block and len(t.shape) == len(index):
        blocked = list(index)
        blocked[axis] = Binary("floordiv", index[axis], Const(block, "int64"))
        return t[tuple(blocked)]
    if len(t.shape) != 1:
        raise KernelError(f"node {node.name!r}: a {len(t.shape)}-D quantization parameter")
    return t[(index[axis],)]


def _quantize(ctx: KernelContext, node: Node):
    out = ctx.type(node.outputs[0])
    x = ctx.tensor(node.inputs[0])
    info = np.iinfo(out.dtype)
    has_zero = len(node.inputs) > 2 and node.inputs[2]

    def body(*i):
        scale = Cast("float32", _quantization_param(ctx, node, node.inputs[1], i))
        value = Unary("round", Cast("float32", x[i]) / scale)
        if has_zero:
            value = value + Cast("float32", _quantization_param(ctx, node, node.inputs[2], i))
        low, high = Const(float(info.min), "float32"), Const(float(info.max), "float32")
        return Cast(out.dtype, minimum(maximum(value, low), high))

    return [compute(out.shape, body, ctx.stage_name(node), out.dtype)]


def _dequantize(ctx: KernelContext, node: Node):
    out = ctx.type(node.outputs[0])
    x = ctx.tensor(node.inputs[0])
    has_zero = len(node.inputs) > 2 and node.inputs[2]

    def body(*i):
        value = Cast(out.dtype, x[i])
        if has_zero:
            value = value - Cast(out.dtype, _quantization_param(ctx, node, node.inputs[2], i))
        return value * Cast(out.dtype, _quantization_param(ctx, node, node.inputs[1], i))

    return [compute(out.shape, body, ctx.stage_name(node), out.dtype)]


def _dynamic_quantize(ctx: KernelContext, node: Node):
    """uint8 quantization with the scale and zero point of x's range (widened to hold 0),
    all in float32 as the operator defines it."""
    x = ctx.tensor(node.inputs[0])
    f32 = "float32"

    def extreme(reduce):
        axes = [reduce_axis(d, f"r{k}") for k, d in enumerate(x.shape)]
        return compute((), lambda: reduce(Cast(f32, x[tuple(axes)]), axes), ctx.stage_name(node))

    low_x, high_x = extreme(reduce_min), extreme(reduce_max)
    zero_f = Const(0.0, f32)

    def scale_body():
        low, high = minimum(low_x[()], zero_f), maximum(high_x[()], zero_f)
        return Select(high > low, (high - low) / Const(255.0, f32), Const(1.0, f32))

    scale = compute((), scale_body, ctx.stage_name(node))

    def saturated(value):
        return minimum(maximum(value, zero_f), Const(255.0, f32))

    zero_point = compute(
        (),
        lambda: saturated(Unary("round", -minimum(low_x[()], zero_f) / scale[()])),
        ctx.stage_name(node),
    )

    def quantized(*i):
        value = Unary("round", Cast(f32, x[i]) / scale[()]) + zero_point[()]
        return Cast("uint8", saturated(value))

    outputs = {
        0: compute(x.shape, quantized, ctx.stage_name(node), "uint8"),
        1: scale,
        2: compute((), lambda: Cast("uint8", zero_point[()]), ctx.stage_name(node), "uint8"),
    }
    return [outputs[k] for k, value in enumerate(node.outputs) if value]


KERNELS.update(
    {
        "QuantizeLinear": _quantize,
        "DequantizeLinear": _dequantize,
        "DynamicQuantizeLinear": _dynamic_quantize,
    }
)
