"""Small tools the passes share for rewriting a graph's node list."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from compiler_core.graph.ir import Graph, NameGenerator, Node, OpKind, TensorType
from compiler_core.graph.ops import OP_TABLE

# Elementwise kinds whose operands do not broadcast numpy-style against the output (they carry
# an axis attribute or change the shape).
NOT_NUMPY_BROADCAST = frozenset(
    {"BatchNormalization", "DequantizeLinear", "QuantizeLinear", "Expand"}
)


def is_elementwise(op: str) -> bool:
    """Whether `op` computes each output element from the same element of its operands,
    broadcast numpy-style (Add, Relu, Where, Clip...)."""
    return OP_TABLE[op].kind <= OpKind.BROADCAST and op not in NOT_NUMPY_BROADCAST


def reshape_node(name: str, source: str, output: str, shape) -> Node:
    """A Reshape of `source` to the static `shape`, writing `output`."""
    return Node("Reshape", name, (source,), (output,), {"shape": tuple(int(d) for d in shape)})


class Rewrite:
    """What a rewriting pass works on: the graph it reads, copies of its types and constants
    it adds to, and fresh names that collide with none of the graph's."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.types = dict(graph.types)
        self.constants = dict(graph.constants)
        self.fresh = NameGenerator(graph.names())

    def constant(self, array, prefix: str) -> str:
        """A new constant holding `array`, named after `prefix`."""
        array = np.asarray(array)
        name = self.fresh(prefix)
        self.constants[name] = array
        self.types[name] = TensorType.of(array)
        return name

    def single_consumer(self, value: str) -> bool:
        """Whether one node reads `value` and it is not a graph output."""
        return len(self.graph.consumers.get(value, ())) == 1 and value not in self.graph.outputs


class Decomposition(Rewrite):
    """A pass that replaces each node it takes (`takes`) by nodes of its own (`decompose`,
    appending to `nodes`) and keeps every other node as it is."""

    def __init__(self, graph: Graph):
        super().__init__(graph)
        self.nodes: list[Node] = []

    def takes(self, node: Node) -> bool:
        raise NotImplementedError

    def decompose(self, node: Node) -> None:
        raise NotImplementedError

    def emit(self, op: str, name: str, inputs, output: str | None = None, **attrs) -> str:
        """Append one node; its output type is what the operator's own rule infers."""
        output = output or self.fresh(f"{name}_out")
        node = Node(op, self.fresh(name), tuple(inputs), (output,), attrs)
        (self.types[output],) = OP_TABLE[op].infer(node, [self.types[i] for i in inputs])[:1]
        self.nodes.append(node)
        return output

    def run(self) -> Graph:
        """The rewritten graph; the graph itself when no node is taken."""
        if not any(self.takes(node) for node in self.graph.nodes):
            return self.graph
        for node in self.graph.nodes:
            if self.takes(node):
                self.decompose(node)
            else:
                self.nodes.append(node)
        return self.graph.replace(
            nodes=tuple(self.nodes), constants=self.constants, types=self.types
        )


def rename_inputs(node: Node, mapping: Mapping[str, str]) -> Node:
    if not any(name in mapping for name in node.inputs):
        return node
    return node.replace(inputs=tuple(mapping.get(name, name) for name in node.inputs))


def resolve(mapping: Mapping[str, str], name: str) -> str:
    while name in mapping:
        name = mapping[name]
    return name


def forward_values(graph: Graph, nodes: Sequence[Node], forward: Mapping[str, str]) -> Graph:
    """Make every use of `old` read `new` instead (for old -> new in `forward`).

    A graph output keeps its name: when `old` is an output and `new` is a plain intermediate,
    the producer of `new` is renamed to produce `old`. Where that cannot be done (new is an
    input, a constant or another output), the node that defined `old` is kept as an Identity.
    """
    forward = {old: resolve(forward, old) for old in forward}
    outputs = set(graph.outputs)
    renames: dict[str, str] = {}
    keep_identity: dict[str, str] = {}
    claimed: set[str] = set()
    for old, new in forward.items():
        if old not in outputs:
            continue
        if (
            new in graph.inputs
            or new in graph.constants
            or new in outputs
            or new in claimed
            or new not in _produced(nodes)
        ):
            keep_identity[old] = new
        else:
            renames[new] = old
            claimed.add(new)
    uses = {old: new for old, new in forward.items() if old not in keep_identity}
    uses = {old: renames.get(new, new) for old, new in uses.items()}
    uses.update(renames)
    result = []
    for node in nodes:
        node = rename_inputs(node, uses)
        if any(out in renames for out in node.outputs):
            node = node.replace(outputs=tuple(renames.get(o, o) for o in node.outputs))
        result.append(node)
    for old, new in keep_identity.items():
        source = uses.get(new, new)
        result.append(Node("Identity", f"{old}_identity", (source,), (old,)))
    types = dict(graph.types)
    return graph.replace(nodes=tuple(_toposort(result, graph)), types=types)


def _produced(nodes: Sequence[Node]) -> set[str]:
    return {out for node in nodes for out in node.outputs}


def _toposort(nodes: Sequence[Node], graph: Graph) -> list[Node]:
    """Stable topological order (nodes appended by a rewrite may depend on later ones)."""
    available = set(graph.inputs) | set(graph.constants) | {""}
    pending = list(nodes)
    ordered: list[Node] = []
    while pending:
        progressed = False
        rest = []
        for node in pending:
            if all(name in available for name in node.inputs):
                ordered.append(node)
                available.update(node.outputs)
                progressed = True
            else:
                rest.append(node)
        if not progressed:
            names = ", ".join(n.name for n in rest[:5])
            raise ValueError(f"graph has a cycle or an undefined value at nodes: {names}")
        pending = rest
    return ordered
