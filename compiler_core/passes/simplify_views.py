"""View simplification: the data-movement ops an exporter leaves around heavy ops.

- Reshape of Reshape composes; so does Transpose of Transpose (perms composed).
- A Transpose that moves only axes of size 1 keeps every element where it was: a Reshape.
  (PyTorch's batch-first attention swaps the batch and sequence axes of [1, S, E] tensors.)
- A Reshape sinks below an elementwise op whose other operand is a constant laid along
  axes the Reshape keeps: `Add(Reshape(x), bias)` becomes `Reshape(Add(x, bias))`, so the
  bias joins the epilogue of the GEMM or conv that wrote `x` (a batched MatMul is a GEMM
  between two Reshapes since import).

Each rewrite keeps the graph's function; the pass repeats until none applies.
"""

from __future__ import annotations

import numpy as np

from compiler_core.graph.ir import Graph, Node, OpKind, TensorType
from compiler_core.graph.ops import OP_TABLE
from compiler_core.passes.rewrite import Rewrite, forward_values

NAME = "simplify_views"
# Binary ops that commute with a reshape of one operand when the other lies along kept axes.
ELEMENTWISE_BINARY = ("Add", "Sub", "Mul", "Div")
MAX_ROUNDS = 32  # each round shortens a chain or moves a Reshape down; real graphs settle in a few


class _Round(Rewrite):
    """One sweep over the nodes; `changed` says whether any rule fired."""

    def __init__(self, graph: Graph):
        super().__init__(graph)
        self.nodes: list[Node] = []
        self.forward: dict[str, str] = {}
        self.changed = False

    def result(self) -> Graph:
        graph = self.graph.replace(
            nodes=tuple(self.nodes), types=self.types, constants=self.constants
        )
        return forward_values(graph, graph.nodes, self.forward) if self.forward else graph


def _reshape(name: str, source: str, output: str, shape) -> Node:
    return Node("Reshape", name, (source,), (output,), {"shape": tuple(int(d) for d in shape)})


def _compose_reshape(rw: _Round, node: Node) -> list[Node] | None:
    producer = rw.graph.producers.get(node.inputs[0])
    if producer is None or producer.op != "Reshape":
        return None
    return [node.replace(inputs=(producer.inputs[0],))]


def _compose_transpose(rw: _Round, node: Node) -> list[Node] | None:
    producer = rw.graph.producers.get(node.inputs[0])
    if producer is None or producer.op != "Transpose":
        return None
    inner, outer = producer.attr("perm"), node.attr("perm")
    return [
        node.replace(inputs=(producer.inputs[0],), attrs={"perm": tuple(inner[p] for p in outer)})
    ]


def _transpose_as_reshape(rw: _Round, node: Node) -> list[Node] | None:
    """A Transpose whose axes longer than 1 keep their order moves no element."""
    shape = rw.types[node.inputs[0]].shape
    moved = [axis for axis in node.attr("perm") if shape[axis] != 1]
    if moved != sorted(moved):
        return None
    out_shape = rw.types[node.outputs[0]].shape
    return [_reshape(node.name, node.inputs[0], node.outputs[0], out_shape)]


def _kept_suffix(source: tuple[int, ...], reshaped: tuple[int, ...]) -> int:
    """How many trailing axes a reshape from `source` to `reshaped` leaves as they were."""
    kept = 0
    while kept < min(len(source), len(reshaped)) and source[-1 - kept] == reshaped[-1 - kept]:
        kept += 1
    return kept


def _constant_along_kept_axes(rw: _Round, other: str, source: TensorType, out: TensorType):
    """A constant operand reshaped for `source` (its leading axes of size 1 dropped), if it
    varies only along trailing axes that the reshape from `source` to `out` keeps."""
    constant = np.asarray(rw.constants[other])
    trailing = list(constant.shape)
    while trailing and trailing[0] == 1:
        trailing.pop(0)
    if len(trailing) > _kept_suffix(source.shape, out.shape):
        return None
    if trailing and tuple(trailing) != tuple(source.shape[-len(trailing) :]):
        return None  # it broadcasts inside a kept axis
    return constant.reshape(trailing)


def _written_by_anchor(rw: _Round, value: str) -> bool:
    """Whether a GEMM, MatMul or conv writes `value`: an op that takes elementwise epilogues.
    (Sinking toward it only: the residual's side must not pull the Reshape back.)"""
    producer = rw.graph.producers.get(value)
    return producer is not None and OP_TABLE[producer.op].kind == OpKind.OUT_ELEMWISE_FUSABLE


def _sink_reshape(rw: _Round, node: Node) -> list[Node] | None:
    """op(Reshape(x), y) -> Reshape(op(x, y')) where y' is y laid out like x: for a constant
    `y` that varies only along the trailing axes the Reshape keeps (a bias), or a `y` of the
    result's whole shape where a GEMM or conv wrote x (a residual, reshaped like x). The op
    then joins the epilogue of whatever wrote x."""
    if len(node.inputs) != 2:
        return None
    for position, value in enumerate(node.inputs):
        producer = rw.graph.producers.get(value)
        if producer is None or producer.op != "Reshape" or not rw.single_consumer(value):
            continue
        other, source = node.inputs[1 - position], producer.inputs[0]
        source_type, out_type = rw.types[source], rw.types[node.outputs[0]]
        if out_type.shape != rw.types[value].shape or source_type.dtype != out_type.dtype:
            continue
        added: list[Node] = []
        if other in rw.constants:
            constant = _constant_along_kept_axes(rw, other, source_type, out_type)
            if constant is None:
                continue
            laid_out = rw.fresh(f"{other}_as_{constant.ndim}d")
            rw.constants[laid_out] = constant
            rw.types[laid_out] = TensorType.of(constant)
        elif rw.types[other].shape == out_type.shape and _written_by_anchor(rw, source):
            laid_out = rw.fresh(f"{other}_reshaped")
            rw.types[laid_out] = TensorType(source_type.shape, rw.types[other].dtype)
            added.append(
                _reshape(rw.fresh(f"{node.name}_operand"), other, laid_out, source_type.shape)
            )
        else:
            continue
        inner = rw.fresh(f"{node.outputs[0]}_unreshaped")
        rw.types[inner] = TensorType(source_type.shape, out_type.dtype)
        operands = [source, laid_out] if position == 0 else [laid_out, source]
        return [
            *added,
            node.replace(inputs=tuple(operands), outputs=(inner,)),
            _reshape(rw.fresh(f"{node.name}_reshape"), inner, node.outputs[0], out_type.shape),
        ]
    return None


# op -> the rules tried on a node of that op, in order; the first that applies rewrites it.
RULES = {
    "Reshape": (_compose_reshape,),
    "Transpose": (_compose_transpose, _transpose_as_reshape),
    **{op: (_sink_reshape,) for op in ELEMENTWISE_BINARY},
}


def _sweep(graph: Graph) -> tuple[Graph, bool]:
    rw = _Round(graph)
    for node in graph.nodes:
        # Rules read the round's input graph and remove no value, so the rewrites of one
        # round stay valid together; a chain they shorten is looked at again next round.
        replacement = None
        for rule in RULES.get(node.op, ()):
            replacement = rule(rw, node)
            if replacement is not None:
                rw.changed = True
                break
        rw.nodes.extend(replacement if replacement is not None else [node])
    return (rw.result(), True) if rw.changed else (graph, False)


def run(graph: Graph) -> Graph:
    for _ in range(MAX_ROUNDS):
        graph, changed = _sweep(graph)
        if not changed:
            break
    return graph
