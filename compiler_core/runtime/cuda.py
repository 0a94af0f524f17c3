"""The CUDA backend of `runtime/device.py`, on pycuda.

pycuda is the optional `cuda` extra and is imported only when a CUDA archive is loaded; CUDA is
initialised then, never at import (a worker that forks after importing the runtime stays
usable). Without pycuda or without a device, loading fails with `NoCudaDeviceError`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from compiler_core.errors import UserError

# The prefetch kernel's launch: a thread per 128-byte line, at most this many blocks (a
# grid-stride loop covers the rest).
PREFETCH_LINE_BYTES = 128
PREFETCH_THREADS = 256
PREFETCH_MAX_BLOCKS = 1024


class NoCudaDeviceError(UserError):
    """A CUDA archive loaded where no NVIDIA GPU can run it."""


def _driver():
    """pycuda's driver, initialised, or NoCudaDeviceError("no CUDA device: <why>")."""
    try:
        import pycuda.driver as driver
    except ImportError as err:
        raise NoCudaDeviceError(f"no CUDA device: pycuda is not installed ({err})") from None
    try:
        driver.init()
        count = driver.Device.count()
    except driver.Error as err:
        raise NoCudaDeviceError(
            f"no CUDA device: the CUDA driver failed to start ({err})"
        ) from None
    if count == 0:
        raise NoCudaDeviceError("no CUDA device: the CUDA driver sees no GPU")
    return driver


def cuda_available() -> tuple[bool, str]:
    """(whether a CUDA device is here, its name or why not). Initialises CUDA in this
    process: call it where CUDA will run (a worker after its fork), not before forking."""
    try:
        driver = _driver()
    except NoCudaDeviceError as err:
        return False, str(err)
    return True, driver.Device(0).name()


class CudaBackend:
    name = "cuda"

    def __init__(self, ordinal: int = 0):
        try:
            self._cuda = _driver()
        except NoCudaDeviceError as err:
            raise NoCudaDeviceError(
                f"{err}. A cuda archive runs on an NVIDIA GPU with kiln[cuda] installed; here, "
                "run its OpenCL twin with load(archive, device='opencl') (kiln run --device "
                "opencl)"
            ) from None
        device = self._cuda.Device(ordinal)
        self.arch = "sm_{}{}".format(*device.compute_capability())
        self._context = device.retain_primary_context()
        self._depth = threading.local()  # per thread: how many `current()` blocks are open
        with self.current():
            self._stream = self._cuda.Stream()
        self._keep: list = []  # allocations live as long as the module

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """The device's primary context made current on the calling thread for the block,
        and taken off again: a module loaded on one thread runs on any other (a server's
        worker threads), and no context is left on a thread's stack at exit, where pycuda
        aborts the process if it finds one. Every method enters it; a caller that makes
        many calls (a module's run) enters it once around them, and the inner ones cost
        no driver call."""
        depth = getattr(self._depth, "value", 0)
        if depth == 0:
            self._context.push()
        self._depth.value = depth + 1
        try:
            yield
        finally:
            self._depth.value = depth
            if depth == 0:
                self._cuda.Context.pop()

    def load(self, members: Mapping[str, bytes]) -> None:
        # The cubin when it was built for this GPU's architecture, else the PTX (the driver
        # compiles it for whatever GPU this is).
        manifest_arch = members.get("manifest.json", b"")
        image = members.get("model.cubin") if self.arch.encode() in manifest_arch else None
        with self.current():
            self._module = self._cuda.module_from_buffer(image or members["model.ptx"])
        self._prefetcher = None  # the new module's prefetch kernel, prepared on first use

    def function(self, name: str):
        with self.current():
            return self._module.get_function(name)

    def alloc(self, nbytes: int):
        with self.current():
            allocation = self._cuda.mem_alloc(nbytes)
        self._keep.append(allocation)
        return np.uintp(int(allocation))

    def view(self, buffer, offset: int, nbytes: int):
        return np.uintp(int(buffer) + offset)

    def upload(self, buffer, array: np.ndarray) -> None:
        with self.current():
            self._cuda.memcpy_htod_async(int(buffer), np.ascontiguousarray(array), self._stream)

    def download(self, buffer, array: np.ndarray) -> None:
        with self.current():
            self._cuda.memcpy_dtoh_async(array, int(buffer), self._stream)
            self._stream.synchronize()

    def launch(self, function, grid: Sequence[int], block: Sequence[int], args: list) -> None:
        # Every argument of a launch is a device pointer.
        self._call(function, "P" * len(args), grid, block, args)

    def prefetch(self, kernel: str, buffer, nbytes: int) -> None:
        """Stream `nbytes` at `buffer` into L2 with the module's prefetch kernel `kernel`
        (a hint: it loads nothing into registers), a thread per 128-byte line, grid-stride."""
        if self._prefetcher is None:
            self._prefetcher = self.function(kernel)
        lines = -(-nbytes // PREFETCH_LINE_BYTES)
        blocks = max(1, min(-(-lines // PREFETCH_THREADS), PREFETCH_MAX_BLOCKS))
        grid, block = (blocks, 1, 1), (PREFETCH_THREADS, 1, 1)
        self._call(self._prefetcher, "PQ", grid, block, [buffer, np.uint64(nbytes)])

    def _call(self, function, arg_format: str, grid, block, args) -> None:
        """A prepared launch on the stream: the arguments packed by `arg_format` (prepared
        once per function), where pycuda's generic call inspects each argument's type on
        every launch."""
        if getattr(function, "kiln_format", None) != arg_format:
            function.prepare(arg_format)
            function.kiln_format = arg_format
        with self.current():
            function.prepared_async_call(tuple(grid), tuple(block), self._stream, *args)

    def synchronize(self) -> None:
        with self.current():
            self._stream.synchronize()

    def time_each(self, steps) -> list[float]:
        """Seconds of each step (a callable that issues launches), the steps run once in
        order with a CUDA event recorded between consecutive ones."""
        with self.current():
            marks = [self._cuda.Event() for _ in range(len(steps) + 1)]
            marks[0].record(self._stream)
            for step, mark in zip(steps, marks[1:], strict=True):
                step()
                mark.record(self._stream)
            marks[-1].synchronize()
            return [a.time_till(b) / 1000.0 for a, b in zip(marks, marks[1:], strict=False)]

    def time_launches(self, launches, number: int) -> float:
        """Seconds per pass of `launches` (function, grid, block, args), `number` passes timed
        together with CUDA events on the stream."""
        with self.current():
            start, end = self._cuda.Event(), self._cuda.Event()
            start.record(self._stream)
            for _ in range(number):
                for function, grid, block, args in launches:
                    self.launch(function, grid, block, args)
            end.record(self._stream)
            end.synchronize()
            return start.time_till(end) / 1000.0 / number

    def free_all(self) -> None:
        """Release every allocation (the tuner's runner, between candidates)."""
        self.synchronize()
        with self.current():
            self._keep.clear()
