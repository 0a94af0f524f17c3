"""Recurrent operators: RNN, LSTM and GRU (one layer, forward, reverse or bidirectional).

The Kiln nodes keep ONNX's input order (X, W, R, B, sequence_lens, initial_h, and for LSTM
initial_c, P) and always list every output ('' where unused). The frontend resolves the
attributes: `hidden_size`, `direction`, `layout`, one activation name per function and per
direction in `activations`, with `activation_alpha` / `activation_beta` filled in for each;
`clip` is present only when the model sets it.

The reference runs the recurrence in float64, one time step at a time, over the whole batch;
batch entries past their `sequence_lens` keep their state and emit zeros.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from compiler_core.graph.ir import OpKind, TensorType
from compiler_core.graph.ops.base import OpDef, ShapeError, opdef

# --- activation functions ----------------------------------------------------------------------


def _sigmoid(x, alpha, beta):
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # tanh form: no overflow for large |x|


def _softplus(x, alpha, beta):
    return np.logaddexp(0.0, x)


# name -> (function of (x, alpha, beta), default alpha, default beta)
ACTIVATIONS: dict[str, tuple[Callable, float, float]] = {
    "Relu": (lambda x, a, b: np.maximum(x, 0.0), 0.0, 0.0),
    "Tanh": (lambda x, a, b: np.tanh(x), 0.0, 0.0),
    "Sigmoid": (_sigmoid, 0.0, 0.0),
    "Affine": (lambda x, a, b: a * x + b, 1.0, 0.0),
    "LeakyRelu": (lambda x, a, b: np.where(x >= 0, x, a * x), 0.01, 0.0),
    "ThresholdedRelu": (lambda x, a, b: np.where(x >= a, x, 0.0), 1.0, 0.0),
    "ScaledTanh": (lambda x, a, b: a * np.tanh(b * x), 1.0, 1.0),
    "HardSigmoid": (lambda x, a, b: np.clip(a * x + b, 0.0, 1.0), 0.2, 0.5),
    "Elu": (lambda x, a, b: np.where(x >= 0, x, a * np.expm1(np.minimum(x, 0.0))), 1.0, 0.0),
    "Softsign": (lambda x, a, b: x / (1.0 + np.abs(x)), 0.0, 0.0),
    "Softplus": (_softplus, 0.0, 0.0),
}
# Which activations read alpha / beta: only those consume entries of activation_alpha/beta.
USES_ALPHA = frozenset(
    {"Affine", "LeakyRelu", "ThresholdedRelu", "ScaledTanh", "HardSigmoid", "Elu"}
)
USES_BETA = frozenset({"Affine", "ScaledTanh", "HardSigmoid"})

# Per operator: number of gates stacked in W/R, activation functions per direction, outputs,
# and the default activations (ONNX's equations).
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}
DEFAULT_ACTIVATIONS = {
    "RNN": ("Tanh",),
    "GRU": ("Sigmoid", "Tanh"),
    "LSTM": ("Sigmoid", "Tanh", "Tanh"),
}
OUTPUT_COUNT = {"RNN": 2, "GRU": 2, "LSTM": 3}


class Activation:
    """One activation function with its alpha and beta, clipping its input when asked."""

    def __init__(self, name: str, alpha: float, beta: float, clip: float | None):
        self.fn, self.alpha, self.beta, self.clip = ACTIVATIONS[name][0], alpha, beta, clip

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.clip is not None:
            x = np.clip(x, -self.clip, self.clip)
        return self.fn(x, self.alpha, self.beta)


def num_directions(node) -> int:
    return 2 if node.attr("direction", "forward") == "bidirectional" else 1


def _direction_activations(node, direction: int) -> list[Activation]:
    per_direction = len(DEFAULT_ACTIVATIONS[node.op])
    first = direction * per_direction
    names = node.attr("activations")[first : first + per_direction]
    alphas = node.attr("activation_alpha")[first : first + per_direction]
    betas = node.attr("activation_beta")[first : first + per_direction]
    clip = node.attr("clip", None)
    return [Activation(*spec, clip) for spec in zip(names, alphas, betas, strict=True)]


# --- cells: one time step for the whole batch ---------------------------------------------------
# Each cell gets the input projection x @ W^T + Wb for this step, the direction's weights, and
# the state tuple; it returns the new state tuple (hidden state first).


def _rnn_cell(projected, params, state, acts):
    (h,) = state
    (f,) = acts
    return (f(projected + h @ params["R"].T + params["Rb"]),)


def _gru_cell(projected, params, state, acts):
    (h,) = state
    f, g = acts
    x_z, x_r, x_h = np.split(projected, 3, axis=-1)
    rz, rr, rh = np.split(params["R"], 3)
    bz, br, bh = np.split(params["Rb"], 3)
    z = f(x_z + h @ rz.T + bz)
    r = f(x_r + h @ rr.T + br)
    if params["linear_before_reset"]:
        candidate = g(x_h + r * (h @ rh.T + bh))
    else:
        candidate = g(x_h + (r * h) @ rh.T + bh)
    return ((1.0 - z) * candidate + z * h,)


def _lstm_cell(projected, params, state, acts):
    h, c = state
    f, g, act_h = acts
    gates = projected + h @ params["R"].T + params["Rb"]
    x_i, x_o, x_f, x_c = np.split(gates, 4, axis=-1)
    p_i, p_o, p_f = np.split(params["P"], 3)
    input_gate = f(x_i + p_i * c)
    # input_forget couples the gates: what is let in is forgotten.
    forget_gate = 1.0 - input_gate if params["input_forget"] else f(x_f + p_f * c)
    cell = forget_gate * c + input_gate * g(x_c)
    output_gate = f(x_o + p_o * cell)
    return (output_gate * act_h(cell), cell)


CELLS = {"RNN": _rnn_cell, "GRU": _gru_cell, "LSTM": _lstm_cell}


# --- the recurrence ----------------------------------------------------------------------------


def _reverse_prefixes(seq: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Reverse each batch entry's first `length` steps (axis 0 is time, axis 1 batch).

    Steps past an entry's length stay where they are, so applying this twice is the identity:
    a reverse direction runs forward over the reversed input and reverses its output back.
    """
    steps = np.arange(seq.shape[0])[:, None]
    source = np.where(steps < lengths[None, :], lengths[None, :] - 1 - steps, steps)
    return seq[source, np.arange(seq.shape[1])[None, :]]


