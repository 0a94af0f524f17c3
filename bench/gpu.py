"""Kiln's GPU archives against ONNX Runtime's CUDA provider, on an NVIDIA GPU, in one run.

    .venv/bin/python -m bench.gpu [--models resnet18 mlp_b1] [--arch sm_90] [--reference cpu]

Each shared model is compiled for `cuda -arch=<the GPU's architecture>` (read from the device
when --arch is not given), run through `compiler_core.runtime` (pycuda), checked against ORT's
output (rtol 1e-4 of the output's scale), and timed in alternating blocks against an ORT
session on the CUDAExecutionProvider. GPU time is measured around synchronised runs, so both
sides pay for their input and output copies. Without a GPU (or without pycuda, or without
ORT's CUDA provider) it says so and exits 2: nothing here is simulated. `--reference cpu`
times ORT's CPU provider instead, for a GPU machine without onnxruntime-gpu: the ratio is then
GPU against the host's cores, not a like-for-like yardstick.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import onnx
import onnxruntime as ort

import compiler_core
from bench.engines import random_feeds, stats
from bench.run import MODEL_CASES, MODELS_DIR, interleaved, model_file
from compiler_core.runtime import load
from compiler_core.runtime.cuda import NoCudaDeviceError

RTOL = 1e-4


PROVIDERS = {"cuda": "CUDAExecutionProvider", "cpu": "CPUExecutionProvider"}


def _session(path, shapes, provider: str) -> ort.InferenceSession:
    model = onnx.load(str(path))
    for value in model.graph.input:
        for dim, size in zip(
            value.type.tensor_type.shape.dim, (shapes or {}).get(value.name, ()), strict=False
        ):
            dim.Clear()
            dim.dim_value = size
    return ort.InferenceSession(model.SerializeToString(), providers=[provider])


def device_arch() -> str:
    from compiler_core.runtime.cuda import CudaBackend

    return CudaBackend().arch


def bench_model(name: str, shapes, arch: str, reference: str = "cuda") -> dict:
    path = MODELS_DIR / f"{model_file(name)}.onnx"
    archive = compiler_core.compile(str(path), target=f"cuda -arch={arch}", shapes=shapes)
    module = load(archive, device="cuda")
    session = _session(path, shapes, PROVIDERS[reference])
    feeds = random_feeds(module.inputs)
    ours = module.run(feeds)
    theirs = dict(
        zip([o.name for o in session.get_outputs()], session.run(None, feeds), strict=True)
    )
    worst = 0.0
    for key, value in ours.items():
        scale = float(np.max(np.abs(theirs[key]))) or 1.0
        worst = max(worst, float(np.max(np.abs(value - theirs[key]))) / scale)
    times = interleaved(lambda: module.run(feeds), lambda: session.run(None, feeds))
    a, b = stats(times["ours"]), stats(times["theirs"])
    return {
        "model": name,
        "arch": arch,
        "max_error_of_scale": worst,
        "matches": worst <= RTOL,
        "kiln": a,
        "reference": f"onnxruntime_{reference}",
        "onnxruntime": b,
        "ratio_median": a["median_ms"] / b["median_ms"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="*", default=list(MODEL_CASES))
    parser.add_argument("--arch", help="sm_80, sm_90 ... (default: the GPU's own)")
    parser.add_argument(
        "--reference", choices=sorted(PROVIDERS), default="cuda", help="ORT's provider to time"
    )
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    if PROVIDERS[args.reference] not in ort.get_available_providers():
        print("bench.gpu: ONNX Runtime has no CUDA provider here (install onnxruntime-gpu)")
        return 2
    try:
        arch = args.arch or device_arch()
    except NoCudaDeviceError as err:
        print(f"bench.gpu: {err}")
        return 2
    rows = [bench_model(name, MODEL_CASES[name], arch, args.reference) for name in args.models]
    theirs = f"ORT-{args.reference.upper()} ms"
    print(f"{'model':14s} {'kiln ms':>9s} {theirs:>12s} {'ratio':>7s} {'max err/scale':>14s}")
    for row in rows:
        print(
            f"{row['model']:14s} {row['kiln']['median_ms']:9.3f} "
            f"{row['onnxruntime']['median_ms']:12.3f} {row['ratio_median']:7.2f} "
            f"{row['max_error_of_scale']:14.2e}"
        )
    worst = max(rows, key=lambda r: r["ratio_median"])
    print(
        f"worst ratio: {worst['model']} {worst['ratio_median']:.2f} "
        f"(kiln/ORT-{args.reference.upper()}, medians)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(r["matches"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
