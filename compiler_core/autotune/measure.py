"""Build candidates and time them in an isolated process.

Candidates are built here (loop IR -> LLVM -> one shared library each); a long-lived runner
subprocess (`python -m compiler_core.autotune.measure`) loads each library, runs it on seeded
random inputs, checks its outputs against the task's reference (the default schedule's), and
times it. A candidate that crashes the runner, hangs past the timeout or computes a wrong
answer becomes a record with its error code; the runner is restarted and tuning goes on.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from compiler_core.autotune.tasks import Task
from compiler_core.codegen.native import compile_kernels, link_shared
from compiler_core.schedule.primitives import apply
from compiler_core.target import Target

CHECK_RTOL = 1e-3  # schedules reorder float sums: compare at a float32-scale tolerance


@dataclasses.dataclass(frozen=True)
class Result:
    costs: tuple[float, ...] = ()
    error: str = "ok"
    detail: str = ""


@dataclasses.dataclass
class MeasureOptions:
    repeats: int = 5
    min_repeat_seconds: float = 0.02
    timeout: float = 20.0  # per candidate, in the runner
    threads: int | None = None


class Measurer:
    """Measures candidates of one target; keep one per tuning session (the runner stays up)."""

    def __init__(self, target: Target, options: MeasureOptions | None = None):
        self.target = target
        self.options = options or MeasureOptions()
        self._dir = tempfile.TemporaryDirectory(prefix="kiln-measure-")
        self._runner: subprocess.Popen | None = None
        self._references: dict[str, Path] = {}

    # --- building -----------------------------------------------------------------------

    def build(self, task: Task, configs: Sequence[dict]) -> list[Path | Result]:
        """A shared library per config, or the Result that says why there is none."""
        funcs, slots = [], []
        outcomes: list[Path | Result] = []
        for config in configs:
            try:
                funcs.append(apply(task.lowered.func, task.records(config)))
                slots.append(len(outcomes))
                outcomes.append(Result(error="build_error"))
            except Exception as err:  # noqa: BLE001 - a config the schedule refuses
                outcomes.append(Result(error="invalid_config", detail=_first_line(err)))
        try:
            objects = compile_kernels(funcs, self.target)
        except Exception:  # noqa: BLE001 - LLVM refused the batch: build one by one
            objects = [None] * len(funcs)
        for slot, func, obj in zip(slots, funcs, objects, strict=True):
            try:
                obj = obj if obj is not None else compile_kernels([func], self.target)[0]
                path = Path(self._dir.name) / f"c{time.monotonic_ns()}_{slot}.so"
                outcomes[slot] = link_shared([obj], path)
            except Exception as err:  # noqa: BLE001 - recorded as a build error
                outcomes[slot] = Result(error="build_error", detail=_first_line(err))
        return outcomes

    # --- running ------------------------------------------------------------------------

    def measure(self, task: Task, configs: Sequence[dict]) -> list[Result]:
        reference = self._reference(task)
        results = []
        for built in self.build(task, configs):
            if isinstance(built, Result):
                results.append(built)
                continue
            results.append(self._run(task, built, reference=reference))
            built.unlink(missing_ok=True)
        return results

    def _reference(self, task: Task) -> Path | None:
        """The default schedule's outputs on the runner's inputs: what every candidate of the
        task must reproduce."""
        if task.key in self._references:
            return self._references[task.key]
        (built,) = self.build(task, [task.tunable.default_config()])
        path = Path(self._dir.name) / f"ref_{task.key[:16]}.npz"
        if isinstance(built, Result):
            return None
        result = self._run(task, built, save_output=path)
        self._references[task.key] = path if result.error == "ok" else None
        return self._references[task.key]

    def _run(self, task: Task, library: Path, reference=None, save_output=None) -> Result:
        func = task.lowered.func
        request = {
            "library": str(library),
            "symbol": func.name,
            "params": [[list(b.shape), b.dtype] for b in func.params],
            "outputs": len(task.lowered.outputs),
            "reference": str(reference) if reference else None,
            "save_output": str(save_output) if save_output else None,
            "repeats": self.options.repeats,
            "min_repeat_seconds": self.options.min_repeat_seconds,
            "rtol": CHECK_RTOL,
        }
        runner = self._ensure_runner()
        runner.stdin.write(json.dumps(request) + "\n")
        runner.stdin.flush()
        ready, _, _ = select.select([runner.stdout], [], [], self.options.timeout)
        if not ready:
            self._kill_runner()
            return Result(error="timeout", detail=f"no answer in {self.options.timeout} s")
        line = runner.stdout.readline()
        if not line:
            code = runner.wait()
            self._runner = None
            return Result(error="run_error", detail=f"the runner died (exit status {code})")
        answer = json.loads(line)
        return Result(tuple(answer.get("costs", ())), answer["error"], answer.get("detail", ""))

    def _ensure_runner(self) -> subprocess.Popen:
        if self._runner is None or self._runner.poll() is not None:
            env = dict(os.environ)
            if self.options.threads:
                env["OMP_NUM_THREADS"] = str(self.options.threads)
            self._runner = subprocess.Popen(
                [sys.executable, "-m", "compiler_core.autotune.measure"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                env=env,
            )
        return self._runner

    def _kill_runner(self) -> None:
        if self._runner is not None:
            self._runner.kill()
            self._runner.wait()
            self._runner = None

    def close(self) -> None:
        if self._runner is not None and self._runner.poll() is None:
            self._runner.stdin.close()
            try:
                self._runner.wait(5)
            except subprocess.TimeoutExpired:
                self._kill_runner()
        self._runner = None
        self._dir.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


# --- the runner (its own process) --------------------------------------------------------------


def _inputs(params, outputs: int):
    import numpy as np

    rng = np.random.default_rng(0)
    arrays = []
    for k, (shape, dtype) in enumerate(params):
        if k >= len(params) - outputs:
            arrays.append(np.zeros(shape, dtype))
        elif np.dtype(dtype).kind == "f":
            arrays.append(rng.standard_normal(shape).astype(dtype))
        else:
            arrays.append(rng.integers(0, 4, shape).astype(dtype))
    return arrays


def _check(outputs, reference: str, rtol: float) -> str | None:
    import numpy as np

    expected = np.load(reference)
    for k, actual in enumerate(outputs):
        want = expected[f"out{k}"]
        scale = float(np.abs(want).max(initial=0.0)) or 1.0
        if not np.allclose(actual, want, rtol=rtol, atol=rtol * scale, equal_nan=True):
            worst = float(np.abs(actual.astype(np.float64) - want).max())
            return f"output {k} differs from the reference by up to {worst:.3g}"
    return None


def run_request(request: dict) -> dict:
    import numpy as np

    from compiler_core.runtime.library import KernelLibrary

    library = KernelLibrary(request["library"])
    arrays = _inputs(request["params"], request["outputs"])
    outputs = arrays[len(arrays) - request["outputs"] :]
    library.call(request["symbol"], arrays)
    if request["save_output"]:
        np.savez(request["save_output"], **{f"out{k}": o for k, o in enumerate(outputs)})
    if request["reference"]:
        problem = _check(outputs, request["reference"], request["rtol"])
        if problem:
            return {"error": "wrong_answer", "detail": problem}
    function = library.function(request["symbol"])
    pointers = [ctypes.c_void_p(a.ctypes.data) for a in arrays]
    number, costs = 1, []
    while True:  # calls per repeat: enough for the repeat to last min_repeat_seconds
        started = time.perf_counter()
        for _ in range(number):
            function(*pointers)
        elapsed = time.perf_counter() - started
        if elapsed >= request["min_repeat_seconds"] or number >= 1 << 20:
            break
        number *= 2
    costs.append(elapsed / number)
    for _ in range(request["repeats"] - 1):
        started = time.perf_counter()
        for _ in range(number):
            function(*pointers)
        costs.append((time.perf_counter() - started) / number)
    return {"error": "ok", "costs": costs}


def runner_main() -> None:
    for line in sys.stdin:
        try:
            answer = run_request(json.loads(line))
        except Exception as err:  # noqa: BLE001 - reported, the runner lives on
            answer = {"error": "run_error", "detail": _first_line(err)}
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    runner_main()
