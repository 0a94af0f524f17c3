"""Load a module archive and run it: the whole model is one native call.

Imports nothing else from the compiler: a serving process needs neither llvmlite nor lightgbm.

Archive (zip) members: `model.so` (kernels + the `kiln_main` entry), `weights.bin` (constants
in their final, packed layouts), `plan.json` (input/output signatures, workspace size) and
`manifest.json` (sha256 of every other member, target, compiler version, verification).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import io
import json
import mmap
import os
import tempfile
import time
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from compiler_core.errors import UserError
from compiler_core.runtime.arena import OutputArena
from compiler_core.runtime.library import KernelLibrary, default_threads, set_num_threads

MEMBERS = ("model.so", "weights.bin", "plan.json")
# What an archive of each target kind must hold (besides manifest.json); other members the
# manifest lists (a cuda archive's model.cubin) are checked as well.
MEMBERS_BY_KIND = {
    "llvm": MEMBERS,
    "cuda": ("model.ptx", "kernels.cl", "weights.bin", "plan.json"),
}
ENTRY = "kiln_main"
ALIGNMENT = 64


class ArchiveError(UserError):
    """A module archive that is truncated, tampered with or not an archive at all."""


class InputError(UserError):
    """Inference inputs that do not match the module's signature."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def target_kind(manifest: dict) -> str:
    return str(manifest.get("target", "llvm")).split(" ", 1)[0]


def read_members(source: str | os.PathLike | bytes) -> dict[str, bytes]:
    data = bytes(source) if isinstance(source, (bytes, bytearray)) else Path(source).read_bytes()
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = set(archive.namelist())
            if "manifest.json" not in names:
                raise ArchiveError("module archive lacks manifest.json")
            manifest = json.loads(archive.read("manifest.json"))
            kind = target_kind(manifest)
            if kind not in MEMBERS_BY_KIND:
                raise ArchiveError(f"module archive for an unknown target kind {kind!r}")
            listed = set(manifest.get("members", {}))
            missing = ({*MEMBERS_BY_KIND[kind]} | listed) - names
            if missing:
                raise ArchiveError(f"module archive lacks {', '.join(sorted(missing))}")
            wanted = ("manifest.json", *MEMBERS_BY_KIND[kind], *sorted(listed))
            members = {name: archive.read(name) for name in wanted}
    except (zipfile.BadZipFile, EOFError, zipfile.LargeZipFile) as err:
        raise ArchiveError(f"not a readable module archive (truncated or corrupt): {err}") from None
    except json.JSONDecodeError as err:
        raise ArchiveError(f"module archive has an unreadable manifest: {err}") from None
    for name in members:
        if name == "manifest.json":
            continue
        expected = manifest.get("members", {}).get(name)
        if expected != sha256(members[name]):
            raise ArchiveError(f"module archive member {name!r} fails its sha256 check")
    return members


def _aligned_buffer(nbytes: int) -> tuple[object, np.ndarray]:
    """(owner, view): a zeroed byte buffer whose view starts on a 64-byte boundary; one of
    `HUGE_PAGE_MIN_BYTES` or more lies in transparent huge pages where the OS offers them."""
    if nbytes >= HUGE_PAGE_MIN_BYTES and HUGE_PAGES:
        return _huge_page_buffer(nbytes)
    owner = np.zeros(nbytes + ALIGNMENT, np.uint8)
    start = (-owner.ctypes.data) % ALIGNMENT
    return owner, owner[start : start + nbytes]


# A model's weights and workspace span thousands of 4 KB pages (MobileNetV2: 14 MB of
# weights), more than the data TLB's 2-3 thousand entries: inside a whole run a kernel's
# first touch of each page of its weights was a page walk, which prefetches cannot hide.
# In 2 MB pages the same bytes take a few entries. Linux gives them to a mapping that asks
# (madvise) where transparent huge pages are set to `madvise` or `always`.
HUGE_PAGE_BYTES = 2 << 20
HUGE_PAGE_MIN_BYTES = HUGE_PAGE_BYTES // 2
HUGE_PAGES = hasattr(mmap, "MADV_HUGEPAGE")


