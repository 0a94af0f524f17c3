"""Elementwise activations built from exp and log, against float64 over their whole range:
the stable Softplus, Mish's one-exp form, Log on every kind of input."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import scipy.special
from onnx import TensorProto, helper

import compiler_core
from compiler_core.runtime import load
from tests.conftest import FLOAT, make_model

X = np.concatenate(
    [np.linspace(-100.0, 100.0, 4001), np.linspace(-3.0, 3.0, 2001), [0.0, -0.0, 20.0, 88.8]]
).astype(np.float32)


def run_unary(op: str, x: np.ndarray, opset: int = 18, dtype=FLOAT) -> np.ndarray:
    node = helper.make_node(op, ["x"], ["y"])
    model = make_model([node], [("x", dtype, list(x.shape))], [("y", dtype, list(x.shape))],
                       opset=opset)  # fmt: skip
    return load(compiler_core.compile(model.SerializeToString())).run({"x": x})["y"]


def test_softplus_is_x_past_where_e_to_the_x_overflows():
    y = run_unary("Softplus", X)
    expected = np.logaddexp(0.0, X.astype(np.float64))
    np.testing.assert_allclose(y, expected, rtol=2e-6, atol=1e-30)
    assert y[X == 100][0] == 100 and np.isfinite(y).all()
    # ln1p(e^-|x|) as a polynomial: within a few ulps wherever the result is normal
    normal = expected > np.finfo(np.float32).tiny
    np.testing.assert_allclose(y[normal], expected[normal], rtol=4e-7)


def test_softplus_in_float64_keeps_its_precision():
    """Double precision takes Goldberg's ln1p (the polynomial is a float32 one)."""
    x = X.astype(np.float64)
    y = run_unary("Softplus", x, dtype=TensorProto.DOUBLE)
    np.testing.assert_allclose(y, np.logaddexp(0.0, x), rtol=1e-14, atol=1e-300)


def test_mish_in_one_exp_matches_its_definition():
    y = run_unary("Mish", X)
    x = X.astype(np.float64)
    expected = x * np.tanh(np.logaddexp(0.0, x))
    np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-30)
    assert np.isclose(y[X == 100][0], 100, rtol=1e-6) and np.isfinite(y).all()


@pytest.mark.parametrize("mish", [True, False])
def test_mish_and_softplus_keep_nan(mish):
    x = np.float32([np.nan, 1.0, -np.inf, np.inf] * 4)
    y = run_unary("Mish" if mish else "Softplus", x)
    assert np.isnan(y[0]) and np.isfinite(y[1])
    assert y[3] == np.inf


def test_log_of_positive_zero_negative_and_infinite_inputs():
    tiny = np.finfo(np.float32).smallest_subnormal
    x = np.concatenate([np.geomspace(tiny, 3e38, 4000), [0.0, -1.0, np.inf, np.nan, 1.0]])
    x = x.astype(np.float32)
    y = run_unary("Log", x, opset=17)
    positive = np.isfinite(x) & (x > 0)
    np.testing.assert_allclose(y[positive], np.log(x[positive].astype(np.float64)), rtol=3e-7)
    assert y[x == 0][0] == -np.inf and y[x == np.inf][0] == np.inf and y[x == 1][0] == 0
    assert np.isnan(y[x == -1][0]) and np.isnan(y[np.isnan(x)][0])


HALF_TYPES = {
    "float16": (TensorProto.FLOAT16, np.float16),
    "bfloat16": (TensorProto.BFLOAT16, ml_dtypes.bfloat16),
}


def ulp_of(half: str, values: np.ndarray) -> np.ndarray:
    """The spacing of the 16-bit type at each value (float64)."""
    if half == "float16":
        return np.spacing(np.abs(values).astype(np.float16)).astype(np.float64)
    # np.spacing knows no bfloat16: float32's, with 8 bits of mantissa instead of 24
    return np.spacing(np.abs(values).astype(np.float32)).astype(np.float64) * 2.0**16


FUNCTIONS = {"Exp": np.exp, "Sigmoid": scipy.special.expit, "Tanh": np.tanh, "Sin": np.sin}


@pytest.mark.parametrize("op", list(FUNCTIONS))
@pytest.mark.parametrize("half", list(HALF_TYPES))
def test_16_bit_transcendentals_are_computed_inline_in_float32(op, half):
    """A float16 or bfloat16 exp, sigmoid, tanh or sin is the float32 one rounded to the type:
    within an ulp of the type of float64's value (libm per lane before, 10-14x slower)."""
    proto, dtype = HALF_TYPES[half]
    x = np.linspace(-10.0, 10.0, 4096).astype(dtype)
    y = run_unary(op, x, opset=17, dtype=proto).astype(np.float64)
    expected = FUNCTIONS[op](x.astype(np.float64))
    assert np.all(np.abs(y - expected) <= ulp_of(half, expected) + 1e-30)


@pytest.mark.parametrize("half", list(HALF_TYPES))
@pytest.mark.parametrize("op", ["Atan", "Tan", "Asinh", "Cosh"])
def test_16_bit_functions_only_libm_has_run_in_float32(op, half):
    """libm has no 16-bit functions: these ran into a KeyError on float16 inputs, and on
    bfloat16 ones declared atanf over 16-bit integers (its memory type)."""
    proto, dtype = HALF_TYPES[half]
    x = np.linspace(-1.0, 1.0, 64).astype(dtype)
    y = run_unary(op, x, opset=17, dtype=proto).astype(np.float64)
    expected = getattr(np, {"Atan": "arctan", "Asinh": "arcsinh"}.get(op, op.lower()))(
        x.astype(np.float64)
    )
    assert np.all(np.abs(y - expected) <= ulp_of(half, expected))
