"""Linear-algebra operators."""

from __future__ import annotations

import numpy as np

from compiler_core.graph.ir import OpKind, TensorType
from compiler_core.graph.ops.base import OpDef, opdef


def _det(node, inputs):
    x = inputs[0]
    return [np.asarray(np.linalg.det(x.astype(np.float64))).astype(x.dtype)]


def _det_rule(node, types):
    return [TensorType(types[0].shape[:-2], types[0].dtype)]


OPS: dict[str, OpDef] = {"Det": opdef("Det", OpKind.OPAQUE, _det_rule, _det)}
