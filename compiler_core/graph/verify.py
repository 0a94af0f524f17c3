"""The graph verifier: small named checks; a failure names the check and prints the graph."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from compiler_core.graph.ir import Graph, TensorType
from compiler_core.graph.ops import OP_TABLE
from compiler_core.graph.printer import format_graph


class VerificationError(ValueError):
    def __init__(self, check: str, problems: list[str], graph: Graph, stage: str):
        listing = "\n".join(f"  - {p}" for p in problems[:20])
        text = format_graph(graph, show_constants=False)
        if len(text) > 20000:
            text = text[:20000] + "\n  ..."
        super().__init__(f"[{stage}] check {check!r} failed:\n{listing}\n{text}")
        self.check = check
        self.problems = problems


Check = Callable[[Graph], Iterator[str]]


def ops_known(graph: Graph) -> Iterator[str]:
    for node in graph.nodes:
        if node.op not in OP_TABLE:
            yield f"node {node.name!r}: unknown operator {node.op!r}"


def single_definition(graph: Graph) -> Iterator[str]:
    seen: set[str] = set()
    defined = list(graph.inputs) + list(graph.constants)
    defined += [o for n in graph.nodes for o in n.outputs if o]
    for name in defined:
        if name in seen:
            yield f"value {name!r} is defined more than once"
        seen.add(name)
    names = [n.name for n in graph.nodes]
    if len(set(names)) != len(names):
        yield "node names are not unique"


def topological_order(graph: Graph) -> Iterator[str]:
    available = set(graph.inputs) | set(graph.constants)
    for node in graph.nodes:
        for name in node.inputs:
            if name and name not in available:
                yield f"node {node.name!r} reads {name!r} before it is defined"
        available.update(o for o in node.outputs if o)


def no_dangling_values(graph: Graph) -> Iterator[str]:
    defined = set(graph.inputs) | set(graph.constants)
    defined |= {o for n in graph.nodes for o in n.outputs if o}
    for name in graph.outputs:
        if name not in defined:
            yield f"graph output {name!r} is never defined"
    for node in graph.nodes:
        for name in node.inputs:
            if name and name not in defined:
                yield f"node {node.name!r} reads undefined value {name!r}"


def shapes_known(graph: Graph) -> Iterator[str]:
    named = set(graph.inputs) | set(graph.constants) | {o for n in graph.nodes for o in n.outputs}
    for name in sorted(named - {""}):
        if not isinstance(graph.types.get(name), TensorType):
            yield f"value {name!r} has no tensor type"


def types_consistent(graph: Graph) -> Iterator[str]:
    for name, array in graph.constants.items():
        if name in graph.types and TensorType.of(np.asarray(array)) != graph.types[name]:
            yield f"constant {name!r} holds {TensorType.of(array)}, typed {graph.types[name]}"
    for node in graph.nodes:
        opdef = OP_TABLE.get(node.op)
        if opdef is None or any(i and i not in graph.types for i in node.inputs):
            continue
        try:
            inferred = opdef.infer(node, [graph.types[i] if i else None for i in node.inputs])
        except Exception as err:  # noqa: BLE001 - reported as a failed check
            yield f"node {node.name!r} ({node.op}): type rule failed: {err}"
            continue
        for name, typ in zip(node.outputs, inferred, strict=False):
            if name and graph.types.get(name) != typ:
                yield (
                    f"node {node.name!r} ({node.op}): {name!r} typed {graph.types.get(name)}, "
                    f"rule says {typ}"
                )


def groups_partition(graph: Graph) -> Iterator[str]:
    if not graph.groups:
        return
    count: dict[str, int] = {}
    for group in graph.groups:
        for name in group.nodes:
            count[name] = count.get(name, 0) + 1
    for node in graph.nodes:
        if count.get(node.name, 0) != 1:
            yield f"node {node.name!r} is in {count.get(node.name, 0)} fusion groups"
    unknown = set(count) - {n.name for n in graph.nodes}
    for name in sorted(unknown):
        yield f"fusion group names unknown node {name!r}"


CHECKS: dict[str, Check] = {
    "ops_known": ops_known,
    "single_definition": single_definition,
    "topological_order": topological_order,
    "no_dangling_values": no_dangling_values,
    "shapes_known": shapes_known,
    "types_consistent": types_consistent,
    "groups_partition": groups_partition,
}


def verify(graph: Graph, stage: str = "graph") -> Graph:
    for name, check in CHECKS.items():
        problems = list(check(graph))
        if problems:
            raise VerificationError(name, problems, graph, stage)
    return graph
