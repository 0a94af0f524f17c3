"""The issue's acceptance on a GPU-less machine: every kernel of the four shared models
compiled for sm_80 and sm_90 assembles with ptxas, and each model's OpenCL twin (the same
kernels, run on PoCL) matches ONNX Runtime within rtol 1e-4 of the output's scale."""

from __future__ import annotations

import io
import subprocess
import zipfile

import numpy as np
import onnxruntime as ort
import pytest

import compiler_core
from compiler_core.codegen import nvptx
from compiler_core.frontend.onnx import import_model
from compiler_core.gpu.build import build_gpu_graph
from compiler_core.passes.pipeline import optimize
from compiler_core.runtime import load
from compiler_core.runtime.opencl import opencl_available
from compiler_core.target import parse_target
from tests.conftest import SHARED_MODELS, assert_close_to_scale, random_feeds, shared_model

SHAPES = {"mlp": {"x": [1, 784]}}
needs_ptxas = pytest.mark.skipif(not nvptx.ptxas_available(), reason="ptxas is not installed")
needs_opencl = pytest.mark.skipif(
    not opencl_available()[0], reason=f"no OpenCL device: {opencl_available()[1]}"
)


@needs_ptxas
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
@pytest.mark.parametrize("name", SHARED_MODELS)
def test_every_kernel_assembles_with_ptxas(name, arch):
    target = parse_target(f"cuda -arch={arch}")
    graph = optimize(import_model(shared_model(name), shapes=SHAPES.get(name)), target=target)
    model = build_gpu_graph(graph, target)
    ptx = nvptx.emit_ptx(model.functions, arch)
    assert ptx.count(".entry") == len(model.functions) + 1  # and the runtime's L2 prefetch
    assert f".entry {nvptx.PREFETCH_KERNEL}(" in ptx
    cubin = nvptx.assemble(ptx, arch)  # raises with ptxas's message on any rejection
    assert cubin
    assert {launch.kernel for launch in model.launches} == {f.name for f in model.functions}


@needs_opencl
@pytest.mark.parametrize("name", SHARED_MODELS)
def test_opencl_twin_matches_onnxruntime(name):
    path = shared_model(name)
    archive = compiler_core.compile(str(path), target="cuda -arch=sm_90", shapes=SHAPES.get(name))
    check = archive.manifest["verification"]
    assert check["passed"] is True and check["device"] == "opencl twin", check
    members = zipfile.ZipFile(io.BytesIO(archive.to_bytes())).namelist()
    assert {"model.ptx", "kernels.cl", "weights.bin", "plan.json"} <= set(members)
    module = load(archive, device="opencl")
    feeds = random_feeds(module.inputs, seed=1)
    ours = module.run(feeds)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    theirs = dict(zip(names, session.run(None, feeds), strict=True))
    for key, value in theirs.items():
        assert_close_to_scale(ours[key], value, 1e-4, f"{name}:{key}")
    # a second run over the same device buffers gives the same answer
    again = module.run(feeds)
    for key in ours:
        np.testing.assert_array_equal(again[key], ours[key])


@needs_ptxas
def test_cubin_member_is_what_ptxas_makes():
    archive = compiler_core.compile(
        str(shared_model("mlp")), target="cuda -arch=sm_80", shapes=SHAPES["mlp"]
    )
    members = zipfile.ZipFile(io.BytesIO(archive.to_bytes()))
    assert members.read("model.cubin")[:4] == b"\x7fELF"
    assert archive.manifest["target"] == "cuda -arch=sm_80"
    version = subprocess.run(["ptxas", "--version"], capture_output=True, text=True).stdout
    assert "Cuda compilation tools" in version
