"""Open Inference Protocol (KServe v2) codecs: JSON tensors and Triton's binary tensor extension.

No HTTP framework here: bytes in, numpy arrays out, and back. Every malformed request raises
`ProtocolError` with a message naming the offending input or output.

Binary tensor extension (as Triton documents it): when the `Inference-Header-Content-Length`
header is present, the body is that many bytes of JSON followed by raw little-endian tensors,
one per input that carries `"parameters": {"binary_data_size": k}`, in input order. Responses
use the same framing for outputs asked in binary (`"binary_data": true` on the output, or
`"binary_data_output": true` on the request).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

HEADER_LENGTH = "Inference-Header-Content-Length"
JSON_TYPE = "application/json"
BINARY_TYPE = "application/octet-stream"

DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
_NAMES_BY_DTYPE = {dtype: name for name, dtype in DATATYPES.items()}


class ProtocolError(ValueError):
    """A malformed inference request: the client's to fix (HTTP 400)."""


@dataclass(frozen=True)
class RequestedOutput:
    name: str
    binary: bool


@dataclass
class InferRequest:
    inputs: dict[str, np.ndarray]
    # None: every output of the model, in binary when `binary_output` is set.
    outputs: list[RequestedOutput] | None = None
    binary_output: bool = False
    id: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)


def datatype_of(dtype: np.dtype) -> str:
    try:
        return _NAMES_BY_DTYPE[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"numpy dtype {dtype} has no Open Inference Protocol datatype") from None


# -- requests ----------------------------------------------------------------------------


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """(JSON part, binary part) of a request body."""
    if header_length is None:
        return body, b""
    try:
        length = int(header_length)
    except ValueError:
        raise ProtocolError(f"{HEADER_LENGTH} must be an integer, got {header_length!r}") from None
    if length < 0 or length > len(body):
        raise ProtocolError(
            f"{HEADER_LENGTH} is {length} but the request body has {len(body)} bytes"
        )
    return body[:length], body[length:]


def parse_json_object(text: bytes, what: str = "request") -> dict:
    try:
        value = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ProtocolError(f"malformed JSON in the {what}: {err}") from None
    if not isinstance(value, dict):
        raise ProtocolError(f"the {what} must be a JSON object, not {type(value).__name__}")
    return value


def decode_infer_request(body: bytes, header_length: str | None = None) -> InferRequest:
    header, binary = split_body(body, header_length)
    request = parse_json_object(header, "inference request")
    parameters = _dict_field(request, "parameters", "the request")
    inputs = request.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise ProtocolError("the request needs 'inputs': a non-empty list of tensors")
    arrays: dict[str, np.ndarray] = {}
    offset = 0
    for index, tensor in enumerate(inputs):
        name, array, offset = _decode_input(tensor, index, binary, offset)
        if name in arrays:
            raise ProtocolError(f"input '{name}' is given twice")
        arrays[name] = array
    if offset != len(binary):
        raise ProtocolError(
            f"the request carries {len(binary) - offset} bytes of binary data that no input "
            "claims with parameters.binary_data_size"
        )
    request_id = request.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ProtocolError("the request 'id' must be a string")
    return InferRequest(
        inputs=arrays,
        outputs=_decode_outputs(request.get("outputs")),
        binary_output=_flag(parameters, "binary_data_output", "the request"),
        id=request_id,
        parameters=parameters,
    )


def _dict_field(obj: dict, key: str, owner: str) -> dict:
    value = obj.get(key, {})
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ProtocolError(f"'{key}' of {owner} must be a JSON object")
    return value


def _flag(parameters: dict, key: str, owner: str) -> bool:
    value = parameters.get(key, False)
    if not isinstance(value, bool):
        raise ProtocolError(f"parameter '{key}' of {owner} must be true or false")
    return value


