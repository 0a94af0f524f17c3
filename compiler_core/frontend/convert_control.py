"""Control flow: If, Loop and Scan.

- `If` with a condition known at compile time is replaced by the taken branch's nodes. With a
  run-time condition, both branches are imported and each output selects between them
  (`Where`): the branches are side-effect free, so this is exact, at the cost of running both.
  Branch outputs of different types make the output's type depend on the condition, which is
  then a shape-deciding operand (bind it as a constant).
- `Scan` and `Loop` become one Kiln `Loop` node (compiler_core/graph/ops/control.py) holding
  the body as a graph: the native kernel is one loop over the steps (te.recurrence), whatever
  their number. A Loop's trip count must be known at compile time; its condition may change in
  the body only when it has no scan outputs (their length would depend on the data).
- A Loop whose body needs its iteration number (or a state) as a compile-time value, say as a
  Slice bound, cannot be one loop over static shapes: up to UNROLL_LIMIT iterations it is
  unrolled at import, each copy seeing its own iteration number.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from compiler_core.frontend.common import (
    ImportContext,
    ModelFormatError,
    NotConstantError,
    UnsupportedError,
    onnx_dtype_name,
    tensor_to_array,
)
from compiler_core.frontend.convert_utils import Attrs, Converter, emit_reshape, input_at
from compiler_core.graph.ir import Graph, TensorType

# Iterations a Loop is unrolled up to when its body cannot be one step of a static loop.
UNROLL_LIMIT = 64
SCALAR_INT64 = TensorType((), "int64")
SCALAR_BOOL = TensorType((), "bool")


# --- bodies ------------------------------------------------------------------------------------


def free_values(graph: onnx.GraphProto) -> list[str]:
    """Outer values the graph (or a graph nested in it) reads, in first-use order."""
    defined = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    free: dict[str, None] = {}
    for node in graph.node:
        for name in node.input:
            if name and name not in defined:
                free.setdefault(name)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                for name in free_values(attr.g):
                    if name not in defined:
                        free.setdefault(name)
        defined.update(node.output)
    return list(free)


def _names_in(graph: onnx.GraphProto) -> set[str]:
    names = {v.name for v in graph.input} | {t.name for t in graph.initializer}
    for node in graph.node:
        names.update(node.output)
        names.update(node.input)
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                names |= _names_in(attr.g)
    return names


def _check_declared(where: str, value: onnx.ValueInfoProto, actual: TensorType) -> None:
    """A body input's declared type, where it has one, must be what the loop feeds it."""
    tensor_type = value.type.tensor_type
    if tensor_type.elem_type and onnx_dtype_name(tensor_type.elem_type) != actual.dtype:
        raise ModelFormatError(
            f"{where}: body input {value.name!r} is declared "
            f"{onnx_dtype_name(tensor_type.elem_type)} but receives {actual}"
        )


def import_body(
    ctx: ImportContext, graph: onnx.GraphProto, input_types: Sequence[TensorType], where: str
) -> tuple[Graph, list[str]]:
    """The body as a Kiln graph whose inputs are its own, then the outer values it reads
    (returned too: the loop node passes them in)."""
    if len(graph.input) != len(input_types):
        raise ModelFormatError(
            f"{where}: the body takes {len(graph.input)} inputs, the loop gives it "
            f"{len(input_types)}"
        )
    free = free_values(graph)
    sub = ctx.subcontext(set(ctx.types) | _names_in(graph))
    for value, typ in zip(graph.input, input_types, strict=True):
        _check_declared(where, value, typ)
        sub.types[value.name] = typ
    for name in free:
        if name in ctx.empty_optionals:  # a name with no value: nothing to pass in
            continue
        sub.types[name] = ctx.type(name)
        if ctx.has_value(name):
            sub.known[name] = ctx.known[name]
    for tensor in graph.initializer:
        sub.add_constant(tensor_to_array(tensor), name=tensor.name)
    for node in graph.node:
        sub.current = node
        sub.convert(sub, node)
    outputs = [v.name for v in graph.output]
    for name in outputs:
        if name not in sub.types:
            raise ModelFormatError(f"{where}: body output {name!r} is never produced")
    used = set(outputs) | {i for n in sub.nodes for i in n.inputs}
    captured = [name for name in free if name in used and name not in sub.constants]
    body = Graph(
        name=graph.name or "body",
        inputs=tuple(v.name for v in graph.input) + tuple(captured),
        outputs=tuple(outputs),
        nodes=tuple(sub.nodes),
        types=sub.types,
        constants=sub.constants,
    ).pruned()
    return body, captured


