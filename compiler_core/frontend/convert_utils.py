"""Shared pieces for converters: attribute access that tracks use, and small emit helpers."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import AttributeProto

from compiler_core.frontend.common import ImportContext, UnsupportedError, tensor_to_array

Converter = Callable[[ImportContext, onnx.NodeProto, "Attrs"], None]


class Attrs:
    """A node's attributes as Python values; records which ones a converter consumed."""

    def __init__(self, node: onnx.NodeProto):
        self.node = node
        self._values = {a.name: _attribute_value(node, a) for a in node.attribute}
        self._read: set[str] = set()

    def get(self, name, default=None):
        self._read.add(name)
        return self._values.get(name, default)

    def has(self, name) -> bool:
        return name in self._values

    def ignore(self, *names) -> None:
        """Attributes that do not change inference results (seeds, training momentum)."""
        self._read.update(names)

    def unread(self) -> list[str]:
        return sorted(set(self._values) - self._read)


def _attribute_value(node: onnx.NodeProto, attr: onnx.AttributeProto):
    if attr.ref_attr_name:
        raise UnsupportedError(f"node {node.name!r}: attribute references are not supported")
    if attr.type == AttributeProto.GRAPH:
        return attr.g  # a body: the control-flow converters import it themselves
    if attr.type == AttributeProto.GRAPHS:
        raise UnsupportedError(
            f"node {node.name!r} ({node.op_type}): graph-list attribute {attr.name!r} is not "
            "supported"
        )
    if attr.type == AttributeProto.TENSOR:
        return tensor_to_array(attr.t)
    if attr.type == AttributeProto.SPARSE_TENSOR:
        raise UnsupportedError(f"node {node.name!r}: sparse tensor attributes are not supported")
    value = onnx.helper.get_attribute_value(attr)
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, list):
        return [v.decode() if isinstance(v, bytes) else v for v in value]
    return value


# --- helpers -----------------------------------------------------------------------------------


def allall_inputs(node) -> list[str]:
    return list(node.input)


def input_at(node, index) -> str:
    return node.input[index] if index < len(node.input) else ""


def ints(array) -> tuple[int, ...]:
    return tuple(int(v) for v in np.asarray(array).reshape(-1))


def allall_outputs(node) -> list[str]:
    return list(node.output)


def single_output(node, name) -> None:
    if any(node.output[1:]):
        raise UnsupportedError(
            f"node {node.name!r} ({node.op_type}): output {name!r} beyond the first is not "
            "supported"
        )


def all_inputs(node) -> list[str]:
    return list(node.input)


def all_outputs(node) -> list[str]:
    return list(node.output)


def direct(op: str | None = None, **defaults) -> Converter:
    """Same inputs and outputs; the listed attributes (with their defaults) carried over."""

    def convert(ctx, node, attrs):
        values = {k: attrs.get(k, v) for k, v in defaults.items()}
        values = {k: v for k, v in values.items() if v is not None}
        ctx.emit(op or node.op_type, all_inputs(node), all_outputs(node), **values)

    return convert


def emit_reshape(ctx, data: str, shape, output: str | None = None):
    return ctx.emit("Reshape", [data], [output] if output else 1, shape=tuple(shape))


def resolve_reshape(in_shape, target, allowzero=False) -> tuple[int, ...]:
    shape = list(target)
    if not allowzero:
        shape = [in_shape[i] if d == 0 else d for i, d in enumerate(shape)]
    if shape.count(-1) > 1:
        raise ValueError(f"reshape target {list(target)} has more than one -1")
    if -1 in shape:
        known = int(np.prod([d for d in shape if d != -1], dtype=np.int64))
        total = int(np.prod(in_shape, dtype=np.int64))
        if known == 0 or total % known:
            raise ValueError(f"cannot reshape {list(in_shape)} to {list(target)}")
        shape[shape.index(-1)] = total // known
    return tuple(shape)


def resolve_auto_pad(auto_pad, in_sizes, kernel, strides, dilations, pads):
    nsp = len(kernel)
    if auto_pad in ("NOTSET", "", None):
        return tuple(pads) if pads else (0,) * (2 * nsp)
    if auto_pad == "VALID":
        return (0,) * (2 * nsp)
    begins, ends = [], []
    for size, k, s, d in zip(in_sizes, kernel, strides, dilations, strict=True):
        out = -(-size // s)
        total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
        small, large = total // 2, total - total // 2
        if auto_pad == "SAME_UPPER":
            begins.append(small)
            ends.append(large)
        elif auto_pad == "SAME_LOWER":
            begins.append(large)
            ends.append(small)
        else:
            raise UnsupportedError(f"auto_pad {auto_pad!r} is not supported")
    return tuple(begins + ends)


def convert_conv(op: str = "Conv", weight_input: int = 1) -> Converter:
    """Conv, ConvInteger, QLinearConv: auto_pad resolved into explicit pads; defaults made
    explicit. `weight_input` is where the weight sits (3 for QLinearConv)."""

    def convert(ctx, node, attrs):
        x, w = ctx.type(node.input[0]), ctx.type(node.input[weight_input])
        nsp = x.rank - 2
        kernel = tuple(attrs.get("kernel_shape") or w.shape[2:])
        if kernel != tuple(w.shape[2:]):
            raise UnsupportedError(f"node {node.name!r}: kernel_shape {kernel} != weight {w.shape}")
        strides = tuple(attrs.get("strides") or (1,) * nsp)
        dilations = tuple(attrs.get("dilations") or (1,) * nsp)
        auto_pad = attrs.get("auto_pad", "NOTSET")
        pads = resolve_auto_pad(
            auto_pad, x.shape[2:], kernel, strides, dilations, attrs.get("pads")
        )
        ctx.emit(
            op,
            all_inputs(node),
            all_outputs(node),
            pads=pads,
            strides=strides,
            dilations=dilations,
            group=attrs.get("group", 1),
        )

    return convert
