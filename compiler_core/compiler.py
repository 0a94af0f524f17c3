"""The one entry point: `compile(model, target, shapes) -> ModuleArchive`."""

from __future__ import annotations

import io
import json
import math
import os
import tempfile
import time
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from compiler_core.batching import (
    BucketedModel,
    bucket_shapes,
    build_buckets,
    check_buckets,
    with_symbolic_batch,
)
from compiler_core.build import CompiledModel, build_graph, describe_types, largest_scratch
from compiler_core.codegen.native import link_shared
from compiler_core.frontend.onnx import defaulted_shapes, import_model, load_model
from compiler_core.graph.ir import Graph
from compiler_core.passes.pipeline import optimize
from compiler_core.reference import run_graph
from compiler_core.runtime.module import load, random_inputs, sha256
from compiler_core.target import Target, TargetError, parse_target

COMPILER_VERSION = "0.1.0"
# An output agrees with the reference when its largest error is within VERIFY_RTOL of the
# output's scale (its largest finite magnitude) plus VERIFY_ATOL. Not element by element: a
# float32 sum of 1024 products is rounded differently in a blocked kernel and in numpy, and
# an output near zero then misses any per-element relative bound (a correct 1024^3 GEMM
# read 2e-4 off on outputs of magnitude up to 150 and failed `np.allclose(rtol=1e-4)`).
VERIFY_RTOL, VERIFY_ATOL = 1e-4, 1e-5


# Archive members carry a fixed timestamp: an archive is a pure function of its inputs, so the
# same model, target and options give byte-identical archives (and the same store digest).
ZIP_DATE_TIME = (1980, 1, 1, 0, 0, 0)


# Archive members kept uncompressed (float data, which deflate barely shrinks).
STORED_MEMBERS = frozenset({"weights.bin"})


class ModuleArchive:
    """A compiled model: its archive members, in memory. `compile_seconds` is reported beside
    the archive, not inside it, for the same reason as the fixed timestamps."""

    def __init__(self, members: dict[str, bytes], compile_seconds: float | None = None):
        self.members = members
        self.compile_seconds = compile_seconds

    @property
    def manifest(self) -> dict:
        return json.loads(self.members["manifest.json"])

    def to_bytes(self) -> bytes:
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
            # manifest first, then the members in the order they were made (deterministic)
            for name in ("manifest.json", *[n for n in self.members if n != "manifest.json"]):
                info = zipfile.ZipInfo(name, date_time=ZIP_DATE_TIME)
                # Weights are stored: deflate saved 7% of resnet18's 47 MB in 1.4 s, an eighth
                # of its whole compile (and the runtime inflated them again on every load).
                stored = name in STORED_MEMBERS
                info.compress_type = zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED
                info.external_attr = 0o644 << 16
                archive.writestr(info, self.members[name])
        return buffer.getvalue()

    def save(self, path: str | os.PathLike) -> Path:
        """Write atomically: the archive appears whole or not at all."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=".kiln-", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(self.to_bytes())
        os.replace(staging, path)
        return path


def _verification(archive: ModuleArchive, graph: Graph, device: str | None = None) -> dict:
    """Run the compiled module (on `device`) and the reference executor on the same random
    inputs."""
    feeds = random_inputs(graph.input_signature())
    actual = load(archive, device=device).run(feeds)
    expected = run_graph(graph, feeds)
    worst, ok = 0.0, True
    for name in graph.outputs:
        error, agrees = output_error(actual[name], expected[name])
        worst, ok = max(worst, error), ok and agrees
    return {
        "oracle": "reference executor",
        **({"device": f"{device} twin"} if device else {}),
        "max_abs_error": worst,
        "rtol": VERIFY_RTOL,
        "atol": VERIFY_ATOL,
        "passed": ok,
    }


def output_error(actual: np.ndarray, expected: np.ndarray) -> tuple[float, bool]:
    """(largest absolute error over the finite expected values, whether the output agrees):
    within VERIFY_RTOL of the output's scale plus VERIFY_ATOL, with NaN and infinities exactly
    where the reference has them."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    if a.shape != e.shape:
        return math.inf, False
    finite = np.isfinite(e)
    same_specials = np.array_equal(a[~finite], e[~finite], equal_nan=True)
    diff = np.abs(a[finite] - e[finite])
    error = float(np.max(np.where(np.isfinite(diff), diff, np.inf), initial=0.0))
    scale = float(np.max(np.abs(e[finite]), initial=0.0))
    return error, bool(same_specials and error <= VERIFY_RTOL * scale + VERIFY_ATOL)


