"""The `kiln` command line.

kiln inspect model.onnx [--shape x=1,784] [--after PASS] [--constants]
    the graph before and after the pass pipeline, and the fused groups
kiln verify model.onnx [--shape x=1,784] [--seed N]
    the optimized graph against the imported one (numpy reference executor) and against
    ONNX Runtime where it is installed, on random inputs
kiln compile model.onnx [--target llvm] [--shape x=1,784] -o model.kiln
    native code for the whole model, in one module archive
kiln run model.kiln [--input name=file.npy ...] [--repeat N]
    load the archive and run it (random inputs where none are given): outputs and latency
kiln tune model.onnx [--shape x=1,784] [--trials N | --time-budget 20m] --log tuning.jsonl
    search the schedules of the model's heavy operators, measuring candidates; then
    `kiln compile model.onnx --tuning tuning.jsonl` builds with the best ones

The services (each a process of its own; see the README):
kiln serve [--api-port 8000] [--runtime-port 8001] [--data-dir DIR]
    api + one worker + runtime server on loopback, in the foreground
kiln worker [-Q QUEUES] [--concurrency N]     a Celery worker for this machine's CPU queues
kiln api [--host H] [--port P]                the HTTP api
kiln runtime [--host H] [--port P]            the inference server (Open Inference Protocol)
kiln gc [--grace SECONDS] [--dry-run]         delete store blobs no manifest references
kiln submit model.onnx --server URL [--tune 10m] [--deploy NAME]   compile (and deploy) on a server
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Sequence

import numpy as np

from compiler_core.errors import UserError
from compiler_core.frontend.onnx import import_model
from compiler_core.graph.ir import Graph
from compiler_core.graph.printer import format_graph, format_groups
from compiler_core.passes.pipeline import PASS_NAMES, optimize
from compiler_core.runtime.module import random_inputs

RTOL, ATOL = 1e-4, 1e-5


class UsageError(UserError):
    pass


BATCH_PLACEHOLDER = "N"


def parse_shapes(items: Sequence[str] | None, batched: bool = False) -> dict[str, list[int]]:
    """`name=1,3,224,224` entries -> {name: [1, 3, 224, 224]}. With `batched` (batch buckets),
    axis 0 may be the placeholder N (`x=N,3,224,224`); the buckets decide it."""
    shapes = {}
    for item in items or ():
        name, sep, dims = item.partition("=")
        words = [d.strip() for d in dims.split(",") if d.strip()]
        if batched and words and words[0] == BATCH_PLACEHOLDER:
            words[0] = "0"
        elif words and words[0] == BATCH_PLACEHOLDER:
            raise UsageError(f"--shape {item!r}: the batch N takes --batch-buckets (e.g. 1,2,4,8)")
        try:
            if not sep or not name:
                raise ValueError
            shapes[name] = [int(d) for d in words]
        except ValueError:
            raise UsageError(f"--shape {item!r}: expected NAME=D0,D1,... (e.g. x=1,784)") from None
    return shapes


def parse_buckets(text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        return [int(word) for word in text.split(",") if word.strip()]
    except ValueError:
        raise UsageError(f"--batch-buckets {text!r}: expected sizes such as 1,2,4,8,16") from None


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
    feeds = random_inputs(graph.input_signature(), args.seed)
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


def cmd_compile(args) -> int:
    from compiler_core.compiler import compile as compile_model

    started = time.perf_counter()
    buckets = parse_buckets(args.batch_buckets)
    archive = compile_model(
        args.model,
        target=args.target,
        shapes=parse_shapes(args.shape, batched=buckets is not None),
        tuning=args.tuning,
        batch_buckets=buckets,
    )
    path = archive.save(args.output)
    manifest = archive.manifest
    memory, check = manifest["memory"], manifest["verification"]
    print(
        f"compiled {args.model} for {manifest['target']} in "
        f"{time.perf_counter() - started:.1f}s -> {path}"
    )
    reuse = f" (without reuse {memory['naive_bytes']})" if "naive_bytes" in memory else ""
    print(
        f"  kernels: {len(manifest['kernels'])} ({manifest['distinct_kernels']} distinct); "
        f"workspace {memory['workspace_bytes']} bytes{reuse}"
    )
    if memory.get("kernel_scratch_bytes"):
        print(
            f"  kernel scratch: up to {memory['kernel_scratch_bytes']} bytes in one call "
            f"({memory['kernel_scratch_kernel']}), beside the workspace"
        )
    if buckets:
        print(f"  batch buckets: {manifest['batch_buckets']} (any batch up to the largest)")
    for name, shape in manifest.get("defaulted_shapes", {}).items():
        print(f"  input {name!r}: symbolic batch compiled as {shape} (bind it with --shape)")
    tuned = sum(1 for k in manifest["kernels"].values() if isinstance(k, dict))
    if args.tuning:
        print(f"  tuned kernels: {tuned} of {len(manifest['kernels'])} (log {args.tuning})")
    if "skipped" in check:  # a GPU archive where no OpenCL device can run its twin
        print(f"  verification skipped: {check['skipped']}")
        return 0
    twin = f" ({check['device']})" if "device" in check else ""
    print(
        f"  verification vs {check['oracle']}{twin}: max abs error {check['max_abs_error']:.3g} "
        f"-> {'ok' if check['passed'] else 'MISMATCH'}"
    )
    return 0 if check["passed"] else 1


def _load_inputs(module, items: Sequence[str] | None, seed: int) -> dict[str, np.ndarray]:
    given = {}
    for item in items or ():
        name, sep, path = item.partition("=")
        if not sep:
            raise UsageError(f"--input {item!r}: expected NAME=FILE.npy")
        try:
            given[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as err:
            raise UsageError(f"--input {item!r}: cannot read {path!r}: {err}") from None
    return {**random_inputs(module.inputs, seed), **given}


def cmd_run(args) -> int:
    from compiler_core.runtime import load
    from compiler_core.runtime.module import Module

    module = load(args.module, num_threads=args.threads, device=args.device)
    inputs = _load_inputs(module, args.input, args.seed)
    outputs = module.run(inputs)
    timings = []
    for _ in range(args.repeat):
        started = time.perf_counter()
        module.run(inputs)
        timings.append(time.perf_counter() - started)
    for name, value in outputs.items():
        preview = np.array2string(value.reshape(-1)[:8], precision=5, separator=", ")
        print(f"{name}: {value.dtype}{list(value.shape)} {preview}")
    if timings:
        ms = np.array(timings) * 1000
        print(
            f"latency over {len(ms)} runs: median {np.median(ms):.3f} ms, "
            f"p90 {np.percentile(ms, 90):.3f} ms"
        )
    if isinstance(module, Module):
        _print_memory(module.manifest.get("memory") or {})
    if args.profile:
        repeats = max(args.repeat, 1)
        in_model = module.profile(inputs, repeats)
        # A CPU module also times each kernel alone (a GPU plan's launches only in order).
        alone = module.profile(inputs, repeats, alone=True) if isinstance(module, Module) else None
        _print_profile(in_model, alone, args.profile)
    return 0


def _print_memory(memory: dict) -> None:
    """A CPU module's memory beside its weights: the planned workspace, the most one kernel
    call takes beside it, and what the process's block cache keeps after the runs."""
    from compiler_core.runtime.library import workspace_cached_bytes

    scratch, kept = memory.get("kernel_scratch_bytes"), workspace_cached_bytes()
    call = f", kernel scratch up to {scratch} bytes a call" if scratch else ""
    print(f"memory: workspace {memory.get('workspace_bytes', 0)} bytes{call}")
    if kept is not None:  # None: an archive built before the cache counted its blocks
        print(f"  kept by the process's block cache after the runs: {kept} bytes")


