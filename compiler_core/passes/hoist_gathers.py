"""Compute only the rows a Gather keeps: move a Gather of constant indices above the ops that
produce its input, one op at a time, while each op's rows along the gathered axis depend on
the same rows of its inputs only.

A BERT-style classifier reads one token of its encoder's last layer (`Gather(h, 0,
axis=1)`): every op of that layer after its attention (the output projection, the residual
Adds, both LayerNorms, the feed-forward GEMMs and their activation), and the attention's
queries, softmax and weighted sum, then run on that one row instead of all of them.

The Gather moves through
- elementwise ops (numpy broadcasting: an operand that broadcasts along the axis stays whole),
- LayerNormalization and Softmax-like ops, along an axis before those they normalize,
- MatMul (the rows of A, or a batch axis of both) and Gemm (the rows of A, and of C when
  it has them),
- Transpose (the axis it came from) and a Reshape that keeps the axis with what comes
  before it (the same count of rows before the axis).
It stops at a value that anything else reads. A scalar index (which drops the axis) is
first split into a one-element Gather and a Reshape that drops the axis, so ranks stay put
while the Gather moves. A Slice that keeps part of one axis (a token picked as `x[:, :1]`
or `x[:, -1:]`) moves as the Gather of the rows it keeps; one that cannot move stays a
Slice.
"""

from __future__ import annotations

import math

import numpy as np

from compiler_core.graph.ir import Graph, Node, TensorType
from compiler_core.graph.ops import OP_TABLE
from compiler_core.graph.ops.base import normalize_axis
from compiler_core.graph.ops.tensor import slice_objects
from compiler_core.passes import eliminate_common_subexpressions, eliminate_dead_code
from compiler_core.passes.rewrite import Rewrite, is_elementwise, reshape_node

NAME = "hoist_gathers"
ROW_NORMALIZERS = ("LayerNormalization",)  # normalize axes axis.. end
ONE_AXIS_NORMALIZERS = ("Softmax", "LogSoftmax", "Hardmax")  # along `axis` alone
MAX_ROUNDS = 256  # each round moves every movable Gather up one op


class _Round(Rewrite):
    def gather(self, value: str, indices: str, axis: int, prefix: str) -> tuple[Node, str]:
        """A Gather of `value`'s `axis` at `indices` (one-dimensional), and its output."""
        out = self.fresh(f"{value}_rows")
        shape = list(self.types[value].shape)
        shape[axis] = int(self.constants[indices].size)
        self.types[out] = TensorType(tuple(shape), self.types[value].dtype)
        node = Node("Gather", self.fresh(prefix), (value, indices), (out,), {"axis": axis})
        return node, out

    def retyped(self, node: Node, inputs: tuple[str, ...], output: str, **attrs) -> Node:
        """`node` on new inputs, writing `output` (typed by the op's own rule)."""
        new = node.replace(name=self.fresh(node.name), inputs=inputs, outputs=(output,))
        if attrs:
            new = new.replace(attrs={**dict(new.attrs), **attrs})
        in_types = [self.types[v] if v else None for v in inputs]
        self.types[output] = OP_TABLE[node.op].infer(new, in_types)[0]
        return new


def _axis(node: Node, rank: int, default: int) -> int:
    return normalize_axis(int(node.attr("axis", default)), rank, node)


def _one_dimensional(rw: _Round, gather: Node) -> list[Node] | None:
    """Gather(x, scalar i) -> Reshape(Gather(x, [i])): the form that moves."""
    indices = gather.inputs[1]
    listed = rw.constant(rw.constants[indices].reshape(1), f"{indices}_listed")
    data = gather.inputs[0]
    axis = _axis(gather, rw.types[data].rank, 0)
    picked, out = rw.gather(data, listed, axis, gather.name)
    result = gather.outputs[0]
    drop = reshape_node(rw.fresh(f"{gather.name}_drop_axis"), out, result, rw.types[result].shape)
    return [picked, drop]


def _operand_axis(operand: TensorType, out_rank: int, axis: int) -> int | None:
    """The axis of a broadcast operand that lines up with the output's `axis`, or None where
    the operand broadcasts along it (lacks it, or has size 1 there)."""
    own = axis - (out_rank - operand.rank)
    if own < 0 or operand.shape[own] == 1:
        return None
    return own


def _through_elementwise(rw, producer, gather, axis) -> list[Node] | None:
    out_rank = rw.types[producer.outputs[0]].rank
    added, inputs = [], []
    for value in producer.inputs:
        own = _operand_axis(rw.types[value], out_rank, axis) if value else None
        if own is None:
            inputs.append(value)
            continue
        node, picked = rw.gather(value, gather.inputs[1], own, gather.name)
        added.append(node)
        inputs.append(picked)
    return [*added, rw.retyped(producer, tuple(inputs), gather.outputs[0])]


def _through_normalizer(rw, producer, gather, axis) -> list[Node] | None:
    rank = rw.types[producer.inputs[0]].rank
    # Axes before the normalized ones only (older Softmax opsets flatten from `axis` on).
    if axis >= _axis(producer, rank, -1) or any(producer.outputs[1:]):
        return None
    node, picked = rw.gather(producer.inputs[0], gather.inputs[1], axis, gather.name)
    rest = producer.inputs[1:]
    outputs = (gather.outputs[0], *producer.outputs[1:])
    moved = rw.retyped(producer, (picked, *rest), gather.outputs[0])
    return [node, moved.replace(outputs=outputs)]


