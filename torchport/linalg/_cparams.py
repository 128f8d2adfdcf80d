"""The C names one dtype's Jacobi kernels are rendered with (shared by the lane kernels of
:mod:`torchport.linalg.kernels`, :mod:`~torchport.linalg.eigh_block` and
:mod:`~torchport.linalg.svd_lanes`, whose templates use the same ``${elem}``/``${sqrt}``/... names)."""

from __future__ import annotations

import ctypes

import torch

from torchport.native import FloatArg, IntArg, Kernel, TensorArg
from torchport.native.launch import ArgSpec


def scalar_params(dtype: torch.dtype, max_sweeps: int) -> dict[str, str]:
    """Template parameters for float32 or float64 kernels: element and matching integer type,
    machine epsilon, the scalar and AVX2 square roots, ``fabs``, ``ldexp``, the ymm type and the
    sweep cap."""
    is64 = dtype == torch.float64
    return {
        "elem": "double" if is64 else "float",
        "eps": repr(float(torch.finfo(dtype).eps)),
        "sqrt": "sqrt" if is64 else "sqrtf",
        "fabs": "fabs" if is64 else "fabsf",
        "ldexp": "ldexp" if is64 else "ldexpf",
        "ielem": "int64_t" if is64 else "int32_t",
        "vsqrt": "_mm256_sqrt_pd" if is64 else "_mm256_sqrt_ps",
        "m256": "__m256d" if is64 else "__m256",
        "max_sweeps": str(int(max_sweeps)),
    }


def launcher(
    lib: ctypes.CDLL, symbol: str, dtype: torch.dtype, tensors: str, scalars: str
) -> Kernel:
    """The entry point ``symbol`` of ``lib``: the tensors named in ``tensors`` (space-separated, in
    argument order) -- ``info`` int32, ``name:r`` (singular values, eigenvalues) ``dtype``'s real
    type, the others ``dtype`` -- then the scalars named in ``scalars``: int64, or a double where
    written ``name:f``. Every linalg launcher follows these roles, so its signature is one line."""
    args: list[ArgSpec] = []
    for x in tensors.split():
        if x.endswith(":r"):
            args.append(TensorArg(x[:-2], (dtype.to_real(),)))
        else:
            args.append(TensorArg(x, (torch.int32 if x == "info" else dtype,)))
    for x in scalars.split():
        args.append(FloatArg(x[:-2]) if x.endswith(":f") else IntArg(x))
    return Kernel(lib, symbol, args)


def one_code_c(max_n: int) -> str:
    """The C macros of the complex one-matrix entry points' packed argument (``code``: m | n << 8 |
    flag i << (16 + i), :func:`torchport.linalg.one._code`) and their size bound; the real
    kernels' source spells out the same lines."""
    return (
        f"#define ONE_MAX_N {int(max_n)}\n"
        "#define ONE_M(c) ((c) & 255)\n"
        "#define ONE_N(c) (((c) >> 8) & 255)\n"
        "#define ONE_F(c, i) ((int)(((c) >> (16 + (i))) & 1))"
    )


def lane_bytes(isa: str, wide: bool) -> int:
    """Bytes per lane vector: 64 (a zmm register) when ``wide`` and the ISA is avx512, else 32."""
    return 64 if wide and isa == "avx512" else 32


def lane_params(dtype: torch.dtype, max_sweeps: int, vbytes: int) -> dict[str, str]:
    """:func:`scalar_params` for kernels whose lane vectors are ``vbytes`` bytes (32: ymm, 64:
    zmm), its ymm-only names (``vsqrt``, ``m256``) replaced by: the width, the macro that guards
    the intrinsics (the templates fall back to per-lane loops without it), the vector square
    root and its operand type, and the sign-bit movemask of a comparison mask and its operand
    type."""
    assert vbytes in (32, 64), vbytes
    params = scalar_params(dtype, max_sweeps)
    del params["vsqrt"], params["m256"]
    return params | _vector_names(dtype == torch.float64, vbytes)


def _vector_names(is64: bool, vbytes: int) -> dict[str, str]:
    if vbytes == 32:
        return {
            "vbytes": "32",
            "vguard": "defined(__AVX__)",
            "lsqrt": "_mm256_sqrt_pd" if is64 else "_mm256_sqrt_ps",
            "lvec": "__m256d" if is64 else "__m256",
            "lmovemask": "_mm256_movemask_pd" if is64 else "_mm256_movemask_ps",
            "lmask": "__m256d" if is64 else "__m256",
        }
    return {
        "vbytes": "64",
        "vguard": "defined(__AVX512F__) && defined(__AVX512DQ__)",
        "lsqrt": "_mm512_sqrt_pd" if is64 else "_mm512_sqrt_ps",
        "lvec": "__m512d" if is64 else "__m512",
        "lmovemask": "_mm512_movepi64_mask" if is64 else "_mm512_movepi32_mask",
        "lmask": "__m512i",
    }
