"""A 1x1 convolution the layout pass left on plain data becomes a MatMul over its pixels.

The layout pass blocks a conv's channels into vector registers when its groups fill whole
blocks. ShuffleNet v1's grouped 1x1 convs (groups of 28, 34, 68 or 136 channels; 16-lane
blocks) do not, and stay on plain NCHW data, where the conv kernel vectorizes over output
channels: each group is padded to whole blocks (34 computes 48) and every vector it stores
is scattered over 16 channel planes. Yet a pointwise conv of plain data is a GEMM whose
columns are contiguous: per group g, out[g] [mg, H*W] = W[g] [mg, cg] x x[g] [cg, H*W].
Here it is written as one: Reshape the data to [N, G, cg, H*W] (a view), a MatMul by the
filters as a constant [G, mg, cg], the bias as an Add of [G, mg, 1], and a Reshape back
(a view). The dense template then broadcasts filter values against pixel vectors, loads the
data rows with unit stride and stores the plain output row by row, with no padded lanes.

Measured on Zen 5 (2 threads, kernels alone): ShuffleNet's g4 convs 24 -> 112 channels at
56 x 56, 136 -> 136 at 28 x 28, 272 -> 272 at 14 x 14, 544 -> 544 at 7 x 7 ran 70 / 62 /
50 / 54 us as plain convs (ONNX Runtime 36 / 32 / 27 / 27 us), 15 / 18 / 18 / 24 us as
MatMuls.

Taken: float32 1-, 2- or 3-D Convs on plain data and output with constant weights (and
bias), a 1x1 kernel, stride 1, no padding, and a reduction of at least `MIN_REDUCTION`
channels a group (a depthwise 1x1 conv, a per-channel scale, gains nothing from a GEMM).
The pass runs after the layout pass and only for CPU targets (`pipeline`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from compiler_core.graph.ir import Graph, Node, TensorType
from compiler_core.graph.ops.nn import conv_layouts, spatial_params
from compiler_core.passes.rewrite import Decomposition

NAME = "pointwise_matmul"
# The fewest input channels a group that a GEMM reduction is worth (a shorter one leaves the
# kernel loading and storing more than it multiplies).
MIN_REDUCTION = 4


def is_pointwise(node: Node, types: Mapping[str, TensorType]) -> bool:
    """Whether Conv `node` is a 1x1, stride-1, unpadded conv (its pixels a GEMM's columns)."""
    pads, strides, _ = spatial_params(node, types[node.inputs[0]].rank - 2)
    kernel = types[node.inputs[1]].shape[2:]
    return set(kernel) == {1} and set(strides) == {1} and not any(pads)


class _PointwiseAsMatMul(Decomposition):
    def takes(self, node: Node) -> bool:
        if node.op != "Conv" or any(conv_layouts(node)):
            return False
        x, w = (self.types[v] for v in node.inputs[:2])
        if x.dtype != "float32" or not 3 <= x.rank <= 5 or node.inputs[1] not in self.constants:
            return False
        bias = node.inputs[2] if len(node.inputs) > 2 else ""
        if bias and bias not in self.constants:
            return False
        return is_pointwise(node, self.types) and w.shape[1] >= MIN_REDUCTION

    def decompose(self, node: Node) -> None:
        x_type, w_type = (self.types[v] for v in node.inputs[:2])
        out = node.outputs[0]
        batch, _, *spatial = x_type.shape
        group = node.attr("group", 1)
        filters, per_group = w_type.shape[0], w_type.shape[1]
        pixels = math.prod(spatial)
        # [N, G, cg, P] with the leading 1s dropped: a batch-1 ungrouped conv is a 2-D GEMM.
        lead = tuple(d for d in (batch, group) if d != 1)
        weights = self.constants[node.inputs[1]].reshape(group, filters // group, per_group)
        weights = weights[0] if group == 1 else weights
        shape = (*lead, per_group, pixels)
        data = self.emit("Reshape", f"{node.name}_columns", [node.inputs[0]], shape=shape)
        product = self.emit(
            "MatMul", f"{node.name}_gemm", [self.constant(weights, f"{node.inputs[1]}_rows"), data]
        )
        if len(node.inputs) > 2 and node.inputs[2]:
            bias = self.constants[node.inputs[2]].reshape(weights.shape[:-1] + (1,))
            product = self.emit(
                "Add", f"{node.name}_bias", [product, self.constant(bias, node.inputs[2])]
            )
        self.emit("Reshape", node.name, [product], output=out, shape=tuple(self.types[out].shape))


def run(graph: Graph) -> Graph:
    return _PointwiseAsMatMul(graph).run()
