"""One-matrix launchers: the native SVD, eigh, QR and Cholesky workers on a single small matrix.

For a batch of one, a ``torch.linalg`` call on the Zen 3 VM costs 7-50 us at n = 2…16, most of it
outside LAPACK, and the native workers need about a microsecond there. What decides is the cost
around them, so a launcher is resolved once per (shape, dtype, options) and per call only
allocates its outputs (``torch.empty_like`` of templates it keeps: 1.3-2.3 us each against 4-5 us
for ``torch.empty(shape, dtype=...)``), takes the data pointers and calls a one-matrix entry point
of :mod:`~torchport.linalg.kernels` (``tp_svd1``, ``tp_eigh1``, ``tp_qr1``, ``tp_chol1``): no
thread team, scratch on the stack, sizes and flags packed in one argument (a ctypes call costs
~0.4 us plus ~0.15 us per int64 argument, ~0.07 us per pointer).

The entry points run the batched kernels' per-matrix workers, so results equal the batched
kernels' (one matrix per thread) bit for bit, except eigh from order ``EIGH_TRIDIAGONAL_FROM``:
there ``tp_eigh1`` runs Householder tridiagonalization and implicit QL (2-3x faster than
torch.linalg.eigh at n = 4…32, where cyclic Jacobi loses from n ≈ 13), which no batched kernel
shares (reference: ``eigh_tridiagonal_reference``). Complex64/complex128 run the entry points
of :mod:`~torchport.linalg.complex_jacobi` (``tp_csvd1``; ``tp_ceigh1``: cyclic Jacobi, or from
``EIGH_TRIDIAGONAL_FROM`` complex Householder tridiagonalization + the real implicit QL,
reference ``complex_eigh_tridiagonal_reference``) and :mod:`~torchport.linalg.complex_factor` (``tp_cqr1``, ``tp_cchol1``), whose workers
are not inlined, so the batched and one-matrix entry points run the same machine code and agree
bit for bit; S and the eigenvalues are then real. The plain-torch references of the
algorithms are those of :mod:`torchport.linalg.reference`. A launcher returns what the public function returns
(torch's named tuples, or the lone tensor of ``svdvals``, ``eigvalsh`` and ``cholesky``) and
treats non-finite input (svd, eigh) as the op layer does (``ops.non_finite``: ``torch.linalg``'s
answer, NaNs for infinities, ``torch.linalg.LinAlgError`` where LAPACK fails on NaN) and fails,
through the ``fail`` callback, for a leading minor that is not positive-definite (cholesky).
It assumes a plain eager CPU tensor of the planned shape and dtype, with nothing for autograd
to record; the caller checks that (``torchport.linalg._native_ok``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from torchport import native
from torchport.linalg import complex_factor, complex_jacobi, kernels, ops

# The largest max(m, n) the entry points take.
ONE_MAX_N = kernels.ONE_MAX_N

_rt: Any = torch.return_types

# From this order eigh_plan runs the tridiagonal QL worker (Householder + implicit QL, flag 3
# of tp_eigh1) instead of cyclic Jacobi. One matrix, launcher calls, alternated medians of 201
# rounds of 10 calls, load 2.6-3.6, us Jacobi -> tridiagonal (torch.linalg.eigh): f32 n = 2
# 4.14 -> 4.11 (8.75), 3 4.42 -> 4.42, 4 4.72 -> 4.53, 8 8.33 -> 5.87, 12 16.1 -> 7.8, 16 33.6
# -> 10.0 (24.3), 24 88.0 -> 17.2 (40.8), 32 171 -> 27.9 (83.5); f64 n = 2 4.18 -> 4.19 (8.86),
# 3 4.53 -> 4.45, 4 5.08 -> 4.80, 8 10.2 -> 6.5, 12 21.3 -> 9.3, 16 46.0 -> 12.3 (28.8), 24 130
# -> 24.2 (52.1), 32 246 -> 39.8 (98.6); eigenvalues only f64 n = 4 3.43 -> 3.13, 32 240 -> 29.4
# (41.1). At n = 2, 3 the two tie, and the 2 x 2 / 3 x 3 Jacobi worker is built at constant
# size, so it keeps those. Complex (tp_ceigh1 flag 2, complex tridiagonalization + the same QL),
# the same timing under the bench lock, load 2.1, us Jacobi -> tridiagonal (torch.linalg.eigh,
# one thread): c64 n = 2 4.74 -> 4.37 (10.5), 3 5.28 -> 4.64, 4 5.89 -> 5.04, 8 21.5 -> 14.5
# (47.3), 16 68.5 -> 24.8 (69.7), 32 386 -> 79.8 (174); c128 n = 2 8.63 -> 8.11 (18.9), 8 21.6
# -> 12.2 (32.4), 16 94.3 -> 26.4 (66.0), 32 600 -> 112 (219); eigenvalues only c128 n = 16
# 76.0 -> 16.3 (37.8), 32 396 -> 50.4 (74.0). The QL worker is ahead from n = 2.
EIGH_TRIDIAGONAL_FROM = {
    torch.float32: 4,
    torch.float64: 4,
    torch.complex64: 2,
    torch.complex128: 2,
}


def fits(m: int, n: int) -> bool:
    """Whether an m × n matrix is one the launchers take."""
    return min(m, n) >= 1 and max(m, n) <= ONE_MAX_N


def _code(m: int, n: int, *flags: bool) -> int:
    """The entry points' packed argument: m | n << 8 | flag i << (16 + i)."""
    code = m | n << 8
    for i, f in enumerate(flags):
        code |= int(f) << (16 + i)
    return code


