"""Compiled modules end to end: native output against ONNX Runtime and the reference executor;
archives that are tampered with or truncated are refused; bad inputs get clear errors."""

from __future__ import annotations

import io
import json
import zipfile

import numpy as np
import onnxruntime as ort
import pytest

import compiler_core
from compiler_core.runtime import ArchiveError, InputError, load
from tests.conftest import shared_model


@pytest.fixture(scope="module")
def mlp_archive():
    return compiler_core.compile(str(shared_model("mlp")), shapes={"x": [4, 784]})


def ort_run(path, feeds):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


@pytest.fixture(scope="module")
def shared_archive():
    """The shared models' archives, each compiled once for this module's tests (resnet18's
    compile is the longest in the suite)."""
    archives = {}

    def archive(name: str):
        if name not in archives:
            shapes = {"x": [2, 784]} if name == "mlp" else None
            archives[name] = compiler_core.compile(str(shared_model(name)), shapes=shapes)
        return archives[name]

    return archive


@pytest.mark.parametrize("name", ["mlp", "encoder4", "resnet18", "mobilenet_v2"])
def test_native_module_matches_onnxruntime(name, tmp_path, shared_archive):
    archive = shared_archive(name)
    assert archive.manifest["verification"]["passed"]
    module = load(archive.save(tmp_path / f"{name}.kiln"))
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal(s).astype(d) for n, s, d in module.inputs}
    outputs = module.run(feeds)
    for (out_name, _, _), expected in zip(
        module.outputs, ort_run(shared_model(name), feeds), strict=True
    ):
        np.testing.assert_allclose(outputs[out_name], expected, rtol=1e-4, atol=1e-5)


def test_outputs_a_caller_keeps_are_never_reused_and_freed_ones_are(mlp_archive):
    """Outputs come from the module's arena: a freed output's block serves a later run (no
    fresh pages to fault in), one the caller holds (or a view of it) is never written."""
    module = load(mlp_archive)
    rng = np.random.default_rng(2)
    first, second = (rng.standard_normal((4, 784)).astype(np.float32) for _ in range(2))
    kept = module.run({"x": first})["probs"]
    expected = kept.copy()
    view = module.run({"x": second})["probs"][1:]  # the array goes, its view keeps the block
    again = module.run({"x": second})["probs"]
    np.testing.assert_array_equal(kept, expected)
    np.testing.assert_array_equal(again[1:], view)
    assert len({kept.ctypes.data, view.base.__array_interface__["data"][0], again.ctypes.data}) == 3
    address = again.ctypes.data
    del again
    reused = module.run({"x": first})["probs"]
    assert reused.ctypes.data == address and reused.ctypes.data % 64 == 0
    np.testing.assert_array_equal(reused, expected)


def test_inputs_in_any_array_form_give_the_same_outputs(mlp_archive):
    """A contiguous writable array is passed where it lies; a read-only one, a strided view
    and a Fortran-ordered copy are taken too (copied where they must be), with the same
    result."""
    module = load(mlp_archive)
    x = np.random.default_rng(3).standard_normal((4, 784)).astype(np.float32)
    expected = module.run({"x": x})["probs"].copy()
    frozen = x.copy()
    frozen.setflags(write=False)
    strided = np.repeat(x, 2, axis=1)[:, ::2]
    assert not strided.flags.c_contiguous
    for form in (frozen, strided, np.asfortranarray(x)):
        np.testing.assert_array_equal(module.run({"x": form})["probs"], expected)


def test_manifest_records_members_plan_and_verification(mlp_archive):
    manifest = mlp_archive.manifest
    assert set(manifest["members"]) == {"model.so", "weights.bin", "plan.json"}
    assert manifest["inputs"] == [{"name": "x", "shape": [4, 784], "dtype": "float32"}]
    assert manifest["memory"]["workspace_bytes"] <= manifest["memory"]["naive_bytes"]
    assert manifest["verification"]["max_abs_error"] < 1e-5


def test_archive_round_trips_through_bytes(mlp_archive):
    x = np.random.default_rng(0).standard_normal((4, 784)).astype(np.float32)
    a = load(mlp_archive).run({"x": x})["probs"]
    b = load(mlp_archive.to_bytes()).run({"x": x})["probs"]
    np.testing.assert_array_equal(a, b)


def test_profile_times_every_kernel_over_the_run_buffers(mlp_archive):
    module = load(mlp_archive)
    x = np.random.default_rng(2).standard_normal((4, 784)).astype(np.float32)
    rows = module.profile({"x": x}, repeats=3)
    plan = json.loads(zipfile.ZipFile(io.BytesIO(mlp_archive.to_bytes())).read("plan.json"))
    assert [name for name, _ in rows] == [k["name"] for k in plan["kernels"]]
    assert all(seconds > 0 for _, seconds in rows)
    alone = module.profile({"x": x}, repeats=3, alone=True)  # each kernel repeated in a row
    assert [name for name, _ in alone] == [name for name, _ in rows]
    assert all(seconds > 0 for _, seconds in alone)
    # Profiling calls the same kernels on the same workspace: a later run is unaffected.
    np.testing.assert_array_equal(
        module.run({"x": x})["probs"], load(mlp_archive).run({"x": x})["probs"]
    )
    with pytest.raises(InputError):
        module.profile({"x": x[:1]})