def _print_profile(
    rows: list[tuple[str, float]], alone: list[tuple[str, float]] | None, top: int
) -> None:
    """The TOP slowest kernels inside the model, with (CPU) each one's time alone, repeated
    with its data in cache: where they differ, the kernel waits on memory inside a run."""
    total = sum(seconds for _, seconds in rows) or 1.0
    hot = dict(alone or ())
    note = f", {sum(hot.values()) * 1000:.3f} ms alone" if hot else ""
    print(f"per-kernel medians (sum {total * 1000:.3f} ms in the model{note}), the {top} slowest:")
    for name, seconds in sorted(rows, key=lambda row: -row[1])[:top]:
        repeated = f"  alone {hot[name] * 1000:8.3f} ms" if name in hot else ""
        print(f"  {seconds * 1000:8.3f} ms {100 * seconds / total:5.1f}%{repeated}  {name}")


def parse_duration(text: str) -> float:
    """`90s`, `20m`, `1.5h` or plain seconds -> seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    try:
        if text and text[-1] in units:
            return float(text[:-1]) * units[text[-1]]
        return float(text)
    except ValueError:
        raise UsageError(f"--time-budget {text!r}: expected e.g. 90s, 20m or 1h") from None


def parse_size(text: str) -> int:
    """`2M`, `512K` or plain bytes -> bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        if text and text[-1].upper() in units:
            return int(float(text[:-1]) * units[text[-1].upper()])
        return int(text)
    except ValueError:
        raise UsageError(f"--cache-flush {text!r}: expected e.g. 2M or 512K") from None


