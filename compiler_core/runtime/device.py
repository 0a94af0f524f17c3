"""Run a GPU module archive: the launch plan over device memory, on a backend.

The archive of a `cuda` target holds `model.ptx` (and `model.cubin` where ptxas was present at
build time), `kernels.cl` (the OpenCL twin of the same kernels), `weights.bin` and `plan.json`
(the launches in order, each with its grid, block and the value every argument names; the
workspace offsets of intermediates). A backend provides device memory, the program and
launches: `runtime/cuda.py` (pycuda, an NVIDIA GPU) and `runtime/opencl.py` (the twin, on any
OpenCL device: PoCL on the CPU in the tests). Memory is allocated once per module; a run
copies only the model's inputs in and its outputs out.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

import numpy as np

from compiler_core.runtime.module import InputError, check_inputs, signature


class Backend(Protocol):
    name: str

    def current(self) -> AbstractContextManager: ...
    def load(self, members: Mapping[str, bytes]) -> None: ...
    def function(self, name: str): ...
    def alloc(self, nbytes: int): ...
    def view(self, buffer, offset: int, nbytes: int): ...
    def upload(self, buffer, array: np.ndarray) -> None: ...
    def download(self, buffer, array: np.ndarray) -> None: ...
    def launch(self, function, grid: Sequence[int], block: Sequence[int], args: list) -> None: ...
    def prefetch(self, kernel: str, buffer, nbytes: int) -> None: ...
    def synchronize(self) -> None: ...
    def time_launches(self, launches: list, number: int) -> float: ...
    def time_each(self, steps: Sequence[Callable[[], None]]) -> list[float]: ...
    def free_all(self) -> None: ...


class DeviceModule:
    """A loaded GPU archive: `run(inputs) -> outputs`, as the CPU module."""

    def __init__(self, members: Mapping[str, bytes], backend: Backend):
        with backend.current():
            self._load(members, backend)

    def _load(self, members: Mapping[str, bytes], backend: Backend) -> None:
        self.manifest = json.loads(members["manifest.json"])
        plan = json.loads(members["plan.json"])
        self.device = backend.name
        self.inputs = signature(plan["inputs"])
        self.outputs = signature(plan["outputs"])
        self.batch_buckets = None
        self._backend = backend
        backend.load(members)
        weights = np.frombuffer(members["weights.bin"], np.uint8)
        self._weights = backend.alloc(max(len(weights), 1))
        if len(weights):
            backend.upload(self._weights, weights)
        self._weight_bytes = weights
        self._workspace = backend.alloc(max(plan["workspace_bytes"], 1))
        self._io = {
            name: backend.alloc(max(int(np.prod(shape)) * dtype.itemsize, 1))
            for name, shape, dtype in self.inputs + self.outputs
        }
        sizes = {v["name"]: v for v in plan["values"]}
        self._launches = [
            (
                launch["kernel"],
                backend.function(launch["kernel"]),
                tuple(launch["grid"]),
                tuple(launch["block"]),
                [self._pointer(value, plan, sizes) for value in launch["args"]],
            )
            for launch in plan["launches"]
        ]
        # Per launch, the weights to stream into L2 just before it (an archive built before
        # the plan listed them has none): (pointer, bytes).
        self._prefetch_kernel = plan.get("prefetch_kernel")
        self._prefetches = [
            [
                (self._pointer(value, plan, sizes), sizes[value]["nbytes"])
                for value in launch.get("prefetch", ())
            ]
            for launch in plan["launches"]
        ]
        self._copied_outputs = plan["copied_outputs"]  # output -> an input or a weight
        self._weight_offsets = plan["weight_offsets"]

    def _pointer(self, value: str, plan: dict, sizes: dict):
        if value in self._io:
            return self._io[value]
        nbytes = sizes[value]["nbytes"]
        if value in plan["weight_offsets"]:
            return self._backend.view(self._weights, plan["weight_offsets"][value], nbytes)
        if value in plan["workspace_offsets"]:
            return self._backend.view(self._workspace, plan["workspace_offsets"][value], nbytes)
        raise InputError(f"plan names {value!r}, which is neither an input, output nor planned")

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        arrays = check_inputs(self.inputs, inputs)
        with self._backend.current():
            return self._run(arrays)

    def _run(self, arrays: list[np.ndarray]) -> dict[str, np.ndarray]:
        for (name, _, _), array in zip(self.inputs, arrays, strict=True):
            self._backend.upload(self._io[name], array)
        for step in range(len(self._launches)):
            self._step(step)
        self._backend.synchronize()
        outputs = {}
        for name, shape, dtype in self.outputs:
            array = np.empty(shape, dtype)
            source = self._copied_outputs.get(name)
            if source is None:
                self._backend.download(self._io[name], array)
            elif source in self._weight_offsets:
                start = self._weight_offsets[source]
                raw = self._weight_bytes[start : start + array.nbytes]
                array[...] = raw.view(dtype).reshape(shape)
            else:
                array[...] = arrays[[n for n, _, _ in self.inputs].index(source)]
            outputs[name] = array
        return outputs

    def _step(self, index: int) -> None:
        """Launch `index` of the plan, after the L2 prefetches of its weights."""
        _, function, grid, block, args = self._launches[index]
        for buffer, nbytes in self._prefetches[index]:
            self._backend.prefetch(self._prefetch_kernel, buffer, nbytes)
        self._backend.launch(function, grid, block, args)

    def profile(self, inputs: Mapping[str, np.ndarray], repeats: int = 20):
        """Each launch's time inside a whole run of the plan, its prefetches counted with it,
        in order: [(kernel, median seconds over `repeats` runs)]. A kernel meets the caches as
        the kernels before it leave them: timed alone and repeated, its weights stay hot, and
        resnet18's convs on an H200 read about half their time in the run."""
        arrays = check_inputs(self.inputs, inputs)
        steps = [functools.partial(self._step, k) for k in range(len(self._launches))]
        with self._backend.current():
            self._run(arrays)  # inputs in place, every buffer written once
            runs = [self._backend.time_each(steps) for _ in range(repeats)]
        return [
            (name, float(np.median(times)))
            for (name, *_), times in zip(self._launches, zip(*runs, strict=True), strict=True)
        ]
