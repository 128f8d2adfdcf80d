"""Native batched kernels: one-sided Jacobi SVD, cyclic Jacobi eigh, Householder QR, Cholesky.

One C source per dtype holds all four; each is parallel over the batch with OpenMP (one matrix per
thread at a time, its working set in per-thread scratch so small matrices stay in L1). Tiny orders
(n = 2, 3, 4) call the same ``always_inline`` worker with constant sizes, so gcc unrolls them fully.
Dot products use ``#pragma omp simd reduction`` and rotations are plain loops, both vectorised by
gcc for AVX2/FMA (the ISA flags come from :func:`torchport.native.isa_flags`). Small batches run
on one thread (B·n³ below 10⁵ for the Jacobi kernels): on a shared, oversubscribed machine a
two-thread region there costs more in waiting for the second thread than it saves.

The algorithms (the references in :mod:`torchport.linalg.reference` follow the same steps):

- **SVD** (Hestenes): the q = min(m, n) vectors (columns of A, or rows when m < n) are rotated
  pairwise until every normalised inner product |w_j·w_k| / (‖w_j‖‖w_k‖) ≤ tol = eps·sqrt(p)
  (the off-diagonal mass of WᵀW is negligible); singular values are the vector norms, sorted
  descending. Vectors whose σ ≤ σ_max·p·eps are numerically null: U (or Vh when m < n) is completed
  with Gram-Schmidt from the unit vector least represented in the basis so far, so it stays
  orthonormal for rank-deficient input and for ``full_matrices``.
  A matrix whose vectors' largest entries span more than ``GRADED_BITS`` binary orders (one
  power-of-two scale would underflow the small ones' squares) runs ``svd_graded``: the same
  sweeps with each vector held in its own power-of-two scale, relatively accurate for
  column-graded input; the lane kernels hand such a lane to it.
- **eigh**: two-sided cyclic Jacobi on the full symmetric matrix; pair (p, q) is rotated while
  |a_pq| > eps·max(sqrt(|a_pp a_qq|), 0.1‖A‖_F). Eigenvalues ascending. For batches of at least
  two register widths ``tp_eigh_vec`` runs the same sweeps on VLN matrices at once, one per SIMD
  lane (see *Lanes* below) (a lane below threshold gets the identity rotation): measured 2-4×
  faster than one matrix per thread, because the rotation angles' sqrt/div latency chain is
  shared by the lanes and the column update becomes contiguous. From n = 6 the lane kernel runs
  round-robin rounds fused by symmetry (order 2, ``eigh_vec_fused_round``: upper triangle only,
  one pass of 2x2 blocks per round, converged block pairs skipped), 1.2-2.1x faster again.
  From n = ``EIGH_TRIDIAG_FROM`` the lanes run Householder tridiagonalisation + implicit QL
  instead (:mod:`torchport.linalg.eigh_tridiag`, 1.3-3x faster than the Jacobi lane kernels),
  unless Jacobi is asked for (``method="jacobi"``).
  ``tp_svd_vec`` does the same for
  the SVD sweeps (1.3-2.6× over one matrix per thread, n = 3…32), then finishes each lane alone.
- **eigh of one matrix** (``tp_eigh1`` with flag 3, used by :mod:`torchport.linalg.one`):
  Householder tridiagonalization, then implicit QL with Wilkinson shifts (LAPACK dsytrd 'U' +
  dsteqr/tql2), Givens rotations applied to contiguous rows of Qᵀ; eigenvalues only: the same
  sweeps in root-free form on e² (dsterf), 1.1-1.2x faster at n = 8…32. An eigenvalue that takes
  more than ``TRI_MAX_SWEEPS`` sweeps sends the matrix to the Jacobi worker instead.
- **QR**: Householder reflectors with LAPACK's sign convention (β = −sign(α)‖x‖, so the results
  match ``geqrf``/``orgqr`` to rounding), each formed as ``dlarfg`` does (``house``: its norm in
  the column's own power-of-two scale, so that a column far below the matrix's largest entry
  keeps Q orthonormal); Q is formed by backward accumulation only if asked for.
  For max(m, n) ≤ 64 and batches that fill the lanes ``tp_qr_vec`` runs the same steps on VLN
  matrices at once (their reflector's sqrt/division shared, the dot products with the trailing
  columns independent accumulators): ``torchport.linalg.qr`` 4-6.5× faster in float64 and
  8-10× in float32 than with the per-matrix kernel (one thread, B = 1000, n = 4/8/16, avx512).
- **Cholesky**: row-oriented (Cholesky–Banachiewicz) dot-product form; a pivot that is not > 0
  (or is NaN) stops that matrix with ``info`` = the order of the failing leading minor. For
  n ≤ 48 ``tp_cholesky_vec`` factors VLN matrices per SIMD lane group, which removes the
  per-matrix division/sqrt latency chain (8-50× at n = 3…8 in one run). A full group moves
  between the row-major matrices and the lane layout by VLN × VLN transposes of 8×8 (float32) /
  4×4 (float64) AVX shuffle tiles and is factored column by column (Crout): a column's entries
  are dot products over the finished columns, and only their final multiply by
  1/sqrt(pivot) = sqrt(s)·(1/s) waits on the pivot. From ``CHOLESKY_STREAM_FROM`` output bytes
  a group is stored to an L1 copy and streamed out by non-temporal stores, the next group's input
  prefetched meanwhile (past the caches the stores' line reads halved the rate at B = 10000).
  The lane Cholesky and QR advise an output of ``HUGE_OUTPUT_FROM`` bytes or more to take 2 MiB
  pages before they first write it: a fresh output's 4 KiB page faults cost 2-3× the kernel.
  Above n = 48, and for batches too small to fill the lanes from n = 17, the blocked kernel of
  :mod:`torchport.linalg.blocked` (panel + register-blocked trailing update) takes over.

*Lanes*: the lane kernels (``tp_*_vec``) hold one matrix per lane of a ``VBYTES``-byte vector,
VLN = VBYTES / sizeof(T) matrices at once: 32 bytes (4 float64 / 8 float32) for avx2, 64 (one zmm
register: 8 / 16) for avx512 (``_cparams.lane_bytes``; the build name carries isa and
width). 64 over 32 bytes, one thread, B = 10000, min of 11 interleaved: eigh n = 2/3/4/8 1.25/1.64/1.57/1.42×
(float64), 1.34/1.46/1.41/1.19× (float32); svd n = 2/3/4 1.27/1.49/1.53×, 1.23/1.29/1.34×;
cholesky (two threads, min of 15) float64 n = 4/8/16 B = 1000 1.12/1.35/1.43×, float32
1.05/1.61/1.17×.
"""

from __future__ import annotations

import functools
import hashlib
import string
from collections.abc import Callable

import torch

from torchport import native
from torchport.linalg import blocked as _blocked
from torchport.linalg import eigh_block as _eigh_block
from torchport.linalg import eigh_tridiag as _eigh_tridiag
from torchport.linalg import svd_lanes as _svd_lanes
from torchport.linalg._cparams import lane_bytes as _lane_bytes
from torchport.linalg._cparams import launcher, scalar_params
from torchport.native import Kernel

_TAG = {torch.float32: "f32", torch.float64: "f64"}

