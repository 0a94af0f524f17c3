"""The cache kernels take their workspace blocks from (codegen/kiln_workspace.c): a kernel's
workspace is not faulted in from fresh pages on every call, a freed block serves the next
request it covers (the smallest that does), the cache keeps a bounded number of blocks, and
every library of a process shares the first one's cache. What a kernel takes is counted at
build time (`build.scratch_bytes`) and reported in the manifest and by `kiln compile`."""

from __future__ import annotations

import ctypes
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from onnx import helper

import compiler_core
from compiler_core import cli, te
from compiler_core.build import build_kernels, scratch_bytes
from compiler_core.codegen.llvm import build_module
from compiler_core.codegen.native import WORKSPACE_SOURCE, compiler_driver, emit_object, link_shared
from compiler_core.frontend.onnx import import_model
from compiler_core.loop.ir import (
    INDEX,
    Allocate,
    Block,
    Buffer,
    Const,
    For,
    ForKind,
    IfThenElse,
    Store,
    Var,
)
from compiler_core.passes.pipeline import optimize
from compiler_core.schedule.primitives import Parallel, apply
from compiler_core.target import host_target
from tests.conftest import FLOAT, make_model

KB = 1024
KEPT_BLOCKS = 8  # kiln_workspace.c's KILN_KEPT_BLOCKS

ROWS, COLS = 56, 4096


