"""Kernels: for every op family a compute definition (tensor expressions) and, in
`schedules`, the default CPU schedule of the fused group it anchors.

`KERNELS` is the one registry, merged from the family modules.
"""

from __future__ import annotations

from compiler_core.kernels import (
    control,
    elementwise,
    injective,
    linear_attention,
    losses,
    nn,
    recurrent,
    reduce,
    signal,
    transformer,
)
from compiler_core.kernels.base import Builder, KernelContext, KernelError


def _merge(*tables: dict[str, Builder]) -> dict[str, Builder]:
    merged: dict[str, Builder] = {}
    for table in tables:
        for op, builder in table.items():
            if op in merged:
                raise RuntimeError(f"kernel for {op!r} is defined twice")
            merged[op] = builder
    return merged


KERNELS: dict[str, Builder] = _merge(
    elementwise.KERNELS,
    injective.KERNELS,
    reduce.KERNELS,
    nn.KERNELS,
    losses.KERNELS,
    transformer.KERNELS,
    signal.KERNELS,
    recurrent.KERNELS,
    linear_attention.KERNELS,
    control.KERNELS,
)

__all__ = ["KERNELS", "KernelContext", "KernelError"]
