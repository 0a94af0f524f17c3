"""Opset-versioned converters: ONNX node -> Kiln nodes, in one table.

`CONVERTERS[op_type]` maps the opset version where a converter's semantics start to the
converter. A converter reads the node's attributes through `Attrs`, which remembers what it
read: an attribute the converter never looked at fails the import (it would be silently
ignored otherwise). Shape-deciding operands are read with `ctx.value(...)` and become static
attributes of the Kiln node.
"""

from __future__ import annotations

import numpy as np
import onnx

from compiler_core.frontend import (
    convert_control,
    convert_conv_transpose,
    convert_image,
    convert_indexing,
    convert_linalg,
    convert_losses,
    convert_normalization,
    convert_quantize,
    convert_recurrent,
    convert_signal,
    convert_text,
    convert_transformer,
)
from compiler_core.frontend.common import (
    DEFAULT_DOMAINS,
    ImportContext,
    KilnImportError,
    UnsupportedError,
    onnx_dtype_name,
)
from compiler_core.frontend.convert_utils import (
    Attrs,
    Converter,
    all_inputs,
    all_outputs,
    convert_conv,
    direct,
    emit_reshape,
    input_at,
    ints,
    resolve_auto_pad,
    resolve_reshape,
    single_output,
)
from compiler_core.registry import merge_tables

# --- converters --------------------------------------------------------------------------------


def convert_pool(op: str) -> Converter:
    def convert(ctx, node, attrs):
        x = ctx.type(node.input[0])
        kernel = tuple(attrs.get("kernel_shape"))
        nsp = len(kernel)
        strides = tuple(attrs.get("strides") or (1,) * nsp)
        dilations = tuple(attrs.get("dilations") or (1,) * nsp)
        ceil_mode = attrs.get("ceil_mode", 0)
        auto_pad = attrs.get("auto_pad", "NOTSET")
        if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
            pads = resolve_auto_pad(auto_pad, x.shape[2:], kernel, strides, dilations, None)
        else:
            pads = resolve_auto_pad(
                auto_pad, x.shape[2:], kernel, strides, dilations, attrs.get("pads")
            )
        extra = {}
        if op == "AveragePool":
            extra["count_include_pad"] = attrs.get("count_include_pad", 0)
        if op == "MaxPool":
            extra["storage_order"] = attrs.get("storage_order", 0)
        if op == "LpPool":
            extra["p"] = attrs.get("p", 2)
        outputs = all_outputs(node)
        if op == "MaxPool" and len(outputs) == 1:
            outputs.append("")
        ctx.emit(
            op,
            [node.input[0]],
            outputs,
            kernel_shape=kernel,
            pads=pads,
            strides=strides,
            dilations=dilations,
            ceil_mode=ceil_mode,
            **extra,
        )

    return convert


def convert_global_pool(reduce_op: str) -> Converter:
    def convert(ctx, node, attrs):
        x = ctx.type(node.input[0])
        if reduce_op == "LpPool":
            p = attrs.get("p", 2)
            ctx.emit("LpPool", [node.input[0]], all_outputs(node), kernel_shape=x.shape[2:], p=p)
            return
        ctx.emit(
            reduce_op, [node.input[0]], all_outputs(node), axes=tuple(range(2, x.rank)), keepdims=1
        )

    return convert


def convert_reshape(ctx, node, attrs):
    target = ints(ctx.value(node.input[1], "Reshape shape"))
    shape = resolve_reshape(ctx.type(node.input[0]).shape, target, attrs.get("allowzero", 0))
    emit_reshape(ctx, node.input[0], shape, node.output[0])


