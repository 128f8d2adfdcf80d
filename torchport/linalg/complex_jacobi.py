"""Native batched Jacobi kernels for complex64/complex128: Hermitian eigh and one-sided SVD.

One C source, instantiated for ``float _Complex`` and ``double _Complex`` (the interleaved
(re, im) layout of torch's complex tensors); each kernel is parallel over the batch with OpenMP,
one matrix per thread at a time in per-thread scratch, as the real per-thread kernels of
:mod:`torchport.linalg.kernels` (same toolchain, cache and thread rule). The arithmetic is written
on the real and imaginary parts, so the rotation and inner-product loops are plain loops over
interleaved pairs that gcc vectorises (no ``__mulsc3`` calls). The plain-torch references are
``complex_eigh_reference`` and ``complex_svd_reference`` in :mod:`torchport.linalg.reference`;
the numerics both follow:

A complex rotation of a pair (x, y) is the unitary [[c, −z], [z̄, c]]: x ← c·x − z·y,
y ← z̄·x + c·y, z = s·f, with (c, s, t) the real Jacobi rotation of the pair's 2×2 problem
(``kernels``' ``rot_params``) and f a phase: the real rotation between the phase diag(1, f) that
makes the coupling real and its inverse, so it tends to the identity as s → 0 (no phase jump when
a pair is rotated once more near convergence, which keeps kernel and reference together).

- **eigh** (two-sided cyclic Jacobi on the Hermitian matrix built from the ``UPLO`` triangle, the
  imaginary part of the diagonal ignored as LAPACK does): pair (p, q) with a_pq = g·e,
  g = |a_pq|, is rotated while g > eps·max(sqrt|a_pp a_qq|, 0.1‖A‖_F), (c, s, t) from
  [[a_pp, g], [g, a_qq]]: rows p, q with f = e, columns the conjugates of the rows, the
  eigenvector columns of V (A = V Λ Vᴴ) with f = ē. Eigenvalues real, ascending.
- **SVD** (Hestenes): the q = min(m, n) vectors (columns of A, or conjugated rows when m < n, i.e.
  the columns of Aᴴ) are rotated pairwise until |w_jᴴ w_k| ≤ eps·sqrt(p)·‖w_j‖‖w_k‖: with
  g = w_jᴴ w_k, f = ḡ/|g| and (c, s, t) from (‖w_j‖², ‖w_k‖², |g|), on W and V alike (|g| and f
  from g's parts divided by the larger one when their squares near underflow, as for two null
  vectors, so that |f| = 1 to rounding; a pair whose test is not a clear "rotate", NaN or
  |g| = 0 included, is skipped; the running norms ‖w_j‖² − t|g|, ‖w_k‖² + t|g| are kept, the
  first recomputed when it is not > 0). S real descending; numerically null vectors
  (σ ≤ σ_max·p·eps) completed by complex Gram-Schmidt from the least represented unit vector;
  Vh = Vᴴ.
  Graded input (as ``kernels``' ``svd_graded``) keeps one power-of-two scale per vector.

Non-finite input stops that matrix; the launchers return 1 + the first such batch index, as the
real ones do. ``tp_csvd1`` and ``tp_ceigh1`` run the same (non-inlined) workers on one matrix,
without a thread team, for :mod:`torchport.linalg.one`; with flag 2 ``tp_ceigh1`` instead runs
Householder tridiagonalization (zhetrd-style, from the last row up), phases that make the
tridiagonal real, and the real implicit QL of :mod:`~torchport.linalg.kernels` (``tri_ql``,
shared C) on the rows of Vᵀ (reference: ``complex_eigh_tridiagonal_reference``), falling back
to Jacobi when the QL does not converge.
"""

from __future__ import annotations

import functools
import hashlib

import torch

from torchport import native
from torchport.linalg import kernels
from torchport.linalg._cparams import launcher, one_code_c, scalar_params
from torchport.native import Kernel

_TAG = {torch.complex64: "c64", torch.complex128: "c128"}
MAX_SWEEPS = 60
# The largest max(m, n) the one-matrix entry points (tp_csvd1, tp_ceigh1) take: the real ones'
# bound (stack scratch: at most 49 KiB, complex128 SVD of 32 x 32).
ONE_MAX_N = kernels.ONE_MAX_N

