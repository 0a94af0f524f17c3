"""The bench zoo: architectures the shared models lack, Kiln (untuned) against ONNX Runtime
and OpenVINO.

    python bench/zoo_export.py --out build/zoo            # once, in a venv with torch
    .venv/bin/python -m bench.zoo --dir build/zoo [--models unet vit_b_16] [--threads 2]
    .venv/bin/python -m bench.zoo --light                 # the onnx package's zoo graphs only

Each model (exported by `bench/zoo_export.py`, with a sidecar JSON of its input shapes) is
compiled natively, checked against ORT (max error within 1e-4 of the output's scale) and timed
against it and OpenVINO (where installed) in alternating blocks
(`bench.engines.compare_and_time`). The table prints medians, kiln/ORT, kiln/OV and kiln/best
per model and the worst ratios; a model that fails to compile or to match is reported as such.

`--light` adds the nine model-zoo graphs the `onnx` package ships for its backend tests
(AlexNet, DenseNet-121, Inception v1/v2, ResNet-50, ShuffleNet v1, SqueezeNet, VGG-19,
ZFNet-512), which need no export: their weights are constant fills, which leaves the work
of every kernel as it is (outputs are still checked against ORT's).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path

import numpy as np
import onnx

import compiler_core
from bench.engines import (
    compare_and_time,
    describe,
    ratio_cells,
    ratio_columns,
    reference_names,
    yardsticks,
)
from bench.ops import summarize
from bench.run import cpu_name
from compiler_core.runtime import load


def zoo_models(directory: Path) -> dict[str, tuple[Path, dict]]:
    """name -> (model, its sidecar: input shapes and family) of each exported model."""
    return {
        path.stem: (path, json.loads(path.with_suffix(".json").read_text()))
        for path in sorted(directory.glob("*.onnx"))
        if path.with_suffix(".json").exists()
    }


def light_models() -> dict[str, tuple[Path, dict]]:
    """The onnx package's model-zoo graphs (`light_<name>.onnx`, static input shapes)."""
    directory = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
    models = {}
    for path in sorted(directory.glob("light_*.onnx")):
        graph = onnx.load(str(path), load_external_data=False).graph
        initializers = {tensor.name for tensor in graph.initializer}
        inputs = {
            value.name: [d.dim_value for d in value.type.tensor_type.shape.dim]
            for value in graph.input
            if value.name not in initializers
        }
        models[path.stem] = (path, {"inputs": inputs, "family": "onnx light zoo"})
    return models


def bench_zoo_model(path: Path, info: dict, threads: int, blocks: int) -> dict:
    shapes = info["inputs"]
    result = {"model": path.stem, "family": info.get("family", "")}
    started = time.perf_counter()
    archive = compiler_core.compile(str(path), shapes=shapes)
    result["compile_seconds"] = round(time.perf_counter() - started, 2)
    module = load(archive, num_threads=threads)
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(s).astype(d) for n, s, d in module.inputs}
    references = yardsticks(str(path), threads, shapes)
    return result | compare_and_time(module.run, references, feeds, blocks)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path("build/zoo"))
    parser.add_argument("--light", action="store_true", help="also the onnx package's zoo")
    parser.add_argument("--models", nargs="*")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--json", type=Path, default=Path("bench/zoo.json"))
    args = parser.parse_args()
    available = zoo_models(args.dir) | (light_models() if args.light else {})
    if not available:
        parser.error(f"no exported models in {args.dir}: run bench/zoo_export.py first")
    names = args.models or list(available)
    missing = sorted(set(names) - set(available))
    if missing:
        parser.error(f"not exported in {args.dir} (nor --light): {missing}")

    print(f"CPU: {cpu_name()}; {args.threads} threads; untuned; {describe()}")
    references = reference_names()
    print(f"{'model':14s} {'compile s':>9s} {'kiln ms':>9s}{ratio_columns(references)}  family")
    results = []
    for name in names:
        try:
            r = bench_zoo_model(*available[name], args.threads, args.blocks)
        except Exception as err:  # a model we cannot build is a result, not a crash of the bench
            traceback.print_exc()
            r = {"model": name, "failed": f"{type(err).__name__}: {err}"}
        results.append(r)
        if "failed" in r:
            print(f"{name:14s} FAILED: {r['failed'][:200]}")
            continue
        print(
            f"{name:14s} {r['compile_seconds']:9.1f} {r['kiln']['median_ms']:9.2f}"
            f"{ratio_cells(r, references)}  {r['family']}"
        )
    summarize(results, "model", args.json)


if __name__ == "__main__":
    main()