def _renamed(graph: onnx.GraphProto, mapping: Mapping[str, str]) -> onnx.GraphProto:
    """A copy of a nested graph whose reads of outer values follow `mapping`."""
    copy = onnx.GraphProto()
    copy.CopyFrom(graph)
    local = {v.name for v in copy.input} | {t.name for t in copy.initializer}
    for node in copy.node:
        for k, name in enumerate(node.input):
            if name and name not in local and name in mapping:
                node.input[k] = mapping[name]
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                inner = {n: m for n, m in mapping.items() if n not in local}
                attr.g.CopyFrom(_renamed(attr.g, inner))
        local.update(node.output)
    return copy


def inline_graph(
    ctx: ImportContext, graph: onnx.GraphProto, bindings: Mapping[str, str]
) -> list[str]:
    """Convert a body's nodes straight into `ctx`, its inputs bound to outer values and every
    value it defines renamed fresh (so one body can be inlined many times); returns the outer
    names of its outputs."""
    mapping = dict(bindings)
    for tensor in graph.initializer:
        mapping[tensor.name] = ctx.add_constant(tensor_to_array(tensor), prefix=tensor.name)
    saved = ctx.current
    for node in graph.node:
        copy = onnx.NodeProto()
        copy.CopyFrom(node)
        for k, name in enumerate(copy.input):
            copy.input[k] = mapping.get(name, name)
        for k, name in enumerate(copy.output):
            if name:
                mapping[name] = ctx.fresh(name)
                copy.output[k] = mapping[name]
        for attr in copy.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                attr.g.CopyFrom(_renamed(attr.g, mapping))
        ctx.current = copy
        ctx.convert(ctx, copy)
    ctx.current = saved
    return [mapping.get(v.name, v.name) for v in graph.output]


def _known_bool(ctx: ImportContext, value: str, where: str) -> bool:
    array = np.asarray(ctx.known[value])
    if array.size != 1:
        raise ModelFormatError(f"{where}: condition {value!r} has {array.size} elements, not one")
    return bool(array.reshape(-1)[0])


def _scalar(ctx: ImportContext, value: str, where: str) -> str:
    """A one-element condition or count as a rank-0 value."""
    typ = ctx.type(value)
    if typ.size != 1:
        raise ModelFormatError(f"{where}: {value!r} is {typ}; it must hold one element")
    return value if typ.rank == 0 else emit_reshape(ctx, value, ())


# --- If ------------------------------------------------------------------------------------


def convert_if(ctx: ImportContext, node: onnx.NodeProto, attrs: Attrs) -> None:
    where = f"node {node.name!r} (If)"
    then_branch, else_branch = attrs.get("then_branch"), attrs.get("else_branch")
    cond = node.input[0]
    if ctx.has_value(cond):
        taken = then_branch if _known_bool(ctx, cond, where) else else_branch
        _bind_outputs(ctx, node.output, inline_graph(ctx, taken, {}), where)
        return
    then_values = inline_graph(ctx, then_branch, {})
    else_values = inline_graph(ctx, else_branch, {})
    if len(then_values) != len(node.output) or len(else_values) != len(node.output):
        raise ModelFormatError(f"{where}: its branches and the node differ in output count")
    condition = _scalar(ctx, cond, where)
    for output, a, b in zip(node.output, then_values, else_values, strict=True):
        if ctx.type(a) != ctx.type(b):
            ctx.value(
                cond,
                f"condition (the branches give {output!r} as {ctx.type(a)} and {ctx.type(b)}, "
                "so the condition decides its type)",
            )
        if output:
            ctx.emit("Where", [condition, a, b], [output])