_SOURCE = r"""
typedef ${elem} T;
typedef ${elem} _Complex C;
#define EPS ((T)${eps})
#define TSQRT ${sqrt}
#define TFABS ${fabs}
#define MAX_SWEEPS ${max_sweeps}

/* Complex vectors are interleaved (re, im) arrays of T: element i is x[2i], x[2i + 1]. */

TP_INLINE T cnorm2(const T *x, int64_t n) {
    T s = 0;
    #pragma omp simd reduction(+:s)
    for (int64_t i = 0; i < 2 * n; ++i) s += x[i] * x[i];
    return s;
}

/* x^H y */
TP_INLINE void cdot(const T *x, const T *y, int64_t n, T *re, T *im) {
    T r = 0, s = 0;
    #pragma omp simd reduction(+:r, s)
    for (int64_t i = 0; i < n; ++i) {
        T xr = x[2 * i], xi = x[2 * i + 1], yr = y[2 * i], yi = y[2 * i + 1];
        r += xr * yr + xi * yi;
        s += xr * yi - xi * yr;
    }
    *re = r; *im = s;
}

/* x <- c x - (sr + i si) y, y <- (sr - i si) x + c y: the unitary rotation [[c, -z], [conj(z), c]]
   on the pair, z = s f for the real rotation's c, s and a phase f (identity as s -> 0) */
TP_INLINE void crot(T *x, T *y, int64_t n, T c, T sr, T si) {
    #pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        T xr = x[2 * i], xi = x[2 * i + 1], yr = y[2 * i], yi = y[2 * i + 1];
        x[2 * i] = c * xr - (sr * yr - si * yi); x[2 * i + 1] = c * xi - (sr * yi + si * yr);
        y[2 * i] = sr * xr + si * xi + c * yr; y[2 * i + 1] = sr * xi - si * xr + c * yi;
    }
}

/* crot with the two coefficients apart, for vectors held in different scales (x 2^e_x,
   y 2^e_y, d = e_y - e_x): x <- c x - (ar + i ai) y, y <- (br - i bi) x + c y, where
   a = z 2^d and b = z 2^-d */
TP_INLINE void crot2(T *x, T *y, int64_t n, T c, T ar, T ai, T br, T bi) {
    for (int64_t i = 0; i < n; ++i) {
        T xr = x[2 * i], xi = x[2 * i + 1], yr = y[2 * i], yi = y[2 * i + 1];
        x[2 * i] = c * xr - (ar * yr - ai * yi); x[2 * i + 1] = c * xi - (ar * yi + ai * yr);
        y[2 * i] = br * xr + bi * xi + c * yr; y[2 * i + 1] = br * xi - bi * xr + c * yi;
    }
}

/* Graded input (see kernels.py's svd_graded, which this follows): vectors whose largest
   |Re|, |Im| lies more than GRADED_BITS binary orders below the matrix's largest are held as
   w 2^e with that largest part in [1, 2), rescaled after every rotation; beyond GRADED_D the
   pair's rotation takes its first-order form. */
#define GRADED_BITS ((int)(sizeof(T) == 4 ? 48 : 480))
#define GRADED_D ((int)(sizeof(T) == 4 ? 32 : 256))

TP_INLINE int csvd_graded_input(const T *a, int64_t m, int64_t n) {
    const int trans = m < n;
    const int64_t p = trans ? n : m, q = trans ? m : n;
    T hi = 0, lo = (T)INFINITY;  /* the largest vector maximum, the smallest nonzero one */
    for (int64_t j = 0; j < q; ++j) {
        T mx = 0;
        for (int64_t i = 0; i < p; ++i) {
            const T *z = a + 2 * (trans ? j * n + i : i * n + j);
            mx = TP_MAX(mx, TP_MAX(TFABS(z[0]), TFABS(z[1])));
        }
        hi = TP_MAX(hi, mx);
        if (mx > 0) lo = TP_MIN(lo, mx);
    }
    return lo < (T)ldexp((double)hi, -GRADED_BITS);
}

/* Bring w's largest |Re|, |Im| into [1, 2) by a power of two (exact), adding it to *e; |w|^2. */
TP_INLINE T crenorm(T *w, int64_t p, int *e) {
    T mx = 0;
    for (int64_t i = 0; i < 2 * p; ++i) mx = TP_MAX(mx, TFABS(w[i]));
    if (mx == 0) return 0;
    const int d = ilogb(mx);
    if (d) {
        for (int64_t i = 0; i < 2 * p; ++i) w[i] = (T)ldexp((double)w[i], -d);
        *e += d;
    }
    return cnorm2(w, p);
}

/* g = |gr + i gi|, and (hr, hi, h) with (hr - i hi) / h = conj(g) / |g| of modulus 1 to rounding:
   (gr, gi, g) while the squares are well above underflow, else the parts divided by the larger
   one first. The inner product of two numerically null vectors is ~eps^2 of the matrix's scale
   (float: 1e-20), whose squares are subnormal: gr / g and gi / g then made a phase off modulus 1
   by percents, and Vh as far from unitary (complex64 rank-one input, n = 32: 1.7e-2). */
#define CTINY2 ((T)(sizeof(T) == 4 ? 1e-30 : 1e-280))
TP_INLINE T cmod(T gr, T gi, T *hr, T *hi, T *h) {
    const T r2 = gr * gr + gi * gi;
    if (!(r2 < CTINY2)) { *hr = gr; *hi = gi; return *h = TSQRT(r2); }  /* NaN too */
    const T mx = TP_MAX(TFABS(gr), TFABS(gi));
    if (mx == 0) { *hr = 0; *hi = 0; *h = 1; return 0; }
    *hr = gr / mx; *hi = gi / mx;
    *h = TSQRT(*hr * *hr + *hi * *hi);
    return mx * *h;
}

/* the real Jacobi rotation of [[al, g], [g, be]] (kernels.py's rot_params) */
TP_INLINE void rot_params(T al, T be, T g, T *tt, T *c, T *s) {
    T zeta = (be - al) / (2 * g), t;
    if (TFABS(zeta) > (T)1e15) t = (T)0.5 / zeta;
    else t = (zeta >= 0 ? (T)1 : (T)-1) / (TFABS(zeta) + TSQRT(1 + zeta * zeta));
    *tt = t; *c = (T)1 / TSQRT(1 + t * t); *s = *c * t;
}

TP_INLINE int all_finite(const T *a, int64_t n) {
    int ok = 1;
    for (int64_t i = 0; i < n; ++i) ok &= isfinite(a[i]) ? 1 : 0;
    return ok;
}

/* Complete rows [r, want) of the orthonormal complex set Ub (vectors of length p) */
TP_INLINE void ccomplete_basis(T *Ub, int64_t r, int64_t want, int64_t p) {
    for (int64_t j = r; j < want; ++j) {
        int64_t best = 0; T bestw = (T)1e30;
        for (int64_t i = 0; i < p; ++i) {
            T w = 0;
            for (int64_t l = 0; l < j; ++l) {
                const T *u = Ub + 2 * (l * p + i);
                w += u[0] * u[0] + u[1] * u[1];
            }
            if (w < bestw) { bestw = w; best = i; }
        }
        T *v = Ub + 2 * j * p;
        for (int64_t i = 0; i < 2 * p; ++i) v[i] = 0;
        v[2 * best] = 1;
        for (int pass = 0; pass < 2; ++pass) {
            for (int64_t l = 0; l < j; ++l) {
                const T *u = Ub + 2 * l * p;
                T dr, di;
                cdot(u, v, p, &dr, &di);
                for (int64_t i = 0; i < p; ++i) {
                    v[2 * i] -= dr * u[2 * i] - di * u[2 * i + 1];
                    v[2 * i + 1] -= dr * u[2 * i + 1] + di * u[2 * i];
                }
            }
        }
        T nv = TSQRT(cnorm2(v, p));
        T inv = nv > 0 ? (T)1 / nv : (T)0;
        for (int64_t i = 0; i < 2 * p; ++i) v[i] *= inv;
    }
}

/* ---------------------------------------------------------------- SVD (one-sided Jacobi)
   The per-matrix workers are not inlined: the batched and the one-matrix entry points run the
   same machine code, so their results are equal bit for bit (one call per matrix). */
static __attribute__((noinline)) int csvd_one(const T *a, T *S, T *U, T *Vh, int64_t m, int64_t n, int uv, int full,
                       T *W, T *Ub, T *V, T *nrm, int64_t *perm) {
    const int trans = m < n;
    const int64_t p = trans ? n : m, q = trans ? m : n;
    if (!all_finite(a, 2 * m * n)) return 1;
    /* one scale for the matrix, or (graded input) one per vector: ve[j] */
    int *ve = csvd_graded_input(a, m, n) ? (int *)malloc(sizeof(int) * (q + 1)) : NULL;
    T amax = 0;
    for (int64_t i = 0; i < 2 * m * n; ++i) amax = TP_MAX(amax, TFABS(a[i]));
    const int ex = ve ? 0 : TP_SCALE_EXP(amax);
    const T fac = (T)ldexp(1.0, -ex);
    if (!trans) {
        for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j) {
                W[2 * (j * p + i)] = a[2 * (i * n + j)] * fac;
                W[2 * (j * p + i) + 1] = a[2 * (i * n + j) + 1] * fac;
            }
    } else {  /* the columns of A^H: conjugated rows */
        for (int64_t i = 0; i < m * n; ++i) { W[2 * i] = a[2 * i] * fac; W[2 * i + 1] = -a[2 * i + 1] * fac; }
    }
    if (uv) {
        for (int64_t j = 0; j < 2 * q * q; ++j) V[j] = 0;
        for (int64_t j = 0; j < q; ++j) V[2 * (j * q + j)] = 1;
    }
    const T tol = EPS * TSQRT((T)p);
    if (ve) for (int64_t j = 0; j < q; ++j) { ve[j] = 0; nrm[j] = crenorm(W + 2 * j * p, p, ve + j); }
    for (int sweep = 0; sweep < MAX_SWEEPS; ++sweep) {
        if (!ve) for (int64_t j = 0; j < q; ++j) nrm[j] = cnorm2(W + 2 * j * p, p);
        int64_t rotated = 0;
        for (int64_t j = 0; j < q; ++j)
            for (int64_t k = j + 1; k < q; ++k) {
                T al = nrm[j], be = nrm[k];
                if (al == 0 || be == 0) continue;
                T gr, gi, hr, hi, h;
                cdot(W + 2 * j * p, W + 2 * k * p, p, &gr, &gi);
                const T g = cmod(gr, gi, &hr, &hi, &h);
                /* written so that a NaN threshold skips the pair (g <= NaN is false) and so
                   that g > 0 past it: with one row far above the others g underflowed to 0
                   while gr did not, and the rotation's phase gr / g was 0/0 */
                if (!(g > tol * TSQRT(al) * TSQRT(be))) continue;
                ++rotated;
                T tt, c, s;
                if (ve) {  /* the pair in the scale 2^-(e_j + e_k): (al 2^-d, g; g, be 2^d) */
                    const int d = ve[k] - ve[j];
                    T sj, sk;
                    if (d > GRADED_D) {
                        c = 1; sj = g / be; sk = (T)ldexp((double)sj, -2 * d); s = (T)ldexp((double)sj, -d);
                    } else if (d < -GRADED_D) {
                        c = 1; sk = -g / al; sj = (T)ldexp((double)sk, 2 * d); s = (T)ldexp((double)sk, d);
                    } else {
                        rot_params((T)ldexp((double)al, -d), (T)ldexp((double)be, d), g, &tt, &c, &s);
                        sj = (T)ldexp((double)s, d); sk = (T)ldexp((double)s, -d);
                    }
                    const T fr = hr / h, fi = -hi / h;  /* conj(g) / |g| */
                    crot2(W + 2 * j * p, W + 2 * k * p, p, c, sj * fr, sj * fi, sk * fr, sk * fi);
                    if (uv) crot(V + 2 * j * q, V + 2 * k * q, q, c, s * fr, s * fi);
                    nrm[j] = crenorm(W + 2 * j * p, p, ve + j);
                    nrm[k] = crenorm(W + 2 * k * p, p, ve + k);
                    continue;
                }
                rot_params(al, be, g, &tt, &c, &s);
                const T sr = s * hr / h, si = -s * hi / h;  /* s conj(g) / |g| */
                crot(W + 2 * j * p, W + 2 * k * p, p, c, sr, si);
                if (uv) crot(V + 2 * j * q, V + 2 * k * q, q, c, sr, si);
                /* the running norms: al - tt g cancels for a column left near the rounding
                   level of the others, and can go negative (then sqrt(al) is NaN): recomputed */
                const T nj = al - tt * g;
                nrm[j] = nj > 0 ? nj : cnorm2(W + 2 * j * p, p);
                nrm[k] = be + tt * g;
            }
        if (!rotated) break;
    }
    for (int64_t j = 0; j < q; ++j) { nrm[j] = TSQRT(cnorm2(W + 2 * j * p, p)); perm[j] = j; }
#define SV_TRUE(j) (ve ? (T)ldexp((double)nrm[j], ve[j]) : nrm[j])
    for (int64_t j = 1; j < q; ++j) {  /* insertion sort, descending */
        int64_t x = perm[j], i = j;
        while (i > 0 && SV_TRUE(perm[i - 1]) < SV_TRUE(x)) { perm[i] = perm[i - 1]; --i; }
        perm[i] = x;
    }
    for (int64_t j = 0; j < q; ++j) S[j] = SV_TRUE(perm[j]);
#undef SV_TRUE
    free(ve);
    if (uv) {
        const T thresh = (q > 0 ? S[0] : 0) * (T)p * EPS;
        int64_t r = 0;
        for (; r < q; ++r) {
            T sg = S[r];
            if (!(sg > thresh) || sg == 0) break;
            const T *w = W + 2 * perm[r] * p;
            T inv = (T)1 / nrm[perm[r]];  /* = 1 / sg for one scale */
            for (int64_t i = 0; i < 2 * p; ++i) Ub[2 * r * p + i] = w[i] * inv;
        }
        const int64_t want = full ? p : q;
        ccomplete_basis(Ub, r, want, p);
        if (!trans) {  /* U = the unit vectors as columns, Vh = V^H */
            for (int64_t i = 0; i < m; ++i)
                for (int64_t j = 0; j < want; ++j) {
                    U[2 * (i * want + j)] = Ub[2 * (j * p + i)];
                    U[2 * (i * want + j) + 1] = Ub[2 * (j * p + i) + 1];
                }
            for (int64_t j = 0; j < q; ++j)
                for (int64_t l = 0; l < q; ++l) {
                    Vh[2 * (j * q + l)] = V[2 * (perm[j] * q + l)];
                    Vh[2 * (j * q + l) + 1] = -V[2 * (perm[j] * q + l) + 1];
                }
        } else {  /* A^H = Ub S V^H: U = V, Vh = Ub^H */
            for (int64_t i = 0; i < m; ++i)
                for (int64_t j = 0; j < m; ++j) {
                    U[2 * (i * m + j)] = V[2 * (perm[j] * q + i)];
                    U[2 * (i * m + j) + 1] = V[2 * (perm[j] * q + i) + 1];
                }
            for (int64_t i = 0; i < want * n; ++i) { Vh[2 * i] = Ub[2 * i]; Vh[2 * i + 1] = -Ub[2 * i + 1]; }
        }
    }
    for (int64_t j = 0; j < q; ++j) S[j] = (T)ldexp((double)S[j], ex);
    return 0;
}

TP_EXPORT int tp_csvd(const C *a, T *S, C *U, C *Vh, int64_t B, int64_t m, int64_t n, int64_t uv,
                      int64_t full, int64_t nthreads) {
    const int64_t p = TP_MAX(m, n), k = TP_MIN(m, n);
    const int64_t usz = uv ? m * (full ? m : k) : 0, vsz = uv ? n * (full ? n : k) : 0;
    /* a complex rotation is ~4 real ones: the real kernels' one-thread bound, in real work */
    int64_t nt = (B < 2 || 4 * B * p * k * k < 100000) ? 1 : nthreads;
    int64_t bad = INT64_MAX;
    #pragma omp parallel num_threads(nt) reduction(min:bad)
    {
        T *W = (T *)malloc(sizeof(T) * 2 * (p * k + p * p + k * k + k + 8));
        T *Ub = W + 2 * p * k, *V = Ub + 2 * p * p, *nrm = V + 2 * k * k;
        int64_t *perm = (int64_t *)malloc(sizeof(int64_t) * (k + 1));
        int64_t chunk = TP_MAX(1, B / (nt * 16));
        #pragma omp for schedule(dynamic, chunk)
        for (int64_t b = 0; b < B; ++b) {
            int st = csvd_one((const T *)(a + b * m * n), S + b * k, (T *)(U + b * usz),
                              (T *)(Vh + b * vsz), m, n, (int)uv, (int)full, W, Ub, V, nrm, perm);
            if (st && b < bad) bad = b;
        }
        free(W); free(perm);
    }
    return bad == INT64_MAX ? 0 : (int)TP_MIN(bad + 1, 2147483647);
}

/* ---------------------------------------------------------------- eigh (two-sided Jacobi) */
/* What both eigh workers store: the eigenvalues d in ascending order (a stable insertion sort of
   perm) into L, scaled back by 2^ex, and with wantv column j of Q = complex row perm[j] of R (rows
   ld reals apart: the Jacobi worker's V, the tridiagonal worker's Zt). */
static void ceigh_store(const T *d, int64_t *perm, int64_t n, int ex, T *L, int wantv,
                        const T *R, int64_t ld, T *Q) {
    for (int64_t j = 0; j < n; ++j) perm[j] = j;
    for (int64_t j = 1; j < n; ++j) {  /* insertion sort, ascending */
        int64_t x = perm[j], i = j;
        while (i > 0 && d[perm[i - 1]] > d[x]) { perm[i] = perm[i - 1]; --i; }
        perm[i] = x;
    }
    for (int64_t j = 0; j < n; ++j) L[j] = (T)ldexp((double)d[perm[j]], ex);
    if (wantv)
        for (int64_t i = 0; i < n; ++i)
            for (int64_t j = 0; j < n; ++j) {
                Q[2 * (i * n + j)] = R[perm[j] * ld + 2 * i];
                Q[2 * (i * n + j) + 1] = R[perm[j] * ld + 2 * i + 1];
            }
}

static __attribute__((noinline)) int ceigh_one(const T *in, T *L, T *Q, int64_t n, int upper, int wantv, T *A, T *V,
                        T *d, int64_t *perm) {
    if (!all_finite(in, 2 * n * n)) return 1;
    /* the entries of the UPLO triangle, the real part of the diagonal; scaled by an even power
       of two (see kernels.py's eigh_one) */
    T amax = 0;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j <= i; ++j) {
            const T *z = upper ? in + 2 * (j * n + i) : in + 2 * (i * n + j);
            amax = TP_MAX(amax, TFABS(z[0]));
            if (i != j) amax = TP_MAX(amax, TFABS(z[1]));
        }
    int ex = TP_SCALE_EXP(amax);
    ex -= ex & 1;
    const T fac = (T)ldexp(1.0, -ex);
    T frob = 0;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j <= i; ++j) {
            const T *z = upper ? in + 2 * (j * n + i) : in + 2 * (i * n + j);
            T re = z[0] * fac, im = (i == j) ? 0 : (upper ? -z[1] : z[1]) * fac;  /* a_ij, i >= j */
            A[2 * (i * n + j)] = re; A[2 * (i * n + j) + 1] = im;
            A[2 * (j * n + i)] = re; A[2 * (j * n + i) + 1] = -im;
            frob += (i == j ? 1 : 2) * (re * re + im * im);
        }
    frob = TSQRT(frob);
    if (wantv) {
        for (int64_t j = 0; j < 2 * n * n; ++j) V[j] = 0;
        for (int64_t j = 0; j < n; ++j) V[2 * (j * n + j)] = 1;
    }
    const T floor_ = (T)0.1 * frob;
    for (int sweep = 0; sweep < MAX_SWEEPS; ++sweep) {
        int64_t rotated = 0;
        for (int64_t p = 0; p < n; ++p)
            for (int64_t q = p + 1; q < n; ++q) {
                T ar = A[2 * (p * n + q)], ai = A[2 * (p * n + q) + 1];
                if (ar == 0 && ai == 0) continue;
                T g = TSQRT(ar * ar + ai * ai);
                T app = A[2 * (p * n + p)], aqq = A[2 * (q * n + q)];
                T scale = TSQRT(TFABS(app)) * TSQRT(TFABS(aqq));
                if (g <= EPS * (scale > floor_ ? scale : floor_)) continue;
                ++rotated;
                T tt, c, s;
                rot_params(app, aqq, g, &tt, &c, &s);
                const T sr = s * ar / g, si = s * ai / g;  /* s e, e = a_pq / |a_pq| */
                crot(A + 2 * p * n, A + 2 * q * n, n, c, sr, si);
                for (int64_t k = 0; k < n; ++k) {
                    A[2 * (k * n + p)] = A[2 * (p * n + k)]; A[2 * (k * n + p) + 1] = -A[2 * (p * n + k) + 1];
                    A[2 * (k * n + q)] = A[2 * (q * n + k)]; A[2 * (k * n + q) + 1] = -A[2 * (q * n + k) + 1];
                }
                A[2 * (p * n + p)] = app - tt * g; A[2 * (p * n + p) + 1] = 0;
                A[2 * (q * n + q)] = aqq + tt * g; A[2 * (q * n + q) + 1] = 0;
                A[2 * (p * n + q)] = 0; A[2 * (p * n + q) + 1] = 0;
                A[2 * (q * n + p)] = 0; A[2 * (q * n + p) + 1] = 0;
                if (wantv) crot(V + 2 * p * n, V + 2 * q * n, n, c, sr, -si);
            }
        if (!rotated) break;
    }
    for (int64_t j = 0; j < n; ++j) d[j] = A[2 * (j * n + j)];
    ceigh_store(d, perm, n, ex, L, wantv, V, 2 * n, Q);
    return 0;
}

TP_EXPORT int tp_ceigh(const C *a, T *L, C *Q, int64_t B, int64_t n, int64_t upper, int64_t wantv,
                       int64_t nthreads) {
    const int64_t qsz = wantv ? n * n : 0;
    int64_t nt = (B < 2 || 4 * B * n * n * n < 100000) ? 1 : nthreads;
    int64_t bad = INT64_MAX;
    #pragma omp parallel num_threads(nt) reduction(min:bad)
    {
        T *A = (T *)malloc(sizeof(T) * (4 * n * n + n + 8));
        T *V = A + 2 * n * n, *d = V + 2 * n * n;
        int64_t *perm = (int64_t *)malloc(sizeof(int64_t) * (n + 1));
        int64_t chunk = TP_MAX(1, B / (nt * 16));
        #pragma omp for schedule(dynamic, chunk)
        for (int64_t b = 0; b < B; ++b) {
            int st = ceigh_one((const T *)(a + b * n * n), L + b * n, (T *)(Q + b * qsz), n,
                               (int)upper, (int)wantv, A, V, d, perm);
            if (st && b < bad) bad = b;
        }
        free(A); free(perm);
    }
    return bad == INT64_MAX ? 0 : (int)TP_MIN(bad + 1, 2147483647);
}

/* ---------------------------------------------------------------- one matrix (B = 1)
   The workers on one matrix of order <= ONE_MAX_N, no thread team, scratch on the stack;
   ``code`` packs m | n << 8 | flag i << (16 + i) (torchport.linalg.one._code). Each returns what
   its batched entry point returns for B = 1; -1 for sizes out of range. */
${one_code}

/* ---------------------------------------------------------------- eigh by tridiagonal QL
   One matrix (flag 2 of tp_ceigh1): reference.complex_eigh_tridiagonal_reference. A (scaled by a
   power of two to max |re|, |im| in [0.5, 1)) held full and Hermitian; step k = n-1 … 2 takes
   x = A[0:k, k] (the conjugated row k), α = x[k-1], and when ‖x[0:k-1]‖ > 0 reflects it into
   β e_{k-1} with zlarfg's H = I - τ v vᴴ (β = -sign(Re α)‖x‖ real, τ = (β - α)/β,
   v = x/(α - β), v[k-1] = 1): A[0:k, 0:k] -= v wᴴ + w vᴴ, w = p - ½ Re(τ pᴴv) v, p = τ A v,
   and Qᵀ ← Hᵀ Qᵀ (rows of Zt: the columns of V, not conjugated). The coupling T[j+1, j]
   (β, or A[k][k-1] when not reflected) then gets the phases δ_0 = 1, δ_{j+1} = δ_j T[j+1, j]/|.|,
   which scale the rows of Zt (V = Q D Z), and kernels.py's real QL (tri_ql) runs on (d, |e|)
   rotating those rows as pairs of real rows. Returns 0, 1 for non-finite input, 2 when the QL
   did not converge (the caller runs ceigh_one). */
${tri_ql}

static __attribute__((noinline)) int ceigh_tri_one(const T *in, T *L, T *Q, int64_t n, int upper, int wantv) {
    if (!all_finite(in, 2 * n * n)) return 1;
    const int64_t nv = (2 * n + TRI_VL - 1) / TRI_VL, ld = nv * TRI_VL;  /* Zt row: ld reals */
    T A[2 * ONE_MAX_N * ONE_MAX_N] __attribute__((aligned(64)));
    T Z[2 * ONE_MAX_N * ONE_MAX_N] __attribute__((aligned(64)));
    T v[2 * ONE_MAX_N], p[2 * ONE_MAX_N];
    T u[2 * ONE_MAX_N] __attribute__((aligned(64)));
    T d[ONE_MAX_N + 1], e[ONE_MAX_N + 1], ec[2 * ONE_MAX_N + 2];
    int64_t perm[ONE_MAX_N];
    T amax = 0;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j <= i; ++j) {
            const T *z = upper ? in + 2 * (j * n + i) : in + 2 * (i * n + j);
            amax = TP_MAX(amax, TFABS(z[0]));
            if (i != j) amax = TP_MAX(amax, TFABS(z[1]));
        }
    if (amax == 0) {
        for (int64_t j = 0; j < n; ++j) L[j] = 0;
        if (wantv) for (int64_t j = 0; j < n * n; ++j) { Q[2 * j] = j % (n + 1) == 0; Q[2 * j + 1] = 0; }
        return 0;
    }
    const int ex = TP_SCALE_EXP(amax) + 1;
    const T sc = (T)ldexp(1.0, -ex);
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j <= i; ++j) {
            const T *z = upper ? in + 2 * (j * n + i) : in + 2 * (i * n + j);
            T re = z[0] * sc, im = (i == j) ? 0 : (upper ? -z[1] : z[1]) * sc;  /* a_ij, i >= j */
            A[2 * (i * n + j)] = re; A[2 * (i * n + j) + 1] = im;
            A[2 * (j * n + i)] = re; A[2 * (j * n + i) + 1] = -im;
        }
    if (wantv)
        for (int64_t i = 0; i < n; ++i)
            for (int64_t j = 0; j < ld; ++j) Z[i * ld + j] = j == 2 * i;
    for (int64_t k = n - 1; k >= 2; --k) {
        const T *ak = A + 2 * k * n;  /* x_j = conj(ak[j]) */
        /* zlarfg in the scale cs = 2^-e of the row's largest |Re|, |Im| (exact; τ and v do not
           depend on it, β is scaled back): in the matrix's one scale a row far below its largest
           entry (rank-one input after a step or two) had subnormal squares, and β, τ and v
           disagreed (|QᴴQ - I| 0.83 in complex64, n = 25) */
        T mx = 0;
        for (int64_t j = 0; j < 2 * k; ++j) mx = TP_MAX(mx, TFABS(ak[j]));
        const int ce = TP_SCALE_EXP(mx);
        const T cs = (T)ldexp(1.0, -ce);
        const T ar = ak[2 * (k - 1)] * cs, ai = -ak[2 * (k - 1) + 1] * cs;
        T xn2 = 0;
        for (int64_t j = 0; j < 2 * (k - 1); ++j) { const T y = ak[j] * cs; xn2 += y * y; }
        d[k] = ak[2 * k];
        if (xn2 == 0) { ec[2 * (k - 1)] = ak[2 * (k - 1)]; ec[2 * (k - 1) + 1] = ak[2 * (k - 1) + 1]; continue; }
        T beta = TSQRT(ar * ar + ai * ai + xn2);  /* >= 1 (2^-23 for a float row of subnormals) */
        if (ar > 0) beta = -beta;
        const T tr = (beta - ar) / beta, ti = -ai / beta;  /* τ */
        const T dr = ar - beta, den = dr * dr + ai * ai;
        const T sr = dr / den, si = -ai / den;  /* 1 / (α - β), on the scaled row */
        ec[2 * (k - 1)] = (T)ldexp((double)beta, ce); ec[2 * (k - 1) + 1] = 0;
        for (int64_t j = 0; j < k - 1; ++j) {
            const T xr = ak[2 * j] * cs, xi = -ak[2 * j + 1] * cs;
            v[2 * j] = xr * sr - xi * si; v[2 * j + 1] = xr * si + xi * sr;
        }
        v[2 * (k - 1)] = 1; v[2 * (k - 1) + 1] = 0;
        T hr = 0, hi = 0;  /* pᴴ v */
        for (int64_t i = 0; i < k; ++i) {
            const T *row = A + 2 * i * n;
            T qr = 0, qi = 0;
            #pragma omp simd reduction(+:qr, qi)
            for (int64_t j = 0; j < k; ++j) {
                qr += row[2 * j] * v[2 * j] - row[2 * j + 1] * v[2 * j + 1];
                qi += row[2 * j] * v[2 * j + 1] + row[2 * j + 1] * v[2 * j];
            }
            p[2 * i] = tr * qr - ti * qi; p[2 * i + 1] = tr * qi + ti * qr;
            hr += p[2 * i] * v[2 * i] + p[2 * i + 1] * v[2 * i + 1];
            hi += p[2 * i] * v[2 * i + 1] - p[2 * i + 1] * v[2 * i];
        }
        const T kk = (T)0.5 * (tr * hr - ti * hi);
        for (int64_t i = 0; i < 2 * k; ++i) p[i] -= kk * v[i];  /* p is now w */
        for (int64_t i = 0; i < k; ++i) {
            T *row = A + 2 * i * n;
            const T vr = v[2 * i], vi = v[2 * i + 1], wr = p[2 * i], wi = p[2 * i + 1];
            #pragma omp simd
            for (int64_t j = 0; j < k; ++j) {  /* -= v_i conj(w_j) + w_i conj(v_j) */
                const T yr = p[2 * j], yi = p[2 * j + 1], zr = v[2 * j], zi = v[2 * j + 1];
                row[2 * j] -= vr * yr + vi * yi + wr * zr + wi * zi;
                row[2 * j + 1] -= vi * yr - vr * yi + wi * zr - wr * zi;
            }
        }
        if (wantv) {  /* Zt <- Hᵀ Zt: u = Σ_j v_j Zt[j], Zt[j] -= τ conj(v_j) u */
            for (int64_t c = 0; c < ld; ++c) u[c] = 0;
            for (int64_t j = 0; j < k; ++j) {
                const T vr = v[2 * j], vi = v[2 * j + 1];
                const T *row = Z + j * ld;
                #pragma omp simd
                for (int64_t c = 0; c < n; ++c) {
                    u[2 * c] += vr * row[2 * c] - vi * row[2 * c + 1];
                    u[2 * c + 1] += vr * row[2 * c + 1] + vi * row[2 * c];
                }
            }
            for (int64_t j = 0; j < k; ++j) {
                const T gr = tr * v[2 * j] + ti * v[2 * j + 1], gi = ti * v[2 * j] - tr * v[2 * j + 1];
                T *row = Z + j * ld;
                #pragma omp simd
                for (int64_t c = 0; c < n; ++c) {
                    row[2 * c] -= gr * u[2 * c] - gi * u[2 * c + 1];
                    row[2 * c + 1] -= gr * u[2 * c + 1] + gi * u[2 * c];
                }
            }
        }
    }
    d[0] = A[0];
    if (n > 1) { d[1] = A[2 * (n + 1)]; ec[0] = A[2 * n]; ec[1] = A[2 * n + 1]; }
    T pr = 1, pi = 0;  /* δ_j */
    for (int64_t j = 0; j < n; ++j) {
        if (wantv && j > 0) {
            T *row = Z + j * ld;
            for (int64_t c = 0; c < n; ++c) {
                const T zr = row[2 * c], zi = row[2 * c + 1];
                row[2 * c] = pr * zr - pi * zi; row[2 * c + 1] = pr * zi + pi * zr;
            }
        }
        if (j == n - 1) break;
        const T m = tri_hypot(ec[2 * j], ec[2 * j + 1]);
        e[j] = m;
        if (m > 0) {
            const T fr = ec[2 * j] / m, fi = ec[2 * j + 1] / m, qr = pr * fr - pi * fi;
            pi = pr * fi + pi * fr; pr = qr;
        }
    }
    e[n - 1] = 0;
    if (tri_ql(d, e, n, wantv ? (TV *)Z : NULL, nv)) return 2;
    ceigh_store(d, perm, n, ex, L, wantv, Z, ld, Q);
    return 0;
}

/* flags: 0 compute_uv, 1 full_matrices */
TP_EXPORT int tp_csvd1(const C *a, T *S, C *U, C *Vh, int64_t code) {
    const int64_t m = ONE_M(code), n = ONE_N(code), p = TP_MAX(m, n), k = TP_MIN(m, n);
    if (k < 1 || p > ONE_MAX_N) return -1;
    T W[2 * (p * k + p * p + k * k + k + 8)];
    int64_t perm[k + 1];
    return csvd_one((const T *)a, S, (T *)U, (T *)Vh, m, n, ONE_F(code, 0), ONE_F(code, 1), W,
                    W + 2 * p * k, W + 2 * (p * k + p * p), W + 2 * (p * k + p * p + k * k), perm);
}

/* flags: 0 upper, 1 compute_v, 2 tridiagonal QL (ceigh_tri_one; Jacobi when it does not converge) */
TP_EXPORT int tp_ceigh1(const C *a, T *L, C *Q, int64_t code) {
    const int64_t n = ONE_N(code);
    if (n < 1 || n > ONE_MAX_N) return -1;
    if (ONE_F(code, 2)) {
        int st = ceigh_tri_one((const T *)a, L, (T *)Q, n, ONE_F(code, 0), ONE_F(code, 1));
        if (st != 2) return st;
    }
    T A[4 * n * n + n + 8];
    int64_t perm[n + 1];
    return ceigh_one((const T *)a, L, (T *)Q, n, ONE_F(code, 0), ONE_F(code, 1), A, A + 2 * n * n,
                     A + 4 * n * n, perm);
}
"""

