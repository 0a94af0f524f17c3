"""Shared fixtures: the benchmark models in ../shared/models and small ONNX graph builders."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from compiler_core.runtime.module import random_inputs

REPO = Path(__file__).resolve().parents[1]
MODELS_DIR = REPO.parent / "shared" / "models"
LIGHT_DIR = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
SHARED_MODELS = ["resnet18", "mobilenet_v2", "encoder4", "mlp"]
LIGHT_MODELS = sorted(p.stem for p in LIGHT_DIR.glob("light_*.onnx"))


def shared_model(name: str) -> Path:
    path = MODELS_DIR / f"{name}.onnx"
    if not path.exists():
        pytest.fail(f"benchmark model {path} is missing: ../shared/models must sit beside the repo")
    return path


def light_model_logits(name: str) -> onnx.ModelProto:
    """A model-zoo 'light' graph with its final Softmax cut off: the output is the logits.

    The light graphs carry synthetic weights that drive the logits to ~1e9 with every class
    equal, so the shipped softmax is exactly uniform; any float32 summation order other than
    the one that made it (numpy's, from one release to the next) moves the logits by a few
    hundred and the softmax anywhere. The logits compare meaningfully at rtol 1e-4.
    """
    model = onnx.shape_inference.infer_shapes(onnx.load(str(LIGHT_DIR / f"{name}.onnx")))
    graph = model.graph
    last = graph.node[-1]
    if last.op_type == "Softmax" and list(last.output) == [o.name for o in graph.output]:
        logits = next(v for v in graph.value_info if v.name == last.input[0])
        del graph.node[-1]
        del graph.output[:]
        graph.output.append(logits)
    return model


def random_feeds(inputs, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs for (name, shape, dtype) triples: the compiler's own generator."""
    return random_inputs(inputs, seed)


def assert_close_to_scale(actual, expected, rtol: float = 1e-4, label: str = "") -> None:
    """Max error within `rtol` of the expected output's scale (its largest magnitude)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{label}: shape {actual.shape} != {expected.shape}"
    scale = max(float(np.max(np.abs(expected), initial=0.0)), 1e-6)
    error = float(np.max(np.abs(actual - expected), initial=0.0)) / scale
    assert error <= rtol, f"{label}: max error {error:.2e} of the output's scale (> {rtol})"


def make_model(nodes, inputs, outputs, initializers=(), opset=17, name="test"):
    """A small ONNX model from (name, elem_type, shape) tuples and numpy initializers."""
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
        [helper.make_tensor_value_info(n, t, s) for n, t, s in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in dict(initializers).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64


def loop_structure(func) -> tuple[int, list[int]]:
    """(stores, extents of the time loops) of a kernel: a recurrence compiled as one loop has
    the stores of one step whatever the number of steps, and one time loop of that extent."""
    from compiler_core.loop.ir import For, Store
    from compiler_core.loop.transform import walk_stmts

    statements = list(walk_stmts(func.body))
    stores = sum(isinstance(s, Store) for s in statements)
    loops = [s.extent for s in statements if isinstance(s, For) and s.var.name.endswith("_t")]
    return stores, loops


def pairwise_cover(space: list[dict]) -> list[dict]:
    """Configs of `space` that between them hold every pair of knob values found together in
    it (greedy: each pick covers the most pairs not yet covered), the first one first. Two
    knobs that break only together still meet; a broken single value shows in every pick
    that holds it."""

    def pairs(config: dict) -> set:
        items = sorted((k, repr(v)) for k, v in config.items())
        return {(a, b) for i, a in enumerate(items) for b in items[i + 1 :]}

    left = set().union(*(pairs(c) for c in space))
    chosen = [space[0]]
    left -= pairs(space[0])
    while left:
        best = max(space, key=lambda c: len(pairs(c) & left))
        chosen.append(best)
        left -= pairs(best)
    return chosen


def one_knob_off_default(tunable) -> list[dict]:
    """The default config, then each knob moved off its default to every value that fits,
    one knob at a time."""
    default = tunable.default_config()
    return [default] + [
        {**default, knob.name: value}
        for knob in tunable.knobs
        for value in knob.choices
        if value != knob.default and tunable.fits({**default, knob.name: value})
    ]


def measurement_errors(task, configs: list[dict]) -> list[tuple]:
    """(config, error code, detail) of each config the measurer (one repeat, checked against
    the reference answer) did not find ok."""
    from compiler_core.autotune.measure import MeasureOptions, Measurer
    from compiler_core.target import parse_target

    options = MeasureOptions(repeats=1, min_repeat_seconds=0.0)
    with Measurer(parse_target("llvm"), options) as measurer:
        results = measurer.measure(task, configs)
    return [
        (c, r.error, r.detail) for c, r in zip(configs, results, strict=True) if r.error != "ok"
    ]


def parallel_loop(task) -> str:
    """The loop a task's default schedule runs in parallel (its one `Parallel` record)."""
    (parallel,) = [r for r in task.records() if type(r).__name__ == "Parallel"]
    return parallel.loop
