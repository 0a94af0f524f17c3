"""Converters for the extra normalization operators."""

from __future__ import annotations

from compiler_core.frontend.convert_utils import Converter, all_inputs, all_outputs, direct


def convert_group_norm(ctx, node, attrs):
    attrs.ignore("stash_type")
    ctx.emit(
        "GroupNormalization",
        all_inputs(node),
        all_outputs(node),
        num_groups=attrs.get("num_groups"),
        epsilon=attrs.get("epsilon", 1e-5),
    )


def convert_mvn(ctx, node, attrs):
    rank = ctx.type(node.input[0]).rank
    axes = tuple(a % rank for a in (attrs.get("axes") or (0, 2, 3)))
    ctx.emit("MeanVarianceNormalization", all_inputs(node), all_outputs(node), axes=axes)


CONVERTERS: dict[str, dict[int, Converter]] = {
    "LpNormalization": {1: direct(axis=-1, p=2)},
    "GroupNormalization": {18: convert_group_norm},
    "MeanVarianceNormalization": {9: convert_mvn},
}
