"""Shared fixtures: the benchmark models in ../shared/models and small ONNX graph builders."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[1]
MODELS_DIR = REPO.parent / "shared" / "models"
LIGHT_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
SHARED_MODELS = ["resnet18", "mobilenet_v2", "encoder4", "mlp"]
LIGHT_MODELS = sorted(p.stem for p in LIGHT_DIR.glob("light_*.onnx"))


def shared_model(name: str) -> Path:
    path = MODELS_DIR / f"{name}.onnx"
    if not path.exists():
        pytest.fail(f"benchmark model {path} is missing: ../shared/models must sit beside the repo")
    return path


def make_model(nodes, inputs, outputs, initializers=(), opset=17, name="test"):
    """A small ONNX model from (name, elem_type, shape) tuples and numpy initializers."""
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in dict(initializers).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64
