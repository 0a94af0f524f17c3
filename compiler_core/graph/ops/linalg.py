"""Linear-algebra operators."""

from __future__ import annotations

import numpy as np

from compiler_core.graph.ir import FLOAT_DTYPES, OpKind, TensorType
from compiler_core.graph.ops.base import OpDef, ShapeError, opdef


def _det(node, inputs):
    x = inputs[0]
    # LU in double precision: a determinant's magnitude can cancel badly in single.
    return [np.asarray(np.linalg.det(x.astype(np.float64))).astype(x.dtype)]


def _det_rule(node, types):
    x = types[0]
    if x.dtype not in FLOAT_DTYPES:
        raise ShapeError(f"Det needs floating-point matrices, got {x}")
    if x.rank < 2 or x.shape[-1] != x.shape[-2]:
        raise ShapeError(f"Det needs (..., M, M) square matrices, got {x}")
    return [TensorType(x.shape[:-2], x.dtype)]


OPS: dict[str, OpDef] = {"Det": opdef("Det", OpKind.OPAQUE, _det_rule, _det)}
