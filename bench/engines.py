"""The yardstick engines the benches time Kiln against: ONNX Runtime and OpenVINO.

Each leads on different models, so a bench reports kiln against each and against the faster
of the two, all timed in one run (`timed_in_blocks`). Both run float32 on the CPU with the
bench's thread count and one inference stream: OpenVINO defaults to bfloat16 inference on
CPUs with AVX-512 BF16 (Zen 4, Sapphire Rapids and later), a different answer from ours and
ORT's, so its precision hint is pinned to f32 and the compiled model is asked back what it
runs.

OpenVINO is optional (the `bench` extra): without it a bench reports ORT alone.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort

try:
    import openvino
except ImportError:  # the yardstick is optional; benches say so in their header
    openvino = None

SETTLE_SECONDS = 0.3
BLOCK, BLOCKS = 10, 8

Model = bytes | str  # serialized ONNX or a path
Runner = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]


def ort_session(model: Model, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def ort_runner(model: Model, threads: int) -> Runner:
    session = ort_session(model, threads)
    names = [o.name for o in session.get_outputs()]

    def run(feeds):
        return dict(zip(names, session.run(None, feeds), strict=True))

    return run


def reference_names() -> list[str]:
    """The reference engines `yardsticks` returns here, in its order."""
    return ["onnxruntime", "openvino"] if openvino is not None else ["onnxruntime"]


def openvino_runner(
    model: Model, threads: int, shapes: dict[str, list[int]] | None = None
) -> Runner:
    """An OpenVINO CPU request for `model`, float32, `threads` threads, one stream.

    `shapes` fixes symbolic input dimensions (OpenVINO compiles a static shape faster than a
    dynamic one, as we do)."""
    if openvino is None:
        raise RuntimeError("OpenVINO is not installed: pip install -e '.[bench]'")
    core = openvino.Core()
    network = core.read_model(model)
    if shapes:
        network.reshape({name: list(shape) for name, shape in shapes.items()})
    compiled = core.compile_model(
        network,
        "CPU",
        {
            "INFERENCE_NUM_THREADS": threads,
            "NUM_STREAMS": 1,
            "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_PRECISION_HINT": "f32",
        },
    )
    precision = str(compiled.get_property("INFERENCE_PRECISION_HINT"))
    if "32" not in precision:
        raise RuntimeError(f"OpenVINO compiled for {precision}, not float32")
    request = compiled.create_infer_request()
    names = [output.get_any_name() for output in compiled.outputs]

    def run(feeds):
        # Shared buffers: no copy of the inputs in, nor of the outputs out (25 us of mlp's
        # 150 at batch 1); the outputs are views that the next inference overwrites.
        results = request.infer(feeds, share_inputs=True, share_outputs=True)
        return {name: results[output] for name, output in zip(names, compiled.outputs, strict=True)}

    return run


def yardsticks(
    model: Model, threads: int, shapes: dict[str, list[int]] | None = None
) -> dict[str, Runner]:
    """The reference engines available here, by name: "onnxruntime", then "openvino". A
    model OpenVINO cannot read or compile is timed against ORT alone (said on stderr): the
    row of a bench is not lost to the second yardstick."""
    engines = {"onnxruntime": ort_runner(_with_shapes(model, shapes), threads)}
    if openvino is not None:
        try:
            engines["openvino"] = openvino_runner(model, threads, shapes)
        except RuntimeError as err:  # OpenVINO's own errors derive from RuntimeError
            print(f"OpenVINO skipped: {str(err).splitlines()[0][:200]}", file=sys.stderr)
    return engines


def _with_shapes(model: Model, shapes: dict[str, list[int]] | None) -> Model:
    """The model with its symbolic input dimensions fixed (ORT has no reshape of its own)."""
    if not shapes:
        return model
    proto = onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(model)
    for value in proto.graph.input:
        if value.name in shapes:
            dims = value.type.tensor_type.shape.dim
            for dim, size in zip(dims, shapes[value.name], strict=True):
                dim.Clear()
                dim.dim_value = size
    return proto.SerializeToString()


def timed_in_blocks(
    engines: dict[str, Callable[[], object]], blocks: int = BLOCKS, block: int = BLOCK
) -> dict[str, np.ndarray]:
    """Times (seconds) of each engine, measured in alternating blocks, in the engines' order.

    Each block starts after a pause of SETTLE_SECONDS: ORT's worker threads keep spinning for
    about 100 ms after its last call (measured: our next five runs took twice as long), and
    Kiln's and OpenVINO's pool workers spin too; the pause lets each engine's threads park
    before the next one runs. The first run of a block is still dropped.
    """
    times = timed_by_position(engines, blocks, block, reverse=False)
    return {name: t[:, 1:].ravel() for name, t in times.items()}


def timed_by_position(
    engines: dict[str, Callable[[], object]],
    blocks: int,
    block: int,
    pause: float = SETTLE_SECONDS,
    reverse: bool = True,
) -> dict[str, np.ndarray]:
    """Times (seconds) of each engine as [blocks, block]: row b holds block b's runs in the
    order they ran, the first included (callers drop or study it). Each block starts after
    `pause`, as the acceptance checks time (an idle vCPU takes a few milliseconds to reach
    speed again on these hosts, so runs early in a block read slower); with `reverse`, the
    engines' order is reversed every other block, so that neither always follows the same
    one."""
    times = {name: np.zeros((blocks, block)) for name in engines}
    names = list(engines)
    for b in range(blocks):
        for name in names[::-1] if reverse and b % 2 else names:
            time.sleep(pause)
            for k in range(block):
                started = time.perf_counter()
                engines[name]()
                times[name][b, k] = time.perf_counter() - started
    return times


def stats(seconds: np.ndarray) -> dict:
    return {
        "median_ms": float(np.median(seconds) * 1e3),
        "p90_ms": float(np.percentile(seconds, 90) * 1e3),
    }


def max_error(ours: np.ndarray, theirs: np.ndarray) -> float:
    """The largest difference as a fraction of the reference output's scale."""
    scale = max(float(np.max(np.abs(theirs))), 1e-6)
    return float(np.max(np.abs(ours.astype(np.float64) - theirs))) / scale