_SOURCE = r"""
typedef ${elem} T;
#define EPS ((T)${eps})
#define TSQRT ${sqrt}
#define TFABS ${fabs}
#define MAX_SWEEPS ${max_sweeps}

TP_INLINE T dotp(const T *a, const T *b, int64_t n) {
    T s = 0;
    #pragma omp simd reduction(+:s)
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

TP_INLINE void rot(T *x, T *y, int64_t n, T c, T s) {
    #pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
        T a = x[i], b = y[i];
        x[i] = c * a - s * b;
        y[i] = s * a + c * b;
    }
}

/* The Householder reflector of LAPACK's xLARFG: H = I - tau u u^T, u = (1, v), with
   H (alpha, x) = (beta, 0) and beta = -sign(alpha) |(alpha, x)| (alpha <= 0: beta > 0). Writes
   v[0..len) (= x / (alpha - beta); v may be x) and *beta, returns tau in [1, 2]; tau = 0 (H = I,
   v not written, *beta = alpha) when x is zero. A column whose sum of squares is below
   HOUSE_SAFE has it formed again in the scale 2^-e that brings max(|alpha|, |x_i|) into [1, 2)
   (exact; tau and v do not depend on it, beta is scaled back), as xLARFG's dnrm2: in the
   matrix's one scale a column far below its largest entry (the trailing columns of
   rank-deficient input after a few steps: 1e-20 and less) has subnormal squares, and beta, tau
   and v disagreed (|Q^T Q - I| up to 0.3 in float32, 8 in float64 in a scan). */
/* Above it the squares lost to underflow (each absolute error < 2^-149 / 2^-1074) are far below
   eps of the sum for any length, and the unscaled steps are the ones used before. */
#define HOUSE_SAFE ((T)(sizeof(T) == 4 ? 0x1p-60 : 0x1p-600))
TP_INLINE T house(T alpha, const T *x, T *v, int64_t len, T *beta) {
    T xn2 = dotp(x, x, len), a = alpha, cs = 1;
    int e = 0;
    if (!(xn2 >= HOUSE_SAFE)) {  /* a small (or zero) column: its norm in its own scale */
        T mx = TFABS(alpha);
        for (int64_t i = 0; i < len; ++i) mx = TP_MAX(mx, TFABS(x[i]));
        e = TP_SCALE_EXP(mx);
        cs = (T)ldexp(1.0, -e);
        xn2 = 0;
        #pragma omp simd reduction(+:xn2)
        for (int64_t i = 0; i < len; ++i) { const T y = x[i] * cs; xn2 += y * y; }
        a = alpha * cs;
    }
    *beta = alpha;
    /* (xn2 == 0 with x non-zero: its squares underflow even relative to alpha, negligible) */
    if (xn2 == 0) return 0;
    T b = TSQRT(a * a + xn2);
    if (a > 0) b = -b;
    /* |a - b| >= |b| >= 1 in the scaled case (2^-23 for a float column of subnormals: cs is
       clamped at 2^126, so the scaled entries are taken first and cs / (a - b) never formed) */
    const T sv = 1 / (a - b);
    if (e == 0) for (int64_t i = 0; i < len; ++i) v[i] = x[i] * sv;
    else for (int64_t i = 0; i < len; ++i) v[i] = (x[i] * cs) * sv;
    *beta = e == 0 ? b : (T)ldexp((double)b, e);
    return (b - a) / b;
}

/* perm[0..n) = the indices of d[0..n) in ascending order of value (insertion sort: n is small). */
TP_INLINE void sort_asc(const T *d, int64_t *perm, int64_t n) {
    for (int64_t j = 0; j < n; ++j) perm[j] = j;
    for (int64_t j = 1; j < n; ++j) {
        int64_t x = perm[j], i = j;
        while (i > 0 && d[perm[i - 1]] > d[x]) { perm[i] = perm[i - 1]; --i; }
        perm[i] = x;
    }
}

/* Pair list for one sweep over q indices. order 0: cyclic row order (j, k), j < k. order 1:
   round-robin tournament, r - 1 rounds of r / 2 disjoint pairs (r = q rounded up to even); a pair
   with an index >= q is a bye, stored as (-1, -1), so every round has the same size r / 2. */
static int64_t make_pairs(int32_t *pairs, int64_t q, int order) {
    int64_t np = 0;
    if (order == 0) {
        for (int64_t j = 0; j < q; ++j)
            for (int64_t k = j + 1; k < q; ++k) { pairs[2 * np] = j; pairs[2 * np + 1] = k; ++np; }
        return np;
    }
    int64_t r = q + (q & 1);
    for (int64_t round = 0; round < r - 1; ++round) {
        for (int64_t i = 0; i < r / 2; ++i) {
            int64_t a = i == 0 ? 0 : 1 + (round + i - 1) % (r - 1);
            int64_t b = 1 + (round + r - 2 - i) % (r - 1);
            int bye = a >= q || b >= q;
            pairs[2 * np] = bye ? -1 : TP_MIN(a, b); pairs[2 * np + 1] = bye ? -1 : TP_MAX(a, b); ++np;
        }
    }
    return np;
}

/* Jacobi rotation for the 2x2 problem with off-diagonal g and diagonal difference (be - al):
   the smaller root t of t^2 + 2 zeta t - 1 = 0, c = 1 / sqrt(1 + t^2), s = c t. */
TP_INLINE void rot_params(T al, T be, T g, T *tt, T *c, T *s) {
    T zeta = (be - al) / (2 * g), t;
    if (TFABS(zeta) > (T)1e15) t = (T)0.5 / zeta;
    else t = (zeta >= 0 ? (T)1 : (T)-1) / (TFABS(zeta) + TSQRT(1 + zeta * zeta));
    *tt = t; *c = (T)1 / TSQRT(1 + t * t); *s = *c * t;
}

/* Complete rows [r, want) of the orthonormal set Ub (vectors of length p, row-major) */
TP_INLINE void complete_basis(T *Ub, int64_t r, int64_t want, int64_t p) {
    for (int64_t j = r; j < want; ++j) {
        /* unit vector e_i least represented: min over i of sum_l Ub[l][i]^2 */
        int64_t best = 0; T bestw = (T)1e30;
        for (int64_t i = 0; i < p; ++i) {
            T w = 0;
            for (int64_t l = 0; l < j; ++l) w += Ub[l * p + i] * Ub[l * p + i];
            if (w < bestw) { bestw = w; best = i; }
        }
        T *v = Ub + j * p;
        for (int64_t i = 0; i < p; ++i) v[i] = 0;
        v[best] = 1;
        for (int pass = 0; pass < 2; ++pass) {
            for (int64_t l = 0; l < j; ++l) {
                T d = dotp(v, Ub + l * p, p);
                for (int64_t i = 0; i < p; ++i) v[i] -= d * Ub[l * p + i];
            }
        }
        T nv = TSQRT(dotp(v, v, p));
        T inv = nv > 0 ? (T)1 / nv : (T)0;
        for (int64_t i = 0; i < p; ++i) v[i] *= inv;
    }
}

TP_INLINE int all_finite(const T *a, int64_t n) {
    int ok = 1;
    for (int64_t i = 0; i < n; ++i) ok &= isfinite(a[i]) ? 1 : 0;
    return ok;
}

/* Singular values from the converged vectors, sorted descending; U and Vh with completion.
   vex: NULL, or vector j of W holds its true values times 2^-vex[j] (svd_graded). Not inlined:
   its always-inlined copies (one per size-specialised SVD kernel) made up about a third of the
   SVD kernels' compile time, paid on the first SVD call; the call per matrix after the sweeps
   costs nothing measurable (2x2 … 8x8, B = 1000-20000, one thread: 0.94-1.08x either way). */
static __attribute__((noinline)) void svd_finish(const T *W, const T *V, T *nrm, int64_t *perm, T *Ub, T *S, T *U, T *Vh,
                          int64_t m, int64_t n, int uv, int full, const int *vex) {
    const int trans = m < n;
    const int64_t p = trans ? n : m, q = trans ? m : n;
    for (int64_t j = 0; j < q; ++j) { nrm[j] = TSQRT(dotp(W + j * p, W + j * p, p)); perm[j] = j; }
#define SV_TRUE(j) (vex ? (T)ldexp((double)nrm[j], vex[j]) : nrm[j])
    for (int64_t j = 1; j < q; ++j) {  /* insertion sort, descending */
        int64_t x = perm[j], i = j;
        while (i > 0 && SV_TRUE(perm[i - 1]) < SV_TRUE(x)) { perm[i] = perm[i - 1]; --i; }
        perm[i] = x;
    }
    for (int64_t j = 0; j < q; ++j) S[j] = SV_TRUE(perm[j]);
#undef SV_TRUE
    if (!uv) return;
    const T smax = q > 0 ? S[0] : 0, thresh = smax * (T)p * EPS;
    int64_t r = 0;
    for (; r < q; ++r) {
        T sg = S[r];
        if (!(sg > thresh) || sg == 0) break;
        const T *w = W + perm[r] * p;
        T inv = (T)1 / nrm[perm[r]];  /* = 1 / sg without vex */
        for (int64_t i = 0; i < p; ++i) Ub[r * p + i] = w[i] * inv;
    }
    const int64_t want = full ? p : q;
    complete_basis(Ub, r, want, p);
    if (!trans) {
        for (int64_t i = 0; i < m; ++i) for (int64_t j = 0; j < want; ++j) U[i * want + j] = Ub[j * p + i];
        for (int64_t j = 0; j < q; ++j) memcpy(Vh + j * q, V + perm[j] * q, sizeof(T) * q);
    } else {
        for (int64_t i = 0; i < m; ++i) for (int64_t j = 0; j < m; ++j) U[i * m + j] = V[perm[j] * q + i];
        memcpy(Vh, Ub, sizeof(T) * want * n);
    }
}

/* ---------------------------------------------------------------- SVD of graded input
   The sweeps below scale a matrix by one power of two and form squared norms and inner products
   of its vectors in that scale, so a vector far below the largest (diag(1e170, 1): 2^-565 after
   scaling, its square 2^-1130) underflows, and its singular value with it. Such input runs
   svd_graded instead: the same one-sided Jacobi (cyclic order), each vector held as w_j 2^e_j
   with its largest entry in [1, 2) (rescaled after every rotation), so its squared norm and its
   inner products are formed in range whatever the grading, and a rotation of vectors j, k takes
   its coefficients in their two scales (d = e_k - e_j): w_j <- c w_j - s 2^d w_k,
   w_k <- s 2^-d w_j + c w_k. The threshold |w_j.w_k| <= tol |w_j| |w_k| is scale-free, so
   column-graded matrices keep one-sided Jacobi's high relative accuracy (Demmel-Veselic). */

/* Vectors (columns of A, or rows when m < n) whose largest entry lies more than this many
   binary orders below the matrix's largest run svd_graded: above it the one-scale sweeps' squares
   keep 2^-96 (float32) / 2^-960 (float64), still normal with a margin. */
#define GRADED_BITS ((int)(sizeof(T) == 4 ? 48 : 480))
/* Beyond this exponent difference of a pair the rotation is taken from its first-order form
   (t = g / (beta - alpha) with the smaller term dropped, c = 1): exact to rounding there, and the
   direct form's zeta could overflow. */
#define GRADED_D ((int)(sizeof(T) == 4 ? 32 : 256))

/* Whether a (finite) matrix is graded so; *amax = its largest |entry| (the one-scale paths'). */
TP_INLINE int svd_graded_input(const T *a, int64_t m, int64_t n, T *amax) {
    const int trans = m < n;
    const int64_t p = trans ? n : m, q = trans ? m : n;
    T hi = 0, lo = (T)INFINITY;  /* the largest vector maximum, the smallest nonzero one */
    for (int64_t j = 0; j < q; ++j) {
        T mx = 0;
        for (int64_t i = 0; i < p; ++i) mx = TP_MAX(mx, TFABS(trans ? a[j * n + i] : a[i * n + j]));
        hi = TP_MAX(hi, mx);
        if (mx > 0) lo = TP_MIN(lo, mx);
    }
    *amax = hi;
    return lo < (T)ldexp((double)hi, -GRADED_BITS);
}

/* Bring w's largest entry into [1, 2) by a power of two (exact), adding it to *e; w.w after. */
TP_INLINE T graded_renorm(T *w, int64_t p, int *e) {
    T mx = 0;
    for (int64_t i = 0; i < p; ++i) mx = TP_MAX(mx, TFABS(w[i]));
    if (mx == 0) return 0;
    const int d = ilogb(mx);
    if (d) {
        for (int64_t i = 0; i < p; ++i) w[i] = (T)ldexp((double)w[i], -d);
        *e += d;
    }
    return dotp(w, w, p);
}

/* The SVD of one (finite) matrix by the per-vector scaled sweeps above; scratch of its own (the
   path is rare). Returns 0. */
static int svd_graded(const T *a, T *S, T *U, T *Vh, int64_t m, int64_t n, int uv, int full) {
    const int trans = m < n;
    const int64_t p = trans ? n : m, q = trans ? m : n;
    T *W = (T *)malloc(sizeof(T) * (p * q + q * q + p * p + q + 4));
    T *V = W + p * q, *Ub = V + q * q, *nrm = Ub + p * p;
    int *ve = (int *)malloc(sizeof(int) * (q + 1));
    int64_t *perm = (int64_t *)malloc(sizeof(int64_t) * (q + 1));
    if (!trans) { for (int64_t i = 0; i < m; ++i) for (int64_t j = 0; j < n; ++j) W[j * p + i] = a[i * n + j]; }
    else memcpy(W, a, sizeof(T) * m * n);
    if (uv) { for (int64_t j = 0; j < q * q; ++j) V[j] = 0; for (int64_t j = 0; j < q; ++j) V[j * q + j] = 1; }
    for (int64_t j = 0; j < q; ++j) { ve[j] = 0; nrm[j] = graded_renorm(W + j * p, p, ve + j); }
    const T tol = EPS * TSQRT((T)p);
    for (int sweep = 0; sweep < MAX_SWEEPS; ++sweep) {
        int64_t rotated = 0;
        for (int64_t j = 0; j < q; ++j)
            for (int64_t k = j + 1; k < q; ++k) {
                T al = nrm[j], be = nrm[k];
                if (al == 0 || be == 0) continue;
                T *wj = W + j * p, *wk = W + k * p;
                T g = dotp(wj, wk, p);
                if (TFABS(g) <= tol * TSQRT(al) * TSQRT(be)) continue;
                ++rotated;
                /* in the scale 2^-(e_j + e_k) the pair's Gram matrix is
                   (al 2^-d, g; g, be 2^d): the same angle as in true values */
                const int d = ve[k] - ve[j];
                T c = 1, s, sj, sk;
                if (d > GRADED_D) {  /* w_k dominates: t = g / beta */
                    sj = g / be; sk = (T)ldexp((double)sj, -2 * d); s = (T)ldexp((double)sj, -d);
                } else if (d < -GRADED_D) {  /* w_j dominates: t = -g / alpha */
                    sk = -g / al; sj = (T)ldexp((double)sk, 2 * d); s = (T)ldexp((double)sk, d);
                } else {
                    T tt;
                    rot_params((T)ldexp((double)al, -d), (T)ldexp((double)be, d), g, &tt, &c, &s);
                    sj = (T)ldexp((double)s, d); sk = (T)ldexp((double)s, -d);
                }
                for (int64_t i = 0; i < p; ++i) {
                    T x = wj[i], y = wk[i];
                    wj[i] = c * x - sj * y;
                    wk[i] = sk * x + c * y;
                }
                if (uv) rot(V + j * q, V + k * q, q, c, s);
                nrm[j] = graded_renorm(wj, p, ve + j);
                nrm[k] = graded_renorm(wk, p, ve + k);
            }
        if (!rotated) break;
    }
    svd_finish(W, V, nrm, perm, Ub, S, U, Vh, m, n, uv, full, ve);
    free(W); free(ve); free(perm);
    return 0;
}

/* ---------------------------------------------------------------- SVD (one-sided Jacobi) */
/* A vector's squared norm after a rotation: nw, the running value (al - t g or be + t g), or w.w
   recomputed when nw has lost half its digits or more to cancellation, nw <= sqrt(eps) ref (ref:
   the pair's smaller squared norm before the rotation; only the smaller vector shrinks, and the
   running value's error is about eps ref; dgesvj recomputes on the same ROOTEPS test). Two equal
   columns (a matrix of ones) give al - t g = al - g, pure rounding, often negative: sqrt(al) was
   then NaN, the threshold test passed and the next rotation's angle was 0/0 (S = 0 / NaN, NaN in
   U and Vh). */
TP_INLINE T svd_norm_update(T nw, T ref, const T *w, int64_t p) {
    return nw > TSQRT(EPS) * ref ? nw : dotp(w, w, p);
}

typedef struct { T *W, *Ub, *V, *nrm, *cs; int64_t *perm; int32_t *pairs; int64_t npairs, round; } svd_scratch;

TP_INLINE int svd_one(const T *a, T *S, T *U, T *Vh, int64_t m, int64_t n, int uv, int full,
                      svd_scratch *sc) {
    const int trans = m < n;
    const int64_t p = trans ? n : m, q = trans ? m : n;
    T *W = sc->W, *V = sc->V, *nrm = sc->nrm;
    if (!all_finite(a, m * n)) return 1;
    T amax;
    if (svd_graded_input(a, m, n, &amax)) return svd_graded(a, S, U, Vh, m, n, uv, full);
    /* scaled by the power of two that brings the largest entry into [1, 2) (exact; the singular
       values are scaled back at the end): the column norms are sums of squares, which underflow
       to zero for a small matrix (fp32 entries below ~1e-19) and overflow for a large one */
    const int ex = TP_SCALE_EXP(amax);
    const T fac = (T)ldexp(1.0, -ex);
    if (!trans) { for (int64_t i = 0; i < m; ++i) for (int64_t j = 0; j < n; ++j) W[j * p + i] = a[i * n + j] * fac; }
    else for (int64_t i = 0; i < m * n; ++i) W[i] = a[i] * fac;
    if (uv) { for (int64_t j = 0; j < q * q; ++j) V[j] = 0; for (int64_t j = 0; j < q; ++j) V[j * q + j] = 1; }
    const T tol = EPS * TSQRT((T)p);
    for (int sweep = 0; sweep < MAX_SWEEPS; ++sweep) {
        for (int64_t j = 0; j < q; ++j) nrm[j] = dotp(W + j * p, W + j * p, p);
        int64_t rotated = 0;
        if (sc->round == 0) {
            for (int64_t t = 0; t < sc->npairs; ++t) {
                int64_t j = sc->pairs[2 * t], k = sc->pairs[2 * t + 1];
                T al = nrm[j], be = nrm[k];
                if (!(al > 0) || !(be > 0)) continue;
                T g = dotp(W + j * p, W + k * p, p);
                if (!(TFABS(g) > tol * TSQRT(al) * TSQRT(be))) continue;
                ++rotated;
                T tt, c, s;
                rot_params(al, be, g, &tt, &c, &s);
                rot(W + j * p, W + k * p, p, c, s);
                if (uv) rot(V + j * q, V + k * q, q, c, s);
                nrm[j] = svd_norm_update(al - tt * g, TP_MIN(al, be), W + j * p, p);
                nrm[k] = svd_norm_update(be + tt * g, TP_MIN(al, be), W + k * p, p);
            }
        } else {  /* a round of disjoint pairs: all inner products, then all rotations */
            const int64_t h = sc->round;
            T *cs = sc->cs;
            for (int64_t base = 0; base < sc->npairs; base += h) {
                const int32_t *pr = sc->pairs + 2 * base;
                int low = 0;  /* whether a running norm of this round is recomputed */
                for (int64_t t = 0; t < h; ++t) {
                    int64_t j = pr[2 * t], k = pr[2 * t + 1];
                    cs[3 * t] = 0;
                    if (j < 0) continue;
                    T al = nrm[j], be = nrm[k];
                    if (!(al > 0) || !(be > 0)) continue;
                    T g = dotp(W + j * p, W + k * p, p);
                    if (!(TFABS(g) > tol * TSQRT(al) * TSQRT(be))) continue;
                    ++rotated;
                    T tt, c, s;
                    rot_params(al, be, g, &tt, &c, &s);
                    cs[3 * t] = c; cs[3 * t + 1] = s;
                    const T nj = al - tt * g, nk = be + tt * g, ref = TP_MIN(al, be);
                    nrm[j] = nj;
                    nrm[k] = nk;
                    /* whether svd_norm_update will recompute one of the two (min(nj, nk) <=
                       sqrt(eps) ref) is noted here among the scalar steps, and its pass runs
                       after the round's rotations only when one does (none on random input).
                       Inside the rotation loop, the test and its effect on the loop's code took
                       1.0M instructions more than no test (callgrind, 16 float32 32 x 32
                       one-matrix SVDs with U and Vh: 14.24M vs 13.24M; time 1.08x that of the
                       code before the recompute), here 0.40M (13.63M; 1.03x) */
                    cs[3 * t + 2] = ref;
                    low |= !(TP_MIN(nj, nk) > TSQRT(EPS) * ref);  /* nj, nk finite: g != 0 */
                }
                for (int64_t t = 0; t < h; ++t) {
                    if (cs[3 * t] == 0) continue;
                    int64_t j = pr[2 * t], k = pr[2 * t + 1];
                    rot(W + j * p, W + k * p, p, cs[3 * t], cs[3 * t + 1]);
                    if (uv) rot(V + j * q, V + k * q, q, cs[3 * t], cs[3 * t + 1]);
                }
                for (int64_t t = 0; low && t < h; ++t) {
                    if (cs[3 * t] == 0) continue;
                    int64_t j = pr[2 * t], k = pr[2 * t + 1];
                    nrm[j] = svd_norm_update(nrm[j], cs[3 * t + 2], W + j * p, p);
                    nrm[k] = svd_norm_update(nrm[k], cs[3 * t + 2], W + k * p, p);
                }
            }
        }
        if (!rotated) break;
    }
    svd_finish(W, V, nrm, sc->perm, sc->Ub, S, U, Vh, m, n, uv, full, NULL);
    for (int64_t j = 0; j < q; ++j) S[j] = (T)ldexp((double)S[j], ex);
    return 0;
}

#define SVD_CALL(M, N) svd_one(a + b * m * n, S + b * k, U + b * usz, Vh + b * vsz, M, N, uv, full, &sc)

TP_EXPORT int tp_svd(const T *a, T *S, T *U, T *Vh, int64_t B, int64_t m, int64_t n, int64_t uv,
                         int64_t full, int64_t order, int64_t nthreads) {
    const int64_t p = TP_MAX(m, n), k = TP_MIN(m, n);
    const int64_t usz = uv ? m * (full ? m : k) : 0, vsz = uv ? n * (full ? n : k) : 0;
    int64_t nt = (B < 2 || B * p * k * k < 100000) ? 1 : nthreads;
    int64_t bad = INT64_MAX;
    #pragma omp parallel num_threads(nt) reduction(min:bad)
    {
        svd_scratch sc;
        sc.W = (T *)malloc(sizeof(T) * (p * k + p * p + k * k + 4 * k + 16));
        sc.Ub = sc.W + p * k; sc.V = sc.Ub + p * p; sc.nrm = sc.V + k * k; sc.cs = sc.nrm + k;
        sc.perm = (int64_t *)malloc(sizeof(int64_t) * (k + 1));
        sc.pairs = (int32_t *)malloc(sizeof(int32_t) * (k + 2) * (k + 2));
        sc.npairs = make_pairs(sc.pairs, k, (int)order);
        sc.round = order ? (k + (k & 1)) / 2 : 0;
        int64_t chunk = TP_MAX(1, B / (nt * 16));
        #pragma omp for schedule(dynamic, chunk)
        for (int64_t b = 0; b < B; ++b) {
            int st;
            if (m == 2 && n == 2) st = SVD_CALL(2, 2);
            else if (m == 3 && n == 3) st = SVD_CALL(3, 3);
            else if (m == 4 && n == 4) st = SVD_CALL(4, 4);
            else st = SVD_CALL(m, n);
            if (st && b < bad) bad = b;
        }
        free(sc.W); free(sc.perm); free(sc.pairs);
    }
    return bad == INT64_MAX ? 0 : (int)TP_MIN(bad + 1, 2147483647);
}

/* ---------------------------------------------------------------- eigh (two-sided Jacobi) */
TP_INLINE int eigh_one(const T *in, T *L, T *Q, int64_t n, int upper, int wantv, T *A, T *V,
                       T *d, int64_t *perm, const int32_t *pairs, int64_t npairs, int64_t round,
                       T *cs, int64_t *lp, int64_t *lq) {
    if (!all_finite(in, n * n)) return 1;
    /* scaled by an even power of two that brings the largest entry into [1, 4) (exact, and the
       square roots below scale exactly; eigenvalues scaled back at the end): the Frobenius sum
       and the angle's squares overflow for fp32 entries from ~1e19 and underflow for tiny ones */
    T amax = 0;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j <= i; ++j) amax = TP_MAX(amax, TFABS(upper ? in[j * n + i] : in[i * n + j]));
    int ex = TP_SCALE_EXP(amax);
    ex -= ex & 1;
    const T fac = (T)ldexp(1.0, -ex);
    T frob = 0;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j <= i; ++j) {
            T x = (upper ? in[j * n + i] : in[i * n + j]) * fac;
            A[i * n + j] = x; A[j * n + i] = x;
            frob += (i == j ? 1 : 2) * x * x;
        }
    frob = TSQRT(frob);
    if (wantv) { for (int64_t j = 0; j < n * n; ++j) V[j] = 0; for (int64_t j = 0; j < n; ++j) V[j * n + j] = 1; }
    const T floor_ = (T)0.1 * frob;
    for (int sweep = 0; sweep < MAX_SWEEPS; ++sweep) {
        int64_t rotated = 0;
        if (round == 0) {
            for (int64_t t = 0; t < npairs; ++t) {
                int64_t p = pairs[2 * t], q = pairs[2 * t + 1];
                T apq = A[p * n + q];
                if (apq == 0) continue;
                T app = A[p * n + p], aqq = A[q * n + q];
                T scale = TSQRT(TFABS(app)) * TSQRT(TFABS(aqq));
                if (TFABS(apq) <= EPS * (scale > floor_ ? scale : floor_)) continue;
                ++rotated;
                T tt, c, s;
                rot_params(app, aqq, apq, &tt, &c, &s);
                rot(A + p * n, A + q * n, n, c, s);
                for (int64_t k = 0; k < n; ++k) { A[k * n + p] = A[p * n + k]; A[k * n + q] = A[q * n + k]; }
                A[p * n + p] = app - tt * apq; A[q * n + q] = aqq + tt * apq;
                A[p * n + q] = 0; A[q * n + p] = 0;
                if (wantv) rot(V + p * n, V + q * n, n, c, s);
            }
        } else {  /* a round of disjoint pairs: all angles, all row rotations, all column rotations */
            const int64_t h = round;
            for (int64_t base = 0; base < npairs; base += h) {
                const int32_t *pr = pairs + 2 * base;
                int64_t live = 0;
                for (int64_t t = 0; t < h; ++t) {
                    int64_t p = pr[2 * t], q = pr[2 * t + 1];
                    if (p < 0) continue;
                    T apq = A[p * n + q];
                    if (apq == 0) continue;
                    T app = A[p * n + p], aqq = A[q * n + q];
                    T scale = TSQRT(TFABS(app)) * TSQRT(TFABS(aqq));
                    if (TFABS(apq) <= EPS * (scale > floor_ ? scale : floor_)) continue;
                    T tt, c, s;
                    rot_params(app, aqq, apq, &tt, &c, &s);
                    lp[live] = p; lq[live] = q;
                    cs[4 * live] = c; cs[4 * live + 1] = s;
                    cs[4 * live + 2] = app - tt * apq; cs[4 * live + 3] = aqq + tt * apq;
                    ++live;
                }
                rotated += live;
                for (int64_t t = 0; t < live; ++t) {
                    rot(A + lp[t] * n, A + lq[t] * n, n, cs[4 * t], cs[4 * t + 1]);
                    if (wantv) rot(V + lp[t] * n, V + lq[t] * n, n, cs[4 * t], cs[4 * t + 1]);
                }
                for (int64_t i = 0; i < n; ++i) {
                    T *row = A + i * n;
                    for (int64_t t = 0; t < live; ++t) {
                        T c = cs[4 * t], s = cs[4 * t + 1], x = row[lp[t]], y = row[lq[t]];
                        row[lp[t]] = c * x - s * y;
                        row[lq[t]] = s * x + c * y;
                    }
                }
                for (int64_t t = 0; t < live; ++t) {
                    int64_t p = lp[t], q = lq[t];
                    A[p * n + p] = cs[4 * t + 2]; A[q * n + q] = cs[4 * t + 3];
                    A[p * n + q] = 0; A[q * n + p] = 0;
                }
            }
        }
        if (!rotated) break;
    }
    for (int64_t j = 0; j < n; ++j) d[j] = A[j * n + j];
    sort_asc(d, perm, n);
    for (int64_t j = 0; j < n; ++j) L[j] = (T)ldexp((double)d[perm[j]], ex);
    if (wantv)
        for (int64_t i = 0; i < n; ++i) for (int64_t j = 0; j < n; ++j) Q[i * n + j] = V[perm[j] * n + i];
    return 0;
}

#define EIGH_CALL(N) eigh_one(a + b * n * n, L + b * n, Q + b * qsz, N, (int)upper, (int)wantv, A, V, d, perm, pairs, np, round, cs, lp, lq)

TP_EXPORT int tp_eigh(const T *a, T *L, T *Q, int64_t B, int64_t n, int64_t upper, int64_t wantv,
                          int64_t order, int64_t nthreads) {
    const int64_t qsz = wantv ? n * n : 0;
    int64_t nt = (B < 2 || B * n * n * n < 100000) ? 1 : nthreads;
    int64_t bad = INT64_MAX;
    #pragma omp parallel num_threads(nt) reduction(min:bad)
    {
        T *A = (T *)malloc(sizeof(T) * (2 * n * n + 5 * n + 16));
        T *V = A + n * n, *d = V + n * n, *cs = d + n;
        int64_t *perm = (int64_t *)malloc(sizeof(int64_t) * (3 * n + 6));
        int64_t *lp = perm + n + 2, *lq = lp + n + 2;
        int32_t *pairs = (int32_t *)malloc(sizeof(int32_t) * (n + 2) * (n + 2));
        int64_t np = make_pairs(pairs, n, (int)order);
        int64_t round = order ? (n + (n & 1)) / 2 : 0;
        int64_t chunk = TP_MAX(1, B / (nt * 16));
        #pragma omp for schedule(dynamic, chunk)
        for (int64_t b = 0; b < B; ++b) {
            int st;
            if (n == 2) st = EIGH_CALL(2);
            else if (n == 3) st = EIGH_CALL(3);
            else if (n == 4) st = EIGH_CALL(4);
            else st = EIGH_CALL(n);
            if (st && b < bad) bad = b;
        }
        free(A); free(perm); free(pairs);
    }
    return bad == INT64_MAX ? 0 : (int)TP_MIN(bad + 1, 2147483647);
}


/* ---------------------------------------------------------------- eigh, VLN matrices at once
   The same cyclic Jacobi as eigh_one, run on VLN matrices interleaved lane by lane (gcc vector
   extensions; VBYTES-byte vectors, see *Lanes* in the module docstring): every lane takes the same (p, q) sequence and a lane whose
   a_pq is below its threshold gets the identity rotation. Rows and columns of the interleaved
   matrix are equally contiguous, so the column update is vectorised too. */
#define VBYTES ${vbytes}
typedef T VT __attribute__((vector_size(VBYTES), aligned(VBYTES)));
typedef ${ielem} VI __attribute__((vector_size(VBYTES), aligned(VBYTES)));
#define VLN ((int64_t)(VBYTES / sizeof(T)))
/* the SVD lane kernel's loops over a column unrolled by 4 (interleaved minima of 11 against
   the rolled loops, B = 400, one thread, load 3.4-4.4: n = 16 / 32 fp64 1.06x / 1.08x, fp32
   1.03x / 1.07x; the same pragma on the eigh kernel's loops gained nothing, 0.96-1.03x) */
#define TP_UNROLL _Pragma("GCC unroll 4")

TP_INLINE VT vsel(VI m, VT a, VT b) { return (VT)(((VI)a & m) | ((VI)b & ~m)); }
TP_INLINE VT vabs(VT x) { VT z = x - x; return vsel(x < z, -x, x); }
TP_INLINE VT vsqrt(VT x) {
#if VBYTES == 64 && defined(__AVX512F__)
    return (VT)${vsqrt512}((${m512})x);
#elif VBYTES == 32 && defined(__AVX__)
    return (VT)${vsqrt}((${m256})x);
#else
    VT r; for (int l = 0; l < VLN; ++l) r[l] = TSQRT(x[l]); return r;
#endif
}
TP_INLINE int vany(VI m) { ${ielem} r = 0; for (int l = 0; l < VLN; ++l) r |= m[l]; return r != 0; }

/* One round of disjoint pairs (p_t, q_t), t < h (p_t < 0: a bye): every angle first (the
   h sqrt/div chains are independent, so they overlap in the pipeline), then the row rotations,
   then the column rotations (contiguous in the lane layout), then the 2x2 blocks' new values.
   Returns 1 if any lane rotated. */
TP_INLINE int eigh_vec_round(VT *A, VT *V, int64_t n, int wantv, const int32_t *pr, int64_t h,
                             VT floor_, VT *cs, int64_t *lp, int64_t *lq) {
    const VT zero = {0}, one = zero + 1;
    int64_t live = 0;
    for (int64_t t = 0; t < h; ++t) {
        int64_t p = pr[2 * t], q = pr[2 * t + 1];
        if (p < 0) continue;
        VT apq = A[p * n + q], app = A[p * n + p], aqq = A[q * n + q];
        VT scale = vsqrt(vabs(app)) * vsqrt(vabs(aqq));
        scale = vsel(scale > floor_, scale, floor_);
        VI act = (vabs(apq) > EPS * scale) & (apq != zero);
        if (!vany(act)) continue;
        VT g = vsel(act, apq, one);
        VT theta = (aqq - app) / (g + g);
        VT sgn = vsel(theta >= zero, one, -one);
        VT tt = vsel(act, sgn / (vabs(theta) + vsqrt(one + theta * theta)), zero);
        VT c = one / vsqrt(one + tt * tt);
        VT *o = cs + 5 * live;
        o[0] = c; o[1] = c * tt; o[2] = app - tt * apq; o[3] = aqq + tt * apq;
        o[4] = vsel(act, zero, apq);
        lp[live] = p; lq[live] = q;
        ++live;
    }
    if (!live) return 0;
    for (int64_t t = 0; t < live; ++t) {
        const VT c = cs[5 * t], s = cs[5 * t + 1];
        VT *rp = A + lp[t] * n, *rq = A + lq[t] * n;
        for (int64_t k = 0; k < n; ++k) {
            VT x = rp[k], y = rq[k];
            rp[k] = c * x - s * y;
            rq[k] = s * x + c * y;
        }
        if (wantv) {
            VT *vp = V + lp[t] * n, *vq = V + lq[t] * n;
            for (int64_t k = 0; k < n; ++k) {
                VT x = vp[k], y = vq[k];
                vp[k] = c * x - s * y;
                vq[k] = s * x + c * y;
            }
        }
    }
    for (int64_t i = 0; i < n; ++i) {
        VT *row = A + i * n;
        for (int64_t t = 0; t < live; ++t) {
            const VT c = cs[5 * t], s = cs[5 * t + 1];
            VT x = row[lp[t]], y = row[lq[t]];
            row[lp[t]] = c * x - s * y;
            row[lq[t]] = s * x + c * y;
        }
    }
    for (int64_t t = 0; t < live; ++t) {
        int64_t p = lp[t], q = lq[t];
        A[p * n + p] = cs[5 * t + 2]; A[q * n + q] = cs[5 * t + 3];
        A[p * n + q] = cs[5 * t + 4]; A[q * n + p] = cs[5 * t + 4];
    }
    return 1;
}

/* Per lane l < cnt of VLN symmetric matrices (the triangle ``upper`` picks): ex[l] brings the
   largest entry into [1, 2); returns the lanes' factors 2^-ex (1 for unused lanes). */
TP_INLINE VT lane_scale_sym(const T *in, int64_t cnt, int64_t n, int upper, int *ex) {
    const VT zero = {0};
    VT fac = zero + 1;
    for (int64_t l = 0; l < VLN; ++l) {
        T mx = 0;
        if (l < cnt)
            for (int64_t i = 0; i < n; ++i)
                for (int64_t j = 0; j <= i; ++j) {
                    T x = TFABS(upper ? in[l * n * n + j * n + i] : in[l * n * n + i * n + j]);
                    mx = x > mx ? x : mx;
                }
        ex[l] = TP_SCALE_EXP(mx);
        fac[l] = ${ldexp}((T)1, -ex[l]);
    }
    return fac;
}

TP_INLINE int eigh_vec(const T *in, T *L, T *Q, int64_t cnt, int64_t n, int upper, int wantv,
                       VT *A, VT *V, T *d, int64_t *perm, const int32_t *pairs, int64_t npairs,
                       int64_t h, VT *cs, int64_t *lp, int64_t *lq) {
    const VT zero = {0}, one = zero + 1;
    for (int64_t l = 0; l < cnt; ++l) if (!all_finite(in + l * n * n, n * n)) return (int)l + 1;
    /* each lane scaled by a power of two (lane_scale_sym; the eigenvalues scaled back at the
       end): unscaled, the Frobenius sum overflowed for large entries (no rotation passed the
       threshold: the sorted diagonal came back as the eigenvalues) and underflowed for small */
    int ex[VLN];
    const VT fac = lane_scale_sym(in, cnt, n, upper, ex);
    VT frob = zero;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j <= i; ++j) {
            VT x = zero;
            for (int64_t l = 0; l < cnt; ++l) x[l] = upper ? in[l * n * n + j * n + i] : in[l * n * n + i * n + j];
            x *= fac;
            A[i * n + j] = x; A[j * n + i] = x;
            frob += (i == j ? one : one + one) * x * x;
        }
    const VT floor_ = (T)0.1 * vsqrt(frob);
    if (wantv) { for (int64_t j = 0; j < n * n; ++j) V[j] = zero; for (int64_t j = 0; j < n; ++j) V[j * n + j] = one; }
    for (int sweep = 0; sweep < MAX_SWEEPS && h; ++sweep) {  /* round-robin order */
        int rotated = 0;
        for (int64_t base = 0; base < npairs; base += h)
            rotated |= eigh_vec_round(A, V, n, wantv, pairs + 2 * base, h, floor_, cs, lp, lq);
        if (!rotated) break;
    }
    for (int sweep = 0; sweep < MAX_SWEEPS && !h; ++sweep) {  /* cyclic order */
        int rotated = 0;
        for (int64_t p = 0; p < n; ++p)
            for (int64_t q = p + 1; q < n; ++q) {
                VT apq = A[p * n + q], app = A[p * n + p], aqq = A[q * n + q];
                VT scale = vsqrt(vabs(app)) * vsqrt(vabs(aqq));
                scale = vsel(scale > floor_, scale, floor_);
                VI act = (vabs(apq) > EPS * scale) & (apq != zero);
                if (!vany(act)) continue;
                rotated = 1;
                VT g = vsel(act, apq, one);
                VT theta = (aqq - app) / (g + g);
                VT sgn = vsel(theta >= zero, one, -one);
                VT t = sgn / (vabs(theta) + vsqrt(one + theta * theta));
                t = vsel(act, t, zero);
                VT c = one / vsqrt(one + t * t), s = c * t;
                VT *rp = A + p * n, *rq = A + q * n;
                for (int64_t k = 0; k < n; ++k) {
                    VT x = rp[k], y = rq[k];
                    rp[k] = c * x - s * y;
                    rq[k] = s * x + c * y;
                }
                for (int64_t k = 0; k < n; ++k) { A[k * n + p] = rp[k]; A[k * n + q] = rq[k]; }
                A[p * n + p] = app - t * apq; A[q * n + q] = aqq + t * apq;
                VT z = vsel(act, zero, apq);
                A[p * n + q] = z; A[q * n + p] = z;
                if (wantv) {
                    VT *vp = V + p * n, *vq = V + q * n;
                    for (int64_t k = 0; k < n; ++k) {
                        VT x = vp[k], y = vq[k];
                        vp[k] = c * x - s * y;
                        vq[k] = s * x + c * y;
                    }
                }
            }
        if (!rotated) break;
    }
    for (int64_t l = 0; l < cnt; ++l) {
        for (int64_t j = 0; j < n; ++j) d[j] = ${ldexp}(A[j * n + j][l], ex[l]);
        sort_asc(d, perm, n);
        for (int64_t j = 0; j < n; ++j) L[l * n + j] = d[perm[j]];
        if (wantv)
            for (int64_t i = 0; i < n; ++i)
                for (int64_t j = 0; j < n; ++j) Q[l * n * n + i * n + j] = V[perm[j] * n + i][l];
    }
    return 0;
}

/* Round-robin Jacobi with each round's two-sided update fused and halved by symmetry (order 2).
   Only the upper triangle (i <= j) of the lane matrix A (stride r, r = n rounded up to even; an
   odd n gets a padding index whose row and column are zero, so it never rotates) is kept. A round
   of r/2 disjoint pairs is A' = G A G^T with G block-diagonal in the pairs; every element of the
   upper triangle lies in exactly one 2x2 block (P, Q), P <= Q, of the pairs, so the round reads
   and writes each element once (B' = G_P B G_Q^T), where the separate row and column passes
   read and wrote the full matrix twice. Blocks whose two pairs rotate in no lane are skipped
   (threshold Jacobi: late sweeps touch only the pairs that are not yet converged). */
#define UIX(i, j) ((i) < (j) ? (i) * r + (j) : (j) * r + (i))
TP_INLINE int eigh_vec_fused_round(VT *A, VT *V, int64_t r, int wantv, const int32_t *pr,
                                   VT floor2, VT *cs, int32_t *live) {
    const VT zero = {0}, one = zero + 1;
    const int64_t h = r / 2;
    int any = 0;
    for (int64_t t = 0; t < h; ++t) {
        const int64_t p = pr[2 * t], q = pr[2 * t + 1];
        VT apq = A[p * r + q], app = A[p * r + p], aqq = A[q * r + q];
        /* the test |a_pq| > eps max(sqrt|a_pp a_qq|, floor) squared: the matrix is scaled to
           max |a_ij| in [1, 2), so no square over- or underflows where it matters */
        VT scale2 = vabs(app * aqq);
        scale2 = vsel(scale2 > floor2, scale2, floor2);
        VI act = (apq * apq > (EPS * EPS) * scale2) & (apq != zero);
        live[t] = vany(act);
        if (!live[t]) continue;
        any = 1;
        /* t = sign(theta) / (|theta| + sqrt(1 + theta^2)), theta = d / g, in the form
           sign(theta) |g| / (|d| + sqrt(d^2 + g^2)): one division and one root fewer */
        VT d = aqq - app, g = apq + apq;
        VI same = (d == zero) | ((d > zero) == (g > zero));
        VT num = vsel(same, vabs(g), -vabs(g));
        VT tt = vsel(act, num / (vabs(d) + vsqrt(d * d + g * g)), zero);
        VT c = one / vsqrt(one + tt * tt);
        VT *o = cs + 2 * t;
        o[0] = c; o[1] = c * tt;
        A[p * r + p] = app - tt * apq; A[q * r + q] = aqq + tt * apq;
        A[p * r + q] = vsel(act, zero, apq);
    }
    if (!any) return 0;
    for (int64_t P = 0; P < h; ++P) {
        const int64_t pP = pr[2 * P], qP = pr[2 * P + 1];
        const VT cP = live[P] ? cs[2 * P] : one, sP = live[P] ? cs[2 * P + 1] : zero;
        for (int64_t Q = P + 1; Q < h; ++Q) {
            if (!live[P] && !live[Q]) continue;
            const int64_t pQ = pr[2 * Q], qQ = pr[2 * Q + 1];
            const VT cQ = live[Q] ? cs[2 * Q] : one, sQ = live[Q] ? cs[2 * Q + 1] : zero;
            VT *ex = A + UIX(pP, pQ), *ey = A + UIX(pP, qQ), *ez = A + UIX(qP, pQ), *ew = A + UIX(qP, qQ);
            VT x = *ex, y = *ey, z = *ez, w = *ew;
            VT x1 = cP * x - sP * z, z1 = sP * x + cP * z;
            VT y1 = cP * y - sP * w, w1 = sP * y + cP * w;
            *ex = cQ * x1 - sQ * y1; *ey = sQ * x1 + cQ * y1;
            *ez = cQ * z1 - sQ * w1; *ew = sQ * z1 + cQ * w1;
        }
    }
    if (wantv)
        for (int64_t t = 0; t < h; ++t) {
            if (!live[t]) continue;
            const VT c = cs[2 * t], s = cs[2 * t + 1];
            VT *vp = V + pr[2 * t] * r, *vq = V + pr[2 * t + 1] * r;
            for (int64_t k = 0; k < r; ++k) {
                VT x = vp[k], y = vq[k];
                vp[k] = c * x - s * y;
                vq[k] = s * x + c * y;
            }
        }
    return 1;
}

TP_INLINE int eigh_vec_fused(const T *in, T *L, T *Q, int64_t cnt, int64_t n, int upper, int wantv,
                             VT *A, VT *V, T *d, int64_t *perm, const int32_t *pairs,
                             int64_t npairs, VT *cs, int32_t *live) {
    const VT zero = {0}, one = zero + 1;
    const int64_t r = n + (n & 1);
    for (int64_t l = 0; l < cnt; ++l) if (!all_finite(in + l * n * n, n * n)) return (int)l + 1;
    /* each lane scaled by a power of two (lane_scale_sym): exact, and the eigenvalues are
       scaled back at the end */
    int ex[VLN];
    const VT fac = lane_scale_sym(in, cnt, n, upper, ex);
    VT frob = zero;
    for (int64_t i = 0; i < r; ++i)
        for (int64_t j = i; j < r; ++j) {
            VT x = zero;
            if (j < n)
                for (int64_t l = 0; l < cnt; ++l) x[l] = upper ? in[l * n * n + i * n + j] : in[l * n * n + j * n + i];
            x *= fac;
            A[i * r + j] = x;
            frob += (i == j ? one : one + one) * x * x;
        }
    const VT floor2 = (T)0.01 * frob;
    if (wantv) { for (int64_t j = 0; j < r * r; ++j) V[j] = zero; for (int64_t j = 0; j < r; ++j) V[j * r + j] = one; }
    const int64_t h = r / 2;
    for (int sweep = 0; sweep < MAX_SWEEPS; ++sweep) {
        int rotated = 0;
        for (int64_t base = 0; base < npairs; base += h)
            rotated |= eigh_vec_fused_round(A, V, r, wantv, pairs + 2 * base, floor2, cs, live);
        if (!rotated) break;
    }
    for (int64_t l = 0; l < cnt; ++l) {
        for (int64_t j = 0; j < n; ++j) d[j] = ${ldexp}(A[j * r + j][l], ex[l]);
        sort_asc(d, perm, n);
        for (int64_t j = 0; j < n; ++j) L[l * n + j] = d[perm[j]];
        if (wantv)
            for (int64_t i = 0; i < n; ++i)
                for (int64_t j = 0; j < n; ++j) Q[l * n * n + i * n + j] = V[perm[j] * r + i][l];
    }
    return 0;
}
#undef UIX

TP_EXPORT int tp_eigh_vec(const T *a, T *L, T *Q, int64_t B, int64_t n, int64_t upper, int64_t wantv,
                          int64_t order, int64_t nthreads) {
    const int64_t groups = (B + VLN - 1) / VLN;
    int64_t nt = (groups < 2 || B * n * n * n < 100000) ? 1 : nthreads;
    int64_t bad = INT64_MAX;
    #pragma omp parallel num_threads(nt) reduction(min:bad)
    {
        const int64_t r = n + 1;  /* room for the fused kernel's padding index */
        VT *A = (VT *)aligned_alloc(VBYTES, sizeof(VT) * (2 * r * r + 5 * r + 8));
        VT *V = A + r * r, *cs = V + r * r;
        T *d = (T *)malloc(sizeof(T) * (n + 1));
        int64_t *perm = (int64_t *)malloc(sizeof(int64_t) * (3 * n + 6));
        int64_t *lp = perm + n + 2, *lq = lp + n + 2;
        int32_t *live = (int32_t *)malloc(sizeof(int32_t) * (n + 2));
        int32_t *pairs = (int32_t *)malloc(sizeof(int32_t) * (n + 2) * (n + 2));
        /* order 2 pairs all r = n + (n & 1) indices (the padding one included) */
        int64_t np = order == 2 ? make_pairs(pairs, n + (n & 1), 1) : make_pairs(pairs, n, (int)order);
        int64_t h = order ? (n + (n & 1)) / 2 : 0;
        int64_t chunk = TP_MAX(1, groups / (nt * 16));
        #pragma omp for schedule(dynamic, chunk)
        for (int64_t gi = 0; gi < groups; ++gi) {
            int64_t b0 = gi * VLN, cnt = TP_MIN(VLN, B - b0);
            int st;
            const T *src = a + b0 * n * n;
            T *lo = L + b0 * n, *qo = wantv ? Q + b0 * n * n : Q;
#define EIGH_VEC(N) eigh_vec(src, lo, qo, cnt, N, (int)upper, (int)wantv, A, V, d, perm, pairs, np, h, cs, lp, lq)
/* constant-size builds of the fused kernel for n = 16 and 32 (trip counts and strides known:
   interleaved minima of 11, B = 400, one thread, load 1.5-2.1: fp64 1.04-1.09x / 1.03-1.11x,
   fp32 1.07-1.16x / 1.04-1.20x) */
#define EIGH_FUSED(N) eigh_vec_fused(src, lo, qo, cnt, N, (int)upper, (int)wantv, A, V, d, perm, pairs, np, cs, live)
            if (order == 2 && n == 16) st = EIGH_FUSED(16);
            else if (order == 2 && n == 32) st = EIGH_FUSED(32);
            else if (order == 2) st = EIGH_FUSED(n);
            else if (n == 2) st = EIGH_VEC(2);
            else if (n == 3) st = EIGH_VEC(3);
            else if (n == 4) st = EIGH_VEC(4);
            else st = EIGH_VEC(n);
            if (st && b0 + st - 1 < bad) bad = b0 + st - 1;
        }
        free(A); free(d); free(perm); free(live); free(pairs);
    }
    return bad == INT64_MAX ? 0 : (int)TP_MIN(bad + 1, 2147483647);
}


/* ---------------------------------------------------------------- SVD, VLN matrices at once
   The one-sided Jacobi sweeps of svd_one (same pair order) on VLN interleaved matrices; then
   each lane is copied out and finished by svd_finish. */
TP_INLINE int svd_vec(const T *a, T *S, T *U, T *Vh, int64_t cnt, int64_t m, int64_t n, int uv,
                      int full, const int32_t *pairs, int64_t npairs, int64_t h, VT *W, VT *V,
                      VT *nv, VT *cs, int64_t *lp, int64_t *lq, T *Ws, T *Vs, T *nrm,
                      int64_t *perm, T *Ub) {
    const int trans = m < n;
    const int64_t p = trans ? n : m, q = trans ? m : n, k = q;
    const VT zero = {0}, one = zero + 1;
    for (int64_t l = 0; l < cnt; ++l) if (!all_finite(a + l * m * n, m * n)) return (int)l + 1;
    /* each lane scaled by the power of two that brings its largest entry into [1, 2), as in
       svd_one (exact; the singular values scaled back at the end): unscaled, the column sums of
       squares overflowed to inf for large entries and underflowed for small ones. A graded lane
       (svd_graded_input) sweeps as zeros, as the padding lanes, and is solved by svd_graded. */
    int ex[VLN], gr[VLN];
    VT fac = one;
    for (int64_t l = 0; l < VLN; ++l) {
        T mx = 0;
        gr[l] = l < cnt && svd_graded_input(a + l * m * n, m, n, &mx);
        if (gr[l]) mx = 0;
        ex[l] = TP_SCALE_EXP(mx);
        fac[l] = (T)ldexp(1.0, -ex[l]);
    }
    for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
            VT x = zero;
            for (int64_t l = 0; l < cnt; ++l) if (!gr[l]) x[l] = a[l * m * n + i * n + j];
            x *= fac;
            if (!trans) W[j * p + i] = x; else W[i * p + j] = x;
        }
    if (uv) { for (int64_t j = 0; j < q * q; ++j) V[j] = zero; for (int64_t j = 0; j < q; ++j) V[j * q + j] = one; }
    const T tol = EPS * TSQRT((T)p);
    for (int sweep = 0; sweep < MAX_SWEEPS; ++sweep) {
        for (int64_t j = 0; j < q; ++j) {
            VT acc = zero;
            TP_UNROLL
            for (int64_t i = 0; i < p; ++i) acc += W[j * p + i] * W[j * p + i];
            nv[j] = acc;
        }
        int rotated = 0;
        for (int64_t base = 0; base < npairs; base += h) {
          /* a round of h disjoint pairs (h = 1: the cyclic order): every inner product and
             angle first, so their FMA and sqrt/div chains overlap, then the rotations */
          int64_t live = 0;
          for (int64_t t = base; t < base + h; ++t) {
            int64_t j = pairs[2 * t], kk = pairs[2 * t + 1];
            if (j < 0) continue;
            VT al = nv[j], be = nv[kk], g = zero;
            const VT *wj = W + j * p, *wk = W + kk * p;
            TP_UNROLL
            for (int64_t i = 0; i < p; ++i) g += wj[i] * wk[i];
            VI act = (al != zero) & (be != zero) & (vabs(g) > tol * vsqrt(al) * vsqrt(be));
            if (!vany(act)) continue;
            VT gs = vsel(act, g, one);
            VT zeta = (be - al) / (gs + gs);
            VT sgn = vsel(zeta >= zero, one, -one);
            VT tt = vsel(act, sgn / (vabs(zeta) + vsqrt(one + zeta * zeta)), zero);
            VT c = one / vsqrt(one + tt * tt);
            cs[3 * live] = c; cs[3 * live + 1] = c * tt; cs[3 * live + 2] = tt * g;
            lp[live] = j; lq[live] = kk;
            ++live;
          }
          rotated |= live > 0;
          for (int64_t r = 0; r < live; ++r) {
            const int64_t j = lp[r], kk = lq[r];
            const VT c = cs[3 * r], s = cs[3 * r + 1];
            VT *wj = W + j * p, *wk = W + kk * p;
            TP_UNROLL
            for (int64_t i = 0; i < p; ++i) {
                VT x = wj[i], y = wk[i];
                wj[i] = c * x - s * y;
                wk[i] = s * x + c * y;
            }
            if (uv) {
                VT *vj = V + j * q, *vk = V + kk * q;
                TP_UNROLL
                for (int64_t i = 0; i < q; ++i) {
                    VT x = vj[i], y = vk[i];
                    vj[i] = c * x - s * y;
                    vk[i] = s * x + c * y;
                }
            }
            nv[j] -= cs[3 * r + 2];
            nv[kk] += cs[3 * r + 2];
          }
        }
        if (!rotated) break;
    }
    const int64_t usz = uv ? m * (full ? m : k) : 0, vsz = uv ? n * (full ? n : k) : 0;
    for (int64_t l = 0; l < cnt; ++l) {
        if (gr[l]) {
            svd_graded(a + l * m * n, S + l * k, U + l * usz, Vh + l * vsz, m, n, uv, full);
            continue;
        }
        for (int64_t i = 0; i < q * p; ++i) Ws[i] = W[i][l];
        if (uv) for (int64_t i = 0; i < q * q; ++i) Vs[i] = V[i][l];
        svd_finish(Ws, Vs, nrm, perm, Ub, S + l * k, U + l * usz, Vh + l * vsz, m, n, uv, full, NULL);
        for (int64_t j = 0; j < k; ++j) S[l * k + j] = (T)ldexp((double)S[l * k + j], ex[l]);
    }
    return 0;
}

TP_EXPORT int tp_svd_vec(const T *a, T *S, T *U, T *Vh, int64_t B, int64_t m, int64_t n, int64_t uv,
                         int64_t full, int64_t order, int64_t nthreads) {
    const int64_t p = TP_MAX(m, n), k = TP_MIN(m, n);
    const int64_t usz = uv ? m * (full ? m : k) : 0, vsz = uv ? n * (full ? n : k) : 0;
    const int64_t groups = (B + VLN - 1) / VLN;
    int64_t nt = (groups < 2 || B * p * k * k < 100000) ? 1 : nthreads;
    int64_t bad = INT64_MAX;
    #pragma omp parallel num_threads(nt) reduction(min:bad)
    {
        VT *W = (VT *)aligned_alloc(VBYTES, sizeof(VT) * (p * k + k * k + 4 * k + 8));
        VT *V = W + p * k, *nv = V + k * k, *cs = nv + k;
        T *Ws = (T *)malloc(sizeof(T) * (p * k + k * k + k + p * p + 8));
        T *Vs = Ws + p * k, *nrm = Vs + k * k, *Ub = nrm + k;
        int64_t *perm = (int64_t *)malloc(sizeof(int64_t) * (3 * k + 6));
        int64_t *lp = perm + k + 2, *lq = lp + k + 2;
        int32_t *pairs = (int32_t *)malloc(sizeof(int32_t) * (k + 2) * (k + 2));
        int64_t np = make_pairs(pairs, k, (int)order);
        int64_t h = order ? (k + (k & 1)) / 2 : 1;
        int64_t chunk = TP_MAX(1, groups / (nt * 16));
        #pragma omp for schedule(dynamic, chunk)
        for (int64_t gi = 0; gi < groups; ++gi) {
            int64_t b0 = gi * VLN, cnt = TP_MIN(VLN, B - b0);
            const T *src = a + b0 * m * n;
            T *so = S + b0 * k, *uo = U + b0 * usz, *vo = Vh + b0 * vsz;
            int st;
            if (m == 2 && n == 2) st = svd_vec(src, so, uo, vo, cnt, 2, 2, (int)uv, (int)full, pairs, np, h, W, V, nv, cs, lp, lq, Ws, Vs, nrm, perm, Ub);
            else if (m == 3 && n == 3) st = svd_vec(src, so, uo, vo, cnt, 3, 3, (int)uv, (int)full, pairs, np, h, W, V, nv, cs, lp, lq, Ws, Vs, nrm, perm, Ub);
            else if (m == 4 && n == 4) st = svd_vec(src, so, uo, vo, cnt, 4, 4, (int)uv, (int)full, pairs, np, h, W, V, nv, cs, lp, lq, Ws, Vs, nrm, perm, Ub);
            /* (no 16 / 32 constant copies: from k = SVD_LANES_FAST_FROM the public path runs
               svd_lanes, so only an explicit cyclic order reaches these sizes, and each copy
               cost ~20 % of this library's compile time) */
            else st = svd_vec(src, so, uo, vo, cnt, m, n, (int)uv, (int)full, pairs, np, h, W, V, nv, cs, lp, lq, Ws, Vs, nrm, perm, Ub);
            if (st && b0 + st - 1 < bad) bad = b0 + st - 1;
        }
        free(W); free(Ws); free(perm); free(pairs);
    }
    return bad == INT64_MAX ? 0 : (int)TP_MIN(bad + 1, 2147483647);
}


/* Cholesky on VLN interleaved matrices (one per SIMD lane); a lane whose pivot fails records its
   info, continues on a unit pivot (its result is discarded) and is written out as zeros. */
TP_INLINE void chol_vec(const T *a, T *out, int32_t *info, int64_t cnt, int64_t n, int upper, VT *Lw) {
    const VT zero = {0}, one = zero + 1;
    int32_t inf_l[VLN];
    for (int l = 0; l < VLN; ++l) inf_l[l] = 0;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j <= i; ++j) {
            VT x = one;
            for (int64_t l = 0; l < cnt; ++l) x[l] = upper ? a[l * n * n + j * n + i] : a[l * n * n + i * n + j];
            Lw[i * n + j] = x;
        }
    for (int64_t i = 0; i < n; ++i) {
        VT *Li = Lw + i * n;
        for (int64_t j = 0; j <= i; ++j) {
            const VT *Lj = Lw + j * n;
            VT s = Li[j];
            for (int64_t k = 0; k < j; ++k) s -= Li[k] * Lj[k];
            if (j < i) { Li[j] = s / Lj[j]; continue; }
            VI ok = s > zero;
            for (int l = 0; l < VLN; ++l) if (!ok[l] && !inf_l[l]) inf_l[l] = (int32_t)(i + 1);
            Li[i] = vsqrt(vsel(ok, s, one));
        }
    }
    for (int64_t l = 0; l < cnt; ++l) {
        T *o = out + l * n * n;
        info[l] = inf_l[l];
        for (int64_t i = 0; i < n; ++i)
            for (int64_t j = 0; j < n; ++j) {
                T v = 0;
                if (!inf_l[l]) {
                    if (!upper && j <= i) v = Lw[i * n + j][l];
                    if (upper && j >= i) v = Lw[j * n + i][l];
                }
                o[i * n + j] = v;
            }
    }
}

/* Lane layout <-> VLN matrices stored one after another (stride `ss` elements): dst[k][l] =
   src[l][k] for a VLN x VLN block, made of TW x TW blocks transposed by AVX shuffles (8x8 float
   / 4x4 double; 64-byte lanes take four of them); ne elements, a tail that is not a whole block
   by scalar moves. */
#define TW ((int64_t)(32 / sizeof(T)))
TP_INLINE void tr_tile(const T *src, int64_t ss, T *dst, int64_t ds) {
#if defined(__AVX__) && ${is64}
    __m256d r0 = _mm256_loadu_pd(src), r1 = _mm256_loadu_pd(src + ss);
    __m256d r2 = _mm256_loadu_pd(src + 2 * ss), r3 = _mm256_loadu_pd(src + 3 * ss);
    __m256d t0 = _mm256_unpacklo_pd(r0, r1), t1 = _mm256_unpackhi_pd(r0, r1);
    __m256d t2 = _mm256_unpacklo_pd(r2, r3), t3 = _mm256_unpackhi_pd(r2, r3);
    _mm256_storeu_pd(dst, _mm256_permute2f128_pd(t0, t2, 0x20));
    _mm256_storeu_pd(dst + ds, _mm256_permute2f128_pd(t1, t3, 0x20));
    _mm256_storeu_pd(dst + 2 * ds, _mm256_permute2f128_pd(t0, t2, 0x31));
    _mm256_storeu_pd(dst + 3 * ds, _mm256_permute2f128_pd(t1, t3, 0x31));
#elif defined(__AVX__)
    __m256 r[8], t[8], u[8];
    for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(src + k * ss);
    for (int k = 0; k < 8; k += 2) { t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]); t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]); }
    for (int k = 0; k < 8; k += 4) {
        u[k] = _mm256_shuffle_ps(t[k], t[k + 2], 0x44); u[k + 1] = _mm256_shuffle_ps(t[k], t[k + 2], 0xEE);
        u[k + 2] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0x44); u[k + 3] = _mm256_shuffle_ps(t[k + 1], t[k + 3], 0xEE);
    }
    for (int k = 0; k < 4; ++k) {
        _mm256_storeu_ps(dst + k * ds, _mm256_permute2f128_ps(u[k], u[k + 4], 0x20));
        _mm256_storeu_ps(dst + (k + 4) * ds, _mm256_permute2f128_ps(u[k], u[k + 4], 0x31));
    }
#else
    for (int64_t k = 0; k < TW; ++k) for (int64_t l = 0; l < TW; ++l) dst[k * ds + l] = src[l * ss + k];
#endif
}

TP_INLINE void tr_block(const T *src, int64_t ss, T *dst, int64_t ds) {
    for (int64_t r = 0; r < VLN; r += TW)
        for (int64_t c = 0; c < VLN; c += TW) tr_tile(src + r * ss + c, ss, dst + c * ds + r, ds);
}

TP_INLINE void to_lanes(const T *a, int64_t ss, int64_t ne, VT *X) {
    int64_t e = 0;
    for (; e + VLN <= ne; e += VLN) tr_block(a + e, ss, (T *)(X + e), VLN);
    for (; e < ne; ++e) for (int64_t l = 0; l < VLN; ++l) X[e][l] = a[l * ss + e];
}

TP_INLINE void from_lanes(const VT *X, int64_t ne, T *a, int64_t ss) {
    int64_t e = 0;
    for (; e + VLN <= ne; e += VLN) tr_block((const T *)(X + e), VLN, a + e, ss);
    for (; e < ne; ++e) for (int64_t l = 0; l < VLN; ++l) a[l * ss + e] = X[e][l];
}

/* A full group of VLN matrices, factored in place in the lane layout X (n x n vectors; the
   factor is built in the lower triangle, reading the upper one as input for upper = 1): one
   division and one square root per pivot (off-diagonal entries multiply by 1/sqrt(pivot)), then
   the other triangle zeroed (or the factor transposed for upper) and stored back. */
TP_INLINE void chol_vec_full(const T *a, T *out, int32_t *info, int64_t n, int upper, VT *X) {
    const VT zero = {0}, one = zero + 1;
    int32_t inf_l[VLN];
    int failed = 0;
    /* lower factor, n a multiple of VLN: the VLN-wide chunks wholly above the diagonal are
       neither read nor transposed, and are stored as zeros */
    const int tri = !upper && n % VLN == 0;
    for (int l = 0; l < VLN; ++l) inf_l[l] = 0;
    if (tri) {
        for (int64_t i = 0; i < n; ++i)
            for (int64_t j0 = 0; j0 <= i; j0 += VLN) tr_block(a + i * n + j0, n * n, (T *)(X + i * n + j0), VLN);
    } else to_lanes(a, n * n, n * n, X);
    /* column by column (Crout, left-looking): a column's entries are dot products over the
       finished columns, independent of its pivot, four rows at a time sharing the loads of row
       j; only the multiply by 1/sqrt(pivot) waits for the pivot, and 1/sqrt(s) = sqrt(s) * (1/s)
       runs the square root and the division side by side. (The row-by-row loop this replaced
       chained every entry on the one before it; the right-looking form stored every trailing
       entry once per column.) */
    for (int64_t j = 0; j < n; ++j) {
        VT *Lj = X + j * n;
        VT s0 = Lj[j], s1 = zero;
        int64_t k = 0;
        for (; k + 1 < j; k += 2) { s0 -= Lj[k] * Lj[k]; s1 -= Lj[k + 1] * Lj[k + 1]; }
        if (k < j) s0 -= Lj[k] * Lj[k];
        VT s = s0 + s1;
        VI ok = s > zero;
        if (vany(~ok)) {
            failed = 1;
            for (int l = 0; l < VLN; ++l) if (!ok[l] && !inf_l[l]) inf_l[l] = (int32_t)(j + 1);
        }
        s = vsel(ok, s, one);
        VT d = vsqrt(s), r = d * (one / s);
        Lj[j] = d;
        int64_t i = j + 1;
        for (; i + 3 < n; i += 4) {
            VT *L0 = X + i * n, *L1 = L0 + n, *L2 = L1 + n, *L3 = L2 + n;
            VT t0 = upper ? Lj[i] : L0[j], t1 = upper ? Lj[i + 1] : L1[j];
            VT t2 = upper ? Lj[i + 2] : L2[j], t3 = upper ? Lj[i + 3] : L3[j];
            for (k = 0; k < j; ++k) {
                VT x = Lj[k];
                t0 -= L0[k] * x; t1 -= L1[k] * x; t2 -= L2[k] * x; t3 -= L3[k] * x;
            }
            L0[j] = t0 * r; L1[j] = t1 * r; L2[j] = t2 * r; L3[j] = t3 * r;
        }
        for (; i < n; ++i) {
            VT *L0 = X + i * n, t0 = upper ? Lj[i] : L0[j];
            for (k = 0; k < j; ++k) t0 -= L0[k] * Lj[k];
            L0[j] = t0 * r;
        }
    }
    if (tri) {
        for (int64_t i = 0; i < n; ++i) {
            int64_t d0 = i - i % VLN;  /* the chunk holding the diagonal */
            for (int64_t j = i + 1; j < d0 + VLN; ++j) X[i * n + j] = zero;
            for (int64_t j0 = 0; j0 <= i; j0 += VLN) tr_block((const T *)(X + i * n + j0), VLN, out + i * n + j0, n * n);
            /* the chunks right of the diagonal one: whole vectors of zeros (a memset per row
               and lane, rep stos here, took a quarter of the time at n = 16) */
            for (int64_t l = 0; l < VLN; ++l)
                for (int64_t j0 = d0 + VLN; j0 < n; j0 += VLN)
                    __builtin_memcpy(out + l * n * n + i * n + j0, &zero, sizeof(VT));
        }
    } else {
        for (int64_t i = 0; i < n; ++i)
            for (int64_t j = i + 1; j < n; ++j) {
                if (upper) { X[i * n + j] = X[j * n + i]; X[j * n + i] = zero; }
                else X[i * n + j] = zero;
            }
        from_lanes(X, n * n, out, n * n);
    }
    for (int64_t l = 0; l < VLN; ++l) {
        info[l] = inf_l[l];
        if (failed && inf_l[l]) memset(out + l * n * n, 0, sizeof(T) * n * n);
    }
}

/* The whole 2 MiB pages inside an output of nbytes at p advised to be transparent huge pages
   (Linux madvise(MADV_HUGEPAGE), best effort) before the kernel first writes them; the caller
   asks for it from HUGE_OUTPUT_FROM bytes (see there: a fresh output's 4 KiB page faults cost more
   than the factorisation). Memory already touched keeps its pages. */
TP_INLINE void advise_huge(void *p, int64_t nbytes) {
#if defined(MADV_HUGEPAGE)
    const uintptr_t h = (uintptr_t)2 << 20;
    const uintptr_t lo = ((uintptr_t)p + h - 1) & ~(h - 1);
    const uintptr_t hi = ((uintptr_t)p + (uintptr_t)nbytes) & ~(h - 1);
    if (hi > lo) madvise((void *)lo, hi - lo, MADV_HUGEPAGE);
#else
    (void)p; (void)nbytes;
#endif
}

/* ne elements (a whole number of vectors) from src to dst (VBYTES-aligned) by non-temporal
   stores: written around the caches, without first reading the destination lines in */
TP_INLINE void stream_out(const T *src, T *dst, int64_t ne) {
    for (int64_t e = 0; e < ne; e += VLN) {
        VT v;
        __builtin_memcpy(&v, src + e, sizeof(VT));
#if VBYTES == 64 && defined(__AVX512F__)
        _mm512_stream_si512((__m512i *)(dst + e), (__m512i)v);
#elif VBYTES == 32 && defined(__AVX2__)
        _mm256_stream_si256((__m256i *)(dst + e), (__m256i)v);
#else
        __builtin_memcpy(dst + e, &v, sizeof(VT));
#endif
    }
}

TP_INLINE int32_t chol_one(const T *a, T *out, int64_t n, int upper, T *Lw);

/* A lane that failed, factored again alone if its largest entry (of the triangle read) is below
   the square root of the smallest normal number: there a pivot can be subnormal, whose reciprocal
   (chol_vec_full multiplies by 1/pivot) overflows to inf and fails the lane, and products of the
   factor's entries lose their low bits (an SPD matrix of largest entry 1e-40 failed in float32).
   It is scaled by the even power of two 4^-k that brings that entry into [1, 4) (exact), factored
   by chol_one and the factor scaled back by 2^k. Above that bound a failed pivot means the matrix
   is not positive definite to working precision: its info stands. w: 2 n^2 elements. */
TP_INLINE int32_t chol_lane_retry(const T *a, T *out, int32_t info, int64_t n, int upper, T *w) {
    T amax = 0;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j <= i; ++j) amax = TP_MAX(amax, TFABS(upper ? a[j * n + i] : a[i * n + j]));
    int ex = TP_SCALE_EXP(amax);
    if (ex >= TP_MIN_NORMAL_EXP / 2) return info;
    ex -= ex & 1;
    const T fac = (T)ldexp(1.0, -ex), back = (T)ldexp(1.0, ex / 2);
    for (int64_t r = 0; r < n * n; ++r) w[r] = a[r] * fac;
    const int32_t st = chol_one(w, out, n, upper, w + n * n);
    if (!st) for (int64_t r = 0; r < n * n; ++r) out[r] *= back;
    return st;
}

TP_EXPORT int tp_cholesky_vec(const T *a, T *out, int32_t *info, int64_t B, int64_t n, int64_t upper,
                              int64_t stream, int64_t huge, int64_t nthreads) {
    const int64_t groups = (B + VLN - 1) / VLN;
    if (huge) advise_huge(out, B * n * n * (int64_t)sizeof(T));
    /* one thread below ~0.6 ms of work (B n^3 < 2e7; n = 16: 4900 matrices). On the shared
       2-core machine a two-thread region waits for a descheduled thread in 4 ms ticks when a
       third process runs: at load 3-5, B = 10000, n = 16 took 12-15 ms on two threads and 2.7-3
       ms on one; at load 1.3-1.4 (this threshold, was 1e8), medians of 21 interleaved, one /
       two threads (static / dynamic schedule): f64 n = 16 B = 10000 4.36 / 2.29 / 2.22 ms, B =
       3000 1.07 / 0.56 / 0.55, B = 1000 0.30 / 0.18 / 0.17; f32 n = 16 B = 10000 1.71 / 0.88 /
       0.77; but f64 n = 4 B = 30000 / 100000 (memory-bound, another process started) 1.10 / 5.1
       / 8.0 and 3.07 / 12.7 / 16.0 ms, so orders under 12 keep the old threshold (1e8: n = 8
       from B = 195313, n = 4 from 1.56e6) and stay on one thread below it. Chunks
       of 16 groups handed out dynamically: a thread descheduled mid-region leaves the rest to
       the other. */
    const int64_t work = B * n * n * n;
    int64_t nt = (groups < 2 || work < 20000000 || (n < 12 && work < 100000000)) ? 1 : nthreads;
    int64_t bad = INT64_MAX;
    /* stream (large outputs, see CHOLESKY_STREAM_FROM): a full group is factored into an
       L1-resident copy of its VLN outputs (S) and streamed out from there with non-temporal
       stores, and the next group's input is prefetched while this one is factored */
    const int st = stream && (uintptr_t)out % VBYTES == 0;
    #pragma omp parallel num_threads(nt) reduction(min:bad)
    {
        VT *Lw = (VT *)aligned_alloc(VBYTES, sizeof(VT) * (n * n + n + 2));
        VT *S = st ? (VT *)aligned_alloc(VBYTES, sizeof(VT) * n * n) : NULL;
        #pragma omp for schedule(dynamic, 16)
        for (int64_t gi = 0; gi < groups; ++gi) {
            int64_t b0 = gi * VLN, cnt = TP_MIN(VLN, B - b0);
            const T *src = a + b0 * n * n;
            T *dst = st && cnt == VLN ? (T *)S : out + b0 * n * n;
            if (st && gi + 1 < groups) {  /* the next group's input, while this one computes */
                const char *nx = (const char *)(src + VLN * n * n);
                const int64_t nb = TP_MIN(VLN, B - b0 - VLN) * n * n * (int64_t)sizeof(T);
                for (int64_t o = 0; o < nb; o += 64) __builtin_prefetch(nx + o, 0, 3);
            }
            if (cnt < VLN) chol_vec(src, dst, info + b0, cnt, n, (int)upper, Lw);
            else if (n == 2) chol_vec_full(src, dst, info + b0, 2, (int)upper, Lw);
            else if (n == 3) chol_vec_full(src, dst, info + b0, 3, (int)upper, Lw);
            else if (n == 4) chol_vec_full(src, dst, info + b0, 4, (int)upper, Lw);
            else if (n == 8) chol_vec_full(src, dst, info + b0, 8, (int)upper, Lw);
            else if (n == 16) chol_vec_full(src, dst, info + b0, 16, (int)upper, Lw);
            else chol_vec_full(src, dst, info + b0, n, (int)upper, Lw);
            for (int64_t l = 0; l < cnt; ++l)  /* (Lw is free: 2 n^2 elements and more) */
                if (info[b0 + l])
                    info[b0 + l] = chol_lane_retry(src + l * n * n, dst + l * n * n, info[b0 + l],
                                                   n, (int)upper, (T *)Lw);
            if (dst == (T *)S) stream_out(dst, out + b0 * n * n, VLN * n * n);
            for (int64_t l = 0; l < cnt; ++l) if (info[b0 + l] && b0 + l < bad) bad = b0 + l;
        }
#if defined(__AVX2__) || defined(__AVX512F__)
        if (st) _mm_sfence();  /* the streamed stores ordered before the region ends */
#endif
        free(S);
        free(Lw);
    }
    return bad == INT64_MAX ? 0 : (int)TP_MIN(bad + 1, 2147483647);
}

/* ---------------------------------------------------------------- QR (Householder) */
TP_INLINE void qr_one(const T *a, T *Q, T *R, int64_t m, int64_t n, int wantq, int complete,
                      T *C, T *Qc, T *tau) {
    const int64_t k = TP_MIN(m, n);
    /* scaled by an even power of two that brings the largest entry into [1, 4) (exact, square
       roots included; R scaled back at the end): the column norms' sums of squares overflow for
       fp32 entries from ~1e19 and underflow for tiny ones */
    T amax = 0;
    for (int64_t i = 0; i < m * n; ++i) amax = TP_MAX(amax, TFABS(a[i]));
    int ex = TP_SCALE_EXP(amax);
    ex -= ex & 1;
    const T fac = (T)ldexp(1.0, -ex), back = (T)ldexp(1.0, ex);
    for (int64_t i = 0; i < m; ++i) for (int64_t j = 0; j < n; ++j) C[j * m + i] = a[i * n + j] * fac;
    for (int64_t j = 0; j < k; ++j) {
        T *x = C + j * m + j;
        const int64_t len = m - j;
        T beta;
        tau[j] = house(x[0], x + 1, x + 1, len - 1, &beta);
        if (tau[j] == 0) continue;
        x[0] = 1;
        for (int64_t l = j + 1; l < n; ++l) {
            T *y = C + l * m + j;
            T w = tau[j] * dotp(x, y, len);
            #pragma omp simd
            for (int64_t i = 0; i < len; ++i) y[i] -= w * x[i];
        }
        x[0] = beta;
    }
    const int64_t rrows = complete ? m : k;
    for (int64_t i = 0; i < rrows; ++i)
        for (int64_t l = 0; l < n; ++l) R[i * n + l] = l >= i ? C[l * m + i] * back : 0;
    if (!wantq) return;
    const int64_t qc = complete ? m : k;
    for (int64_t c = 0; c < qc; ++c) { for (int64_t i = 0; i < m; ++i) Qc[c * m + i] = 0; Qc[c * m + c] = 1; }
    for (int64_t j = k - 1; j >= 0; --j) {
        if (tau[j] == 0) continue;
        T *x = C + j * m + j;
        const int64_t len = m - j;
        T save = x[0];
        x[0] = 1;
        for (int64_t c = j; c < qc; ++c) {
            T *y = Qc + c * m + j;
            T w = tau[j] * dotp(x, y, len);
            #pragma omp simd
            for (int64_t i = 0; i < len; ++i) y[i] -= w * x[i];
        }
        x[0] = save;
    }
    for (int64_t i = 0; i < m; ++i) for (int64_t c = 0; c < qc; ++c) Q[i * qc + c] = Qc[c * m + i];
}

#define QR_CALL(M, N) qr_one(a + b * m * n, Q + b * qsz, R + b * rsz, M, N, (int)wantq, (int)complete, C, Qc, tau)

TP_EXPORT int tp_qr(const T *a, T *Q, T *R, int64_t B, int64_t m, int64_t n, int64_t wantq,
                        int64_t complete, int64_t huge, int64_t nthreads) {
    const int64_t k = TP_MIN(m, n), qc = complete ? m : k, rrows = complete ? m : k;
    const int64_t qsz = wantq ? m * qc : 0, rsz = rrows * n;
    if (huge) { advise_huge(Q, B * qsz * (int64_t)sizeof(T)); advise_huge(R, B * rsz * (int64_t)sizeof(T)); }
    int64_t nt = (B < 2 || B * m * n * k < 20000) ? 1 : nthreads;
    #pragma omp parallel num_threads(nt)
    {
        T *C = (T *)malloc(sizeof(T) * (m * n + m * m + k + 8));
        T *Qc = C + m * n, *tau = Qc + m * m;
        int64_t chunk = TP_MAX(1, B / (nt * 8));
        #pragma omp for schedule(dynamic, chunk)
        for (int64_t b = 0; b < B; ++b) {
            if (m == 2 && n == 2) QR_CALL(2, 2);
            else if (m == 3 && n == 3) QR_CALL(3, 3);
            else if (m == 4 && n == 4) QR_CALL(4, 4);
            else QR_CALL(m, n);
        }
        free(C);
    }
    return 0;
}

/* ---------------------------------------------------------------- QR, VLN matrices at once
   qr_one's Householder steps on VLN interleaved matrices, in their row-major lane layout X
   (m x n vectors). A lane whose column below the diagonal is zero gets tau = 0 (the identity),
   as in qr_one. Q (m x qc vectors, formed only if asked for) by the same backward accumulation.

   Reflector j (v = (1, X[j+1..m)[j]), tau) applied to columns [c0, c1) of Y (row stride ldy),
   four columns at a time: their dot products w_c = tau (y_c[j] + sum_{i > j} v_i y_c[i]) with
   the accumulators in registers (independent FMA chains, no stores), then the rank-1 update
   y_c -= w_c v down the same four columns. */
TP_INLINE void qr_vec_reflect(const VT *X, int64_t n, int64_t j, int64_t m, VT tj, VT *Y,
                              int64_t ldy, int64_t c0, int64_t c1) {
    int64_t c = c0;
    for (; c + 3 < c1; c += 4) {
        VT *y = Y + j * ldy + c;
        VT a0 = y[0], a1 = y[1], a2 = y[2], a3 = y[3];
        for (int64_t i = j + 1; i < m; ++i) {
            const VT v = X[i * n + j];
            const VT *yi = Y + i * ldy + c;
            a0 += v * yi[0]; a1 += v * yi[1]; a2 += v * yi[2]; a3 += v * yi[3];
        }
        a0 *= tj; a1 *= tj; a2 *= tj; a3 *= tj;
        y[0] -= a0; y[1] -= a1; y[2] -= a2; y[3] -= a3;
        for (int64_t i = j + 1; i < m; ++i) {
            const VT v = X[i * n + j];
            VT *yi = Y + i * ldy + c;
            yi[0] -= a0 * v; yi[1] -= a1 * v; yi[2] -= a2 * v; yi[3] -= a3 * v;
        }
    }
    for (; c < c1; ++c) {
        VT a0 = Y[j * ldy + c];
        for (int64_t i = j + 1; i < m; ++i) a0 += X[i * n + j] * Y[i * ldy + c];
        a0 *= tj;
        Y[j * ldy + c] -= a0;
        for (int64_t i = j + 1; i < m; ++i) Y[i * ldy + c] -= a0 * X[i * n + j];
    }
}

/* house()'s rescaling for the lanes (low) whose column j below the diagonal has a sum of squares
   below HOUSE_SAFE: their column (in place) and *alpha multiplied by cs = 2^-e of the column's
   largest entry, *xn2 formed again; returns cs (1 in the other lanes). tau and v do not depend
   on cs, beta is scaled back by the caller. Entries <= 4 after qr_vec_full's scaling, so
   cs >= 1/4; a column of subnormals or zeros gets 2^1023 / 2^127, finite. Not inlined: with
   these steps inline, qr_vec_full took 1.12-1.18x its earlier time (float32, n = 16, B = 1000,
   one thread, three runs), out of line 0.96-1.02x (min of five). */
static __attribute__((noinline)) VT qr_vec_rescale(VT *X, int64_t n, int64_t j, int64_t m, VI low,
                                                   VT *alpha, VT *xn2) {
    const VT zero = {0}, one = zero + 1;
    const VI ebits = (VI)(zero + (T)INFINITY);  /* x & ebits = 2^e, 2^e <= |x| < 2^(e + 1) */
    VT mx = vabs(*alpha);
    for (int64_t i = j + 1; i < m; ++i) { const VT y = vabs(X[i * n + j]); mx = vsel(y > mx, y, mx); }
    const VT cs = vsel(low, (VT)(2 * (VI)one - ((VI)mx & ebits)), one);
    VT s = zero;
    for (int64_t i = j + 1; i < m; ++i) { const VT y = X[i * n + j] * cs; X[i * n + j] = y; s += y * y; }
    *alpha *= cs;
    *xn2 = s;
    return cs;
}

TP_INLINE void qr_vec_full(const T *a, T *Q, T *R, int64_t m, int64_t n, int wantq, int complete,
                           VT *X, VT *Y, VT *tau) {
    const VT zero = {0}, one = zero + 1;
    const int64_t k = TP_MIN(m, n), qc = complete ? m : k, rrows = complete ? m : k;
    to_lanes(a, m * n, m * n, X);
    /* per lane, the even power-of-two scale of qr_one (R scaled back at the end) */
    VT fac = one, back = one;
    for (int64_t l = 0; l < VLN; ++l) {
        T amax = 0;
        for (int64_t i = 0; i < m * n; ++i) amax = TP_MAX(amax, TFABS(X[i][l]));
        int ex = TP_SCALE_EXP(amax);
        ex -= ex & 1;
        fac[l] = (T)ldexp(1.0, -ex); back[l] = (T)ldexp(1.0, ex);
    }
    for (int64_t i = 0; i < m * n; ++i) X[i] *= fac;
    for (int64_t j = 0; j < k; ++j) {
        VT xn2 = zero, alpha = X[j * n + j], cs = one;
        for (int64_t i = j + 1; i < m; ++i) xn2 += X[i * n + j] * X[i * n + j];
        const VI low = xn2 < zero + HOUSE_SAFE;
        const int scaled = vany(low);
        if (scaled) cs = qr_vec_rescale(X, n, j, m, low, &alpha, &xn2);
        VI act = xn2 != zero;
        VT b = vsqrt(alpha * alpha + xn2);
        b = vsel(alpha > zero, -b, b);
        const VT beta = vsel(act, b, alpha), den = vsel(act, beta, one);
        const VT tj = vsel(act, (beta - alpha) / den, zero);
        const VT sc = vsel(act, one / (alpha - den), one);
        tau[j] = tj;
        for (int64_t i = j + 1; i < m; ++i) X[i * n + j] *= sc;
        qr_vec_reflect(X, n, j, m, tj, X, n, j + 1, n);
        X[j * n + j] = scaled ? beta / cs : beta;
    }
    if (wantq) {
        for (int64_t i = 0; i < m; ++i)
            for (int64_t c = 0; c < qc; ++c) Y[i * qc + c] = i == c ? one : zero;
        for (int64_t j = k - 1; j >= 0; --j) qr_vec_reflect(X, n, j, m, tau[j], Y, qc, j, qc);
        from_lanes(Y, m * qc, Q, m * qc);
    }
    /* R: the upper triangle of the first rrows rows (rrows > k only for complete, m > n) */
    for (int64_t i = 0; i < rrows; ++i) {
        for (int64_t l = 0; l < TP_MIN(i, n); ++l) X[i * n + l] = zero;
        for (int64_t l = i; l < n; ++l) X[i * n + l] *= back;
    }
    from_lanes(X, rrows * n, R, rrows * n);
}

TP_EXPORT int tp_qr_vec(const T *a, T *Q, T *R, int64_t B, int64_t m, int64_t n, int64_t wantq,
                        int64_t complete, int64_t huge, int64_t nthreads) {
    const int64_t k = TP_MIN(m, n), qc = complete ? m : k, rrows = complete ? m : k;
    const int64_t qsz = wantq ? m * qc : 0, rsz = rrows * n;
    if (huge) { advise_huge(Q, B * qsz * (int64_t)sizeof(T)); advise_huge(R, B * rsz * (int64_t)sizeof(T)); }
    const int64_t groups = (B + VLN - 1) / VLN;
    /* one thread below B m n k = 3e7 (~4e7 flops; the lane Cholesky's threshold was 1e8 B n^3 for
       n^3 / 3 flops each until its two-thread runs were re-measured) */
    int64_t nt = (groups < 2 || B * m * n * k < 30000000) ? 1 : nthreads;
    #pragma omp parallel num_threads(nt)
    {
        const int64_t p = TP_MAX(m, n);
        VT *X = (VT *)aligned_alloc(VBYTES, sizeof(VT) * (m * n + m * m + p + 8));
        VT *Y = X + m * n, *tau = Y + m * m;
        /* a partial last group: its matrices padded with zeros (tau = 0 lanes) to a full one */
        T *pad = (T *)malloc(sizeof(T) * VLN * (m * n + qsz + rsz + 1));
        #pragma omp for schedule(static)
        for (int64_t gi = 0; gi < groups; ++gi) {
            int64_t b0 = gi * VLN, cnt = TP_MIN(VLN, B - b0);
            const T *src = a + b0 * m * n;
            T *qo = Q + b0 * qsz, *ro = R + b0 * rsz;
            if (cnt < VLN) {
                memset(pad, 0, sizeof(T) * VLN * m * n);
                memcpy(pad, src, sizeof(T) * cnt * m * n);
                src = pad; qo = pad + VLN * m * n; ro = qo + VLN * qsz;
            }
            if (m == 2 && n == 2) qr_vec_full(src, qo, ro, 2, 2, (int)wantq, (int)complete, X, Y, tau);
            else if (m == 3 && n == 3) qr_vec_full(src, qo, ro, 3, 3, (int)wantq, (int)complete, X, Y, tau);
            else if (m == 4 && n == 4) qr_vec_full(src, qo, ro, 4, 4, (int)wantq, (int)complete, X, Y, tau);
            else if (m == 8 && n == 8) qr_vec_full(src, qo, ro, 8, 8, (int)wantq, (int)complete, X, Y, tau);
            else if (m == 16 && n == 16) qr_vec_full(src, qo, ro, 16, 16, (int)wantq, (int)complete, X, Y, tau);
            else qr_vec_full(src, qo, ro, m, n, (int)wantq, (int)complete, X, Y, tau);
            if (cnt < VLN) {
                memcpy(Q + b0 * qsz, qo, sizeof(T) * cnt * qsz);
                memcpy(R + b0 * rsz, ro, sizeof(T) * cnt * rsz);
            }
        }
        free(X); free(pad);
    }
    return 0;
}

/* ---------------------------------------------------------------- Cholesky */
TP_INLINE int32_t chol_one(const T *a, T *out, int64_t n, int upper, T *Lw) {
    for (int64_t i = 0; i < n; ++i) {
        T *Li = Lw + i * n;
        for (int64_t j = 0; j <= i; ++j) {
            T s = upper ? a[j * n + i] : a[i * n + j];
            s -= dotp(Li, Lw + j * n, j);
            if (j < i) Li[j] = s / Lw[j * n + j];
            else {
                if (!(s > 0)) {
                    for (int64_t r = 0; r < n * n; ++r) out[r] = 0;
                    return (int32_t)(i + 1);
                }
                Li[i] = TSQRT(s);
            }
        }
    }
    if (!upper) {
        for (int64_t i = 0; i < n; ++i) for (int64_t j = 0; j < n; ++j) out[i * n + j] = j <= i ? Lw[i * n + j] : 0;
    } else {
        for (int64_t i = 0; i < n; ++i) for (int64_t j = 0; j < n; ++j) out[i * n + j] = j >= i ? Lw[j * n + i] : 0;
    }
    return 0;
}

#define CHOL_CALL(N) chol_one(a + b * n * n, out + b * n * n, N, (int)upper, Lw)

TP_EXPORT int tp_cholesky(const T *a, T *out, int32_t *info, int64_t B, int64_t n, int64_t upper,
                              int64_t nthreads) {
    int64_t nt = (B < 2 || B * n * n * n < 60000) ? 1 : nthreads;
    int64_t bad = INT64_MAX;
    #pragma omp parallel num_threads(nt) reduction(min:bad)
    {
        T *Lw = (T *)malloc(sizeof(T) * (n * n + 8));
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < B; ++b) {
            int32_t st;
            if (n == 2) st = CHOL_CALL(2);
            else if (n == 3) st = CHOL_CALL(3);
            else if (n == 4) st = CHOL_CALL(4);
            else st = CHOL_CALL(n);
            info[b] = st;
            if (st && b < bad) bad = b;
        }
        free(Lw);
    }
    return bad == INT64_MAX ? 0 : (int)TP_MIN(bad + 1, 2147483647);
}

/* ---------------------------------------------------------------- one matrix (B = 1)
   The workers above on a single matrix of order <= ONE_MAX_N, with no thread team and the scratch
   on the stack: for one small matrix the batched entry points' parallel region and scratch
   mallocs cost more than the factorisation. ``code`` packs m | n << 8 | flag i << (16 + i) into
   one argument (each int64 argument adds ~0.15 us to a ctypes call on the Zen 3). Each returns
   what its batched entry point returns for B = 1 (tp_chol1: the order of the failing leading
   minor, which it also stores to *info when info is not NULL); -1 for sizes out of range. */
#define ONE_MAX_N ${one_max_n}
#define ONE_M(c) ((c) & 255)
#define ONE_N(c) (((c) >> 8) & 255)
#define ONE_F(c, i) ((int)(((c) >> (16 + (i))) & 1))

TP_EXPORT int tp_svd1(const T *a, T *S, T *U, T *Vh, int64_t code) {
    const int64_t m = ONE_M(code), n = ONE_N(code), p = TP_MAX(m, n), k = TP_MIN(m, n);
    const int uv = ONE_F(code, 0), full = ONE_F(code, 1), order = ONE_F(code, 2);
    if (k < 1 || p > ONE_MAX_N) return -1;
    T W[p * k + p * p + k * k + 4 * k + 16];
    int64_t perm[k + 1];
    int32_t pairs[(k + 2) * (k + 2)];
    svd_scratch sc;
    sc.W = W; sc.Ub = W + p * k; sc.V = sc.Ub + p * p; sc.nrm = sc.V + k * k; sc.cs = sc.nrm + k;
    sc.perm = perm; sc.pairs = pairs;
    sc.npairs = make_pairs(pairs, k, order);
    sc.round = order ? (k + (k & 1)) / 2 : 0;
    if (m == 2 && n == 2) return svd_one(a, S, U, Vh, 2, 2, uv, full, &sc);
    if (m == 3 && n == 3) return svd_one(a, S, U, Vh, 3, 3, uv, full, &sc);
    if (m == 4 && n == 4) return svd_one(a, S, U, Vh, 4, 4, uv, full, &sc);
    return svd_one(a, S, U, Vh, m, n, uv, full, &sc);
}

/* One matrix by tridiagonal QL (flag 3 of tp_eigh1): the steps of
   reference.eigh_tridiagonal_reference, with the reduction run from the last row up (LAPACK's
   dsytrd with UPLO = 'U') so that the active block A[0:k, 0:k] starts every row at a vector
   boundary. A (scaled by a power of two to max |a_ij| in [0.5, 1), so no square in the rotations
   can overflow) is held full and symmetric in rows of ld = n rounded up to TRI_VL elements;
   step k = n-1 … 2 reflects row k's entries 0 … k-2 into e[k-1] with H_k = I - τ v vᵀ, v[k-1] = 1
   (dlarfg's sign), updates A[0:k, 0:k] -= v wᵀ + w vᵀ, w = p - (τ/2)(pᵀv) v, p = τ A v (p as a
   sum of rows, all in whole vectors: v, p and w are zero from column k on), and applies H_k to
   Zᵀ from the left at once (Zᵀ = H_2 … H_{n-1}, rows of Zᵀ = columns of Z), so no reflector is
   kept. Then tql2's implicit QL on (d, e) with Wilkinson shifts, e[j] negligible when
   |e_j| <= eps (|d_j| + |d_j+1|), each Givens rotation applied to two contiguous rows of Zᵀ.
   Returns 0, 1 for non-finite input, or 2 when an eigenvalue needs more than TRI_MAX_IT sweeps
   (the caller then runs the Jacobi worker instead). */
${tri_ql}
static int eigh_tri_one(const T *in, T *L, T *Q, int64_t n, int upper, int wantv) {
    if (!all_finite(in, n * n)) return 1;
    const int64_t nv = (n + TRI_VL - 1) / TRI_VL, ld = nv * TRI_VL;
    T A[ONE_MAX_N * ONE_MAX_N] __attribute__((aligned(64)));
    T Z[ONE_MAX_N * ONE_MAX_N] __attribute__((aligned(64)));
    T v[ONE_MAX_N] __attribute__((aligned(64))), p[ONE_MAX_N] __attribute__((aligned(64)));
    T u[ONE_MAX_N] __attribute__((aligned(64)));
    T d[ONE_MAX_N + 1], e[ONE_MAX_N + 1];
    int64_t perm[ONE_MAX_N];
    TV *Av = (TV *)A, *Zv = (TV *)Z, *vv = (TV *)v, *pv = (TV *)p, *uv = (TV *)u;
    const TV vzero = {0};
    T amax = 0;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j <= i; ++j) {
            T x = TFABS(upper ? in[j * n + i] : in[i * n + j]);
            amax = x > amax ? x : amax;
        }
    if (amax == 0) {
        for (int64_t j = 0; j < n; ++j) L[j] = 0;
        if (wantv) for (int64_t j = 0; j < n * n; ++j) Q[j] = j % (n + 1) == 0;
        return 0;
    }
    const int ex = TP_SCALE_EXP(amax) + 1;  /* largest entry into [0.5, 1) */
    const T sc = (T)ldexp(1.0, -ex);
    for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j <= i; ++j) {
            T x = sc * (upper ? in[j * n + i] : in[i * n + j]);
            A[i * ld + j] = x; A[j * ld + i] = x;
        }
        for (int64_t j = n; j < ld; ++j) A[i * ld + j] = 0;
    }
    if (wantv)
        for (int64_t i = 0; i < n; ++i)
            for (int64_t j = 0; j < ld; ++j) Z[i * ld + j] = i == j;
    for (int64_t k = n - 1; k >= 2; --k) {
        T *ak = A + k * ld;
        d[k] = ak[k];
        const T tau = house(ak[k - 1], ak, v, k - 1, e + k - 1);
        if (tau == 0) continue;
        const int64_t kv = (k + TRI_VL - 1) / TRI_VL;
        v[k - 1] = 1;
        for (int64_t j = k; j < kv * TRI_VL; ++j) v[j] = 0;
        for (int64_t c = 0; c < kv; ++c) pv[c] = vzero;
        for (int64_t j = 0; j < k; ++j) {
            const TV tv = vzero + tau * v[j];
            const TV *row = Av + j * nv;
            for (int64_t c = 0; c < kv; ++c) pv[c] += tv * row[c];
        }
        for (int64_t j = k; j < kv * TRI_VL; ++j) p[j] = 0;
        T pv_dot = 0;
        for (int64_t j = 0; j < k; ++j) pv_dot += p[j] * v[j];
        const TV kk = vzero + (T)0.5 * tau * pv_dot;
        for (int64_t c = 0; c < kv; ++c) pv[c] -= kk * vv[c];  /* p is now w */
        for (int64_t i = 0; i < k; ++i) {
            const TV vi = vzero + v[i], wi = vzero + p[i];
            TV *row = Av + i * nv;
            for (int64_t c = 0; c < kv; ++c) row[c] -= vi * pv[c] + wi * vv[c];
        }
        if (wantv) {  /* Zᵀ <- H_k Zᵀ: u = Σ_j v_j Zᵀ[j], Zᵀ[j] -= τ v_j u */
            for (int64_t c = 0; c < nv; ++c) uv[c] = vzero;
            for (int64_t j = 0; j < k; ++j) {
                const TV vj = vzero + v[j];
                const TV *row = Zv + j * nv;
                for (int64_t c = 0; c < nv; ++c) uv[c] += vj * row[c];
            }
            for (int64_t j = 0; j < k; ++j) {
                const TV tv = vzero + tau * v[j];
                TV *row = Zv + j * nv;
                for (int64_t c = 0; c < nv; ++c) row[c] -= tv * uv[c];
            }
        }
    }
    d[0] = A[0];
    if (n > 1) { d[1] = A[ld + 1]; e[0] = A[ld]; }
    e[n - 1] = 0;
    if (tri_ql(d, e, n, wantv ? Zv : NULL, nv)) return 2;
    sort_asc(d, perm, n);
    for (int64_t j = 0; j < n; ++j) L[j] = (T)ldexp((double)d[perm[j]], ex);
    if (wantv)
        for (int64_t i = 0; i < n; ++i)
            for (int64_t j = 0; j < n; ++j) Q[i * n + j] = Z[perm[j] * ld + i];
    return 0;
}

TP_EXPORT int tp_eigh1(const T *a, T *L, T *Q, int64_t code) {
    const int64_t n = ONE_N(code);
    const int upper = ONE_F(code, 0), wantv = ONE_F(code, 1), order = ONE_F(code, 2);
    if (n < 1 || n > ONE_MAX_N) return -1;
    T A[2 * n * n + 5 * n + 16];
    T *V = A + n * n, *d = V + n * n, *cs = d + n;
    int64_t perm[3 * n + 6];
    int64_t *lp = perm + n + 2, *lq = lp + n + 2;
    int32_t pairs[(n + 2) * (n + 2)];
    if (ONE_F(code, 3)) {
        int st = eigh_tri_one(a, L, Q, n, upper, wantv);
        if (st != 2) return st;
    }
    const int64_t np = make_pairs(pairs, n, order), round = order ? (n + (n & 1)) / 2 : 0;
    if (n == 2) return eigh_one(a, L, Q, 2, upper, wantv, A, V, d, perm, pairs, np, round, cs, lp, lq);
    if (n == 3) return eigh_one(a, L, Q, 3, upper, wantv, A, V, d, perm, pairs, np, round, cs, lp, lq);
    if (n == 4) return eigh_one(a, L, Q, 4, upper, wantv, A, V, d, perm, pairs, np, round, cs, lp, lq);
    return eigh_one(a, L, Q, n, upper, wantv, A, V, d, perm, pairs, np, round, cs, lp, lq);
}

TP_EXPORT int tp_qr1(const T *a, T *Q, T *R, int64_t code) {
    const int64_t m = ONE_M(code), n = ONE_N(code), k = TP_MIN(m, n);
    const int wantq = ONE_F(code, 0), complete = ONE_F(code, 1);
    if (k < 1 || TP_MAX(m, n) > ONE_MAX_N) return -1;
    T C[m * n + m * m + k + 8];
    if (m == 2 && n == 2) qr_one(a, Q, R, 2, 2, wantq, complete, C, C + 4, C + 8);
    else if (m == 3 && n == 3) qr_one(a, Q, R, 3, 3, wantq, complete, C, C + 9, C + 18);
    else if (m == 4 && n == 4) qr_one(a, Q, R, 4, 4, wantq, complete, C, C + 16, C + 32);
    else qr_one(a, Q, R, m, n, wantq, complete, C, C + m * n, C + m * n + m * m);
    return 0;
}

TP_EXPORT int tp_chol1(const T *a, T *out, int32_t *info, int64_t code) {
    const int64_t n = ONE_N(code);
    const int upper = ONE_F(code, 0);
    if (n < 1 || n > ONE_MAX_N) return -1;
    T Lw[n * n + 8];
    int32_t st;
    if (n == 2) st = chol_one(a, out, 2, upper, Lw);
    else if (n == 3) st = chol_one(a, out, 3, upper, Lw);
    else if (n == 4) st = chol_one(a, out, 4, upper, Lw);
    else st = chol_one(a, out, n, upper, Lw);
    if (info) *info = st;
    return st;
}
"""


