"""View simplification: the data-movement ops an exporter leaves around heavy ops.

- Reshape of Reshape composes; so does Transpose of Transpose (perms composed).
- A Transpose that moves only axes of size 1 keeps every element where it was: a Reshape.
  (PyTorch's batch-first attention swaps the batch and sequence axes of [1, S, E] tensors.)
- A Reshape sinks below the row-wise op that reads it, so that it ends up where it meets its
  inverse (and both go) or a graph output: below an elementwise op whose other operands can be
  laid out like the Reshape's source (a bias along kept axes, a residual reshaped the same
  way, or a residual of the result's shape where a GEMM wrote the source: `Add(Reshape(g),
  bias)` becomes `Reshape(Add(g, bias))`, and the Add joins the GEMM's epilogue), below a
  LayerNorm or Softmax whose normalized axes it keeps, and below a MatMul of a matrix by a
  matrix. PyTorch's encoder layers, exported as [1, S, E] tensors around 2-D GEMMs (a batched
  MatMul is a GEMM between two Reshapes since import), then run on [S, E] end to end.

Each rewrite keeps the graph's function; the pass repeats until none applies.
"""

from __future__ import annotations

import numpy as np

from compiler_core.graph.ir import Graph, Node, OpKind, TensorType
from compiler_core.graph.ops import OP_TABLE
from compiler_core.graph.ops.base import normalize_axis
from compiler_core.passes import eliminate_dead_code
from compiler_core.passes.rewrite import Rewrite, is_elementwise, reshape_node

NAME = "simplify_views"
MAX_ROUNDS = 32  # each round shortens a chain or moves a Reshape down; real graphs settle in a few


class _Round(Rewrite):
    """One sweep over the nodes; `changed` says whether any rule fired."""

    def __init__(self, graph: Graph):
        super().__init__(graph)
        self.nodes: list[Node] = []
        self.changed = False

    def result(self) -> Graph:
        return self.graph.replace(
            nodes=tuple(self.nodes), types=self.types, constants=self.constants
        )


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
    return [reshape_node(node.name, node.inputs[0], node.outputs[0], out_shape)]


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
    """Whether a GEMM, MatMul or conv writes `value`: an op that takes elementwise epilogues."""
    producer = rw.graph.producers.get(value)
    return producer is not None and OP_TABLE[producer.op].kind == OpKind.OUT_ELEMWISE_FUSABLE


def _laid_out(rw: _Round, node: Node, position: int, source: TensorType, out: TensorType):
    """The operands of elementwise `node` with its Reshape at `position` replaced by the
    Reshape's source and every other operand laid out like that source, plus the nodes that
    takes; None where an operand cannot be: a constant must vary only along the trailing axes
    the Reshape keeps (a bias), a value must be a Reshape of the same shape (a residual that
    was reshaped too) or, where a GEMM or conv wrote the source and none wrote the value, of
    the result's whole shape (reshaped like the source: the op joins that GEMM's epilogue)."""
    operands, added = [], []
    sunk = rw.graph.producers[node.inputs[position]].inputs[0]
    for k, value in enumerate(node.inputs):
        if k == position:
            operands.append(sunk)
        elif not value:
            operands.append(value)
        elif value in rw.constants:
            constant = _constant_along_kept_axes(rw, value, source, out)
            if constant is None:
                return None, []
            operands.append(rw.constant(constant, f"{value}_as_{constant.ndim}d"))
        elif (
            (reshaped := _reshaped_input(rw, value))
            and rw.types[reshaped].shape == source.shape
            and rw.types[value].shape == out.shape
        ):
            operands.append(reshaped)
        elif (
            rw.types[value].shape == out.shape
            and _written_by_anchor(rw, sunk)
            and not _written_by_anchor(rw, value)  # else the other side's pulls it back
        ):
            laid_out = rw.fresh(f"{value}_reshaped")
            rw.types[laid_out] = TensorType(source.shape, rw.types[value].dtype)
            added.append(
                reshape_node(rw.fresh(f"{node.name}_operand"), value, laid_out, source.shape)
            )
            operands.append(laid_out)
        else:
            return None, []
    return operands, added


