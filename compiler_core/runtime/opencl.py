"""The OpenCL backend of `runtime/device.py`: a CUDA archive's twin kernels (`kernels.cl`) on
any OpenCL device — PoCL on the CPU where there is no GPU. It runs the same launch plan over
the same workspace offsets as the CUDA backend (sub-buffers of one workspace), so a twin run
checks the kernels and the memory plan together.

pyopencl is imported when the backend is made, not at import.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Mapping, Sequence

import numpy as np

from compiler_core.errors import UserError


class NoOpenCLDeviceError(UserError):
    """No OpenCL platform or device to run a twin on."""


@functools.cache
def _device():
    try:
        import pyopencl as cl
    except ImportError as err:
        raise NoOpenCLDeviceError(f"pyopencl is not installed ({err})") from None
    try:
        platforms = cl.get_platforms()
    except cl.Error as err:
        raise NoOpenCLDeviceError(f"no OpenCL platform ({err})") from None
    devices = [d for p in platforms for d in p.get_devices()]
    if not devices:
        raise NoOpenCLDeviceError("OpenCL platforms have no device")
    # A CPU device (PoCL) first: the twin is a check, and it must not depend on a GPU.
    devices.sort(key=lambda d: d.type != cl.device_type.CPU)
    return cl, devices[0]


def opencl_available() -> tuple[bool, str]:
    """(whether a twin can run here, why not)."""
    try:
        _, device = _device()
    except NoOpenCLDeviceError as err:
        return False, str(err)
    return True, device.name


class OpenCLBackend:
    name = "opencl"

    def __init__(self):
        self._cl, self.device = _device()
        self._context = self._cl.Context([self.device])
        self._queue = self._cl.CommandQueue(self._context)
        self._kernels: dict = {}

    def current(self) -> contextlib.AbstractContextManager:
        """OpenCL calls name their context: nothing to make current (see CudaBackend)."""
        return contextlib.nullcontext()

    def prefetch(self, kernel: str, buffer, nbytes: int) -> None:
        """Nothing: an L2 prefetch is a hint with no semantics for the twin to check."""

    def load(self, members: Mapping[str, bytes]) -> None:
        source = members["kernels.cl"].decode()
        self._program = self._cl.Program(self._context, source).build()
        self._kernels = {}  # a new program: kernels of the last one must not be reused

    def function(self, name: str):
        if name not in self._kernels:
            from compiler_core.codegen.opencl import cl_name

            self._kernels[name] = self._cl.Kernel(self._program, cl_name(name))
        return self._kernels[name]

    def alloc(self, nbytes: int):
        return self._cl.Buffer(self._context, self._cl.mem_flags.READ_WRITE, nbytes)

    def view(self, buffer, offset: int, nbytes: int):
        return buffer.get_sub_region(offset, nbytes)

    def upload(self, buffer, array: np.ndarray) -> None:
        self._cl.enqueue_copy(self._queue, buffer, np.ascontiguousarray(array))

    def download(self, buffer, array: np.ndarray) -> None:
        self._cl.enqueue_copy(self._queue, array, buffer)

    def launch(self, function, grid: Sequence[int], block: Sequence[int], args: list) -> None:
        global_size = tuple(g * b for g, b in zip(grid, block, strict=True))
        function(self._queue, global_size, tuple(block), *args)

    def synchronize(self) -> None:
        self._queue.finish()

    def time_each(self, steps) -> list[float]:
        """Seconds of each step (a callable that issues launches), the steps run once in
        order: the host clock around each and the queue's finish."""
        self.synchronize()
        seconds = []
        for step in steps:
            started = time.perf_counter()
            step()
            self.synchronize()
            seconds.append(time.perf_counter() - started)
        return seconds

    def time_launches(self, launches, number: int) -> float:
        """Seconds per pass of `launches` (function, grid, block, args): the host clock
        around `number` passes and the queue's finish (PoCL has no cheaper exact timer)."""
        self.synchronize()
        started = time.perf_counter()
        for _ in range(number):
            for function, grid, block, args in launches:
                self.launch(function, grid, block, args)
        self.synchronize()
        return (time.perf_counter() - started) / number

    def free_all(self) -> None:
        """Buffers are released when their last reference goes: nothing is held here."""
        self.synchronize()
