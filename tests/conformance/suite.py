"""The ONNX backend node test suite, run against `compiler_core.backend`.

The node test data is not in the onnx wheel: it is generated from the installed package's own
case definitions (`onnx.backend.test.case.node.collect_testcases`) into a cache folder, the way
`onnx/backend/test/cmd_tools.py` writes it (model.onnx + test_data_set_*/{input,output}_*.pb),
plus the case's tolerances. Each case is then run the way ONNX's runner does and classified as
passed, failed or not supported, or listed as out of scope with the reason.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import time
import traceback
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

CACHE_ROOT = Path(os.environ.get("KILN_CACHE", Path(__file__).resolve().parents[2] / ".cache"))

# What the report lists as out of scope, and why. Checked in this order.
OUT_OF_SCOPE_DOMAINS = {
    "ai.onnx.ml": "ai.onnx.ml (classical ML) operators",
    "ai.onnx.preview.training": "training operators",
}
TRAINING_OPS = {"Adagrad", "Adam", "Momentum", "Gradient"}
LOW_PRECISION_TYPES = {
    getattr(TensorProto, name)
    for name in (
        "FLOAT8E4M3FN",
        "FLOAT8E4M3FNUZ",
        "FLOAT8E5M2",
        "FLOAT8E5M2FNUZ",
        "FLOAT8E8M0",
        "INT4",
        "UINT4",
        "FLOAT4E2M1",
        "INT2",
        "UINT2",
    )
    if hasattr(TensorProto, name)
}
_EXPANDED = re.compile(r"_expanded(_|$)")
_TRAINING_NAME = re.compile(r"training")


def cache_dir() -> Path:
    return CACHE_ROOT / f"onnx-node-tests-{onnx.__version__}"


def generate(target: Path | None = None) -> Path:
    """Write every node test case once per onnx version; returns the folder."""
    from onnx.backend.test.case.node import collect_testcases

    target = target or cache_dir()
    marker = target / ".complete"
    if marker.exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    with np.errstate(all="ignore"):
        cases = collect_testcases()
    for case in cases:
        _write_case(target / case.name, case)
    marker.write_text(str(len(cases)))
    return target


def _write_case(folder: Path, case) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.onnx").write_bytes(case.model.SerializeToString())
    (folder / "data.json").write_text(json.dumps({"rtol": case.rtol, "atol": case.atol}))
    for i, (inputs, outputs) in enumerate(case.data_sets):
        data_dir = folder / f"test_data_set_{i}"
        data_dir.mkdir(exist_ok=True)
        for kind, values, infos in (
            ("input", inputs, case.model.graph.input),
            ("output", outputs, case.model.graph.output),
        ):
            for j, value in enumerate(values):
                proto = _to_proto(value, infos[j] if j < len(infos) else None)
                if proto is not None:
                    (data_dir / f"{kind}_{j}.pb").write_bytes(proto.SerializeToString())


def _to_proto(value, info):
    """Tensors only: sequence/optional/map values belong to out-of-scope cases."""
    if isinstance(value, TensorProto):
        return value
    if info is not None and not info.type.HasField("tensor_type"):
        return None
    if isinstance(value, np.ndarray) or np.isscalar(value):
        try:
            return numpy_helper.from_array(np.asarray(value), info.name if info else "")
        except (TypeError, ValueError):
            return None
    return None


def out_of_scope_reason(name: str, model: onnx.ModelProto) -> str | None:
    if _EXPANDED.search(name):
        return "function-expanded test (_expanded)"
    graph = model.graph
    for node in graph.node:
        if node.domain in OUT_OF_SCOPE_DOMAINS:
            return OUT_OF_SCOPE_DOMAINS[node.domain]
        if node.op_type in TRAINING_OPS:
            return "training operators"
    for value in list(graph.input) + list(graph.output):
        which = value.type.WhichOneof("value")
        if which in ("sequence_type", "map_type"):
            return "sequence/map values"
        if which == "optional_type":
            return "optional values"
        if which == "tensor_type":
            elem = value.type.tensor_type.elem_type
            if elem == TensorProto.STRING:
                return "string tensors"
            if elem in LOW_PRECISION_TYPES:
                return "float8/int4/int2/e8m0/float4 types"
    for node in graph.node:
        for attr in node.attribute:
            if attr.name == "to" and attr.i in LOW_PRECISION_TYPES:
                return "float8/int4/int2/e8m0/float4 types"
            if attr.name == "to" and attr.i == TensorProto.STRING:
                return "string tensors"
    if _TRAINING_NAME.search(name) and any(n.op_type == "Dropout" for n in graph.node):
        return "training mode"
    return None


def _load_data_set(folder: Path, kind: str) -> list[np.ndarray]:
    files = sorted(folder.glob(f"{kind}_*.pb"), key=lambda p: int(p.stem.split("_")[1]))
    arrays = []
    for path in files:
        tensor = TensorProto()
        tensor.ParseFromString(path.read_bytes())
        arrays.append(numpy_helper.to_array(tensor))
    return arrays


def _compare(expected: np.ndarray, actual: np.ndarray, rtol: float, atol: float) -> None:
    """ONNX's runner: same dtype; allclose for numbers (NaN == NaN), equality otherwise."""
    actual = np.asarray(actual)
    if expected.dtype != actual.dtype:
        raise AssertionError(f"dtype {actual.dtype}, expected {expected.dtype}")
    if expected.shape != actual.shape:
        raise AssertionError(f"shape {actual.shape}, expected {expected.shape}")
    if expected.dtype.name == "bfloat16":
        expected, actual = expected.astype(np.float32), actual.astype(np.float32)
    if expected.dtype.kind in "fc":
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)
    else:
        np.testing.assert_array_equal(actual, expected)


