"""The C names one dtype's Jacobi kernels are rendered with (shared by the lane kernels of
:mod:`torchport.linalg.kernels`, :mod:`~torchport.linalg.eigh_block` and
:mod:`~torchport.linalg.svd_lanes`, whose templates use the same ``${elem}``/``${sqrt}``/... names)."""

from __future__ import annotations

import torch


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
