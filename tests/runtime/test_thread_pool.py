"""Kiln's thread pool (codegen/kiln_pool.c), which every kernel library links: parallel loops
compute the same values at any thread count, from several Python threads at once, and in a
forked child; the libraries no longer need OpenMP's runtime; each thread claims its own home
range of a loop first, and every iteration is claimed exactly once."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from compiler_core import te
from compiler_core.codegen.llvm import build_module
from compiler_core.codegen.native import POOL_SOURCE, compiler_driver, emit_object, link_shared
from compiler_core.loop import interpreter
from compiler_core.loop.ir import Unary
from compiler_core.runtime.library import KernelLibrary, default_threads, set_num_threads
from compiler_core.schedule.primitives import Parallel, Vectorize, apply
from compiler_core.target import host_target

ROWS, COLS = 257, 48  # an odd row count: the last chunk is short


def parallel_kernel():
    x = te.placeholder((ROWS, COLS), "float32", "x")
    out = te.compute((ROWS, COLS), lambda i, j: Unary("tanh", x[i, j]) * 3.0 + x[i, j], "out")
    func = te.lower([x], [out], "rows")
    return apply(func, [Parallel("out_i0"), Vectorize("out_i1")])


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    target = host_target()
    obj = emit_object(build_module([parallel_kernel()], target), target)
    path = link_shared([obj], tmp_path_factory.mktemp("pool") / "pool.so")
    yield KernelLibrary(path)
    set_num_threads(default_threads())


def inputs(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((ROWS, COLS)).astype(np.float32)


def expected(x: np.ndarray) -> np.ndarray:
    args = {"x": x.copy(), "out": np.zeros_like(x)}
    interpreter.run(parallel_kernel(), args)
    return args["out"]


def run(library: KernelLibrary, x: np.ndarray) -> np.ndarray:
    out = np.zeros_like(x)
    library.call("rows", [x, out])
    return out


def test_the_library_links_no_openmp_runtime(library):
    dynamic = subprocess.run(
        ["readelf", "-d", str(library.path)], capture_output=True, text=True, check=True
    ).stdout
    assert "NEEDED" in dynamic and "gomp" not in dynamic


@pytest.mark.parametrize("threads", [1, 2, 3, 8])
def test_any_thread_count_computes_the_same_values(library, threads):
    """More threads than cores included: a worker the OS runs late finds the loop done."""
    set_num_threads(threads)
    x = inputs(threads)
    want = expected(x)
    for _ in range(20):
        np.testing.assert_allclose(run(library, x), want, rtol=2e-6, atol=1e-6)


def test_python_threads_share_one_library(library):
    """A caller that finds the pool busy runs its loop alone; nothing is lost or mixed up."""
    set_num_threads(2)
    cases = [inputs(100 + k) for k in range(4)]
    wants = [expected(x) for x in cases]
    failures = []

    def work(k):
        for _ in range(50):
            if not np.allclose(run(library, cases[k]), wants[k], rtol=2e-6, atol=1e-6):
                failures.append(k)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(t.is_alive() for t in threads) and failures == []


def _child(library_path: str, seed: int, queue) -> None:
    x = inputs(seed)
    queue.put(float(run(KernelLibrary(library_path), x).sum()))


def test_a_forked_child_starts_its_own_workers(library):
    """The parent's workers do not survive fork(): the child must not wait for them."""
    set_num_threads(2)
    x = inputs(7)
    run(library, x)  # the parent's workers exist now
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child, args=(str(library.path), 7, queue))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child hung in a parallel loop")
    assert child.exitcode == 0
    assert queue.get(timeout=5) == pytest.approx(float(expected(x).sum()), rel=1e-5)


def thread_count() -> int:
    """The process's pool workers (named kiln-pool): threads other libraries start meanwhile
    (another test's, in the same test process) do not count."""
    names = (Path("/proc/self/task") / task / "comm" for task in os.listdir("/proc/self/task"))
    return sum(1 for name in names if _comm(name) == "kiln-pool")


