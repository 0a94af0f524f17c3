"""Operator fusion: partition the nodes into groups, each of which later becomes one kernel.

Rules, written against pattern kinds only (TVM's):
- an OUT_ELEMWISE_FUSABLE anchor (Conv, Gemm, MatMul, pooling) absorbs the elementwise and
  broadcast ops that consume its result (bias, residual Add, Relu, Clip...): its epilogue;
- chains of ELEMWISE/BROADCAST/INJECTIVE ops fuse together, and into a REDUCTION that
  consumes them; a reduction absorbs an elementwise epilogue;
- two heavy ops (OUT_ELEMWISE_FUSABLE or REDUCTION) never share a group, with one exception:
  a depthwise conv joins the group of the pointwise (1x1) conv that expands its input (a
  MobileNet block's expand -> depthwise pair, both channel-blocked): the kernel then computes
  the expanded channels a tile of rows at a time, in cache, instead of writing the widest
  tensor of the block to memory and reading it back;
- OPAQUE ops stay alone;
- a view that only heavy ops read (a Reshape of a conv's data to a pointwise conv's GEMM
  operand) stays alone too: the memory plan puts it in the bytes it views and its kernel
  copies nothing (`build.view_aliases`), where joining its producer's group would make that
  group write in the view's shape (a layout transform's blocked reads lose their register
  transpose: ShuffleNet's 10 -> 90 us).

A node joins its producer's group only through a value that no one else reads (and that is
not a graph output), and only when none of its other inputs depends on that group: the
groups must stay a DAG.
"""

from __future__ import annotations

import dataclasses

from compiler_core.graph.ir import FusionGroup, Graph, Node, OpKind
from compiler_core.graph.ops import OP_TABLE
from compiler_core.graph.ops.nn import conv_layouts, spatial_params
from compiler_core.graph.ops.tensor import BYTE_VIEWS

NAME = "fuse_operators"
HEAVY = (OpKind.OUT_ELEMWISE_FUSABLE, OpKind.REDUCTION)


@dataclasses.dataclass
class _Group:
    nodes: list[str]
    anchor: str | None
    anchor_kind: OpKind | None
    max_kind: OpKind


def kind_of(node: Node) -> OpKind:
    return OP_TABLE[node.op].kind


def _can_absorb(group: _Group, kind: OpKind) -> bool:
    if kind == OpKind.OPAQUE or group.max_kind == OpKind.OPAQUE:
        return False
    if group.anchor_kind == OpKind.OUT_ELEMWISE_FUSABLE:
        return kind <= OpKind.BROADCAST  # epilogue only
    if group.anchor_kind == OpKind.REDUCTION:
        return kind <= OpKind.BROADCAST
    # An anchorless group of injective ops: more injective ops, or a reduction to anchor it.
    return kind <= OpKind.INJECTIVE or kind == OpKind.REDUCTION


def run(graph: Graph) -> Graph:
    group_of: dict[str, int] = {}  # node name -> group id
    groups: list[_Group] = []
    # reads[g]: the groups whose values group g reads directly (to keep the DAG).
    reads: list[set[int]] = []

    for node in graph.nodes:
        kind = kind_of(node)
        producer_groups = {
            group_of[graph.producers[v].name] for v in node.inputs if v in graph.producers
        }
        target = _choose_group(graph, node, kind, group_of, groups, reads)
        if target is None:
            groups.append(_Group([node.name], None, None, kind))
            reads.append(set())
            target = len(groups) - 1
            if kind in HEAVY:
                groups[target].anchor, groups[target].anchor_kind = node.name, kind
        else:
            group = groups[target]
            group.nodes.append(node.name)
            group.max_kind = max(group.max_kind, kind)
            if kind in HEAVY:
                group.anchor, group.anchor_kind = node.name, kind
        group_of[node.name] = target
        reads[target] |= producer_groups - {target}

    fused = tuple(
        FusionGroup(
            name=f"group_{rank}_{(groups[g].anchor or groups[g].nodes[0])}",
            nodes=tuple(groups[g].nodes),
            kind=groups[g].anchor_kind if groups[g].anchor_kind is not None else groups[g].max_kind,
            anchor=groups[g].anchor,
        )
        for rank, g in enumerate(_execution_order(reads))
    )
    return graph.replace(groups=fused)


