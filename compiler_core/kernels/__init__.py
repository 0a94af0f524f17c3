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
    text,
    transformer,
)
from compiler_core.kernels.base import Builder, KernelContext, KernelError
from compiler_core.registry import merge_tables

KERNELS: dict[str, Builder] = merge_tables(
    (
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
        text.KERNELS,
    ),
    "kernel",
)

__all__ = ["KERNELS", "KernelContext", "KernelError"]
