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
    transformer,
)
from compiler_core.graph.ops.base import OpDef

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
)


def _merge(families) -> dict[str, OpDef]:
    table: dict[str, OpDef] = {}
    for family in families:
        for name, opdef in family.items():
            if name in table:
                raise RuntimeError(f"operator {name!r} is defined twice in the op table")
            table[name] = opdef
    return table


OP_TABLE: dict[str, OpDef] = _merge(_FAMILIES)

__all__ = ["OP_TABLE", "OpDef"]
