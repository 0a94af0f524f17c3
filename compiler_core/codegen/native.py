"""LLVM module -> optimized object code -> shared library, with the system toolchain."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import llvmlite.binding as llvm
import llvmlite.ir as ir

from compiler_core.target import Target

OPT_LEVEL = 3


class LinkError(RuntimeError):
    pass


def target_machine(target: Target) -> llvm.TargetMachine:
    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    return llvm.Target.from_triple(target.triple).create_target_machine(
        cpu=target.cpu, features=target.features, opt=OPT_LEVEL, reloc="pic", codemodel="default"
    )


def optimize(module: ir.Module | str, target: Target) -> llvm.ModuleRef:
    """Parse, verify and run LLVM's O3 pipeline (new pass manager) on the module."""
    tm = target_machine(target)
    ref = llvm.parse_assembly(str(module))
    ref.triple = target.triple
    ref.data_layout = str(tm.target_data)
    ref.verify()
    options = llvm.create_pipeline_tuning_options(speed_level=OPT_LEVEL)
    builder = llvm.create_pass_builder(tm, options)
    builder.getModulePassManager().run(ref, builder)
    return ref


def emit_object(module: ir.Module | str, target: Target) -> bytes:
    return target_machine(target).emit_object(optimize(module, target))


def emit_assembly(module: ir.Module | str, target: Target) -> str:
    return target_machine(target).emit_assembly(optimize(module, target))


# Below this many kernels a helper process costs more (its start-up imports llvmlite) than it
# saves.
PARALLEL_MIN_KERNELS = 8


def compile_kernels(funcs: Sequence, target: Target, workers: int | None = None) -> list[bytes]:
    """Object code of each loop-IR function (its own LLVM module), built by up to `workers`
    processes.

    Both halves of the work are serial in one process: rendering LLVM IR is Python, and
    llvmlite serializes every LLVM call behind one lock, so threads would not overlap. Every
    other share of the functions goes to a helper process (`python -m
    compiler_core.codegen.native`, started with subprocess so that it also works inside
    daemonic worker processes), while this process builds its own share.
    """
    workers = min(workers or os.cpu_count() or 1, len(funcs))
    if workers <= 1 or len(funcs) < PARALLEL_MIN_KERNELS:
        return [_kernel_object(func, target) for func in funcs]
    shares = [list(range(k, len(funcs), workers)) for k in range(workers)]
    objects: list[bytes] = [b""] * len(funcs)
    with tempfile.TemporaryDirectory(prefix="kiln-objects-") as tmp:
        helpers = [_start_helper(Path(tmp), funcs, share, target) for share in shares[1:]]
        for index in shares[0]:
            objects[index] = _kernel_object(funcs[index], target)
        for (process, job), share in zip(helpers, shares[1:], strict=True):
            _, stderr = process.communicate()
            if process.returncode != 0:
                raise LinkError(f"an LLVM helper process failed:\n{stderr.decode()[-2000:]}")
            for index in share:
                objects[index] = (job.parent / f"{job.stem}_{index}.o").read_bytes()
    return objects


def _kernel_object(func, target: Target) -> bytes:
    from compiler_core.codegen.llvm import build_module

    return emit_object(build_module([func], target, name=func.name), target)


def _start_helper(folder: Path, funcs: Sequence, share: list[int], target: Target):
    job = folder / f"share{share[0]}.pickle"
    job.write_bytes(pickle.dumps((target, [(index, funcs[index]) for index in share])))
    command = [sys.executable, "-m", "compiler_core.codegen.native", str(job)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return process, job


def _helper_main(job: Path) -> None:
    """Build each function of a pickled share; write `<job>_<index>.o` beside the job file."""
    target, share = pickle.loads(job.read_bytes())
    for index, func in share:
        (job.parent / f"{job.stem}_{index}.o").write_bytes(_kernel_object(func, target))


def compiler_driver() -> str:
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise LinkError("no C compiler driver (cc, gcc or clang) found to link the shared library")


POOL_SOURCE = Path(__file__).with_name("kiln_pool.c")
WORKSPACE_SOURCE = Path(__file__).with_name("kiln_workspace.c")
# What every kernel library links besides its kernels: the thread pool its parallel loops run
# on, and the cache its kernels take their workspace blocks from.
SUPPORT_SOURCES = (POOL_SOURCE, WORKSPACE_SOURCE)
_support_objects: list[bytes] | None = None


def support_objects() -> list[bytes]:
    """SUPPORT_SOURCES compiled, once per process."""
    global _support_objects
    if _support_objects is None:
        objects = []
        with tempfile.TemporaryDirectory(prefix="kiln-support-") as tmp:
            for source in SUPPORT_SOURCES:
                out = Path(tmp) / f"{source.stem}.o"
                command = [compiler_driver(), "-O2", "-fPIC", "-pthread", "-c", str(source)]
                result = subprocess.run([*command, "-o", str(out)], capture_output=True, text=True)
                if result.returncode != 0:
                    raise LinkError(f"compiling {source.name} failed:\n{result.stderr}")
                objects.append(out.read_bytes())
        _support_objects = objects
    return _support_objects


def link_shared(objects: list[bytes], output: Path) -> Path:
    """Link object files and Kiln's support code (SUPPORT_SOURCES) into one shared library."""
    output = Path(output)
    with tempfile.TemporaryDirectory(prefix="kiln-link-") as tmp:
        paths = []
        for i, data in enumerate([*objects, *support_objects()]):
            path = Path(tmp) / f"part{i}.o"
            path.write_bytes(data)
            paths.append(str(path))
        staged = Path(tmp) / output.name
        command = [compiler_driver(), "-shared", "-pthread", "-o", str(staged), *paths, "-lm"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise LinkError(f"linking failed ({' '.join(command)}):\n{result.stderr}")
        output.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staged), output)  # appears whole or not at all
    return output


if __name__ == "__main__":
    _helper_main(Path(sys.argv[1]))