def _comm(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:  # the thread ended meanwhile
        return ""


def test_libraries_loaded_later_run_on_the_first_ones_pool(library, tmp_path):
    """A second module in the process starts no workers of its own: one set of workers
    per process, not one per library spinning against each other."""
    set_num_threads(2)
    x = inputs(3)
    run(library, x)
    before = thread_count()
    target = host_target()
    obj = emit_object(build_module([parallel_kernel()], target), target)
    second = KernelLibrary(link_shared([obj], tmp_path / "second.so"))
    for _ in range(10):
        np.testing.assert_allclose(run(second, x), expected(x), rtol=2e-6, atol=1e-6)
    assert thread_count() == before


SCRIPT = """
import gc, os, sys
import numpy as np
from compiler_core.runtime.library import KernelLibrary, set_num_threads
from tests.runtime.test_thread_pool import inputs, run
first, second = sys.argv[1:]
set_num_threads(1)
library = KernelLibrary(first)
run(library, inputs(0))
del library
gc.collect()
set_num_threads(2)
before = len(os.listdir("/proc/self/task"))
run(KernelLibrary(second), inputs(0))
print(before, len(os.listdir("/proc/self/task")))
"""


def test_the_thread_count_reaches_the_pool_after_its_first_library_is_gone(library, tmp_path):
    """The first library's pool serves the process even when its KernelLibrary object has
    been collected (a compile's verification run, say): set_num_threads must still reach it,
    or every later module runs on one thread."""
    target = host_target()
    obj = emit_object(build_module([parallel_kernel()], target), target)
    paths = [str(link_shared([obj], tmp_path / f"lib{k}.so")) for k in range(2)]
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, *paths], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    before, after = map(int, result.stdout.split()[-2:])
    assert after == before + 1  # the pool's worker


# --- claiming chunks: each thread its own home range first ----------------------------------

HOMES = 8  # kiln_pool.c's KILN_HOMES


class Claims(ctypes.Structure):
    _fields_ = [
        ("extent", ctypes.c_int64),
        ("homes", ctypes.c_int64),
        ("next", ctypes.c_int64 * HOMES),
    ]


@pytest.fixture(scope="module")
def claims_api(tmp_path_factory):
    """kiln_pool.c built with its hidden functions exported, to call kiln_claim directly."""
    out = tmp_path_factory.mktemp("claims") / "claims.so"
    command = [compiler_driver(), "-O2", "-fPIC", "-shared", "-pthread", "-DHIDDEN="]
    subprocess.run([*command, str(POOL_SOURCE), "-o", str(out)], check=True)
    lib = ctypes.CDLL(str(out))
    lib.kiln_claims_init.argtypes = [ctypes.POINTER(Claims), ctypes.c_int64]
    lib.kiln_claim.argtypes = [
        ctypes.POINTER(Claims),
        ctypes.POINTER(ctypes.c_int64),
        ctypes.POINTER(ctypes.c_int64),
    ]
    lib.kiln_claim.restype = ctypes.c_int64
    lib.kiln_pool_set_threads.argtypes = [ctypes.c_int]
    return lib


def claim_all(lib, claims: Claims, index: int) -> list[tuple[int, int]]:
    """Every chunk one thread claims, in order, until the loop is claimed."""
    cursor = (ctypes.c_int64 * 2)(index, 0)
    stop = ctypes.c_int64()
    chunks = []
    while (start := lib.kiln_claim(ctypes.byref(claims), cursor, ctypes.byref(stop))) >= 0:
        chunks.append((start, stop.value))
    return chunks


def covered_once(chunks, extent: int) -> bool:
    hits = np.zeros(extent, dtype=int)
    for start, stop in chunks:
        hits[start:stop] += 1
    return bool((hits == 1).all())


@pytest.mark.parametrize("threads, extent", [(2, 257), (3, 10), (2, 1), (8, 5), (20, 1000)])
def test_a_thread_claims_its_own_home_first_then_the_rest(claims_api, threads, extent):
    claims_api.kiln_pool_set_threads(threads)
    claims = Claims()
    claims_api.kiln_claims_init(ctypes.byref(claims), extent)
    homes = min(threads, HOMES, extent)
    assert claims.homes == homes
    index = threads - 1
    chunks = claim_all(claims_api, claims, index)
    home = index % homes
    assert chunks[0][0] == home * extent // homes  # its own home's first row
    assert covered_once(chunks, extent)  # alone, it ends up doing the whole loop
    assert len(chunks) <= 4 * homes  # a few chunks a home, not one per row


def claim_concurrently(lib, claims: Claims, threads: int) -> list[list[tuple[int, int]]]:
    """Each thread's chunks when `threads` Python threads claim one loop at once."""
    results: list[list[tuple[int, int]]] = [[] for _ in range(threads)]

    def claimer(index: int) -> None:
        results[index] = claim_all(lib, claims, index)

    workers = [threading.Thread(target=claimer, args=(k,)) for k in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return results


def test_two_claimers_share_a_loop_exactly(claims_api):
    """Concurrent claims (ctypes releases the GIL) cover every iteration exactly once, and
    each thread's first chunk is its own home's."""
    claims_api.kiln_pool_set_threads(2)
    for _ in range(200):
        claims = Claims()
        claims_api.kiln_claims_init(ctypes.byref(claims), 1001)
        first, second = claim_concurrently(claims_api, claims, 2)
        assert covered_once(first + second, 1001)
        # A thread starts in its own home unless the other claimed the whole loop first.
        assert first == [] or first[0][0] < 500
        assert second == [] or second[0][0] >= 500
