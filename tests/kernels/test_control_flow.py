"""If, Loop and Scan through native code, against ONNX Runtime; the forms Kiln refuses, with
their reasons."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler_core.build import build_kernels
from compiler_core.compiler import compile_graph
from compiler_core.frontend.common import NotConstantError, UnsupportedError
from compiler_core.frontend.onnx import import_model
from compiler_core.passes.pipeline import optimize
from compiler_core.reference import run_graph
from compiler_core.runtime import load
from compiler_core.target import parse_target
from tests.conftest import FLOAT, INT64, loop_structure, make_model

BOOL = TensorProto.BOOL


def value_info(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def run_both(model, feeds, constants=None, rtol=1e-5, atol=1e-5):
    """Kiln's native module and its reference executor against ORT; returns the graph."""
    graph = optimize(import_model(model, constants=constants))
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    ort_feeds = {**feeds, **(constants or {})}
    names = [o.name for o in session.get_outputs()]
    expected = dict(zip(names, session.run(None, ort_feeds), strict=True))
    graph_feeds = {n: feeds[n] for n in graph.inputs}
    module = load(compile_graph(graph, parse_target("llvm")))
    native = module.run(graph_feeds)
    reference = run_graph(graph, graph_feeds)
    for name, want in expected.items():
        np.testing.assert_allclose(native[name], want, rtol=rtol, atol=atol, err_msg=name)
        np.testing.assert_allclose(reference[name], want, rtol=rtol, atol=atol, err_msg=name)
    return graph


# --- Scan --------------------------------------------------------------------------------------


