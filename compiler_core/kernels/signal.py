"""Native kernels for DFT and STFT (reference: compiler_core/graph/ops/signal.py)."""

from __future__ import annotations

from compiler_core.kernels.base import Builder

KERNELS: dict[str, Builder] = {}
