"""ConvTranspose as one ordinary convolution plus an interleave (stride-phase decomposition).

A transposed convolution with stride s scatters each input pixel times the kernel onto the
output at s-spaced positions. Output position j = q*s + r (phase r in [0, s)) only ever
receives kernel taps k = r + t*s, from input pixel q - t:

    canvas[q*s + r] = sum_t x[q - t] * w[r + t*s]

For each phase that is a stride-1 correlation of x with the phase's taps, flipped and padded
to T = ceil(k/s) taps (a zero tap where a phase has fewer). All s^d phases share the input,
so they become ONE Conv whose M * s^d output channels are ordered (m, phase): the heavy work
runs on the blocked conv path, with no zero-stuffed input and no multiply by a zero tap
beyond the ceil. One injective InterleavePhases op (a DepthToSpace with a crop) puts the
phases in place and crops pads and output_padding; with direct per-element index math its
vectorized copy compiles to constant-offset loads, and fusion folds the layout transform
back from the conv's blocked output into it. Input positions outside x read zero through
the conv's padding, which is also what negative pads (an oversized output_shape) and
output_padding need: their margins are zero plus bias.

A 1-D ConvTranspose is decomposed as a 2-D one of unit height (LIFT_1D), so that its phase
Conv gets the blocked 2-D path. Dilated kernels, and weights only known at run time, keep
the ConvTranspose node and its direct kernel.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from compiler_core.graph.ir import Graph, Node, TensorType
from compiler_core.kernels.schedules import NCHWC_TILE
from compiler_core.passes.rewrite import Decomposition

NAME = "decompose_conv_transpose"
# Lift 1-D transposed convolutions to 2-D (unit H) so that their phase Conv is blocked.
LIFT_1D = True


@dataclasses.dataclass(frozen=True)
class _Axis:
    """One spatial axis of the decomposition: the conv computes phase-grid rows
    q = start .. start + rows - 1 (conv output row a is q = start + a) and the output begins
    at canvas position `crop` of the interleaved rows."""

    size: int  # input length
    stride: int
    taps: int  # T = ceil(k / s): kernel taps per phase
    start: int
    rows: int
    crop: int

    @property
    def conv_pads(self) -> tuple[int, int]:
        """Row a reads x[start + a - (T-1) + u]; rows = size + begin + end - T + 1."""
        begin = self.taps - 1 - self.start
        return begin, self.rows - self.size - begin + self.taps - 1


def _axis(size: int, kernel: int, stride: int, pad_begin: int, out: int, last: bool) -> _Axis:
    taps = -(-kernel // stride)
    first_row = pad_begin // stride  # q of output position 0 (floor: pads may be negative)
    last_row = (pad_begin + out - 1) // stride
    # Conv pads cannot be negative: compute from q = T-1 at the latest and to q = size-1 at
    # the earliest, and crop whatever extra rows that gives.
    start, end = min(first_row, taps - 1), max(last_row, size - 1)
    rows = end - start + 1
    if last:
        rows = _tileable_width(rows)
    return _Axis(size, stride, taps, start, rows, pad_begin - start * stride)


# The conv kernels tile a row of output pixels by a divisor of its width (at most NCHWC_TILE
# pixels). The phase grid is often one wider than the input (k4 s2 p1 on 16 pixels: 17), and
# a prime width gets one-pixel tiles, several times slower. Up to 1/8 more columns
# (computed, then cropped) buy a width with a divisor of at least GOOD_TILE.
GOOD_TILE = 6


def _tileable_width(width: int) -> int:
    def best_tile(w: int) -> int:
        return max(t for t in range(1, NCHWC_TILE + 1) if w % t == 0)

    for candidate in range(width, width + width // 8 + 1):
        if best_tile(candidate) >= GOOD_TILE:
            return candidate
    return width


def phase_weight(w: np.ndarray, strides, group: int) -> np.ndarray:
    """ConvTranspose weight (C, M/g, *k) -> Conv weight (M * S, C/g, *T), S = prod(strides).

    Output channel (m, phase r) at tap u holds w[..., r + (T-1-u)*s] per axis, zero where
    that index passes the kernel's end.
    """
    channels, per_group, *kernel = w.shape
    nsp = len(kernel)
    pairs = [(-(-k // s), s) for k, s in zip(kernel, strides, strict=True)]  # (T, s)
    taps = [t for t, _ in pairs]
    padded = np.zeros((channels, per_group, *[t * s for t, s in pairs]), w.dtype)
    padded[(slice(None), slice(None), *[slice(0, k) for k in kernel])] = w
    # kernel index k = t*s + r: split each axis into (t, r), then flip t (u = T-1-t).
    split = padded.reshape(group, channels // group, per_group, *[d for p in pairs for d in p])
    t_axes = [3 + 2 * i for i in range(nsp)]
    r_axes = [4 + 2 * i for i in range(nsp)]
    flipped = np.flip(split, axis=tuple(t_axes))
    # (group, C/g, M/g, T1, s1, ...) -> (group, M/g, s1.., C/g, T1..)
    moved = flipped.transpose(0, 2, *r_axes, 1, *t_axes)
    phases = math.prod(strides)
    return np.ascontiguousarray(moved.reshape(group * per_group * phases, channels // group, *taps))


class _Rewriter(Decomposition):
    def takes(self, node: Node) -> bool:
        return _eligible(self.graph, node)

    def emit_typed(self, op: str, name: str, inputs, out_shape, dtype, output=None, **attrs) -> str:
        """One node of a type given here (its shape is known from the ConvTranspose)."""
        output = output or self.fresh(f"{name}_out")
        self.types[output] = TensorType(tuple(out_shape), dtype)
        self.nodes.append(Node(op, self.fresh(name), tuple(inputs), (output,), attrs))
        return output

    def decompose(self, node: Node) -> None:
        x, w_name = node.inputs[0], node.inputs[1]
        bias = node.inputs[2] if len(node.inputs) > 2 else ""
        w = self.graph.constants[w_name]
        strides, pads = node.attr("strides"), node.attr("pads")
        x_shape, out_type = self.types[x].shape, self.types[node.outputs[0]]
        out_shape, dtype, output = out_type.shape, out_type.dtype, node.outputs[0]
        if len(x_shape) == 3 and LIFT_1D:
            # 1-D convolutions have no blocked (NCW[b]c) path yet: a unit H axis puts the phase
            # Conv on the 2-D one. The Reshape of x is one copy of the (small) input.
            x_shape, out_shape = (*x_shape[:2], 1, x_shape[2]), (*out_shape[:2], 1, out_shape[2])
            x = self.emit_typed("Reshape", f"{node.name}_as_2d", [x], x_shape, dtype, shape=x_shape)
            w, strides, pads = w[:, :, None], (1, *strides), (0, pads[0], 0, pads[1])
            output = self.fresh(f"{node.name}_2d")
        n, _, *in_spatial = x_shape
        out_spatial = out_shape[2:]
        nsp, phases, group = len(in_spatial), math.prod(strides), node.attr("group", 1)
        axes = [
            _axis(in_spatial[i], w.shape[2 + i], strides[i], pads[i], out_spatial[i], i == nsp - 1)
            for i in range(nsp)
        ]
        conv_pads = [a.conv_pads for a in axes]
        inputs = [x, self.constant(phase_weight(w, strides, group), f"{node.name}_phase_weight")]
        if bias:
            b = self.graph.constants[bias]
            inputs.append(self.constant(np.repeat(b, phases), f"{node.name}_phase_bias"))
        canvas = [a.rows * a.stride for a in axes]
        exact = phases == 1 and not any(a.crop for a in axes) and canvas == list(out_spatial)
        phase_grid = self.emit_typed(
            "Conv",
            f"{node.name}_phases",
            inputs,
            (n, out_shape[1] * phases, *[a.rows for a in axes]),
            dtype,
            output=output if exact else None,
            pads=tuple(p[0] for p in conv_pads) + tuple(p[1] for p in conv_pads),
            strides=(1,) * nsp,
            dilations=(1,) * nsp,
            group=group,
        )
        if not exact:
            # One injective op interleaves the phases and crops (a plain crop at stride 1).
            self.emit_typed(
                "InterleavePhases",
                f"{node.name}_interleave",
                [phase_grid],
                out_shape,
                dtype,
                output=output,
                strides=tuple(strides),
                starts=tuple(a.crop for a in axes),
                output_shape=tuple(out_spatial),
            )
        if output != node.outputs[0]:  # back from the lifted 2-D form (fuses into the copy)
            final = out_type.shape
            self.emit_typed("Reshape", f"{node.name}_as_1d", [output], final, dtype,
                            node.outputs[0], shape=final)  # fmt: skip


def _eligible(graph: Graph, node: Node) -> bool:
    """Constant weight and bias, no dilation: the weights can be rearranged at build time."""
    if node.op != "ConvTranspose" or node.inputs[1] not in graph.constants:
        return False
    if len(node.inputs) > 2 and node.inputs[2] and node.inputs[2] not in graph.constants:
        return False
    return all(d == 1 for d in node.attr("dilations"))


def run(graph: Graph) -> Graph:
    return _Rewriter(graph).run()
