"""The `kiln` command line.

kiln inspect model.onnx [--shape x=1,784] [--after PASS] [--constants]
    the graph before and after the pass pipeline, and the fused groups
kiln verify model.onnx [--shape x=1,784] [--seed N]
    the optimized graph against the imported one (numpy reference executor) and against
    ONNX Runtime where it is installed, on random inputs
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import numpy as np

from compiler_core.frontend.onnx import KilnImportError, import_model
from compiler_core.graph.ir import Graph
from compiler_core.graph.ops.base import ShapeError
from compiler_core.graph.printer import format_graph, format_groups
from compiler_core.passes.pipeline import PASS_NAMES, optimize

RTOL, ATOL = 1e-4, 1e-5


class UsageError(ValueError):
    pass


def parse_shapes(items: Sequence[str] | None) -> dict[str, list[int]]:
    """`name=1,3,224,224` entries -> {name: [1, 3, 224, 224]}."""
    shapes = {}
    for item in items or ():
        name, sep, dims = item.partition("=")
        try:
            if not sep or not name:
                raise ValueError
            shapes[name] = [int(d) for d in dims.split(",") if d.strip()]
        except ValueError:
            raise UsageError(f"--shape {item!r}: expected NAME=D0,D1,... (e.g. x=1,784)") from None
    return shapes


def random_inputs(graph: Graph, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds = {}
    for name in graph.inputs:
        t = graph.types[name]
        if t.dtype == "bool":
            feeds[name] = rng.integers(0, 2, t.shape).astype(bool)
        elif np.dtype(t.dtype).kind in "iu":
            feeds[name] = rng.integers(0, 10, t.shape).astype(t.dtype)
        else:
            feeds[name] = rng.standard_normal(t.shape).astype(t.dtype)
    return feeds


def summary(graph: Graph) -> str:
    ops = ", ".join(f"{op} x{count}" for op, count in graph.op_histogram().items())
    weights = sum(graph.types[name].nbytes for name in graph.constants)
    return (
        f"{len(graph.nodes)} nodes, {len(graph.constants)} constants "
        f"({weights / 2**20:.1f} MiB): {ops}"
    )


def cmd_inspect(args) -> int:
    graph = import_model(args.model, shapes=parse_shapes(args.shape))
    optimized = optimize(graph, stop_after=args.after)
    print(f"== imported: {summary(graph)}")
    print(format_graph(graph, show_constants=args.constants))
    label = f"after {args.after}" if args.after else "after the pipeline"
    print(f"\n== {label} ({' -> '.join(PASS_NAMES)}): {summary(optimized)}")
    print(format_graph(optimized, show_constants=args.constants))
    if optimized.groups:
        print()
        print(format_groups(optimized))
    return 0


def _max_errors(actual: np.ndarray, expected: np.ndarray) -> tuple[float, bool]:
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        return float("inf"), False
    if actual.dtype.kind not in "fc":
        return float(np.sum(actual != expected)), bool(np.array_equal(actual, expected))
    diff = np.abs(actual.astype(np.float64) - expected.astype(np.float64))
    ok = bool(np.allclose(actual, expected, rtol=RTOL, atol=ATOL))
    return float(diff.max(initial=0.0)), ok


def cmd_verify(args) -> int:
    from compiler_core.reference import run_graph

    started = time.perf_counter()
    graph = import_model(args.model, shapes=parse_shapes(args.shape))
    optimized = optimize(graph)
    compile_seconds = time.perf_counter() - started
    feeds = random_inputs(graph, args.seed)
    results = run_graph(optimized, feeds)
    print(f"{args.model}: {summary(graph)}")
    print(f"optimized in {compile_seconds:.2f}s: {summary(optimized)}")
    oracles = {"imported graph": run_graph(graph, feeds)}
    try:
        import onnxruntime as ort

        session = ort.InferenceSession(str(args.model), providers=["CPUExecutionProvider"])
        values = session.run(None, feeds)
        oracles["onnxruntime"] = dict(zip(graph.outputs, values, strict=True))
    except ImportError:
        print("onnxruntime is not installed: comparing with the imported graph only")
    all_ok = True
    for oracle, expected in oracles.items():
        for name in graph.outputs:
            err, ok = _max_errors(results[name], expected[name])
            all_ok &= ok
            verdict = "ok" if ok else "MISMATCH"
            print(
                f"  vs {oracle:15s} {name}: max abs error {err:.3g} "
                f"(rtol {RTOL}, atol {ATOL}) {verdict}"
            )
    return 0 if all_ok else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description="Kiln inference compiler")
    sub = parser.add_subparsers(dest="command", required=True)

    inspect = sub.add_parser("inspect", help="print the graph before/after the pass pipeline")
    inspect.add_argument("model")
    inspect.add_argument("--shape", action="append", help="bind an input shape: NAME=D0,D1,...")
    inspect.add_argument("--after", choices=PASS_NAMES, help="stop after this pass")
    inspect.add_argument("--constants", action="store_true", help="list constants too")
    inspect.set_defaults(run=cmd_inspect)

    verify = sub.add_parser("verify", help="check the optimized graph against oracles")
    verify.add_argument("model")
    verify.add_argument("--shape", action="append", help="bind an input shape: NAME=D0,D1,...")
    verify.add_argument("--seed", type=int, default=0)
    verify.set_defaults(run=cmd_verify)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (KilnImportError, ShapeError, UsageError, FileNotFoundError) as err:
        print(f"kiln {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
