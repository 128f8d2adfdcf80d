"""Test matrices for the linalg tests, real or complex (shared by the test files)."""

from __future__ import annotations

import torch


def basis(b: int, n: int, g: torch.Generator, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``b`` random orthogonal (unitary for a complex ``dtype``) n x n matrices."""
    q, _ = torch.linalg.qr(torch.randn(b, n, n, generator=g, dtype=dtype))
    return q


def make(
    kind: str, b: int, m: int, n: int, seed: int = 0, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """``b`` m x n test matrices of ``dtype`` (float64 or complex128): random, zero, diagonal,
    rank-deficient, ill-conditioned (cond 1e6), repeated singular values."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    if kind == "random":
        return torch.randn(b, m, n, generator=g, dtype=dtype)
    if kind == "zero":
        return torch.zeros(b, m, n, dtype=dtype)
    if kind == "diagonal":
        a = torch.zeros(b, m, n, dtype=dtype)
        a.diagonal(0, -2, -1).copy_(torch.randn(b, k, generator=g, dtype=dtype))
        return a
    u, v = basis(b, m, g, dtype), basis(b, n, g, dtype)
    s = torch.zeros(b, k, dtype=torch.float64)
    if kind == "rank_deficient":
        r = max(1, k // 2)
        s[:, :r] = torch.rand(b, r, generator=g, dtype=torch.float64) + 0.5
    elif kind == "ill_conditioned":
        s[:] = torch.logspace(0, -6, k, dtype=torch.float64)
    elif kind == "repeated":
        s[:] = 2.0
        s[:, k // 2 :] = 0.5
    else:
        raise ValueError(kind)
    return (u[..., :, :k] * s.to(dtype).unsqueeze(-2)) @ v[..., :, :k].mH