# The tridiagonal QL worker's C (``${tri_max_it}``, ``${is64}`` and the scalar names of
# :func:`~torchport.linalg._cparams.scalar_params` in scope): shared by ``tp_eigh1`` (flag 3) and
# the complex one-matrix worker of :mod:`torchport.linalg.complex_jacobi`, which both rotate
# their eigenvector rows with it.
TRI_QL = r"""#define TRI_MAX_IT ${tri_max_it}
#define TRI_VL ((int64_t)(32 / sizeof(T)))
typedef T TV __attribute__((vector_size(32), aligned(32), may_alias));
#define TRI_TINY2 ((T)(${is64} ? 1e-280 : 1e-30))
#define TRI_BIG ((T)(${is64} ? 1e8 : 1e4))

/* sqrt(f² + g²), rescaled when the squares could underflow (the matrix is scaled to norm ~1). */
TP_INLINE T tri_hypot(T f, T g) {
    T r2 = f * f + g * g;
    if (r2 >= TRI_TINY2) return TSQRT(r2);
    T m = TFABS(f) > TFABS(g) ? TFABS(f) : TFABS(g);
    if (m == 0) return 0;
    f /= m; g /= m;
    return m * TSQRT(f * f + g * g);
}

/* The Givens rotation of (f, g): returns r = sqrt(f² + g²) and, when r > 0, sets s = f / r,
   c = g / r. Where the squares could underflow, c and s come from (f, g) / max(|f|, |g|): r is
   then tiny, subnormal in the noise block of a rank-deficient matrix (float32 rank-one v vᵀ:
   eigenvalues down to 1e-36), and f / r, g / r with its few bits gave |QᵀQ - I| 1.2e-3. */
TP_INLINE T tri_givens(T f, T g, T *c, T *s) {
    T r2 = f * f + g * g;
    if (r2 >= TRI_TINY2) {
        const T r = TSQRT(r2);
        *s = f / r; *c = g / r;  /* two independent divisions: shorter chain than 1/r */
        return r;
    }
    T m = TFABS(f) > TFABS(g) ? TFABS(f) : TFABS(g);
    if (m == 0) return 0;
    f /= m; g /= m;
    const T t = TSQRT(f * f + g * g);
    *s = f / t; *c = g / t;
    return m * t;
}

/* Eigenvalues only: the same QL sweeps in root-free form on the squared off-diagonal (LAPACK
   dsterf, Pal-Walker-Kahan): the same shifts and test (|e_j| <= eps (|d_j| + |d_j+1|), compared
   in squares), equal in exact arithmetic, but no square root in the rotations' latency chain. */
TP_INLINE int tri_ql_squared(T *d, T *e, int64_t n) {
    for (int64_t j = 0; j < n; ++j) e[j] *= e[j];
    for (int64_t l = 0; l < n - 1; ++l) {
        for (int it = 0;; ++it) {
            int64_t m = l;
            for (; m < n - 1; ++m) {
                const T t = EPS * (TFABS(d[m]) + TFABS(d[m + 1]));
                if (e[m] <= t * t) break;
            }
            if (m == l) break;
            if (it == TRI_MAX_IT) return 2;
            const T rte = TSQRT(e[l]);
            T g = (d[l + 1] - d[l]) / (2 * rte);
            T r = TFABS(g) > TRI_BIG ? TFABS(g) : TSQRT(g * g + 1);
            const T sigma = d[l] - rte / (g + (g >= 0 ? r : -r));
            T c = 1, s = 0, gamma = d[m] - sigma, p = gamma * gamma;
            for (int64_t i = m - 1; i >= l; --i) {
                const T bb = e[i], oldc = c, oldgam = gamma, alpha = d[i];
                r = p + bb;
                if (i != m - 1) e[i + 1] = s * r;
                c = p / r; s = bb / r;
                gamma = c * (alpha - sigma) - s * oldgam;
                d[i + 1] = oldgam + (alpha - gamma);
                p = c != 0 ? gamma * gamma / c : oldc * bb;
            }
            e[l] = s * p; d[l] = sigma + gamma;
        }
    }
    return 0;
}


/* tql2's implicit QL with Wilkinson shifts on (d, e) (e[j] couples d[j] and d[j+1], e[n-1] = 0),
   e[j] negligible when |e_j| <= eps (|d_j| + |d_j+1|); each Givens rotation (real c, s) is
   applied to rows i, i+1 of Zt (rows of nv vectors TV; the complex worker's rows are interleaved
   (re, im) pairs, on which a real rotation acts alike). Zt NULL: eigenvalues only
   (tri_ql_squared). d then holds the eigenvalues, unsorted; returns 0, or 2 when an eigenvalue
   needs more than TRI_MAX_IT sweeps or a NaN appeared. */
TP_INLINE int tri_ql(T *d, T *e, int64_t n, TV *Zv, int64_t nv) {
    const TV vzero = {0};
    const int wantv = Zv != NULL;
    if (!wantv && tri_ql_squared(d, e, n)) return 2;
    for (int64_t l = 0; wantv && l < n - 1; ++l) {
        for (int it = 0;; ++it) {
            int64_t m = l;
            while (m < n - 1 && TFABS(e[m]) > EPS * (TFABS(d[m]) + TFABS(d[m + 1]))) ++m;
            if (m == l) break;
            if (it == TRI_MAX_IT) return 2;
            T g = (d[l + 1] - d[l]) / (2 * e[l]);
            T r = TFABS(g) > TRI_BIG ? TFABS(g) : TSQRT(g * g + 1);
            g = d[m] - d[l] + e[l] / (g + (g >= 0 ? r : -r));
            T s = 1, c = 1, pp = 0;
            int64_t i = m - 1;
            for (; i >= l; --i) {
                const T f = s * e[i], b = c * e[i];
                r = tri_givens(f, g, &c, &s);
                e[i + 1] = r;
                if (r == 0) { d[i + 1] -= pp; e[m] = 0; break; }
                g = d[i + 1] - pp;
                r = (d[i] - g) * s + 2 * c * b;
                pp = s * r;
                d[i + 1] = g + pp;
                g = c * r - b;
                if (wantv) {
                    TV *zi = Zv + i * nv, *zj = zi + nv;
                    const TV cv = vzero + c, sv2 = vzero + s;
                    for (int64_t q = 0; q < nv; ++q) {
                        const TV x = zi[q], y = zj[q];
                        zj[q] = sv2 * x + cv * y;
                        zi[q] = cv * x - sv2 * y;
                    }
                }
            }
            if (i >= l) continue;  /* deflated by an underflowing rotation */
            d[l] -= pp; e[l] = g; e[m] = 0;
        }
    }
    for (int64_t j = 0; j < n; ++j)
        if (d[j] != d[j]) return 2;  /* NaN passes every negligibility test: not converged */
    return 0;
}
"""


