"""Native batched complex64/complex128 Householder QR and Cholesky.

One C source, built for ``float _Complex`` and ``double _Complex`` (the toolchain, disk cache and
prelude of :mod:`torchport.native`, as :mod:`~torchport.linalg.kernels`); one matrix per thread
at a time, parallel over the batch with OpenMP, scalar complex arithmetic (gcc's
``-fcx-limited-range``: products and quotients inline, without the C99 NaN/Inf recovery calls,
which the algorithms below never need: a quotient's divisor is real or bounded away from zero).
The plain-torch references are ``qr_reference`` and ``cholesky_reference`` of
:mod:`torchport.linalg.reference` (the real algorithms with conjugates where complex needs them);
the numerics match LAPACK's ``zgeqrf``/``zungqr`` and ``zpotrf``:

- **QR**: reflector j maps column j's tail x to β e₁ with β = −sign(Re x₀)·‖x‖ *real* (+0 and −0
  counted positive, as the LAPACK behind ``torch.linalg.qr`` gives it)
  (``zlarfg``): τ = (β − x₀)/β, v = (1, x₁.. / (x₀ − β)), H = I − τ v vᴴ; R = H_kᴴ…H_1ᴴ A, so R's
  diagonal is real, as ``torch.linalg.qr`` gives it, and Q = H_1…H_k (backward accumulation,
  only if asked for). A column whose tail is zero and whose x₀ is real gets τ = 0 (x₀ kept);
  a non-real x₀ still gets a reflector (even for the last row), which makes R's diagonal real.
  The input is scaled by a power of four that brings its largest |Re|, |Im| into [1, 4) (exact,
  as the real kernel), R scaled back; each reflector is then computed on its column scaled by a
  power of two (largest |Re|, |Im| in [1, 2)), as zlarfg's scaled norm, so that a column far
  below the matrix's largest entry does not underflow to β = 0.
- **Cholesky**: A = L Lᴴ, row by row (Cholesky–Banachiewicz) for n ≤ 4, right-looking above
  (the same sums in another order, vectorised without reductions); only the lower triangle is read
  (the upper one, conjugated, when ``upper``; the result is then U = Lᴴ), and only the real part
  of the diagonal. A pivot Re a_ii − Σ|l_ik|² that is not > 0 (NaN included) stops the matrix
  with ``info`` = the order of the failing leading minor and a zero factor.

``tp_cqr1`` and ``tp_cchol1`` run the same (non-inlined) workers on one matrix, without a thread
team, for :mod:`torchport.linalg.one`.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable

import torch

from torchport import native
from torchport.linalg import kernels
from torchport.linalg._cparams import launcher, one_code_c, scalar_params
from torchport.native import Kernel

DTYPES = (torch.complex64, torch.complex128)
_TAG = {torch.complex64: "c64", torch.complex128: "c128"}
# The largest max(m, n) the one-matrix entry points (tp_cqr1, tp_cchol1) take: the real ones'.
ONE_MAX_N = kernels.ONE_MAX_N

_SOURCE = r"""
#include <stdlib.h>
typedef ${relem} T;
typedef ${celem} TC;
#define TSQRT ${sqrt}
#define TFABS ${fabs}

TP_INLINE TC cmake(T re, T im) { TC z; __real__ z = re; __imag__ z = im; return z; }
TP_INLINE TC cconj(TC z) { return cmake(__real__ z, -__imag__ z); }
TP_INLINE T cabs2(TC z) { return __real__ z * __real__ z + __imag__ z * __imag__ z; }

/* sum_i conj(x_i) y_i */
TP_INLINE TC cdotc(const TC *x, const TC *y, int64_t n) {
    T sr = 0, si = 0;
    #pragma omp simd reduction(+:sr, si)
    for (int64_t i = 0; i < n; ++i) {
        T xr = __real__ x[i], xi = __imag__ x[i], yr = __real__ y[i], yi = __imag__ y[i];
        sr += xr * yr + xi * yi;
        si += xr * yi - xi * yr;
    }
    return cmake(sr, si);
}

/* y -= w x */
TP_INLINE void caxpy_sub(TC w, const TC *x, TC *y, int64_t n) {
    const T wr = __real__ w, wi = __imag__ w;
    #pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        T xr = __real__ x[i], xi = __imag__ x[i];
        y[i] = cmake(__real__ y[i] - (wr * xr - wi * xi), __imag__ y[i] - (wr * xi + wi * xr));
    }
}

