"""ONNX model -> graph IR.

`load_model` reads and validates the file (size checks happen before any tensor is
materialized); `import_model` converts every node with the opset-versioned converter table in
`onnx_ops`, gives every value a concrete type, and propagates small known values so that the
exporter's shape arithmetic (Shape -> Gather -> Concat -> Reshape) resolves to static
attributes.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import TensorProto

from compiler_core.frontend.common import (  # noqa: F401 - re-exported: the frontend's API
    DEFAULT_DOMAINS,
    NUMPY_TO_ONNX,
    ONNX_TO_NUMPY,
    ImportContext,
    KilnImportError,
    ModelFormatError,
    NotConstantError,
    ShapeBindingError,
    UnsupportedError,
    infer_node,
    onnx_dtype_name,
    tensor_to_array,
)
from compiler_core.frontend.onnx_ops import convert_node, outside_known_domains
from compiler_core.graph.ir import Graph, TensorType

# 11 is the floor the product promises; older models import where their operators' semantics
# are converted (the ONNX model zoo's opset-9 graphs are).
MIN_OPSET = 1
MAX_OPSET = onnx.defs.onnx_opset_version()
# A single tensor larger than this is refused: protects against absurd declared sizes.
MAX_TENSOR_BYTES = 8 << 30


class DefaultedShapeWarning(UserWarning):
    """An input's symbolic batch dimension, left unbound, was compiled as 1."""


DEFAULT_BATCH = 1


def defaulted_shapes(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]] | None):
    """The inputs whose unbound symbolic batch axis importing sets to DEFAULT_BATCH, with the
    shapes they get (what a manifest records of a build without `shapes=`)."""
    result = {}
    for value in model.graph.input:
        if value.name in (shapes or {}) or not value.type.HasField("tensor_type"):
            continue
        dims = value.type.tensor_type.shape.dim
        symbolic_batch = len(dims) > 1 and not dims[0].HasField("dim_value")
        if symbolic_batch and all(d.HasField("dim_value") for d in dims[1:]):
            result[value.name] = [DEFAULT_BATCH, *(d.dim_value for d in dims[1:])]
    return result


# --- loading and validation ------------------------------------------------------------------


def load_model(source: str | os.PathLike | bytes | onnx.ModelProto) -> onnx.ModelProto:
    """Parse and validate an ONNX model; external data is read only from inside its folder."""
    if isinstance(source, onnx.ModelProto):
        model, base_dir = source, None
    elif isinstance(source, (bytes, bytearray)):
        model, base_dir = _parse(bytes(source), "<bytes>"), None
    else:
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"no ONNX model at {str(path)!r}")
        model, base_dir = _parse(path.read_bytes(), str(path)), path.resolve().parent
    _check_structure(model)
    for tensor in _all_tensors(model.graph):
        _check_tensor_size(tensor, base_dir)
    _load_external_data(model, base_dir)
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as err:
        _raise_unsupported_node(model)
        raise ModelFormatError(f"ONNX checker rejected the model: {_first_line(err)}") from None
    return model


def _raise_unsupported_node(model: onnx.ModelProto) -> None:
    """Turn a checker failure caused by an unknown operator or attribute into an error that
    names the node, the op type and the opset."""
    opsets = {op.domain or "": op.version for op in model.opset_import}
    for node in model.graph.node:
        domain = node.domain or ""
        version = opsets.get("" if domain == "ai.onnx" else domain)
        where = f"node {node.name!r}: operator {node.op_type}"
        if outside_known_domains(node):
            raise UnsupportedError(
                f"{where} in domain {domain!r} is outside the default ONNX domain; not supported"
            )
        schema_domain = "" if domain in DEFAULT_DOMAINS else domain
        if version is None or not onnx.defs.has(node.op_type, version, schema_domain):
            raise UnsupportedError(f"{where} (opset {version}) is not an ONNX operator")
        schema = onnx.defs.get_schema(node.op_type, version, schema_domain)
        unknown = sorted(a.name for a in node.attribute if a.name not in schema.attributes)
        if unknown:
            raise UnsupportedError(
                f"{where} (opset {version}) attribute(s) {', '.join(unknown)} not supported"
            )


