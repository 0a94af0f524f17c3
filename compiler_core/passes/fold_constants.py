"""Constant folding: evaluate every node whose inputs are all known at compile time.

Shape and Size are known from types alone, so the exporter's shape arithmetic
(Shape -> Gather -> Concat -> Reshape) folds even when the data itself is an input.
"""

from __future__ import annotations

import numpy as np

from compiler_core.graph.ir import Graph
from compiler_core.graph.ops import OP_TABLE

# Folding that would materialize a huge tensor (an Expand of a scalar, say) is left to run time.
MAX_FOLDED_BYTES = 256 << 20
NAME = "fold_constants"


def run(graph: Graph) -> Graph:
    constants = dict(graph.constants)
    nodes = []
    for node in graph.nodes:
        opdef = OP_TABLE[node.op]
        out_types = [graph.types[o] for o in node.outputs if o]
        foldable = all(not name or name in constants for name in node.inputs)
        if sum(t.nbytes for t in out_types) > MAX_FOLDED_BYTES:
            foldable = False
        if opdef.from_types is not None:
            values = opdef.from_types(node, [graph.types[i] for i in node.inputs if i])
        elif foldable and node.op != "Identity":
            inputs = [constants[name] if name else None for name in node.inputs]
            with np.errstate(all="ignore"):
                values = opdef.compute(node, inputs)
        else:
            nodes.append(node)
            continue
        for name, value in zip(node.outputs, values, strict=False):
            if name:
                constants[name] = np.asarray(value).astype(graph.types[name].dtype, copy=False)
    return graph.replace(nodes=tuple(nodes), constants=constants)
