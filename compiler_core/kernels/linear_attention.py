"""Native kernel for LinearAttention (reference: compiler_core/graph/ops/transformer.py)."""

from __future__ import annotations

from compiler_core.kernels.base import Builder

KERNELS: dict[str, Builder] = {}
