"""Split a GEMM by the column ranges its readers take, where one of them reads fewer rows.

A transformer's fused QKV projection computes queries, keys and values in one GEMM, [M, K] x
[K, 3d] (+ a bias along the columns), and its readers each take one column range through a
view chain (Reshape, Transpose, Gather of a constant index). When a classifier reads one
token of the last layer, `hoist_gathers` carries that row up to the queries' view chain and
stops at the projection, which the keys and values read whole. Here such a GEMM becomes one
GEMM per column range (its columns of the weights and the bias), and each reader's view
chain, up to where it is a plain reshape of its range, becomes a Reshape of that GEMM; the
next `hoist_gathers` then moves the row Gather above the queries' GEMM, which computes one
row instead of M (encoder4's last QKV projection: 2/3 of its FLOPs).

Which columns and rows a view chain reads is found by running it (the ops' own numpy
definitions) on the flat indices of the GEMM's output, so every view op the graph knows is
covered, and a chain that does anything else is left alone. A GEMM whose readers all take
every row stays whole: one GEMM is as fast as its three parts.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from compiler_core.graph.ir import Graph, Node, TensorType
from compiler_core.graph.ops import OP_TABLE
from compiler_core.passes import eliminate_dead_code
from compiler_core.passes.rewrite import Rewrite, reshape_node

NAME = "split_gemm_columns"
VIEW_OPS = ("Reshape", "Transpose", "Gather", "Squeeze", "Unsqueeze", "Flatten", "Identity")
# Outputs up to this many elements are traced (16 MB of int32 indices): a transformer's QKV
# projection over 512 tokens of 1024 channels is 1.6 M.
MAX_TRACED = 1 << 22


@dataclasses.dataclass(frozen=True)
class _Cut:
    """A view node whose output is a reshape of columns [start, stop) of every row of the
    GEMM's output: it becomes a Reshape of that range's GEMM."""

    node: Node
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class _Gemm:
    matmul: Node
    bias: Node | None  # an Add of a constant along the columns
    output: str  # the value the readers read: the bias Add's output, else the MatMul's


def _gemm(rw: Rewrite, node: Node) -> _Gemm | None:
    """`node` as a 2-D MatMul by a constant matrix, with the bias Add that follows it."""
    if node.op != "MatMul" or len(node.inputs) != 2 or node.inputs[1] not in rw.constants:
        return None
    a, b = (rw.types[v] for v in node.inputs)
    if a.rank != 2 or b.rank != 2:
        return None
    output = node.outputs[0]
    readers = rw.graph.consumers.get(output, ())
    if len(readers) == 1 and rw.single_consumer(output):
        add = readers[0]
        other = next((v for v in add.inputs if v != output), None)
        is_bias = add.op == "Add" and len(add.inputs) == 2 and other in rw.constants
        if is_bias and rw.constants[other].shape in ((b.shape[1],), (1, b.shape[1])):
            return _Gemm(node, add, add.outputs[0])
    return _Gemm(node, None, output)


def _column_range(index: np.ndarray, rows: int, columns: int) -> tuple[int, int] | None:
    """(start, stop) where `index` (flat indices into a [rows, columns] matrix) holds the
    columns start..stop of every row in order: a reshape of that column range."""
    flat = index.ravel()
    if flat.size == 0 or flat.size % rows:
        return None
    start = int(flat[0] % columns)
    stop = start + flat.size // rows
    expected = (np.arange(rows)[:, None] * columns + np.arange(start, stop)[None, :]).ravel()
    return (start, stop) if stop <= columns and np.array_equal(flat, expected) else None


def _cuts(rw: Rewrite, source: str, rows: int, columns: int) -> tuple[list[_Cut], bool] | None:
    """Where the view chains from `source` each reach one column range (the first view node
    of each path whose output is one), and whether any view below reads fewer rows; None when
    a path reaches anything else (an op, a graph output) before a column range."""
    cuts: list[_Cut] = []
    fewer_rows = False
    start = np.arange(rows * columns, dtype=np.int32).reshape(rows, columns)
    pending = [(source, start, False)]  # (value, its flat indices, below a cut)
    while pending:
        value, index, cut = pending.pop()
        if len(np.unique(index // columns)) < rows:
            fewer_rows = True
        if value in rw.graph.outputs and not cut:
            return None
        for node in rw.graph.consumers.get(value, ()):
            viewed = _viewed(rw, node, value, index)
            if viewed is None:
                if cut:
                    continue  # what reads a range's rows is its own business
                return None
            found = None if cut else _column_range(viewed, rows, columns)
            narrower = found is not None and found != (0, columns)
            if narrower:
                cuts.append(_Cut(node, *found))
            pending.append((node.outputs[0], viewed, cut or narrower))
    return cuts, fewer_rows


def _viewed(rw: Rewrite, node: Node, value: str, index: np.ndarray) -> np.ndarray | None:
    """`index` through the view op `node` (which reads `value` first), or None when `node`
    is not one (or takes a non-constant operand)."""
    if node.op not in VIEW_OPS or node.inputs[0] != value:
        return None
    if any(v not in rw.constants for v in node.inputs[1:] if v):
        return None
    args = [index, *(rw.constants[v] if v else None for v in node.inputs[1:])]
    return np.asarray(OP_TABLE[node.op].compute(node, args)[0])


def _split(rw: Rewrite, gemm: _Gemm) -> tuple[list[Node], dict[str, list[Node]]] | None:
    """(the nodes that replace the GEMM, and the Reshape of its range's GEMM that replaces
    each cut node, by name), or None where the GEMM stays whole. The view nodes above the
    cuts are left to dead-code elimination."""
    rows, columns = rw.types[gemm.output].shape
    readers = rw.graph.consumers.get(gemm.output, ())
    if rows * columns > MAX_TRACED or not all(r.op in VIEW_OPS for r in readers):
        return None
    found = _cuts(rw, gemm.output, rows, columns)
    if found is None:
        return None
    cuts, fewer_rows = found
    ranges = sorted({(c.start, c.stop) for c in cuts})
    if len(ranges) < 2 or not fewer_rows:
        return None
    a, weights = gemm.matmul.inputs
    bias = None
    if gemm.bias is not None:
        bias = next(v for v in gemm.bias.inputs if v != gemm.matmul.outputs[0])
    parts, produced = [], {}
    for start, stop in ranges:
        produced[start, stop] = _part(rw, gemm, a, weights, bias, start, stop, parts)
    replaced = {}
    for cut in cuts:
        out = cut.node.outputs[0]
        source = produced[cut.start, cut.stop]
        shape = rw.types[out].shape
        replaced[cut.node.name] = [reshape_node(rw.fresh(cut.node.name), source, out, shape)]
    return parts, replaced


def _part(rw: Rewrite, gemm: _Gemm, a: str, weights: str, bias, start, stop, parts) -> str:
    """Add the GEMM of columns start..stop (and its bias) to `parts`; its output."""
    name = gemm.matmul.name
    dtype = rw.types[gemm.output].dtype
    rows = rw.types[gemm.output].shape[0]
    columns = np.ascontiguousarray(rw.constants[weights][:, start:stop])
    w = rw.constant(columns, f"{weights}_cols_{start}")
    product = rw.fresh(f"{gemm.matmul.outputs[0]}_cols_{start}")
    rw.types[product] = TensorType((rows, stop - start), dtype)
    parts.append(Node("MatMul", rw.fresh(f"{name}_cols_{start}"), (a, w), (product,)))
    if bias is None:
        return product
    b = rw.constants[bias]
    b = rw.constant(np.ascontiguousarray(b[..., start:stop]), f"{bias}_cols_{start}")
    out = rw.fresh(f"{gemm.output}_cols_{start}")
    rw.types[out] = TensorType((rows, stop - start), dtype)
    parts.append(Node("Add", rw.fresh(f"{gemm.bias.name}_cols_{start}"), (product, b), (out,)))
    return out


def run(graph: Graph) -> Graph:
    rw = Rewrite(graph)
    replaced: dict[str, list[Node]] = {}
    for node in graph.nodes:
        gemm = _gemm(rw, node)
        if gemm is None or node.name in replaced:
            continue
        split = _split(rw, gemm)
        if split is None:
            continue
        parts, readers = split
        replaced[node.name] = parts
        if gemm.bias is not None:
            replaced[gemm.bias.name] = []
        replaced.update(readers)
    if not replaced:
        return graph
    nodes = [new for node in graph.nodes for new in replaced.get(node.name, [node])]
    split = graph.replace(nodes=tuple(nodes), types=rw.types, constants=rw.constants)
    return eliminate_dead_code.run(split)  # the view nodes above the cuts read nothing now
