"""Small hand-built versions of the bench zoo's architecture families, for the test suite.

The bench zoo (`bench/zoo_export.py`) exports full models from PyTorch, which CI does not
install; these graphs keep each family's characteristic structure (Conv1d front ends, grouped
and transposed convs, 3-D convs, channel shuffle, squeeze-excitation, ragged attention) at a
size that compiles in seconds, so their correctness through native code is tested on every run.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class GraphBuilder:
    """Appends nodes with fresh names and random float32 weights (fixed seed)."""

    def __init__(self, name: str, seed: int = 0):
        self.name = name
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.value_info: list[onnx.ValueInfoProto] = []  # where onnx cannot infer a type
        self.rng = np.random.default_rng(seed)
        self.count = 0

    def fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def input(self, name: str, shape) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape)))
        return name

    def const(self, array, prefix: str = "c") -> str:
        name = self.fresh(prefix)
        self.initializers.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def weight(self, *shape, scale: float | None = None) -> str:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        scale = np.float32(scale if scale is not None else 1.0 / np.sqrt(fan_in))
        return self.const(self.rng.standard_normal(shape).astype(np.float32) * scale, "w")

    def op(self, op_type: str, *inputs: str, outputs: int = 1, **attrs):
        names = [self.fresh(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, **attrs))
        return names[0] if outputs == 1 else names

    # --- layers --------------------------------------------------------------------------

    def conv(self, x, cin, cout, kernel, stride=1, pad=0, group=1, nd=2, bias=True):
        kernel = [kernel] * nd if isinstance(kernel, int) else list(kernel)
        stride = [stride] * nd if isinstance(stride, int) else list(stride)
        pad = [pad] * nd if isinstance(pad, int) else list(pad)
        inputs = [x, self.weight(cout, cin // group, *kernel)]
        if bias:
            inputs.append(self.weight(cout, scale=0.1))
        return self.op(
            "Conv", *inputs, kernel_shape=kernel, strides=stride, pads=pad + pad, group=group
        )

    def conv_transpose(self, x, cin, cout, kernel, stride, pad=0):
        w = self.weight(cin, cout, kernel, kernel)
        return self.op(
            "ConvTranspose",
            x,
            w,
            self.weight(cout, scale=0.1),
            kernel_shape=[kernel, kernel],
            strides=[stride, stride],
            pads=[pad] * 4,
        )

    def linear(self, x, cin, cout):
        return self.op("Add", self.op("MatMul", x, self.weight(cin, cout)), self.weight(cout))

    def layer_norm(self, x, width, axis=-1):
        scale = self.const(1.0 + 0.1 * self.rng.standard_normal(width).astype(np.float32))
        return self.op("LayerNormalization", x, scale, self.weight(width, scale=0.1), axis=axis)

    def group_norm(self, x, shape, groups):
        """GroupNormalization (opset 21: per-channel scale); onnx's shape inference leaves its
        output untyped, so it is declared."""
        channels = shape[1]
        scale, bias = self.weight(channels, scale=1.0), self.weight(channels, scale=0.1)
        y = self.op("GroupNormalization", x, scale, bias, num_groups=groups)
        self.value_info.append(helper.make_tensor_value_info(y, TensorProto.FLOAT, list(shape)))
        return y

    def gelu(self, x):
        # Erf form, as exporters write it: x * 0.5 * (1 + erf(x / sqrt 2))
        scaled = self.op("Div", x, self.const(np.float32(np.sqrt(2.0))))
        one = self.op("Add", self.op("Erf", scaled), self.const(np.float32(1.0)))
        return self.op("Mul", self.op("Mul", x, one), self.const(np.float32(0.5)))

    def hard_swish(self, x):
        return self.op("HardSwish", x)

    def reshape(self, x, shape):
        return self.op("Reshape", x, self.const(np.array(shape, np.int64), "shape"))

    def attention(self, x, tokens, width, heads):
        """Multi-head self-attention over [1, tokens, width]."""
        head = width // heads

        def split_heads(t):
            return self.op(
                "Transpose", self.reshape(t, [1, tokens, heads, head]), perm=[0, 2, 1, 3]
            )

        q, k, v = (split_heads(self.linear(x, width, width)) for _ in range(3))
        scores = self.op("MatMul", q, self.op("Transpose", k, perm=[0, 1, 3, 2]))
        scores = self.op("Mul", scores, self.const(np.float32(1.0 / np.sqrt(head))))
        mixed = self.op("MatMul", self.op("Softmax", scores, axis=-1), v)
        merged = self.reshape(self.op("Transpose", mixed, perm=[0, 2, 1, 3]), [1, tokens, width])
        return self.linear(merged, width, width)

    def model(self, output: str, opset: int = 18) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes,
            self.name,
            self.inputs,
            [helper.make_empty_tensor_value_info(output)],
            self.initializers,
            value_info=self.value_info,
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
        model.ir_version = 8
        model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
        declared = next(v for v in model.graph.value_info if v.name == output)
        model.graph.output[0].CopyFrom(declared)
        return model


# --- the families ----------------------------------------------------------------------------


def audio_encoder() -> onnx.ModelProto:
    """wav2vec2-style: Conv1d feature extractor on raw audio (k10 s5, then k3 s2, GroupNorm,
    GELU), a projection, a grouped long-kernel positional Conv1d, one attention layer."""
    b = GraphBuilder("audio_encoder")
    x = b.reshape(b.input("audio", [1, 1203]), [1, 1, 1203])
    x = b.conv(x, 1, 32, 10, stride=5, nd=1, bias=False)
    x = b.gelu(b.group_norm(x, [1, 32, 239], groups=32))
    x = b.gelu(b.conv(x, 32, 32, 3, stride=2, nd=1, bias=False))
    x = b.gelu(b.conv(x, 32, 32, 2, stride=2, nd=1, bias=False))
    tokens = 59
    x = b.op("Transpose", x, perm=[0, 2, 1])  # [1, tokens, 32]
    x = b.linear(b.layer_norm(x, 32), 32, 48)
    positional = b.conv(b.op("Transpose", x, perm=[0, 2, 1]), 48, 48, 8, pad=4, group=4, nd=1)
    positional = b.op(
        "Slice",
        positional,
        b.const(np.array([0], np.int64)),
        b.const(np.array([tokens], np.int64)),
        b.const(np.array([2], np.int64)),
    )
    x = b.op("Add", x, b.op("Transpose", b.gelu(positional), perm=[0, 2, 1]))
    x = b.layer_norm(x, 48)
    x = b.op("Add", x, b.attention(x, tokens, 48, 4))
    return b.model(b.layer_norm(x, 48), opset=21)


def unet() -> onnx.ModelProto:
    """Two down steps, a bottleneck, two ConvTranspose k2 s2 up steps with Concat skips."""
    b = GraphBuilder("unet")
    x = b.input("x", [1, 3, 36, 36])
    s1 = b.op("Relu", b.conv(x, 3, 8, 3, pad=1))
    s2 = b.op(
        "Relu", b.conv(b.op("MaxPool", s1, kernel_shape=[2, 2], strides=[2, 2]), 8, 16, 3, pad=1)
    )
    bottom = b.op("MaxPool", s2, kernel_shape=[2, 2], strides=[2, 2])
    bottom = b.op("Relu", b.conv(bottom, 16, 24, 3, pad=1))
    up2 = b.op("Concat", b.conv_transpose(bottom, 24, 16, 2, 2), s2, axis=1)
    d2 = b.op("Relu", b.conv(up2, 32, 16, 3, pad=1))
    up1 = b.op("Concat", b.conv_transpose(d2, 16, 8, 2, 2), s1, axis=1)
    d1 = b.op("Relu", b.conv(up1, 16, 8, 3, pad=1))
    # A GAN-style k4 s2 p1 up-sampling head.
    return b.model(b.conv_transpose(d1, 8, 4, 4, 2, pad=1))


def video_net() -> onnx.ModelProto:
    """(2+1)-D video convs: a full 3x3x3 conv, a spatial (1,3,3) and a temporal (3,1,1) conv
    through an odd number of mid planes (R(2+1)D's 230, 460...: a padded block), 3-D pooling,
    a global mean and a classifier."""
    b = GraphBuilder("video_net")
    x = b.input("clip", [1, 3, 6, 20, 20])
    x = b.op("Relu", b.conv(x, 3, 16, 3, pad=1, nd=3))
    x = b.op("Relu", b.conv(x, 16, 23, [1, 3, 3], stride=[1, 2, 2], pad=[0, 1, 1], nd=3))
    x = b.op("Relu", b.conv(x, 23, 24, [3, 1, 1], pad=[1, 0, 0], nd=3))
    x = b.op("MaxPool", x, kernel_shape=[2, 2, 2], strides=[2, 2, 2])
    x = b.op("ReduceMean", x, b.const(np.array([2, 3, 4], np.int64)), keepdims=0)
    return b.model(b.linear(x, 24, 10))


def vision_transformer() -> onnx.ModelProto:
    """ViT: 8x8 patches of a 40x40 image (25 tokens + a class token = 26, a ragged count),
    one pre-norm attention block with a GELU MLP."""
    b = GraphBuilder("vision_transformer")
    x = b.conv(b.input("image", [1, 3, 40, 40]), 3, 64, 8, stride=8)
    x = b.op("Transpose", b.reshape(x, [1, 64, 25]), perm=[0, 2, 1])
    x = b.op("Concat", b.weight(1, 1, 64, scale=0.5), x, axis=1)
    x = b.op("Add", x, b.weight(1, 26, 64, scale=0.1))
    x = b.op("Add", x, b.attention(b.layer_norm(x, 64), 26, 64, 4))
    hidden = b.gelu(b.linear(b.layer_norm(x, 64), 64, 128))
    x = b.op("Add", x, b.linear(hidden, 128, 64))
    return b.model(b.layer_norm(x, 64))


def shufflenet_block() -> onnx.ModelProto:
    """ShuffleNetV2 units: odd channel counts (58), Split, depthwise, Concat, shuffle."""
    b = GraphBuilder("shufflenet_block")
    x = b.op("Relu", b.conv(b.input("x", [1, 3, 24, 24]), 3, 116, 3, stride=2, pad=1))
    for _ in range(2):
        left, right = b.op("Split", x, b.const(np.array([58, 58], np.int64)), axis=1, outputs=2)
        right = b.op("Relu", b.conv(right, 58, 58, 1))
        right = b.conv(right, 58, 58, 3, pad=1, group=58)
        right = b.op("Relu", b.conv(right, 58, 58, 1))
        x = b.op("Concat", left, right, axis=1)
        x = b.reshape(
            b.op("Transpose", b.reshape(x, [1, 2, 58, 12, 12]), perm=[0, 2, 1, 3, 4]),
            [1, 116, 12, 12],
        )
    return b.model(x)


def mobilenet_v3_block() -> onnx.ModelProto:
    """MobileNetV3: hard-swish, a 5x5 depthwise conv, squeeze-excitation with hard-sigmoid."""
    b = GraphBuilder("mobilenet_v3_block")
    x = b.hard_swish(b.conv(b.input("x", [1, 3, 32, 32]), 3, 16, 3, stride=2, pad=1))
    expanded = b.hard_swish(b.conv(x, 16, 72, 1))
    dw = b.hard_swish(b.conv(expanded, 72, 72, 5, pad=2, group=72))
    squeeze = b.op("GlobalAveragePool", dw)
    excite = b.op("HardSigmoid", b.conv(b.op("Relu", b.conv(squeeze, 72, 24, 1)), 24, 72, 1))
    x = b.op("Add", b.conv(b.op("Mul", dw, excite), 72, 16, 1), x)
    return b.model(x)


def convnext_block() -> onnx.ModelProto:
    """ConvNeXt: 7x7 depthwise, LayerNorm over channels (channels-last), GELU MLP, residual."""
    b = GraphBuilder("convnext_block")
    x = b.conv(b.input("x", [1, 3, 28, 28]), 3, 48, 4, stride=4)
    y = b.conv(x, 48, 48, 7, pad=3, group=48)
    y = b.layer_norm(b.op("Transpose", y, perm=[0, 2, 3, 1]), 48)
    y = b.linear(b.gelu(b.linear(y, 48, 96)), 96, 48)
    return b.model(b.op("Add", x, b.op("Transpose", y, perm=[0, 3, 1, 2])))


def resnext_block() -> onnx.ModelProto:
    """ResNeXt: grouped 3x3 convs between 1x1 convs, residual: 8 groups of 8 channels, then
    16 groups of 4 (resnext50_32x4d's first stage), whose blocks hold two groups each."""
    b = GraphBuilder("resnext_block")
    x = b.op("Relu", b.conv(b.input("x", [1, 16, 14, 14]), 16, 64, 1))
    y = b.op("Relu", b.conv(x, 64, 64, 1))
    y = b.op("Relu", b.conv(y, 64, 64, 3, pad=1, group=8))
    y = b.op("Relu", b.conv(y, 64, 64, 3, pad=1, group=16))
    return b.model(b.op("Relu", b.op("Add", b.conv(y, 64, 64, 1), x)))


FAMILIES = {
    "audio_encoder": audio_encoder,
    "unet": unet,
    "video_net": video_net,
    "vision_transformer": vision_transformer,
    "shufflenet_block": shufflenet_block,
    "mobilenet_v3_block": mobilenet_v3_block,
    "convnext_block": convnext_block,
    "resnext_block": resnext_block,
}