def _run_direction(node, x, lengths, params, state, acts):
    """Outputs (seq, batch, hidden) and the final state tuple of one direction."""
    cell = CELLS[node.op]
    projected = x @ params["W"].T + params["Wb"]
    outputs = np.zeros(x.shape[:2] + (state[0].shape[-1],))
    for step in range(x.shape[0]):
        active = (step < lengths)[:, None]
        new_state = cell(projected[step], params, state, acts)
        state = tuple(np.where(active, new, old) for new, old in zip(new_state, state, strict=True))
        outputs[step] = np.where(active, state[0], 0.0)
    # An empty sequence has no last step: its final states are zeros (as onnxruntime gives),
    # not the initial states.
    ran = (lengths > 0)[:, None]
    return outputs, tuple(np.where(ran, s, 0.0) for s in state)


def _optional(inputs, index: int) -> np.ndarray | None:
    """An optional input; trailing omitted inputs may be missing from the list altogether."""
    return inputs[index] if len(inputs) > index else None


def _direction_params(node, inputs, direction: int, hidden: int) -> dict:
    w, r, bias = inputs[1].astype(np.float64), inputs[2].astype(np.float64), _optional(inputs, 3)
    gates = GATES[node.op]
    bias = np.zeros((w.shape[0], 2 * gates * hidden)) if bias is None else bias.astype(np.float64)
    params = {
        "W": w[direction],
        "R": r[direction],
        "Wb": bias[direction, : gates * hidden],
        "Rb": bias[direction, gates * hidden :],
        "linear_before_reset": node.attr("linear_before_reset", 0),
        "input_forget": node.attr("input_forget", 0),
    }
    if node.op == "LSTM":
        peepholes = _optional(inputs, 7)
        params["P"] = (
            np.zeros(3 * hidden) if peepholes is None else peepholes[direction].astype(np.float64)
        )
    return params


