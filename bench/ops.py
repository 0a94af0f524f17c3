"""Op-family benchmark: single-operator models, Kiln (untuned) against ONNX Runtime and
OpenVINO in one run.

    .venv/bin/python -m bench.ops [--cases conv1d_k3s2 softmax] [--threads 2] [--list]

Each case is a one-node ONNX model (constant weights, as in a trained model) built here with
onnx.helper. The engines run it in alternating blocks with a settle pause before each block
(`bench.engines.compare_and_time`); the table prints medians, kiln/ORT, kiln/OV, kiln/best
(against the faster of the two; OpenVINO where the `bench` extra installed it) and the worst
ratios. Outputs are
checked against ORT (rtol 1e-4 of the output's scale) before anything is timed: a fast wrong
kernel is reported as a failure, not a speed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import compiler_core
from bench.engines import (
    compare_and_time,
    describe,
    ratio_cells,
    ratio_columns,
    reference_names,
    yardsticks,
)
from bench.run import cpu_name
from compiler_core.runtime import load


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    family: str
    description: str
    build: Callable[[], tuple[bytes, dict[str, np.ndarray]]]


def _model(op, inputs, weights, output_shape, attrs=None, opset=17, extra_nodes=()):
    """A one-node model: `inputs` {name: shape} are graph inputs (float32), `weights`
    {name: array} initializers; the node reads inputs then weights in the order given."""
    rng = np.random.default_rng(0)
    names = [*inputs, *weights]
    node = helper.make_node(op, names, ["y"], **(attrs or {}))
    graph = helper.make_graph(
        [node, *extra_nodes],
        op.lower(),
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, output_shape)],
        [numpy_helper.from_array(w.astype(np.float32), n) for n, w in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in inputs.items()}
    return model.SerializeToString(), feeds


def _weights(*shape, scale=None):
    fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
    scale = scale if scale is not None else 1.0 / np.sqrt(fan_in)
    return np.random.default_rng(1).standard_normal(shape).astype(np.float32) * scale


def _out_len(length, kernel, stride=1, pad=0, dilation=1):
    return (length + 2 * pad - dilation * (kernel - 1) - 1) // stride + 1


def conv(name, family, c, m, spatial, kernel, stride=1, pad=0, group=1, description=""):
    """Conv over len(spatial) dims; kernel, stride and pad are one int for every axis or one
    per axis (a (3, 1, 1) temporal conv)."""
    nd = len(spatial)
    kernel, stride, pad = (v if isinstance(v, tuple) else (v,) * nd for v in (kernel, stride, pad))
    out = [_out_len(*args) for args in zip(spatial, kernel, stride, pad, strict=True)]

    def build():
        return _model(
            "Conv",
            {"x": [1, c, *spatial]},
            {"w": _weights(m, c // group, *kernel), "b": _weights(m, scale=0.1)},
            [1, m, *out],
            {
                "kernel_shape": list(kernel),
                "strides": list(stride),
                "pads": list(pad) * 2,
                "group": group,
            },
        )

    return Case(name, family, description, build)


def conv_transpose(name, c, m, spatial, kernel, stride, pad=0, description=""):
    nd = len(spatial)
    out = [(s - 1) * stride - 2 * pad + kernel for s in spatial]

    def build():
        return _model(
            "ConvTranspose",
            {"x": [1, c, *spatial]},
            {"w": _weights(c, m, *[kernel] * nd), "b": _weights(m, scale=0.1)},
            [1, m, *out],
            {"kernel_shape": [kernel] * nd, "strides": [stride] * nd, "pads": [pad] * (2 * nd)},
        )

    return Case(name, "conv_transpose", description, build)


def matmul(name, a_shape, b_shape, b_constant, description=""):
    out = list(np.matmul(np.zeros(a_shape, np.float32), np.zeros(b_shape, np.float32)).shape)

    def build():
        if b_constant:
            return _model("MatMul", {"a": a_shape}, {"b": _weights(*b_shape)}, out)
        return _model("MatMul", {"a": a_shape, "b": b_shape}, {}, out)

    return Case(name, "matmul", description, build)


def attention(name, heads, length, head_size, kv_heads=None, queries=None, description="", **attrs):
    """The ONNX Attention operator (opset 23; 25 for the windows) over [1, heads, queries,
    head_size] Q and [1, kv_heads, length, head_size] K, V (by default as many heads and
    queries as keys)."""
    q_shape = [1, heads, queries or length, head_size]
    kv_shape = [1, kv_heads or heads, length, head_size]
    windowed = any(key.endswith("_window_size") for key in attrs)

    def build():
        inputs = {"q": q_shape, "k": kv_shape, "v": kv_shape}
        return _model("Attention", inputs, {}, q_shape, attrs, opset=25 if windowed else 23)

    return Case(name, "attention", description, build)


def masked_attention(name, heads, length, head_size, description=""):
    """Attention spelled out as torch exports GPT-2: Q K^T / sqrt(d), the causal pattern as a
    constant boolean Where with the float32 lowest value, Softmax, then P V."""
    shape = [1, heads, length, head_size]

    def build():
        rng = np.random.default_rng(0)
        causal = np.tril(np.ones((length, length), bool))[None, None]
        constants = {
            "scale": np.float32(np.sqrt(head_size)),
            "mask": causal,
            "lowest": np.float32(np.finfo(np.float32).min),
        }
        nodes = [
            helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
            helper.make_node("MatMul", ["q", "kt"], ["s"]),
            helper.make_node("Div", ["s", "scale"], ["scaled"]),
            helper.make_node("Where", ["mask", "scaled", "lowest"], ["masked"]),
            helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
            helper.make_node("MatMul", ["p", "v"], ["y"]),
        ]
        graph = helper.make_graph(
            nodes,
            "masked_attention",
            [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in "qkv"],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
            [numpy_helper.from_array(np.asarray(v), n) for n, v in constants.items()],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        feeds = {n: rng.standard_normal(shape).astype(np.float32) for n in "qkv"}
        return model.SerializeToString(), feeds

    return Case(name, "attention", description, build)


def unary(name, family, op, shape, attrs=None, out_shape=None, opset=17, description=""):
    def build():
        return _model(op, {"x": shape}, {}, out_shape or shape, attrs, opset)

    return Case(name, family, description, build)


def layer_norm(name, shape, description=""):
    def build():
        width = shape[-1]
        return _model(
            "LayerNormalization",
            {"x": shape},
            {"scale": _weights(width, scale=1.0), "bias": _weights(width, scale=0.1)},
            shape,
            {"axis": -1, "epsilon": 1e-5},
        )

    return Case(name, "row_reduction", description, build)


def group_norm(name, shape, groups, description=""):
    def build():
        channels = shape[1]
        return _model(
            "GroupNormalization",
            {"x": shape},
            {"scale": _weights(channels, scale=1.0), "bias": _weights(channels, scale=0.1)},
            shape,
            {"num_groups": groups, "epsilon": 1e-5},
            opset=21,
        )

    return Case(name, "row_reduction", description, build)


def reduce_mean(name, shape, axes, description=""):
    out = [1 if k in axes else d for k, d in enumerate(shape)]

    def build():
        return _model("ReduceMean", {"x": shape}, {}, out, {"axes": list(axes)}, opset=17)

    return Case(name, "row_reduction", description, build)


def lstm(name, steps, size, hidden, description=""):
    """A one-layer LSTM (PyTorch's weight scale, 1/sqrt(hidden)) over `steps` steps."""

    def build():
        scale = hidden**-0.5
        weights = {
            "w": _weights(1, 4 * hidden, size, scale=scale),
            "r": _weights(1, 4 * hidden, hidden, scale=scale),
            "b": _weights(1, 8 * hidden, scale=scale),
        }
        attrs = {"hidden_size": hidden}
        return _model("LSTM", {"x": [steps, 1, size]}, weights, [steps, 1, 1, hidden], attrs, 14)

    return Case(name, "recurrent", description, build)


def scan_rnn(name, steps, size, hidden, description=""):
    """An Elman RNN written as an ONNX Scan (h' = tanh(x_t W + h R + b)): a body graph run
    once per step, as exporters write loops no fused operator covers."""

    def build():
        value = helper.make_tensor_value_info
        weights = {"w": _weights(size, hidden), "r": _weights(hidden, hidden)}
        body = helper.make_graph(
            [
                helper.make_node("MatMul", ["x_t", "w"], ["xw"]),
                helper.make_node("MatMul", ["h_in", "r"], ["hr"]),
                helper.make_node("Add", ["xw", "hr"], ["s"]),
                helper.make_node("Tanh", ["s"], ["h_out"]),
                helper.make_node("Identity", ["h_out"], ["y_t"]),
            ],
            "cell",
            [
                value("h_in", TensorProto.FLOAT, [1, hidden]),
                value("x_t", TensorProto.FLOAT, [1, size]),
            ],
            [
                value("h_out", TensorProto.FLOAT, [1, hidden]),
                value("y_t", TensorProto.FLOAT, [1, hidden]),
            ],
        )
        scan = helper.make_node("Scan", ["h0", "x"], ["h", "y"], body=body, num_scan_inputs=1)
        inputs = {"h0": [1, hidden], "x": [steps, 1, size]}
        graph = helper.make_graph(
            [scan],
            "scan_rnn",
            [value(n, TensorProto.FLOAT, s) for n, s in inputs.items()],
            [
                value("h", TensorProto.FLOAT, [1, hidden]),
                value("y", TensorProto.FLOAT, [steps, 1, hidden]),
            ],
            [numpy_helper.from_array(w.astype(np.float32), n) for n, w in weights.items()],
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        rng = np.random.default_rng(0)
        feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in inputs.items()}
        return model.SerializeToString(), feeds

    return Case(name, "control_flow", description, build)


def _avgpool_out(shape, kernel, stride, pad):
    return [*shape[:2], *[_out_len(s, kernel, stride, pad) for s in shape[2:]]]


# The table of issue 15 first (same shapes), then the families found on the way.
ISSUE_TABLE = (
    "conv2d_3x3",
    "conv1d_k3s2",
    "conv1d_k64g8",
    "conv1d_stem",
    "convT_k2s2",
    "convT_k4s2p1",
    "conv3d_3x3x3",
    "bmm_qk",
    "matmul_m49",
    "softmax",
    "layernorm",
    "reducemean_hw",
    "avgpool_3x3s1",
    "conv2d_stem",
)
CASES: dict[str, Case] = {
    c.name: c
    for c in [
        conv("conv2d_3x3", "conv2d", 64, 64, [56, 56], 3, 1, 1, description="reference path"),
        conv("conv1d_k3s2", "conv1d", 256, 256, [3199], 3, 2, description="wav2vec2 extractor"),
        conv(
            "conv1d_k64g8",
            "conv1d",
            256,
            256,
            [400],
            64,
            1,
            32,
            group=8,
            description="positional conv embedding",
        ),
        conv("conv1d_stem", "conv1d", 1, 256, [16000], 10, 5, description="raw-audio stem"),
        conv(
            "gconv_g32c4",
            "grouped",
            128,
            128,
            [56, 56],
            3,
            1,
            1,
            group=32,
            description="ResNeXt-50 layer1, 4 channels a group",
        ),
        conv(
            "gconv_g32c8",
            "grouped",
            256,
            256,
            [28, 28],
            3,
            1,
            1,
            group=32,
            description="ResNeXt-50 layer2, 8 channels a group",
        ),
        conv_transpose("convT_k2s2", 48, 24, [96, 96], 2, 2, description="U-Net up-step"),
        conv_transpose("convT_k4s2p1", 128, 64, [32, 32], 4, 2, 1, description="GAN decoder"),
        conv("conv3d_3x3x3", "conv3d", 32, 32, [8, 28, 28], 3, 1, 1, description="video"),
        conv(
            "conv3d_133",
            "conv3d",
            64,
            144,
            [8, 56, 56],
            (1, 3, 3),
            1,
            (0, 1, 1),
            description="R(2+1)D spatial",
        ),
        conv(
            "conv3d_311",
            "conv3d",
            144,
            64,
            [8, 56, 56],
            (3, 1, 1),
            1,
            (1, 0, 0),
            description="R(2+1)D temporal",
        ),
        conv(
            "conv3d_133_c230",
            "conv3d",
            64,
            230,
            [8, 56, 56],
            (1, 3, 3),
            (1, 2, 2),
            (0, 1, 1),
            description="R(2+1)D, 230 mid planes",
        ),
        matmul("bmm_qk", [12, 197, 64], [12, 64, 197], False, description="ViT attention scores"),
        matmul("bmm_pv", [12, 197, 197], [12, 197, 64], False, description="ViT attention P.V"),
        matmul("matmul_m49", [49, 768], [768, 3072], True, description="Swin MLP, ragged M"),
        unary(
            "softmax",
            "row_reduction",
            "Softmax",
            [12, 197, 197],
            {"axis": -1},
            opset=13,
            description="last axis",
        ),
        layer_norm("layernorm", [197, 768], description="ViT token rows"),
        unary(
            "gelu",
            "elementwise",
            "Gelu",
            [197, 3072],
            opset=20,
            description="ViT MLP hidden, erf form",
        ),
        unary("sigmoid", "elementwise", "Sigmoid", [1, 64, 112, 112], description="SiLU's gate"),
        unary("tanh", "elementwise", "Tanh", [64, 4096], description="GPT-2 GELU's inner tanh"),
        unary("mish", "elementwise", "Mish", [1, 64, 152, 152], opset=18, description="YOLOv4's"),
        unary("softplus", "elementwise", "Softplus", [1, 256, 56, 56], description="stable form"),
        reduce_mean("reducemean_hw", [1, 512, 28, 28], (2, 3), description="over H, W"),
        unary(
            "avgpool_3x3s1",
            "pooling",
            "AveragePool",
            [1, 256, 28, 28],
            {"kernel_shape": [3, 3], "strides": [1, 1], "pads": [1, 1, 1, 1]},
            out_shape=_avgpool_out([1, 256, 28, 28], 3, 1, 1),
            description="plain NCHW",
        ),
        conv("conv2d_stem", "conv2d", 3, 32, [224, 224], 3, 2, 1, description="3-channel stem"),
        conv("conv2d_stem7", "conv2d", 3, 64, [224, 224], 7, 2, 3, description="ResNet 7x7 stem"),
        conv("conv2d_512_7x7", "conv2d", 512, 512, [7, 7], 3, 1, 1, description="ResNet layer4"),
        # Found on the way: other shapes of the same families.
        conv("conv2d_c58", "conv2d", 58, 58, [28, 28], 1, description="ShuffleNet 1x1, 58 ch"),
        conv("conv2d_c116", "conv2d", 116, 116, [14, 14], 1, description="ShuffleNet 1x1, 116 ch"),
        conv(
            "dwconv_5x5",
            "depthwise",
            120,
            120,
            [28, 28],
            5,
            1,
            2,
            group=120,
            description="MobileNetV3",
        ),
        conv(
            "dwconv_7x7", "depthwise", 96, 96, [56, 56], 7, 1, 3, group=96, description="ConvNeXt-T"
        ),
        conv("conv2d_c40_3x3", "conv2d", 40, 40, [28, 28], 3, 1, 1, description="40 ch, 3x3"),
        group_norm("groupnorm", [1, 512, 49], 32, description="wav2vec2 first layer"),
        matmul("matmul_m197", [197, 768], [768, 768], True, description="ViT projection"),
        conv(
            "dwconv_s2",
            "depthwise",
            144,
            144,
            [56, 56],
            3,
            2,
            1,
            group=144,
            description="MobileNetV2 stride-2 depthwise",
        ),
        conv(
            "dwconv_s1",
            "depthwise",
            32,
            32,
            [112, 112],
            3,
            1,
            1,
            group=32,
            description="MobileNetV2 first depthwise",
        ),
        unary(
            "softmax_channels",
            "row_reduction",
            "Softmax",
            [1, 21, 56, 56],
            {"axis": 1},
            opset=13,
            description="segmentation classes, axis 1",
        ),
        unary(
            "maxpool_3x3s2",
            "pooling",
            "MaxPool",
            [1, 64, 112, 112],
            {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
            out_shape=_avgpool_out([1, 64, 112, 112], 3, 2, 1),
            description="ResNet stem pool, plain NCHW",
        ),
        matmul("vecmat_768", [768], [768, 3072], True, description="1-D input, dense layer"),
        attention("attention_vit", 12, 197, 64, description="ONNX Attention, ViT-B's 12 heads"),
        attention("attention_1k", 12, 1024, 64, description="12 heads of 1024 tokens"),
        attention("attention_causal", 12, 256, 64, is_causal=1, description="causal, 256 tokens"),
        attention(
            "attention_gqa_prefill",
            32,
            256,
            128,
            kv_heads=8,
            is_causal=1,
            description="grouped-query, 32 heads on 8, causal, 256 tokens",
        ),
        attention(
            "attention_gqa_decode",
            32,
            1024,
            128,
            kv_heads=8,
            queries=1,
            is_causal=1,
            description="grouped-query decode step, 1024 keys",
        ),
        attention(
            "attention_window",
            12,
            1024,
            64,
            is_causal=1,
            left_window_size=128,
            description="causal, 1024 tokens, 128-key sliding window",
        ),
        masked_attention(
            "attention_gpt2_export", 12, 256, 64, description="causal, as torch exports GPT-2"
        ),
        conv_transpose("convT1d_k16s8", 512, 256, [32], 16, 8, 4, description="HiFi-GAN up"),
        lstm("lstm_4", 4, 128, 192, description="torch.nn.LSTM(128, 192), 4 steps"),
        lstm("lstm_512", 512, 128, 192, description="the same over 512 steps (one loop)"),
        scan_rnn("scan_rnn_512", 512, 64, 128, description="ONNX Scan, an RNN cell body"),
    ]
}


def bench_case(case: Case, threads: int) -> dict:
    data, feeds = case.build()
    started = time.perf_counter()
    module = load(compiler_core.compile(data), num_threads=threads)
    compile_s = time.perf_counter() - started
    result = {"case": case.name, "family": case.family, "compile_s": compile_s}
    return result | compare_and_time(module.run, yardsticks(data, threads), feeds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("bench/ops.json"))
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args()
    if args.list:
        for case in CASES.values():
            print(f"{case.name:16s} {case.family:16s} {case.description}")
        return
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        parser.error(f"unknown case(s) {unknown}; --list shows them")

    print(f"CPU: {cpu_name()}; {args.threads} threads; untuned; {describe()}")
    references = reference_names()
    print(f"{'case':16s} {'kiln ms':>9s}{ratio_columns(references)} {'compile s':>9s}  description")
    results = []
    for name in args.cases:
        case = CASES[name]
        r = bench_case(case, args.threads)
        results.append(r)
        if "failed" in r:
            print(f"{name:16s} FAILED: {r['failed']}")
            continue
        print(
            f"{name:16s} {r['kiln']['median_ms']:9.3f}{ratio_cells(r, references)} "
            f"{r['compile_s']:9.2f}  {case.description}"
        )
    summarize(results, "case", args.json)


def summarize(results: list[dict], label: str, path: Path) -> None:
    """Print the worst kiln/ORT (and kiln/best) ratio and the failures; write every result to
    `path`."""
    timed = [r for r in results if "ratio_median" in r]
    if timed:
        worst = max(timed, key=lambda r: r["ratio_median"])
        print(f"worst kiln/ORT: {worst[label]} {worst['ratio_median']:.2f}")
    both = [r for r in timed if len(r["ratio"]) > 2]  # two references and the faster one
    if both:
        worst = max(both, key=lambda r: r["ratio"]["best"])
        print(f"worst kiln/best: {worst[label]} {worst['ratio']['best']:.2f}")
    table = [r for r in timed if r[label] in ISSUE_TABLE]
    if table:  # the acceptance table of issue 15, on its own
        worst = max(table, key=lambda r: r["ratio_median"])
        print(
            f"worst of issue 15's table ({len(table)} cases): {worst[label]} "
            f"{worst['ratio_median']:.2f}"
        )
    failed = [r[label] for r in results if "failed" in r]
    if failed:
        print(f"failed: {', '.join(failed)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cpu": cpu_name(), f"{label}s": results}, indent=1))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