# Identifies this source in autotuning keys (torchport.linalg._tune), so choices made for an
# older kernel are not reused.
SOURCE_TAG = hashlib.sha256((_SOURCE + kernels.TRI_QL).encode()).hexdigest()[:12]


@functools.cache
def library(dtype: torch.dtype, isa: str) -> dict[str, Kernel]:
    """Build (or load from the disk cache) the complex kernels for complex64 or complex128."""
    real = dtype.to_real()
    params = scalar_params(real, MAX_SWEEPS)
    src = native.render(
        "#include <stdlib.h>\n#include <complex.h>\n"
        + _SOURCE.replace("${tri_ql}", kernels.tri_ql_c(real, MAX_SWEEPS)),
        **{k: params[k] for k in ("elem", "eps", "sqrt", "fabs", "max_sweeps")},
        one_code=one_code_c(ONE_MAX_N),
    )
    lib = native.build(src, name=f"linalg_{_TAG[dtype]}_{isa}", isa=isa)
    return {
        "svd": launcher(lib, "tp_csvd", dtype, "A S:r U Vh", "B m n uv full nthreads"),
        "eigh": launcher(lib, "tp_ceigh", dtype, "A L:r Q", "B n upper wantv nthreads"),
        # one matrix, sizes and flags packed in ``code`` (torchport.linalg.one)
        "svd1": launcher(lib, "tp_csvd1", dtype, "A S:r U Vh", "code"),
        "eigh1": launcher(lib, "tp_ceigh1", dtype, "A L:r Q", "code"),
    }


