"""ConvTranspose becomes a Conv: the stride-phase decomposition, never a zero-stuffed input.

A transposed convolution with stride s writes output position u = i*s + k from input position
i and kernel tap k. Split the output by phase p = u mod s: the outputs of one phase, at
q = u div s, are an ordinary stride-1 correlation of the input with the taps k = p, p+s, p+2s...
in reverse order. So all s^d phases are ONE Conv with M*s^d output channels and a kernel of
ceil(k/s) taps per axis (weights rearranged at build time, zero where a phase has fewer taps),
whose input is padded by ceil(k/s)-1 in front; interleaving its phase channels into the
spatial axes (Reshape, Transpose, Reshape) and cropping the pads (Slice) gives the output.

The Conv rides the blocked-convolution path (layout pass, register-tiled kernels, tuning);
the interleave is one copy. Rewritten: float ConvTranspose with constant weights (and a
constant bias, if any), dilation 1 and non-negative pads; others keep their own kernel.
"""

from __future__ import annotations

import itertools
import math

import numpy as np

from compiler_core.graph.ir import Graph, NameGenerator, Node, TensorType
from compiler_core.graph.ops import OP_TABLE

NAME = "lower_conv_transpose"


def _eligible(graph: Graph, node: Node) -> bool:
    if node.op != "ConvTranspose" or len(node.inputs) < 2:
        return False
    x, w = node.inputs[0], node.inputs[1]
    bias = node.inputs[2] if len(node.inputs) > 2 else ""
    nsp = graph.types[x].rank - 2
    return (
        graph.types[x].dtype in ("float32", "float64")
        and nsp >= 1
        and w in graph.constants
        and (not bias or bias in graph.constants)
        and all(d == 1 for d in node.attr("dilations", (1,) * nsp))
        and all(p >= 0 for p in node.attr("pads", (0,) * (2 * nsp)))
    )


def phase_weights(weights: np.ndarray, strides, group: int) -> np.ndarray:
    """ConvTranspose weights [C, M/g, *K] as the phase Conv's [M*S, C/g, *J] (S = prod(s),
    J = ceil(K/s)): output channel m*S + phase, tap t of a phase p reads k = p + (J-1-t)*s."""
    channels, per_group = weights.shape[:2]
    kernel = weights.shape[2:]
    taps = [math.ceil(k / s) for k, s in zip(kernel, strides, strict=True)]
    phases = list(itertools.product(*[range(s) for s in strides]))
    cg = channels // group
    out = np.zeros((group * per_group * len(phases), cg, *taps), weights.dtype)
    for g, m_local, (ph, phase) in itertools.product(
        range(group), range(per_group), enumerate(phases)
    ):
        row = (g * per_group + m_local) * len(phases) + ph
        for tap in itertools.product(*[range(j) for j in taps]):
            k = [p + (j - 1 - t) * s for p, t, j, s in zip(phase, tap, taps, strides, strict=True)]
            if all(ki < ks for ki, ks in zip(k, kernel, strict=True)):
                out[(row, slice(None), *tap)] = weights[(slice(g * cg, (g + 1) * cg), m_local, *k)]
    return out


class _Rewriter:
    def __init__(self, graph: Graph):
        self.graph = graph
        self.fresh = NameGenerator(graph.names())
        self.types = dict(graph.types)
        self.constants = dict(graph.constants)
        self.nodes: list[Node] = []

    def constant(self, array: np.ndarray, prefix: str) -> str:
        name = self.fresh.unique(prefix)
        self.constants[name] = array
        self.types[name] = TensorType.of(array)
        return name

    def emit(self, op: str, base: str, inputs, attrs, output: str | None = None) -> str:
        output = output or self.fresh.unique(f"{base}_{op.lower()}")
        node = Node(op, self.fresh.unique(f"{base}_{op.lower()}"), tuple(inputs), (output,), attrs)
        (out_type,) = OP_TABLE[op].infer(node, [self.types[v] for v in node.inputs])
        self.types[output] = out_type
        self.nodes.append(node)
        return output

    def lower(self, node: Node) -> None:
        x, w = node.inputs[0], node.inputs[1]
        x_type = self.types[x]
        nsp = x_type.rank - 2
        strides = tuple(node.attr("strides", (1,) * nsp))
        pads = tuple(node.attr("pads", (0,) * (2 * nsp)))
        group = node.attr("group", 1)
        out_spatial = tuple(node.attr("output_shape"))
        weights = np.asarray(self.constants[w])
        kernel = weights.shape[2:]
        taps = [math.ceil(k / s) for k, s in zip(kernel, strides, strict=True)]
        phases = math.prod(strides)
        out_channels = weights.shape[1] * group
        in_spatial = x_type.shape[2:]
        # Phase outputs needed per axis: the output's last position sits at pad + out - 1.
        needed = [math.ceil((pads[i] + out_spatial[i]) / strides[i]) for i in range(nsp)]
        ends = [max(0, q - size) for q, size in zip(needed, in_spatial, strict=True)]
        conv_pads = [j - 1 for j in taps] + ends
        inputs = [x, self.constant(phase_weights(weights, strides, group), f"{w}_phases")]
        if len(node.inputs) > 2 and node.inputs[2]:
            bias = np.asarray(self.constants[node.inputs[2]])
            inputs.append(self.constant(np.repeat(bias, phases), f"{node.inputs[2]}_phases"))
        base = node.name
        conv = self.emit(
            "Conv",
            base,
            inputs,
            {
                "kernel_shape": tuple(taps),
                "strides": (1,) * nsp,
                "dilations": (1,) * nsp,
                "pads": tuple(conv_pads),
                "group": group,
            },
        )
        lengths = self.types[conv].shape[2:]
        n = x_type.shape[0]
        split = self.emit("Reshape", base, [conv], {"shape": (n, out_channels, *strides, *lengths)})
        perm = (0, 1, *itertools.chain.from_iterable((2 + nsp + i, 2 + i) for i in range(nsp)))
        woven = self.emit("Transpose", base, [split], {"perm": perm})
        full = [length * s for length, s in zip(lengths, strides, strict=True)]
        merged_shape = (n, out_channels, *full)
        begins = pads[:nsp]
        crop = any(b or f != b + o for b, f, o in zip(begins, full, out_spatial, strict=True))
        output = node.outputs[0]
        merged = self.emit(
            "Reshape", base, [woven], {"shape": merged_shape}, None if crop else output
        )
        if crop:
            self.emit(
                "Slice",
                base,
                [merged],
                {
                    "starts": tuple(begins),
                    "ends": tuple(b + o for b, o in zip(begins, out_spatial, strict=True)),
                    "axes": tuple(range(2, 2 + nsp)),
                    "steps": (1,) * nsp,
                },
                output,
            )


def run(graph: Graph) -> Graph:
    if not any(_eligible(graph, node) for node in graph.nodes):
        return graph
    rewriter = _Rewriter(graph)
    for node in graph.nodes:
        if _eligible(graph, node):
            rewriter.lower(node)
        else:
            rewriter.nodes.append(node)
    return graph.replace(
        nodes=tuple(rewriter.nodes), types=rewriter.types, constants=rewriter.constants
    )
