"""Targets: a string such as `llvm -mcpu=znver4` parsed once into a typed, fingerprinted object."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shlex
from collections.abc import Iterable

from compiler_core.errors import UserError


class TargetError(UserError):
    pass


# L1 data cache associativity by CPU: 48 KB and 12 ways on Zen 5 and Intel's cores since Ice
# Lake (Rocket Lake's is Ice Lake's core); 32 KB and 8 ways on Zen 2-4 and Skylake (the
# default: the smaller guess errs safe).
L1_WAYS = {
    cpu: 12
    for cpu in (
        "znver5", "icelake-client", "icelake-server", "tigerlake", "rocketlake", "alderlake",
        "raptorlake", "meteorlake", "sapphirerapids", "emeraldrapids", "graniterapids",
    )
}  # fmt: skip
DEFAULT_L1_WAYS = 8
# Cores that run a 512-bit FMA at the rate of a 256-bit one (two FMA pipes of full width):
# Zen 5 and Intel's server cores. Zen 4 splits it in two passes, Intel's client cores fuse
# their two 256-bit pipes into one: there 16 lanes cost what 8 lanes do twice.
FULL_WIDTH_512 = frozenset(
    {"znver5", "skylake-avx512", "cascadelake", "cooperlake", "icelake-server",
     "sapphirerapids", "emeraldrapids", "graniterapids"}
)  # fmt: skip
# Cores that run a 256-bit FMA as two 128-bit halves (AMD's Zen and Zen+, whose LLVM name is
# znver1, and the FMA3 Bulldozers): an FMA handles 4 float32 lanes at the full rate, half of
# what Zen 2 and later do with the same ymm registers (bench.run's FMA peak on a Zen 1 VM:
# 40 GFLOP/s a core, against 99 on a Zen 3).
HALF_WIDTH_256 = frozenset({"znver1", "bdver2", "bdver3", "bdver4"})
# AMX ships on Intel's server cores only (Sapphire Rapids on): a CPU with it has their two
# full-width FMA pipes and 12-way L1 whatever model number it reports. A hypervisor may show
# a server core under a client's (seen: KVM's model 167, which LLVM names rocketlake, on a
# Xeon with 480 MB of L3 and AMX, running 512-bit FMAs at 64 FLOP per cycle).
SERVER_ONLY_FEATURE = "+amx-tile"
# Cores whose own prefetchers bring a GEMM's next panels of B in better than the dense
# template's software prefetches (its `prefetch` knob) do, so that the knob is off by
# default there. Zen 3, untuned: mlp at batch 64 10-13% faster without them (`bench.ab`, 24
# blocks), ViT's 197 x 768 x 768 projection 4% alone, encoder4 level; Zen 5, untuned: mlp at
# batch 64 1-5% faster without them (`bench.ab`, 24-30 blocks; back to back 6-14%), encoder4
# and the 1024^3 / 2048^3 GEMMs level; an Emerald Rapids Xeon ran mlp at batch 64 7% faster
# with them. Zen 1, 2 and 4 are not measured: they keep them.
NO_PANEL_PREFETCH = frozenset({"znver3", "znver5"})
# The host features that change the code LLVM emits for a kernel: the vector ISA (SSE to
# AVX-512 and AMX, FMA, F16C). The others (protection keys, WBNOINVD, shadow stacks, ...) are
# ones a hypervisor shows on one VM and hides on the next of the same CPU; keying tuning
# records on them split one machine's records in two (seen: Zen 3 VMs with and without PKU).
CODEGEN_FEATURE_PREFIXES = ("+sse", "+ssse3", "+avx", "+fma", "+f16c", "+amx", "+evex512")


@dataclasses.dataclass(frozen=True)
class Target:
    kind: str  # "llvm" (CPU) or "cuda"
    cpu: str
    features: str  # LLVM feature string: "+avx512f,+fma,..."
    triple: str
    cores: int

    @property
    def is_gpu(self) -> bool:
        return self.kind == "cuda"

    @property
    def arch(self) -> str:
        """The SM architecture of a cuda target (`sm_90`)."""
        if not self.is_gpu:
            raise TargetError(f"{self} is not a GPU target")
        return self.cpu

    @property
    def vector_bits(self) -> int:
        # A cuda target packs as for 16 lanes: panels of 32 columns are one warp's loads.
        if self.is_gpu:
            return 512
        return 512 if "+avx512f" in self.features.split(",") else 256

    @property
    def vector_lanes(self) -> int:
        """float32 lanes of one vector register: 16 (zmm) with AVX-512, else 8 (ymm)."""
        return self.vector_bits // 32

    @property
    def l1_ways(self) -> int:
        """Associativity of the L1 data cache (how many lines of one set it keeps)."""
        if self._intel_server:
            return 12
        return L1_WAYS.get(self.cpu, DEFAULT_L1_WAYS)

    @property
    def fma_lanes(self) -> int:
        """float32 lanes an FMA handles at the full rate: a vector register's on a core with
        full-width pipes, else 8 (a ymm register), or 4 on a core that splits even those."""
        if self.is_gpu:
            return self.vector_lanes
        if self.cpu in HALF_WIDTH_256:
            return 4
        if self.vector_lanes <= 8:
            return self.vector_lanes
        full_width = self.cpu in FULL_WIDTH_512 or self._intel_server
        return self.vector_lanes if full_width else 8

    @property
    def prefetches_panels(self) -> bool:
        """Whether a GEMM's untuned schedule prefetches its next panels of B (see
        NO_PANEL_PREFETCH); the tuner measures both ways wherever the knob is offered."""
        return self.cpu not in NO_PANEL_PREFETCH

    @property
    def fma_broadcasts(self) -> bool:
        """Whether an FMA takes a broadcast input straight from memory (AVX-512's embedded
        broadcast, `{1to16}`); with AVX2 every broadcast input value is an instruction of its
        own, which a register tile pays once per pixel and reduction step."""
        return self.is_gpu or "+avx512f" in self.features.split(",")

    @property
    def scales_exponents(self) -> bool:
        """Whether x * 2^n on float32 vectors is one instruction (AVX-512's vscalefps, which
        `llvm.ldexp` lowers to); without it LLVM calls ldexpf lane by lane."""
        return not self.is_gpu and "+avx512f" in self.features.split(",")

    @property
    def _intel_server(self) -> bool:
        return SERVER_ONLY_FEATURE in self.features.split(",")

    @property
    def vector_registers(self) -> int:
        """Architectural vector registers: 32 zmm with AVX-512, 16 ymm with AVX2."""
        return 32 if self.vector_bits == 512 else 16

    @property
    def fingerprint(self) -> str:
        """What tuning records and cached objects are keyed by: the CPU, its vector ISA and
        its cores (a measurement on one VM holds on another of the same CPU and cores)."""
        codegen = (f for f in self.features.split(",") if f.startswith(CODEGEN_FEATURE_PREFIXES))
        return self.fingerprint_over(codegen)

    def fingerprint_over(self, features: Iterable[str]) -> str:
        """The hash of the target's kind, triple, CPU and cores with `features` (the legacy
        fingerprint took every enabled feature: `bench.rekey`)."""
        text = f"{self.kind}|{self.triple}|{self.cpu}|{','.join(sorted(features))}|{self.cores}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def __str__(self) -> str:
        if self.is_gpu:
            return f"cuda -arch={self.cpu}"
        return f"{self.kind} -mcpu={self.cpu}"


@dataclasses.dataclass(frozen=True)
class GpuLimits:
    """What one thread block may use (per SM architecture; statically allocated shared memory
    is capped at 48 KiB on every architecture we target)."""

    max_threads_per_block: int = 1024
    max_shared_bytes: int = 48 * 1024
    max_registers_per_thread: int = 255
    warp_size: int = 32


# Architectures the NVPTX path emits PTX for (ptxas checks each in the tests).
GPU_ARCHS = ("sm_80", "sm_86", "sm_89", "sm_90")
GPU_LIMITS = {arch: GpuLimits() for arch in GPU_ARCHS}


def gpu_limits(target: Target) -> GpuLimits:
    return GPU_LIMITS[target.arch]


def cuda_target(arch: str = "sm_90") -> Target:
    if arch not in GPU_ARCHS:
        raise TargetError(
            f"unsupported CUDA architecture {arch!r} (supported: {', '.join(GPU_ARCHS)})"
        )
    return Target(kind="cuda", cpu=arch, features="", triple="nvptx64-nvidia-cuda", cores=0)


def host_target() -> Target:
    import llvmlite.binding as llvm

    llvm.initialize_native_target()
    llvm.initialize_native_asmprinter()
    return Target(
        kind="llvm",
        cpu=llvm.get_host_cpu_name(),
        features=llvm.get_host_cpu_features().flatten(),
        triple=llvm.get_process_triple(),
        cores=os.cpu_count() or 1,
    )


def _parse_cuda(text: str, options: list[str]) -> Target:
    arch = "sm_90"
    for word in options:
        key, _, value = word.partition("=")
        if key == "-arch" and value:
            arch = value
        else:
            raise TargetError(f"unknown target option {word!r} in {text!r}")
    return cuda_target(arch)


def parse_target(text: str = "llvm") -> Target:
    """`llvm [-mcpu=NAME] [-mattr=FEATURES]` (the host CPU by default) or
    `cuda [-arch=sm_XY]` (sm_90 by default)."""
    words = shlex.split(text)
    if words and words[0] == "cuda":
        return _parse_cuda(text, words[1:])
    if not words or words[0] != "llvm":
        raise TargetError(
            f"unsupported target {text!r} (expected 'llvm [-mcpu=NAME]' or 'cuda -arch=sm_XY')"
        )
    target = host_target()
    for word in words[1:]:
        key, _, value = word.partition("=")
        if key == "-mcpu" and value:
            if value != target.cpu:
                # Another CPU's name keeps only the features it is known to have; the host's
                # feature list would claim too much.
                target = dataclasses.replace(target, cpu=value, features="")
        elif key == "-mattr" and value:
            target = dataclasses.replace(target, features=value)
        else:
            raise TargetError(f"unknown target option {word!r} in {text!r}")
    return target