def _bind_outputs(ctx: ImportContext, outputs: Sequence[str], values: Sequence[str], where):
    if len(values) != len(outputs):
        raise ModelFormatError(f"{where}: the body gives {len(values)} outputs for {len(outputs)}")
    for output, value in zip(outputs, values, strict=True):
        if output:
            ctx.emit("Identity", [value], [output])


# --- Loop ----------------------------------------------------------------------------------


def _condition_is_invariant(body: onnx.GraphProto) -> bool:
    """Whether the body's condition output is its condition input (through Identity nodes),
    so that the loop runs all its trip count or not at all."""
    cond_in, value = body.input[1].name, body.output[0].name
    producers = {out: n for n in body.node for out in n.output}
    while value != cond_in:
        node = producers.get(value)
        if node is None or node.op_type != "Identity":
            return False
        value = node.input[0]
    return True


def convert_loop(ctx: ImportContext, node: onnx.NodeProto, attrs: Attrs) -> None:
    where = f"node {node.name!r} (Loop)"
    body = attrs.get("body")
    trip_value, cond_value = input_at(node, 0), input_at(node, 1)
    carried = list(node.input[2:])
    scans = len(body.output) - 1 - len(carried)
    if scans < 0 or len(body.input) != 2 + len(carried):
        raise ModelFormatError(
            f"{where}: the body's inputs/outputs do not match {len(carried)} carried values"
        )
    if not trip_value:
        raise UnsupportedError(
            f"{where}: a Loop without a trip count (a while loop) has no static bound; Kiln "
            "compiles loops whose trip count M is known at compile time"
        )
    trip = int(np.asarray(ctx.value(trip_value, "trip count")).reshape(-1)[0])
    invariant = _condition_is_invariant(body)
    cond_known = not cond_value or ctx.has_value(cond_value)
    runs = (not cond_value) or (ctx.has_value(cond_value) and _known_bool(ctx, cond_value, where))
    if scans and not invariant:
        raise UnsupportedError(
            f"{where}: its condition changes inside the body, so the length of its "
            f"{scans} scan output(s) depends on the data; not supported"
        )
    if scans and not cond_known:
        ctx.value(cond_value, "loop condition (it decides the scan outputs' length)")
    if cond_known and not runs:
        trip = 0
    guarded = not (invariant and cond_known)
    state_types = [SCALAR_BOOL] + [ctx.type(v) for v in carried]
    try:
        graph, captured = import_body(ctx, body, [SCALAR_INT64, *state_types], where)
    except NotConstantError as err:
        _unroll_loop(ctx, node, body, trip, guarded, err)
        return
    if trip == 0:
        _empty_loop(ctx, node, graph, len(carried), where)
        return
    condition = _initial_condition(ctx, cond_value, where)
    ctx.emit(
        "Loop",
        [condition, *carried, *captured],
        ["", *node.output],
        body=graph,
        steps=trip,
        num_states=1 + len(carried),
        num_scan_inputs=0,
        scan_input_axes=(),
        scan_input_directions=(),
        scan_output_axes=(0,) * scans,
        scan_output_directions=(0,) * scans,
        iteration_input=1,
        guarded=int(guarded),
    )


def _initial_condition(ctx: ImportContext, value: str, where: str) -> str:
    """The loop's condition as a rank-0 value; an omitted one is true."""
    return _scalar(ctx, value, where) if value else ctx.add_constant(np.array(True))


def _empty_loop(ctx: ImportContext, node, graph: Graph, carried: int, where: str) -> None:
    """No iteration runs: the carried values pass through; scan outputs are empty."""
    for output, value in zip(node.output[:carried], node.input[2:], strict=True):
        if output:
            ctx.emit("Identity", [value], [output])
    for output, value in zip(node.output[carried:], graph.outputs[1 + carried :], strict=True):
        if output:
            typ = graph.types[value]
            ctx.add_constant(np.zeros((0, *typ.shape), typ.dtype), name=output)