def staged_kernel():
    """Three intermediate stages of 0.9, 1.8 and 1.8 MB (a Winograd conv's padded input,
    transformed input and products at 56x56 are of these sizes), each a workspace buffer."""
    a = te.placeholder((ROWS, COLS), "float32", "a")
    b = te.compute((ROWS, COLS), lambda i, j: a[i, j] * 2.0, "b")
    d = te.compute((2 * ROWS, COLS), lambda i, j: b[i // 2, j] + 1.0, "d")
    e = te.compute((2 * ROWS, COLS), lambda i, j: d[i, j] * 3.0, "e")
    out = te.compute((ROWS, COLS), lambda i, j: e[2 * i, j] + d[2 * i + 1, COLS - 1 - j], "out")
    func = te.lower([a], [out], "staged")
    return apply(func, [Parallel("d_i0"), Parallel("e_i0"), Parallel("out_i0")])


FAULTS_SCRIPT = """
import json, resource, sys
import numpy as np
from compiler_core.runtime.library import KernelLibrary
libraries = [KernelLibrary(path) for path in sys.argv[1:]]
x = np.random.default_rng(0).standard_normal((56, 4096)).astype(np.float32)
expected = None
faults = []
for library in [libraries[0]] * 12 + libraries[1:]:
    out = np.zeros_like(x)  # a fresh output per call, as the tuning runner allocates
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    library.call("staged", [x, out])
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    expected = out if expected is None else expected
    assert np.array_equal(out, expected)
print(json.dumps(faults))
"""


def page_faults(paths: list) -> list[int]:
    """Page faults of each call in a fresh process: the first library's kernel 12 times,
    then each other library's once."""
    result = subprocess.run(
        [sys.executable, "-c", FAULTS_SCRIPT, *map(str, paths)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


OUTPUT_PAGES = ROWS * COLS * 4 // 4096
WORKSPACE_PAGES = 5 * ROWS * COLS * 4 // 4096


def test_a_kernels_workspace_is_not_faulted_in_again_on_every_call(tmp_path):
    """In a fresh process (the tuning runner is one) whose caller allocates between calls,
    blocks freed to malloc went back to the OS after every call: each call faulted its 4.5 MB
    of workspace in again, about 860 pages (ResNet-18's first Winograd conv ran 4x slower in
    the runner than in a process whose heap held the memory). From the cache, no page is
    faulted again after the first call but the output's."""
    target = host_target()
    obj = emit_object(build_module([staged_kernel()], target), target)
    faults = page_faults([link_shared([obj], tmp_path / "staged.so")])
    assert faults[0] >= WORKSPACE_PAGES // 2  # the first call maps the blocks
    assert max(faults[2:]) <= OUTPUT_PAGES, faults


def test_a_library_loaded_later_takes_its_workspace_from_the_first_ones_cache(tmp_path):
    """One cache per process (a tuning runner loads hundreds of libraries): the blocks the
    first library's kernel freed serve the second library's first call."""
    target = host_target()
    obj = emit_object(build_module([staged_kernel()], target), target)
    paths = [link_shared([obj], tmp_path / f"staged{k}.so") for k in range(2)]
    faults = page_faults(paths)
    assert faults[-1] <= OUTPUT_PAGES, faults


def test_the_scratch_the_build_counts_is_what_the_first_call_maps(tmp_path):
    """The staged kernel's three stages are live together: 0.9 + 1.8 + 1.8 MB, counted from
    its loop program, and the pages its first call in a fresh process faults in (beside,
    at most, its output's: what malloc hands the caller may be mapped already)."""
    func = staged_kernel()
    scratch = scratch_bytes(func.body, threads=2)
    assert scratch == 5 * ROWS * COLS * 4
    target = host_target()
    obj = emit_object(build_module([func], target), target)
    (first, *_) = page_faults([link_shared([obj], tmp_path / "staged.so")])
    pages = scratch // 4096
    assert pages <= first <= pages + OUTPUT_PAGES + 64, (first, pages)


CACHED_SCRIPT = """
import sys
import numpy as np
from compiler_core.runtime.library import KernelLibrary, workspace_cached_bytes
unloaded = workspace_cached_bytes()
library = KernelLibrary(sys.argv[1])
loaded = workspace_cached_bytes()
x = np.ones((56, 4096), np.float32)
library.call("staged", [x, np.zeros_like(x)])
print(unloaded, loaded, workspace_cached_bytes())
"""


def test_the_process_reports_the_blocks_its_cache_keeps_after_a_call(tmp_path):
    """What the runtime server's kiln_runtime_workspace_cached_bytes reads: no count before
    a library is loaded, nothing before a kernel ran, the staged kernel's three blocks (all
    it took) after its call."""
    func = staged_kernel()
    target = host_target()
    obj = emit_object(build_module([func], target), target)
    path = link_shared([obj], tmp_path / "staged.so")
    result = subprocess.run(
        [sys.executable, "-c", CACHED_SCRIPT, str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    unloaded, loaded, after = result.stdout.split()
    assert (unloaded, loaded) == ("None", "0")
    assert int(after) == scratch_bytes(func.body, threads=2)


def _block(name: str, floats: int, scope: str = "workspace") -> Allocate:
    buffer = Buffer(name, (floats,), "float32", scope)
    return Allocate(buffer, Store(buffer, (Const(0, INDEX),), Const(0.0, "float32")))


def test_scratch_adds_nested_blocks_takes_the_larger_of_siblings_and_one_per_thread():
    small, large = _block("small", 100), _block("large", 300)
    nested = Allocate(Buffer("outer", (50,), "float32", "workspace"), large)
    assert scratch_bytes(Block((small, large)), threads=2) == 1200
    assert scratch_bytes(nested, threads=2) == 1400
    assert scratch_bytes(IfThenElse(Var("c", INDEX) < 1, small, nested), threads=2) == 1400
    assert scratch_bytes(_block("stack", 1000, "local"), threads=2) == 0

    def loop(kind, extent):
        return For(Var("i", INDEX), extent, small, kind)

    assert scratch_bytes(loop(ForKind.SERIAL, 8), threads=2) == 400
    assert scratch_bytes(loop(ForKind.PARALLEL, 8), threads=2) == 800  # one block a thread
    assert scratch_bytes(loop(ForKind.PARALLEL, 8), threads=16) == 3200  # one an iteration


def winograd_conv_model():
    """A 64-channel 3x3 conv at 56x56 (Winograd by default: transformed tiles and products
    in blocks of the kernel's own) followed by a Relu."""
    weights = np.random.default_rng(0).standard_normal((64, 64, 3, 3)).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["y"]),
    ]
    return make_model(
        nodes, [("x", FLOAT, [1, 64, 56, 56])], [("y", FLOAT, [1, 64, 56, 56])], {"w": weights}
    )


def test_the_manifest_and_kiln_compile_report_the_largest_kernel_scratch(tmp_path, capsys):
    model = winograd_conv_model()
    path = tmp_path / "conv.onnx"
    path.write_bytes(model.SerializeToString())
    target = host_target()
    kernels = build_kernels(optimize(import_model(str(path))), target)
    largest = max(kernels, key=lambda k: scratch_bytes(k.func.body, target.cores))
    expected = scratch_bytes(largest.func.body, target.cores)
    assert expected > 0
    memory = compiler_core.compile(str(path)).manifest["memory"]
    assert memory["kernel_scratch_bytes"] == expected
    assert memory["kernel_scratch_kernel"] == largest.name
    assert cli.main(["compile", str(path), "-o", str(tmp_path / "conv.kiln")]) == 0
    said = capsys.readouterr().out
    assert f"kernel scratch: up to {expected} bytes in one call ({largest.name})" in said


def test_a_model_whose_kernels_take_no_blocks_reports_none(tmp_path, capsys):
    nodes = [helper.make_node("Relu", ["x"], ["y"])]
    model = make_model(nodes, [("x", FLOAT, [4, 1024])], [("y", FLOAT, [4, 1024])])
    path = tmp_path / "relu.onnx"
    path.write_bytes(model.SerializeToString())
    memory = compiler_core.compile(str(path)).manifest["memory"]
    assert memory["kernel_scratch_bytes"] == 0 and "kernel_scratch_kernel" not in memory
    assert cli.main(["compile", str(path), "-o", str(tmp_path / "relu.kiln")]) == 0
    assert "kernel scratch" not in capsys.readouterr().out


@pytest.fixture(scope="module")
def cache_source(tmp_path_factory):
    """kiln_workspace.c built with its hidden functions exported."""
    out = tmp_path_factory.mktemp("workspace") / "cache.so"
    command = [compiler_driver(), "-O2", "-fPIC", "-pthread", "-shared", "-DHIDDEN="]
    subprocess.run([*command, str(WORKSPACE_SOURCE), "-o", str(out)], check=True)
    return out


@pytest.fixture
def caches(cache_source, tmp_path):
    """Two fresh caches, each a copy of that library loaded with ctypes (not KernelLibrary:
    the process's shared cache stays out of it), so no test sees another's blocks."""
    libraries = []
    for k in range(2):
        path = tmp_path / f"cache{k}.so"
        shutil.copyfile(cache_source, path)
        library = ctypes.CDLL(str(path))
        for name in ("kiln_workspace_alloc", "kiln_workspace_take"):
            getattr(library, name).restype = ctypes.c_void_p
            getattr(library, name).argtypes = [ctypes.c_int64]
        for name in ("kiln_workspace_free", "kiln_workspace_give"):
            getattr(library, name).argtypes = [ctypes.c_void_p]
        library.kiln_workspace_share.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        libraries.append(library)
    return libraries


def drain(cache, sizes):
    """Take blocks of `sizes` (emptying the cache of what covers them) and free them all."""
    blocks = [cache.kiln_workspace_alloc(size) for size in sizes]
    for block in blocks:
        cache.kiln_workspace_free(block)
    return blocks


def test_a_freed_block_serves_the_next_request_it_covers_the_smallest_first(caches):
    cache = caches[0]
    small, large = drain(cache, [300 * KB, 900 * KB])
    assert cache.kiln_workspace_alloc(250 * KB) == small  # both cover it: the smaller
    assert cache.kiln_workspace_alloc(250 * KB) == large  # then the one left
    cache.kiln_workspace_free(small)
    cache.kiln_workspace_free(large)
    assert cache.kiln_workspace_alloc(600 * KB) == large  # only the larger covers it
    cache.kiln_workspace_free(large)


def test_blocks_start_on_a_cache_line(caches):
    cache = caches[0]
    blocks = [cache.kiln_workspace_alloc(size) for size in (1, 100, 70 * KB, 3 * 1024 * KB)]
    assert all(block % 64 == 0 for block in blocks)
    for block in blocks:
        cache.kiln_workspace_free(block)


def test_the_cache_keeps_the_largest_blocks_it_was_given_and_no_more(caches):
    """Of KEPT_BLOCKS + 1 blocks freed, the smallest is given back to malloc: a request of
    its size is served by the next smallest kept block."""
    cache = caches[0]
    sizes = [(k + 2) * 100 * KB for k in range(KEPT_BLOCKS + 1)]
    blocks = drain(cache, sizes)
    assert cache.kiln_workspace_alloc(sizes[0]) == blocks[1]
    cache.kiln_workspace_free(blocks[1])


def test_a_library_pointed_at_another_ones_cache_takes_and_gives_its_blocks_there(caches):
    host, guest = caches
    guest.kiln_workspace_share(
        ctypes.cast(host.kiln_workspace_alloc, ctypes.c_void_p),
        ctypes.cast(host.kiln_workspace_free, ctypes.c_void_p),
    )
    block = guest.kiln_workspace_take(2 * 1024 * KB)
    guest.kiln_workspace_give(block)
    assert host.kiln_workspace_alloc(2 * 1024 * KB) == block  # kept by the host's cache
    host.kiln_workspace_free(block)
