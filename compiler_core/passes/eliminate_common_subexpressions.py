"""Common-subexpression elimination: identical nodes on identical inputs compute once.

Constants with equal content are merged first, so two copies of one weight count as equal.
"""

from __future__ import annotations

from compiler_core.graph.ir import Graph, _array_digest
from compiler_core.passes.rewrite import forward_values, rename_inputs

NAME = "eliminate_common_subexpressions"
# Large constants are compared by content too; hashing them is linear and done once per pass.


def _merge_constants(graph: Graph) -> dict[str, str]:
    first_by_digest: dict[str, str] = {}
    forward = {}
    for name in sorted(graph.constants):
        digest = _array_digest(graph.constants[name])
        if digest in first_by_digest:
            forward[name] = first_by_digest[digest]
        else:
            first_by_digest[digest] = name
    return forward


def run(graph: Graph) -> Graph:
    forward = {k: v for k, v in _merge_constants(graph).items() if k not in graph.outputs}
    seen: dict[tuple, tuple[str, ...]] = {}
    kept = []
    for node in graph.nodes:
        node = rename_inputs(node, forward)
        previous = seen.get(node.signature)
        if previous is None:
            seen[node.signature] = node.outputs
            kept.append(node)
            continue
        for old, new in zip(node.outputs, previous, strict=True):
            if old:
                forward[old] = new
    if not forward:
        return graph
    return forward_values(graph, kept, forward)
