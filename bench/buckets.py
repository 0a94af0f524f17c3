"""Batch buckets end to end: one archive with plans for batches 1..16, run at other batches.

    .venv/bin/python -m bench.buckets [--models resnet18 mlp] [--buckets 1,2,4,8,16]

Compiles each shared model with `batch_buckets`, then runs batches 1, 3, 7 and 16 through the
one archive and through ONNX Runtime (the model with a symbolic batch), printing the max error
against ORT (of the output's scale) and both latencies (medians of alternating blocks).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnx

import compiler_core
from bench.engines import max_error, ort_session
from bench.run import MODELS_DIR, interleaved
from compiler_core.batching import with_symbolic_batch
from compiler_core.runtime import load

SHAPES = {"mlp": {"x": [1, 784]}}
BATCHES = (1, 3, 7, 16)


def bench_batch(module, session, batch: int) -> tuple[float, float, float]:
    """(max error of scale, kiln ms, ORT ms) at `batch`."""
    (input_name, shape, dtype), *_ = module.inputs
    rng = np.random.default_rng(batch)
    feeds = {input_name: rng.standard_normal((batch, *shape[1:])).astype(dtype)}
    ours = list(module.run(feeds).values())
    theirs = session.run(None, feeds)
    error = max(max_error(a, b) for a, b in zip(ours, theirs, strict=True))
    times = interleaved(lambda: module.run(feeds), lambda: session.run(None, feeds), 3)
    kiln, ort_ms = (float(np.median(times[k]) * 1e3) for k in ("ours", "theirs"))
    return error, kiln, ort_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["resnet18", "mlp"])
    parser.add_argument("--buckets", default="1,2,4,8,16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    buckets = [int(b) for b in args.buckets.split(",")]
    for name in args.models:
        path = MODELS_DIR / f"{name}.onnx"
        started = time.perf_counter()
        archive = compiler_core.compile(str(path), shapes=SHAPES.get(name), batch_buckets=buckets)
        seconds = time.perf_counter() - started
        verification = archive.manifest["verification"]
        size = len(archive.to_bytes())
        check = f"{verification['passed']} (max abs {verification['max_abs_error']:.2g})"
        print(
            f"{name}: buckets {buckets}, compiled in {seconds:.1f}s, {size} bytes, verified {check}"
        )
        module = load(archive, num_threads=args.threads)
        session = ort_session(with_symbolic_batch(onnx.load(str(path))).SerializeToString(), 2)
        for batch in (b for b in BATCHES if b <= buckets[-1]):
            error, kiln, ort_ms = bench_batch(module, session, batch)
            print(
                f"  batch {batch:2d}: max error {error:.2e} of scale; kiln {kiln:8.3f} ms, "
                f"ORT {ort_ms:8.3f} ms ({kiln / ort_ms:.2f}x)"
            )


if __name__ == "__main__":
    main()
