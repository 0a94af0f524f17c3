"""Loop: a body graph run for a static number of steps, carrying states between steps.

ONNX's Scan and Loop both import to it (compiler_core/frontend/convert_control.py). Inputs,
in order: the states' initial values, the scanned inputs, then the outer values the body
captures. The body's inputs follow the same order, after the iteration number when
`iteration_input` is set; its outputs are the new states, then one slice per scan output.
Outputs: the final states, then the scan outputs (the per-step slices stacked along
`scan_output_axes`, walked backwards where the direction is 1).

With `guarded`, state 0 is a boolean condition: a step whose condition is false changes no
state (ONNX Loop's early exit, with `steps` as the trip count's static bound).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from compiler_core.graph.ir import Graph, Node, OpKind, TensorType
from compiler_core.graph.ops.base import OpDef, ShapeError, opdef


def body_of(node: Node) -> Graph:
    return node.attr("body").graph


def scan_output_types(node: Node) -> list[TensorType]:
    """Each scan output: the body's per-step slice with the steps inserted at its axis."""
    body, states, steps = body_of(node), node.attr("num_states"), node.attr("steps")
    types = []
    for value, axis in zip(body.outputs[states:], node.attr("scan_output_axes"), strict=True):
        slice_type = body.types[value]
        shape = (*slice_type.shape[:axis], steps, *slice_type.shape[axis:])
        types.append(TensorType(shape, slice_type.dtype))
    return types


def _loop_rule(node: Node, types: Sequence[TensorType | None]) -> list[TensorType]:
    body, states = body_of(node), node.attr("num_states")
    outs = []
    for k in range(states):
        produced = body.types[body.outputs[k]]
        if produced != types[k]:
            raise ShapeError(
                f"state {k} enters the body as {types[k]} but leaves it as {produced}; a loop "
                "state must keep its type"
            )
        outs.append(types[k])
    return outs + scan_output_types(node)


def _scan_slice(array: np.ndarray, axis: int, index: int) -> np.ndarray:
    return np.take(array, index, axis=axis)


def _loop(node: Node, args: Sequence[np.ndarray | None]) -> list[np.ndarray]:
    # The executor runs graphs with this table: imported here, not at module level.
    from compiler_core.reference.executor import run_graph

    body, steps = body_of(node), node.attr("steps")
    states_n, scans_n = node.attr("num_states"), node.attr("num_scan_inputs")
    states = [np.asarray(a) for a in args[:states_n]]
    scanned = args[states_n : states_n + scans_n]
    captured = list(args[states_n + scans_n :])
    directions = node.attr("scan_input_directions")
    axes = node.attr("scan_input_axes")
    slices: list[list[np.ndarray]] = [[] for _ in body.outputs[states_n:]]
    for t in range(steps):
        if node.attr("guarded") and not bool(states[0]):
            break
        step_inputs = [np.array(t, dtype=np.int64)] if node.attr("iteration_input") else []
        step_inputs += states
        for x, axis, backward in zip(scanned, axes, directions, strict=True):
            step_inputs.append(_scan_slice(x, axis, steps - 1 - t if backward else t))
        results = run_graph(body, dict(zip(body.inputs, step_inputs + captured, strict=True)))
        outputs = [results[name] for name in body.outputs]
        states = outputs[:states_n]
        for k, value in enumerate(outputs[states_n:]):
            slices[k].append(value)
    stacked = []
    for k, (axis, backward) in enumerate(
        zip(node.attr("scan_output_axes"), node.attr("scan_output_directions"), strict=True)
    ):
        rows = slices[k][::-1] if backward else slices[k]
        stacked.append(np.stack(rows, axis=axis))
    return states + stacked


OPS: dict[str, OpDef] = {"Loop": opdef("Loop", OpKind.OPAQUE, _loop_rule, _loop)}