def _unroll_loop(ctx, node, body, trip: int, guarded: bool, cause: NotConstantError) -> None:
    where = f"node {node.name!r} (Loop)"
    if trip > UNROLL_LIMIT:
        raise UnsupportedError(
            f"{where}: the body needs {cause.value!r} at compile time (it decides a shape), so "
            f"the loop cannot be one loop over static shapes, and {trip} iterations are more "
            f"than the {UNROLL_LIMIT} Kiln unrolls"
        ) from None
    carried = list(node.input[2:])
    condition = input_at(node, 1) or ctx.add_constant(np.array(True))
    scans: list[list[str]] = [[] for _ in body.output[1 + len(carried) :]]
    for iteration in range(trip):
        if guarded and not _known_bool_or_raise(ctx, condition, where):
            break
        number = ctx.add_constant(np.array(iteration, dtype=np.int64), prefix="iteration")
        values = [number, _scalar(ctx, condition, where), *carried]
        bindings = dict(zip([v.name for v in body.input], values, strict=True))
        outputs = inline_graph(ctx, body, bindings)
        condition, carried = outputs[0], outputs[1 : 1 + len(carried)]
        for k, value in enumerate(outputs[1 + len(carried) :]):
            scans[k].append(value)
    _bind_outputs(ctx, node.output[: len(carried)], carried, where)
    for output, rows in zip(node.output[len(carried) :], scans, strict=True):
        if not output:
            continue
        if not rows:
            raise UnsupportedError(f"{where}: a scan output of a loop that never runs")
        stacked = [emit_reshape(ctx, r, (1, *ctx.type(r).shape)) for r in rows]
        ctx.emit("Concat", stacked, [output], axis=0)


def _known_bool_or_raise(ctx: ImportContext, value: str, where: str) -> bool:
    ctx.value(value, "condition of a loop unrolled at compile time")
    return _known_bool(ctx, value, where)


# --- Scan ----------------------------------------------------------------------------------


def convert_scan(ctx: ImportContext, node: onnx.NodeProto, attrs: Attrs) -> None:
    where = f"node {node.name!r} (Scan)"
    body = attrs.get("body")
    scanned = attrs.get("num_scan_inputs")
    states = len(node.input) - scanned
    outputs = len(node.output) - states
    if states < 0 or outputs < 0:
        raise ModelFormatError(f"{where}: more scan inputs than inputs")
    inputs = list(node.input)
    in_axes = _axes(attrs.get("scan_input_axes"), [ctx.type(v).rank for v in inputs[states:]])
    in_dirs = tuple(attrs.get("scan_input_directions") or (0,) * scanned)
    out_dirs = tuple(attrs.get("scan_output_directions") or (0,) * outputs)
    lengths = {ctx.type(v).shape[a] for v, a in zip(inputs[states:], in_axes, strict=True)}
    if len(lengths) != 1:
        raise ModelFormatError(f"{where}: its scan inputs differ in length: {sorted(lengths)}")
    steps = lengths.pop()
    slice_types = [
        TensorType(tuple(d for k, d in enumerate(ctx.type(v).shape) if k != a), ctx.type(v).dtype)
        for v, a in zip(inputs[states:], in_axes, strict=True)
    ]
    state_types = [ctx.type(v) for v in inputs[:states]]
    graph, captured = _native_body(ctx, body, state_types + slice_types, where)
    out_ranks = [graph.types[v].rank + 1 for v in graph.outputs[states:]]
    layout = _ScanLayout(
        in_axes, in_dirs, _axes(attrs.get("scan_output_axes"), out_ranks), out_dirs
    )
    _emit_scan(ctx, inputs, list(node.output), graph, captured, steps, states, layout)


def _native_body(ctx, body, input_types, where) -> tuple[Graph, list[str]]:
    try:
        graph, captured = import_body(ctx, body, input_types, where)
    except NotConstantError as err:
        raise UnsupportedError(
            f"{where}: the body needs {err.value!r} at compile time (it decides a shape); a "
            "scan body must have the same shapes at every step"
        ) from None
    return graph, captured


