"""Signal operators. Window functions depend only on their (static) size: they become
constants at import."""

from __future__ import annotations

import numpy as np

from compiler_core.frontend.convert_utils import Converter
from compiler_core.frontend.onnx import onnx_dtype_name

# Generalized cosine windows: w[n] = sum_k (-1)^k a_k cos(2 pi k n / N).
WINDOW_COEFFICIENTS = {
    "HannWindow": (0.5, 0.5),
    "HammingWindow": (25 / 46, 21 / 46),
    "BlackmanWindow": (0.42, 0.5, 0.08),
}


def convert_window(op: str) -> Converter:
    def convert(ctx, node, attrs):
        size = int(np.asarray(ctx.value(node.input[0], f"{op} size")).reshape(-1)[0])
        periodic = attrs.get("periodic", 1)
        dtype = onnx_dtype_name(attrs.get("output_datatype", 1))
        denominator = size if periodic else size - 1
        n = np.arange(size, dtype=np.float64)
        window = np.zeros(size)
        for k, a in enumerate(WINDOW_COEFFICIENTS[op]):
            window += (-1) ** k * a * np.cos(2 * np.pi * k * n / denominator)
        ctx.add_constant(window.astype(dtype), name=node.output[0])

    return convert


CONVERTERS: dict[str, dict[int, Converter]] = {
    op: {17: convert_window(op)} for op in WINDOW_COEFFICIENTS
}