def convert_flatten(ctx, node, attrs):
    x = ctx.type(node.input[0])
    axis = attrs.get("axis", 1)
    axis = axis + x.rank if axis < 0 else axis
    outer = int(np.prod(x.shape[:axis], dtype=np.int64))
    emit_reshape(ctx, node.input[0], (outer, x.size // outer if outer else 0), node.output[0])


def _axes_from(ctx, node, attrs, index, purpose):
    if attrs.has("axes"):
        return tuple(attrs.get("axes"))
    if input_at(node, index):
        return ints(ctx.value(node.input[index], purpose))
    return None


def convert_squeeze(ctx, node, attrs):
    x = ctx.type(node.input[0])
    axes = _axes_from(ctx, node, attrs, 1, "Squeeze axes")
    if axes is None:
        axes = tuple(i for i, d in enumerate(x.shape) if d == 1)
    axes = {a % x.rank for a in axes}
    if any(x.shape[a] != 1 for a in axes):
        raise ValueError(f"node {node.name!r}: cannot squeeze non-unit axes of {x}")
    shape = [d for i, d in enumerate(x.shape) if i not in axes]
    emit_reshape(ctx, node.input[0], shape, node.output[0])


def convert_unsqueeze(ctx, node, attrs):
    x = ctx.type(node.input[0])
    axes = _axes_from(ctx, node, attrs, 1, "Unsqueeze axes")
    rank = x.rank + len(axes)
    axes = sorted(a % rank for a in axes)
    shape = list(x.shape)
    for a in axes:
        shape.insert(a, 1)
    emit_reshape(ctx, node.input[0], shape, node.output[0])


def convert_constant(ctx, node, attrs):
    for key in ("value", "value_float", "value_floats", "value_int", "value_ints"):
        if attrs.has(key):
            value = attrs.get(key)
            dtype = np.float32 if "float" in key else np.int64 if "int" in key else None
            array = np.asarray(value, dtype=dtype)
            ctx.add_constant(array, name=node.output[0])
            return
    raise UnsupportedError(
        f"node {node.name!r}: Constant with attribute(s) {', '.join(attrs._values)} "
        "(strings/sparse) is not supported"
    )


def convert_constant_of_shape(ctx, node, attrs):
    shape = ints(ctx.value(node.input[0], "ConstantOfShape shape"))
    value = attrs.get("value")
    fill = np.zeros((), np.float32) if value is None else np.asarray(value).reshape(())
    # A zero-strided view: a large fill (model-zoo weights are made this way) costs no memory.
    ctx.add_constant(np.broadcast_to(fill, shape), name=node.output[0])


def convert_range(ctx, node, attrs):
    start, limit, delta = (ctx.value(n, "Range bound") for n in node.input)
    count = max(int(np.ceil((limit - start) / delta)), 0)
    values = (start + np.arange(count) * delta).astype(start.dtype)
    ctx.add_constant(values, name=node.output[0])


def convert_identity(ctx, node, attrs):
    ctx.emit("Identity", [node.input[0]], [node.output[0]])


def convert_dropout(ctx, node, attrs):
    attrs.ignore("seed", "ratio")
    training = input_at(node, 2)
    if training and bool(np.asarray(ctx.value(training, "Dropout training_mode")).item()):
        raise UnsupportedError(f"node {node.name!r}: Dropout in training mode is not supported")
    ctx.emit("Identity", [node.input[0]], [node.output[0]])
    if len(node.output) > 1 and node.output[1]:
        mask = np.ones(ctx.type(node.input[0]).shape, dtype=bool)
        ctx.add_constant(mask, name=node.output[1])


def convert_optional(ctx, node, attrs):
    """Optional of a tensor is the tensor; an empty one is remembered by name (an optional is
    decided when the graph is built, as a branch of an If with a constant condition is)."""
    attrs.ignore("type")
    value = input_at(node, 0)
    if value:
        ctx.emit("Identity", [value], [node.output[0]])
    else:
        ctx.empty_optionals.add(node.output[0])


def convert_optional_has_element(ctx, node, attrs):
    """A constant: whether the input names a value (a tensor, or a non-empty Optional)."""
    value = input_at(node, 0)
    present = bool(value) and value not in ctx.empty_optionals
    ctx.add_constant(np.array(present), name=node.output[0])


def convert_optional_get_element(ctx, node, attrs):
    value = input_at(node, 0)
    if not value or value in ctx.empty_optionals:
        raise KilnImportError(
            f"node {node.name!r}: OptionalGetElement of an empty optional {value!r} has no value"
        )
    ctx.emit("Identity", [value], [node.output[0]])


def convert_cast(ctx, node, attrs):
    attrs.ignore("saturate", "round_mode")
    to = onnx_dtype_name(attrs.get("to"))
    ctx.emit("Cast", [node.input[0]], [node.output[0]], to=to)


def convert_cast_like(ctx, node, attrs):
    attrs.ignore("saturate", "round_mode")
    ctx.emit("Cast", [node.input[0]], [node.output[0]], to=ctx.type(node.input[1]).dtype)


def convert_clip(ctx, node, attrs):
    bounds = {}
    for index, key in ((1, "min"), (2, "max")):
        if input_at(node, index):
            bounds[key] = np.asarray(ctx.value(node.input[index], f"Clip {key}")).item()
    ctx.emit("Clip", [node.input[0]], [node.output[0]], **bounds)


def convert_clip_legacy(ctx, node, attrs):
    bounds = {k: attrs.get(k) for k in ("min", "max") if attrs.has(k)}
    ctx.emit("Clip", [node.input[0]], [node.output[0]], **bounds)


def convert_pad_legacy(ctx, node, attrs):
    ctx.emit(
        "Pad",
        [node.input[0]],
        [node.output[0]],
        pads=tuple(attrs.get("pads")),
        mode=attrs.get("mode", "constant"),
        value=attrs.get("value", 0.0),
    )


def convert_slice_legacy(ctx, node, attrs):
    rank = ctx.type(node.input[0]).rank
    starts, ends = tuple(attrs.get("starts")), tuple(attrs.get("ends"))
    axes = tuple(a % rank for a in (attrs.get("axes") or range(len(starts))))
    ctx.emit(
        "Slice",
        [node.input[0]],
        [node.output[0]],
        starts=starts,
        ends=ends,
        axes=axes,
        steps=(1,) * len(starts),
    )


def convert_softmax_legacy(op: str) -> Converter:
    """Before opset 13 the softmax family flattens to 2-D at `axis`."""

    def convert(ctx, node, attrs):
        x = ctx.type(node.input[0])
        axis = attrs.get("axis", 1) % max(x.rank, 1)
        outer = int(np.prod(x.shape[:axis], dtype=np.int64))
        flat = emit_reshape(ctx, node.input[0], (outer, x.size // max(outer, 1)))
        result = ctx.emit(op, [flat], 1, axis=-1)
        emit_reshape(ctx, result, x.shape, node.output[0])

    return convert


def convert_softmax(ctx, node, attrs):
    x = ctx.type(node.input[0])
    axis = attrs.get("axis", -1)
    ctx.emit(node.op_type, [node.input[0]], [node.output[0]], axis=axis % max(x.rank, 1))


def convert_split(ctx, node, attrs):
    x = ctx.type(node.input[0])
    axis = attrs.get("axis", 0) % x.rank
    count = len(node.output)
    if attrs.has("split"):
        sizes = tuple(attrs.get("split"))
    elif input_at(node, 1):
        sizes = ints(ctx.value(node.input[1], "Split sizes"))
    else:
        parts = attrs.get("num_outputs", count)
        chunk = -(-x.shape[axis] // parts)
        sizes = tuple(min(chunk, x.shape[axis] - i * chunk) for i in range(parts))
    ctx.emit("Split", [node.input[0]], all_outputs(node), axis=axis, sizes=sizes)


def convert_slice(ctx, node, attrs):
    x = ctx.type(node.input[0])
    starts = ints(ctx.value(node.input[1], "Slice starts"))
    ends = ints(ctx.value(node.input[2], "Slice ends"))
    axes = (
        ints(ctx.value(node.input[3], "Slice axes"))
        if input_at(node, 3)
        else tuple(range(len(starts)))
    )
    steps = (
        ints(ctx.value(node.input[4], "Slice steps")) if input_at(node, 4) else (1,) * len(starts)
    )
    axes = tuple(a % x.rank for a in axes)
    ctx.emit(
        "Slice", [node.input[0]], [node.output[0]], starts=starts, ends=ends, axes=axes, steps=steps
    )


def convert_pad(ctx, node, attrs):
    x = ctx.type(node.input[0])
    pads = ints(ctx.value(node.input[1], "Pad pads"))
    value = 0
    if input_at(node, 2):
        value = np.asarray(ctx.value(node.input[2], "Pad constant_value")).item()
    if input_at(node, 3):
        axes = [a % x.rank for a in ints(ctx.value(node.input[3], "Pad axes"))]
        full = [0] * (2 * x.rank)
        for i, a in enumerate(axes):
            full[a], full[a + x.rank] = pads[i], pads[i + len(axes)]
        pads = tuple(full)
    ctx.emit(
        "Pad",
        [node.input[0]],
        [node.output[0]],
        pads=pads,
        mode=attrs.get("mode", "constant"),
        value=value,
    )


def convert_expand(ctx, node, attrs):
    shape = ints(ctx.value(node.input[1], "Expand shape"))
    ctx.emit("Expand", [node.input[0]], [node.output[0]], shape=shape)


def convert_tile(ctx, node, attrs):
    repeats = ints(ctx.value(node.input[1], "Tile repeats"))
    ctx.emit("Tile", [node.input[0]], [node.output[0]], repeats=repeats)


def convert_reduce(axes_from_input: bool) -> Converter:
    def convert(ctx, node, attrs):
        keepdims = attrs.get("keepdims", 1)
        noop = attrs.get("noop_with_empty_axes", 0)
        if axes_from_input:
            axes = ints(ctx.value(node.input[1], "reduce axes")) if input_at(node, 1) else ()
        else:
            axes = tuple(attrs.get("axes") or ())
        if not axes and noop:
            ctx.emit("Identity", [node.input[0]], [node.output[0]])
            return
        rank = ctx.type(node.input[0]).rank
        axes = tuple(sorted({a % rank for a in axes})) if rank else ()
        ctx.emit(node.op_type, [node.input[0]], [node.output[0]], axes=axes, keepdims=keepdims)

    return convert


def convert_batch_norm(ctx, node, attrs):
    attrs.ignore("spatial")
    epsilon, momentum = attrs.get("epsilon", 1e-5), attrs.get("momentum", 0.9)
    if attrs.get("training_mode", 0):
        _batch_norm_training(ctx, node, epsilon, momentum)
        return
    single_output(node, "running statistics")
    ctx.emit("BatchNormalization", all_inputs(node), [node.output[0]], epsilon=epsilon)


def _batch_norm_training(ctx, node, epsilon: float, momentum: float) -> None:
    """Training mode (opset 14+): normalized by the batch's own mean and population variance
    over every axis but the channels, and the running statistics (outputs 1 and 2) moved
    towards them by 1 - momentum."""
    x, scale, bias, running_mean, running_var = node.input[:5]
    x_type = ctx.type(x)
    axes = tuple(a for a in range(x_type.rank) if a != 1)
    kept_mean = ctx.emit("ReduceMean", [x], axes=axes, keepdims=1)
    mean = emit_reshape(ctx, kept_mean, (x_type.shape[1],))  # a view: reduced once
    centered = ctx.emit("Sub", [x, kept_mean])
    squares = ctx.emit("Mul", [centered, centered])
    variance = ctx.emit("ReduceMean", [squares], axes=axes, keepdims=0)
    inputs = [x, scale, bias, mean, variance]
    ctx.emit("BatchNormalization", inputs, [node.output[0]], epsilon=epsilon)
    keep = ctx.add_constant(np.array(momentum, x_type.dtype), prefix="momentum")
    take = ctx.add_constant(np.array(1 - momentum, x_type.dtype), prefix="momentum")
    statistics = zip(node.output[1:3], (running_mean, running_var), (mean, variance), strict=False)
    for output, running, batch in statistics:
        if output:
            kept = ctx.emit("Mul", [running, keep])
            ctx.emit("Add", [kept, ctx.emit("Mul", [batch, take])], [output])


def convert_layer_norm(ctx, node, attrs):
    stash = attrs.get("stash_type", 1)
    outputs = all_outputs(node) + [""] * (3 - len(node.output))
    ctx.emit(
        "LayerNormalization",
        all_inputs(node),
        outputs,
        axis=attrs.get("axis", -1),
        epsilon=attrs.get("epsilon", 1e-5),
        stash_type=onnx_dtype_name(stash),
    )


def convert_transpose(ctx, node, attrs):
    rank = ctx.type(node.input[0]).rank
    perm = tuple(attrs.get("perm") or range(rank - 1, -1, -1))
    ctx.emit("Transpose", [node.input[0]], [node.output[0]], perm=perm)


def convert_depth_to_space(ctx, node, attrs):
    n, c, h, w = ctx.type(node.input[0]).shape
    b = attrs.get("blocksize")
    if attrs.get("mode", "DCR") == "DCR":
        tmp = emit_reshape(ctx, node.input[0], (n, b, b, c // (b * b), h, w))
        perm = (0, 3, 4, 1, 5, 2)
    else:
        tmp = emit_reshape(ctx, node.input[0], (n, c // (b * b), b, b, h, w))
        perm = (0, 1, 4, 2, 5, 3)
    moved = ctx.emit("Transpose", [tmp], 1, perm=perm)
    emit_reshape(ctx, moved, (n, c // (b * b), h * b, w * b), node.output[0])


def convert_space_to_depth(ctx, node, attrs):
    n, c, h, w = ctx.type(node.input[0]).shape
    b = attrs.get("blocksize")
    tmp = emit_reshape(ctx, node.input[0], (n, c, h // b, b, w // b, b))
    # DCR puts the block offset before the channel; CRD puts the channel first.
    perm = (0, 3, 5, 1, 2, 4) if attrs.get("mode", "DCR") == "DCR" else (0, 1, 3, 5, 2, 4)
    moved = ctx.emit("Transpose", [tmp], 1, perm=perm)
    emit_reshape(ctx, moved, (n, c * b * b, h // b, w // b), node.output[0])


def convert_shape(ctx, node, attrs):
    extra = {k: attrs.get(k) for k in ("start", "end") if attrs.has(k)}
    ctx.emit("Shape", [node.input[0]], [node.output[0]], **extra)


# The table. Versions are the opsets where the ONNX semantics a converter implements begin.
_UNARY = [
    "Relu",
    "Sigmoid",
    "Tanh",
    "Erf",
    "Sqrt",
    "Exp",
    "Log",
    "Neg",
    "Abs",
    "Reciprocal",
    "Floor",
    "Ceil",
    "Round",
    "Sign",
    "Sin",
    "Cos",
    "Tan",
    "Asin",
    "Acos",
    "Atan",
    "Sinh",
    "Cosh",
    "Asinh",
    "Acosh",
    "Atanh",
    "Softplus",
    "Softsign",
    "HardSwish",
    "Mish",
    "Not",
    "IsNaN",
    "BitwiseNot",
]
_BINARY = [
    "Add",
    "Sub",
    "Mul",
    "Div",
    "Pow",
    "PRelu",
    "Equal",
    "Less",
    "Greater",
    "LessOrEqual",
    "GreaterOrEqual",
    "And",
    "Or",
    "Xor",
    "BitwiseAnd",
    "BitwiseOr",
    "BitwiseXor",
    "Where",
    "Max",
    "Min",
    "Sum",
    "Mean",
]

_CORE: dict[str, dict[int, Converter]] = {
    **{op: {1: direct()} for op in _UNARY + _BINARY},
    "LeakyRelu": {1: direct(alpha=0.01)},
    "Elu": {1: direct(alpha=1.0)},
    "Selu": {1: direct(alpha=1.6732632423543772, gamma=1.0507009873554805)},
    "Celu": {12: direct(alpha=1.0)},
    "ThresholdedRelu": {10: direct(alpha=1.0)},
    "HardSigmoid": {1: direct(alpha=0.2, beta=0.5)},
    "Gelu": {20: direct(approximate="none")},
    "Shrink": {9: direct(bias=0.0, lambd=0.5)},
    "IsInf": {10: direct(detect_negative=1, detect_positive=1)},
    "Mod": {10: direct(fmod=0)},
    "BitShift": {11: direct(direction=None)},
    "Clip": {6: convert_clip_legacy, 11: convert_clip},
    "Cast": {1: convert_cast},
    "CastLike": {15: convert_cast_like},
    "Identity": {1: convert_identity},
    "Dropout": {1: convert_dropout},
    "Optional": {15: convert_optional},
    "OptionalHasElement": {15: convert_optional_has_element},
    "OptionalGetElement": {15: convert_optional_get_element},
    "Constant": {1: convert_constant},
    "ConstantOfShape": {9: convert_constant_of_shape},
    "Range": {11: convert_range},
    "Shape": {1: convert_shape},
    "Size": {1: direct()},
    "Reshape": {5: convert_reshape},
    "Flatten": {1: convert_flatten},
    "Squeeze": {1: convert_squeeze},
    "Unsqueeze": {1: convert_unsqueeze},
    "Transpose": {1: convert_transpose},
    "Concat": {4: direct(axis=None)},
    "Split": {1: convert_split},
    "Slice": {1: convert_slice_legacy, 10: convert_slice},
    "Gather": {1: direct(axis=0)},
    "Expand": {8: convert_expand},
    "Tile": {6: convert_tile},
    "Pad": {2: convert_pad_legacy, 11: convert_pad},
    "DepthToSpace": {1: convert_depth_to_space},
    "SpaceToDepth": {1: convert_space_to_depth},
    "Conv": {1: convert_conv()},
    "MaxPool": {1: convert_pool("MaxPool")},
    "AveragePool": {1: convert_pool("AveragePool")},
    "LpPool": {1: convert_pool("LpPool")},
    "GlobalAveragePool": {1: convert_global_pool("ReduceMean")},
    "GlobalMaxPool": {1: convert_global_pool("ReduceMax")},
    "GlobalLpPool": {2: convert_global_pool("LpPool")},
    "Gemm": {1: direct(alpha=1.0, beta=1.0, transA=0, transB=0)},
    "Einsum": {12: direct(equation=None)},
    "BatchNormalization": {1: convert_batch_norm},
    "LayerNormalization": {17: convert_layer_norm},
    "InstanceNormalization": {1: direct(epsilon=1e-5)},
    "LRN": {1: direct(alpha=1e-4, beta=0.75, bias=1.0, size=None)},
    "Softmax": {1: convert_softmax_legacy("Softmax"), 13: convert_softmax},
    "LogSoftmax": {1: convert_softmax_legacy("LogSoftmax"), 13: convert_softmax},
    "Hardmax": {1: convert_softmax_legacy("Hardmax"), 13: convert_softmax},
    "ArgMax": {1: direct(axis=0, keepdims=1, select_last_index=0)},
    "ArgMin": {1: direct(axis=0, keepdims=1, select_last_index=0)},
    "ReduceSum": {1: convert_reduce(False), 13: convert_reduce(True)},
    **{
        op: {1: convert_reduce(False), 18: convert_reduce(True)}
        for op in (
            "ReduceMean",
            "ReduceMax",
            "ReduceMin",
            "ReduceProd",
            "ReduceL1",
            "ReduceL2",
            "ReduceSumSquare",
            "ReduceLogSum",
            "ReduceLogSumExp",
        )
    },
}


def node_label(node: onnx.NodeProto) -> str:
    """How errors name a node: its name, or what it produces when it has none."""
    if node.name:
        return f"node {node.name!r}"
    return f"unnamed node producing {list(node.output)}"


# The one table. Family modules keep their converters beside their topic; this is where
# they all meet.
CONVERTERS: dict[str, dict[int, Converter]] = merge_tables(
    (
        _CORE,
        convert_conv_transpose.CONVERTERS,
        convert_normalization.CONVERTERS,
        convert_transformer.CONVERTERS,
        convert_losses.CONVERTERS,
        convert_indexing.CONVERTERS,
        convert_image.CONVERTERS,
        convert_recurrent.CONVERTERS,
        convert_quantize.CONVERTERS,
        convert_signal.CONVERTERS,
        convert_linalg.CONVERTERS,
        convert_control.CONVERTERS,
        convert_text.CONVERTERS,
    ),
    "converter",
)


def converter_key(node: onnx.NodeProto) -> str:
    """A node's key in CONVERTERS: its operator's name in the default domain, `domain.name`
    in another (the preview domain's FlexAttention: `ai.onnx.preview.FlexAttention`)."""
    if node.domain in DEFAULT_DOMAINS:
        return node.op_type
    return f"{node.domain}.{node.op_type}"


def outside_known_domains(node: onnx.NodeProto) -> bool:
    """Whether `node` belongs to a domain Kiln converts nothing of (a preview operator with a
    converter is inside)."""
    return node.domain not in DEFAULT_DOMAINS and converter_key(node) not in CONVERTERS


def convert_node(ctx: ImportContext, node: onnx.NodeProto) -> None:
    key = converter_key(node)
    versions = CONVERTERS.get(key)
    opset = ctx.opset_of(node.domain)
    if versions is None:
        raise UnsupportedError(
            f"{node_label(node)}: operator {key} (opset {opset}) is not supported"
        )
    eligible = [v for v in versions if v <= opset]
    if not eligible:
        raise UnsupportedError(
            f"{node_label(node)}: operator {key} at opset {opset} is not "
            f"supported (Kiln converts it from opset {min(versions)})"
        )
    attrs = Attrs(node)
    versions[max(eligible)](ctx, node, attrs)
    unread = attrs.unread()
    if unread:
        raise UnsupportedError(
            f"{node_label(node)}: operator {key} (opset {opset}) attribute(s) "
            f"{', '.join(unread)} not supported"
        )