def rnn_scan_model(steps, size=8, hidden=16, reverse=False, out_axis=0, seed=0):
    """An Elman RNN written as a Scan: h' = tanh(x_t W + h R + b). W is an outer initializer
    the body captures, R a body initializer, b a body Constant."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((size, hidden)) / np.sqrt(size)).astype(np.float32)
    r = (rng.standard_normal((hidden, hidden)) / np.sqrt(hidden)).astype(np.float32)
    b = rng.standard_normal((1, hidden)).astype(np.float32) * 0.1
    body = helper.make_graph(
        [
            helper.make_node("MatMul", ["x_t", "w"], ["xw"]),
            helper.make_node("MatMul", ["h_in", "r"], ["hr"]),
            helper.make_node("Constant", [], ["b"], value=numpy_helper.from_array(b)),
            helper.make_node("Add", ["xw", "hr"], ["s"]),
            helper.make_node("Add", ["s", "b"], ["pre"]),
            helper.make_node("Tanh", ["pre"], ["h_out"]),
            helper.make_node("Identity", ["h_out"], ["y_t"]),
        ],
        "rnn_cell",
        [value_info("h_in", FLOAT, [1, hidden]), value_info("x_t", FLOAT, [1, size])],
        [value_info("h_out", FLOAT, [1, hidden]), value_info("y_t", FLOAT, [1, hidden])],
        [numpy_helper.from_array(r, "r")],
    )
    y_shape = [steps, 1, hidden] if out_axis == 0 else [1, steps, hidden]
    scan = helper.make_node(
        "Scan", ["h0", "x"], ["h_last", "ys"], body=body, num_scan_inputs=1,
        scan_input_directions=[int(reverse)], scan_output_axes=[out_axis],
    )  # fmt: skip
    return make_model(
        [scan],
        [("h0", FLOAT, [1, hidden]), ("x", FLOAT, [steps, 1, size])],
        [("h_last", FLOAT, [1, hidden]), ("ys", FLOAT, y_shape)],
        {"w": w},
        opset=17,
    )


def rnn_feeds(steps, size=8, hidden=16, seed=1):
    rng = np.random.default_rng(seed)
    return {
        "h0": rng.standard_normal((1, hidden)).astype(np.float32) * 0.1,
        "x": rng.standard_normal((steps, 1, size)).astype(np.float32),
    }


@pytest.mark.parametrize(("reverse", "out_axis"), [(False, 0), (True, 1)])
def test_a_scan_rnn_matches_onnxruntime(reverse, out_axis):
    run_both(rnn_scan_model(6, reverse=reverse, out_axis=out_axis), rnn_feeds(6), rtol=1e-4)


def test_a_long_scan_compiles_to_the_kernel_of_a_short_one():
    stores, loops = {}, {}
    for steps in (4, 512):
        graph = optimize(import_model(rnn_scan_model(steps)))
        (kernel,) = build_kernels(graph, parse_target("llvm"))
        stores[steps], loops[steps] = loop_structure(kernel.func)
    assert stores[4] == stores[512]
    assert loops == {4: [4], 512: [512]}
    run_both(rnn_scan_model(512), rnn_feeds(512), rtol=1e-4, atol=1e-5)


def test_scan_with_two_states_and_a_reversed_output():
    body = helper.make_graph(
        [
            helper.make_node("Add", ["sum_in", "x_t"], ["sum_out"]),
            helper.make_node("Max", ["max_in", "x_t"], ["max_out"]),
            helper.make_node("Mul", ["sum_out", "max_out"], ["y_t"]),
        ],
        "body",
        [value_info(n, FLOAT, [3]) for n in ("sum_in", "max_in", "x_t")],
        [value_info(n, FLOAT, [3]) for n in ("sum_out", "max_out", "y_t")],
    )
    node = helper.make_node(
        "Scan", ["s0", "m0", "x"], ["s", "m", "y"], body=body, num_scan_inputs=1,
        scan_input_axes=[1], scan_output_directions=[1],
    )  # fmt: skip
    model = make_model(
        [node],
        [("s0", FLOAT, [3]), ("m0", FLOAT, [3]), ("x", FLOAT, [3, 7])],
        [("s", FLOAT, [3]), ("m", FLOAT, [3]), ("y", FLOAT, [7, 3])],
    )
    rng = np.random.default_rng(3)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in
             (("s0", (3,)), ("m0", (3,)), ("x", (3, 7)))}  # fmt: skip
    run_both(model, feeds)


def test_a_scan_body_whose_shapes_depend_on_a_state_is_refused():
    body = helper.make_graph(
        [
            helper.make_node("Reshape", ["x_t", "shape_in"], ["r"]),
            helper.make_node("Identity", ["shape_in"], ["shape_out"]),
            helper.make_node("Identity", ["r"], ["y_t"]),
        ],
        "body",
        [value_info("shape_in", INT64, [2]), value_info("x_t", FLOAT, [6])],
        [value_info("shape_out", INT64, [2]), value_info("y_t", FLOAT, [2, 3])],
    )
    node = helper.make_node("Scan", ["shape0", "x"], ["shape", "y"], body=body, num_scan_inputs=1)
    model = make_model(
        [node],
        [("shape0", INT64, [2]), ("x", FLOAT, [4, 6])],
        [("shape", INT64, [2]), ("y", FLOAT, [4, 2, 3])],
    )
    with pytest.raises(UnsupportedError, match="same shapes at every step"):
        import_model(model)


# --- Loop --------------------------------------------------------------------------------------


def loop_model(body_nodes, carried, scans, cond_output="cond_in", extra_inputs=()):
    """Loop(M, cond, *carried) with a body over (i, cond_in, *carried) whose condition output
    is `cond_output`; `carried`/`scans` are (name, shape) of carried values and scan slices."""
    body = helper.make_graph(
        body_nodes + [helper.make_node("Identity", [cond_output], ["cond_out"])],
        "body",
        [value_info("i", INT64, []), value_info("cond_in", BOOL, [])]
        + [value_info(f"{n}_in", FLOAT, s) for n, s in carried],
        [value_info("cond_out", BOOL, [])]
        + [value_info(f"{n}_out", FLOAT, s) for n, s in carried]
        + [value_info(n, FLOAT, s) for n, s in scans],
    )
    node = helper.make_node(
        "Loop", ["m", "cond", *[f"{n}0" for n, _ in carried]],
        [f"{n}_final" for n, _ in carried] + [f"{n}s" for n, _ in scans], body=body,
    )  # fmt: skip
    inputs = [("m", INT64, []), ("cond", BOOL, [])] + [(f"{n}0", FLOAT, s) for n, s in carried]
    outputs = [(f"{n}_final", FLOAT, s) for n, s in carried] + [
        (f"{n}s", FLOAT, ["steps", *s]) for n, s in scans
    ]
    return make_model([node], inputs + list(extra_inputs), outputs)


def test_a_loop_using_its_iteration_number_is_one_native_loop():
    """y' = y * 0.9 + i * w (w captured from the outer graph); a scan output of y'."""
    nodes = [
        helper.make_node("Cast", ["i"], ["i_f"], to=FLOAT),
        helper.make_node("Mul", ["i_f", "w"], ["iw"]),
        helper.make_node("Constant", [], ["decay"], value_float=0.9),
        helper.make_node("Mul", ["y_in", "decay"], ["yd"]),
        helper.make_node("Add", ["yd", "iw"], ["y_out"]),
        helper.make_node("Identity", ["y_out"], ["y_t"]),
    ]
    model = loop_model(nodes, [("y", [4])], [("y_t", [4])], extra_inputs=[("w", FLOAT, [4])])
    rng = np.random.default_rng(0)
    feeds = {"y0": rng.standard_normal(4).astype(np.float32),
             "w": rng.standard_normal(4).astype(np.float32)}  # fmt: skip
    constants = {"m": np.array(10, np.int64), "cond": np.array(True)}
    graph = run_both(model, feeds, constants)
    assert graph.op_histogram().get("Loop") == 1


def test_a_loop_with_a_data_dependent_condition_stops_where_onnxruntime_does():
    """Halve x until its sum drops below 1, at most 50 times: the step count depends on x,
    and the condition is a run-time input too."""
    nodes = [
        helper.make_node("Constant", [], ["half"], value_float=0.5),
        helper.make_node("Mul", ["x_in", "half"], ["x_out"]),
        helper.make_node("ReduceSum", ["x_out"], ["total"], keepdims=0),
        helper.make_node("Constant", [], ["one"], value_float=1.0),
        helper.make_node("Greater", ["total", "one"], ["again"]),
    ]
    model = loop_model(nodes, [("x", [5])], [], cond_output="again")
    constants = {"m": np.array(50, np.int64)}
    for scale, go in ((100.0, True), (3.0, True), (100.0, False)):
        feeds = {"x0": np.full(5, scale, np.float32), "cond": np.array(go)}
        graph = run_both(model, feeds, constants)
    assert graph.op_histogram().get("Loop") == 1


def test_a_loop_slicing_by_its_iteration_number_is_unrolled():
    """The body's Slice bounds come from the iteration number (ONNX's own loop11 case): the
    shapes are static only per iteration, so the loop is unrolled at import."""
    x = np.arange(1, 6, dtype=np.float32)
    nodes = [
        helper.make_node("Constant", [], ["one"], value=numpy_helper.from_array(np.array([1]))),
        helper.make_node("Unsqueeze", ["i", "zero"], ["start"]),
        helper.make_node("Add", ["start", "one"], ["end"]),
        helper.make_node("Slice", ["table", "start", "end"], ["piece"]),
        helper.make_node("Add", ["y_in", "piece"], ["y_out"]),
        helper.make_node("Identity", ["y_out"], ["y_t"]),
    ]
    model = loop_model(nodes, [("y", [1])], [("y_t", [1])])
    model.graph.initializer.extend(
        [numpy_helper.from_array(x, "table"), numpy_helper.from_array(np.array([0]), "zero")]
    )
    graph = run_both(
        model, {"y0": np.array([0.5], np.float32)},
        {"m": np.array(5, np.int64), "cond": np.array(True)},
    )  # fmt: skip
    assert "Loop" not in graph.op_histogram()


def test_a_while_loop_with_scan_outputs_is_refused():
    nodes = [
        helper.make_node("ReduceSum", ["y_in"], ["total"], keepdims=0),
        helper.make_node("Constant", [], ["limit"], value_float=10.0),
        helper.make_node("Less", ["total", "limit"], ["again"]),
        helper.make_node("Identity", ["y_in"], ["y_out"]),
        helper.make_node("Identity", ["y_in"], ["y_t"]),
    ]
    model = loop_model(nodes, [("y", [2])], [("y_t", [2])], cond_output="again")
    with pytest.raises(UnsupportedError, match="depends on the data"):
        import_model(model, constants={"m": np.array(3, np.int64)})


def test_a_loop_whose_trip_count_is_not_known_asks_for_it():
    model = loop_model([helper.make_node("Identity", ["y_in"], ["y_out"])], [("y", [2])], [])
    with pytest.raises(NotConstantError, match="trip count") as info:
        import_model(model)
    assert info.value.value == "m"


# --- If ----------------------------------------------------------------------------------------


def if_model(then_shape=(3,), else_shape=(3,)):
    then_branch = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["t"])], "then", [], [value_info("t", FLOAT, ["n"])]
    )
    else_nodes = [helper.make_node("Neg", ["x"], ["e0"])]
    if else_shape != then_shape:
        else_nodes.append(helper.make_node("Concat", ["e0", "e0"], ["e"], axis=0))
    else:
        else_nodes.append(helper.make_node("Identity", ["e0"], ["e"]))
    else_branch = helper.make_graph(else_nodes, "else", [], [value_info("e", FLOAT, ["n"])])
    node = helper.make_node("If", ["c"], ["y"], then_branch=then_branch, else_branch=else_branch)
    return make_model([node], [("c", BOOL, []), ("x", FLOAT, list(then_shape))],
                      [("y", FLOAT, ["n"])])  # fmt: skip


@pytest.mark.parametrize("condition", [True, False])
def test_if_with_a_run_time_condition_selects_the_taken_branch(condition):
    x = np.array([-1.0, 2.0, -3.0], np.float32)
    graph = run_both(if_model(), {"c": np.array(condition), "x": x})
    assert "Where" in graph.op_histogram()


def test_if_with_a_known_condition_is_the_taken_branch_only():
    graph = optimize(import_model(if_model(), constants={"c": np.array(False)}))
    assert graph.op_histogram() == {"Neg": 1}


def test_if_whose_branches_differ_in_shape_needs_the_condition_at_compile_time():
    with pytest.raises(NotConstantError, match="decides its type") as info:
        import_model(if_model(else_shape=(6,)))
    assert info.value.value == "c"
    graph = optimize(import_model(if_model(else_shape=(6,)), constants={"c": np.array(False)}))
    assert graph.types["y"].shape == (6,)


def test_a_small_step_runs_on_one_thread_and_a_large_one_in_parallel():
    """A step's stages run once per step: below STEP_PARALLEL_MIN_WORK a parallel region's
    fork and join would cost more than the stage, so they stay serial; a large product in a
    step keeps its parallel loop."""
    from compiler_core.kernels.schedules import STEP_PARALLEL_MIN_WORK
    from compiler_core.schedule.primitives import Parallel

    def parallel_step_stages(hidden):
        graph = optimize(import_model(rnn_scan_model(4, size=8, hidden=hidden)))
        (kernel,) = build_kernels(graph, parse_target("llvm"))
        in_step = {s.name for s in kernel.stages if s.note("in_step")}
        assert in_step
        loops = [r.loop for r in kernel.schedule if isinstance(r, Parallel)]
        return {n for n in in_step if any(loop.startswith(n + "_") for loop in loops)}

    assert 16 * 16 < STEP_PARALLEL_MIN_WORK < 512 * 512
    assert parallel_step_stages(16) == set()
    assert parallel_step_stages(512)  # the 512x512 recurrent product


def test_a_scan_inside_a_scan_body_runs_on_the_reference_and_is_refused_natively():
    from compiler_core.kernels import KernelError

    inner = helper.make_graph(
        [helper.make_node("Add", ["a_in", "v"], ["a_out"])],
        "inner",
        [value_info("a_in", FLOAT, [2]), value_info("v", FLOAT, [2])],
        [value_info("a_out", FLOAT, [2])],
    )
    outer = helper.make_graph(
        [
            helper.make_node("Scan", ["s_in", "row"], ["s_out"], body=inner, num_scan_inputs=1),
        ],
        "outer",
        [value_info("s_in", FLOAT, [2]), value_info("row", FLOAT, [3, 2])],
        [value_info("s_out", FLOAT, [2])],
    )
    node = helper.make_node("Scan", ["s0", "x"], ["s"], body=outer, num_scan_inputs=1)
    model = make_model([node], [("s0", FLOAT, [2]), ("x", FLOAT, [4, 3, 2])], [("s", FLOAT, [2])])
    x = np.arange(24, dtype=np.float32).reshape(4, 3, 2)
    graph = optimize(import_model(model))
    result = run_graph(graph, {"s0": np.zeros(2, np.float32), "x": x})
    np.testing.assert_allclose(result["s"], x.sum(axis=(0, 1)))
    with pytest.raises(KernelError, match="nested recurrences are not supported"):
        compile_graph(graph, parse_target("llvm"))


def test_an_opset_8_scan_runs_each_batch_entry():
    """Opset 8's Scan carries a batch axis on its states and inputs: one body for all entries,
    one loop per entry."""
    body = helper.make_graph(
        [
            helper.make_node("Add", ["sum_in", "x_t"], ["sum_out"]),
            helper.make_node("Identity", ["sum_out"], ["y_t"]),
        ],
        "body",
        [value_info("sum_in", FLOAT, [2]), value_info("x_t", FLOAT, [2])],
        [value_info("sum_out", FLOAT, [2]), value_info("y_t", FLOAT, [2])],
    )
    node = helper.make_node(
        "Scan", ["", "s0", "x"], ["s", "y"], body=body, num_scan_inputs=1, directions=[1]
    )
    model = make_model(
        [node],
        [("s0", FLOAT, [3, 2]), ("x", FLOAT, [3, 4, 2])],
        [("s", FLOAT, [3, 2]), ("y", FLOAT, [3, 4, 2])],
        opset=8,
    )
    rng = np.random.default_rng(5)
    feeds = {"s0": rng.standard_normal((3, 2)).astype(np.float32),
             "x": rng.standard_normal((3, 4, 2)).astype(np.float32)}  # fmt: skip
    graph = run_both(model, feeds)
    assert graph.op_histogram()["Loop"] == 3