@dataclasses.dataclass(frozen=True)
class _ScanLayout:
    """Which axis each scanned input and scan output steps along, and in which direction."""

    in_axes: tuple[int, ...]
    in_dirs: tuple[int, ...]
    out_axes: tuple[int, ...]
    out_dirs: tuple[int, ...]


def _emit_scan(ctx, inputs, outputs, graph, captured, steps, states, layout: _ScanLayout):
    if steps == 0:
        _bind_outputs(ctx, outputs[:states], inputs[:states], "an empty scan")
        scans = zip(outputs[states:], graph.outputs[states:], layout.out_axes, strict=True)
        for output, value, axis in scans:
            if output:
                typ = graph.types[value]
                empty = np.zeros((*typ.shape[:axis], 0, *typ.shape[axis:]), typ.dtype)
                ctx.add_constant(empty, name=output)
        return
    ctx.emit(
        "Loop",
        [*inputs, *captured],
        list(outputs),
        body=graph,
        steps=steps,
        num_states=states,
        num_scan_inputs=len(inputs) - states,
        scan_input_axes=tuple(layout.in_axes),
        scan_input_directions=tuple(layout.in_dirs),
        scan_output_axes=tuple(layout.out_axes),
        scan_output_directions=tuple(layout.out_dirs),
        iteration_input=0,
        guarded=0,
    )


def _axes(given, ranks: Sequence[int]) -> tuple[int, ...]:
    axes = list(given) if given else [0] * len(ranks)
    if len(axes) != len(ranks):
        raise ModelFormatError(f"scan axes {axes} do not match {len(ranks)} scanned values")
    for axis, rank in zip(axes, ranks, strict=True):
        if not -rank <= axis < rank:
            raise ModelFormatError(f"scan axis {axis} is out of range for rank {rank}")
    return tuple(a % r for a, r in zip(axes, ranks, strict=True))


def convert_scan_8(ctx: ImportContext, node: onnx.NodeProto, attrs: Attrs) -> None:
    """Opset 8: a leading batch axis on every state and scan input, and optional per-entry
    sequence lengths. Each batch entry is its own scan over its slices."""
    where = f"node {node.name!r} (Scan)"
    body = attrs.get("body")
    scanned = attrs.get("num_scan_inputs")
    lengths_value = node.input[0]
    inputs = list(node.input[1:])
    states = len(inputs) - scanned
    in_dirs = tuple(attrs.get("directions") or (0,) * scanned)
    batch = ctx.type(inputs[0]).shape[0]
    steps = ctx.type(inputs[states]).shape[1]
    if lengths_value:
        lengths = np.asarray(ctx.value(lengths_value, "sequence_lens"))
        if np.any(lengths != steps):
            raise UnsupportedError(f"{where}: sequence_lens shorter than the sequence")
    # Every batch entry's slices have the same types: one body serves them all.
    entry_types = [TensorType(ctx.type(v).shape[1:], ctx.type(v).dtype) for v in inputs]
    slice_types = [TensorType(t.shape[1:], t.dtype) for t in entry_types[states:]]
    graph, captured = _native_body(ctx, body, entry_types[:states] + slice_types, where)
    scans = len(node.output) - states
    layout = _ScanLayout((0,) * scanned, in_dirs, (0,) * scans, (0,) * scans)
    per_entry: list[list[str]] = [[] for _ in node.output]
    for b in range(batch):
        index = ctx.add_constant(np.array(b, dtype=np.int64), prefix="batch")
        entry = [ctx.emit("Gather", [v, index], 1, axis=0) for v in inputs]
        outs = [ctx.fresh(f"{o or 'unused'}_b{b}") for o in node.output]
        _emit_scan(ctx, entry, outs, graph, captured, steps, states, layout)
        for k, value in enumerate(outs):
            per_entry[k].append(emit_reshape(ctx, value, (1, *ctx.type(value).shape)))
    for output, values in zip(node.output, per_entry, strict=True):
        if output:
            ctx.emit("Concat", values, [output], axis=0)


CONVERTERS: dict[str, dict[int, Converter]] = {
    "If": {1: convert_if},
    "Loop": {1: convert_loop},
    "Scan": {8: convert_scan_8, 9: convert_scan},
}