def tri_ql_c(dtype: torch.dtype, max_sweeps: int) -> str:
    """:data:`TRI_QL` for float32 or float64 (real) ``dtype``, its parameters substituted; the
    templates take it in place of their ``${tri_ql}`` before rendering (a C text with comments
    cannot be a render parameter: those are echoed in comments)."""
    return string.Template(TRI_QL).substitute(
        tri_max_it=str(min(TRI_MAX_SWEEPS, max_sweeps)),
        is64="1" if dtype == torch.float64 else "0",
    )


# Identifies the kernel sources (this one, the blocked Cholesky's, eigh_block's, svd_lanes') and
# the lane widths they are built at in autotuning keys, so choices made for older kernels are not
# reused.
SOURCE_TAG = hashlib.sha256(
    (
        _SOURCE
        + _blocked.SOURCE_TAG
        + _eigh_block.SOURCE_TAG
        + TRI_QL
        + _eigh_tridiag.SOURCE_TAG
        + _svd_lanes._SOURCE
        + repr(sorted((str(k), v) for k, v in _eigh_block.WIDE_LANES.items()))
        + repr(sorted((str(k), v) for k, v in _svd_lanes.WIDE_LANES.items()))
        + repr(sorted((str(k), v) for k, v in _eigh_tridiag.WIDE_LANES.items()))
    ).encode()
).hexdigest()[:12]


