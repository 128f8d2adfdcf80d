"""CPU feature detection for kernel templates.

Features come from ``/proc/cpuinfo`` (what the kernel lets user space execute, so features a
hypervisor hides are reported absent). ``CpuInfo.isa`` is the widest instruction-set level that
templates may target, lowered further by ``torchport.config.isa``:

- ``avx512``: AVX-512 F+BW+VL (+ BF16 dot, VNNI and VBMI when present);
- ``avx2``: AVX2 + FMA (+ F16C);
- ``scalar``: portable C that any compiler and CPU accept.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
from dataclasses import dataclass

from torchport import config

# Flags (as /proc/cpuinfo names them) that templates care about.
KNOWN_FLAGS = (
    "sse4_2",
    "avx",
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512dq",
    "avx512_bf16",
    "avx512_vnni",
    "avx512vbmi",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)

ISA_LEVELS = ("scalar", "avx2", "avx512")
_ISA = config.Snapshot("isa")  # read on every kernel lookup


@dataclass(frozen=True)
class CpuInfo:
    """What this CPU can run: model name, relevant flags, core count."""

    model: str
    arch: str
    flags: frozenset[str]
    cores: int

    @functools.cached_property
    def max_isa(self) -> str:
        """Widest ISA level the hardware supports (computed once per instance)."""
        if self.arch not in ("x86_64", "AMD64"):
            return "scalar"
        # the avx512 level compiles with -mavx512dq, and kernels use DQ instructions (vrangeps,
        # vreduceps in the piecewise GELU, linalg's): no DQ, no avx512 level
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= self.flags:
            return "avx512"
        if {"avx2", "fma"} <= self.flags:
            return "avx2"
        return "scalar"

    @property
    def isa(self) -> str:
        """ISA level templates should target: hardware maximum, lowered by ``config.isa``."""
        want = _ISA()[0]
        hw = self.max_isa
        if want == "auto":
            return hw
        return want if ISA_LEVELS.index(want) < ISA_LEVELS.index(hw) else hw

    def has(self, flag: str) -> bool:
        """True if the CPU reports ``flag`` (a /proc/cpuinfo flag name)."""
        return flag in self.flags

    @property
    def has_avx512_bf16(self) -> bool:
        return self.isa == "avx512" and "avx512_bf16" in self.flags

    @property
    def has_vnni(self) -> bool:
        return ("avx512_vnni" in self.flags and self.isa == "avx512") or (
            "avx_vnni" in self.flags and self.isa != "scalar"
        )

    @property
    def has_amx(self) -> bool:
        return {"amx_tile", "amx_bf16"} <= self.flags

    def identity(self) -> dict[str, object]:
        """Machine identity used in cache keys."""
        return {
            "model": self.model,
            "arch": self.arch,
            "flags": sorted(self.flags),
            "cores": self.cores,
        }


def _parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    model = ""
    flags: frozenset[str] = frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            have = set(value.split())
            flags = frozenset(f for f in KNOWN_FLAGS if f in have)
    return model, flags


@functools.cache
def cpu_info() -> CpuInfo:
    """Detect this machine's CPU once per process."""
    model, flags = "", frozenset[str]()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            model, flags = _parse_cpuinfo(f.read())
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return CpuInfo(
        model=model or platform.processor() or "unknown",
        arch=platform.machine(),
        flags=flags,
        cores=cores or 1,
    )


def isa_flags(isa: str) -> list[str]:
    """Compiler flags that enable the given ISA level (and the optional extensions present)."""
    info = cpu_info()
    if isa == "scalar":
        return []
    flags = ["-mavx2", "-mfma"]
    if info.has("f16c"):
        flags.append("-mf16c")
    if isa == "avx512":
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
        if info.has("avx512_bf16"):
            flags.append("-mavx512bf16")
        if info.has("avx512_vnni"):
            flags.append("-mavx512vnni")
        if info.has("avx512vbmi"):
            flags.append("-mavx512vbmi")
    return flags


# arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): x86-64 Linux's syscall number and arguments
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18


@functools.cache
def amx_permitted() -> bool:
    """Whether Linux grants this process the AMX tile data state (the request the AMX kernels
    also make, once per process; torch's oneDNN asks the same). Asked from Python, so that
    whether AMX candidates exist does not depend on building an AMX library first."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    from torchport.native.launch import c_function

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syscall = c_function(libc, "syscall", [ctypes.c_long] * 3, ctypes.c_long)
    except (OSError, AttributeError):
        return False
    return int(syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)) == 0


def amx_missing(
    flags: set[str], *, unbuildable: bool, compiler: str, isa: str | None = None
) -> str | None:
    """What an AMX kernel needing CPU ``flags`` lacks here, in words (None: nothing): the avx512
    ISA level (``isa`` asked for, default the one in force, and the one in force), the flags, a
    compiler that builds it (``unbuildable``: a build of it failed in this process; ``compiler``
    names the extension) and the OS's tile state (:func:`amx_permitted`)."""
    info = cpu_info()
    isa = info.isa if isa is None else isa
    if isa != "avx512" or info.isa != "avx512":
        return f"the avx512 ISA level (isa is {isa!r}, in force {info.isa!r})"
    lacking = sorted(flags - info.flags)
    if lacking:
        return f"CPU flags {', '.join(lacking)} (absent here)"
    if unbuildable:
        return f"a compiler that builds {compiler} (an AMX build failed to compile here)"
    if not amx_permitted():
        return "the AMX tile state, which the OS did not grant"
    return None
