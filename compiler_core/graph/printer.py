"""A text form of the graph IR that people can read (and diff)."""

from __future__ import annotations

from compiler_core.graph.ir import ArrayAttr, Graph, GraphAttr, Node


def _format_attr(value) -> str:
    if isinstance(value, tuple):
        return "[" + ",".join(_format_attr(v) for v in value) + "]"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (ArrayAttr, GraphAttr)):
        return repr(value)
    return str(value)


def format_node(node: Node, graph: Graph | None = None) -> str:
    outs = ", ".join(f"%{o}" if o else "_" for o in node.outputs)
    ins = ", ".join(f"%{i}" if i else "_" for i in node.inputs)
    attrs = ", ".join(f"{k}={_format_attr(v)}" for k, v in node.attrs)
    text = f"{outs} = {node.op}({ins})"
    if attrs:
        text += " {" + attrs + "}"
    if graph is not None:
        types = ", ".join(str(graph.types[o]) for o in node.outputs if o in graph.types)
        text += f"  : {types}"
    return text


def format_graph(graph: Graph, show_groups: bool = False, show_constants: bool = True) -> str:
    ins = ", ".join(f"%{n}: {graph.types[n]}" for n in graph.inputs)
    outs = ", ".join(f"%{n}: {graph.types[n]}" for n in graph.outputs)
    lines = [f"graph {graph.name}({ins}) -> ({outs}) {{"]
    if show_constants:
        for name in sorted(graph.constants):
            lines.append(f"  const %{name}: {graph.types[name]}")
    for node in graph.nodes:
        lines.append(f"  {format_node(node, graph)}    # {node.name}")
        for _, value in node.attrs:
            if isinstance(value, GraphAttr):  # a body, printed in full under its node
                body = format_graph(value.graph, show_constants=show_constants)
                lines.extend("    " + line for line in body.splitlines())
    lines.append("}")
    if show_groups and graph.groups:
        lines.append(format_groups(graph))
    return "\n".join(lines)


def format_groups(graph: Graph) -> str:
    lines = [f"fused groups ({len(graph.groups)}):"]
    for group in graph.groups:
        ops = " -> ".join(graph.node_by_name[n].op for n in group.nodes)
        anchor = f" anchor={group.anchor}" if group.anchor else ""
        lines.append(f"  {group.name} [{group.kind.name.lower()}{anchor}]: {ops}")
    return "\n".join(lines)
