"""Output buffers that outlive a run and are reused by the next ones.

A fresh `np.empty` of a large output is fresh memory from the OS (glibc maps blocks above its
mmap threshold and unmaps them on free): the kernel then faults in every 4 KB page as it
stores, about 2.5 us each here, so a 1.6 MB output cost 1.1 ms of page faults on a 0.17 ms
conv, in every run. ONNX Runtime serves outputs from its own arena; so do we.

An output array is a view of a block the arena keeps (numpy collapses every view's base to
the array that owns the memory, the block's `owner`): a block whose owner nobody but the arena
references is free, and a later run of the same size takes it. A caller that keeps its
outputs, or any view of them, keeps their blocks; nothing is overwritten. Checking a
reference count costs far less than tracking leases with finalizers: outputs are handed out
on every run, and for a small model the Python around the kernels is most of its latency.
"""

from __future__ import annotations

import math
import sys
import threading

import numpy as np

ALIGNMENT = 64
# Blocks kept per size: a few runs' outputs in flight at once (a server's threads).
KEPT_PER_SIZE = 4


class _Block:
    """`nbytes` on a 64-byte boundary (`data`, a view of `owner`), and its address."""

    def __init__(self, nbytes: int):
        self.owner = np.empty(nbytes + ALIGNMENT, np.uint8)
        start = (-self.owner.ctypes.data) % ALIGNMENT
        self.data = self.owner[start : start + nbytes]
        self.address = self.owner.ctypes.data + start
        # The owner's references while nobody else holds it (this block, `data`'s base and
        # getrefcount's own argument), measured rather than assumed.
        self.free_refs = sys.getrefcount(self.owner)

    def is_free(self) -> bool:
        return sys.getrefcount(self.owner) == self.free_refs


class OutputArena:
    def __init__(self) -> None:
        self._blocks: dict[int, list[_Block]] = {}
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> tuple[np.ndarray, int]:
        """An uninitialized C-contiguous array on a 64-byte boundary, from a free block of
        the same size when there is one, and its address."""
        dtype = dtype if isinstance(dtype, np.dtype) else np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        if not nbytes:  # nothing to fault in
            array = np.empty(shape, dtype)
            return array, array.ctypes.data
        with self._lock:
            blocks = self._blocks.get(nbytes)
            if blocks is None:
                blocks = self._blocks[nbytes] = []
            for block in blocks:  # a plain loop: this runs on every run of a module
                if block.is_free():
                    break
            else:
                block = _Block(nbytes)
                if len(blocks) < KEPT_PER_SIZE:
                    blocks.append(block)
            # Bytes first, then the dtype: viewed while the lock is held, so that no other
            # thread sees the block free in between.
            array = block.data.view(dtype).reshape(shape)
        return array, block.address