def _parse(data: bytes, origin: str) -> onnx.ModelProto:
    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError) as err:
        raise ModelFormatError(
            f"{origin} is not a valid ONNX model (malformed or truncated protobuf: {err})"
        ) from None
    return model


def _check_structure(model: onnx.ModelProto) -> None:
    if not model.HasField("graph") or (
        not model.graph.node and not model.graph.output and not model.graph.input
    ):
        raise ModelFormatError("the file holds no ONNX graph (malformed or truncated model)")
    if model.ir_version <= 0:
        raise ModelFormatError("the model has no IR version (malformed or truncated model)")


def _first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _all_tensors(graph: onnx.GraphProto):
    yield from graph.initializer
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _all_tensors(attr.g)
            for sub in attr.graphs:
                yield from _all_tensors(sub)


def _declared_nbytes(tensor: TensorProto) -> int:
    dims = list(tensor.dims)
    if any(d < 0 for d in dims):
        raise ModelFormatError(f"tensor {tensor.name!r} has a negative dimension {dims}")
    count = int(np.prod(dims, dtype=np.float64)) if dims else 1
    itemsize = np.dtype(ONNX_TO_NUMPY.get(tensor.data_type, "uint8")).itemsize
    return count * itemsize


def _element_count(tensor: TensorProto) -> int:
    return int(np.prod(list(tensor.dims), dtype=np.float64)) if tensor.dims else 1


def _check_tensor_size(tensor: TensorProto, base_dir: Path | None) -> None:
    """Refuse a tensor whose bytes do not match its declared shape, before allocating it."""
    nbytes = _declared_nbytes(tensor)
    if nbytes > MAX_TENSOR_BYTES:
        raise ModelFormatError(f"tensor {tensor.name!r} declares {nbytes} bytes, over the limit")
    if tensor.data_location == TensorProto.EXTERNAL:
        _external_location(tensor, base_dir, nbytes)
        return
    if tensor.data_type not in ONNX_TO_NUMPY:
        return  # unsupported types are reported where they are used
    if tensor.HasField("raw_data"):
        if len(tensor.raw_data) != nbytes:
            raise ModelFormatError(
                f"tensor {tensor.name!r} declares shape {list(tensor.dims)} "
                f"({nbytes} bytes) but holds {len(tensor.raw_data)} bytes"
            )
        return
    # Typed storage (float_data, int32_data, ...) keeps one element per slot.
    field = onnx.helper.tensor_dtype_to_field(tensor.data_type)
    held = len(getattr(tensor, field))
    expected = _element_count(tensor)
    if held != expected:
        raise ModelFormatError(
            f"tensor {tensor.name!r} declares shape {list(tensor.dims)} ({expected} elements) "
            f"but holds {held}"
        )


def _external_location(tensor: TensorProto, base_dir: Path | None, nbytes: int):
    info = {entry.key: entry.value for entry in tensor.external_data}
    location = info.get("location", "")
    if base_dir is None:
        raise ModelFormatError(
            f"tensor {tensor.name!r} uses external data but the model was not loaded from a file"
        )
    candidate = Path(location)
    resolved = (base_dir / candidate).resolve()
    if not location or candidate.is_absolute() or not resolved.is_relative_to(base_dir):
        raise ModelFormatError(
            f"tensor {tensor.name!r}: external data location {location!r} points outside "
            f"the model's folder {str(base_dir)!r}; refused"
        )
    if not resolved.is_file():
        raise ModelFormatError(f"tensor {tensor.name!r}: external data file {location!r} missing")
    offset = int(info.get("offset", 0))
    length = int(info.get("length", nbytes))
    if length != nbytes:
        raise ModelFormatError(
            f"tensor {tensor.name!r}: external data length {length} does not match the "
            f"declared {nbytes} bytes"
        )
    if offset < 0 or offset + length > resolved.stat().st_size:
        raise ModelFormatError(
            f"tensor {tensor.name!r}: external data {location!r} is shorter than "
            f"offset {offset} + length {length}"
        )
    return resolved, offset, length


