"""The op table: for every Kiln operator its pattern kind, type rule and numpy reference.

One plain dict, merged from the family modules; a name defined twice is an error.
"""

from __future__ import annotations

from compiler_core.graph.ops import (
    control,
    conv_transpose,
    elementwise,
    image,
    indexing,
    layout,
    linalg,
    losses,
    nn,
    normalization,
    quantize,
    recurrent,
    reduce,
    signal,
    tensor,
    text,
    transformer,
)
from compiler_core.graph.ops.base import OpDef
from compiler_core.registry import merge_tables

_FAMILIES = (
    elementwise.OPS,
    tensor.OPS,
    reduce.OPS,
    nn.OPS,
    conv_transpose.OPS,
    normalization.OPS,
    transformer.OPS,
    losses.OPS,
    indexing.OPS,
    layout.OPS,
    image.OPS,
    recurrent.OPS,
    quantize.OPS,
    signal.OPS,
    linalg.OPS,
    control.OPS,
    text.OPS,
)


OP_TABLE: dict[str, OpDef] = merge_tables(_FAMILIES, "operator definition")

__all__ = ["OP_TABLE", "OpDef"]