def _decode_input(tensor: Any, index: int, binary: bytes, offset: int):
    """(name, array, new binary offset) of the index-th input tensor."""
    if not isinstance(tensor, dict):
        raise ProtocolError(f"inputs[{index}] must be a JSON object")
    name = tensor.get("name")
    if not isinstance(name, str) or not name:
        raise ProtocolError(f"inputs[{index}] needs a 'name' string")
    dtype = _datatype(tensor.get("datatype"), f"input '{name}'")
    shape = _shape(tensor.get("shape"), f"input '{name}'")
    parameters = _dict_field(tensor, "parameters", f"input '{name}'")
    size = parameters.get("binary_data_size")
    if size is None:
        if "data" not in tensor:
            raise ProtocolError(f"input '{name}' has neither 'data' nor binary_data_size")
        return name, _from_json(tensor["data"], dtype, shape, name), offset
    if "data" in tensor:
        raise ProtocolError(f"input '{name}' has both 'data' and binary_data_size")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ProtocolError(f"input '{name}': binary_data_size must be a non-negative integer")
    if offset + size > len(binary):
        raise ProtocolError(
            f"input '{name}': binary_data_size {size} runs past the end of the request body "
            f"({len(binary) - offset} bytes left)"
        )
    array = _from_binary(binary[offset : offset + size], dtype, shape, name)
    return name, array, offset + size


def _datatype(value: Any, owner: str) -> np.dtype:
    if value in DATATYPES:
        return DATATYPES[value]
    raise ProtocolError(
        f"{owner}: unsupported datatype {value!r}; supported: {', '.join(DATATYPES)}"
    )


def _shape(value: Any, owner: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    ):
        raise ProtocolError(f"{owner}: 'shape' must be a list of non-negative integers")
    return tuple(value)


def _from_binary(raw: bytes, dtype: np.dtype, shape: tuple[int, ...], name: str) -> np.ndarray:
    expected = math.prod(shape) * dtype.itemsize
    if len(raw) != expected:
        raise ProtocolError(
            f"input '{name}': binary_data_size is {len(raw)} bytes, but shape {list(shape)} of "
            f"{_NAMES_BY_DTYPE[dtype]} needs {expected}"
        )
    # The wire is little-endian; astype copies into a fresh, aligned, native array, which
    # the kernels may rely on (a slice of the body can start at any byte).
    return np.frombuffer(raw, dtype.newbyteorder("<")).astype(dtype).reshape(shape)


def _from_json(data: Any, dtype: np.dtype, shape: tuple[int, ...], name: str) -> np.ndarray:
    try:
        values = np.asarray(data)
        if dtype.kind in "iu" and values.dtype.kind in "fO":
            # Integers past int64 (or a mix of large unsigned and other values) come out as
            # float64 or object: keep them as exact Python ints to range-check them.
            values = np.array(data, dtype=object)
    except (ValueError, TypeError):
        raise ProtocolError(f"input '{name}': 'data' is not a rectangular list") from None
    if values.size != math.prod(shape):
        raise ProtocolError(
            f"input '{name}': 'data' has {values.size} elements, shape {list(shape)} "
            f"needs {math.prod(shape)}"
        )
    if values.size:
        _check_values(values, dtype, name)
    with np.errstate(over="ignore"):  # FP16 overflow becomes inf, as a cast on the client
        return values.astype(dtype).reshape(shape)


def _values_fit_kind(values: np.ndarray, dtype: np.dtype) -> bool:
    kind = values.dtype.kind
    if dtype.kind == "b":
        return kind == "b"
    if dtype.kind in "iu":
        if kind == "O":
            # type() rather than isinstance: JSON true/false are bools, not integers here.
            return all(type(v) is int for v in values.flat)
        return kind in "iu"
    return kind in "iuf"


def _check_values(values: np.ndarray, dtype: np.dtype, name: str) -> None:
    """JSON numbers must fit the declared datatype: no silent truncation or wrap-around."""
    datatype = _NAMES_BY_DTYPE[dtype]
    if not _values_fit_kind(values, dtype):
        raise ProtocolError(f"input '{name}': 'data' holds values that are not {datatype}")
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        if values.min() < info.min or values.max() > info.max:
            raise ProtocolError(f"input '{name}': 'data' holds values out of range for {datatype}")