def _huge_page_buffer(nbytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """An anonymous mapping (zeroed by the OS) asked to be backed by huge pages, and a view
    of `nbytes` from its first 2 MB boundary."""
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # A kernel built without transparent huge pages refuses the advice: 4 KB pages it is.
    with contextlib.suppress(OSError):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    whole = np.frombuffer(mapping, np.uint8)
    start = (-whole.ctypes.data) % HUGE_PAGE_BYTES
    return mapping, whole[start : start + nbytes]


Signature = list[tuple[str, tuple[int, ...], np.dtype]]


def _address(array: np.ndarray) -> int:
    """Where a contiguous array's data starts: through the buffer protocol where it is
    writable (half the cost of `array.ctypes.data`, which builds a helper object)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))
    except (TypeError, ValueError, BufferError):  # read-only, empty, or no buffer export
        return array.ctypes.data


def random_inputs(signature: Signature, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs for (name, shape, dtype) triples: standard-normal floats, booleans, and
    integers in 0..3 (small enough to be valid indices and lengths of most models). The
    one generator of the verification, `kiln verify` / `kiln run` and the tests."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for name, shape, dtype in signature:
        dtype = np.dtype(dtype)
        if dtype.kind == "f" or dtype.name == "bfloat16":
            feeds[name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[name] = rng.integers(0, 2, shape).astype(bool)
        else:
            feeds[name] = rng.integers(0, 4, shape).astype(dtype)
    return feeds


def signature(values: list[dict]) -> Signature:
    return [(v["name"], tuple(v["shape"]), np.dtype(v["dtype"])) for v in values]


def check_names(expected_signature: Signature, inputs: Mapping[str, np.ndarray]) -> None:
    expected = [name for name, _, _ in expected_signature]
    unknown = sorted(set(inputs) - set(expected))
    missing = [name for name in expected if name not in inputs]
    if unknown or missing:
        raise InputError(
            f"inputs do not match the module: missing {missing}, unknown {unknown}; "
            f"expected {expected}"
        )


def check_inputs(expected: Signature, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """The inputs as contiguous arrays in signature order; an InputError names any mismatch."""
    if len(inputs) != len(expected):
        check_names(expected, inputs)
    arrays = []
    for name, shape, dtype in expected:
        try:
            array = inputs[name]
        except KeyError:  # as many inputs as expected, one of them misnamed
            check_names(expected, inputs)
            raise
        if (  # the common case, quickly
            type(array) is np.ndarray
            and array.flags.c_contiguous
            and array.shape == shape
            and array.dtype == dtype
        ):
            arrays.append(array)
            continue
        array = np.asarray(array)
        if array.shape != shape or array.dtype != dtype:
            raise InputError(
                f"input {name!r} is {array.dtype}{list(array.shape)}, "
                f"the module expects {dtype}{list(shape)}"
            )
        arrays.append(np.ascontiguousarray(array))
    return arrays


@dataclasses.dataclass
class _Plan:
    """One compiled plan: its entry, signature and buffers. A bucketed archive has one per
    batch bucket (`batch`); a plain archive has one, for its fixed shapes (`batch` None)."""

    batch: int | None
    entry: object
    inputs: Signature
    outputs: Signature
    kernels: list[dict]
    workspace_offsets: dict[str, int]
    weight_offsets: dict[str, int]

    def __post_init__(self) -> None:
        # The entry's pointer arrays' types, made once: a small model's run is mostly the
        # Python around its kernels (mlp at batch 1: 3.5 us of a 47 us run).
        self.input_pointers = ctypes.c_void_p * max(len(self.inputs), 1)
        self.output_pointers = ctypes.c_void_p * max(len(self.outputs), 1)

    @classmethod
    def of(cls, plan: dict, entry, batch: int | None) -> _Plan:
        return cls(
            batch,
            entry,
            signature(plan["inputs"]),
            signature(plan["outputs"]),
            plan["kernels"],
            plan["workspace_offsets"],
            plan["weight_offsets"],
        )


def request_batch(expected: Signature, buckets: list[int], inputs: Mapping[str, np.ndarray]) -> int:
    """The batch (axis 0) of a request to a bucketed module, or an InputError naming what
    does not fit: every input at the signature's shape past axis 0, one batch, within the
    largest bucket."""
    check_names(expected, inputs)
    largest = buckets[-1]
    batches = set()
    for name, shape, dtype in expected:
        array = np.asarray(inputs[name])
        if array.dtype != dtype or array.ndim != len(shape) or array.shape[1:] != shape[1:]:
            wanted = ["N", *shape[1:]]
            raise InputError(
                f"input {name!r} is {array.dtype}{list(array.shape)}, the module expects "
                f"{dtype}{wanted} with a batch N of 1 to {largest}"
            )
        batches.add(array.shape[0])
    if len(batches) != 1:
        raise InputError(f"inputs disagree on the batch (axis 0): {sorted(batches)}")
    (batch,) = batches
    if not 1 <= batch <= largest:
        raise InputError(
            f"batch {batch} is outside the module's buckets {buckets} (the largest is {largest})"
        )
    return batch


class Module:
    def __init__(self, members: dict[str, bytes], num_threads: int | None = None):
        self.manifest = json.loads(members["manifest.json"])
        plan = json.loads(members["plan.json"])
        # The signature: for a bucketed archive, the largest bucket's (axis 0 of every input and
        # output takes any batch up to it).
        self.inputs = signature(plan["inputs"])
        self.outputs = signature(plan["outputs"])
        self.batch_buckets: list[int] | None = plan.get("batch_buckets")
        self._dir = tempfile.TemporaryDirectory(prefix="kiln-module-")
        library = Path(self._dir.name) / "model.so"
        library.write_bytes(members["model.so"])
        self._library = KernelLibrary(library)
        if self.batch_buckets:
            self._plans = [
                _Plan.of(b, self._library.function(b["entry"]), b["batch"]) for b in plan["buckets"]
            ]
        else:
            self._plans = [_Plan.of(plan, self._library.function(ENTRY), None)]
        self._weights_owner, self._weights = _aligned_buffer(len(members["weights.bin"]))
        self._weights[:] = np.frombuffer(members["weights.bin"], np.uint8)
        # Plans run one at a time on a module: the largest workspace serves them all.
        self._workspace_owner, self._workspace = _aligned_buffer(plan["workspace_bytes"])
        self._workspace_ptr = ctypes.c_void_p(self._workspace.ctypes.data)
        self._weights_ptr = ctypes.c_void_p(self._weights.ctypes.data)
        self._outputs = OutputArena()
        set_num_threads(num_threads or default_threads())

    def _checked(self, inputs: Mapping[str, np.ndarray]) -> tuple[_Plan, list[np.ndarray], int]:
        """(the plan to run, its input arrays, the request's batch)."""
        if not self.batch_buckets:
            return self._plans[0], check_inputs(self.inputs, inputs), 0
        batch = self._batch_of(inputs)
        plan = next(p for p in self._plans if p.batch >= batch)
        arrays = []
        for name, shape, dtype in plan.inputs:
            array = np.asarray(inputs[name])
            if batch == plan.batch:
                arrays.append(np.ascontiguousarray(array))
            else:  # the bucket's rows past the request's batch are zeros, cut from the outputs
                padded = np.zeros(shape, dtype)
                padded[:batch] = array
                arrays.append(padded)
        return plan, arrays, batch

    def _batch_of(self, inputs: Mapping[str, np.ndarray]) -> int:
        return request_batch(self.inputs, self.batch_buckets, inputs)

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        plan, arrays, batch = self._checked(inputs)
        outputs, output_ptrs = {}, plan.output_pointers()
        for k, (name, shape, dtype) in enumerate(plan.outputs):
            outputs[name], output_ptrs[k] = self._outputs.empty(shape, dtype)
        input_ptrs = plan.input_pointers(*map(_address, arrays))
        plan.entry(input_ptrs, output_ptrs, self._workspace_ptr, self._weights_ptr)
        if plan.batch is not None and batch != plan.batch:
            return {name: array[:batch] for name, array in outputs.items()}
        return outputs

    def profile(
        self, inputs: Mapping[str, np.ndarray], repeats: int = 20, alone: bool = False
    ) -> list[tuple[str, float]]:
        """Time every kernel on its own, in execution order: [(kernel, median seconds)].

        Kernels are called one by one over the same workspace the entry function uses, so
        each sees the data it would see inside a whole-model run (a debug executor): the
        whole sequence `repeats` times. With `alone`, each kernel is called `repeats` times
        in a row instead (after one call that warms it), in the same order, so it finds its
        weights and inputs in cache: the difference from the in-model time is what the
        kernel waits on memory for inside a run.
        """
        plan, checked, _ = self._checked(inputs)
        arrays = dict(zip([name for name, _, _ in plan.inputs], checked, strict=True))
        outputs = {name: np.empty(shape, dtype) for name, shape, dtype in plan.outputs}

        def pointer(value: str) -> ctypes.c_void_p:
            if value in arrays:
                return ctypes.c_void_p(arrays[value].ctypes.data)
            if value in outputs:
                return ctypes.c_void_p(outputs[value].ctypes.data)
            if value in plan.weight_offsets:
                base, offset = self._weights, plan.weight_offsets[value]
            else:
                base, offset = self._workspace, plan.workspace_offsets[value]
            return ctypes.c_void_p(base.ctypes.data + offset)

        calls = [
            (
                k["name"],
                self._library.function(k["symbol"]),
                [pointer(v) for v in k["inputs"] + k["outputs"]],
            )
            for k in plan.kernels
        ]
        samples: dict[str, list[float]] = {name: [] for name, _, _ in calls}
        if alone:
            for name, fn, args in calls:
                fn(*args)
                for _ in range(repeats):
                    started = time.perf_counter()
                    fn(*args)
                    samples[name].append(time.perf_counter() - started)
        else:
            for _ in range(repeats):
                for name, fn, args in calls:
                    started = time.perf_counter()
                    fn(*args)
                    samples[name].append(time.perf_counter() - started)
        return [(name, float(np.median(samples[name]))) for name, _, _ in calls]


DEVICES = ("cuda", "opencl")


def load(source, num_threads: int | None = None, device: str | None = None):
    """Load an archive given as a path, bytes, or an object with `to_bytes()`.

    A CPU archive runs here (`num_threads` threads). A `cuda` archive runs on an NVIDIA GPU
    through pycuda (`device="cuda"`, the default; NoCudaDeviceError where there is none), or
    as its OpenCL twin on any OpenCL device (`device="opencl"`: PoCL runs it on the CPU)."""
    if hasattr(source, "to_bytes"):
        source = source.to_bytes()
    members = read_members(source)
    kind = target_kind(json.loads(members["manifest.json"]))
    if kind == "llvm":
        if device not in (None, "cpu"):
            raise InputError(f"a CPU archive runs on the CPU, not on device {device!r}")
        return Module(members, num_threads)
    device = device or "cuda"
    if device not in DEVICES:
        raise InputError(f"unknown device {device!r} for a {kind} archive (one of {DEVICES})")
    from compiler_core.runtime.device import DeviceModule

    if device == "cuda":
        from compiler_core.runtime.cuda import CudaBackend

        return DeviceModule(members, CudaBackend())
    from compiler_core.runtime.opencl import OpenCLBackend

    return DeviceModule(members, OpenCLBackend())