def _ms(seconds: float | None) -> str:
    return "(after every task's first batch)" if seconds is None else f"{seconds * 1000:.3f} ms"


def cmd_tune(args) -> int:
    from compiler_core.autotune.measure import MeasureOptions, Measurer
    from compiler_core.autotune.records import open_log
    from compiler_core.autotune.search import Tuner
    from compiler_core.autotune.tasks import extract_tasks
    from compiler_core.compiler import COMPILER_VERSION
    from compiler_core.target import parse_target

    if args.trials is None and args.time_budget is None:
        raise UsageError("give a budget: --trials N or --time-budget 20m")
    budget = parse_duration(args.time_budget) if args.time_budget else None
    for path in args.transfer_from:
        if not path.startswith("redis://") and not os.path.isfile(path):
            raise UsageError(f"--transfer-from {path}: no such tuning log")
    target = parse_target(args.target)
    graph = optimize(import_model(args.model, shapes=parse_shapes(args.shape)), target=target)
    tasks = extract_tasks(graph, target)
    print(f"{args.model}: {len(tasks)} tuning tasks for {target} (log {args.log})")
    for k, task in enumerate(tasks):
        print(f"  task {k}: {task.workload} x{task.weight}, {len(task.space())} configs")
    started = time.perf_counter()

    def progress(tuner, state) -> None:
        k = tuner.states.index(state)
        print(
            f"[{time.perf_counter() - started:6.0f}s] {tuner.trials:5d} trials | task {k}: "
            f"{state.trials} trials, best {state.best_gflops:.1f} GFLOP/s | tuned kernels' "
            f"estimated time {_ms(tuner.estimated_latency())}",
            flush=True,
        )

    flush = parse_size(args.cache_flush) if args.cache_flush else 0
    options = MeasureOptions(threads=args.threads, device=args.device, flush_bytes=flush)
    with contextlib.ExitStack() as stack:
        measurer = stack.enter_context(Measurer(target, options))
        log = stack.enter_context(open_log(args.log))
        sources = [stack.enter_context(open_log(path)) for path in args.transfer_from]
        if measurer.device:
            print(f"measuring on {measurer.device} ({measurer.target_label})")
        tuner = Tuner(
            tasks, target, log, measurer, batch=args.batch, seed=args.seed,
            compiler_version=COMPILER_VERSION, transfer_from=sources,
        )  # fmt: skip
        resumed = sum(len(s.visited) for s in tuner.states)
        if resumed:
            print(f"resuming: {resumed} configs already in the log are not measured again")
        records, workloads = tuner.transfer
        if records:
            where = "the logs" if sources else "the log"
            print(f"warm start: the cost model learns from {records} records of {workloads} "
                  f"other workloads in {where}")  # fmt: skip
        elif sources:
            print("warm start: none: --transfer-from holds no records of this machine with "
                  "features, of workloads whose default config was measured (a log written "
                  "by kiln tune before records flagged their default has none)")  # fmt: skip
        tuner.run(trials=args.trials, time_budget=budget, progress=progress, retime=True)
        if tuner.retimings:
            print(f"re-timed each task's best configs and default: {tuner.retimings} runs")
        if tuner.model.trained:
            print(f"cost model: {_model_summary(tuner.model)}")
        if not target.is_gpu:
            _check_in_model(graph, target, tasks, log, measurer, args.threads)
        if args.export_best:
            total = len(log.records())
            kept = log.export_jsonl(args.export_best, best_only=True)
            print(f"best records: {kept} of {total} written to {args.export_best}")
        if args.plot:
            from compiler_core.autotune.plot import plot_curves

            title = os.path.basename(args.model)
            print(f"curves: {plot_curves(tuner.states, args.plot, title)}")
        for k, state in enumerate(tuner.states):
            default = state.task.flops / state.default_cost / 1e9 if state.default_cost else 0
            print(
                f"  task {k}: {state.trials} trials, best {state.best_gflops:.1f} GFLOP/s "
                f"(default {default:.1f}) {state.best_config}{_applied(log, state, measurer)}"
            )
    print(f"tuned in {time.perf_counter() - started:.0f}s", end="; ")
    if args.device == "opencl":
        print("the OpenCL twin's records check the schedules; they are not applied to a GPU build")
    else:
        print(f"build with: kiln compile {args.model} --target '{target}' --tuning {args.log} "
              "-o model.kiln")  # fmt: skip
    return 0