def _through_matmul(rw, producer, gather, axis) -> list[Node] | None:
    a, b = producer.inputs[:2]
    a_type, b_type = rw.types[a], rw.types[b]
    out_rank = rw.types[producer.outputs[0]].rank
    if a_type.rank < 2 or b_type.rank < 2:
        return None
    if axis == out_rank - 2:  # rows: of A alone
        node, picked = rw.gather(a, gather.inputs[1], a_type.rank - 2, gather.name)
        return [node, rw.retyped(producer, (picked, b), gather.outputs[0])]
    if axis < out_rank - 2:  # a batch axis: of each operand that has it whole
        return _through_elementwise(rw, producer, gather, axis)
    return None


def _through_gemm(rw, producer, gather, axis) -> list[Node] | None:
    if axis != 0 or producer.attr("transA", 0):
        return None
    a, *rest = producer.inputs
    added = []
    node, picked = rw.gather(a, gather.inputs[1], 0, gather.name)
    added.append(node)
    inputs = [picked, rest[0]]
    if len(rest) > 1 and rest[1]:
        c = rest[1]
        own = _operand_axis(rw.types[c], 2, 0)
        if own is not None:
            node, c = rw.gather(c, gather.inputs[1], own, gather.name)
            added.append(node)
        inputs.append(c)
    return [*added, rw.retyped(producer, tuple(inputs), gather.outputs[0])]


def _through_transpose(rw, producer, gather, axis) -> list[Node] | None:
    perm = producer.attr("perm")
    node, picked = rw.gather(producer.inputs[0], gather.inputs[1], perm[axis], gather.name)
    return [node, rw.retyped(producer, (picked,), gather.outputs[0])]


def _through_reshape(rw, producer, gather, axis) -> list[Node] | None:
    source, out = rw.types[producer.inputs[0]].shape, rw.types[producer.outputs[0]].shape
    before = math.prod(out[:axis])
    own = next(
        (
            k
            for k in range(len(source))
            if math.prod(source[:k]) == before and source[k] == out[axis]
        ),
        None,
    )
    if own is None:
        return None
    node, picked = rw.gather(producer.inputs[0], gather.inputs[1], own, gather.name)
    shape = tuple(rw.types[gather.outputs[0]].shape)
    return [node, rw.retyped(producer, (picked,), gather.outputs[0], shape=shape)]


def _through(op: str):
    if is_elementwise(op):
        return _through_elementwise
    if op in ROW_NORMALIZERS or op in ONE_AXIS_NORMALIZERS:
        return _through_normalizer
    return {
        "MatMul": _through_matmul,
        "Gemm": _through_gemm,
        "Transpose": _through_transpose,
        "Reshape": _through_reshape,
    }.get(op)


def _hoisted(rw: _Round, gather: Node) -> list[Node] | None:
    """The nodes that replace `gather` and its input's producer, or None where it stays."""
    data, indices = gather.inputs
    if indices not in rw.constants:
        return None
    producer = rw.graph.producers.get(data)
    if producer is None or not rw.single_consumer(data):
        return None
    move = _through(producer.op)
    if move is None:
        return None
    if rw.constants[indices].ndim == 0:
        return _one_dimensional(rw, gather)  # it moves from the next round on
    return move(rw, producer, gather, _axis(gather, rw.types[data].rank, 0))


def _slice_as_gather(rw: _Round, node: Node) -> Node | None:
    """A Slice that keeps part of one axis (`x[:, :1]`, `x[:, -1:]`, every other row), as
    the Gather of the rows it keeps: the same node name and output, so it moves as one."""
    shape = rw.types[node.inputs[0]].shape
    index = slice_objects(node, shape)
    cut = [
        axis
        for axis, (part, dim) in enumerate(zip(index, shape, strict=True))
        if range(*part.indices(dim)) != range(dim)
    ]
    if len(cut) != 1:
        return None
    axis = cut[0]
    kept = np.arange(shape[axis], dtype=np.int64)[index[axis]]
    if kept.size == 0:
        return None
    indices = rw.constant(kept, f"{node.name}_rows")
    return Node("Gather", node.name, (node.inputs[0], indices), node.outputs, {"axis": axis})


def _sweep(graph: Graph) -> tuple[Graph, bool]:
    rw = _Round(graph)
    replaced: dict[str, list[Node]] = {}  # node name -> what takes its place
    moved_from: set[str] = set()  # producers a Gather moved above (removed)
    for node in graph.nodes:
        if node.name in moved_from:
            continue
        gather = _slice_as_gather(rw, node) if node.op == "Slice" else node
        if gather is None or gather.op != "Gather":
            continue
        producer = graph.producers.get(gather.inputs[0])
        if producer is not None and (producer.name in replaced or producer.name in moved_from):
            continue  # one change per node a round
        new = _hoisted(rw, gather)
        if new is None:
            continue  # a Slice that does not move stays a Slice
        replaced[node.name] = new
        if rw.constants[gather.inputs[1]].ndim != 0 and producer is not None:
            moved_from.add(producer.name)
    if not replaced:
        return graph, False
    nodes = []
    for node in graph.nodes:
        if node.name in moved_from:
            continue
        nodes.extend(replaced.get(node.name, [node]))
    return graph.replace(nodes=tuple(nodes), types=rw.types, constants=rw.constants), True


def run(graph: Graph) -> Graph:
    graph = eliminate_dead_code.run(graph)  # a dead reader must not hold a Gather back
    for _ in range(MAX_ROUNDS):
        graph, changed = _sweep(graph)
        if not changed:
            # Gathers that reached a value from two sides (x and f(x) in x * f(x), GELU's
            # shape) are one Gather: merged, it is the value's sole reader and moves on.
            merged = eliminate_common_subexpressions.run(graph)
            if len(merged.nodes) == len(graph.nodes):
                break
            graph = merged
    return graph