def _decode_outputs(outputs: Any) -> list[RequestedOutput] | None:
    if outputs is None:
        return None
    if not isinstance(outputs, list):
        raise ProtocolError("'outputs' must be a list of {name, parameters} objects")
    requested = []
    for index, output in enumerate(outputs):
        if not isinstance(output, dict) or not isinstance(output.get("name"), str):
            raise ProtocolError(f"outputs[{index}] needs a 'name' string")
        name = output["name"]
        parameters = _dict_field(output, "parameters", f"output '{name}'")
        if parameters.get("classification"):
            raise ProtocolError(f"output '{name}': the classification extension is not supported")
        requested.append(
            RequestedOutput(name, _flag(parameters, "binary_data", f"output '{name}'"))
        )
    return requested


# -- validation against a model signature ------------------------------------------------


def check_inputs(inputs: Mapping[str, np.ndarray], signature, model: str) -> None:
    """Names, datatypes and shapes against the model's inputs, each error naming the input.
    A -1 in the signature (a bucketed archive's batch axis) takes any size; the repository
    checks that it fits the buckets."""
    expected = {name: (shape, dtype) for name, shape, dtype in signature}
    for name, array in inputs.items():
        if name not in expected:
            raise ProtocolError(
                f"unknown input '{name}' for model '{model}'; it expects {sorted(expected)}"
            )
        shape, dtype = expected[name]
        if array.dtype != dtype:
            raise ProtocolError(
                f"input '{name}' has datatype {datatype_of(array.dtype)}, "
                f"model '{model}' expects {datatype_of(dtype)}"
            )
        if len(array.shape) != len(shape) or any(
            want not in (-1, got) for got, want in zip(array.shape, shape, strict=True)
        ):
            raise ProtocolError(
                f"input '{name}' has shape {list(array.shape)}, "
                f"model '{model}' expects {list(shape)}"
            )
    missing = [name for name in expected if name not in inputs]
    if missing:
        raise ProtocolError(f"missing input(s) {missing} for model '{model}'")


def select_outputs(request: InferRequest, signature, model: str) -> list[RequestedOutput]:
    """The outputs to return, in order, each with its encoding."""
    names = [name for name, _, _ in signature]
    if request.outputs is None:
        return [RequestedOutput(name, request.binary_output) for name in names]
    for output in request.outputs:
        if output.name not in names:
            raise ProtocolError(
                f"unknown output '{output.name}' for model '{model}'; it has {names}"
            )
    return request.outputs


# -- responses ---------------------------------------------------------------------------


def encode_infer_response(
    model: str,
    version: str,
    outputs: Mapping[str, np.ndarray],
    selection: list[RequestedOutput],
    request_id: str | None = None,
) -> tuple[bytes, dict[str, str], str]:
    """(body, extra headers, media type) of an inference response."""
    header: dict[str, Any] = {"model_name": model, "model_version": version}
    if request_id is not None:
        header["id"] = request_id
    tensors, chunks = [], []
    for output in selection:
        array = outputs[output.name]
        tensor: dict[str, Any] = {
            "name": output.name,
            "datatype": datatype_of(array.dtype),
            "shape": list(array.shape),
        }
        if output.binary:
            raw = np.ascontiguousarray(array, array.dtype.newbyteorder("<")).tobytes()
            tensor["parameters"] = {"binary_data_size": len(raw)}
            chunks.append(raw)
        else:
            tensor["data"] = array.ravel().tolist()
        tensors.append(tensor)
    header["outputs"] = tensors
    text = json.dumps(header, separators=(",", ":")).encode()
    if not chunks:
        return text, {}, JSON_TYPE
    return text + b"".join(chunks), {HEADER_LENGTH: str(len(text))}, BINARY_TYPE


def tensor_metadata(signature) -> list[dict[str, Any]]:
    return [
        {"name": name, "datatype": datatype_of(dtype), "shape": list(shape)}
        for name, shape, dtype in signature
    ]