/* ---------------------------------------------------------------- QR (Householder, zgeqrf) */
TP_INLINE void cqr_one(const TC *a, TC *Q, TC *R, int64_t m, int64_t n, int wantq, int complete,
                       TC *C, TC *Qc, TC *tau) {
    const int64_t k = TP_MIN(m, n);
    T amax = 0;
    for (int64_t i = 0; i < m * n; ++i) amax = TP_MAX(amax, TP_MAX(TFABS(__real__ a[i]), TFABS(__imag__ a[i])));
    int ex = TP_SCALE_EXP(amax);
    ex -= ex & 1;
    const T fac = (T)ldexp(1.0, -ex), back = (T)ldexp(1.0, ex);
    for (int64_t i = 0; i < m; ++i) for (int64_t j = 0; j < n; ++j) C[j * m + i] = a[i * n + j] * fac;
    for (int64_t j = 0; j < k; ++j) {
        TC *x = C + j * m + j;
        const int64_t len = m - j;
        /* The column scaled by cs = 2^-e (max |Re|, |Im| into [1, 2)) for its norm, as zlarfg
           (dznrm2, dlapy3): after the matrix-wide scaling a column far below the largest entry
           has squares that underflow, and a tiny non-real x0 then gave beta = 0 and 0/0 in tau
           and 1/(x0 - beta). tau and v are invariant under the scaling; beta is scaled back. */
        T cmax = 0;
        for (int64_t i = 0; i < len; ++i)
            cmax = TP_MAX(cmax, TP_MAX(TFABS(__real__ x[i]), TFABS(__imag__ x[i])));
        const int ce = TP_SCALE_EXP(cmax);
        const T cs = (T)ldexp(1.0, -ce);
        T xn2 = 0;
        for (int64_t i = 1; i < len; ++i) xn2 += cabs2(x[i] * cs);
        const T ar = __real__ x[0] * cs, ai = __imag__ x[0] * cs;
        /* (xn2 == 0 with a non-zero tail: squares below the underflow threshold relative to x0,
           negligible. Past this test cmax > 0, so the largest scaled entry has modulus >= 1
           (>= 2^-23 for a float column of subnormals) and |beta| >= it: no division by 0.) */
        if (xn2 == 0 && __imag__ x[0] == 0) { tau[j] = 0; continue; }
        T beta = TSQRT(ar * ar + ai * ai + xn2);
        if (!(ar < 0)) beta = -beta; /* zlarfg: -SIGN(norm, Re x0), +0 and -0 counting as positive */
        tau[j] = cmake((beta - ar) / beta, -ai / beta);
        /* 1 / (x0 - beta) = cs conj(d) / |d|^2 on the scaled column, |d| >= |beta| > 0: the tail
           scaled first, so that no factor overflows for a column of subnormals */
        const T dr = ar - beta, d2 = dr * dr + ai * ai;
        const TC sc = cmake(dr / d2, -ai / d2);
        for (int64_t i = 1; i < len; ++i) x[i] = (x[i] * cs) * sc;
        x[0] = 1;
        const TC ct = cconj(tau[j]);
        for (int64_t l = j + 1; l < n; ++l) {
            TC *y = C + l * m + j;
            caxpy_sub(ct * cdotc(x, y, len), x, y, len);
        }
        x[0] = beta * (T)ldexp(1.0, ce);
    }
    const int64_t rrows = complete ? m : k;
    for (int64_t i = 0; i < rrows; ++i)
        for (int64_t l = 0; l < n; ++l) R[i * n + l] = l >= i ? C[l * m + i] * back : 0;
    if (!wantq) return;
    const int64_t qc = complete ? m : k;
    for (int64_t c = 0; c < qc; ++c) { for (int64_t i = 0; i < m; ++i) Qc[c * m + i] = 0; Qc[c * m + c] = 1; }
    for (int64_t j = k - 1; j >= 0; --j) {
        if (__real__ tau[j] == 0 && __imag__ tau[j] == 0) continue;
        TC *x = C + j * m + j;
        const int64_t len = m - j;
        const TC save = x[0];
        x[0] = 1;
        for (int64_t c = j; c < qc; ++c) {
            TC *y = Qc + c * m + j;
            caxpy_sub(tau[j] * cdotc(x, y, len), x, y, len);
        }
        x[0] = save;
    }
    for (int64_t i = 0; i < m; ++i) for (int64_t c = 0; c < qc; ++c) Q[i * qc + c] = Qc[c * m + i];
}

