"""Build candidates and time them in an isolated process.

Candidates are built here (loop IR -> LLVM -> one shared library each); a long-lived runner
subprocess (`python -m compiler_core.autotune.measure`) loads each library, runs it on seeded
random inputs, checks its outputs against the task's reference (the default schedule's), and
times it. A candidate that crashes the runner, hangs past the timeout or computes a wrong
answer becomes a record with its error code; the runner is restarted and tuning goes on.

A GPU target's candidate is its group split into device kernels, checked against the
target's limits (a config over them is `invalid_config`, never run) and written as a bundle:
the kernels' source (PTX for a CUDA device, the OpenCL twin for an OpenCL one) and their
launches. The runner runs the launches in order over device buffers and times whole passes
(CUDA events on a GPU). Measurements of the OpenCL twin carry their own fingerprint: PoCL's
timings say nothing about a GPU's, so they are never applied to a GPU build.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import os
import select
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Sequence
from pathlib import Path

from compiler_core.autotune.tasks import Task
from compiler_core.build import LoweredGroup
from compiler_core.codegen.native import compile_kernels, link_shared
from compiler_core.errors import UserError
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
    device: str | None = None  # GPU targets: "cuda" or "opencl" (the twin); None: cuda
    # Bytes written to a scratch buffer before every timed pass (0: none): a kernel then
    # finds its weights and inputs out of L2, as it does inside a whole model, instead of
    # hot from the previous pass.
    flush_bytes: int = 0


DEVICES = ("cuda", "opencl")


class MeasureDeviceError(UserError):
    """No device to measure a target's candidates on."""


def measure_device(target: Target, requested: str | None) -> str | None:
    """The device a target's candidates run on: None for a CPU target (the host), "cuda" or
    "opencl" for a GPU target, or MeasureDeviceError saying why there is none."""
    if not target.is_gpu:
        if requested not in (None, "cpu"):
            raise MeasureDeviceError(f"device {requested!r}: {target} is measured on the host CPU")
        return None
    if requested not in (None, *DEVICES):
        raise MeasureDeviceError(f"device {requested!r}: expected one of {list(DEVICES)}")
    if requested == "opencl":
        from compiler_core.runtime.opencl import opencl_available

        available, why = opencl_available()
        if not available:
            raise MeasureDeviceError(f"no OpenCL device to measure the twin on: {why}")
        return "opencl"
    from compiler_core.runtime.cuda import cuda_available

    available, why = cuda_available()
    if not available:
        raise MeasureDeviceError(
            f"tuning {target} measures candidates on a CUDA device: {why}. Tune on a machine "
            "with the GPU (a worker on the cuda queue), or measure the OpenCL twin with device "
            "'opencl' (its records are kept apart from the GPU's)"
        )
    return "cuda"