def outputs_error(ours: dict[str, np.ndarray], theirs: dict[str, np.ndarray]) -> float:
    """`max_error` over the outputs both hold, the largest."""
    return max(max_error(ours[key], value) for key, value in theirs.items() if key in ours)


def compare_and_time(
    ours: Callable[[dict], dict],
    references: dict[str, Runner],
    feeds: dict[str, np.ndarray],
    blocks: int = BLOCKS,
    tolerance: float = 1e-4,
) -> dict:
    """Kiln's outputs checked against each reference, then every engine timed in one run.

    ONNX Runtime is the oracle: an output further than `tolerance` (of the output's scale)
    from ORT's is a failed result, not a speed. Each other engine's distance is recorded.
    Ratios are kiln/engine of medians; "best" is against the faster reference.
    """
    kiln = ours(feeds)
    errors = {name: outputs_error(kiln, run(feeds)) for name, run in references.items()}
    result = {"max_error": errors}
    if not errors["onnxruntime"] <= tolerance:
        result["failed"] = (
            f"output differs from ORT: max error {errors['onnxruntime']:.2e} of its scale"
        )
        return result
    engines = {"kiln": lambda: ours(feeds)}
    engines.update({name: (lambda run=run: run(feeds)) for name, run in references.items()})
    times = timed_in_blocks(engines, blocks)
    for name, seconds in times.items():
        result[name] = stats(seconds)
    ours_ms = result["kiln"]["median_ms"]
    result["ratio"] = {name: ours_ms / result[name]["median_ms"] for name in references}
    result["ratio"]["best"] = ours_ms / min(result[name]["median_ms"] for name in references)
    result["ratio_median"] = result["ratio"]["onnxruntime"]  # the key earlier results used
    return result


def ratio_columns(references: list[str]) -> str:
    """Header of the per-reference time and ratio columns that `ratio_cells` fills."""
    times = "".join(f" {_short(name) + ' ms':>9s}" for name in references)
    shown = [*references, "best"] if len(references) > 1 else references
    return times + "".join(f" {'/' + _short(name):>7s}" for name in shown)


def ratio_cells(result: dict, references: list[str]) -> str:
    """The cells under `ratio_columns`; an engine a row lacks (a model OpenVINO could not
    read) shows a dash."""
    times = "".join(
        f" {result[name]['median_ms']:9.3f}" if name in result else f" {'-':>9s}"
        for name in references
    )
    shown = [*references, "best"] if len(references) > 1 else references
    ratios = result["ratio"]
    return times + "".join(
        f" {ratios[name]:7.2f}" if name in ratios else f" {'-':>7s}" for name in shown
    )


def _short(name: str) -> str:
    return {"onnxruntime": "ORT", "openvino": "OV"}.get(name, name)


def describe() -> str:
    """One line for a bench's header: the yardsticks it times and their versions."""
    line = f"yardsticks: ONNX Runtime {ort.__version__}"
    if openvino is None:
        return line + "; OpenVINO not installed (pip install -e '.[bench]')"
    return line + f", OpenVINO {openvino.__version__.split('-')[0]} (f32)"


def random_feeds(inputs, seed: int = 0) -> dict[str, np.ndarray]:
    """Inputs for a module's (name, shape, dtype) `inputs`: standard normal floats, integers
    in [0, 10) (token ids, indices) for the rest."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, shape, dtype in inputs:
        if np.dtype(dtype).kind == "f":
            feeds[name] = rng.standard_normal(shape).astype(dtype)
        else:
            feeds[name] = rng.integers(0, 10, shape).astype(dtype)
    return feeds