def run_case(folder: Path, engine: str = "reference") -> dict:
    """Run one case; returns {'status': passed|failed|not_supported|out_of_scope, 'reason'}."""
    import compiler_core.backend as backend
    from compiler_core.frontend.onnx import UnsupportedError

    model = onnx.load_model(str(folder / "model.onnx"))
    reason = out_of_scope_reason(folder.name, model)
    if reason is not None:
        return {"status": "out_of_scope", "reason": reason}
    tolerances = json.loads((folder / "data.json").read_text())
    try:
        rep = backend.prepare(model, "CPU", engine=engine)
        for data_dir in sorted(folder.glob("test_data_set_*")):
            inputs = _load_data_set(data_dir, "input")
            expected = _load_data_set(data_dir, "output")
            outputs = rep.run(inputs)
            for i, want in enumerate(expected):
                try:
                    _compare(want, outputs[i], tolerances["rtol"], tolerances["atol"])
                except AssertionError as err:
                    name = model.graph.output[i].name
                    raise AssertionError(f"output {name!r}: {_short(err)}") from None
    except UnsupportedError as err:
        return {"status": "not_supported", "reason": _short(err)}
    except AssertionError as err:
        return {"status": "failed", "reason": f"wrong result: {_short(err)}"}
    except Exception as err:  # noqa: BLE001 - every failure is recorded with its reason
        where = traceback.extract_tb(err.__traceback__)[-1]
        origin = f"{Path(where.filename).name}:{where.lineno}"
        return {"status": "failed", "reason": f"{type(err).__name__}: {_short(err)} ({origin})"}
    return {"status": "passed", "reason": ""}


def _short(err: Exception, limit: int = 400) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _run_named(args):
    root, name, engine = args
    start = time.perf_counter()
    result = run_case(Path(root) / name, engine)
    result["seconds"] = round(time.perf_counter() - start, 3)
    return name, result


def run_suite(workers: int = 2, pattern: str | None = None, engine: str = "reference") -> dict:
    """Run every generated case; returns the report (see `summarize`)."""
    root = generate()
    names = sorted(p.name for p in root.iterdir() if p.is_dir())
    if pattern:
        names = [n for n in names if re.search(pattern, n)]
    jobs = [(str(root), n, engine) for n in names]
    if workers > 1:
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(workers, maxtasksperchild=200) as pool:
            results = dict(pool.imap_unordered(_run_named, jobs, chunksize=8))
    else:
        results = dict(map(_run_named, jobs))
    report = summarize(results)
    report["engine"] = engine
    return report


def summarize(results: dict[str, dict]) -> dict:
    in_scope = {n: r for n, r in results.items() if r["status"] != "out_of_scope"}
    counts = {s: 0 for s in ("passed", "failed", "not_supported")}
    for r in in_scope.values():
        counts[r["status"]] += 1
    out_of_scope: dict[str, list[str]] = {}
    for name, r in sorted(results.items()):
        if r["status"] == "out_of_scope":
            out_of_scope.setdefault(r["reason"], []).append(name)
    total = len(in_scope)
    return {
        "onnx_version": onnx.__version__,
        "summary": {
            "in_scope": total,
            **counts,
            "out_of_scope": len(results) - total,
            "pass_rate": round(counts["passed"] / total, 4) if total else 0.0,
        },
        "out_of_scope_reasons": {k: len(v) for k, v in out_of_scope.items()},
        "out_of_scope": out_of_scope,
        "results": dict(sorted(results.items())),
    }


def write_report(report: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1, sort_keys=False))
    return path
