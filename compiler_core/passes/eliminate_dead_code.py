"""Dead-code elimination: drop nodes none of whose outputs reach a graph output."""

from __future__ import annotations

from compiler_core.graph.ir import Graph

NAME = "eliminate_dead_code"


def run(graph: Graph) -> Graph:
    live = set(graph.outputs)
    kept = []
    for node in reversed(graph.nodes):
        if any(out in live for out in node.outputs):
            kept.append(node)
            live.update(name for name in node.inputs if name)
    return graph.replace(nodes=tuple(reversed(kept)))
