"""Load a compiled kernel library and call its functions on numpy arrays (ctypes).

Part of the runtime: imports nothing else from the compiler, so a serving process needs
neither llvmlite nor lightgbm.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Sequence
from pathlib import Path

import numpy as np

_GOMP = None


def openmp_runtime() -> ctypes.CDLL:
    """libgomp, loaded globally so kernels link to the same thread pool."""
    global _GOMP
    if _GOMP is None:
        name = ctypes.util.find_library("gomp") or "libgomp.so.1"
        _GOMP = ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    return _GOMP


def set_num_threads(count: int) -> None:
    openmp_runtime().omp_set_num_threads(int(count))


class KernelLibrary:
    def __init__(self, path: str | Path):
        openmp_runtime()
        self.path = Path(path)
        self._lib = ctypes.CDLL(str(self.path))

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