def _model_summary(model) -> str:
    """The objective the cost model kept, its rounds, and how each objective's top picks ran
    on held-out records at the last fit."""
    held_out = ", ".join(f"{o} {q:.2f}" for o, q in model.held_out_quality.items())
    compared = f"; held-out top picks at {held_out} of the best" if held_out else ""
    prior = len(model.prior_groups)
    over = f" over a prior fit on {prior} other workloads" if prior else ""
    return f"{model.chosen}, {model.rounds} boosting rounds{over}{compared}"


def _applied(log, state, measurer) -> str:
    """What a build applies for a task, when the in-model check chose other than the search's
    fastest config alone (its default, or its algorithm at its default knobs)."""
    from compiler_core.autotune.tasks import config_key

    best = log.best(state.task.key, measurer.fingerprint, template=state.task.template)
    if best is None or not best.in_model or state.best_config is None:
        return ""
    if config_key(best.config) == config_key(state.best_config):
        return ""
    return f"; in the model {best.config} ran faster: builds apply it"


def _alternative_label(timing, config: dict) -> str:
    """An in-model alternative as `kiln tune` names it: what builds applied before this
    search, or its algorithm, at its template's default knobs or at the knobs that differ
    from them."""
    if config == timing.previous:
        return "before this search"
    variant, knobs = timing.task.variant(config)
    changed = {k: v for k, v in knobs.items() if variant.tunable.default_config().get(k) != v}
    where = " ".join(f"{k}={v}" for k, v in changed.items()) or "at its default knobs"
    return f"{config.get('algorithm') or 'direct'} {where}"


