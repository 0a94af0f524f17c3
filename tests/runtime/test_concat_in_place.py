"""Concats joined in place: each operand's producer writes straight into its slice of the
joined value and the Concat's kernel does nothing; outputs match ONNX Runtime (random
weights), and joins the memory plan cannot hold in place still copy."""

from __future__ import annotations

import onnxruntime as ort
import pytest
from onnx import helper

import compiler_core
from compiler_core.build import build_kernels, concat_aliases, plan_memory
from compiler_core.frontend.onnx import import_model
from compiler_core.loop.ir import Block
from compiler_core.passes.pipeline import optimize
from compiler_core.runtime import load
from compiler_core.target import parse_target
from tests.conftest import FLOAT, assert_close_to_scale, make_model
from tests.kernels.test_conv_family import rand


def conv(name, x, w, out, pads=0):
    return helper.make_node("Conv", [x, w], [out], name=name, pads=[pads] * 4)


def dense_block(batch=1, layers=3, growth=16, channels=16, size=6):
    """DenseNet's block: each layer's 3x3 conv of the running join, joined to it."""
    nodes, weights, joined, width = [], {}, "x", channels
    for k in range(layers):
        nodes.append(helper.make_node("Relu", [joined], [f"r{k}"], name=f"relu{k}"))
        nodes.append(conv(f"grow{k}", f"r{k}", f"w{k}", f"g{k}", pads=1))
        weights[f"w{k}"] = rand(growth, width, 3, 3, scale=0.2)
        nodes.append(
            helper.make_node("Concat", [joined, f"g{k}"], [f"j{k}"], name=f"join{k}", axis=1)
        )
        joined, width = f"j{k}", width + growth
    nodes.append(conv("head", joined, "wh", "y"))
    weights["wh"] = rand(8, width, 1, 1, scale=0.2)
    shape = [batch, channels, size, size]
    return make_model(nodes, [("x", FLOAT, shape)], [("y", FLOAT, [batch, 8, size, size])], weights)


def inception_join():
    """Four branches of one input joined, read by a conv: Inception's module. (A join whose
    one reader is elementwise fuses into it: that kernel reads the operands once anyway.)"""
    branches = [conv(f"b{k}", "x", f"w{k}", f"o{k}", pads=k % 2) for k in range(4)]
    weights = {f"w{k}": rand(8 * (k + 1), 16, 1 + 2 * (k % 2), 1 + 2 * (k % 2)) for k in range(4)}
    weights["wh"] = rand(8, 80, 1, 1)
    nodes = [
        *branches,
        helper.make_node("Concat", [f"o{k}" for k in range(4)], ["j"], name="join", axis=1),
        conv("head", "j", "wh", "y"),
    ]
    return make_model(nodes, [("x", FLOAT, [1, 16, 8, 8])], [("y", FLOAT, [1, 8, 8, 8])], weights)


def does_nothing(kernel) -> bool:
    return isinstance(kernel.func.body, Block) and not kernel.func.body.stmts


# The joins' structure depends on the channel blocks the layout pass picks, so the tests that
# read it name their target (AVX2: blocks of 8); each model also runs on the host, whatever it
# picks there, against ONNX Runtime.
AVX2 = parse_target("llvm -mcpu=znver3")
AVX512 = parse_target("llvm -mcpu=znver5 -mattr=+avx2,+fma,+avx512f")


def joins(model, target=AVX2):
    graph = optimize(import_model(model), target=target)
    return graph, concat_aliases(graph)


def matches_onnxruntime(model):
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]
    feeds = {"x": rand(*shape)}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    actual = load(compiler_core.compile(model)).run(feeds)["y"]
    assert_close_to_scale(actual, session.run(None, feeds)[0])


@pytest.mark.parametrize("model", [dense_block, inception_join])
def test_joins_in_place_match_onnxruntime(model):
    graph, aliases = joins(model())
    assert aliases  # something was joined in place
    kernels = build_kernels(graph, AVX2)
    memory = plan_memory(graph, kernels)
    for value, (host, start) in aliases.items():
        assert memory.offsets[value] == memory.offsets[host] + start
    matches_onnxruntime(model())


