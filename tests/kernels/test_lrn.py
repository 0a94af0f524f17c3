"""LRN against ONNX Runtime; the exponents of the networks that use it run as square roots."""

from __future__ import annotations

import onnxruntime as ort
import pytest
from onnx import helper

import compiler_core
from compiler_core.build import build_kernels
from compiler_core.frontend.onnx import import_model
from compiler_core.loop.ir import Binary
from compiler_core.loop.transform import stmt_exprs, walk_exprs, walk_stmts
from compiler_core.passes.pipeline import optimize
from compiler_core.runtime import load
from compiler_core.target import host_target
from tests.conftest import FLOAT, assert_close_to_scale, make_model
from tests.kernels.test_conv_family import rand

SHAPE = [1, 12, 7, 9]


def lrn_model(beta: float, size: int = 5):
    node = helper.make_node("LRN", ["x"], ["y"], size=size, alpha=5e-2, beta=beta, bias=2.0)
    return make_model([node], [("x", FLOAT, SHAPE)], [("y", FLOAT, SHAPE)])


def powers(model) -> int:
    graph = optimize(import_model(model), target=host_target())
    (kernel,) = build_kernels(graph, host_target())
    exprs = [e for s in walk_stmts(kernel.func.body) for x in stmt_exprs(s) for e in walk_exprs(x)]
    return sum(isinstance(e, Binary) and e.op == "pow" for e in exprs)


@pytest.mark.parametrize(("beta", "size"), [(0.75, 5), (0.5, 3), (1.0, 5), (0.6, 3)])
def test_lrn_matches_onnxruntime(beta, size):
    model = lrn_model(beta, size)
    x = rand(*SHAPE, scale=3.0)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = session.run(None, {"x": x})[0]
    actual = load(compiler_core.compile(model)).run({"x": x})["y"]
    assert_close_to_scale(actual, expected, rtol=1e-6, label=f"beta {beta}")


@pytest.mark.parametrize(
    ("beta", "calls_pow"), [(0.75, False), (0.5, False), (1.0, False), (0.6, True)]
)
def test_only_other_exponents_call_pow(beta, calls_pow):
    assert (powers(lrn_model(beta)) > 0) == calls_pow