def _check_in_model(graph, target, tasks, log, measurer, threads) -> None:
    """Time the tuned tasks inside the model, tuned and untuned (`check_in_model`); say
    which keep their default."""
    from compiler_core.autotune.in_model import check_in_model
    from compiler_core.compiler import COMPILER_VERSION

    timings = check_in_model(graph, target, tasks, log, measurer, COMPILER_VERSION, threads)
    if not timings:
        return
    kept = sum(t.kept_default for t in timings)
    previous = sum(t.kept_previous for t in timings)
    earlier = f", {previous} keep what builds applied before this search" if previous else ""
    print(f"checked in the model: {len(timings)} tuned tasks, {kept} keep their default{earlier}")
    for timing in timings:
        if not timing.kept_default and not timing.alternatives:
            continue
        others = "".join(
            f", {_alternative_label(timing, config)} {statistics.median(times) * 1e3:.3f} ms"
            for config, times in timing.alternatives
        )
        print(
            f"  task {tasks.index(timing.task)}: tuned {timing.tuned_ms:.3f} ms, default "
            f"{timing.default_ms:.3f} ms{others} in the model"
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kiln",
        description="Kiln inference compiler",
        epilog="services: kiln serve | worker | api | runtime | gc (each with --help)",
    )
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

    compile_ = sub.add_parser("compile", help="compile a model to a native module archive")
    compile_.add_argument("model")
    compile_.add_argument(
        "--target", default="llvm", help="e.g. 'llvm', 'llvm -mcpu=znver4' or 'cuda -arch=sm_90'"
    )
    compile_.add_argument("--shape", action="append", help="bind an input shape: NAME=D0,D1,...")
    compile_.add_argument("-o", "--output", required=True, help="archive path (.kiln)")
    compile_.add_argument("--tuning", help="a tuning log (JSONL path or redis:// URL)")
    compile_.add_argument(
        "--batch-buckets",
        help="one plan per batch size, e.g. 1,2,4,8,16: the archive runs any batch up to the "
        "largest (with --shape x=N,3,224,224)",
    )
    compile_.set_defaults(run=cmd_compile)

    tune = sub.add_parser("tune", help="tune the schedules of a model's heavy operators")
    tune.add_argument("model")
    tune.add_argument("--target", default="llvm")
    tune.add_argument("--shape", action="append", help="bind an input shape: NAME=D0,D1,...")
    tune.add_argument("--trials", type=int, help="candidates to measure in all")
    tune.add_argument("--time-budget", help="wall clock, e.g. 90s, 20m, 1h")
    tune.add_argument("--log", required=True, help="tuning log: JSONL path or redis:// URL")
    tune.add_argument(
        "--transfer-from",
        action="append",
        default=[],
        metavar="LOG",
        help="another tuning log to learn from before measuring (read only; repeatable): its "
        "records of this target warm-start the cost model",
    )
    tune.add_argument(
        "--export-best",
        metavar="PATH",
        help="afterwards, write the log's best record of each workload and machine to PATH "
        "(all a build applies; PATH may be the log itself, to compact it)",
    )
    tune.add_argument("--batch", type=int, default=8, help="candidates per round")
    tune.add_argument("--threads", type=int, default=None, help="threads while measuring")
    tune.add_argument(
        "--device",
        choices=("cuda", "opencl"),
        help="where a GPU target's candidates run: cuda (default) or the OpenCL twin, whose "
        "records are kept apart and never applied to a GPU build",
    )
    tune.add_argument("--seed", type=int, default=0)
    tune.add_argument(
        "--cache-flush",
        metavar="SIZE",
        help="write SIZE bytes (e.g. 2M) before every timed pass, so candidates are timed "
        "with their data out of cache as inside a model; give it a log of its own (its "
        "costs do not compare with unflushed ones)",
    )
    tune.add_argument(
        "--plot",
        metavar="PNG",
        help="draw each task's best GFLOP/s against its trials (with --trials 0: the log's)",
    )
    tune.set_defaults(run=cmd_tune)

    run = sub.add_parser("run", help="run a compiled module archive")
    run.add_argument("module")
    run.add_argument("--input", action="append", help="NAME=FILE.npy (random if omitted)")
    run.add_argument(
        "--device",
        choices=("cpu", "cuda", "opencl"),
        help="where a GPU archive runs: cuda (default) or its OpenCL twin",
    )
    run.add_argument("--repeat", type=int, default=20, help="timed runs after the first")
    run.add_argument("--threads", type=int, default=None)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument(
        "--profile",
        type=int,
        nargs="?",
        const=20,
        default=0,
        metavar="TOP",
        help="also time each kernel on its own and list the TOP slowest (default 20)",
    )
    run.set_defaults(run=cmd_run)
    return parser


# The services run as processes of their own, started by module name: the compiler never
# imports the service layer.
SERVICE_COMMANDS = {
    "serve": ["tuner_workers", "serve"],
    "worker": ["tuner_workers", "worker"],
    "gc": ["tuner_workers", "gc"],
    "api": ["api"],
    "runtime": ["runtime_server"],
    "submit": ["api.submit"],
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SERVICE_COMMANDS:
        command = [sys.executable, "-m", *SERVICE_COMMANDS[argv[0]], *argv[1:]]
        os.execv(sys.executable, command)
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    # Only the user's mistakes become a message; a compiler bug keeps its traceback.
    except (UserError, FileNotFoundError) as err:
        print(f"kiln {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
