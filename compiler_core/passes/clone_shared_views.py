"""Give each reader of a shared view chain its own copy of the chain.

A chain of Reshapes and Transposes whose result several injective ops read (the three
Gathers that split a fused QKV projection into queries, keys and values) would become a
kernel of its own: it writes the whole transposed tensor for the readers to read back. A
view computes nothing, so each reader recomputes it instead: after this pass every reader
fuses its own copy and reads the chain's source directly, in one kernel, and the copy kernel
is gone. Runs after common-subexpression elimination, which would merge the copies again.
"""

from __future__ import annotations

from compiler_core.graph.ir import Graph, NameGenerator, Node, OpKind
from compiler_core.graph.ops import OP_TABLE

NAME = "clone_shared_views"
VIEW_OPS = ("Reshape", "Transpose")


def _chain(graph: Graph, value: str) -> list[Node]:
    """The view nodes that compute `value` from a non-view value, first to last; the values
    between them must have no other reader (they are cloned whole)."""
    chain: list[Node] = []
    producer = graph.producers.get(value)
    while producer is not None and producer.op in VIEW_OPS:
        chain.insert(0, producer)
        source = producer.inputs[0]
        if len(graph.consumers.get(source, ())) != 1 or source in graph.outputs:
            break
        producer = graph.producers.get(source)
    return chain


def _cloned(chain: list[Node], reader: Node, fresh: NameGenerator, types) -> list[Node]:
    """A copy of `chain` with fresh node and value names, its last value renamed in `reader`."""
    renamed: dict[str, str] = {}
    copies = []
    for node in chain:
        output = fresh(f"{node.outputs[0]}_copy")
        types[output] = types[node.outputs[0]]
        renamed[node.outputs[0]] = output
        inputs = tuple(renamed.get(v, v) for v in node.inputs)
        copies.append(node.replace(name=fresh(node.name), inputs=inputs, outputs=(output,)))
    return copies


def run(graph: Graph) -> Graph:
    fresh = NameGenerator(graph.names())
    types = dict(graph.types)
    clones: dict[str, list[Node]] = {}  # reader name -> the chain copies placed before it
    renames: dict[str, dict[str, str]] = {}  # reader name -> value renames in its inputs
    for value, readers in graph.consumers.items():
        if len(readers) < 2 or value in graph.outputs:
            continue
        if any(OP_TABLE[r.op].kind > OpKind.INJECTIVE for r in readers):
            continue  # a heavy reader reads the chain's result from memory anyway
        chain = _chain(graph, value)
        if not chain:
            continue
        for reader in readers[1:]:
            copies = _cloned(chain, reader, fresh, types)
            clones.setdefault(reader.name, []).extend(copies)
            renames.setdefault(reader.name, {})[value] = copies[-1].outputs[0]
    if not clones:
        return graph
    nodes: list[Node] = []
    for node in graph.nodes:
        if node.name in clones:
            nodes.extend(clones[node.name])
            mapping = renames[node.name]
            node = node.replace(inputs=tuple(mapping.get(v, v) for v in node.inputs))
        nodes.append(node)
    return graph.replace(nodes=tuple(nodes), types=types)