def _plan_of(graph: Graph, kernels, memory, weight_offsets) -> dict:
    return {
        "inputs": describe_types(graph, graph.inputs),
        "outputs": describe_types(graph, graph.outputs),
        "workspace_bytes": memory.workspace_bytes,
        "kernels": [
            {"name": k.name, "symbol": k.symbol, "inputs": k.inputs, "outputs": k.outputs}
            for k in kernels
        ],
        "workspace_offsets": memory.offsets,
        "weight_offsets": weight_offsets,
    }


def _kernel_notes(graph: Graph, kernels, tuned: dict[str, dict]) -> dict:
    return {
        kernel.name: tuned.get(group.name, "default schedule")
        for kernel, group in zip(kernels, graph.groups, strict=True)
    }


def _scratch_fields(kernels, target: Target) -> dict:
    """The manifest's account of the memory a run takes beyond its planned workspace: the
    most scratch one kernel holds in a call (`largest_scratch`, its threads at the target's
    core count) and which kernel that is."""
    size, kernel = largest_scratch(kernels, target.cores)
    return {"kernel_scratch_bytes": size, **({"kernel_scratch_kernel": kernel} if size else {})}


def _prefetch_notes(kernels) -> dict:
    """Per kernel that prefetches later kernels' weights: which bytes of which value."""
    return {
        kernel.name: [
            {"value": p.value, "for": kernels[p.of].name, "start": p.start, "bytes": p.nbytes}
            for p in kernel.prefetches
        ]
        for kernel in kernels
        if kernel.prefetches
    }


def _archive_members(
    plan: dict, members: dict[str, bytes], target: Target, **manifest_fields
) -> dict[str, bytes]:
    """`members` plus the manifest that lists them (sha256 of each)."""
    members = dict(members)
    manifest = {
        "format": "kiln-module/1",
        **manifest_fields,
        "inputs": plan["inputs"],
        "outputs": plan["outputs"],
        "target": str(target),
        "target_fingerprint": target.fingerprint,
        "compiler_version": COMPILER_VERSION,
    }
    manifest["members"] = {name: sha256(data) for name, data in members.items()}
    members["manifest.json"] = json.dumps(manifest, indent=1).encode()
    return members


def _cpu_members(library: bytes, weights: bytes, plan: dict) -> dict[str, bytes]:
    return {
        "model.so": library,
        "weights.bin": weights,
        "plan.json": json.dumps(plan, indent=1).encode(),
    }


def _members(
    compiled: CompiledModel, library: bytes, model_sha: str, tuned: dict[str, dict]
) -> dict[str, bytes]:
    graph = compiled.graph
    plan = _plan_of(graph, compiled.kernels, compiled.memory, compiled.weights.offsets)
    return _archive_members(
        plan,
        _cpu_members(library, compiled.weights.blob, plan),
        compiled.target,
        model_sha256=model_sha,
        graph_key=graph.key,
        kernels=_kernel_notes(graph, compiled.kernels, tuned),
        weight_prefetches=_prefetch_notes(compiled.kernels),
        distinct_kernels=len({k.symbol for k in compiled.kernels}),
        memory={
            "workspace_bytes": compiled.memory.workspace_bytes,
            "naive_bytes": compiled.memory.naive_bytes,
            **_scratch_fields(compiled.kernels, compiled.target),
        },
    )


