"""Side-by-side benchmarks: Kiln's compiled modules against ONNX Runtime, OpenVINO and numpy,
measured in the same run on the same machine, with the machine's FMA peak as the yardstick.

    .venv/bin/python -m bench.run [--models resnet18 mlp] [--threads 2] [--tuned]

`--tuned` also builds each model with its committed log (`bench/tuning/<model>.jsonl`, written
by `kiln tune ... --export-best`: the best record of each workload and machine) and compares
that build with ONNX Runtime in the same run; a GEMM case with a log
(`bench/tuning/gemm_MxKxN.jsonl`: `kiln tune` over `gemm_model`) is timed tuned too.

The yardsticks are ONNX Runtime and, where the `bench` extra installed it, OpenVINO (float32,
the same threads; `bench/engines.py`): each leads on different models, so the table gives
kiln/ORT, kiln/OV and kiln/best, against the faster of the two. Latency is measured in
alternating blocks (ten runs of one engine, then ten of the next, a 0.3 s pause before each
block and its first run dropped): ORT's worker threads keep spinning for about 100 ms after a
call and would slow whatever runs right after them. Medians and p90 over all kept runs.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import tempfile
import threading
import time
from pathlib import Path

import llvmlite.ir as ir
import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import compiler_core
from bench.engines import (
    BLOCK,
    BLOCKS,
    compare_and_time,
    describe,
    random_feeds,
    ratio_cells,
    ratio_columns,
    reference_names,
    timed_in_blocks,
    yardsticks,
)
from compiler_core.codegen.native import emit_object, link_shared
from compiler_core.runtime import load
from compiler_core.target import host_target

MODELS_DIR = Path(__file__).resolve().parents[2] / "shared" / "models"
MODEL_CASES = {
    "resnet18": None,
    "mobilenet_v2": None,
    "encoder4": None,
    "mlp_b1": {"x": [1, 784]},
    "mlp_b64": {"x": [64, 784]},
}
GEMM_CASES = [(n, n, n) for n in (256, 512, 1024, 2048)] + [(1, 784, 1024), (64, 784, 1024)]
TUNING_DIR = Path(__file__).resolve().parent / "tuning"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# --- FMA peak ----------------------------------------------------------------------------------


def _peak_library(lanes: int, chains: int) -> ctypes.CDLL:
    """void fma_peak(i64 n, float* out): `chains` independent vector FMA chains, n steps."""
    target = host_target()
    module = ir.Module(name="peak")
    module.triple = target.triple
    f32, i64 = ir.FloatType(), ir.IntType(64)
    vec = ir.VectorType(f32, lanes)
    fma = ir.Function(module, ir.FunctionType(vec, [vec, vec, vec]), name=f"llvm.fma.v{lanes}f32")
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [i64, ir.PointerType()]), "fma_peak")
    n, out = fn.args
    entry, loop, done = (fn.append_basic_block(x) for x in ("entry", "loop", "done"))
    b = ir.IRBuilder(entry)
    b.branch(loop)
    b.position_at_end(loop)
    i = b.phi(i64)
    i.add_incoming(i64(0), entry)
    accs = [b.phi(vec) for _ in range(chains)]
    scale = ir.Constant(vec, [0.999999] * lanes)
    shift = ir.Constant(vec, [1e-7] * lanes)
    for k, acc in enumerate(accs):
        acc.add_incoming(ir.Constant(vec, [float(k)] * lanes), entry)
    nexts = [b.call(fma, [acc, scale, shift]) for acc in accs]
    step = b.add(i, i64(1))
    for acc, value in zip(accs, nexts, strict=True):
        acc.add_incoming(value, loop)
    i.add_incoming(step, loop)
    b.cbranch(b.icmp_signed("<", step, n), loop, done)
    b.position_at_end(done)
    total = nexts[0]
    for value in nexts[1:]:
        total = b.fadd(total, value)
    b.store(b.extract_element(total, ir.IntType(32)(0)), out)
    b.ret_void()
    path = Path(tempfile.mkdtemp(prefix="kiln-peak-")) / "peak.so"
    link_shared([emit_object(module, target)], path)
    return ctypes.CDLL(str(path))


def fma_peak_gflops(threads: int) -> float:
    target = host_target()
    # Enough independent chains to cover the FMA latency on every pipe, few enough to stay in
    # registers with the two constants: 16 chains spilled on AVX2's 16 ymm registers and
    # measured half the peak (50 against 100 GFLOP/s per core on a Zen 3).
    lanes, chains = target.vector_lanes, target.vector_registers - 4
    lib = _peak_library(lanes, chains)
    steps = 20_000_000
    sink = [np.zeros(1, np.float32) for _ in range(threads)]

    def work(k):
        lib.fma_peak(ctypes.c_int64(steps), ctypes.c_void_p(sink[k].ctypes.data))

    work(0)  # warm up
    best = 0.0
    for _ in range(3):
        pool = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
        started = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        seconds = time.perf_counter() - started
        best = max(best, threads * steps * chains * lanes * 2 / seconds / 1e9)
    return best


# --- latency -----------------------------------------------------------------------------------


def interleaved(ours, theirs, blocks=BLOCKS, block=BLOCK):
    """Times (seconds) of two engines, "ours" and "theirs", in alternating blocks."""
    return timed_in_blocks({"ours": ours, "theirs": theirs}, blocks, block)


def model_file(name: str) -> str:
    return name.split("_b")[0] if name.startswith("mlp") else name


def bench_model(name: str, shapes, threads: int, tuning: Path | None = None) -> dict:
    path = MODELS_DIR / f"{model_file(name)}.onnx"
    started = time.perf_counter()
    archive = compiler_core.compile(str(path), shapes=shapes, tuning=tuning)
    compile_seconds = time.perf_counter() - started
    module = load(archive, num_threads=threads)
    feeds = random_feeds(module.inputs)
    references = yardsticks(str(path), threads, shapes)
    tuned = sum(1 for k in archive.manifest["kernels"].values() if isinstance(k, dict))
    return {
        "model": name,
        "tuning": str(tuning) if tuning else None,
        "tuned_kernels": tuned,
        "compile_seconds": round(compile_seconds, 2),
        **compare_and_time(module.run, references, feeds),
    }


def gemm_model(m: int, k: int, n: int) -> bytes:
    weights = np.random.default_rng(1).standard_normal((k, n)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["a", "b"], ["c"])],
        "gemm",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [m, k])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [m, n])],
        [numpy_helper.from_array(weights, "b")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def gemm_log(m: int, k: int, n: int) -> Path:
    """The committed tuning log of one GEMM case (`kiln tune` over `gemm_model`'s model)."""
    return TUNING_DIR / f"gemm_{m}x{k}x{n}.jsonl"


def bench_gemm(m: int, k: int, n: int, threads: int, tuning: Path | None = None) -> dict:
    data = gemm_model(m, k, n)
    module = load(compiler_core.compile(data, tuning=tuning), num_threads=threads)
    weights = numpy_helper.to_array(onnx.load_from_string(data).graph.initializer[0])
    a = np.random.default_rng(2).standard_normal((m, k)).astype(np.float32)
    times = interleaved(lambda: module.run({"a": a}), lambda: a @ weights)
    flops = 2 * m * n * k
    ours = flops / np.median(times["ours"]) / 1e9
    numpy_rate = flops / np.median(times["theirs"]) / 1e9
    return {
        "shape": [m, k, n],
        "tuning": str(tuning) if tuning else None,
        "kiln_gflops": ours,
        "numpy_gflops": numpy_rate,
        "ratio": ours / numpy_rate,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODEL_CASES), choices=list(MODEL_CASES))
    parser.add_argument("--gemm", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path("bench/results.json"))
    parser.add_argument(
        "--tuned",
        action="store_true",
        help="also build each model with its log bench/tuning/<model>.jsonl and compare that",
    )
    args = parser.parse_args()

    peak = fma_peak_gflops(args.threads)
    print(f"CPU: {cpu_name()}; {args.threads} threads; FMA peak {peak:.0f} GFLOP/s (measured)")
    results = {
        "cpu": cpu_name(),
        "threads": args.threads,
        "fma_peak_gflops": peak,
        "models": [],
        "gemm": [],
    }
    print(describe())
    references = reference_names()
    print(f"{'model':14s} {'compile s':>9s} {'kiln ms (p90)':>16s}{ratio_columns(references)}")
    for name in args.models:
        logs = [None]
        if args.tuned:
            logs.append(TUNING_DIR / f"{model_file(name)}.jsonl")
        for log in logs:
            if log is not None and not log.exists():
                print(f"{name}: no tuning log {log}")
                continue
            r = bench_model(name, MODEL_CASES[name], args.threads, log)
            results["models"].append(r)
            label = f"{name} tuned" if log else name
            if "failed" in r:
                print(f"{label:14s} FAILED: {r['failed']}")
                continue
            print(
                f"{label:14s} {r['compile_seconds']:9.1f} "
                f"{r['kiln']['median_ms']:8.3f} ({r['kiln']['p90_ms']:6.3f})"
                f"{ratio_cells(r, references)}"
                + (f"  ({r['tuned_kernels']} tuned kernels)" if log else "")
            )
    if args.gemm:
        print(
            f"{'GEMM m,k,n':18s} {'kiln GFLOP/s':>12s} {'numpy':>8s} {'kiln/numpy':>10s} "
            f"{'% peak':>7s}"
        )
        for m, k, n in GEMM_CASES:
            logs = [None]
            if args.tuned and gemm_log(m, k, n).exists():
                logs.append(gemm_log(m, k, n))
            for log in logs:
                r = bench_gemm(m, k, n, args.threads, log)
                results["gemm"].append(r)
                print(
                    f"{m:5d},{k:5d},{n:5d}  {r['kiln_gflops']:12.1f} {r['numpy_gflops']:8.1f} "
                    f"{r['ratio']:10.2f} {100 * r['kiln_gflops'] / peak:6.1f}%"
                    + ("  tuned" if log else "")
                )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    print(f"results: {args.json}")


if __name__ == "__main__":
    main()
