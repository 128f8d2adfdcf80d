"""Blocked (right-looking) batched Cholesky for n ≳ 32: panel, triangular solve, trailing update.

Each thread factors whole matrices of the batch, one at a time, in a private padded copy ``W``
(row-major, lower triangle). For each panel of ``nb`` columns starting at k0:

1. the ``kb × kb`` diagonal block is factored in place (Cholesky–Banachiewicz, one division per
   pivot: the rest multiply by the reciprocal); a pivot that is not > 0 (or NaN) stops the matrix
   with ``info`` = the order of the failing leading minor, as LAPACK's ``potrf``;
2. the panel below it is copied transposed into ``Pt`` (``Pt[p][i] = W[k0+kb+i][k0+p]``) and solved
   against the diagonal block (``L21 = A21 L11⁻ᵀ``) with vectors along the rows i;
3. the trailing lower triangle is updated, ``A22 -= L21 L21ᵀ``, by a register-blocked kernel:
   4 rows × 2 vectors of columns (8 float32 / 4 float64 lanes each) held in 8 accumulators over
   the panel's kb columns, one broadcast per row and two vector loads per column step.

The reference :func:`torchport.linalg.reference.cholesky_blocked_reference` runs the same three
steps with torch ops over the batch. Rounding differs from the unblocked kernel only in the order
of the dot-product sums (each panel's contribution is subtracted as one partial sum), so the two
agree to a few ulps times n; failing minors are found at the same order.

The vector width is that of AVX2 (32 bytes) or AVX-512 (64 bytes) by the build's ISA; gcc vector
extensions lower it to SSE/scalar code for the scalar build.
"""

from __future__ import annotations

import functools
import hashlib

import torch

from torchport import native
from torchport.linalg._cparams import launcher
from torchport.native import Kernel

# Panel width (columns per panel): measured single-threaded at n = 24…256 (both dtypes), 8 was
# best below n ≈ 48, where the scalar diagonal block dominates, 16 above; 32 was slower everywhere.
NB = 16
NB_SMALL, NB_SMALL_BELOW = 8, 48
# Order from which kernels.cholesky uses this kernel when the lane kernel does not apply (a
# batch too small to fill the SIMD lanes, or n > kernels.CHOLESKY_LANES_MAX_N). Measured
# single-threaded: 3-10x the unblocked kernel's GFLOP/s from n = 24 up.
BLOCKED_FROM = 17