def _call(dtype: torch.dtype, name: str) -> Callable[..., int]:
    isa = native.cpu_info().isa
    if not dtype.is_complex:
        return kernels.library(dtype, isa)[name].raw_call
    source = complex_jacobi if name in ("svd1", "eigh1") else complex_factor
    return source.library(dtype, isa)[name].raw_call


def _check_plan(shape: torch.Size) -> tuple[int, int]:
    m, n = shape[-2:]
    assert len(shape) >= 2 and math.prod(shape[:-2]) == 1 and fits(m, n), shape
    return m, n


def svd_plan(
    shape: torch.Size, dtype: torch.dtype, full_matrices: bool, compute_uv: bool
) -> Callable[[torch.Tensor], Any]:
    """``svd`` (``linalg_svd`` named tuple) or, without ``compute_uv``, ``svdvals`` (S)."""
    m, n = _check_plan(shape)
    k, batch = min(m, n), shape[:-2]
    call = _call(dtype, "svd1")
    # the batched kernel's order for one matrix per thread (kernels.svd; complex: cyclic only)
    order = not dtype.is_complex and k >= kernels.SVD_ROUND_ROBIN_FROM
    code = _code(m, n, compute_uv, full_matrices, order)
    s_like = torch.empty((*batch, k), dtype=dtype.to_real())
    if not compute_uv:

        def vals(a: torch.Tensor) -> torch.Tensor:
            if not a.is_contiguous():
                a = a.contiguous()
            s = torch.empty_like(s_like)
            if call(a.data_ptr(), s.data_ptr(), None, None, code):
                return ops.non_finite("svd", a, 1, lambda: torch.linalg.svdvals(a))
            return s

        return vals
    u_like = torch.empty((*batch, m, m if full_matrices else k), dtype=dtype)
    vh_like = torch.empty((*batch, n if full_matrices else k, n), dtype=dtype)

    def run(a: torch.Tensor) -> Any:
        if not a.is_contiguous():
            a = a.contiguous()
        u, s, vh = torch.empty_like(u_like), torch.empty_like(s_like), torch.empty_like(vh_like)
        if call(a.data_ptr(), s.data_ptr(), u.data_ptr(), vh.data_ptr(), code):
            return ops.non_finite("svd", a, 1, lambda: torch.linalg.svd(a, full_matrices))
        return _rt.linalg_svd((u, s, vh))

    return run