MAX_SWEEPS = 60
# The largest max(m, n) the one-matrix entry points (tp_svd1, ...) take (stack scratch).
ONE_MAX_N = 32
# QL sweeps per eigenvalue before tp_eigh1's tridiagonal worker gives the matrix to Jacobi
# (LAPACK dsteqr's bound); a library built with fewer ``max_sweeps`` caps it at that.
TRI_MAX_SWEEPS = 30


@functools.cache
def library(
    dtype: torch.dtype, isa: str, max_sweeps: int = MAX_SWEEPS, lane_bytes: int | None = None
) -> dict[str, Kernel]:
    """Build (or load from the disk cache) the kernels for one dtype; keyed by op name.

    ``max_sweeps`` caps the Jacobi sweeps (the public functions use 60, which converged input
    never reaches); ``bench linalg --sweeps`` builds capped copies to time one sweep.
    ``lane_bytes``: the width of the lane kernels' vectors, 32 or 64 (64 needs ``avx512``);
    None = the isa's widest (:func:`~torchport.linalg._cparams.lane_bytes`).
    """
    is64 = dtype == torch.float64
    vbytes = _lane_bytes(isa, wide=True) if lane_bytes is None else lane_bytes
    assert vbytes == 32 or (vbytes == 64 and isa == "avx512"), (isa, vbytes)
    src = native.render(
        "#include <stdlib.h>\n#include <string.h>\n#include <sys/mman.h>\n"
        + _SOURCE.replace("${tri_ql}", tri_ql_c(dtype, max_sweeps)),
        **scalar_params(dtype, max_sweeps),
        one_max_n=str(ONE_MAX_N),
        is64="1" if is64 else "0",
        vbytes=str(vbytes),
        vsqrt512="_mm512_sqrt_pd" if is64 else "_mm512_sqrt_ps",
        m512="__m512d" if is64 else "__m512",
    )
    lib = native.build(src, name=f"linalg_{_TAG[dtype]}_{isa}_v{vbytes}", isa=isa)
    ks = {
        "svd": launcher(lib, "tp_svd", dtype, "A S:r U Vh", "B m n uv full order nthreads"),
        "eigh": launcher(lib, "tp_eigh", dtype, "A L:r Q", "B n upper wantv order nthreads"),
        "svd_vec": launcher(lib, "tp_svd_vec", dtype, "A S:r U Vh", "B m n uv full order nthreads"),
        "eigh_vec": launcher(
            lib, "tp_eigh_vec", dtype, "A L:r Q", "B n upper wantv order nthreads"
        ),
        "cholesky_vec": launcher(
            lib, "tp_cholesky_vec", dtype, "A L info", "B n upper stream huge nthreads"
        ),
        "qr": launcher(lib, "tp_qr", dtype, "A Q R", "B m n wantq complete huge nthreads"),
        "qr_vec": launcher(lib, "tp_qr_vec", dtype, "A Q R", "B m n wantq complete huge nthreads"),
        "cholesky": launcher(lib, "tp_cholesky", dtype, "A L info", "B n upper nthreads"),
        # one matrix, sizes and flags packed in ``code`` (torchport.linalg.one)
        "svd1": launcher(lib, "tp_svd1", dtype, "A S:r U Vh", "code"),
        "eigh1": launcher(lib, "tp_eigh1", dtype, "A L:r Q", "code"),
        "qr1": launcher(lib, "tp_qr1", dtype, "A Q R", "code"),
        "chol1": launcher(lib, "tp_chol1", dtype, "A L info", "code"),
    }
    return ks