_SOURCE = r"""
typedef ${elem} T;
#define TSQRT ${sqrt}
#define NB_MAX 64
#define VB ${vbytes}
typedef T VT __attribute__((vector_size(VB)));
#define VL ((int64_t)(VB / sizeof(T)))

TP_INLINE VT vload(const T *p) { VT v; memcpy(&v, p, sizeof v); return v; }
TP_INLINE void vstore(T *p, VT v) { memcpy(p, &v, sizeof v); }

/* A22 -= L21 L21^T on the lower triangle of the m x m trailing block C (leading dimension ld),
   L21 stored transposed in Pt (kb rows of length >= m + 2 VL, zero past m). Tiles of 4 rows x
   2 VL columns; a tile reaching past the diagonal also updates entries above it (never read) and
   past column m (Pt is zero there, so they are unchanged). */
TP_INLINE void syrk_lower(T *C, const T *Pt, int64_t m, int64_t kb, int64_t ld) {
    int64_t i = 0;
    for (; i + 4 <= m; i += 4) {
        for (int64_t j = 0; j < i + 4; j += 2 * VL) {
            VT c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0}, c30 = {0}, c31 = {0};
            for (int64_t p = 0; p < kb; ++p) {
                const T *row = Pt + p * ld;
                VT b0 = vload(row + j), b1 = vload(row + j + VL);
                T a0 = row[i], a1 = row[i + 1], a2 = row[i + 2], a3 = row[i + 3];
                c00 += a0 * b0; c01 += a0 * b1;
                c10 += a1 * b0; c11 += a1 * b1;
                c20 += a2 * b0; c21 += a2 * b1;
                c30 += a3 * b0; c31 += a3 * b1;
            }
            T *r0 = C + i * ld + j;
            vstore(r0, vload(r0) - c00); vstore(r0 + VL, vload(r0 + VL) - c01);
            r0 += ld; vstore(r0, vload(r0) - c10); vstore(r0 + VL, vload(r0 + VL) - c11);
            r0 += ld; vstore(r0, vload(r0) - c20); vstore(r0 + VL, vload(r0 + VL) - c21);
            r0 += ld; vstore(r0, vload(r0) - c30); vstore(r0 + VL, vload(r0 + VL) - c31);
        }
    }
    for (; i < m; ++i) {
        for (int64_t j = 0; j <= i; j += 2 * VL) {
            VT c0 = {0}, c1 = {0};
            for (int64_t p = 0; p < kb; ++p) {
                const T *row = Pt + p * ld;
                T a = row[i];
                c0 += a * vload(row + j); c1 += a * vload(row + j + VL);
            }
            T *r0 = C + i * ld + j;
            vstore(r0, vload(r0) - c0); vstore(r0 + VL, vload(r0 + VL) - c1);
        }
    }
}

/* One matrix, panels of nb <= NB_MAX columns; W is n x ld and Pt nb x ld, private to the thread.
   Returns info. */
TP_INLINE int32_t chol_blocked_one(const T *a, T *out, int64_t n, int upper, int64_t nb, T *W, T *Pt,
                                   int64_t ld) {
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j <= i; ++j) W[i * ld + j] = upper ? a[j * n + i] : a[i * n + j];
    T inv[NB_MAX];
    int32_t info = 0;
    for (int64_t k0 = 0; k0 < n && !info; k0 += nb) {
        const int64_t kb = TP_MIN(nb, n - k0), r0 = k0 + kb, m = n - r0;
        /* 1. diagonal block */
        for (int64_t j = 0; j < kb && !info; ++j) {
            T *Lj = W + (k0 + j) * ld + k0;
            T s = Lj[j];
            for (int64_t p = 0; p < j; ++p) s -= Lj[p] * Lj[p];
            if (!(s > 0)) { info = (int32_t)(k0 + j + 1); break; }
            T d = TSQRT(s);
            Lj[j] = d;
            inv[j] = (T)1 / d;
            for (int64_t i = j + 1; i < kb; ++i) {
                T *Li = W + (k0 + i) * ld + k0;
                T x = Li[j];
                for (int64_t p = 0; p < j; ++p) x -= Li[p] * Lj[p];
                Li[j] = x * inv[j];
            }
        }
        if (info || m == 0) break;
        /* 2. panel, transposed into Pt, solved with vectors along the rows */
        const int64_t mv = (m + VL - 1) / VL * VL;
        for (int64_t p = 0; p < kb; ++p) {
            T *pt = Pt + p * ld;
            for (int64_t i = 0; i < m; ++i) pt[i] = W[(r0 + i) * ld + k0 + p];
            for (int64_t i = m; i < m + 2 * VL; ++i) pt[i] = 0;
        }
        for (int64_t j = 0; j < kb; ++j) {
            const T *Lj = W + (k0 + j) * ld + k0;
            T *pj = Pt + j * ld;
            for (int64_t i = 0; i < mv; i += VL) {
                VT x = vload(pj + i);
                for (int64_t p = 0; p < j; ++p) x -= Lj[p] * vload(Pt + p * ld + i);
                vstore(pj + i, x * inv[j]);
            }
        }
        for (int64_t p = 0; p < kb; ++p)  /* final L21 back into W */
            for (int64_t i = 0; i < m; ++i) W[(r0 + i) * ld + k0 + p] = Pt[p * ld + i];
        /* 3. trailing update */
        syrk_lower(W + r0 * ld + r0, Pt, m, kb, ld);
    }
    if (info) {
        for (int64_t r = 0; r < n * n; ++r) out[r] = 0;
        return info;
    }
    if (!upper) {
        for (int64_t i = 0; i < n; ++i) for (int64_t j = 0; j < n; ++j) out[i * n + j] = j <= i ? W[i * ld + j] : 0;
    } else {
        for (int64_t i = 0; i < n; ++i) for (int64_t j = 0; j < n; ++j) out[i * n + j] = j >= i ? W[j * ld + i] : 0;
    }
    return 0;
}

TP_EXPORT int tp_cholesky_blocked(const T *a, T *out, int32_t *info, int64_t B, int64_t n,
                                  int64_t upper, int64_t nb, int64_t nthreads) {
    nb = TP_MAX(1, TP_MIN(nb, NB_MAX));
    const int64_t ld = (n + VL - 1) / VL * VL + 3 * VL;
    int64_t nt = (B < 2 || B * n * n * n < 200000) ? 1 : nthreads;
    int64_t bad = INT64_MAX;
    #pragma omp parallel num_threads(nt) reduction(min:bad)
    {
        T *W = (T *)aligned_alloc(64, sizeof(T) * (n + NB_MAX + 4) * ld);
        T *Pt = W + n * ld;
        memset(W, 0, sizeof(T) * (n + NB_MAX + 4) * ld);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < B; ++b) {
            int32_t st = chol_blocked_one(a + b * n * n, out + b * n * n, n, (int)upper, nb, W, Pt, ld);
            info[b] = st;
            if (st && b < bad) bad = b;
        }
        free(W);
    }
    return bad == INT64_MAX ? 0 : (int)TP_MIN(bad + 1, 2147483647);
}
"""

SOURCE_TAG = hashlib.sha256(_SOURCE.encode()).hexdigest()[:12]


@functools.cache
def library(dtype: torch.dtype, isa: str) -> Kernel:
    """Build (or load from the disk cache) the blocked Cholesky kernel for one dtype and ISA."""
    is64 = dtype == torch.float64
    src = native.render(
        "#include <stdlib.h>\n#include <string.h>\n" + _SOURCE,
        elem="double" if is64 else "float",
        sqrt="sqrt" if is64 else "sqrtf",
        vbytes="64" if isa == "avx512" else "32",
    )
    lib = native.build(src, name=f"linalg_chol_blocked_{'f64' if is64 else 'f32'}_{isa}", isa=isa)
    return launcher(lib, "tp_cholesky_blocked", dtype, "A L info", "B n upper nb nthreads")


def panel_width(n: int) -> int:
    """The measured panel width for order ``n`` (see :data:`NB`)."""
    return NB_SMALL if n < NB_SMALL_BELOW else NB


def cholesky_blocked(
    a: torch.Tensor, upper: bool, nb: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Blocked Cholesky of ``a`` (B, n, n), contiguous: factor, int32 info (B,), first bad + 1.

    ``nb``: panel width (1…64); None = :func:`panel_width`.
    """
    assert a.dim() == 3 and a.is_contiguous() and a.dtype in (torch.float32, torch.float64)
    b, n, _ = a.shape
    out = a.new_empty((b, n, n))
    info = torch.zeros((b,), dtype=torch.int32)
    if b == 0 or n == 0:
        return out, info, 0
    if nb is None:
        nb = panel_width(n)
    assert 1 <= nb <= 64
    bad = library(a.dtype, native.cpu_info().isa).call_unchecked(
        a.data_ptr(), out.data_ptr(), info.data_ptr(), b, n, int(upper), nb, native.num_threads()
    )
    return out, info, bad