/* one matrix, constant-size copies for 2, 3 and 4; not inlined, so that the batched and the
   one-matrix entry points run the same machine code (equal results bit for bit) */
static __attribute__((noinline)) void cqr_run(const TC *a, TC *Q, TC *R, int64_t m, int64_t n,
                                              int wantq, int complete, TC *C, TC *Qc, TC *tau) {
    if (m == 2 && n == 2) cqr_one(a, Q, R, 2, 2, wantq, complete, C, Qc, tau);
    else if (m == 3 && n == 3) cqr_one(a, Q, R, 3, 3, wantq, complete, C, Qc, tau);
    else if (m == 4 && n == 4) cqr_one(a, Q, R, 4, 4, wantq, complete, C, Qc, tau);
    else cqr_one(a, Q, R, m, n, wantq, complete, C, Qc, tau);
}

TP_EXPORT int tp_cqr(const TC *a, TC *Q, TC *R, int64_t B, int64_t m, int64_t n, int64_t wantq,
                     int64_t complete, int64_t nthreads) {
    const int64_t k = TP_MIN(m, n), qc = complete ? m : k, rrows = complete ? m : k;
    const int64_t qsz = wantq ? m * qc : 0, rsz = rrows * n;
    /* a complex flop is ~4 real ones: the real kernel's 20000 threshold divided by 4 */
    int64_t nt = (B < 2 || B * m * n * k < 5000) ? 1 : nthreads;
    #pragma omp parallel num_threads(nt)
    {
        TC *C = (TC *)malloc(sizeof(TC) * (m * n + m * m + k + 8));
        TC *Qc = C + m * n, *tau = Qc + m * m;
        int64_t chunk = TP_MAX(1, B / (nt * 8));
        #pragma omp for schedule(dynamic, chunk)
        for (int64_t b = 0; b < B; ++b)
            cqr_run(a + b * m * n, Q + b * qsz, R + b * rsz, m, n, (int)wantq, (int)complete, C, Qc, tau);
        free(C);
    }
    return 0;
}

/* ---------------------------------------------------------------- Cholesky (zpotrf)
   Two orders of the same sums: row by row (Cholesky-Banachiewicz, a dot product per entry) for
   n <= 4, right-looking above (column j scaled, then the trailing lower triangle updated by
   contiguous row axpys, no reductions): 1.3x / 1.6x / 2.0x faster at n = 8 / 16 / 32 on one
   thread, 0.88x at n = 4. */
TP_INLINE int32_t cchol_rows(const TC *a, TC *out, int64_t n, int upper, TC *Lw) {
    for (int64_t i = 0; i < n; ++i) {
        TC *Li = Lw + i * n;
        for (int64_t j = 0; j < i; ++j) {
            /* A's (i, j) entry from the lower triangle, or conj of (j, i) from the upper */
            TC s = upper ? cconj(a[j * n + i]) : a[i * n + j];
            s -= cconj(cdotc(Li, Lw + j * n, j));
            Li[j] = s * ((T)1 / __real__ Lw[j * n + j]);
        }
        T s = __real__ a[i * n + i];
        for (int64_t l = 0; l < i; ++l) s -= cabs2(Li[l]);
        if (!(s > 0)) {
            for (int64_t r = 0; r < n * n; ++r) out[r] = 0;
            return (int32_t)(i + 1);
        }
        Li[i] = TSQRT(s);
    }
    if (!upper) {
        for (int64_t i = 0; i < n; ++i) for (int64_t j = 0; j < n; ++j) out[i * n + j] = j <= i ? Lw[i * n + j] : 0;
    } else {
        for (int64_t i = 0; i < n; ++i) for (int64_t j = 0; j < n; ++j) out[i * n + j] = j >= i ? cconj(Lw[j * n + i]) : 0;
    }
    return 0;
}

