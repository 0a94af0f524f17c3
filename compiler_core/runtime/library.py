"""Load a compiled kernel library and call its functions on numpy arrays (ctypes).

Part of the runtime: imports nothing else from the compiler, so a serving process needs
neither llvmlite nor lightgbm.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def default_threads() -> int:
    """KILN_NUM_THREADS, else OMP_NUM_THREADS (as OpenMP took it), else every core."""
    for name in ("KILN_NUM_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(name, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return os.cpu_count() or 1


_GOMP = None
_THREADS = default_threads()
_LIBRARIES: weakref.WeakSet = weakref.WeakSet()
# The first kernel library loaded with a pool: every later one runs its parallel loops on
# this library's pool, so a process has one set of workers (kept alive on purpose; ctypes
# never unloads a library anyway).
_POOL_HOST: ctypes.CDLL | None = None


def openmp_runtime() -> ctypes.CDLL | None:
    """libgomp, loaded globally, for kernel libraries linked before Kiln had its own thread
    pool (their parallel loops call GOMP_parallel); None where it is not installed."""
    global _GOMP
    if _GOMP is None:
        name = ctypes.util.find_library("gomp") or "libgomp.so.1"
        try:
            _GOMP = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            return None
    return _GOMP


def set_num_threads(count: int) -> None:
    """Threads per parallel loop (the caller included) for every kernel library, loaded or
    to be loaded."""
    global _THREADS
    _THREADS = max(int(count), 1)
    for library in list(_LIBRARIES):
        library.set_threads(_THREADS)
    if _POOL_HOST is not None:  # its KernelLibrary may be gone; its pool runs every library's
        _POOL_HOST.kiln_pool_set_threads(ctypes.c_int(_THREADS))
    gomp = openmp_runtime()
    if gomp is not None:
        gomp.omp_set_num_threads(_THREADS)


def workspace_cached_bytes() -> int | None:
    """The bytes the process's cache of kernel workspace blocks keeps between calls
    (kiln_workspace.c; every library loaded after the first uses the first one's cache);
    None before any library is loaded, or where the first was built before the count."""
    kept = getattr(_POOL_HOST, "kiln_workspace_kept_bytes", None) if _POOL_HOST else None
    return None if kept is None else int(kept())


class KernelLibrary:
    def __init__(self, path: str | Path):
        openmp_runtime()
        self.path = Path(path)
        self._lib = ctypes.CDLL(str(self.path))
        _LIBRARIES.add(self)
        self.set_threads(_THREADS)
        self._join_process_pool()

    def _join_process_pool(self) -> None:
        """Run this library's parallel loops on the first library's pool, and take its
        kernels' workspace blocks from that library's cache (kiln_workspace.c): one of each
        per process, however many libraries it loads (a tuning runner loads hundreds)."""
        global _POOL_HOST
        share = getattr(self._lib, "kiln_pool_share", None)
        if share is None:
            return  # an OpenMP library, built before Kiln had its own pool
        if _POOL_HOST is None:
            _POOL_HOST = self._lib
            kept = getattr(self._lib, "kiln_workspace_kept_bytes", None)
            if kept is not None:  # read by workspace_cached_bytes
                kept.restype = ctypes.c_int64
            return
        share.argtypes = [ctypes.c_void_p]
        share(ctypes.cast(_POOL_HOST.kiln_pool_run, ctypes.c_void_p))
        share_workspace = getattr(self._lib, "kiln_workspace_share", None)
        host_alloc = getattr(_POOL_HOST, "kiln_workspace_alloc", None)
        if share_workspace is None or host_alloc is None:
            return  # one of the two was built before the cache: each keeps its own malloc
        share_workspace.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        share_workspace(
            ctypes.cast(host_alloc, ctypes.c_void_p),
            ctypes.cast(_POOL_HOST.kiln_workspace_free, ctypes.c_void_p),
        )

    def set_threads(self, count: int) -> None:
        """The thread count of this library's pool (kiln_pool.c), if it has one."""
        setter = getattr(self._lib, "kiln_pool_set_threads", None)
        if setter is not None:
            setter.argtypes = [ctypes.c_int]
            setter(int(count))

    def function(self, name: str):
        try:
            fn = getattr(self._lib, name)
        except AttributeError:
            raise KeyError(f"{self.path.name} has no kernel {name!r}") from None
        fn.restype = None
        return fn

    def call(self, name: str, arrays: Sequence[np.ndarray]) -> None:
        """Call kernel `name` with dense arrays (they must be C-contiguous and writable where
        the kernel writes)."""
        pointers = []
        for array in arrays:
            if not array.flags.c_contiguous:
                raise ValueError(f"kernel {name!r}: arguments must be C-contiguous arrays")
            pointers.append(ctypes.c_void_p(array.ctypes.data))
        self.function(name)(*pointers)
