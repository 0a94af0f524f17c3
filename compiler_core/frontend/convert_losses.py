"""Converters for the loss operators."""

from __future__ import annotations

from compiler_core.frontend.convert_utils import Converter, all_inputs, all_outputs


def convert_loss(op: str) -> Converter:
    def convert(ctx, node, attrs):
        values = {"reduction": attrs.get("reduction", "mean")}
        if attrs.has("ignore_index"):
            values["ignore_index"] = attrs.get("ignore_index")
        outputs = all_outputs(node)
        if op == "SoftmaxCrossEntropyLoss" and len(outputs) == 1:
            outputs.append("")
        ctx.emit(op, all_inputs(node), outputs, **values)

    return convert


CONVERTERS: dict[str, dict[int, Converter]] = {
    "NegativeLogLikelihoodLoss": {12: convert_loss("NegativeLogLikelihoodLoss")},
    "SoftmaxCrossEntropyLoss": {12: convert_loss("SoftmaxCrossEntropyLoss")},
}
