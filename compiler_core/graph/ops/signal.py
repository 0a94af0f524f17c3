"""Fourier transforms. Complex values travel as a trailing dimension: size 2 holds (real,
imaginary), size 1 a real signal.

DFT attributes: axis (non-negative, a signal axis), dft_length, inverse, onesided.
STFT attributes: frame_step, frame_length, onesided; inputs are the signal and an optional
window.
"""

from __future__ import annotations

import numpy as np

from compiler_core.graph.ir import FLOAT_DTYPES, OpKind, TensorType
from compiler_core.graph.ops.base import OpDef, ShapeError, opdef


def _as_complex(x: np.ndarray) -> np.ndarray:
    """(..., 1) or (..., 2) real tensor -> complex tensor without the trailing dim.

    Single precision stays single (complex64), as frameworks compute it: the transform's
    rounding then matches theirs where exact results are zero.
    """
    dtype = np.complex128 if x.dtype == np.float64 else np.complex64
    z = x[..., 0].astype(dtype)
    if x.shape[-1] == 2:
        z.imag = x[..., 1]
    return z


def _as_pairs(z: np.ndarray, dtype) -> np.ndarray:
    return np.stack([z.real, z.imag], axis=-1).astype(dtype)


def _check_signal(node, t: TensorType, min_rank: int) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ShapeError(f"{node.op} needs a floating-point signal, got {t}")
    if t.rank < min_rank or t.shape[-1] not in (1, 2):
        raise ShapeError(f"{node.op} signal {t} must end in a dimension of 1 (real) or 2")


# --- DFT -------------------------------------------------------------------------------------


def _dft_rule(node, types):
    x = types[0]
    _check_signal(node, x, 2)
    axis, length = node.attr("axis"), node.attr("dft_length")
    if not 0 <= axis < x.rank - 1:
        raise ShapeError(f"DFT axis {axis} is not a signal axis of {x}")
    if length < 1:
        raise ShapeError(f"DFT length {length} must be positive")
    shape = list(x.shape)
    inverse, onesided = node.attr("inverse", 0), node.attr("onesided", 0)
    if onesided and inverse:
        shape[axis], shape[-1] = length, 1  # one-sided spectrum back to a real signal
    else:
        shape[axis], shape[-1] = (length // 2 + 1 if onesided else length), 2
    return [TensorType(tuple(shape), x.dtype)]


def _dft(node, inputs):
    x = inputs[0]
    axis, length = node.attr("axis"), node.attr("dft_length")
    inverse, onesided = node.attr("inverse", 0), node.attr("onesided", 0)
    z = _as_complex(x)
    if onesided and inverse:
        # irfft zero-pads or trims the bins to length // 2 + 1 itself.
        real = np.fft.irfft(z, n=length, axis=axis)
        return [real[..., None].astype(x.dtype)]
    if inverse:
        return [_as_pairs(np.fft.ifft(z, n=length, axis=axis), x.dtype)]
    spectrum = np.fft.fft(z, n=length, axis=axis)
    if onesided:
        spectrum = np.take(spectrum, np.arange(length // 2 + 1), axis=axis)
    return [_as_pairs(spectrum, x.dtype)]


# --- STFT ------------------------------------------------------------------------------------


def _stft_shape(node, signal: TensorType) -> tuple[int, ...]:
    step, frame = node.attr("frame_step"), node.attr("frame_length")
    if step < 1 or not 1 <= frame <= signal.shape[1]:
        raise ShapeError(
            f"STFT frame_length {frame} and frame_step {step} do not fit signal {signal}"
        )
    frames = (signal.shape[1] - frame) // step + 1
    bins = frame // 2 + 1 if node.attr("onesided", 1) else frame
    return (signal.shape[0], frames, bins, 2)


def _stft_rule(node, types):
    signal = types[0]
    window = types[1] if len(types) > 1 else None
    _check_signal(node, signal, 3)
    if signal.rank != 3:
        raise ShapeError(f"STFT signal {signal} must have rank 3 (batch, length, 1 or 2)")
    if window is not None and window.shape != (node.attr("frame_length"),):
        raise ShapeError(f"STFT window {window} must be 1-D of frame_length")
    return [TensorType(_stft_shape(node, signal), signal.dtype)]


def _stft(node, inputs):
    signal = inputs[0]
    window = inputs[1] if len(inputs) > 1 else None
    step, frame = node.attr("frame_step"), node.attr("frame_length")
    z = _as_complex(signal)
    # (batch, positions, frame) views; every step-th position starts a frame.
    frames = np.lib.stride_tricks.sliding_window_view(z, frame, axis=1)[:, ::step]
    if window is not None:
        frames = frames * window.astype(frames.real.dtype)
    spectrum = np.fft.fft(frames, axis=-1)
    if node.attr("onesided", 1):
        spectrum = spectrum[..., : frame // 2 + 1]
    return [_as_pairs(spectrum, signal.dtype)]


OPS: dict[str, OpDef] = {
    "DFT": opdef("DFT", OpKind.OPAQUE, _dft_rule, _dft),
    "STFT": opdef("STFT", OpKind.OPAQUE, _stft_rule, _stft),
}