def _execution_order(reads: list[set[int]]) -> list[int]:
    """Groups in an order where every group comes after those it reads (creation order
    otherwise): a residual Add joins an earlier conv's group yet reads a later one."""
    order, done = [], set()
    for root in range(len(reads)):
        stack = [(root, False)]
        while stack:  # iterative depth-first search: deep models exceed Python's recursion
            g, expanded = stack.pop()
            if expanded:
                order.append(g)
            elif g not in done:
                done.add(g)
                stack.append((g, True))
                stack.extend((dep, False) for dep in sorted(reads[g], reverse=True))
    return order


def _choose_group(graph, node, kind, group_of, groups, reads) -> int | None:
    if kind == OpKind.OPAQUE or _view_for_heavy_ops(graph, node):
        return None
    candidates = []
    for value in node.inputs:
        producer = graph.producers.get(value)
        if producer is None or value in graph.outputs:
            continue
        if len(graph.consumers.get(value, ())) != 1:
            continue
        g = group_of[producer.name]
        group = groups[g]
        chained = _expands_into_depthwise(graph, graph.node_by_name.get(group.anchor), node)
        if kind in HEAVY and group.anchor_kind is not None and not chained:
            continue  # two heavy ops never fuse
        if not chained and not _can_absorb(group, kind):
            continue
        if not _keeps_dag(graph, node, g, group_of, reads):
            continue
        candidates.append(g)
    if not candidates:
        return None
    # Prefer joining a heavy anchor's group (an epilogue), then the earliest operand: for a
    # residual Add that is the main path's conv, not the shortcut's.
    anchored = [g for g in candidates if groups[g].anchor_kind is not None]
    return (anchored or candidates)[0]


def _view_for_heavy_ops(graph: Graph, node: Node) -> bool:
    """Whether `node` is a byte view (`BYTE_VIEWS`) whose readers are all heavy ops."""
    if node.op not in BYTE_VIEWS:
        return False
    readers = graph.consumers.get(node.outputs[0], ())
    return bool(readers) and all(kind_of(reader) in HEAVY for reader in readers)


def _expands_into_depthwise(graph: Graph, anchor: Node | None, node: Node) -> bool:
    """Whether `node` is a 2-D depthwise conv of channel-blocked data that reads (through the
    anchor's elementwise epilogue) a 1x1, stride-1, unpadded, ungrouped conv writing its
    data's channel blocks (from plain or blocked data): the pair one kernel computes a tile
    of rows at a time."""
    if anchor is None or anchor.op != "Conv" or node.op != "Conv":
        return False
    if anchor.name == node.name or not _blocked_2d(graph, anchor) or not _blocked_2d(graph, node):
        return False
    expand_w = graph.constants[anchor.inputs[1]].shape
    depthwise_w = graph.constants[node.inputs[1]].shape
    pads, strides, dilations = spatial_params(anchor, 2)
    pointwise = tuple(expand_w[2:]) == (1, 1) and anchor.attr("group", 1) == 1
    pointwise = pointwise and not any(pads) and strides == (1, 1) and dilations == (1, 1)
    groups = node.attr("group", 1)
    depthwise = depthwise_w[1] == 1 and groups == depthwise_w[0] > 1
    depthwise = depthwise and spatial_params(node, 2)[2] == (1, 1)
    same_blocks = conv_layouts(anchor)[1] == conv_layouts(node)[0] == conv_layouts(node)[1]
    return pointwise and depthwise and same_blocks


def _blocked_2d(graph: Graph, conv: Node) -> bool:
    """A conv with constant 2-D filters, writing channel blocks."""
    weights = graph.constants.get(conv.inputs[1]) if len(conv.inputs) > 1 else None
    return weights is not None and weights.ndim == 4 and conv_layouts(conv)[1] > 0


def _keeps_dag(graph, node, target, group_of, reads) -> bool:
    """Joining `target` is safe if no other input of `node` comes from a group that
    itself depends on `target` (that would make the fused group read its own output)."""
    for value in node.inputs:
        producer = graph.producers.get(value)
        if producer is None:
            continue
        g = group_of[producer.name]
        if g != target and _depends_on(g, target, reads):
            return False
    return True


def _depends_on(start: int, target: int, reads) -> bool:
    stack, seen = [start], set()
    while stack:
        g = stack.pop()
        if g == target:
            return True
        if g not in seen:
            seen.add(g)
            stack.extend(reads[g])
    return False