def _load_external_data(model: onnx.ModelProto, base_dir: Path | None) -> None:
    for tensor in _all_tensors(model.graph):
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        path, offset, length = _external_location(tensor, base_dir, _declared_nbytes(tensor))
        with open(path, "rb") as f:
            f.seek(offset)
            tensor.raw_data = f.read(length)
        del tensor.external_data[:]
        tensor.data_location = TensorProto.DEFAULT


# --- conversion --------------------------------------------------------------------------------


def _input_type(value: onnx.ValueInfoProto, shapes: Mapping[str, Sequence[int]]) -> TensorType:
    if not value.type.HasField("tensor_type"):
        kind = value.type.WhichOneof("value")
        raise UnsupportedError(f"input {value.name!r} is a {kind}; only tensors are supported")
    tensor_type = value.type.tensor_type
    dtype = onnx_dtype_name(tensor_type.elem_type)
    bound = shapes.get(value.name)
    if not tensor_type.HasField("shape"):
        if bound is None:
            raise ShapeBindingError(
                f"input {value.name!r} has no declared shape; bind it with "
                f"shapes={{{value.name!r}: [...]}}"
            )
        return TensorType(tuple(bound), dtype)
    dims = tensor_type.shape.dim
    if bound is not None:
        bound = tuple(int(d) for d in bound)
        if len(bound) != len(dims):
            raise ShapeBindingError(
                f"input {value.name!r} has rank {len(dims)} but shapes= gives {list(bound)}"
            )
        for declared, given in zip(dims, bound, strict=True):
            if declared.HasField("dim_value") and declared.dim_value != given:
                raise ShapeBindingError(
                    f"input {value.name!r} has static shape {_dims_text(dims)} but shapes= "
                    f"gives {list(bound)}"
                )
        return TensorType(bound, dtype)
    shape = []
    for i, dim in enumerate(dims):
        if dim.HasField("dim_value"):
            shape.append(dim.dim_value)
        elif i == 0 and len(dims) > 1:
            # An unbound batch axis compiles for batch 1, as trtexec does, and says so; any
            # other symbolic dimension has no such default.
            shape.append(DEFAULT_BATCH)
            warnings.warn(
                f"input {value.name!r} has a symbolic batch dimension "
                f"{dim.dim_param or '?'!r}: compiled for batch {DEFAULT_BATCH} (bind it with "
                f"shapes={{{value.name!r}: [...]}} or use batch buckets)",
                DefaultedShapeWarning,
                stacklevel=4,
            )
        else:
            label = dim.dim_param or "?"
            raise ShapeBindingError(
                f"input {value.name!r} has symbolic dimension {label!r} (axis {i}) in shape "
                f"{_dims_text(dims)}; bind it with shapes={{{value.name!r}: [...]}}"
            )
    return TensorType(tuple(shape), dtype)


def _dims_text(dims) -> str:
    labels = [str(d.dim_value) if d.HasField("dim_value") else d.dim_param or "?" for d in dims]
    return "[" + ",".join(labels) + "]"


def default_opset(model: onnx.ModelProto) -> int:
    versions = [op.version for op in model.opset_import if op.domain in DEFAULT_DOMAINS]
    if not versions:
        raise UnsupportedError("the model imports no default-domain (ai.onnx) opset")
    version = max(versions)
    if not MIN_OPSET <= version <= MAX_OPSET:
        raise UnsupportedError(
            f"opset {version} is not supported (Kiln supports ai.onnx opsets "
            f"{MIN_OPSET}..{MAX_OPSET})"
        )
    return version


