"""LLVM module -> optimized object code -> shared library, with the system toolchain."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
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


def optimize(module: ir.Module, target: Target) -> llvm.ModuleRef:
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


def emit_object(module: ir.Module, target: Target) -> bytes:
    return target_machine(target).emit_object(optimize(module, target))


def emit_assembly(module: ir.Module, target: Target) -> str:
    return target_machine(target).emit_assembly(optimize(module, target))


def compiler_driver() -> str:
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise LinkError("no C compiler driver (cc, gcc or clang) found to link the shared library")


def link_shared(objects: list[bytes], output: Path) -> Path:
    """Link object files into one shared library that uses OpenMP's runtime (libgomp)."""
    output = Path(output)
    with tempfile.TemporaryDirectory(prefix="kiln-link-") as tmp:
        paths = []
        for i, data in enumerate(objects):
            path = Path(tmp) / f"part{i}.o"
            path.write_bytes(data)
            paths.append(str(path))
        staged = Path(tmp) / output.name
        command = [compiler_driver(), "-shared", "-o", str(staged), *paths, "-lgomp", "-lm"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise LinkError(f"linking failed ({' '.join(command)}):\n{result.stderr}")
        output.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(staged), output)  # appears whole or not at all
    return output
