"""Read an uploaded ONNX file well enough to accept or refuse it, and describe it.

The api never imports the compiler: this is the protobuf and the onnx checker only. A model
that passes here can still fail to compile (an unsupported operator, say); its compile job
then fails with the node named.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError


class InvalidModelError(ValueError):
    pass


def _dims(value: onnx.ValueInfoProto) -> list[int | str]:
    shape = value.type.tensor_type.shape
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in shape.dim]


def _spec(value: onnx.ValueInfoProto) -> dict:
    elem = value.type.tensor_type.elem_type
    dtype = onnx.TensorProto.DataType.Name(elem).lower() if elem else "unknown"
    return {"name": value.name, "dtype": dtype, "shape": _dims(value)}


def read_model(path: Path) -> onnx.ModelProto:
    data = path.read_bytes()
    if not data:
        raise InvalidModelError("the upload is empty")
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError) as err:
        raise InvalidModelError(f"not an ONNX model (protobuf does not decode: {err})") from None
    if model.ir_version <= 0 or not model.HasField("graph"):
        raise InvalidModelError("not an ONNX model (no IR version or no graph)")
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as err:
        raise InvalidModelError(f"invalid ONNX model: {_checker_message(err)}") from None
    return model


def _checker_message(err: Exception) -> str:
    """The checker's first line, with its context line when there is one: the context names
    the node (`Bad node spec for node. Name: n1 OpType: Foo`)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    context = next((line for line in lines[1:] if line.startswith("==> Context:")), None)
    if context is None:
        return lines[0]
    return f"{lines[0]} ({context.removeprefix('==> Context:').strip()[:300]})"


def describe(model: onnx.ModelProto) -> dict:
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    return {
        "ir_version": model.ir_version,
        "opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
        "producer": " ".join(filter(None, [model.producer_name, model.producer_version])) or None,
        "inputs": [_spec(v) for v in graph.input if v.name not in initializers],
        "outputs": [_spec(v) for v in graph.output],
        "op_histogram": dict(Counter(node.op_type for node in graph.node).most_common()),
        "nodes": len(graph.node),
    }
