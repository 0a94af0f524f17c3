"""The codecs on their own, with tritonclient's encoder and decoder as the oracle."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tritonclient.http as triton

from runtime_server import protocol
from runtime_server.protocol import ProtocolError, RequestedOutput

# Every datatype the server speaks, with values at the edges of its range.
SAMPLES = {
    "BOOL": np.array([[True, False, True]]),
    "UINT8": np.array([0, 7, 255], np.uint8),
    "UINT16": np.array([0, 65535], np.uint16),
    "UINT32": np.array([0, 2**32 - 1], np.uint32),
    "UINT64": np.array([0, 2**64 - 1], np.uint64),
    "INT8": np.array([-128, 127], np.int8),
    "INT16": np.array([[-(2**15)], [2**15 - 1]], np.int16),
    "INT32": np.array([-(2**31), 2**31 - 1], np.int32),
    "INT64": np.array([-(2**63), 2**63 - 1], np.int64),
    "FP16": np.array([0.5, -2.0, 65504.0], np.float16),
    "FP32": np.arange(6, dtype=np.float32).reshape(2, 3) / 3,
    "FP64": np.array([[1e-300, -1e300]], np.float64),
}


def tritonclient_body(array: np.ndarray, datatype: str, binary: bool, **kwargs):
    tensor = triton.InferInput("t", list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    body, length = triton.InferenceServerClient.generate_request_body([tensor], **kwargs)
    return body, None if length is None else str(length)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("datatype", list(SAMPLES))
def test_decodes_what_tritonclient_encodes(datatype, binary):
    array = SAMPLES[datatype]
    request = protocol.decode_infer_request(*tritonclient_body(array, datatype, binary))
    decoded = request.inputs["t"]
    assert decoded.dtype == protocol.DATATYPES[datatype]
    np.testing.assert_array_equal(decoded, array)
    # tritonclient asks for binary outputs when it names none.
    assert request.outputs is None and request.binary_output


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("datatype", list(SAMPLES))
def test_tritonclient_decodes_what_we_encode(datatype, binary):
    array = SAMPLES[datatype]
    body, headers, media_type = protocol.encode_infer_response(
        "m", "3", {"t": array}, [RequestedOutput("t", binary)], request_id="r1"
    )
    length = headers.get(protocol.HEADER_LENGTH)
    assert media_type == (protocol.BINARY_TYPE if binary else protocol.JSON_TYPE)
    result = triton.InferenceServerClient.parse_response_body(
        body, header_length=None if length is None else int(length)
    )
    got = result.as_numpy("t").reshape(array.shape)
    assert got.dtype == array.dtype
    np.testing.assert_array_equal(got, array)
    assert result.get_response()["id"] == "r1"


def test_nested_and_flat_json_data_agree():
    nested = {
        "inputs": [{"name": "a", "shape": [2, 2], "datatype": "INT32", "data": [[1, 2], [3, 4]]}]
    }
    flat = {"inputs": [{"name": "a", "shape": [2, 2], "datatype": "INT32", "data": [1, 2, 3, 4]}]}
    a = protocol.decode_infer_request(json.dumps(nested).encode()).inputs["a"]
    b = protocol.decode_infer_request(json.dumps(flat).encode()).inputs["a"]
    np.testing.assert_array_equal(a, b)
    assert a.shape == (2, 2) and a.dtype == np.int32


def request(datatype: str, data, shape=None, **extra) -> bytes:
    shape = [len(data)] if shape is None else shape
    tensor = {"name": "t", "shape": shape, "datatype": datatype, "data": data, **extra}
    return json.dumps({"inputs": [tensor]}).encode()


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (request("UINT8", [256]), "out of range for UINT8"),
        (request("INT8", [-129]), "out of range for INT8"),
        (request("INT32", [1.5]), "not INT32"),
        (request("BOOL", [1, 0]), "not BOOL"),
        (request("FP32", ["1.0"]), "not FP32"),
        (request("FP32", [1.0], shape=[-1]), "non-negative integers"),
        (request("FP32", [1.0], shape="1"), "non-negative integers"),
        (request("BF16", [1.0]), "unsupported datatype 'BF16'"),
        (request("FP32", [1.0], parameters={"binary_data_size": 4}), "both 'data'"),
        (request("FP32", [1.0], parameters=[]), "JSON object"),
        (json.dumps({"inputs": [{"name": "t", "shape": [1], "datatype": "FP32"}]}), "neither"),
        (json.dumps({"inputs": [{"shape": [1], "datatype": "FP32", "data": [1]}]}), "'name'"),
        (json.dumps({"inputs": "x"}), "non-empty list"),
        (json.dumps({**json.loads(request("FP32", [1.0])), "id": 3}), "'id'"),
        (json.dumps({**json.loads(request("FP32", [1.0])), "outputs": {}}), "'outputs'"),
        (
            json.dumps(
                {**json.loads(request("FP32", [1.0])), "parameters": {"binary_data_output": 1}}
            ),
            "binary_data_output",
        ),
        (
            json.dumps(
                {
                    **json.loads(request("FP32", [1.0])),
                    "outputs": [{"name": "o", "parameters": {"classification": 2}}],
                }
            ),
            "classification",
        ),
    ],
)
def test_malformed_tensors_are_protocol_errors(body, needle):
    with pytest.raises(ProtocolError, match=needle.replace("[", r"\[").replace("(", r"\(")):
        protocol.decode_infer_request(body if isinstance(body, bytes) else body.encode())


def test_duplicate_input_is_an_error():
    tensor = {"name": "t", "shape": [1], "datatype": "FP32", "data": [1.0]}
    body = json.dumps({"inputs": [tensor, tensor]}).encode()
    with pytest.raises(ProtocolError, match="input 't' is given twice"):
        protocol.decode_infer_request(body)


def test_check_inputs_names_the_missing_input():
    signature = [("a", (1,), np.dtype(np.float32)), ("b", (1,), np.dtype(np.float32))]
    with pytest.raises(ProtocolError, match=r"missing input\(s\) \['b'\]"):
        protocol.check_inputs({"a": np.zeros(1, np.float32)}, signature, "m")


@pytest.mark.parametrize(
    ("datatype", "data", "needle"),
    [
        ("UINT64", [2**64], "out of range for UINT64"),
        ("INT64", [2**63], "out of range for INT64"),
        ("UINT64", [-1, 2**64 - 1], "out of range for UINT64"),
        ("INT64", [1.0, 2**64 - 1], "not INT64"),
    ],
)
def test_big_integers_are_range_checked_exactly(datatype, data, needle):
    with pytest.raises(ProtocolError, match=needle):
        protocol.decode_infer_request(request(datatype, data))
