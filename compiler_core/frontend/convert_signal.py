"""Signal operators. DFT and STFT become Kiln ops with their lengths and axis read at import.
Window functions and MelWeightMatrix depend only on (static) scalars: they become constants."""

from __future__ import annotations

import numpy as np

from compiler_core.frontend.common import UnsupportedError, onnx_dtype_name
from compiler_core.frontend.convert_utils import Converter, input_at

# Generalized cosine windows: w[n] = sum_k (-1)^k a_k cos(2 pi k n / N).
WINDOW_COEFFICIENTS = {
    "HannWindow": (0.5, 0.5),
    "HammingWindow": (25 / 46, 21 / 46),
    "BlackmanWindow": (0.42, 0.5, 0.08),
}


def _scalar(ctx, name: str, purpose: str):
    return np.asarray(ctx.value(name, purpose)).reshape(-1)[0].item()


def convert_window(op: str) -> Converter:
    def convert(ctx, node, attrs):
        size = int(_scalar(ctx, node.input[0], f"{op} size"))
        periodic = attrs.get("periodic", 1)
        dtype = onnx_dtype_name(attrs.get("output_datatype", 1))
        # A periodic window is one period of length N; a symmetric one spans N - 1 steps.
        period = max(size if periodic else size - 1, 1)
        n = np.arange(size, dtype=np.float64)
        window = np.zeros(size)
        for k, a in enumerate(WINDOW_COEFFICIENTS[op]):
            window += (-1) ** k * a * np.cos(2 * np.pi * k * n / period)
        ctx.add_constant(window.astype(dtype), name=node.output[0])

    return convert


# --- DFT -------------------------------------------------------------------------------------


def _signal_axis(ctx, node, axis: int, rank: int) -> int:
    """ONNX counts negative axes from the back including the trailing complex dimension, which
    is itself not a valid axis."""
    if not (-rank <= axis <= -2 or 0 <= axis <= rank - 2):
        raise UnsupportedError(f"node {node.name!r} (DFT): axis {axis} is out of range")
    return axis % rank


def _emit_dft(ctx, node, attrs, axis: int):
    x = ctx.type(node.input[0])
    axis = _signal_axis(ctx, node, axis, x.rank)
    inverse, onesided = attrs.get("inverse", 0), attrs.get("onesided", 0)
    length_input = input_at(node, 1)
    if length_input:
        length = int(_scalar(ctx, length_input, "DFT dft_length"))
    elif onesided and inverse:
        length = 2 * (x.shape[axis] - 1)  # the real signal a one-sided spectrum came from
    else:
        length = x.shape[axis]
    ctx.emit(
        "DFT",
        [node.input[0]],
        [node.output[0]],
        axis=axis,
        dft_length=length,
        inverse=inverse,
        onesided=onesided,
    )


def convert_dft_17(ctx, node, attrs):
    _emit_dft(ctx, node, attrs, attrs.get("axis", 1))


def convert_dft_20(ctx, node, attrs):
    axis_input = input_at(node, 2)
    axis = int(_scalar(ctx, axis_input, "DFT axis")) if axis_input else -2
    _emit_dft(ctx, node, attrs, axis)


# --- STFT ------------------------------------------------------------------------------------


def convert_stft(ctx, node, attrs):
    signal = ctx.type(node.input[0])
    window, length_input = input_at(node, 2), input_at(node, 3)
    step = int(_scalar(ctx, node.input[1], "STFT frame_step"))
    if length_input:
        frame = int(_scalar(ctx, length_input, "STFT frame_length"))
    elif window:
        frame = ctx.type(window).shape[0]
    else:
        frame = signal.shape[1]
    onesided = attrs.get("onesided", 1)
    if onesided and signal.shape[-1] == 2:
        raise UnsupportedError(
            f"node {node.name!r} (STFT): a one-sided spectrum of a complex signal is not "
            "defined; set onesided=0"
        )
    ctx.emit(
        "STFT",
        [node.input[0], window] if window else [node.input[0]],
        [node.output[0]],
        frame_step=step,
        frame_length=frame,
        onesided=onesided,
    )


# --- MelWeightMatrix -------------------------------------------------------------------------


def _hertz_to_mel(hertz):
    return 2595.0 * np.log10(1.0 + hertz / 700.0)


def _mel_to_hertz(mel):
    return 700.0 * (10.0 ** (mel / 2595.0) - 1.0)


def mel_weight_matrix(bands: int, dft_length: int, sample_rate, low_hz, high_hz) -> np.ndarray:
    """(dft_length // 2 + 1, bands) triangles peaking at 1, evenly spaced on the mel scale.

    Band i rises from edge i to edge i + 1 and falls to edge i + 2, edges being spectrogram
    bins. As ONNX defines it, the mel range is split into bands + 2 steps (so the top edge
    falls below high_hz), and a frequency maps to bin floor((dft_length + 1) * f / rate).
    """
    bins = dft_length // 2 + 1
    low_mel, high_mel = _hertz_to_mel(low_hz), _hertz_to_mel(high_hz)
    mels = low_mel + np.arange(bands + 2) * (high_mel - low_mel) / (bands + 2)
    edges = np.floor((dft_length + 1) * _mel_to_hertz(mels) / sample_rate).astype(np.int64)
    # Rows past the spectrum (edges above the Nyquist bin) are computed, then dropped.
    matrix = np.zeros((max(bins, int(edges.max()) + 1), bands))
    for band in range(bands):
        left, center, right = edges[band : band + 3]
        rising = np.arange(left, center + 1)
        matrix[rising, band] = (rising - left) / max(center - left, 1)
        falling = np.arange(center, right)
        matrix[falling, band] = (right - falling) / max(right - center, 1)
        matrix[center, band] = 1.0
    return matrix[:bins]


def convert_mel_weight_matrix(ctx, node, attrs):
    names = ("num_mel_bins", "dft_length", "sample_rate", "lower_edge_hertz", "upper_edge_hertz")
    bands, dft_length, rate, low, high = (
        _scalar(ctx, value, f"MelWeightMatrix {name}")
        for value, name in zip(node.input, names, strict=True)
    )
    dtype = onnx_dtype_name(attrs.get("output_datatype", 1))
    matrix = mel_weight_matrix(int(bands), int(dft_length), float(rate), float(low), float(high))
    ctx.add_constant(matrix.astype(dtype), name=node.output[0])


CONVERTERS: dict[str, dict[int, Converter]] = {
    **{op: {17: convert_window(op)} for op in WINDOW_COEFFICIENTS},
    "DFT": {17: convert_dft_17, 20: convert_dft_20},
    "STFT": {17: convert_stft},
    "MelWeightMatrix": {17: convert_mel_weight_matrix},
}
