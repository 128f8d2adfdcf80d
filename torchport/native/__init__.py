"""The one toolchain for native kernels: templates → C → system compiler → cached .so → ctypes.

Layers:

- :mod:`~torchport.native.cpu` detects CPU features and picks the ISA level templates target;
- :mod:`~torchport.native.prelude` is the C prelude (headers, bf16 helpers, work splitting) and
  ``render`` fills a template's ``${params}``;
- :mod:`~torchport.native.toolchain` compiles with a content-addressed, concurrency-safe cache;
- :mod:`~torchport.native.launch` validates tensors and calls exported functions.

Kernels parallelise with OpenMP; each takes an explicit ``nthreads`` argument that callers set
from ``torch.get_num_threads()`` (the generated objects share torch's ``libgomp``).
"""

from __future__ import annotations

import torch

from torchport import config
from torchport.native.cpu import CpuInfo, amx_missing, amx_permitted, cpu_info, isa_flags
from torchport.native.launch import (
    C_TYPES,
    FloatArg,
    IntArg,
    Kernel,
    KernelArgumentError,
    TensorArg,
    c_function,
    check_tensor,
    eager_fast_path,
    forward_ad_active,
    functorch_active,
    thread_scratch,
)
from torchport.native.prelude import PRELUDE, render
from torchport.native.toolchain import (
    CacheUnavailableError,
    CompileError,
    CompilerNotFoundError,
    CorruptCacheWarning,
    DiskFullError,
    NativeError,
    NativeFallbackWarning,
    Stats,
    UnsafeCacheError,
    build,
    cache_size,
    compile_flags,
    find_compiler,
    native_dir,
    note_fallback,
    reset_stats,
    stats,
)

__all__ = [
    "C_TYPES",
    "PRELUDE",
    "CacheUnavailableError",
    "CompileError",
    "CompilerNotFoundError",
    "CorruptCacheWarning",
    "CpuInfo",
    "DiskFullError",
    "FloatArg",
    "IntArg",
    "Kernel",
    "KernelArgumentError",
    "NativeError",
    "NativeFallbackWarning",
    "Stats",
    "TensorArg",
    "UnsafeCacheError",
    "amx_missing",
    "amx_permitted",
    "build",
    "c_function",
    "cache_size",
    "check_tensor",
    "compile_flags",
    "cpu_info",
    "eager_fast_path",
    "enabled",
    "find_compiler",
    "forward_ad_active",
    "functorch_active",
    "isa_flags",
    "native_dir",
    "note_fallback",
    "num_threads",
    "render",
    "reset_stats",
    "stats",
    "thread_scratch",
]


_NATIVE = config.Snapshot("native")


def enabled() -> bool:
    """True if native kernels are switched on (``TORCHPORT_NATIVE``)."""
    return bool(_NATIVE()[0])


def num_threads() -> int:
    """Threads a kernel launch should use: torch's intra-op setting."""
    return max(1, torch.get_num_threads())
