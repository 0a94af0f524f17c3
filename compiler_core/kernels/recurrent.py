"""Native kernels for RNN, GRU and LSTM (reference: compiler_core/graph/ops/recurrent.py)."""

from __future__ import annotations

from compiler_core.kernels.base import Builder

KERNELS: dict[str, Builder] = {}