TP_INLINE int32_t cchol_right(const TC *a, TC *out, int64_t n, int upper, TC *W) {
    TC *c = W + n * n; /* conj of the finished column j below the diagonal */
    for (int64_t i = 0; i < n; ++i) {
        for (int64_t l = 0; l < i; ++l) W[i * n + l] = upper ? cconj(a[l * n + i]) : a[i * n + l];
        W[i * n + i] = __real__ a[i * n + i];
    }
    for (int64_t j = 0; j < n; ++j) {
        const T s = __real__ W[j * n + j];
        if (!(s > 0)) {
            for (int64_t r = 0; r < n * n; ++r) out[r] = 0;
            return (int32_t)(j + 1);
        }
        const T d = TSQRT(s), inv = (T)1 / d;
        W[j * n + j] = d;
        for (int64_t i = j + 1; i < n; ++i) { W[i * n + j] *= inv; c[i] = cconj(W[i * n + j]); }
        /* trailing update A[i][l] -= L[i][j] conj(L[l][j]), j < l <= i: contiguous in l */
        for (int64_t i = j + 1; i < n; ++i) {
            const TC w = W[i * n + j];
            caxpy_sub(w, c + j + 1, W + i * n + j + 1, i - j);
        }
    }
    if (!upper) {
        for (int64_t i = 0; i < n; ++i) for (int64_t j = 0; j < n; ++j) out[i * n + j] = j <= i ? W[i * n + j] : 0;
    } else {
        for (int64_t i = 0; i < n; ++i) for (int64_t j = 0; j < n; ++j) out[i * n + j] = j >= i ? cconj(W[j * n + i]) : 0;
    }
    return 0;
}

/* one matrix: row by row (constant-size copies) to n = 4, right-looking above; not inlined
   (see cqr_run). Lw: n * n + n + 8 elements. */
static __attribute__((noinline)) int32_t cchol_run(const TC *a, TC *out, int64_t n, int upper, TC *Lw) {
    if (n == 1) return cchol_rows(a, out, 1, upper, Lw);
    if (n == 2) return cchol_rows(a, out, 2, upper, Lw);
    if (n == 3) return cchol_rows(a, out, 3, upper, Lw);
    if (n == 4) return cchol_rows(a, out, 4, upper, Lw);
    return cchol_right(a, out, n, upper, Lw);
}

TP_EXPORT int tp_ccholesky(const TC *a, TC *out, int32_t *info, int64_t B, int64_t n, int64_t upper,
                           int64_t nthreads) {
    int64_t nt = (B < 2 || B * n * n * n < 15000) ? 1 : nthreads;
    int64_t bad = INT64_MAX;
    #pragma omp parallel num_threads(nt) reduction(min:bad)
    {
        TC *Lw = (TC *)malloc(sizeof(TC) * (n * n + n + 8));
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < B; ++b) {
            const int32_t st = cchol_run(a + b * n * n, out + b * n * n, n, (int)upper, Lw);
            info[b] = st;
            if (st && b < bad) bad = b;
        }
        free(Lw);
    }
    return bad == INT64_MAX ? 0 : (int)TP_MIN(bad + 1, 2147483647);
}

/* ---------------------------------------------------------------- one matrix (B = 1)
   The workers on one matrix of max(m, n) <= ONE_MAX_N, no thread team, scratch on the stack;
   ``code`` packs m | n << 8 | flag i << (16 + i) (torchport.linalg.one._code); -1 for sizes out
   of range. */
${one_code}

/* flags: 0 wantq, 1 complete; returns 0 */
TP_EXPORT int tp_cqr1(const TC *a, TC *Q, TC *R, int64_t code) {
    const int64_t m = ONE_M(code), n = ONE_N(code), k = TP_MIN(m, n);
    if (k < 1 || TP_MAX(m, n) > ONE_MAX_N) return -1;
    TC C[m * n + m * m + k + 8];
    cqr_run(a, Q, R, m, n, ONE_F(code, 0), ONE_F(code, 1), C, C + m * n, C + m * n + m * m);
    return 0;
}

/* flag 0: upper; returns the order of the failing leading minor (0: factored), also stored to
   *info when info is not NULL */
