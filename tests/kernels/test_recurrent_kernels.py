"""Native RNN, GRU and LSTM kernels agree with the numpy reference (directions, layouts,
sequence_lens, omitted outputs, activations, clip, peepholes, linear_before_reset)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from compiler_core.compiler import compile_graph
from compiler_core.frontend.onnx import import_model
from compiler_core.passes.pipeline import optimize
from compiler_core.reference import run_graph
from compiler_core.runtime import load
from compiler_core.target import parse_target
from tests.conftest import FLOAT, loop_structure, make_model

INT32 = TensorProto.INT32
GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def recurrent_model(op, *, steps, batch, size, hidden, direction="forward", layout=0,
                    lengths=False, initial=False, peepholes=False, outputs=(1, 1, 1), seed=0,
                    scale=0.5, **attrs):  # fmt: skip
    """One recurrent node; X (and sequence_lens, initial states) are graph inputs, the weights
    initializers. `outputs` flags which of Y, Y_h (, Y_c) the node produces."""
    rng = np.random.default_rng(seed)
    dirs = 2 if direction == "bidirectional" else 1
    gates = GATES[op]
    x_shape = [batch, steps, size] if layout else [steps, batch, size]
    state_shape = [batch, dirs, hidden] if layout else [dirs, batch, hidden]
    y_shape = [batch, steps, dirs, hidden] if layout else [steps, dirs, batch, hidden]
    inits = {
        "w": rng.standard_normal((dirs, gates * hidden, size)).astype(np.float32) * scale,
        "r": rng.standard_normal((dirs, gates * hidden, hidden)).astype(np.float32) * scale,
        "b": rng.standard_normal((dirs, 2 * gates * hidden)).astype(np.float32) * scale,
    }
    graph_inputs = [("x", FLOAT, x_shape)]
    names = ["x", "w", "r", "b", "", ""]
    if lengths:
        graph_inputs.append(("lens", INT32, [batch]))
        names[4] = "lens"
    if initial:
        graph_inputs.append(("h0", FLOAT, state_shape))
        names[5] = "h0"
        if op == "LSTM":
            graph_inputs.append(("c0", FLOAT, state_shape))
            names.append("c0")
    if peepholes:
        names += [""] * (7 - len(names)) + ["p"]
        inits["p"] = rng.standard_normal((dirs, 3 * hidden)).astype(np.float32) * 0.5
    while names[-1] == "":
        names.pop()
    out_names = ["y", "y_h", "y_c"][: len(outputs) if op == "LSTM" else 2]
    node_outputs = [n if flag else "" for n, flag in zip(out_names, outputs, strict=False)]
    while node_outputs[-1] == "":
        node_outputs.pop()
    shapes = {"y": y_shape, "y_h": state_shape, "y_c": state_shape}
    node = helper.make_node(
        op, names, node_outputs, name=op.lower(), hidden_size=hidden, direction=direction,
        layout=layout, **attrs,
    )  # fmt: skip
    graph_outputs = [(n, FLOAT, shapes[n]) for n in node_outputs if n]
    return make_model([node], graph_inputs, graph_outputs, inits, opset=14)


def check(model, feeds, rtol=1e-5, atol=1e-5):
    graph = optimize(import_model(model))
    feeds = {n: feeds[n] for n in graph.inputs}
    expected = run_graph(graph, feeds)
    module = load(compile_graph(graph, parse_target("llvm"), verify=False))
    actual = module.run(feeds)
    for name in graph.outputs:
        np.testing.assert_allclose(actual[name], expected[name], rtol=rtol, atol=atol)
    return expected


def random_feeds(steps, batch, size, hidden, dirs, layout=0, lengths=None, seed=1):
    rng = np.random.default_rng(seed)
    x_shape = (batch, steps, size) if layout else (steps, batch, size)
    state = (batch, dirs, hidden) if layout else (dirs, batch, hidden)
    feeds = {
        "x": rng.standard_normal(x_shape).astype(np.float32),
        "h0": rng.standard_normal(state).astype(np.float32),
        "c0": rng.standard_normal(state).astype(np.float32),
    }
    if lengths is not None:
        feeds["lens"] = np.asarray(lengths, dtype=np.int32)
    return feeds


def test_lstm_bidirectional_with_sequence_lens_peepholes_and_initial_states():
    model = recurrent_model(
        "LSTM", steps=4, batch=3, size=5, hidden=3, direction="bidirectional",
        lengths=True, initial=True, peepholes=True,
    )  # fmt: skip
    expected = check(model, random_feeds(4, 3, 5, 3, 2, lengths=[4, 2, 0]))
    y = expected["y"]
    # Steps past an entry's length emit zeros, and an empty sequence's final states are zeros.
    assert np.all(y[2:, :, 1] == 0) and np.all(y[:, :, 2] == 0)
    assert np.all(expected["y_c"][:, 2] == 0)


def test_lstm_batch_first_input_forget_only_final_cell():
    model = recurrent_model(
        "LSTM", steps=3, batch=2, size=4, hidden=2, direction="reverse", layout=1,
        initial=True, outputs=(0, 0, 1), input_forget=1,
    )  # fmt: skip
    check(model, random_feeds(3, 2, 4, 2, 1, layout=1))


@pytest.mark.parametrize("linear_before_reset", [0, 1])
def test_gru_reverse_with_sequence_lens_and_omitted_y(linear_before_reset):
    model = recurrent_model(
        "GRU", steps=5, batch=3, size=4, hidden=3, direction="reverse", lengths=True,
        initial=True, outputs=(0, 1), linear_before_reset=linear_before_reset,
    )  # fmt: skip
    check(model, random_feeds(5, 3, 4, 3, 1, lengths=[5, 3, 1]))


def test_gru_bidirectional_linear_before_reset():
    model = recurrent_model(
        "GRU", steps=3, batch=2, size=3, hidden=4, direction="bidirectional",
        linear_before_reset=1,
    )  # fmt: skip
    check(model, random_feeds(3, 2, 3, 4, 2))


def test_rnn_batch_first_with_clip_and_custom_activations():
    model = recurrent_model(
        "RNN", steps=4, batch=2, size=3, hidden=4, direction="bidirectional", layout=1,
        initial=True, clip=0.7, activations=["LeakyRelu", "ScaledTanh"],
        activation_alpha=[0.1, 1.5], activation_beta=[0.8],
    )  # fmt: skip
    check(model, random_feeds(4, 2, 3, 4, 2, layout=1))


@pytest.mark.parametrize("activation", ["Sigmoid", "HardSigmoid", "Elu", "Softsign", "Softplus"])
def test_rnn_activations_with_sequence_lens(activation):
    model = recurrent_model(
        "RNN", steps=3, batch=2, size=3, hidden=2, lengths=True, outputs=(1, 0),
        activations=[activation],
    )  # fmt: skip
    check(model, random_feeds(3, 2, 3, 2, 1, lengths=[1, 3]))


def test_a_512_step_lstm_is_one_loop_and_matches_onnxruntime():
    """A long sequence compiles to the kernel of a short one (one loop over the steps, not an
    unrolled cell per step) and agrees with ORT's float32 LSTM after 512 steps. Weights at
    PyTorch's scale (1/sqrt(hidden)): at the other tests' 0.5 the dynamics are chaotic over
    hundreds of steps, and float32 rounding differences grow without bound in any runtime."""
    import onnxruntime as ort

    from compiler_core.build import build_kernels

    stores, time_loops = {}, {}
    for steps in (4, 512):
        model = recurrent_model(
            "LSTM", steps=steps, batch=1, size=32, hidden=48, initial=True, scale=48**-0.5
        )
        graph = optimize(import_model(model))
        (kernel,) = build_kernels(graph, parse_target("llvm"))
        stores[steps], time_loops[steps] = loop_structure(kernel.func)
    assert stores[4] == stores[512]
    assert time_loops == {4: [4], 512: [512]}
    feeds = random_feeds(512, 1, 32, 48, 1)
    feeds = {n: feeds[n] for n in graph.inputs}
    module = load(compile_graph(graph, parse_target("llvm")))
    actual = module.run(feeds)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    for name, want in zip(names, session.run(None, feeds), strict=True):
        np.testing.assert_allclose(actual[name], want, rtol=1e-4, atol=1e-5)


def test_a_recurrence_for_a_gpu_target_is_refused_with_the_reason():
    from compiler_core.target import TargetError

    graph = optimize(import_model(recurrent_model("LSTM", steps=3, batch=1, size=4, hidden=2)))
    with pytest.raises(TargetError, match="recurrence .* has no GPU kernel yet"):
        compile_graph(graph, parse_target("cuda -arch=sm_90"))


@pytest.mark.parametrize("op", ["GRU", "LSTM"])
def test_weights_given_at_run_time_take_the_plain_products(op):
    """W and R as graph inputs, not initializers: no build-time packing, plain reductions."""
    from onnx import numpy_helper

    model = recurrent_model(op, steps=4, batch=2, size=3, hidden=5, direction="bidirectional")
    feeds = random_feeds(4, 2, 3, 5, 2)
    for name in ("w", "r"):
        (init,) = [i for i in model.graph.initializer if i.name == name]
        array = numpy_helper.to_array(init)
        model.graph.initializer.remove(init)
        model.graph.input.append(helper.make_tensor_value_info(name, FLOAT, list(array.shape)))
        feeds[name] = array
    check(model, feeds)