def _bucket_members(
    built: BucketedModel, library: bytes, model_sha: str, tuned: dict[int, dict]
) -> dict[str, bytes]:
    """One plan per bucket; the top-level signature is the largest bucket's (axis 0 of every
    input and output is the batch, any size up to it)."""
    buckets = [
        {
            "batch": p.batch,
            "entry": p.entry,
            **_plan_of(p.graph, p.kernels, p.memory, p.weight_offsets),
        }
        for p in built.plans
    ]
    largest = buckets[-1]
    plan = {
        "inputs": largest["inputs"],
        "outputs": largest["outputs"],
        "workspace_bytes": max(b["workspace_bytes"] for b in buckets),
        "batch_buckets": [b["batch"] for b in buckets],
        "buckets": buckets,
    }
    kernels = [k for p in built.plans for k in p.kernels]
    notes, prefetches = {}, {}
    for p in built.plans:
        notes.update(_kernel_notes(p.graph, p.kernels, tuned.get(p.batch, {})))
        prefetches.update(_prefetch_notes(p.kernels))
    return _archive_members(
        plan,
        _cpu_members(library, built.weights, plan),
        built.target,
        model_sha256=model_sha,
        graph_key=built.plans[-1].graph.key,
        batch_buckets=plan["batch_buckets"],
        kernels=notes,
        weight_prefetches=prefetches,
        distinct_kernels=len({k.symbol for k in kernels}),
        memory={
            "workspace_bytes": plan["workspace_bytes"],
            **_scratch_fields(kernels, built.target),
        },
    )


def _model_bytes(model) -> bytes:
    if isinstance(model, (bytes, bytearray)):
        return bytes(model)
    if hasattr(model, "SerializeToString"):
        return model.SerializeToString()
    return Path(model).read_bytes()


def compile_graph(
    graph: Graph,
    target: Target,
    model_sha: str = "",
    verify: bool = True,
    tuning=None,
    configs: dict[str, dict] | None = None,
) -> ModuleArchive:
    """Build `graph` for `target`; `tuning` (a log path, `redis://` URL or TuningLog) supplies
    the best measured schedule of every task it has records for, or `configs` ({workload key:
    config}, no log) the schedule of each task it names. Tasks neither names take defaults."""
    if tuning is not None and configs is not None:
        raise ValueError("compile_graph takes a tuning log or explicit configs, not both")
    if target.is_gpu:
        return compile_gpu_graph(graph, target, model_sha, verify, tuning)
    started = time.perf_counter()
    schedules, tuned, choices = None, {}, None
    if tuning is not None:
        from compiler_core.autotune.apply import tuned_schedules

        schedules, tuned, choices = tuned_schedules(graph, target, tuning)
    elif configs is not None:
        from compiler_core.autotune.apply import configured_schedules

        schedules, tuned, choices = configured_schedules(graph, target, configs)
    compiled = build_graph(graph, target, schedules, choices)
    with tempfile.TemporaryDirectory(prefix="kiln-build-") as tmp:
        library = link_shared(compiled.objects, Path(tmp) / "model.so").read_bytes()
    compiled.compile_seconds = time.perf_counter() - started
    archive = ModuleArchive(_members(compiled, library, model_sha, tuned), compiled.compile_seconds)
    if verify:
        return attach_verification(archive, graph)
    return _with_manifest(archive, verification={"oracle": None, "passed": None})


def compile_gpu_graph(
    graph: Graph, target: Target, model_sha: str = "", verify: bool = True, tuning=None
) -> ModuleArchive:
    """A cuda archive. Verified through its OpenCL twin where an OpenCL device is present (no
    GPU is needed: the twin runs the same kernels, PoCL on the CPU)."""
    from compiler_core.gpu import archive as gpu_archive
    from compiler_core.gpu.build import build_gpu_graph

    started = time.perf_counter()
    schedules, tuned = None, {}
    if tuning is not None:
        from compiler_core.autotune.apply import tuned_schedules

        schedules, tuned, _ = tuned_schedules(graph, target, tuning)  # one algorithm each
    model = build_gpu_graph(graph, target, schedules)
    members = gpu_archive.members_of(model)
    plan = json.loads(members["plan.json"])
    seconds = time.perf_counter() - started
    members = _archive_members(
        plan,
        members,
        target,
        model_sha256=model_sha,
        graph_key=graph.key,
        **gpu_archive.manifest_fields(model, tuned),
    )
    archive = ModuleArchive(members, seconds)
    if not verify:
        return _with_manifest(archive, verification={"oracle": None, "passed": None})
    return attach_verification(archive, graph)


