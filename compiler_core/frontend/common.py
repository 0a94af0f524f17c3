"""What the ONNX frontend's modules share: its errors, element types, the conversion context
converters emit into, and node type inference. `onnx.py` (loading, validation, the import loop)
and the `convert_*` modules (one per operator family) both import from here, so neither imports
the other back."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from compiler_core.errors import UserError
from compiler_core.graph.ir import DTYPES, NameGenerator, Node, TensorType
from compiler_core.graph.ops import OP_TABLE
from compiler_core.graph.ops.base import ShapeError

# Values up to this many elements are evaluated during import when their inputs are known;
# that is what resolves shape arithmetic. Larger ones are left to constant folding.
PROPAGATE_LIMIT = 1 << 16
ONNX_TO_NUMPY = {
    TensorProto.FLOAT: "float32",
    TensorProto.DOUBLE: "float64",
    TensorProto.FLOAT16: "float16",
    TensorProto.BFLOAT16: "bfloat16",
    TensorProto.INT8: "int8",
    TensorProto.INT16: "int16",
    TensorProto.INT32: "int32",
    TensorProto.INT64: "int64",
    TensorProto.UINT8: "uint8",
    TensorProto.UINT16: "uint16",
    TensorProto.UINT32: "uint32",
    TensorProto.UINT64: "uint64",
    TensorProto.BOOL: "bool",
}
NUMPY_TO_ONNX = {v: k for k, v in ONNX_TO_NUMPY.items()}


class KilnImportError(UserError):
    """Base of every error the frontend raises; the message says what to fix."""


class ModelFormatError(KilnImportError):
    """The bytes are not a valid ONNX model (truncated, corrupt, inconsistent tensors)."""


class UnsupportedError(KilnImportError):
    """An operator, attribute, opset or type Kiln does not handle."""


class ShapeBindingError(KilnImportError):
    """An input has a symbolic dimension that no `shapes=` entry binds."""


class NotConstantError(KilnImportError):
    """A shape-deciding operand is not known at compile time."""

    def __init__(self, message: str, value: str):
        super().__init__(message)
        self.value = value


def onnx_dtype_name(elem_type: int) -> str:
    try:
        return ONNX_TO_NUMPY[elem_type]
    except KeyError:
        name = TensorProto.DataType.Name(elem_type) if elem_type else "UNDEFINED"
        raise UnsupportedError(f"element type {name} is not supported") from None


def tensor_to_array(tensor: TensorProto) -> np.ndarray:
    onnx_dtype_name(tensor.data_type)  # refuses unsupported element types by name
    return np.asarray(numpy_helper.to_array(tensor))


# The default ONNX domain, by both of its names.
DEFAULT_DOMAINS = ("", "ai.onnx")


class ImportContext:
    """What a converter sees: types and known values so far, and where to emit nodes."""

    def __init__(
        self,
        opset: int,
        taken_names: set[str],
        convert: Callable[[ImportContext, onnx.NodeProto], None] | None = None,
    ):
        self.opset = opset
        # How one ONNX node is converted (checks included): control-flow converters run it
        # on their bodies' nodes, which is why it is handed in rather than imported.
        self.convert = convert
        self.types: dict[str, TensorType] = {}
        self.known: dict[str, np.ndarray] = {}
        self.constants: dict[str, np.ndarray] = {}
        self.nodes: list[Node] = []
        # Optionals are resolved at compile time: one that holds a tensor is that tensor's
        # value; an empty one (Optional with no input) is only a name, kept here.
        self.empty_optionals: set[str] = set()
        self.fresh = NameGenerator(taken_names)
        self.current: onnx.NodeProto | None = None
        # The model's opsets of domains other than the default one (ai.onnx.preview's).
        self.domain_opsets: dict[str, int] = {}

    def subcontext(self, taken_names: set[str]) -> ImportContext:
        """A context for a body graph, converted with the same opset and rules; the empty
        optionals of the graphs around it are empty in it too."""
        body = ImportContext(self.opset, taken_names, self.convert)
        body.empty_optionals = set(self.empty_optionals)
        body.domain_opsets = self.domain_opsets
        return body

    def opset_of(self, domain: str) -> int:
        """The model's opset of `domain` (0 where the model does not import it)."""
        if domain in DEFAULT_DOMAINS:
            return self.opset
        return self.domain_opsets.get(domain, 0)

    # queries

    def type(self, value: str) -> TensorType:
        try:
            return self.types[value]
        except KeyError:
            raise KilnImportError(f"value {value!r} is used before it is defined") from None

    def has_value(self, value: str) -> bool:
        return value in self.known

    def value(self, value: str, purpose: str) -> np.ndarray:
        """The compile-time value of an operand that decides shapes."""
        if value in self.known:
            return self.known[value]
        node = self.current
        where = f"node {node.name!r} ({node.op_type})" if node is not None else "the graph"
        raise NotConstantError(
            f"{where}: {purpose} operand {value!r} must be known at compile time "
            "(a constant, or computable from static shapes); bind it as a constant",
            value,
        )

    # emission

    def add_constant(self, array: np.ndarray, prefix: str = "const", name: str | None = None):
        array = np.asarray(array)
        if array.dtype.name not in DTYPES:
            raise UnsupportedError(f"constant of element type {array.dtype} is not supported")
        name = name or self.fresh(prefix)
        self.fresh.reserve(name)
        self.constants[name] = array
        self.known[name] = array
        self.types[name] = TensorType.of(array)
        return name

    def emit(self, op: str, inputs: Sequence[str], outputs: Sequence[str] | int = 1, **attrs):
        """Append one Kiln node; infer its output types; propagate its value when cheap."""
        source = self.current
        if isinstance(outputs, int):
            outputs = [self.fresh(f"{op.lower()}") for _ in range(outputs)]
        base = (source.name or source.op_type) if source is not None else op
        node = Node(op, self.fresh.unique(base), tuple(inputs), tuple(outputs), attrs)
        in_types = [self.types[i] if i else None for i in node.inputs]
        out_types = infer_node(node, in_types)
        for name, typ in zip(node.outputs, out_types, strict=True):
            if name:
                self.types[name] = typ
        self.nodes.append(node)
        self._propagate(node, out_types)
        return list(node.outputs) if len(node.outputs) != 1 else node.outputs[0]

    def _propagate(self, node: Node, out_types: Sequence[TensorType]) -> None:
        opdef = OP_TABLE[node.op]
        if opdef.from_types is not None:
            values = opdef.from_types(node, [self.types[i] for i in node.inputs if i])
        elif all(not i or i in self.known for i in node.inputs) and all(
            t.size <= PROPAGATE_LIMIT for t in out_types
        ):
            inputs = [self.known[i] if i else None for i in node.inputs]
            with np.errstate(all="ignore"):
                values = opdef.compute(node, inputs)
        else:
            return
        for name, value in zip(node.outputs, values, strict=True):
            if name:
                self.known[name] = np.asarray(value)


def infer_node(node: Node, in_types: Sequence[TensorType | None]) -> list[TensorType]:
    opdef = OP_TABLE.get(node.op)
    if opdef is None:
        raise UnsupportedError(f"node {node.name!r}: Kiln has no operator {node.op!r}")
    try:
        out_types = list(opdef.infer(node, in_types))
    except (ShapeError, ValueError, IndexError, TypeError) as err:
        shown = ", ".join(str(t) for t in in_types)
        raise ShapeError(
            f"node {node.name!r} ({node.op}) with inputs ({shown}) has no valid output type: {err}"
        ) from None
    if len(out_types) < len(node.outputs):
        raise ShapeError(f"node {node.name!r} ({node.op}) produces fewer outputs than named")
    return out_types[: len(node.outputs)]
