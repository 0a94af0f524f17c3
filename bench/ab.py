"""A/B of builds of one model: two or more builds (untuned, with a tuning log, or a compiled
archive) and optionally ONNX Runtime, timed in one process the way the acceptance checks time
them: blocks of runs after a settle pause, the first run of each block dropped, the order of
the engines reversed every other block. Reported per engine: the median of the kept runs, the
median of the per-block ratios to the first build (steadier than a ratio of medians on a noisy
host), the medians by position in the block (how far each run is from the pause) and a
back-to-back median. Every build's outputs are checked against the first's (and ORT's) before
anything is timed.

    python -m bench.ab ../shared/models/mlp.onnx --shape x=64,784 \\
        --build committed=bench/tuning/mlp.jsonl --build retuned=build/tuning/mlp.jsonl --ort
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

import compiler_core
from bench.engines import (
    _with_shapes,
    ort_runner,
    outputs_error,
    random_feeds,
    timed_by_position,
)
from compiler_core.cli import UsageError, parse_shapes
from compiler_core.errors import UserError
from compiler_core.runtime import load

UNTUNED = "untuned"
# Outputs further apart than this (of the first build's output scale) are different answers,
# not two speeds of one.
TOLERANCE = 1e-3


def parse_build(text: str) -> tuple[str, str]:
    """`NAME=SPEC` (or a bare SPEC, named after itself) -> (name, spec)."""
    name, sep, spec = text.partition("=")
    if not sep:
        name, spec = Path(text).stem, text
    if not name or not spec:
        raise UsageError(f"--build {text!r}: expected NAME=SPEC (untuned, a .jsonl log, a .kiln)")
    if spec != UNTUNED and not Path(spec).is_file():
        raise UsageError(f"--build {text!r}: no file {spec!r} (or say {UNTUNED!r})")
    return name, spec


def build(model: str, spec: str, shapes: dict[str, list[int]], threads: int):
    """The module of one build: an archive as it is, else `model` compiled (with `spec`'s
    tuning log unless untuned)."""
    if spec.endswith(".kiln"):
        return load(spec, num_threads=threads)
    tuning = None if spec == UNTUNED else spec
    return load(
        compiler_core.compile(model, shapes=shapes or None, tuning=tuning), num_threads=threads
    )


def check_agreement(runners: dict, feeds: dict) -> dict[str, float]:
    """Each runner's largest output difference from the first's, as a fraction of its scale;
    a UsageError names a build that computes another answer."""
    first_name, *_ = runners
    expected = runners[first_name](feeds)
    errors = {}
    for name, run in runners.items():
        got = run(feeds)
        errors[name] = outputs_error(got, expected)
        if not errors[name] <= TOLERANCE:
            raise UsageError(
                f"{name!r} differs from {first_name!r}: max error {errors[name]:.2e} of the "
                "output's scale (not two speeds of one model)"
            )
    return errors


def summarize(times: dict[str, np.ndarray], back_to_back: dict[str, np.ndarray]) -> dict:
    """The report of `timed_by_position`'s times (the first run of each block dropped)."""
    first, *_ = times
    kept = {name: t[:, 1:] for name, t in times.items()}
    report = {}
    for name, t in kept.items():
        report[name] = {
            "median_ms": float(np.median(t) * 1e3),
            "ratio_to_first": float(np.median(t) / np.median(kept[first])),
            "median_block_ratio": float(np.median(np.median(t, 1) / np.median(kept[first], 1))),
            "by_position_ms": [float(v) for v in np.median(times[name], 0) * 1e3],
            "back_to_back_ms": float(np.median(back_to_back[name]) * 1e3),
        }
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="an ONNX model")
    parser.add_argument("--build", action="append", required=True, help="NAME=SPEC, repeatable")
    parser.add_argument("--shape", action="append", help="bind an input shape: NAME=D0,D1,...")
    parser.add_argument("--ort", action="store_true", help="time ONNX Runtime beside them")
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--block", type=int, default=11, help="runs a block, the first dropped")
    parser.add_argument("--pause", type=float, default=0.3, help="seconds before each block")
    parser.add_argument("--back-to-back", type=int, default=200, help="runs of the last block")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    try:
        if args.block < 2 or args.blocks < 1:
            raise UsageError("--block takes at least 2 runs (the first is dropped), --blocks 1")
        shapes = parse_shapes(args.shape)
        specs = dict(parse_build(text) for text in args.build)
        modules = {
            name: build(args.model, spec, shapes, args.threads) for name, spec in specs.items()
        }
        feeds = random_feeds(next(iter(modules.values())).inputs)
        runners = {name: module.run for name, module in modules.items()}
        if args.ort:
            runners["onnxruntime"] = ort_runner(_with_shapes(args.model, shapes), args.threads)
        errors = check_agreement(runners, feeds)
    except (UserError, OSError) as err:
        print(f"bench.ab: {err}", file=sys.stderr)
        return 2
    calls = {name: (lambda run=run: run(feeds)) for name, run in runners.items()}
    times = timed_by_position(calls, args.blocks, args.block, args.pause)
    back_to_back = timed_by_position(calls, 1, args.back_to_back, args.pause)
    report = summarize(times, {name: t[0, 1:] for name, t in back_to_back.items()})
    for name, row in report.items():
        positions = " ".join(f"{v:.3f}" for v in row["by_position_ms"])
        print(
            f"{name:>14s}: {row['median_ms']:.3f} ms  x{row['ratio_to_first']:.3f} "
            f"(blocks x{row['median_block_ratio']:.3f})  back to back {row['back_to_back_ms']:.3f}"
            f"  max error {errors[name]:.1e}\n{'':>16s}by position: {positions}"
        )
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "builds": specs, **report}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
