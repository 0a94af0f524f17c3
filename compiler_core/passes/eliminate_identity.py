"""Identity elimination: uses of an Identity's output read its input instead.

Also removes operators that are identities for their static attributes: a Reshape to the same
shape, a Transpose by the identity permutation, a Cast to the same type, a one-input Concat.
"""

from __future__ import annotations

from compiler_core.graph.ir import Graph, Node
from compiler_core.passes.rewrite import forward_values

NAME = "eliminate_identity"


def is_identity(graph: Graph, node: Node) -> bool:
    if len(node.outputs) != 1 or not node.inputs or not node.inputs[0]:
        return False
    source, result = graph.types[node.inputs[0]], graph.types[node.outputs[0]]
    if source != result:
        return False
    if node.op in ("Identity", "Reshape", "Cast", "Expand", "Tile", "Pad"):
        return node.op != "Pad" or not any(node.attr("pads"))
    if node.op == "Transpose":
        return tuple(node.attr("perm")) == tuple(range(source.rank))
    if node.op in ("Concat", "Sum", "Max", "Min", "Mean"):
        return len(node.inputs) == 1
    return False


def run(graph: Graph) -> Graph:
    forward = {}
    kept = []
    for node in graph.nodes:
        if is_identity(graph, node):
            forward[node.outputs[0]] = node.inputs[0]
        else:
            kept.append(node)
    if not forward:
        return graph
    return forward_values(graph, kept, forward)
