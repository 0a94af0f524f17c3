"""Loop IR -> PTX for NVIDIA GPUs, through LLVM's NVPTX target (llvmlite).

A device kernel (see `gpu/kernels.py`) is emitted by the CPU renderer with the few rules that
differ on a GPU:

- a loop bound to `blockIdx.x` ... `threadIdx.z` is no loop: its variable is the special
  register (`llvm.nvvm.read.ptx.sreg.ctaid.x` ...), the launch matching the loop's extent;
- a shared buffer is a module-level array in address space 3, one per kernel and buffer;
- `Barrier` is `__syncthreads` (`llvm.nvvm.barrier0`); warp shuffles are `shfl.sync`;
- math the NVPTX backend cannot select (libm calls, `llvm.log`, `llvm.sin`...) is expanded
  from what it can (the CPU renderer's exp/erf/tanh polynomials, `ex2`/`lg2` approximations
  accurate to ~2^-22, identities for the hyperbolic and inverse functions);
- each kernel is marked as an entry (`!nvvm.annotations`, "kernel").

No CUDA toolkit or GPU is needed to emit PTX; `assemble` runs `ptxas` where it is installed.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import llvmlite.binding as llvm
import llvmlite.ir as ir

from compiler_core.codegen.llvm import (
    FAST_MATH,
    I32,
    I64,
    PTR,
    CodegenError,
    FunctionEmitter,
    _Scope,
    _suffix,
    memory_type,
)
from compiler_core.loop.ir import Allocate, Barrier, Call, For, ForKind, Prefetch, PrimFunc, Stmt

TRIPLE = "nvptx64-nvidia-cuda"
DATA_LAYOUT = "e-p6:32:32-i64:64-i128:128-i256:256-v16:16-v32:32-n16:32:64"
OPT_LEVEL = 3
SPECIAL_REGISTERS = {
    "blockIdx.x": "ctaid.x",
    "blockIdx.y": "ctaid.y",
    "blockIdx.z": "ctaid.z",
    "threadIdx.x": "tid.x",
    "threadIdx.y": "tid.y",
    "threadIdx.z": "tid.z",
}
SHARED = 3  # the NVPTX address space of __shared__ memory
SHUFFLES = {"shfl_down": "down", "shfl_xor": "bfly"}
LN2 = 0.6931471805599453
LOG2E = 1.4426950408889634
PI = 3.141592653589793


class DeviceEmitter(FunctionEmitter):
    """Renders one device kernel into an NVPTX llvmlite module."""

    def emit(self) -> ir.Function:
        fn = super().emit()
        kernel = self.module.add_metadata([fn, "kernel", I32(1)])
        self.module.add_named_metadata("nvvm.annotations", kernel)
        return fn

    # --- statements -----------------------------------------------------------------------

    def _stmt(self, b: ir.IRBuilder, scope: _Scope, s: Stmt) -> None:
        if isinstance(s, Barrier):
            b.call(self._declare("llvm.nvvm.barrier0", ir.VoidType(), []), [])
        elif isinstance(s, Prefetch):
            return  # a CPU cache hint; GPU weights go through the runtime's L2 prefetch
        else:
            super()._stmt(b, scope, s)

    def _for(self, b: ir.IRBuilder, scope: _Scope, loop: For) -> None:
        if loop.kind == ForKind.THREAD_BINDING:
            register = SPECIAL_REGISTERS[loop.binding]
            read = self._declare(f"llvm.nvvm.read.ptx.sreg.{register}", I32, [])
            index = b.zext(b.call(read, []), I64, name=loop.var.name)
            inner = _Scope({**scope.values, loop.var.name: index}, scope.buffers)
            self._stmt(b, inner, loop.body)
        elif loop.kind == ForKind.PARALLEL:
            raise CodegenError(f"parallel loop {loop.var.name!r} in a GPU kernel: bind it")
        else:
            super()._for(b, scope, loop)

    def _allocate(self, b: ir.IRBuilder, scope: _Scope, s: Allocate) -> None:
        if s.buffer.scope == "shared":
            element = memory_type(s.buffer.dtype)
            name = f"{self.func.name}__{s.buffer.name}"
            array = ir.GlobalVariable(
                self.module, ir.ArrayType(element, s.buffer.size), name, addrspace=SHARED
            )
            array.linkage = "internal"
            array.align = 16
            array.initializer = ir.Constant(array.value_type, ir.Undefined)
            pointer = self.entry_builder.addrspacecast(array, PTR)
            inner = _Scope(
                scope.values,
                {**scope.buffers, s.buffer: pointer},
                scope.lanes,
                scope.vector_var,
                scope.mask,
            )
            self._stmt(b, inner, s.body)
        elif s.buffer.scope == "local":
            super()._allocate(b, scope, s)
        else:
            raise CodegenError(
                f"{s.buffer.scope} buffer {s.buffer.name!r} inside a GPU kernel: device memory "
                "is planned by the host (split the kernel)"
            )

    def _parallel(self, b, scope, loop):
        raise CodegenError(f"parallel loop {loop.var.name!r} in a GPU kernel: bind it")

    # --- expressions ----------------------------------------------------------------------

    def _expr(self, b: ir.IRBuilder, scope: _Scope, e):
        if isinstance(e, Call):
            return self._shuffle(b, scope, e)
        return super()._expr(b, scope, e)

    def _shuffle(self, b, scope, e: Call) -> ir.Value:
        value, offset = (self._expr(b, scope, a) for a in e.args)
        if e.dtype not in ("float32", "int32"):
            raise CodegenError(f"{e.name} of {e.dtype}: shuffles move 32-bit values")
        ty = memory_type(e.dtype)
        kind = SHUFFLES[e.name]
        name = f"llvm.nvvm.shfl.sync.{kind}.{'f32' if e.dtype == 'float32' else 'i32'}"
        fn = self._declare(name, ty, [I32, ty, I32, I32])
        full_mask, clamp = I32(-1), I32(31 if kind == "bfly" else 31)
        return b.call(fn, [full_mask, value, b.trunc(offset, I32), clamp])

    def _unary(self, b, op: str, dtype: str, x) -> ir.Value:
        if dtype in ("float32", "bfloat16") and op in DEVICE_MATH:
            return DEVICE_MATH[op](self, b, x)
        if dtype == "float64" and op not in NATIVE_F64:
            raise CodegenError(f"no GPU rule for {op} on float64")
        return super()._unary(b, op, dtype, x)

    # --- float32 math the NVPTX backend cannot select -----------------------------------------

    def _nvvm(self, b, name: str, x) -> ir.Value:
        return b.call(self._declare(name, x.type, [x.type]), [x])

    def _log(self, b, x):
        return b.fmul(self._nvvm(b, "llvm.nvvm.lg2.approx.f", x), ir.Constant(x.type, LN2))

    def _sin(self, b, x):
        return self._nvvm(b, "llvm.nvvm.sin.approx.f", self._reduce_angle(b, x))

    def _cos(self, b, x):
        return self._nvvm(b, "llvm.nvvm.cos.approx.f", self._reduce_angle(b, x))

    def _reduce_angle(self, b, x):
        """x - 2 pi round(x / 2 pi): the approximations are accurate in [-pi, pi]."""
        c = functools.partial(ir.Constant, x.type)
        turns = b.fmul(x, c(1.0 / (2 * PI)))
        whole = self._nvvm(b, "llvm.roundeven." + _suffix(x.type), turns)
        return b.fsub(x, b.fmul(whole, c(2 * PI)))

    def _tan(self, b, x):
        return b.fdiv(self._sin(b, x), self._cos(b, x))

    def _sinh(self, b, x):
        c = functools.partial(ir.Constant, x.type)
        up, down = self._fast_exp(b, x), self._fast_exp(b, b.fneg(x))
        return b.fmul(b.fsub(up, down), c(0.5))

    def _cosh(self, b, x):
        c = functools.partial(ir.Constant, x.type)
        up, down = self._fast_exp(b, x), self._fast_exp(b, b.fneg(x))
        return b.fmul(b.fadd(up, down), c(0.5))

    def _sqrt(self, b, x):
        return b.call(self._intrinsic("llvm.sqrt", x.type), [x])

    def _asinh(self, b, x):
        """sign(x) log(|x| + sqrt(x^2 + 1)), odd so that large negative x do not cancel."""
        c = functools.partial(ir.Constant, x.type)
        ax = self._nvvm(b, "llvm.fabs." + _suffix(x.type), x)
        root = self._sqrt(b, b.fadd(b.fmul(ax, ax), c(1.0)))
        magnitude = self._log(b, b.fadd(ax, root))
        copysign = self._declare(f"llvm.copysign.{_suffix(x.type)}", x.type, [x.type, x.type])
        return b.call(copysign, [magnitude, x])

    def _acosh(self, b, x):
        c = functools.partial(ir.Constant, x.type)
        return self._log(b, b.fadd(x, self._sqrt(b, b.fsub(b.fmul(x, x), c(1.0)))))

    def _atanh(self, b, x):
        c = functools.partial(ir.Constant, x.type)
        ratio = b.fdiv(b.fadd(c(1.0), x), b.fsub(c(1.0), x))
        return b.fmul(self._log(b, ratio), c(0.5))

    def _atan(self, b, x):
        """Range-reduced to [0, 1] (atan x = pi/2 - atan 1/x above 1), then a minimax odd
        polynomial (error below 2e-7 rad on [0, 1])."""
        c = functools.partial(ir.Constant, x.type)
        ax = self._nvvm(b, "llvm.fabs." + _suffix(x.type), x)
        large = b.fcmp_ordered(">", ax, c(1.0))
        t = b.select(large, b.fdiv(c(1.0), ax), ax)
        t2 = b.fmul(t, t)
        poly = c(-0.0040540580)
        for coefficient in (
            0.0218612288,
            -0.0559098861,
            0.0964200441,
            -0.1390853351,
            0.1994653599,
            -0.3332985605,
            0.9999993329,
        ):
            poly = b.fadd(b.fmul(poly, t2, flags=FAST_MATH), c(coefficient), flags=FAST_MATH)
        angle = b.fmul(poly, t)
        angle = b.select(large, b.fsub(c(PI / 2), angle), angle)
        copysign = self._declare(f"llvm.copysign.{_suffix(x.type)}", x.type, [x.type, x.type])
        return b.call(copysign, [angle, x])

    def _asin(self, b, x):
        c = functools.partial(ir.Constant, x.type)
        return self._atan(b, b.fdiv(x, self._sqrt(b, b.fsub(c(1.0), b.fmul(x, x)))))

    def _acos(self, b, x):
        c = functools.partial(ir.Constant, x.type)
        return b.fsub(c(PI / 2), self._asin(b, x))


DEVICE_MATH = {
    "log": DeviceEmitter._log,
    "sin": DeviceEmitter._sin,
    "cos": DeviceEmitter._cos,
    "tan": DeviceEmitter._tan,
    "sinh": DeviceEmitter._sinh,
    "cosh": DeviceEmitter._cosh,
    "asinh": DeviceEmitter._asinh,
    "acosh": DeviceEmitter._acosh,
    "atanh": DeviceEmitter._atanh,
    "atan": DeviceEmitter._atan,
    "asin": DeviceEmitter._asin,
    "acos": DeviceEmitter._acos,
}
# float64 operations the NVPTX backend selects itself (the rest would be libm calls).
NATIVE_F64 = ("neg", "not", "abs", "sqrt", "floor", "ceil", "round", "sign", "rsqrt")


def device_module(funcs: Sequence[PrimFunc], name: str = "kiln_cuda") -> ir.Module:
    module = ir.Module(name=name)
    module.triple = TRIPLE
    module.data_layout = DATA_LAYOUT
    for func in funcs:
        DeviceEmitter(module, func).emit()
    _add_prefetch_kernel(module)
    return module


# The runtime's L2 prefetch: `kiln_prefetch_l2(pointer, bytes)` asks for every 128-byte line
# of a buffer (grid-stride), loading nothing into registers. The runtime launches it for a
# kernel's large weights just before the kernel (see runtime/device.py).
PREFETCH_KERNEL = "kiln_prefetch_l2"
LINE_BYTES = 128


def _add_prefetch_kernel(module: ir.Module) -> None:
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [PTR, I64]), PREFETCH_KERNEL)
    base, nbytes = fn.args
    entry, loop, body, done = (fn.append_basic_block(n) for n in ("entry", "loop", "body", "done"))
    b = ir.IRBuilder(entry)

    def register(name: str) -> ir.Value:
        read = module.globals.get(f"llvm.nvvm.read.ptx.sreg.{name}")
        if read is None:
            read = ir.Function(module, ir.FunctionType(I32, []), f"llvm.nvvm.read.ptx.sreg.{name}")
        return b.zext(b.call(read, []), I64)

    thread = b.add(b.mul(register("ctaid.x"), register("ntid.x")), register("tid.x"))
    start = b.mul(thread, I64(LINE_BYTES))
    step = b.mul(b.mul(register("nctaid.x"), register("ntid.x")), I64(LINE_BYTES))
    b.branch(loop)
    b.position_at_end(loop)
    offset = b.phi(I64)
    offset.add_incoming(start, entry)
    b.cbranch(b.icmp_unsigned("<", offset, nbytes), body, done)
    b.position_at_end(body)
    hint = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [PTR]), "prefetch.L2 [$0];", "l", True)
    b.call(hint, [b.gep(base, [offset], source_etype=ir.IntType(8))])
    offset.add_incoming(b.add(offset, step), body)
    b.branch(loop)
    b.position_at_end(done)
    b.ret_void()
    kernel = module.add_metadata([fn, "kernel", I32(1)])
    module.add_named_metadata("nvvm.annotations", kernel)


def _target_machine(arch: str) -> llvm.TargetMachine:
    llvm.initialize_all_targets()
    llvm.initialize_all_asmprinters()
    return llvm.Target.from_triple(TRIPLE).create_target_machine(cpu=arch, opt=OPT_LEVEL)


def emit_ptx(funcs: Sequence[PrimFunc], arch: str) -> str:
    """PTX text for `funcs` (device kernels) on `arch` (`sm_80`, `sm_90`...)."""
    tm = _target_machine(arch)
    ref = llvm.parse_assembly(str(device_module(funcs)))
    ref.verify()
    options = llvm.create_pipeline_tuning_options(speed_level=OPT_LEVEL)
    builder = llvm.create_pass_builder(tm, options)
    builder.getModulePassManager().run(ref, builder)
    return tm.emit_assembly(ref)


def ptxas_available() -> bool:
    return shutil.which("ptxas") is not None


def assemble(ptx: str, arch: str) -> bytes | None:
    """A cubin for `arch` from ptxas; None where ptxas is not installed. A rejection raises
    CodegenError with ptxas's message."""
    ptxas = shutil.which("ptxas")
    if ptxas is None:
        return None
    with tempfile.TemporaryDirectory(prefix="kiln-ptxas-") as tmp:
        source, cubin = Path(tmp) / "kernels.ptx", Path(tmp) / "kernels.cubin"
        source.write_text(ptx)
        result = subprocess.run(
            [ptxas, f"-arch={arch}", str(source), "-o", str(cubin)],
            capture_output=True,
            text=True,
        )
        if result.returncode:
            raise CodegenError(f"ptxas rejected the PTX for {arch}: {result.stderr.strip()[:2000]}")
        return cubin.read_bytes()