def _reshaped_input(rw: _Round, value: str) -> str | None:
    """The source of the Reshape that writes `value`. Its other readers, if any, keep reading
    the Reshape until they sink it too (a view costs nothing to keep for them)."""
    producer = rw.graph.producers.get(value)
    if producer is None or producer.op != "Reshape" or value in rw.graph.outputs:
        return None
    return producer.inputs[0]


def _below(rw: _Round, node: Node, inputs, shape, **attrs) -> list[Node]:
    """`node` on `inputs` (laid out like a Reshape's source), writing `shape`, then a Reshape
    to its old output."""
    result = rw.types[node.outputs[0]]
    inner = rw.fresh(f"{node.outputs[0]}_unreshaped")
    rw.types[inner] = TensorType(tuple(shape), result.dtype)
    moved = node.replace(inputs=tuple(inputs), outputs=(inner, *node.outputs[1:]))
    if attrs:
        moved = moved.replace(attrs={**dict(moved.attrs), **attrs})
    reshape = reshape_node(rw.fresh(f"{node.name}_reshape"), inner, node.outputs[0], result.shape)
    return [moved, reshape]


def _sink_reshape(rw: _Round, node: Node) -> list[Node] | None:
    """op(Reshape(x), y, ...) -> Reshape(op(x, y', ...)) for an elementwise op whose other
    operands can be laid out like x (see `_laid_out`): the op then joins the epilogue of
    whatever wrote x, and a chain of such ops carries the Reshape to its end."""
    if not is_elementwise(node.op) or len(node.outputs) != 1:
        return None
    out = rw.types[node.outputs[0]]
    for position, value in enumerate(node.inputs):
        source = _reshaped_input(rw, value) if value else None
        if source is None or out.shape != rw.types[value].shape:
            continue
        operands, added = _laid_out(rw, node, position, rw.types[source], out)
        if operands is not None:
            return [*added, *_below(rw, node, operands, rw.types[source].shape)]
    return None


def _sink_into_rows(rw: _Round, node: Node) -> list[Node] | None:
    """LayerNorm(Reshape(x)) -> Reshape(LayerNorm(x)) when the Reshape keeps the normalized
    trailing axes (Softmax likewise along its last axis)."""
    source = _reshaped_input(rw, node.inputs[0])
    if source is None or any(node.outputs[1:]):
        return None
    shape, kept = rw.types[node.inputs[0]].shape, rw.types[source].shape
    axis = normalize_axis(int(node.attr("axis", -1)), len(shape), node)
    if node.op != "LayerNormalization" and axis != len(shape) - 1:
        return None
    normalized = len(shape) - axis
    if _kept_suffix(kept, shape) < normalized:
        return None
    inputs = (source, *node.inputs[1:])
    return _below(rw, node, inputs, kept, axis=len(kept) - normalized)


def _sink_into_matmul(rw: _Round, node: Node) -> list[Node] | None:
    """MatMul(Reshape(x), B) -> Reshape(MatMul(x, B)) for a matrix x and a matrix B: rows of
    x in, rows out, one GEMM (never a batch of one-row products)."""
    source = _reshaped_input(rw, node.inputs[0])
    if source is None or rw.types[source].rank != 2 or rw.types[node.inputs[1]].rank != 2:
        return None
    if rw.types[source].shape[-1] != rw.types[node.inputs[0]].shape[-1]:
        return None
    rows, columns = rw.types[source].shape[0], rw.types[node.outputs[0]].shape[-1]
    return _below(rw, node, (source, node.inputs[1]), (rows, columns))


# op -> the rules tried on a node of that op, in order; the first that applies rewrites it
# (every elementwise op: `_sink_reshape`).
RULES = {
    "Reshape": (_compose_reshape,),
    "Transpose": (_compose_transpose, _transpose_as_reshape),
    "LayerNormalization": (_sink_into_rows,),
    "Softmax": (_sink_into_rows,),
    "LogSoftmax": (_sink_into_rows,),
    "MatMul": (_sink_into_matmul,),
}


def _sweep(graph: Graph) -> tuple[Graph, bool]:
    rw = _Round(graph)
    for node in graph.nodes:
        # Rules read the round's input graph and remove no value, so the rewrites of one
        # round stay valid together; a chain they shorten is looked at again next round.
        replacement = None
        for rule in RULES.get(node.op, (_sink_reshape,) if is_elementwise(node.op) else ()):
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
    return eliminate_dead_code.run(graph)  # the views the rewrites left unread