def test_nested_joins_live_in_the_outermost_and_their_kernels_do_nothing():
    graph, aliases = joins(dense_block(layers=4))
    hosts = {host for host, _ in aliases.values()}
    assert len(hosts) == 1  # every later layer's features inside the last join
    kernels = build_kernels(graph, AVX2)
    joined = hosts | set(aliases)
    elided = [k for k in kernels if set(k.outputs) & joined and does_nothing(k)]
    assert len(elided) == 3  # the first join is fused with its operand's layout transform


def test_a_batch_of_two_is_not_contiguous_and_copies():
    graph, aliases = joins(dense_block(batch=2))
    assert not aliases
    matches_onnxruntime(dense_block(batch=2))


def test_slices_off_the_cache_line_copy():
    """Inception's join at 7 x 7: a block of 8 channels is 1568 bytes, so the second branch's
    slice would start mid-line (every store of its conv split in two)."""
    model = inception_join()
    model.graph.input[0].type.tensor_type.shape.dim[2].dim_value = 7
    model.graph.input[0].type.tensor_type.shape.dim[3].dim_value = 7
    model.graph.output[0].type.tensor_type.shape.dim[2].dim_value = 7
    model.graph.output[0].type.tensor_type.shape.dim[3].dim_value = 7
    _, aliases = joins(model)
    assert not aliases
    matches_onnxruntime(model)


def test_an_operand_that_is_a_graph_input_is_copied():
    """The block's first join reads the graph's input (through its layout transform, with
    which it fuses); the later joins, whose operands are intermediates, are in place."""
    graph, aliases = joins(dense_block(layers=3))
    first_join = next(n for n in graph.nodes if n.op == "Concat")
    assert not set(first_join.inputs) & set(aliases)
    assert {"g1_nchw8c", "g2_nchw8c"} <= set(aliases)


def test_with_avx512_blocks_a_dense_block_joins_in_place_and_mixed_blocks_copy():
    """Blocks of 16 channels: DenseNet's 16-channel growth joins in place as with blocks of 8;
    Inception's branches of 8 and 24 channels end mid-block, so the branches are unblocked and
    joined in the plain layout, by a copy."""
    _, aliases = joins(dense_block(layers=3), AVX512)
    assert {"g1_nchw16c", "g2_nchw16c"} <= set(aliases)
    _, aliases = joins(inception_join(), AVX512)
    assert not aliases


def test_an_operand_that_is_a_graph_output_is_copied():
    """An output lives in the caller's buffer: the join that reads it copies."""
    model = make_model(
        [
            helper.make_node("MatMul", ["x", "wa"], ["a"], name="a"),
            helper.make_node("MatMul", ["x", "wb"], ["b"], name="b"),
            helper.make_node("Concat", ["a", "b"], ["j"], name="join", axis=1),
            helper.make_node("MatMul", ["j", "wy"], ["y"], name="y"),
            helper.make_node("MatMul", ["j", "wz"], ["z"], name="z"),
        ],
        [("x", FLOAT, [1, 32])],
        [("y", FLOAT, [1, 8]), ("z", FLOAT, [1, 8]), ("a", FLOAT, [1, 16])],
        {"wa": rand(32, 16), "wb": rand(32, 16), "wy": rand(32, 8), "wz": rand(32, 8)},
    )
    _, aliases = joins(model)
    assert not aliases
    feeds = {"x": rand(1, 32)}
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    actual = load(compiler_core.compile(model)).run(feeds)
    for name, expected in zip(["y", "z", "a"], session.run(None, feeds), strict=True):
        assert_close_to_scale(actual[name], expected, label=name)
    model.graph.output.pop()  # without the output, the join is in place
    _, aliases = joins(model)
    assert set(aliases) == {"a", "b"}