def _initial_states(node, inputs, batch: int, hidden: int) -> list[np.ndarray]:
    """initial_h (and initial_c for LSTM) as (num_directions, batch, hidden), zeros if absent."""
    indices = [5, 6] if node.op == "LSTM" else [5]
    states = []
    for index in indices:
        value = _optional(inputs, index)
        if value is None:
            value = np.zeros((num_directions(node), batch, hidden))
        elif node.attr("layout", 0):
            value = value.transpose(1, 0, 2)
        states.append(value.astype(np.float64))
    return states


def _recurrent(node, inputs):
    x = inputs[0]
    if node.attr("layout", 0):
        x = x.transpose(1, 0, 2)  # (batch, seq, input) -> (seq, batch, input)
    seq_length, batch = x.shape[:2]
    hidden = node.attr("hidden_size")
    lengths = _optional(inputs, 4)
    lengths = np.full(batch, seq_length) if lengths is None else lengths.astype(np.int64)
    lengths = np.minimum(lengths, seq_length)
    initial = _initial_states(node, inputs, batch, hidden)
    reverse_only = node.attr("direction", "forward") == "reverse"
    sequences, finals = [], []
    for direction in range(num_directions(node)):
        backward = reverse_only or direction == 1
        steps = _reverse_prefixes(x, lengths) if backward else x
        params = _direction_params(node, inputs, direction, hidden)
        state = tuple(s[direction] for s in initial)
        acts = _direction_activations(node, direction)
        y, final = _run_direction(node, steps.astype(np.float64), lengths, params, state, acts)
        sequences.append(_reverse_prefixes(y, lengths) if backward else y)
        finals.append(final)
    y = np.stack(sequences, axis=1)  # (seq, num_directions, batch, hidden)
    states = [np.stack(s, axis=0) for s in zip(*finals, strict=True)]
    if node.attr("layout", 0):
        y = y.transpose(2, 0, 1, 3)
        states = [s.transpose(1, 0, 2) for s in states]
    return [a.astype(inputs[0].dtype) for a in [y, *states]]


def _recurrent_rule(node, types):
    x, w, r = types[0], types[1], types[2]
    hidden, dirs, gates = node.attr("hidden_size"), num_directions(node), GATES[node.op]
    if x.rank != 3:
        raise ShapeError(f"{node.op} input X must have rank 3, got {x}")
    seq_length, batch = (x.shape[1], x.shape[0]) if node.attr("layout", 0) else x.shape[:2]
    if w.shape != (dirs, gates * hidden, x.shape[2]):
        raise ShapeError(f"{node.op} W is {w}, expected ({dirs}, {gates * hidden}, {x.shape[2]})")
    if r.shape != (dirs, gates * hidden, hidden):
        raise ShapeError(f"{node.op} R is {r}, expected ({dirs}, {gates * hidden}, {hidden})")
    if node.attr("layout", 0):
        y, state = (batch, seq_length, dirs, hidden), (batch, dirs, hidden)
    else:
        y, state = (seq_length, dirs, batch, hidden), (dirs, batch, hidden)
    states = [TensorType(state, x.dtype)] * (OUTPUT_COUNT[node.op] - 1)
    return [TensorType(y, x.dtype), *states]


OPS: dict[str, OpDef] = {
    op: opdef(op, OpKind.OPAQUE, _recurrent_rule, _recurrent) for op in ("RNN", "GRU", "LSTM")
}