class Measurer:
    """Measures candidates of one target; keep one per tuning session (the runner stays up)."""

    def __init__(self, target: Target, options: MeasureOptions | None = None):
        self.target = target
        self.options = options or MeasureOptions()
        self.device = measure_device(target, self.options.device)
        self._dir = tempfile.TemporaryDirectory(prefix="kiln-measure-")
        self._runner: subprocess.Popen | None = None
        self._references: dict[tuple[str, Path | None], Path | None] = {}
        self._input_files: dict[int, tuple[LoweredGroup, Path]] = {}

    @property
    def fingerprint(self) -> str:
        """What this session's records are keyed by: the target's fingerprint, or for the
        OpenCL twin of a GPU target one of its own."""
        if self.device != "opencl":
            return self.target.fingerprint
        text = f"{self.target.fingerprint}|opencl-twin"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def target_label(self) -> str:
        """The target as the records name it (the twin says so)."""
        return f"{self.target} -device=opencl" if self.device == "opencl" else str(self.target)

    # --- building -----------------------------------------------------------------------

    def build(self, task: Task, configs: Sequence[dict]) -> list[Path | Result]:
        """A shared library (a device bundle for a GPU target) per config, or the Result that
        says why there is none."""
        if self.device is not None:
            return [self._device_bundle(task, config, slot) for slot, config in enumerate(configs)]
        funcs, slots = [], []
        outcomes: list[Path | Result] = []
        for config in configs:
            try:
                funcs.append(apply(task.lowered_for(config).func, task.records(config)))
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

    def _device_bundle(self, task: Task, config: dict, slot: int) -> Path | Result:
        from compiler_core.gpu.kernels import device_kernels
        from compiler_core.gpu.verify import GpuScheduleError, verify_device

        try:
            func = apply(task.lowered_for(config).func, task.records(config))
            kernels, scratch = device_kernels(func)
            for kernel in kernels:
                verify_device(kernel.func, self.target)
        except GpuScheduleError as err:  # over a limit, or a race: the numbers, not the listing
            detail = f"GPU check {err.check!r}: {'; '.join(err.problems)}"
            return Result(error="invalid_config", detail=detail[:300])
        except Exception as err:  # noqa: BLE001 - a config the schedule refuses
            return Result(error="invalid_config", detail=_first_line(err))
        try:
            bundle = device_bundle(kernels, scratch, self.target, self.device)
        except Exception as err:  # noqa: BLE001 - recorded as a build error
            return Result(error="build_error", detail=_first_line(err))
        path = Path(self._dir.name) / f"c{time.monotonic_ns()}_{slot}.json"
        path.write_text(json.dumps(bundle))
        return path

    # --- running ------------------------------------------------------------------------

    def measure(self, task: Task, configs: Sequence[dict]) -> list[Result]:
        """Each config built and run once: its result (or why it has none)."""
        return [results for (results,) in self.measure_rounds(task, configs, 1)]

    def measure_rounds(
        self, task: Task, configs: Sequence[dict], rounds: int
    ) -> list[list[Result]]:
        """Each config built once and run `rounds` times, the configs taking turns (in
        reverse order every other round): a comparison of a few configs that a busy second
        cannot tilt. Per config, its results in the order they were taken."""
        reference = self._reference(task)
        built = self.build(task, configs)
        results: list[list[Result]] = [[] for _ in configs]
        try:
            for round_ in range(rounds):
                order = range(len(configs))
                for k in reversed(order) if round_ % 2 else order:
                    if isinstance(built[k], Result):
                        results[k].append(built[k])
                    else:
                        lowered = task.lowered_for(configs[k])
                        results[k].append(self._run(lowered, built[k], reference=reference))
        finally:
            for path in built:
                if not isinstance(path, Result):
                    path.unlink(missing_ok=True)
        return results

    def _reference(self, task: Task) -> Path | None:
        """The default schedule's outputs on the runner's inputs: what every candidate of the
        task must reproduce (of any algorithm: see `_input_file`). Kept per workload and
        set of inputs: two models that share a workload key run it on their own weights."""
        default = task.default_config()
        lowered = task.lowered_for(default)
        identity = (task.key, self._input_file(lowered))
        if identity in self._references:
            return self._references[identity]
        (built,) = self.build(task, [default])
        path = Path(self._dir.name) / f"ref_{len(self._references)}.npz"
        if isinstance(built, Result):
            return None
        result = self._run(lowered, built, save_output=path)
        self._references[identity] = path if result.error == "ok" else None
        return self._references[identity]

    def _input_file(self, lowered: LoweredGroup) -> Path | None:
        """The inputs a CPU candidate runs on: the group's real build-time packed weights,
        and random values seeded by each other input's name. Two algorithms of one group
        pack their weights differently but compute the same function of them, so their
        outputs on these inputs agree (up to rounding) and each is checked against the
        other's reference."""
        if self.device is not None:
            return None  # device runs draw their inputs in the runner
        import numpy as np

        if id(lowered) in self._input_files:
            return self._input_files[id(lowered)][1]
        params = lowered.func.params[: len(lowered.inputs)]
        arrays = {}
        for k, (name, buffer) in enumerate(zip(lowered.inputs, params, strict=True)):
            if name in lowered.packed:
                arrays[f"in{k}"] = np.asarray(lowered.packed[name], buffer.dtype)
            else:
                arrays[f"in{k}"] = _named_random(name, buffer.shape, buffer.dtype)
        path = Path(self._dir.name) / f"in_{len(self._input_files)}.npz"
        np.savez(path, **arrays)
        # Keyed by identity, kept alive with the file (a freed lowering's id may be reused).
        self._input_files[id(lowered)] = (lowered, path)
        return path

    def _run(self, lowered: LoweredGroup, library: Path, reference=None, save_output=None):
        func = lowered.func
        inputs = self._input_file(lowered)
        request = {
            "device": self.device,
            "library": str(library),
            "symbol": func.name,
            "params": [[list(b.shape), b.dtype] for b in func.params],
            "inputs": str(inputs) if inputs else None,
            "outputs": len(lowered.outputs),
            "reference": str(reference) if reference else None,
            "save_output": str(save_output) if save_output else None,
            "repeats": self.options.repeats,
            "min_repeat_seconds": self.options.min_repeat_seconds,
            "rtol": CHECK_RTOL,
            "flush_bytes": self.options.flush_bytes,
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
                env["KILN_NUM_THREADS"] = str(self.options.threads)
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


def device_bundle(kernels, scratch, target: Target, device: str) -> dict:
    """A GPU candidate as the runner takes it: the kernels' source for `device` and the
    launches in order, each argument a group parameter (by index) or a scratch buffer (by
    name, with its size)."""
    from compiler_core.codegen import nvptx, opencl
    from compiler_core.gpu.launch import launch_dims

    functions = [k.func for k in kernels]
    if device == "cuda":
        source = nvptx.emit_ptx(functions, target.arch)
    else:
        source = opencl.render_opencl(functions)
    sizes = {b.name: b.nbytes for b in scratch}
    launches = []
    for kernel in kernels:
        grid, block = launch_dims(kernel.func)
        args = [
            ["param", what] if kind == "param" else ["scratch", what, sizes[what]]
            for kind, what in kernel.args
        ]
        launches.append(
            {"kernel": kernel.func.name, "grid": list(grid), "block": list(block), "args": args}
        )
    return {"device": device, "source": source, "launches": launches}


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


# --- the runner (its own process) --------------------------------------------------------------


def _named_random(name: str, shape, dtype):
    """Random values for a kernel input, seeded by its name (the same in every variant)."""
    import numpy as np

    rng = np.random.default_rng(zlib.crc32(name.encode()))
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(0, 4, shape).astype(dtype)


# The runner's last input file and its arrays: consecutive candidates are mostly of one task
# (and algorithm), whose packed weights need not be read again for each one. Kernels never
# write their inputs, so the arrays are shared.
_LOADED_INPUTS: dict[str, list] = {}


def _library_inputs(request: dict):
    """The arrays a library candidate runs on: its request's input file and zeroed outputs,
    or (no file) seeded random inputs."""
    import numpy as np

    path = request.get("inputs")
    if not path:
        return _inputs(request["params"], request["outputs"])
    if path not in _LOADED_INPUTS:
        with np.load(path) as stored:
            arrays = [np.array(stored[f"in{k}"]) for k in range(len(stored.files))]
        _LOADED_INPUTS.clear()
        _LOADED_INPUTS[path] = arrays
    inputs = _LOADED_INPUTS[path]
    outputs = [np.zeros(shape, dtype) for shape, dtype in request["params"][len(inputs) :]]
    return [*inputs, *outputs]


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
    if request.get("device"):
        return run_device_request(request)
    return run_library_request(request)


def _finish_check(request: dict, outputs) -> dict | None:
    import numpy as np

    if request["save_output"]:
        np.savez(request["save_output"], **{f"out{k}": o for k, o in enumerate(outputs)})
    if request["reference"]:
        problem = _check(outputs, request["reference"], request["rtol"])
        if problem:
            return {"error": "wrong_answer", "detail": problem}
    return None


def _timed(run_passes, request: dict) -> dict:
    """Costs of `run_passes(number) -> seconds per pass`: the pass count doubled until a
    repeat lasts min_repeat_seconds, then `repeats` repeats."""
    number = 1
    while True:
        cost = run_passes(number)
        if cost * number >= request["min_repeat_seconds"] or number >= 1 << 20:
            break
        number *= 2
    costs = [cost] + [run_passes(number) for _ in range(request["repeats"] - 1)]
    return {"error": "ok", "costs": costs}


_DEVICE_BACKENDS: dict = {}  # one per runner process: CUDA's context is made once


def _device_backend(name: str):
    if name not in _DEVICE_BACKENDS:
        if name == "cuda":
            from compiler_core.runtime.cuda import CudaBackend

            _DEVICE_BACKENDS[name] = CudaBackend()
        else:
            from compiler_core.runtime.opencl import OpenCLBackend

            _DEVICE_BACKENDS[name] = OpenCLBackend()
    return _DEVICE_BACKENDS[name]


def run_device_request(request: dict) -> dict:
    """Run a device bundle's launches over device buffers holding the runner's inputs."""
    bundle = json.loads(Path(request["library"]).read_text())
    backend = _device_backend(request["device"])
    member = "model.ptx" if request["device"] == "cuda" else "kernels.cl"
    backend.load({member: bundle["source"].encode()})
    arrays = _inputs(request["params"], request["outputs"])
    buffers = []
    for array in arrays:
        buffer = backend.alloc(max(array.nbytes, 1))
        backend.upload(buffer, array)
        buffers.append(buffer)
    scratch: dict = {}
    launches = []
    for launch in bundle["launches"]:
        args = []
        for arg in launch["args"]:
            if arg[0] == "param":
                args.append(buffers[arg[1]])
            else:
                if arg[1] not in scratch:
                    scratch[arg[1]] = backend.alloc(max(arg[2], 1))
                args.append(scratch[arg[1]])
        launches.append((backend.function(launch["kernel"]), launch["grid"], launch["block"], args))
    try:
        for function, grid, block, args in launches:
            backend.launch(function, grid, block, args)
        backend.synchronize()
        outputs = arrays[len(arrays) - request["outputs"] :]
        for k, output in enumerate(outputs):
            backend.download(buffers[len(arrays) - request["outputs"] + k], output)
        failed = _finish_check(request, outputs)
        if failed:
            return failed
        return _timed(lambda number: backend.time_launches(launches, number), request)
    finally:
        backend.free_all()


def run_library_request(request: dict) -> dict:
    import numpy as np

    from compiler_core.runtime.library import KernelLibrary

    library = KernelLibrary(request["library"])
    arrays = _library_inputs(request)
    outputs = arrays[len(arrays) - request["outputs"] :]
    library.call(request["symbol"], arrays)
    failed = _finish_check(request, outputs)
    if failed:
        return failed
    function = library.function(request["symbol"])
    pointers = [ctypes.c_void_p(a.ctypes.data) for a in arrays]
    flush = request.get("flush_bytes", 0)
    scratch = np.empty(flush, np.uint8) if flush else None

    def passes(number: int) -> float:
        if scratch is None:
            started = time.perf_counter()
            for _ in range(number):
                function(*pointers)
            return (time.perf_counter() - started) / number
        spent = 0.0
        for k in range(number):
            scratch.fill(k & 0xFF)  # evicts the previous pass's data; not timed
            started = time.perf_counter()
            function(*pointers)
            spent += time.perf_counter() - started
        return spent / number

    return _timed(passes, request)


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