def import_model(
    source: str | os.PathLike | bytes | onnx.ModelProto,
    shapes: Mapping[str, Sequence[int]] | None = None,
    constants: Mapping[str, np.ndarray] | None = None,
) -> Graph:
    """Convert an ONNX model to a typed graph.

    `shapes` binds input shapes (required for symbolic dims); `constants` binds graph inputs
    to fixed values (they become constants, as a shape-deciding operand must be).
    """
    model = load_model(source)
    shapes = dict(shapes or {})
    constants = dict(constants or {})
    opset = default_opset(model)
    graph_proto = model.graph
    taken = {v.name for v in graph_proto.input} | {t.name for t in graph_proto.initializer}
    for node in graph_proto.node:
        taken.update(node.output)
    ctx = ImportContext(opset, taken, convert_checked)
    ctx.domain_opsets = {
        op.domain: op.version for op in model.opset_import if op.domain not in DEFAULT_DOMAINS
    }

    for tensor in graph_proto.initializer:
        ctx.add_constant(tensor_to_array(tensor), name=tensor.name)
    inputs = []
    for value in graph_proto.input:
        if value.name in ctx.constants:
            continue  # IR < 4 lists initializers as inputs too
        if value.name in constants:
            array = np.asarray(constants[value.name])
            ctx.add_constant(array.astype(_input_type_dtype(value)), name=value.name)
            continue
        ctx.types[value.name] = _input_type(value, shapes)
        inputs.append(value.name)

    for node in graph_proto.node:
        ctx.current = node
        convert_checked(ctx, node)
    ctx.current = None

    outputs = [v.name for v in graph_proto.output]
    for name in outputs:
        if name not in ctx.types:
            raise ModelFormatError(f"graph output {name!r} is never produced")
    return Graph(
        name=graph_proto.name or "model",
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        nodes=tuple(ctx.nodes),
        types=ctx.types,
        constants=ctx.constants,
    ).pruned()


def convert_checked(ctx: ImportContext, node: onnx.NodeProto) -> None:
    """Convert one node into `ctx` after the checks every node passes."""
    if outside_known_domains(node):
        raise UnsupportedError(
            f"node {node.name!r}: operator {node.domain}.{node.op_type} is outside the "
            "default ONNX domain; not supported"
        )
    _check_type_constraints(ctx, node)
    convert_node(ctx, node)


def _check_type_constraints(ctx: ImportContext, node: onnx.NodeProto) -> None:
    """Inputs that the operator's schema ties to one type variable (Conv's X, W and B are all
    `T`) must have one element type: a float64 weight on a float32 input is a malformed model,
    and would otherwise surface as a codegen failure deep in the build."""
    if not onnx.defs.has(node.op_type, ctx.opset, ""):
        return  # the converter names the unsupported operator
    schema = onnx.defs.get_schema(node.op_type, ctx.opset, "")
    formals = schema.inputs
    seen: dict[str, tuple[str, str]] = {}  # type variable -> (first input, its dtype)
    for k, value in enumerate(node.input):
        if not value or value not in ctx.types or not formals:
            continue
        formal = formals[min(k, len(formals) - 1)]
        variadic = formal.option == onnx.defs.OpSchema.FormalParameterOption.Variadic
        if variadic and not formal.is_homogeneous:
            continue  # each input of a heterogeneous list (Loop's carried values) has its own
        variable = formal.type_str
        if variable not in {c.type_param_str for c in schema.type_constraints}:
            continue  # a fixed type (tensor(int64), say): the converter checks it
        dtype = ctx.types[value].dtype
        first, first_dtype = seen.setdefault(variable, (value, dtype))
        if dtype != first_dtype:
            raise ModelFormatError(
                f"node {node.name!r} ({node.op_type}): inputs {first!r} ({first_dtype}) and "
                f"{value!r} ({dtype}) must have the same element type {variable}"
            )


def _input_type_dtype(value: onnx.ValueInfoProto) -> str:
    return onnx_dtype_name(value.type.tensor_type.elem_type)