def _ks(dtype: torch.dtype) -> dict[str, Kernel]:
    return library(dtype, native.cpu_info().isa)


def svd(
    a: torch.Tensor, full_matrices: bool, compute_uv: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Batched SVD of complex ``a`` (B, m, n): U (B, m, m|k), real S (B, k), Vh (B, n|k, n) and
    1 + the first batch index with non-finite input (0 when none), as ``kernels.svd``."""
    assert a.dim() == 3 and a.is_contiguous() and not a.is_conj() and a.dtype in _TAG, a.dtype
    b, m, n = a.shape
    k = min(m, n)
    s = a.new_empty((b, k), dtype=a.dtype.to_real())
    if compute_uv:
        u = a.new_empty((b, m, m if full_matrices else k))
        vh = a.new_empty((b, n if full_matrices else k, n))
    else:
        u = vh = a.new_empty((0,))
    if b == 0 or k == 0:
        if compute_uv:
            u.copy_(torch.eye(u.shape[-2], u.shape[-1], dtype=a.dtype).expand_as(u))
            vh.copy_(torch.eye(vh.shape[-2], vh.shape[-1], dtype=a.dtype).expand_as(vh))
        return u, s, vh, 0
    bad = _ks(a.dtype)["svd"].call_unchecked(
        a.data_ptr(), s.data_ptr(), u.data_ptr(), vh.data_ptr(), b, m, n, int(compute_uv),
        int(full_matrices), native.num_threads(),
    )  # fmt: skip
    return u, s, vh, bad


def eigh(a: torch.Tensor, upper: bool, compute_v: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Batched Hermitian eigendecomposition of complex ``a`` (B, n, n) from its ``upper`` (else
    lower) triangle: real L (B, n) ascending, Q (B, n, n), 1 + the first bad batch index."""
    assert a.dim() == 3 and a.is_contiguous() and not a.is_conj() and a.dtype in _TAG, a.dtype
    b, n, _ = a.shape
    lam = a.new_empty((b, n), dtype=a.dtype.to_real())
    q = a.new_empty((b, n, n)) if compute_v else a.new_empty((0,))
    if b == 0 or n == 0:
        return lam, q, 0
    bad = _ks(a.dtype)["eigh"].call_unchecked(
        a.data_ptr(), lam.data_ptr(), q.data_ptr(), b, n, int(upper), int(compute_v),
        native.num_threads(),
    )  # fmt: skip
    return lam, q, bad