# --- launchers: (B, m, n) contiguous input → outputs; each returns 1 + the first failing batch
# index (0 when every matrix succeeded) next to its results -------------------------------------

# Jacobi orderings, chosen by measurement (``torchport bench linalg --orderings``, interleaved):
# for the one-sided SVD the round-robin order, which computes a round's n/2 independent inner
# products and rotation angles before applying them, was 1.2-1.4x faster than cyclic for
# 8 <= n <= 32 and even at n = 3 (0.95x), so it is used from n = 5 up; for the per-thread
# two-sided eigh it gained nothing (0.83-1.09x: the column phase becomes a strided gather), so
# that kernel stays cyclic.
SVD_ROUND_ROBIN_FROM = 5
EIGH_ORDER = 0
# From this min(m, n) the lane SVD runs svd_lanes.tp_svd_lanes (four-accumulator inner products,
# one division per angle, V from the converged vectors) instead of tp_svd_vec.
SVD_LANES_FAST_FROM = 5
# The lane kernel (tp_eigh_vec) in round-robin order batches a round's angles (n/2 independent
# sqrt/div chains). Single-threaded, interleaved medians of 21 at load ~8, round-robin/cyclic
# speed: n = 8 1.76x (f32) 1.74x (f64); n = 12 1.04x / 1.08x; n = 16 0.97x / 1.06x; n = 24
# 0.97x / 1.14x; `bench linalg --orderings --quick` (2 threads, load 5-6): n = 3 0.75x / 0.94x,
# n = 8 1.49x / 1.22x, n = 16 1.18x / 1.15x; n = 32 0.7-1.0x in other runs. Used: 5 <= n <= 16.
EIGH_LANES_ROUND_ROBIN = (5, 16)
# From this order the lane kernel runs round-robin with each round's row and column passes fused
# and halved by symmetry (order 2, eigh_vec_fused_round: each upper-triangle element read and
# written once a round). Single thread, medians of 7, load 1.4-1.6, ms old default -> fused:
# f32 n = 5 2.96 -> 2.93, 6 4.27 -> 3.65, 8 10.5 -> 7.5, 16 9.2 -> 7.1, 32 9.4 -> 6.8, 64 35.0
# -> 17.3; f64 n = 5 6.15 -> 6.32, 6 9.4 -> 7.9, 8 19.8 -> 16.4, 16 26.0 -> 19.3, 32 23.1 ->
# 16.7, 64 84.9 -> 40.4 (B = 10000 … 64, ~0.2 GFLOP each); n = 3 0.70x (the constant-size
# build of the unfused kernel wins there).
EIGH_LANES_FUSED_FROM = 6
# From this order the lanes run the block-ordered kernel (torchport.linalg.eigh_block: two
# rotation rounds per pass over A's 4x4 tiles, four per pass over V's rows, scaled one-FMA
# rotations). Fused (order 2) -> block, min of 9 alternated thread-CPU times, one thread,
# B ~ 2e7 / 6n^3 (load 1.9-2.1): f64 n = 12 1.14x, 16 1.33x, 20 1.06x, 24 1.33x, 32 1.33x; f32
# 1.06x, 1.13x, 1.21x, 1.21x, 1.32x. Two threads, B = 2000, min of 15 (load 2.4-3.3): f64 n = 12
# / 16 / 20 1.20x / 1.18x / 1.41x, f32 0.98x / 1.22x / 0.92x.
EIGH_BLOCK_FROM = 12
# From this order (to LANES_MAX_N) the lanes run Householder tridiagonalisation + implicit QL
# (torchport.linalg.eigh_tridiag) instead of Jacobi, unless the caller asks for Jacobi
# (method="jacobi"). One thread, B ~ 2e7 / 9n^3, min of 9 interleaved, Jacobi (default lane
# kernel) / QL: f64 (load 4.1) n = 3 1.06x, 4 1.40x, 5 1.61x, 6 1.15x, 7 1.44x, 8 1.56x, 12
# 1.77x, 16 1.97x, 24 2.50x, 32 2.38x, 64 2.91x; f32 (load 2.4-2.5) 0.80x, 1.09x, 1.38x, 1.26x,
# 1.56x, 1.59x, 1.56x, 1.75x, 2.23x, 2.08x, 2.67x.
EIGH_TRIDIAG_FROM = 4
LANES_MAX_N = 64


