"""Converters for the recurrent operators: RNN, GRU and LSTM.

One converter serves every opset version: later versions only added attributes (GRU's
linear_before_reset in 3, layout in 14) whose defaults give the earlier behaviour, and opset 1's
`output_sequence` only says whether Y is wanted, which the node's outputs already say.
"""

from __future__ import annotations

from compiler_core.frontend.common import UnsupportedError
from compiler_core.frontend.convert_utils import Converter, all_inputs, all_outputs
from compiler_core.graph.ops.recurrent import (
    ACTIVATIONS,
    DEFAULT_ACTIVATIONS,
    OUTPUT_COUNT,
    USES_ALPHA,
    USES_BETA,
)

DIRECTIONS = ("forward", "reverse", "bidirectional")
# Activation names are matched case-insensitively, as runtimes do.
_CANONICAL = {name.lower(): name for name in ACTIVATIONS}


def _activation_names(node, attrs, directions: int) -> list[str]:
    defaults = DEFAULT_ACTIVATIONS[node.op_type]
    names = list(attrs.get("activations") or defaults * directions)
    if len(names) == len(defaults) and directions == 2:
        names = names * 2  # one set given for a bidirectional node: the same for both
    if len(names) != len(defaults) * directions:
        raise UnsupportedError(
            f"node {node.name!r} ({node.op_type}): expected {len(defaults) * directions} "
            f"activations, got {names}"
        )
    unknown = [n for n in names if n.lower() not in _CANONICAL]
    if unknown:
        raise UnsupportedError(
            f"node {node.name!r} ({node.op_type}): activation(s) {unknown} are not supported"
        )
    return [_CANONICAL[n.lower()] for n in names]


def _activation_parameters(names, given, uses, default_index: int) -> tuple[float, ...]:
    """One alpha (or beta) per activation: the given values are consumed in order by the
    activations that use one; the rest take their operator's default."""
    pending = list(given or [])
    values = []
    for name in names:
        if name in uses and pending:
            values.append(float(pending.pop(0)))
        else:
            values.append(float(ACTIVATIONS[name][default_index]))
    return tuple(values)


def convert_recurrent(ctx, node, attrs):
    attrs.ignore("output_sequence")
    direction = attrs.get("direction", "forward")
    if direction not in DIRECTIONS:
        raise UnsupportedError(f"node {node.name!r} ({node.op_type}): direction {direction!r}")
    directions = 2 if direction == "bidirectional" else 1
    hidden_size = attrs.get("hidden_size") or ctx.type(node.input[2]).shape[-1]
    names = _activation_names(node, attrs, directions)
    values = {
        "direction": direction,
        "hidden_size": int(hidden_size),
        "layout": attrs.get("layout", 0),
        "activations": tuple(names),
        "activation_alpha": _activation_parameters(
            names, attrs.get("activation_alpha"), USES_ALPHA, 1
        ),
        "activation_beta": _activation_parameters(
            names, attrs.get("activation_beta"), USES_BETA, 2
        ),
    }
    if attrs.get("clip") is not None:
        values["clip"] = float(attrs.get("clip"))
    if node.op_type == "LSTM":
        values["input_forget"] = attrs.get("input_forget", 0)
    if node.op_type == "GRU":
        values["linear_before_reset"] = attrs.get("linear_before_reset", 0)
    outputs = all_outputs(node)
    outputs += [""] * (OUTPUT_COUNT[node.op_type] - len(outputs))
    ctx.emit(node.op_type, all_inputs(node), outputs, **values)


CONVERTERS: dict[str, dict[int, Converter]] = {
    "RNN": {1: convert_recurrent},
    "GRU": {1: convert_recurrent},
    "LSTM": {1: convert_recurrent},
}
