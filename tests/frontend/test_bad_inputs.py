"""Bad input gets a clear error, raised before anything large is allocated."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from compiler_core.frontend.onnx import (
    DefaultedShapeWarning,
    ModelFormatError,
    NotConstantError,
    ShapeBindingError,
    UnsupportedError,
    defaulted_shapes,
    import_model,
)
from tests.conftest import FLOAT, make_model, shared_model


def relu_model(**kwargs):
    return make_model(
        [helper.make_node("Relu", ["x"], ["y"], name="act")],
        [("x", FLOAT, [2, 3])],
        [("y", FLOAT, [2, 3])],
        **kwargs,
    )


def test_truncated_file_is_refused(tmp_path):
    data = shared_model("mlp").read_bytes()
    path = tmp_path / "truncated.onnx"
    path.write_bytes(data[: len(data) // 3])
    with pytest.raises(ModelFormatError, match="truncated|malformed|declares"):
        import_model(path, shapes={"x": [1, 784]})


def test_random_bytes_are_refused(tmp_path):
    path = tmp_path / "noise.onnx"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelFormatError):
        import_model(path)


def test_empty_file_is_refused(tmp_path):
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    with pytest.raises(ModelFormatError, match="no ONNX graph"):
        import_model(path)


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.onnx"):
        import_model(tmp_path / "nowhere.onnx")


def test_unsupported_operator_names_node_op_and_opset():
    # A while loop (no trip count) has no static bound: the one Loop form Kiln refuses.
    body = helper.make_graph(
        [
            helper.make_node("Not", ["cond_in"], ["cond_out"]),
            helper.make_node("Identity", ["y_in"], ["y_out"]),
        ],
        "body",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("y_in", FLOAT, [1]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("y_out", FLOAT, [1]),
        ],
    )
    model = make_model(
        [helper.make_node("Loop", ["", "c", "x"], ["y"], name="the_loop", body=body)],
        [("c", TensorProto.BOOL, []), ("x", FLOAT, [1])],
        [("y", FLOAT, [1])],
    )
    with pytest.raises(UnsupportedError) as info:
        import_model(model)
    assert "the_loop" in str(info.value)
    assert "Loop" in str(info.value)
    assert "trip count" in str(info.value)


def test_unknown_operator_names_node_op_and_opset():
    model = make_model(
        [helper.make_node("FancyNewOp", ["x"], ["y"], name="fancy")],
        [("x", FLOAT, [2])],
        [("y", FLOAT, [2])],
    )
    with pytest.raises(UnsupportedError, match=r"'fancy'.*FancyNewOp.*opset 17"):
        import_model(model)


def test_unsupported_attribute_is_named():
    node = helper.make_node("Relu", ["x"], ["y"], name="act", flavour="spicy")
    model = make_model([node], [("x", FLOAT, [2])], [("y", FLOAT, [2])])
    with pytest.raises(UnsupportedError, match=r"'act'.*Relu.*opset 17.*flavour"):
        import_model(model)


def test_custom_domain_is_refused():
    node = helper.make_node("Relu", ["x"], ["y"], name="act", domain="com.example")
    model = make_model([node], [("x", FLOAT, [2])], [("y", FLOAT, [2])])
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(UnsupportedError, match="com.example.Relu"):
        import_model(model)


def test_opset_newer_than_supported_is_refused():
    model = relu_model(opset=onnx.defs.onnx_opset_version() + 5)
    with pytest.raises((UnsupportedError, ModelFormatError), match="opset"):
        import_model(model)


def _external_model(tmp_path, location: str):
    weight = TensorProto(name="w", data_type=FLOAT, dims=[4])
    weight.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", "16")):
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    model = make_model(
        [helper.make_node("Add", ["x", "w"], ["y"], name="add")],
        [("x", FLOAT, [4])],
        [("y", FLOAT, [4])],
    )
    model.graph.initializer.append(weight)
    folder = tmp_path / "model"
    folder.mkdir()
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def test_external_data_path_traversal_is_refused(tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\0" * 16)
    path = _external_model(tmp_path, "../secret.bin")
    with pytest.raises(ModelFormatError, match="outside the model's folder"):
        import_model(path)


def test_external_data_absolute_path_is_refused(tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\0" * 16)
    path = _external_model(tmp_path, str(secret))
    with pytest.raises(ModelFormatError, match="outside the model's folder"):
        import_model(path)


def test_external_data_inside_the_folder_loads(tmp_path):
    path = _external_model(tmp_path, "weights.bin")
    (path.parent / "weights.bin").write_bytes(np.arange(4, dtype=np.float32).tobytes())
    graph = import_model(path)
    assert graph.constants["w"].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_external_data_shorter_than_declared_is_refused(tmp_path):
    path = _external_model(tmp_path, "weights.bin")
    (path.parent / "weights.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ModelFormatError, match="shorter"):
        import_model(path)


def test_tensor_size_mismatch_is_refused_before_allocation():
    model = relu_model()
    # Declares 10^12 floats but carries 16 bytes: must fail on the size check, not in numpy.
    tensor = TensorProto(name="huge", data_type=FLOAT, dims=[1000000, 1000000], raw_data=b"\0" * 16)
    model.graph.initializer.append(tensor)
    with pytest.raises(ModelFormatError, match="huge"):
        import_model(model.SerializeToString())


def test_raw_data_shorter_than_shape_is_refused():
    model = relu_model()
    tensor = TensorProto(name="w", data_type=FLOAT, dims=[4, 4], raw_data=b"\0" * 12)
    model.graph.initializer.append(tensor)
    with pytest.raises(ModelFormatError, match=r"'w'.*\[4, 4\].*64 bytes.*12"):
        import_model(model.SerializeToString())


def test_unbound_batch_compiles_as_one_and_says_so():
    with pytest.warns(DefaultedShapeWarning, match=r"'x'.*'batch'.*batch 1"):
        graph = import_model(shared_model("mlp"))
    assert graph.types["x"].shape == (1, 784)
    model = onnx.load(str(shared_model("mlp")))
    assert defaulted_shapes(model, None) == {"x": [1, 784]}
    assert defaulted_shapes(model, {"x": [4, 784]}) == {}


def test_missing_shape_binding_names_input_and_dim():
    """A symbolic dimension other than the batch has no default."""
    model = onnx.load(str(shared_model("mlp")))
    dims = model.graph.input[0].type.tensor_type.shape.dim
    dims[0].dim_value = 2
    dims[1].dim_param = "features"
    with pytest.raises(ShapeBindingError, match=r"'x'.*'features'.*axis 1"):
        import_model(model)


def test_shape_binding_of_wrong_rank_is_refused():
    with pytest.raises(ShapeBindingError, match="rank 2"):
        import_model(shared_model("mlp"), shapes={"x": [784]})


def test_shape_binding_contradicting_static_dims_is_refused():
    with pytest.raises(ShapeBindingError, match="static shape"):
        import_model(shared_model("resnet18"), shapes={"input": [1, 3, 32, 32]})


def test_non_constant_shape_operand_is_named():
    model = make_model(
        [helper.make_node("Reshape", ["x", "s"], ["y"], name="reshape")],
        [("x", FLOAT, [2, 3]), ("s", TensorProto.INT64, [2])],
        [("y", FLOAT, [3, 2])],
    )
    with pytest.raises(NotConstantError, match=r"'reshape'.*Reshape shape.*'s'"):
        import_model(model)


def test_failed_import_leaves_the_source_file_untouched(tmp_path):
    path = tmp_path / "model.onnx"
    path.write_bytes(relu_model(opset=99).SerializeToString())
    before = path.read_bytes()
    with pytest.raises((UnsupportedError, ModelFormatError)):
        import_model(path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["model.onnx"]


def test_operands_of_one_type_variable_must_share_their_element_type():
    """Conv's X and W are both `T`: a float64 weight on a float32 input is rejected at import,
    naming the node and both operands, not left to fail in codegen."""
    model = make_model(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="stem")],
        [("x", FLOAT, [1, 3, 8, 8])],
        [("y", FLOAT, [1, 4, 6, 6])],
        {"w": np.ones((4, 3, 3, 3), np.float64)},
    )
    with pytest.raises(ModelFormatError, match=r"'stem' \(Conv\).*'x' \(float32\).*'w'"):
        import_model(model)