def lane_batch(dtype: torch.dtype) -> int:
    """The batch from which the batched kernels run one matrix per SIMD lane (svd, eigh, qr and
    Cholesky, within their ``*_MAX_N``): 64 bytes of one element per matrix. Below it they run
    one matrix per thread, a different kernel, so the tuner never times a batch under it for a
    call at or above it (``torchport.linalg._tune_batch``)."""
    return 64 // (torch.finfo(dtype).bits // 8)


def runs_lanes(op: str, b: int, m: int, n: int, dtype: torch.dtype) -> bool:
    """Whether the batched ``op`` (svd, eigh, qr, cholesky) of ``b`` m x n matrices runs one
    matrix per SIMD lane: a batch of at least :func:`lane_batch` within the op's lane sizes
    (``LANES_MAX_N``, ``QR_LANES_MAX_N``, ``CHOLESKY_LANES_MAX_N``). Calls on either side run
    different kernels, so the tuner keeps their choices apart. Complex dtypes: never (their
    kernels, :mod:`~torchport.linalg.complex_jacobi`, run one matrix per thread)."""
    if dtype.is_complex:
        return False
    top = (
        QR_LANES_MAX_N if op == "qr" else CHOLESKY_LANES_MAX_N if op == "cholesky" else LANES_MAX_N
    )
    return b >= lane_batch(dtype) and max(m, n) <= top