def attach_verification(archive: ModuleArchive, graph: Graph) -> ModuleArchive:
    """Run the archive against the reference executor and record the result in its manifest.
    A GPU archive runs as its OpenCL twin (no GPU needed); where no OpenCL device exists
    either, the manifest says verification was skipped and why (`passed` is None)."""
    if not archive.manifest["target"].startswith("cuda"):
        return _with_manifest(archive, verification=_verification(archive, graph))
    from compiler_core.runtime.opencl import opencl_available

    available, why = opencl_available()
    if not available:
        skipped = {"oracle": None, "passed": None, "skipped": f"no OpenCL device ({why})"}
        return _with_manifest(archive, verification=skipped)
    return _with_manifest(archive, verification=_verification(archive, graph, device="opencl"))


def _with_manifest(archive: ModuleArchive, **fields) -> ModuleArchive:
    manifest = {**archive.manifest, **fields}
    members = {**archive.members, "manifest.json": json.dumps(manifest, indent=1).encode()}
    return ModuleArchive(members, archive.compile_seconds)


def compile(  # noqa: A001 - the documented entry point's name
    model,
    target: str | Target = "llvm",
    shapes: Mapping[str, Sequence[int]] | None = None,
    tuning=None,
    batch_buckets: Sequence[int] | None = None,
) -> ModuleArchive:
    """Compile an ONNX model (path, bytes or ModelProto) to a native module archive, with the
    best schedules of the tuning log `tuning` (a path, a `redis://` URL or a TuningLog).

    With `batch_buckets` (e.g. [1, 2, 4, 8, 16]) the archive holds one plan per batch size
    and runs any batch up to the largest (`compiler_core.batching`)."""
    target = parse_target(target) if isinstance(target, str) else target
    if batch_buckets is not None and target.is_gpu:
        raise TargetError(f"{target}: batch buckets are built for CPU targets only")
    if batch_buckets is not None:
        return compile_buckets(model, target, shapes, batch_buckets, tuning)
    graph = optimize(import_model(model, shapes=shapes), target=target)
    archive = compile_graph(graph, target, sha256(_model_bytes(model)), tuning=tuning)
    defaulted = defaulted_shapes(load_model(model), shapes)
    return _with_manifest(archive, defaulted_shapes=defaulted) if defaulted else archive


def compile_buckets(
    model,
    target: Target,
    shapes: Mapping[str, Sequence[int]] | None,
    batch_buckets: Sequence[int],
    tuning=None,
) -> ModuleArchive:
    """One archive, one plan per batch bucket; every bucket is verified against the
    reference executor at its own batch."""
    started = time.perf_counter()
    buckets = check_buckets(batch_buckets)
    proto = with_symbolic_batch(load_model(model))
    graphs = {
        batch: optimize(
            import_model(proto, shapes=bucket_shapes(proto, shapes, batch)), target=target
        )
        for batch in buckets
    }
    schedules, tuned, choices = {}, {}, {}
    if tuning is not None:
        from compiler_core.autotune.apply import tuned_schedules

        for batch, graph in graphs.items():
            schedules[batch], tuned[batch], choices[batch] = tuned_schedules(graph, target, tuning)
    built = build_buckets(graphs, target, schedules, choices)
    with tempfile.TemporaryDirectory(prefix="kiln-build-") as tmp:
        library = link_shared(built.objects, Path(tmp) / "model.so").read_bytes()
    seconds = time.perf_counter() - started
    members = _bucket_members(built, library, sha256(_model_bytes(model)), tuned)
    archive = ModuleArchive(members, seconds)
    checks = [_verification(archive, graph) for graph in graphs.values()]
    verification = {
        **max(checks, key=lambda c: c["max_abs_error"]),
        "passed": all(c["passed"] for c in checks),
        "batches": list(buckets),
    }
    return _with_manifest(archive, verification=verification)