def test_identical_kernels_share_one_function(shared_archive):
    archive = shared_archive("resnet18")
    plan = json.loads(zipfile.ZipFile(io.BytesIO(archive.to_bytes())).read("plan.json"))
    symbols = [k["symbol"] for k in plan["kernels"]]
    assert len(set(symbols)) == archive.manifest["distinct_kernels"] < len(symbols)
    assert archive.manifest["verification"]["passed"]


def _rewrite_member(data: bytes, name: str, content: bytes) -> bytes:
    source = zipfile.ZipFile(io.BytesIO(data))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as target:
        for item in source.namelist():
            target.writestr(item, content if item == name else source.read(item))
    return buffer.getvalue()


def test_tampered_archive_is_refused(mlp_archive):
    data = mlp_archive.to_bytes()
    weights = zipfile.ZipFile(io.BytesIO(data)).read("weights.bin")
    tampered = _rewrite_member(data, "weights.bin", b"\x01" + weights[1:])
    with pytest.raises(ArchiveError, match="weights.bin.*sha256"):
        load(tampered)


def test_truncated_archive_is_refused(mlp_archive):
    data = mlp_archive.to_bytes()
    with pytest.raises(ArchiveError, match="truncated or corrupt|lacks"):
        load(data[: len(data) // 2])


def test_archive_missing_a_member_is_refused(mlp_archive):
    source = zipfile.ZipFile(io.BytesIO(mlp_archive.to_bytes()))
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as target:
        for item in source.namelist():
            if item != "plan.json":
                target.writestr(item, source.read(item))
    with pytest.raises(ArchiveError, match="plan.json"):
        load(buffer.getvalue())


def test_manifest_edit_is_caught_by_member_hashes(mlp_archive):
    data = mlp_archive.to_bytes()
    manifest = json.loads(zipfile.ZipFile(io.BytesIO(data)).read("manifest.json"))
    manifest["members"]["model.so"] = "0" * 64
    with pytest.raises(ArchiveError, match="model.so"):
        load(_rewrite_member(data, "manifest.json", json.dumps(manifest).encode()))


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({"y": np.zeros((4, 784), np.float32)}, "missing \\['x'\\], unknown \\['y'\\]"),
        ({}, "missing \\['x'\\], unknown \\[\\]"),
        (
            {"x": np.zeros((4, 784), np.float32), "y": np.zeros(1, np.float32)},
            "missing \\[\\], unknown \\['y'\\]",
        ),
        ({"x": np.zeros((3, 784), np.float32)}, "float32\\[3, 784\\].*float32\\[4, 784\\]"),
        ({"x": np.zeros((4, 784), np.float64)}, "float64"),
    ],
)
def test_bad_inputs_are_refused(mlp_archive, inputs, message):
    module = load(mlp_archive)
    with pytest.raises(InputError, match=message):
        module.run(inputs)


def test_runtime_imports_nothing_else_from_the_compiler():
    import subprocess
    import sys

    code = (
        "import sys, compiler_core.runtime;"
        "bad=[m for m in sys.modules if m.startswith('compiler_core.') and "
        "not m.startswith('compiler_core.runtime') and m != 'compiler_core.errors'] + "
        "[m for m in ('llvmlite', 'lightgbm', 'onnx') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def mapping_flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        lines = smaps.read().splitlines()
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(
    not hasattr(__import__("mmap"), "MADV_HUGEPAGE"), reason="no transparent huge pages here"
)
def test_weights_ask_for_huge_pages_and_still_compute_right(mlp_archive):
    """A module's weights (7 MB here; a workspace of 1 MB or more too) sit in a mapping
    advised for huge pages (`hg`), from a 2 MB boundary, so that a run's page walks do not
    grow with the model."""
    from compiler_core.runtime import module as runtime_module

    module = load(mlp_archive)
    weights = module._weights.ctypes.data
    assert weights % runtime_module.HUGE_PAGE_BYTES == 0
    assert "hg" in mapping_flags(weights)
    x = np.random.default_rng(0).standard_normal((4, 784)).astype(np.float32)
    (expected,) = ort_run(shared_model("mlp"), {"x": x})
    ((name, _, _),) = module.outputs
    np.testing.assert_allclose(module.run({"x": x})[name], expected, rtol=1e-4, atol=1e-5)