TP_EXPORT int tp_cchol1(const TC *a, TC *out, int32_t *info, int64_t code) {
    const int64_t n = ONE_N(code);
    if (n < 1 || n > ONE_MAX_N) return -1;
    TC Lw[n * n + n + 8];
    const int32_t st = cchol_run(a, out, n, ONE_F(code, 0), Lw);
    if (info) *info = st;
    return st;
}
"""

# Part of the autotuner's key for complex problems (``torchport.linalg._tune``).
SOURCE_TAG = hashlib.sha256(_SOURCE.encode()).hexdigest()[:12]


@functools.cache
def library(dtype: torch.dtype, isa: str) -> dict[str, Kernel]:
    """Build (or load from the disk cache) the complex kernels for one dtype; keyed by op name."""
    assert dtype in DTYPES, dtype
    real = scalar_params(dtype.to_real(), 0)  # the real part's C names (no sweeps here)
    src = native.render(
        _SOURCE,
        relem=real["elem"],
        celem=f"{real['elem']} _Complex",
        sqrt=real["sqrt"],
        fabs=real["fabs"],
        one_code=one_code_c(ONE_MAX_N),
    )
    lib = native.build(
        src, name=f"linalg_cfac_{_TAG[dtype]}_{isa}", isa=isa, extra_flags=("-fcx-limited-range",)
    )
    return {
        "qr": launcher(lib, "tp_cqr", dtype, "A Q R", "B m n wantq complete nthreads"),
        "cholesky": launcher(lib, "tp_ccholesky", dtype, "A L info", "B n upper nthreads"),
        # one matrix, sizes and flags packed in ``code`` (torchport.linalg.one)
        "qr1": launcher(lib, "tp_cqr1", dtype, "A Q R", "code"),
        "chol1": launcher(lib, "tp_cchol1", dtype, "A L info", "code"),
    }


def _ks(dtype: torch.dtype) -> dict[str, Kernel]:
    return library(dtype, native.cpu_info().isa)


# --- launchers: (B, m, n) contiguous complex input → outputs, as kernels.qr / kernels.cholesky ---


def qr(a: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched complex Householder QR of ``a`` (B, m, n) for ``mode`` in reduced/complete/r."""
    assert a.dim() == 3 and a.is_contiguous() and not a.is_conj() and a.dtype in DTYPES
    q, r, work = kernels.qr_outputs(a, mode)
    if not work:
        return q, r
    b, m, n = a.shape
    wantq, complete = mode != "r", mode == "complete"
    _ks(a.dtype)["qr"].call_unchecked(
        a.data_ptr(), q.data_ptr(), r.data_ptr(), b, m, n, int(wantq), int(complete),
        native.num_threads(),
    )  # fmt: skip
    return q, r


def qr_plan(
    b: int, m: int, n: int, dtype: torch.dtype, mode: str, batch: tuple[int, ...] | None = None
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """:func:`qr`'s launcher for ``b`` matrices of m × n (all ≥ 1), resolved once, with
    ``kernels.qr_plan``'s contract (outputs shaped with batch shape ``batch``)."""
    assert b >= 1 and m >= 1 and n >= 1 and mode in ("reduced", "complete", "r")
    k = min(m, n)
    complete, wantq = mode == "complete", mode != "r"
    bs = (b,) if batch is None else tuple(batch)
    r_shape = (*bs, m if complete else k, n)
    q_shape = (*bs, m, m if complete else k) if wantq else (0,)
    call = _ks(dtype)["qr"].call_unchecked
    wq, cp = int(wantq), int(complete)
    nthreads = torch.get_num_threads

    def run(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not a.is_contiguous():
            a = a.contiguous()
        q, r = torch.empty(q_shape, dtype=dtype), torch.empty(r_shape, dtype=dtype)
        call(a.data_ptr(), q.data_ptr(), r.data_ptr(), b, m, n, wq, cp, max(1, nthreads()))
        return q, r

    return run


def cholesky(a: torch.Tensor, upper: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Batched complex Cholesky of ``a`` (B, n, n): factor, int32 info (B,), first failing
    index + 1 (0 when every matrix succeeded)."""
    assert a.dim() == 3 and a.is_contiguous() and not a.is_conj() and a.dtype in DTYPES
    b, n, _ = a.shape
    out = a.new_empty((b, n, n))
    info = torch.zeros((b,), dtype=torch.int32)
    if b == 0 or n == 0:
        return out, info, 0
    bad = _ks(a.dtype)["cholesky"].call_unchecked(
        a.data_ptr(), out.data_ptr(), info.data_ptr(), b, n, int(upper), native.num_threads()
    )
    return out, info, bad


def cholesky_plan(
    b: int, n: int, dtype: torch.dtype, upper: bool, batch: tuple[int, ...] | None = None
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, int]]:
    """:func:`cholesky`'s launcher for ``b`` matrices of order n ≥ 1, resolved once, with
    ``kernels.cholesky_plan``'s contract (info shaped ``batch``)."""
    assert b >= 1 and n >= 1
    call = _ks(dtype)["cholesky"].call_unchecked
    up = int(upper)
    info_like = torch.empty((b,) if batch is None else batch, dtype=torch.int32)
    nthreads = torch.get_num_threads

    def run(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        if not a.is_contiguous():
            a = a.contiguous()
        out = torch.empty_like(a)
        info = torch.empty_like(info_like)
        bad = call(a.data_ptr(), out.data_ptr(), info.data_ptr(), b, n, up, max(1, nthreads()))
        return out, info, bad

    return run
