"""The bench zoo: architectures the shared models lack, Kiln (untuned) against ONNX Runtime.

    python bench/zoo_export.py --out build/zoo            # once, in a venv with torch
    .venv/bin/python -m bench.zoo --dir build/zoo [--models unet vit_b_16] [--threads 2]

Each model (exported by `bench/zoo_export.py`, with a sidecar JSON of its input shapes) is
compiled natively, checked against ORT (max error within 1e-4 of the output's scale) and timed
against it in alternating blocks (`bench.run.interleaved`). The table prints medians, kiln/ORT
per model and the worst ratio; a model that fails to compile or to match is reported as such.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import numpy as np

import compiler_core
from bench.ops import max_error, summarize
from bench.run import cpu_name, interleaved, ort_session, stats
from compiler_core.runtime import load


def zoo_models(directory: Path) -> dict[str, dict]:
    return {
        path.stem: json.loads(path.with_suffix(".json").read_text())
        for path in sorted(directory.glob("*.onnx"))
        if path.with_suffix(".json").exists()
    }


def bench_zoo_model(path: Path, info: dict, threads: int, blocks: int) -> dict:
    shapes = info["inputs"]
    result = {"model": path.stem, "family": info.get("family", "")}
    started = time.perf_counter()
    archive = compiler_core.compile(str(path), shapes=shapes)
    result["compile_seconds"] = round(time.perf_counter() - started, 2)
    module = load(archive, num_threads=threads)
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(s).astype(d) for n, s, d in module.inputs}
    session = ort_session(str(path), threads)
    ours = module.run(feeds)
    names = [o.name for o in session.get_outputs()]
    theirs = dict(zip(names, session.run(None, feeds), strict=True))
    error = max(max_error(ours[name], theirs[name]) for name in theirs)
    result["max_error"] = error
    if not error <= 1e-4:
        result["failed"] = f"output differs from ORT: max error {error:.2e} of its scale"
        return result
    times = interleaved(lambda: module.run(feeds), lambda: session.run(None, feeds), blocks)
    result["kiln"], result["onnxruntime"] = stats(times["ours"]), stats(times["theirs"])
    result["ratio_median"] = result["kiln"]["median_ms"] / result["onnxruntime"]["median_ms"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("build/zoo"))
    parser.add_argument("--models", nargs="*")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--json", type=Path, default=Path("bench/zoo.json"))
    args = parser.parse_args()
    available = zoo_models(args.dir)
    if not available:
        parser.error(f"no exported models in {args.dir}: run bench/zoo_export.py first")
    names = args.models or list(available)
    missing = sorted(set(names) - set(available))
    if missing:
        parser.error(f"not exported in {args.dir}: {missing}")

    print(f"CPU: {cpu_name()}; {args.threads} threads; untuned")
    print(
        f"{'model':14s} {'compile s':>9s} {'kiln ms':>9s} {'ORT ms':>9s} {'kiln/ORT':>8s}  family"
    )
    results = []
    for name in names:
        try:
            r = bench_zoo_model(
                args.dir / f"{name}.onnx", available[name], args.threads, args.blocks
            )
        except Exception as err:  # a model we cannot build is a result, not a crash of the bench
            traceback.print_exc()
            r = {"model": name, "failed": f"{type(err).__name__}: {err}"}
        results.append(r)
        if "failed" in r:
            print(f"{name:14s} FAILED: {r['failed'][:200]}")
            continue
        print(
            f"{name:14s} {r['compile_seconds']:9.1f} {r['kiln']['median_ms']:9.2f} "
            f"{r['onnxruntime']['median_ms']:9.2f} {r['ratio_median']:8.2f}  {r['family']}"
        )
    summarize(results, "model", args.json)


if __name__ == "__main__":
    main()
