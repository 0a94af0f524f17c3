"""Targets: a string such as `llvm -mcpu=znver4` parsed once into a typed, fingerprinted object."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shlex

from compiler_core.errors import UserError


class TargetError(UserError):
    pass


@dataclasses.dataclass(frozen=True)
class Target:
    kind: str  # "llvm" (CPU) or "cuda"
    cpu: str
    features: str  # LLVM feature string: "+avx512f,+fma,..."
    triple: str
    cores: int

    @property
    def vector_bits(self) -> int:
        return 512 if "+avx512f" in self.features.split(",") else 256

    @property
    def vector_lanes(self) -> int:
        """float32 lanes of one vector register: 16 (zmm) with AVX-512, else 8 (ymm)."""
        return self.vector_bits // 32

    @property
    def vector_registers(self) -> int:
        """Architectural vector registers: 32 zmm with AVX-512, 16 ymm with AVX2."""
        return 32 if self.vector_bits == 512 else 16

    @property
    def fingerprint(self) -> str:
        """What tuning records and cached objects are keyed by."""
        enabled = sorted(f for f in self.features.split(",") if f.startswith("+"))
        text = f"{self.kind}|{self.triple}|{self.cpu}|{','.join(enabled)}|{self.cores}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def __str__(self) -> str:
        return f"{self.kind} -mcpu={self.cpu}"


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


def parse_target(text: str = "llvm") -> Target:
    words = shlex.split(text)
    if not words or words[0] != "llvm":
        raise TargetError(f"unsupported target {text!r} (expected 'llvm [-mcpu=NAME]')")
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