def eigh_plan(
    shape: torch.Size,
    dtype: torch.dtype,
    upper: bool,
    compute_v: bool,
    tridiagonal: bool | None = None,
) -> Callable[[torch.Tensor], Any]:
    """``eigh`` (``linalg_eigh`` named tuple) or, without ``compute_v``, ``eigvalsh`` (L).

    ``tridiagonal``: run the tridiagonal QL worker (flag 3 of ``tp_eigh1``, flag 2 of
    ``tp_ceigh1``) instead of cyclic Jacobi; None = from ``EIGH_TRIDIAGONAL_FROM[dtype]`` on."""
    _, n = _check_plan(shape)
    call = _call(dtype, "eigh1")
    if tridiagonal is None:
        tridiagonal = n >= EIGH_TRIDIAGONAL_FROM[dtype]
    if dtype.is_complex:
        code = _code(0, n, upper, compute_v, tridiagonal)
    else:
        code = _code(0, n, upper, compute_v, bool(kernels.EIGH_ORDER), tridiagonal)
    lam_like = torch.empty(shape[:-1], dtype=dtype.to_real())
    uplo = "U" if upper else "L"
    if not compute_v:

        def vals(a: torch.Tensor) -> torch.Tensor:
            if not a.is_contiguous():
                a = a.contiguous()
            lam = torch.empty_like(lam_like)
            if call(a.data_ptr(), lam.data_ptr(), None, code):
                m, bad = ops.read_triangle(a.view(1, n, n), upper)  # unread triangle's NaN/inf
                if bad or call(m.data_ptr(), lam.data_ptr(), None, code):
                    return ops.non_finite("eigh", a, 1, lambda: torch.linalg.eigvalsh(a, uplo))
            return lam

        return vals
    q_like = torch.empty(shape, dtype=dtype)

    def run(a: torch.Tensor) -> Any:
        if not a.is_contiguous():
            a = a.contiguous()
        lam, q = torch.empty_like(lam_like), torch.empty_like(q_like)
        if call(a.data_ptr(), lam.data_ptr(), q.data_ptr(), code):
            m, bad = ops.read_triangle(a.view(1, n, n), upper)  # unread triangle's NaN/inf
            if bad or call(m.data_ptr(), lam.data_ptr(), q.data_ptr(), code):
                return ops.non_finite("eigh", a, 1, lambda: torch.linalg.eigh(a, uplo))
        return _rt.linalg_eigh((lam, q))

    return run


def qr_plan(shape: torch.Size, dtype: torch.dtype, mode: str) -> Callable[[torch.Tensor], Any]:
    """``qr`` in ``mode`` reduced, complete or r (``linalg_qr`` named tuple; Q empty for r)."""
    m, n = _check_plan(shape)
    k, batch = min(m, n), shape[:-2]
    complete, wantq = mode == "complete", mode != "r"
    call = _call(dtype, "qr1")
    code = _code(m, n, wantq, complete)
    r_like = torch.empty((*batch, m if complete else k, n), dtype=dtype)
    q_like = torch.empty((*batch, m, m if complete else k) if wantq else (0,), dtype=dtype)

    def run(a: torch.Tensor) -> Any:
        if not a.is_contiguous():
            a = a.contiguous()
        q, r = torch.empty_like(q_like), torch.empty_like(r_like)
        call(a.data_ptr(), q.data_ptr(), r.data_ptr(), code)
        return _rt.linalg_qr((q, r))

    return run


# fail(op, A, info): raise for a factorization that stopped (info: int32, A's batch shape)
Fail = Callable[[str, torch.Tensor, torch.Tensor], None]


def cholesky_plan(
    shape: torch.Size, dtype: torch.dtype, upper: bool, fail: Fail
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``cholesky``: the factor, or ``fail("cholesky", A, info)`` when it stopped."""
    _, n = _check_plan(shape)
    call = _call(dtype, "chol1")
    code = _code(0, n, upper)

    def run(a: torch.Tensor) -> torch.Tensor:
        if not a.is_contiguous():
            a = a.contiguous()
        out = torch.empty_like(a)
        minor = call(a.data_ptr(), out.data_ptr(), None, code)
        if minor:
            fail("cholesky", a, torch.full(shape[:-2], minor, dtype=torch.int32))
        return out

    return run


def cholesky_ex_plan(
    shape: torch.Size, dtype: torch.dtype, upper: bool, fail: Fail
) -> Callable[[torch.Tensor, bool], Any]:
    """``cholesky_ex(A, check_errors)``: (factor, info) as ``linalg_cholesky_ex``, or
    ``fail("cholesky_ex", A, info)`` when it stopped and ``check_errors``."""
    _, n = _check_plan(shape)
    call = _call(dtype, "chol1")
    code = _code(0, n, upper)
    info_like = torch.empty(shape[:-2], dtype=torch.int32)

    def run(a: torch.Tensor, check_errors: bool) -> Any:
        if not a.is_contiguous():
            a = a.contiguous()
        out, info = torch.empty_like(a), torch.empty_like(info_like)
        if call(a.data_ptr(), out.data_ptr(), info.data_ptr(), code) and check_errors:
            fail("cholesky_ex", a, info)
        return _rt.linalg_cholesky_ex((out, info))

    return run
