"""Attention's three kernels as one: S = Q K^T, P = Softmax(S) over its last axis, Y = P V.

Decomposed (`decompose_attention`, or as an exporter spells it), attention is a batched GEMM
that writes every head's scores, a row softmax that reads them and writes the probabilities,
and a second GEMM that reads those: at 12 heads of 1024 keys, 50 MB written and read twice
each, so the two GEMMs and the softmax wait on memory (12 heads of 64 at 1024 tokens ran
1.37x ONNX Runtime's fused kernel on a Xeon, 0.93x joined). The joined kernel computes a
block of query rows at a time: their scores into a buffer of the thread's, the softmax over
it in cache, then their rows of Y (`schedules.attention_schedule`), so the scores never
leave L1/L2.

The fusion pass keeps heavy ops apart, and Softmax alone; this pass (CPU targets, after it)
joins the three groups when the middle one is just the Softmax over the last axis of a
batched MatMul's output (its epilogue may scale or mask it) that only the second MatMul reads,
as its A operand, and each value in between has no other reader. The joined group takes the
second MatMul's place in the order (every group between reads neither value).
"""

from __future__ import annotations

from compiler_core.graph.ir import FusionGroup, Graph, Node

NAME = "fuse_attention"
# Float types the chain computes in (its builders' stages are float32 GEMMs and row softmax).
DTYPES = ("float32",)


def run(graph: Graph) -> Graph:
    if not graph.groups:
        return graph
    groups = list(graph.groups)
    group_of = {name: k for k, group in enumerate(groups) for name in group.nodes}
    merged: dict[int, tuple[int, int]] = {}  # the second GEMM's group -> the other two
    for k, group in enumerate(groups):
        softmax = _lone_softmax(graph, group)
        if softmax is None:
            continue
        producer = graph.producers.get(softmax.inputs[0])
        readers = graph.consumers.get(softmax.outputs[0], ())
        scores_readers = graph.consumers.get(softmax.inputs[0], ())
        if producer is None or len(readers) != 1 or len(scores_readers) != 1:
            continue  # the scores or probabilities are read elsewhere (a qk output)
        if softmax.outputs[0] in graph.outputs:
            continue
        scores, values = groups[group_of[producer.name]], groups[group_of[readers[0].name]]
        if _scores_group(graph, scores, producer) and _values_group(graph, values, softmax):
            merged[group_of[readers[0].name]] = (group_of[producer.name], k)
    if not merged:
        return graph
    absorbed = {g for pair in merged.values() for g in pair}
    fused = []
    for k, group in enumerate(groups):
        if k in absorbed:
            continue
        if k in merged:
            first, middle = merged[k]
            nodes = groups[first].nodes + groups[middle].nodes + group.nodes
            group = FusionGroup(group.name, nodes, group.kind, group.anchor)
        fused.append(group)
    return graph.replace(groups=tuple(fused))


def _lone_softmax(graph: Graph, group: FusionGroup) -> Node | None:
    """The group's one node when it is a float32 Softmax over the last axis of a tensor of
    rank 3 or more (heads of rows); rows with no allowed key (`zero_empty_rows`, a mask
    known at run time) change its expressions, not its stages."""
    if len(group.nodes) != 1:
        return None
    node = graph.node_by_name[group.nodes[0]]
    if node.op != "Softmax":
        return None
    x = graph.types[node.inputs[0]]
    axis = node.attr("axis", -1)
    last = axis in (-1, x.rank - 1)
    return node if last and x.rank >= 3 and x.dtype in DTYPES else None


def _scores_group(graph: Graph, group: FusionGroup, last: Node) -> bool:
    """A batched MatMul's group whose last node (its epilogue's, or the MatMul) makes the
    softmax's input, every value of it read inside the group but that one."""
    if group.anchor is None or group.nodes[-1] != last.name:
        return False
    anchor = graph.node_by_name[group.anchor]
    return anchor.op == "MatMul" and _private(graph, group, allowed=last.outputs[0])


def _values_group(graph: Graph, group: FusionGroup, softmax: Node) -> bool:
    """A batched MatMul's group (with its epilogue) whose MatMul reads the softmax as A."""
    if group.anchor is None or group.nodes[0] != group.anchor:
        return False
    anchor = graph.node_by_name[group.anchor]
    if anchor.op != "MatMul" or anchor.inputs[0] != softmax.outputs[0]:
        return False
    b = graph.types[anchor.inputs[1]]
    return b.rank >= 3 and anchor.inputs[1] not in graph.constants


def _private(graph: Graph, group: FusionGroup, allowed: str) -> bool:
    """No value the group makes, but `allowed`, is read outside it or is a graph output."""
    inside = set(group.nodes)
    for name in group.nodes:
        for value in graph.node_by_name[name].outputs:
            if not value or value == allowed:
                continue
            outside = any(c.name not in inside for c in graph.consumers.get(value, ()))
            if outside or value in graph.outputs:
                return False
    return allowed not in graph.outputs