# Cholesky, one matrix per lane up to this order, blocked above (single thread, B = 300-1000,
# ns per matrix lanes/blocked: n = 17 172/582 (f32) 328/674 (f64), n = 32 883/1494, 1863/2496,
# n = 48 2260/3173, 4833/5617, n = 64 5997/6316, 12398/12253).
CHOLESKY_LANES_MAX_N = 48
# From this many output bytes the lane Cholesky streams its output (non-temporal stores from an
# L1 copy of each group, the next group's input prefetched): past ~3 MB of output (6 MB in + out)
# the plain kernel's time per matrix rose 2-4x on the Zen 3 VM (its caches hold ~8 MB: a copy's
# rate fell from 43 to 10 GB/s between 5 and 8 MB), the stores' line reads and write-backs
# competing with the input's reads (a prefetch alone, with plain stores, gained nothing). ``bench
# linalg --fastest --threads 1 --reps 11``, B = 10000, torch.linalg / ours, two alternated runs
# before -> after (load 1.6-2.9): f64 n = 8 / 12 / 16 2.01, 2.29 / 1.75, 1.87 / 2.25, 2.55 ->
# 3.59, 4.09 / 2.38, 2.26 / 2.67, 2.72; f32 2.77, 2.95 / 2.64, 2.79 / 2.94, 3.06 -> 5.73, 5.93 /
# 3.90, 4.33 / 4.31, 4.71. In cache (B = 1000, kernel alone, one thread) it cost 7-17%, so it
# starts at 2 MiB.
CHOLESKY_STREAM_FROM = 2 << 20
# From this many bytes an output of the lane Cholesky and of QR (Q and R each) has its whole 2 MiB
# pages advised to be transparent huge pages before the kernel writes it (advise_huge; THP is in
# madvise mode on the Zen 3 VM). A fresh output (glibc mmaps every block from 32 MiB, and smaller
# ones whenever its heap was trimmed) otherwise takes a 4 KiB page fault per page, ~2.5 us each
# on this VM: f64 n = 16, B = 30000 / 100000, kernel on a fresh output, one thread, 15001 / 50001
# faults 50.7 / 169 ms, advised 693 / 434 faults 19.0 / 59.7 ms (kernel on a reused output 12.6 /
# 43 ms); two threads 29.5 / 90.5 -> 10.7 / 33.6 ms. A second madvise(MADV_POPULATE_WRITE) to
# fault them in at once gained nothing on one thread and cost 2-8 ms on two.
HUGE_OUTPUT_FROM = 4 << 20
# QR, one matrix per lane (tp_qr_vec) up to this max(m, n), one per thread (tp_qr) above. One
# thread, avx512, min of 9 interleaved, tp_qr / tp_qr_vec (mode reduced): B = 1000 n = 16 / 20 /
# 24 / 32 f64 3.8 / 6.1 / 6.7 / 4.5x, f32 10.1 / 10.1 / 9.7 / 15.7x; B = 300 n = 48 / 64 / 96
# f64 5.3 / 2.9 / 3.3x, f32 13.0 / 7.0 / 6.6x. Capped at the lane kernels' 64 (a group's Q and
# R, 2 n^2 vectors, then fill L2).
QR_LANES_MAX_N = LANES_MAX_N


def _ks(dtype: torch.dtype) -> dict[str, Kernel]:
    return library(dtype, native.cpu_info().isa)


def svd(
    a: torch.Tensor,
    full_matrices: bool,
    compute_uv: bool,
    order: int | None = None,
    lanes: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Batched SVD of ``a`` (B, m, n): U (B, m, m|k), S (B, k), Vh (B, n|k, n), bad index + 1.

    ``order``: 0 cyclic, 1 round-robin, None = the measured default (see above). ``lanes``: one
    matrix per SIMD lane (``tp_svd_vec``); None = when the batch fills lanes and n is small.
    """
    assert a.dim() == 3 and a.is_contiguous()
    b, m, n = a.shape
    k = min(m, n)
    if order is None:
        order = int(k >= SVD_ROUND_ROBIN_FROM)
    s = a.new_empty((b, k))
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
    if lanes is None:
        lanes = runs_lanes("svd", b, m, n, a.dtype)
    args = (
        a.data_ptr(), s.data_ptr(), u.data_ptr(), vh.data_ptr(), b, m, n,
        int(compute_uv), int(full_matrices), order,
    )  # fmt: skip
    if lanes and k >= SVD_LANES_FAST_FROM and order == 1:
        fast = _svd_lanes.library(a.dtype, native.cpu_info().isa)
        args = (*args[:-1], _svd_lanes.pair_order(k))
        bad = fast.call_unchecked(*args, _svd_lanes.KAPPA_C, native.num_threads())
    else:
        kern = _ks(a.dtype)["svd_vec" if lanes else "svd"]
        bad = kern.call_unchecked(*args, native.num_threads())
    return u, s, vh, bad


def eigh(
    a: torch.Tensor,
    upper: bool,
    compute_v: bool,
    order: int | None = None,
    lanes: bool | None = None,
    jacobi: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Batched symmetric eigendecomposition of ``a`` (B, n, n): L (B, n), Q (B, n, n), bad + 1.

    ``lanes``: run one matrix per SIMD lane (``tp_eigh_vec``); None = when the batch fills lanes.
    ``order``: 0 cyclic, 1 round-robin, 2 round-robin with fused symmetric rounds (lanes only;
    the same rotations as 1), 3 the block order of :mod:`torchport.linalg.eigh_block` (lanes
    only), 4 not Jacobi but tridiagonalisation + QL (:mod:`torchport.linalg.eigh_tridiag`, lanes
    only); None = the measured default of the kernel used (from ``EIGH_TRIDIAG_FROM`` that is
    order 4 unless ``jacobi``). ``jacobi``: only the Jacobi kernels (``method="jacobi"``).
    """
    assert a.dim() == 3 and a.is_contiguous()
    b, n, _ = a.shape
    lam = a.new_empty((b, n))
    q = a.new_empty((b, n, n)) if compute_v else a.new_empty((0,))
    if b == 0 or n == 0:
        return lam, q, 0
    if lanes is None:
        lanes = runs_lanes("eigh", b, n, n, a.dtype)
    if lanes:
        if order == 4 or (order is None and not jacobi and n >= EIGH_TRIDIAG_FROM):
            return _eigh_tridiag.eigh(a, upper, compute_v)
        if order == 3 or (order is None and n >= EIGH_BLOCK_FROM):
            return _eigh_block.eigh(a, upper, compute_v)
        if order is None and n >= EIGH_LANES_FUSED_FROM:
            order = 2
        elif order is None:
            order = int(EIGH_LANES_ROUND_ROBIN[0] <= n <= EIGH_LANES_ROUND_ROBIN[1])
        return lam, q, _ks(a.dtype)["eigh_vec"].call_unchecked(
            a.data_ptr(), lam.data_ptr(), q.data_ptr(), b, n, int(upper), int(compute_v), order,
            native.num_threads(),
        )  # fmt: skip
    if order is None:
        order = EIGH_ORDER
    bad = _ks(a.dtype)["eigh"].call_unchecked(
        a.data_ptr(), lam.data_ptr(), q.data_ptr(), b, n, int(upper), int(compute_v), order,
        native.num_threads(),
    )  # fmt: skip
    return lam, q, bad


def qr_outputs(a: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """Q and R for the batched QR of ``a`` (B, m, n) in ``mode`` (Q empty for ``'r'``), and
    whether a kernel has work: an empty batch returns them as they are, m or n = 0 filled here
    (R zero, Q the identity's leading columns)."""
    b, m, n = a.shape
    k = min(m, n)
    complete, wantq = mode == "complete", mode != "r"
    r = a.new_empty((b, m if complete else k, n))
    q = a.new_empty((b, m, m if complete else k)) if wantq else a.new_empty((0,))
    if b == 0:
        return q, r, False
    if m == 0 or n == 0:
        r.zero_()
        if wantq:
            q.copy_(torch.eye(q.shape[-2], q.shape[-1], dtype=a.dtype).expand_as(q))
        return q, r, False
    return q, r, True


def qr(a: torch.Tensor, mode: str, lanes: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched Householder QR of ``a`` (B, m, n) for ``mode`` in reduced/complete/r.

    ``lanes``: one matrix per SIMD lane (``tp_qr_vec``); None = :func:`runs_lanes`.
    """
    assert a.dim() == 3 and a.is_contiguous()
    q, r, work = qr_outputs(a, mode)
    if not work:
        return q, r
    b, m, n = a.shape
    wantq, complete = mode != "r", mode == "complete"
    if lanes is None:
        lanes = runs_lanes("qr", b, m, n, a.dtype)
    _ks(a.dtype)["qr_vec" if lanes else "qr"].call_unchecked(
        a.data_ptr(), q.data_ptr(), r.data_ptr(), b, m, n, int(wantq), int(complete),
        int(_huge(q) or _huge(r)), native.num_threads(),
    )  # fmt: skip
    return q, r


def qr_plan(
    b: int, m: int, n: int, dtype: torch.dtype, mode: str, batch: tuple[int, ...] | None = None
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The launcher :func:`qr` would use for ``b`` matrices of m × n (all ≥ 1), resolved once.

    The returned function takes a CPU tensor of ``b`` such matrices with batch shape ``batch``
    (default ``(b,)``) and returns (Q, R) shaped as ``torch.linalg.qr`` gives them; per call it
    only allocates the outputs and calls the kernel (routed ``method="auto"`` and repeated
    ``method="jacobi"`` calls, where the op layer costs more than the kernel at small sizes).
    """
    assert b >= 1 and m >= 1 and n >= 1 and mode in ("reduced", "complete", "r")
    k = min(m, n)
    complete, wantq = mode == "complete", mode != "r"
    bs = (b,) if batch is None else tuple(batch)
    r_shape = (*bs, m if complete else k, n)
    q_shape = (*bs, m, m if complete else k) if wantq else (0,)
    call = _ks(dtype)["qr_vec" if runs_lanes("qr", b, m, n, dtype) else "qr"].call_unchecked
    wq, cp = int(wantq), int(complete)
    big = b * max(r_shape[-2] * n, m * q_shape[-1] if wantq else 0) * (torch.finfo(dtype).bits // 8)
    huge = int(big >= HUGE_OUTPUT_FROM)
    nthreads = torch.get_num_threads
    # empty_like of a template (~1.3 us) for small outputs; large ones are not kept alive
    small = b * m * n <= 1 << 14
    r_like = torch.empty(r_shape if small else (0,), dtype=dtype)
    q_like = torch.empty(q_shape if small else (0,), dtype=dtype)

    def run(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not a.is_contiguous():
            a = a.contiguous()
        if small:
            q, r = torch.empty_like(q_like), torch.empty_like(r_like)
        else:
            q, r = torch.empty(q_shape, dtype=dtype), torch.empty(r_shape, dtype=dtype)
        call(a.data_ptr(), q.data_ptr(), r.data_ptr(), b, m, n, wq, cp, huge,
             max(1, nthreads()))  # fmt: skip
        return q, r

    return run


def _huge(out: torch.Tensor) -> bool:
    """Whether a kernel advises ``out``'s pages to be huge (``HUGE_OUTPUT_FROM``)."""
    return out.numel() * out.element_size() >= HUGE_OUTPUT_FROM


def _chol_stream(b: int, n: int, dtype: torch.dtype) -> bool:
    return b * n * n * (torch.finfo(dtype).bits // 8) >= CHOLESKY_STREAM_FROM


def cholesky(
    a: torch.Tensor,
    upper: bool,
    lanes: bool | None = None,
    blocked: bool | None = None,
    stream: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Batched Cholesky of ``a`` (B, n, n): factor, int32 info (B,), first failing index + 1.

    ``lanes``: one matrix per SIMD lane (``tp_cholesky_vec``); None = for batches that fill lanes with n ≤ ``CHOLESKY_LANES_MAX_N``.
    ``blocked``: the blocked kernel (:mod:`~torchport.linalg.blocked`); None = from
    n = ``blocked.BLOCKED_FROM`` when ``lanes`` is None and the lanes do not apply. Otherwise
    the unblocked per-matrix kernel.
    ``stream``: the lane kernel writes its output by non-temporal stores (the same values);
    None = from ``CHOLESKY_STREAM_FROM`` output bytes.
    """
    assert a.dim() == 3 and a.is_contiguous()
    b, n, _ = a.shape
    fills_lanes = runs_lanes("cholesky", b, n, n, a.dtype)
    if blocked is None:
        blocked = lanes is None and not fills_lanes and n >= _blocked.BLOCKED_FROM
    if blocked:
        return _blocked.cholesky_blocked(a, upper)
    if lanes is None:
        lanes = fills_lanes
    out = a.new_empty((b, n, n))
    info = torch.zeros((b,), dtype=torch.int32)
    if b == 0 or n == 0:
        return out, info, 0
    if lanes:
        if stream is None:
            stream = _chol_stream(b, n, a.dtype)
        bad = _ks(a.dtype)["cholesky_vec"].call_unchecked(
            a.data_ptr(), out.data_ptr(), info.data_ptr(), b, n, int(upper), int(stream),
            int(_huge(out)), native.num_threads(),
        )  # fmt: skip
    else:
        bad = _ks(a.dtype)["cholesky"].call_unchecked(
            a.data_ptr(), out.data_ptr(), info.data_ptr(), b, n, int(upper), native.num_threads()
        )
    return out, info, bad


def cholesky_plan(
    b: int, n: int, dtype: torch.dtype, upper: bool, batch: tuple[int, ...] | None = None
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, int]]:
    """The launcher :func:`cholesky` would use for ``b`` matrices of order n ≥ 1, resolved once.

    The returned function takes a CPU tensor of ``b`` such matrices with batch shape ``batch``
    (default ``(b,)``) and returns (factor, int32 info of that batch shape, first failing flat
    index + 1); per call it only allocates the outputs and calls the kernel (for the routed
    shapes of ``method="auto"`` and repeated ``method="jacobi"`` calls, where the choice of
    kernel and its symbol lookup would otherwise cost microseconds a call).
    """
    assert b >= 1 and n >= 1
    fills_lanes = runs_lanes("cholesky", b, n, n, dtype)
    tail: tuple[int, ...] = ()
    if not fills_lanes and n >= _blocked.BLOCKED_FROM:
        call = _blocked.library(dtype, native.cpu_info().isa).call_unchecked
        tail = (_blocked.panel_width(n),)
    elif fills_lanes:
        call = _ks(dtype)["cholesky_vec"].call_unchecked
        big = b * n * n * (torch.finfo(dtype).bits // 8) >= HUGE_OUTPUT_FROM
        tail = (int(_chol_stream(b, n, dtype)), int(big))
    else:
        call = _ks(dtype)["cholesky"].call_unchecked
    up = int(upper)
    # empty_like of a template: ~1.3 us vs ~3 us for torch.empty(shape, dtype=...) (B = 100)
    info_like = torch.empty((b,) if batch is None else batch, dtype=torch.int32)
    nthreads = torch.get_num_threads

    def run(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        if not a.is_contiguous():
            a = a.contiguous()
        out = torch.empty_like(a)
        info = torch.empty_like(info_like)
        bad = call(a.data_ptr(), out.data_ptr(), info.data_ptr(), b, n, up, *tail,
                   max(1, nthreads()))  # fmt: skip
        return out, info, bad

    return run
