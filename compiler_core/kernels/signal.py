"""Native kernels for DFT and STFT (reference: compiler_core/graph/ops/signal.py).

A transform of static length is a product with a table of cosines and sines, built once at
compile time (in float64, with the inverse's 1/N and the one-sided inverse's Hermitian weights
folded in): out[j] = sum over r of x[r] * (cos - i sin)(2 pi j r / N). Sums run in float64.
"""

from __future__ import annotations

import numpy as np

from compiler_core.graph.ir import Node
from compiler_core.kernels.base import Builder, KernelContext
from compiler_core.loop.ir import INDEX, Binary, Cast, Const, Select
from compiler_core.te import Tensor, compute, reduce_axis, reduce_sum

F64 = "float64"


def _tables(outputs: int, used: int, length: int, weights=None, scale: float = 1.0):
    """cos and sin of 2 pi j r / length for j < outputs, r < used, times weights[r]."""
    angle = 2 * np.pi * np.outer(np.arange(outputs), np.arange(used)) / length
    w = np.ones(used) if weights is None else weights
    return np.cos(angle) * w * scale, np.sin(angle) * w * scale


def _complex_parts(x: Tensor, index):
    """(real, imaginary) of x at `index` (without its trailing pair axis), in float64."""
    real = Cast(F64, x[(*index, Const(0, INDEX))])
    if x.shape[-1] == 1:
        return real, Const(0.0, F64)
    return real, Cast(F64, x[(*index, Const(1, INDEX))])


def _pairs(ctx, node, shape, real: Tensor, imaginary: Tensor | None, dtype: str) -> Tensor:
    def body(*i):
        re = real[i[:-1]]
        if imaginary is None:
            return Cast(dtype, re)
        return Cast(dtype, Select(Binary("eq", i[-1], Const(0, INDEX)), re, imaginary[i[:-1]]))

    return compute(shape, body, ctx.stage_name(node), dtype)


def _dft(ctx: KernelContext, node: Node):
    x = ctx.tensor(node.inputs[0])
    out = ctx.type(node.outputs[0])
    axis, length = node.attr("axis"), node.attr("dft_length")
    inverse, onesided = node.attr("inverse", 0), node.attr("onesided", 0)
    real_output = bool(onesided and inverse)
    if real_output:  # irfft: bins 0 .. N/2 stand for the whole Hermitian spectrum
        used = min(x.shape[axis], length // 2 + 1)
        weights = np.full(used, 2.0)
        weights[0] = 1.0
        if length % 2 == 0 and used > length // 2:
            weights[length // 2] = 1.0
        cos, sin = _tables(length, used, length, weights, 1.0 / length)
        # numpy's irfft ignores the imaginary parts of the bins at 0 and N/2.
        sin[:, 0] = 0.0
        if length % 2 == 0 and used > length // 2:
            sin[:, length // 2] = 0.0
    else:
        used = min(x.shape[axis], length)
        cos, sin = _tables(out.shape[axis], used, length, scale=1.0 / length if inverse else 1.0)
    sign = 1.0 if inverse else -1.0  # e^{sign i theta}
    cos_t = ctx.packed(node.inputs[0], f"dft_cos_{node.name}", cos)
    sin_t = ctx.packed(node.inputs[0], f"dft_sin_{node.name}", sin)
    part_shape = out.shape[:-1]

    def part(imaginary: bool):
        def body(*i):
            r = reduce_axis(used, "rn")
            source = (*i[:axis], r, *i[axis + 1 :])
            xr, xi = _complex_parts(x, source)
            c, s = cos_t[(i[axis], r)], sin_t[(i[axis], r)] * Const(sign, F64)
            # (xr + i xi)(c + i s)
            value = xi * c + xr * s if imaginary else xr * c - xi * s
            return reduce_sum(value, r)

        return compute(part_shape, body, ctx.stage_name(node), F64)

    real = part(False)
    imaginary = None if real_output else part(True)
    return [_pairs(ctx, node, out.shape, real, imaginary, out.dtype)]


def _stft(ctx: KernelContext, node: Node):
    signal = ctx.tensor(node.inputs[0])
    has_window = len(node.inputs) > 1 and node.inputs[1]
    window = ctx.tensor(node.inputs[1]) if has_window else None
    out = ctx.type(node.outputs[0])
    step, frame = node.attr("frame_step"), node.attr("frame_length")
    bins = out.shape[2]
    cos, sin = _tables(bins, frame, frame)
    cos_t = ctx.packed(node.inputs[0], f"stft_cos_{node.name}", cos)
    sin_t = ctx.packed(node.inputs[0], f"stft_sin_{node.name}", -sin)

    def part(imaginary: bool):
        def body(b, f, k):
            n = reduce_axis(frame, "rn")
            xr, xi = _complex_parts(signal, (b, f * Const(step, INDEX) + n))
            if window is not None:
                w = Cast(F64, window[(n,)])
                xr, xi = xr * w, xi * w
            c, s = cos_t[(k, n)], sin_t[(k, n)]
            return reduce_sum(xi * c + xr * s if imaginary else xr * c - xi * s, n)

        return compute(out.shape[:-1], body, ctx.stage_name(node), F64)

    return [_pairs(ctx, node, out.shape, part(False), part(True), out.dtype)]


KERNELS: dict[str, Builder] = {"DFT": _dft, "STFT": _stft}
