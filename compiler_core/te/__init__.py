"""Tensor expressions: declare what each op computes, separately from how it is scheduled.

    a = placeholder((m, k), "float32", "a")
    b = placeholder((k, n), "float32", "b")
    kk = reduce_axis(k, "kk")
    c = compute((m, n), lambda i, j: reduce_sum(a[i, kk] * b[kk, j], kk), "c")

`lower([a, b], [c])` turns the declaration into a loop-IR function with one naive loop nest
per stage; schedule records then transform that function.
"""

from compiler_core.te.lower import lower
from compiler_core.te.tensor import (
    ComputeOp,
    Previous,
    RecurrenceOp,
    ReduceAxis,
    Reduction,
    Tensor,
    TensorRead,
    compute,
    placeholder,
    recurrence,
    reduce_axis,
    reduce_max,
    reduce_min,
    reduce_prod,
    reduce_sum,
)

__all__ = [
    "ComputeOp",
    "Previous",
    "RecurrenceOp",
    "ReduceAxis",
    "Reduction",
    "Tensor",
    "TensorRead",
    "compute",
    "lower",
    "placeholder",
    "reduce_axis",
    "reduce_max",
    "reduce_min",
    "reduce_prod",
    "recurrence",
    "reduce_sum",
]
