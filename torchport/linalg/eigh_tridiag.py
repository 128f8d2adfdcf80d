"""Batched symmetric eigh by Householder tridiagonalisation and implicit QL, one matrix per lane.

VLN matrices (4 float64 / 8 float32 per ymm register, twice that per zmm on avx512) are held
interleaved, one per SIMD lane, in the layout of the Jacobi lane kernels
(:mod:`torchport.linalg.eigh_block`): element (i, j) of every lane's matrix in one vector. All
lanes execute the same instructions; what differs per lane (norms, signs, convergence) is
selected by blends.

1. **Scaling**: each lane is scaled by the power of two that brings its largest entry of the
   read triangle into [1, 2) (exact; the eigenvalues are scaled back at the end).
2. **Tridiagonalisation** T = Qᵀ A Q by n - 2 Householder reflectors H_k = I - τ v vᵀ, LAPACK's
   convention (β = -sign(α) ‖x‖, v_0 = 1; τ = 0, the identity, where the column below the
   subdiagonal is already zero; ‖x‖ formed in the column's own power-of-two scale, as dlarfg),
   the trailing block updated as A - v wᵀ - w vᵀ with p = τ A v, w = p - (τ/2)(pᵀv) v (full
   symmetric storage). Q is formed by backward accumulation, stored
   transposed (row i of Z = column i of Q) so that the rotations below act on contiguous rows.
3. **Implicit QL** with Wilkinson shifts (LAPACK ``dsteqr``'s QL branch), |e_i| ≤ eps ‖T‖
   (‖T‖ = max_i |d_i| + |e_i|, per lane) counting as negligible. Every lane has its own top
   index l (the first non-negligible e at or after its previous l: its eigenvalues above l have
   converged) and block end m (its first negligible e_m, m > l). A sweep runs over the union of
   the lanes' ranges, i = M-1 … Lmin; a lane starts its bulge chase at i = m - 1 (its own shift,
   from its d_l, d_l+1, e_l) and takes the identity rotation (c = 1, s = 0, d and e unchanged)
   outside [l, m). Sweeps end when every lane is done, at most ``MAX_QL_ITERS`` n of them;
   past that a lane keeps what it has (the Jacobi kernels likewise stop at their sweep cap
   without an error). ``QL_GROUPS`` lane groups run their sweeps together, step by step (their
   chases are independent sqrt/division latency chains); the rotations are applied to Z after
   each sweep, four columns at a time through the sweep's sequence in registers.
   Rotation by rotation this differs from the reference, which advances all matrices' l
   together; both converge to the same eigenpairs (tests hold both to LAPACK).
4. Eigenvalues ascending (stable rank per lane), eigenvectors as columns of Q G.

:func:`torchport.linalg.reference.eigh_tridiagonal_reference` states the same steps in plain
torch.
"""

from __future__ import annotations

import functools
import hashlib

import torch

from torchport import native
from torchport.linalg._cparams import lane_bytes, lane_params, launcher
from torchport.native import Kernel

# QL sweeps of a lane group set are capped at MAX_QL_ITERS n (LAPACK dsteqr's cap; converged
# input takes ~2.4 n: 76 sweeps at n = 32, random input, two groups of four float64 matrices).
MAX_QL_ITERS = 30
# Lane vectors of a zmm register on avx512 (as eigh_block.WIDE_LANES); not measured for this
# kernel (no avx512 machine here).
WIDE_LANES = {torch.float32: True, torch.float64: True}
# Lane groups whose QL bulge chases run interleaved (independent sqrt/division latency chains).
# One thread, B = 2000, medians of 11 interleaved (load 1.6-1.8), us per matrix with vectors,
# 2 / 3 / 4 groups: f64 n = 8 0.89 / 0.84 / 0.85, n = 16 3.77 / 3.68 / 3.99, n = 32 20.76 /
# 20.38 / 20.48; f32 2 / 3: 0.49 / 0.47, 1.85 / 1.82, 10.44 / 10.06 (one group: f64 n = 16
# 4.87, n = 32 24.5 in an earlier run).
QL_GROUPS = 3

_SOURCE = r"""
typedef ${elem} T;
typedef T VT __attribute__((vector_size(${vbytes}), aligned(${vbytes})));
typedef ${ielem} VI __attribute__((vector_size(${vbytes}), aligned(${vbytes})));
#define VLN ((int64_t)(${vbytes} / sizeof(T)))
#define EPS ((T)${eps})
#define MAX_QL_ITERS ${max_sweeps}
/* lane groups whose QL sweeps run interleaved */
#define QG ${qgroups}
/* row stride of the lane matrices: n + 1 vectors (rows not a multiple of 4 KiB apart) */
#define RS (n + 1)

TP_INLINE VT vsel(VI m, VT a, VT b) { return (VT)(((VI)a & m) | ((VI)b & ~m)); }
TP_INLINE VT vabs(VT x) { VT z = x - x; return vsel(x < z, -x, x); }
TP_INLINE VT vsqrt(VT x) {
#if ${vguard}
    return (VT)${lsqrt}((${lvec})x);
#else
    VT r; for (int64_t l = 0; l < VLN; ++l) r[l] = ${sqrt}(x[l]); return r;
#endif
}
TP_INLINE int vany(VI m) {
#if ${vguard}
    return ${lmovemask}((${lmask})m) != 0;
#else
    ${ielem} r = 0; for (int64_t l = 0; l < VLN; ++l) r |= m[l]; return r != 0;
#endif
}

/* Householder tridiagonalisation of the lanes' full symmetric A (n x n, stride RS) in place:
   d, e the diagonal and subdiagonal of T; row k of A keeps v_k in columns k+1..n-1 (v_k[0] = 1
   implied), tau[k] its factor. p is scratch of n vectors. */
TP_INLINE void tridiag(VT *A, int64_t n, VT *d, VT *e, VT *tau, VT *p) {
    const VT zero = {0}, one = zero + 1;
    /* the exponent bits: x & ebits is 2^e for 2^e <= |x| < 2^(e + 1), 2 one - it is 2^-e */
    const VI ebits = (VI)(zero + (T)INFINITY);
    /* below this sum of squares a column's norm is formed in its own scale (kernels.py house) */
    const T house_safe = (T)(sizeof(T) == 4 ? 0x1p-60 : 0x1p-600);
    for (int64_t k = 0; k + 2 < n; ++k) {
        VT *x = A + k * RS + k + 1;
        const int64_t m = n - k - 1;
        /* as LAPACK's dlarfg (whose norm dnrm2 scales), a lane whose column's sum of squares is
           below house_safe has it formed again in the scale cs = 2^-e of its largest entry: in
           the matrix's one scale a column far below its largest entry (a rank-one matrix after
           a step or two) had subnormal squares, and beta, tau and v disagreed (|QᵀQ - I| 1.6 in
           float32, 2.6e-5 in float64). Entries <= 2 after the scaling, so cs >= 1/2; a column
           of subnormals or zeros gets 2^1023 / 2^127. tau and v do not depend on cs, beta is
           scaled back. */
        const VT alpha = x[0];
        VT xn2 = zero, a = alpha, cs = one;
        for (int64_t j = 1; j < m; ++j) xn2 += x[j] * x[j];
        const VI low = xn2 < zero + house_safe;
        const int scaled = vany(low);
        if (scaled) {
            VT mx = vabs(alpha);
            for (int64_t j = 1; j < m; ++j) { const VT y = vabs(x[j]); mx = vsel(y > mx, y, mx); }
            cs = vsel(low, (VT)(2 * (VI)one - ((VI)mx & ebits)), one);
            xn2 = zero;
            for (int64_t j = 1; j < m; ++j) { const VT y = x[j] * cs; xn2 += y * y; }
            a = alpha * cs;
        }
        VI live = xn2 != zero;
        VT nrm = vsqrt(a * a + xn2);
        VT beta = vsel(a >= zero, -nrm, nrm);
        VT den = vsel(live, a - beta, one);
        VT t = vsel(live, (beta - a) / beta, zero), sc = one / den;
        d[k] = A[k * RS + k];
        tau[k] = t;
        x[0] = one;
        if (scaled) {
            const VT cv = vsel(live, cs, one);
            for (int64_t j = 1; j < m; ++j) x[j] = (x[j] * cv) * sc;
            beta /= cs;
        } else {
            for (int64_t j = 1; j < m; ++j) x[j] *= sc;
        }
        e[k] = vsel(live, beta, alpha);
        /* p = tau A22 v, then w = p - (tau / 2)(p . v) v in p */
        VT *A22 = A + (k + 1) * RS + k + 1;
        VT pv = zero;
        for (int64_t i = 0; i < m; ++i) {
            const VT *row = A22 + i * RS;
            VT s0 = zero, s1 = zero;
            int64_t j = 0;
            for (; j + 1 < m; j += 2) { s0 += row[j] * x[j]; s1 += row[j + 1] * x[j + 1]; }
            if (j < m) s0 += row[j] * x[j];
            p[i] = t * (s0 + s1);
            pv += p[i] * x[i];
        }
        const VT K = (T)0.5 * t * pv;
        for (int64_t i = 0; i < m; ++i) p[i] -= K * x[i];
        for (int64_t i = 0; i < m; ++i) {
            VT *row = A22 + i * RS;
            const VT vi = x[i], wi = p[i];
            for (int64_t j = 0; j < m; ++j) row[j] -= vi * p[j] + wi * x[j];
        }
    }
    if (n >= 2) {
        d[n - 2] = A[(n - 2) * RS + n - 2];
        e[n - 2] = A[(n - 2) * RS + n - 1];
        tau[n - 2] = zero;
    }
    d[n - 1] = A[(n - 1) * RS + n - 1];
    e[n - 1] = zero;
}

/* Z = Q^T (row i of Z is column i of Q = H_0 ... H_{n-3}), by backward accumulation. */
TP_INLINE void form_q(const VT *A, int64_t n, const VT *tau, VT *Z) {
    const VT zero = {0}, one = zero + 1;
    for (int64_t i = 0; i < n; ++i) {
        for (int64_t j = 0; j < n; ++j) Z[i * RS + j] = zero;
        Z[i * RS + i] = one;
    }
    for (int64_t k = n - 3; k >= 0; --k) {
        const VT *v = A + k * RS + k + 1, t = tau[k];
        const int64_t m = n - k - 1;
        for (int64_t r = k + 1; r < n; ++r) {
            VT *z = Z + r * RS + k + 1;
            VT s0 = zero, s1 = zero;
            int64_t j = 0;
            for (; j + 1 < m; j += 2) { s0 += z[j] * v[j]; s1 += z[j + 1] * v[j + 1]; }
            if (j < m) s0 += z[j] * v[j];
            const VT f = t * (s0 + s1);
            for (j = 0; j < m; ++j) z[j] -= f * v[j];
        }
    }
}

/* Rows l..M of Z rotated by the sweep's rotations i = M-1 .. l (dsteqr's dlasr('R', 'V', 'B')):
   z_{i+1}' = c z_{i+1} + s z_i, z_i' = c z_i - s z_{i+1}, four columns at a time. */
TP_INLINE void rotate_rows(VT *Z, int64_t n, int64_t l, int64_t M, const VT *cs, const VT *sn) {
    int64_t k = 0;
    for (; k + 4 <= n; k += 4) {
        VT x0 = Z[M * RS + k], x1 = Z[M * RS + k + 1], x2 = Z[M * RS + k + 2], x3 = Z[M * RS + k + 3];
        for (int64_t i = M - 1; i >= l; --i) {
            VT *zi = Z + i * RS + k, *zo = zi + RS;
            const VT c = cs[i], s = sn[i];
            VT y0 = zi[0], y1 = zi[1], y2 = zi[2], y3 = zi[3];
            zo[0] = c * x0 + s * y0; zo[1] = c * x1 + s * y1;
            zo[2] = c * x2 + s * y2; zo[3] = c * x3 + s * y3;
            x0 = c * y0 - s * x0; x1 = c * y1 - s * x1;
            x2 = c * y2 - s * x2; x3 = c * y3 - s * x3;
        }
        VT *zl = Z + l * RS + k;
        zl[0] = x0; zl[1] = x1; zl[2] = x2; zl[3] = x3;
    }
    for (; k < n; ++k) {
        VT x = Z[M * RS + k];
        for (int64_t i = M - 1; i >= l; --i) {
            const VT y = Z[i * RS + k];
            Z[(i + 1) * RS + k] = cs[i] * x + sn[i] * y;
            x = cs[i] * y - sn[i] * x;
        }
        Z[l * RS + k] = x;
    }
}

/* Implicit QL with Wilkinson shifts on the tridiagonals (d, e) of QG lane groups at once (group
   h's vectors at offset h * (n + 1), its Z at h * zs), rotations applied to Z when wantv. Every
   lane has its own top index l (its eigenvalues above l have converged) and block end m (its
   first negligible e_m, m > l); a sweep runs over the union of all lanes' ranges,
   i = M-1 .. Lmin, each lane rotating only inside its own [l, m). The groups' bulge chases are
   independent latency chains (a step's sqrt and division), interleaved step by step. */
TP_INLINE void ql(VT *d, VT *e, int64_t n, VT *Z, int64_t zs, int wantv, VT *cs, VT *sn) {
    const VT zero = {0}, one = zero + 1, top = zero + (T)(n - 1);
    const int64_t o = n + 1;
    VT tol[QG], lv[QG];
    for (int h = 0; h < QG; ++h) {
        VT anorm = zero;
        for (int64_t i = 0; i < n; ++i) {
            VT x = vabs(d[h * o + i]) + vabs(e[h * o + i]);
            anorm = vsel(x > anorm, x, anorm);
        }
        tol[h] = EPS * anorm;
        lv[h] = zero;
    }
    int64_t L0 = 0;
    for (int64_t sweep = 0; sweep < MAX_QL_ITERS * n; ++sweep) {
        /* each lane's l: its first i >= l with |e_i| > tol (n - 1: done); m: the first i > l
           with |e_i| <= tol (e_{n-1} = 0) */
        VT ln[QG], mv[QG], sigma[QG];
        VI act[QG];
        int live[QG], any = 0;
        T Mx = 0, Lm = (T)(n - 1);
        VT mxv = zero, lmv = top;
        for (int h = 0; h < QG; ++h) {
            const VT *eh = e + h * o, *dh = d + h * o;
            /* one downward scan: ms = the nearest negligible index above i */
            VT lh = top, mh = top, ms = top;
            for (int64_t i = n - 2; i >= L0; --i) {
                const VT iv = zero + (T)i;
                const VI small = vabs(eh[i]) <= tol[h], cand = ~small & (iv >= lv[h]);
                lh = vsel(cand, iv, lh);
                mh = vsel(cand, ms, mh);
                ms = vsel(small, iv, ms);
            }
            ln[h] = lv[h] = lh; mv[h] = mh;
            act[h] = lh < top;
            live[h] = vany(act[h]);
            any |= live[h];
            mxv = vsel(act[h] & (mh > mxv), mh, mxv);
            lmv = vsel(act[h] & (lh < lmv), lh, lmv);
            /* each lane's d_l, d_l+1, e_l (l = n - 1 for a lane that is done: the d, e
               arrays have n + 1 entries) */
            VT dl, dl1, el;
            for (int64_t q = 0; q < VLN; ++q) {
                const int64_t li = (int64_t)lh[q];
                dl[q] = dh[li][q]; dl1[q] = dh[li + 1][q]; el[q] = eh[li][q];
            }
            dl = vsel(act[h], dl, zero); dl1 = vsel(act[h], dl1, zero); el = vsel(act[h], el, one);
            /* shift: sigma = d_l - e_l / (g + sign(r, g)), g = (d_{l+1} - d_l) / (2 e_l) */
            const VT g0 = (dl1 - dl) / (el + el);
            const VT r0 = vsqrt(g0 * g0 + one);
            sigma[h] = dl - el / (g0 + vsel(g0 >= zero, r0, -r0));
        }
        if (!any) break;
        for (int64_t q = 0; q < VLN; ++q) {
            Mx = mxv[q] > Mx ? mxv[q] : Mx;
            Lm = lmv[q] < Lm ? lmv[q] : Lm;
        }
        const int64_t M = (int64_t)Mx;
        L0 = (int64_t)Lm;
        VT g[QG], c[QG], s[QG], p[QG];
        for (int h = 0; h < QG; ++h) { g[h] = zero; c[h] = one; s[h] = one; p[h] = zero; }
        for (int64_t i = M - 1; i >= L0; --i) {
            const VT iv = zero + (T)i;
            #pragma GCC unroll 4
            for (int h = 0; h < QG; ++h) {
                VT *dh = d + h * o, *eh = e + h * o;
                const VI st = (mv[h] == iv + 1) & act[h], on = (mv[h] > iv) & (iv >= ln[h]);
                const VI fin = on & (iv == ln[h]);
                VT gh = vsel(st, dh[i + 1] - sigma[h], g[h]);
                VT ch = vsel(st, one, c[h]), sh = vsel(st, one, s[h]), ph = vsel(st, zero, p[h]);
                const VT ei = eh[i], f = sh * ei, b = ch * ei;
                const VT r2 = gh * gh + f * f;
                const VI nz = r2 != zero;
                const VT r = vsqrt(r2);
                const VT rs = vsel(gh >= zero, r, -r), fs = vsel(gh >= zero, f, -f);
                ch = vsel(nz, vabs(gh) / r, one);
                sh = vsel(nz, fs / r, zero);
                eh[i + 1] = vsel(on & ~st, rs, eh[i + 1]);
                const VT gg = dh[i + 1] - ph;
                const VT rr = (dh[i] - gg) * sh + (ch + ch) * b;
                ph = sh * rr;
                dh[i + 1] = vsel(on, gg + ph, dh[i + 1]);
                gh = ch * rr - b;
                dh[i] = vsel(fin, dh[i] - ph, dh[i]);
                eh[i] = vsel(fin, gh, eh[i]);
                cs[h * o + i] = vsel(on, ch, one);
                sn[h * o + i] = vsel(on, sh, zero);
                g[h] = gh; c[h] = ch; s[h] = sh; p[h] = ph;
            }
        }
        if (wantv)
            for (int h = 0; h < QG; ++h)
                if (live[h]) rotate_rows(Z + h * zs, n, L0, M, cs + h * o, sn + h * o);
    }
}

/* One lane group's input (cnt <= VLN matrices; the other lanes zero) scaled per lane by a power
   of two (exponents into ex) and reduced to tridiagonal (d, e), Q^T into Z when wantv. Returns
   1 + the first lane with a non-finite entry (d and e then zero), else 0. */
TP_INLINE int reduce_group(const T *in, int64_t cnt, int64_t n, int upper, int wantv, VT *A,
                           VT *Z, VT *d, VT *e, VT *tau, VT *p, int *ex) {
    const VT zero = {0}, one = zero + 1;
    const int64_t nn = n * n;
    for (int64_t l = 0; l < cnt; ++l) {  /* x * 0 is NaN exactly for non-finite x */
        T acc = 0;
        #pragma omp simd reduction(+:acc)
        for (int64_t i = 0; i < nn; ++i) acc += in[l * nn + i] * 0;
        if (acc != acc) cnt = -(l + 1);
        if (cnt < 0) break;
    }
    d[n] = zero; e[n] = zero;  /* read (and blended away) for lanes that are done */
    if (cnt <= 0) {  /* nothing to do: a zero tridiagonal converges at once */
        for (int64_t i = 0; i < n; ++i) { d[i] = zero; e[i] = zero; }
        return (int)-cnt;
    }
    /* the read triangle into both triangles of A (lanes past cnt stay zero) */
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < n; ++j) A[i * RS + j] = zero;
    for (int64_t l = 0; l < cnt; ++l) {
        const T *src = in + l * nn;
        for (int64_t i = 0; i < n; ++i) {
            const int64_t j0 = upper ? i : 0, j1 = upper ? n : i + 1;
            for (int64_t j = j0; j < j1; ++j) {
                const T x = src[i * n + j];
                A[i * RS + j][l] = x;
                A[j * RS + i][l] = x;
            }
        }
    }
    VT mxv[4] = {zero, zero, zero, zero};
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j <= i; ++j) {
            VT x = vabs(A[i * RS + j]);
            VT *mp = &mxv[j & 3];
            *mp = vsel(x > *mp, x, *mp);
        }
    for (int k = 1; k < 4; ++k) mxv[0] = vsel(mxv[k] > mxv[0], mxv[k], mxv[0]);
    VT fac = one;
    for (int64_t l = 0; l < VLN; ++l) {
        ex[l] = TP_SCALE_EXP(${fabs}(mxv[0][l]));
        fac[l] = ${ldexp}((T)1, -ex[l]);
    }
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < n; ++j) A[i * RS + j] *= fac;
    tridiag(A, n, d, e, tau, p);
    if (wantv) form_q(A, n, tau, Z);
    return 0;
}

/* Eigenvalues ascending (stable: lane rank of d_j = #{k < j: d_k <= d_j} + #{k > j: d_k < d_j})
   scaled back, their vectors (rows of Z) as the columns of Q. */
TP_INLINE void finish_group(T *L, T *Q, int64_t cnt, int64_t n, int wantv, const VT *Z,
                            const VT *d, int64_t *perm, const int *ex) {
    const int64_t nn = n * n;
    /* identity first: a rank collision (NaN, which no comparison orders) then still leaves
       every slot a valid index */
    for (int64_t l = 0; l < cnt; ++l)
        for (int64_t j = 0; j < n; ++j) perm[l * n + j] = j;
    for (int64_t j = 0; j < n; ++j) {
        const VT x = d[j];
        VI rk = (VI){0};
        for (int64_t k = 0; k < j; ++k) rk -= d[k] <= x;
        for (int64_t k = j + 1; k < n; ++k) rk -= d[k] < x;
        for (int64_t l = 0; l < cnt; ++l) perm[l * n + rk[l]] = j;
    }
    for (int64_t l = 0; l < cnt; ++l) {
        const int64_t *pl = perm + l * n;
        for (int64_t j = 0; j < n; ++j) L[l * n + j] = ${ldexp}(d[pl[j]][l], ex[l]);
        if (wantv)
            for (int64_t i = 0; i < n; ++i) {
                T *qo = Q + l * nn + i * n;
                for (int64_t j = 0; j < n; ++j) qo[j] = Z[pl[j] * RS + i][l];
            }
    }
}

/* QG lane groups (QG VLN matrices from b0; fewer at the end of the batch): reduced one by one,
   their QL run interleaved, finished one by one. Returns 1 + the first index (from b0) of a
   matrix with a non-finite entry, else 0. */
TP_INLINE int eigh_groups(const T *in, T *L, T *Q, int64_t cnt, int64_t n, int upper, int wantv,
                          VT *A, VT *Z, VT *d, VT *e, VT *tau, VT *cs, VT *sn, int64_t *perm) {
    const int64_t o = n + 1, zs = n * RS, nn = n * n;
    int ex[QG][VLN];
    int bad = 0;
    for (int h = 0; h < QG; ++h) {
        const int64_t ch = TP_MAX(0, TP_MIN(VLN, cnt - h * VLN));
        const int st = reduce_group(in + h * VLN * nn, ch, n, upper, wantv, A, Z + h * zs,
                                    d + h * o, e + h * o, tau, cs, ex[h]);
        if (st && !bad) bad = (int)(h * VLN) + st;
    }
    if (bad) return bad;
    ql(d, e, n, Z, zs, wantv, cs, sn);
    for (int h = 0; h < QG; ++h) {
        const int64_t ch = TP_MAX(0, TP_MIN(VLN, cnt - h * VLN));
        if (ch) finish_group(L + h * VLN * n, Q + (wantv ? h * VLN * nn : 0), ch, n, wantv,
                             Z + h * zs, d + h * o, perm, ex[h]);
    }
    return 0;
}

TP_EXPORT int tp_eigh_tridiag(const T *a, T *L, T *Q, int64_t B, int64_t n, int64_t upper,
                              int64_t wantv, int64_t nthreads) {
    const int64_t per = QG * VLN, units = (B + per - 1) / per;
    int64_t nt = (units < 2 || B * n * n * n < 100000) ? 1 : nthreads;
    int64_t bad = INT64_MAX;
    int oom = 0;
    #pragma omp parallel num_threads(nt) reduction(min:bad) reduction(|:oom)
    {
        const int64_t rs = n + 1;
        VT *A = (VT *)aligned_alloc(sizeof(VT), sizeof(VT) * ((QG + 1) * n * rs + (4 * QG + 1) * (n + 1)));
        VT *Z = A + n * rs, *d = Z + QG * n * rs, *e = d + QG * (n + 1), *cs = e + QG * (n + 1);
        VT *sn = cs + QG * (n + 1), *tau = sn + QG * (n + 1);
        int64_t *perm = (int64_t *)malloc(sizeof(int64_t) * VLN * (n + 1));
        const int ok = A && perm;
        if (!ok) oom = 1;
        int64_t chunk = TP_MAX(1, units / (nt * 16));
        #pragma omp for schedule(dynamic, chunk)
        for (int64_t u = 0; u < units; ++u) {
            if (!ok) continue; /* every thread still meets the worksharing loop */
            int64_t b0 = u * per, cnt = TP_MIN(per, B - b0);
            const T *src = a + b0 * n * n;
            T *lo = L + b0 * n, *qo = wantv ? Q + b0 * n * n : Q;
            int st;
#define EIGH_GROUPS(N) eigh_groups(src, lo, qo, cnt, N, (int)upper, (int)wantv, A, Z, d, e, tau, cs, sn, perm)
            if (n == 16) st = EIGH_GROUPS(16);
            else if (n == 32) st = EIGH_GROUPS(32);
            else st = EIGH_GROUPS(n);
#undef EIGH_GROUPS
            if (st && b0 + st - 1 < bad) bad = b0 + st - 1;
        }
        free(A); free(perm);
    }
    if (oom) return -1;
    return bad == INT64_MAX ? 0 : (int)TP_MIN(bad + 1, 2147483647);
}
"""


SOURCE_TAG = hashlib.sha256(_SOURCE.encode()).hexdigest()[:12]


@functools.cache
def library(
    dtype: torch.dtype,
    isa: str,
    max_iters: int = MAX_QL_ITERS,
    vbytes: int | None = None,
    qgroups: int = QL_GROUPS,
) -> Kernel:
    """Build (or load from the disk cache) ``tp_eigh_tridiag`` for one dtype.

    ``max_iters`` caps the QL sweeps per eigenvalue; ``vbytes``: bytes per lane vector (32 or
    64; None = :data:`WIDE_LANES`' choice for the dtype on this ISA); ``qgroups``: lane groups
    whose QL sweeps run interleaved (:data:`QL_GROUPS`).
    """
    vbytes = vbytes or lane_bytes(isa, WIDE_LANES[dtype])
    src = native.render(
        "#include <stdlib.h>\n" + _SOURCE,
        **lane_params(dtype, max_iters, vbytes),
        qgroups=str(qgroups),
    )
    tag = "f64" if dtype == torch.float64 else "f32"
    name = f"linalg_eigh_tridiag_{tag}_{isa}_v{vbytes}_g{qgroups}"
    lib = native.build(src, name=name, isa=isa)
    return launcher(lib, "tp_eigh_tridiag", dtype, "A L:r Q", "B n upper wantv nthreads")


def eigh(
    a: torch.Tensor, upper: bool, compute_v: bool, vbytes: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Batched symmetric eigendecomposition of contiguous ``a`` (B, n, n) by tridiagonalisation
    and QL on the lanes: L (B, n) ascending, Q (B, n, n) (empty unless ``compute_v``), and 1 +
    the first batch index with a non-finite entry (0 when there is none); MemoryError when a
    thread's work space cannot be allocated. ``vbytes``: lane vector width (see :func:`library`)."""
    assert a.dim() == 3 and a.is_contiguous() and a.dtype in (torch.float32, torch.float64)
    b, n, _ = a.shape
    lam = a.new_empty((b, n))
    q = a.new_empty((b, n, n)) if compute_v else a.new_empty((0,))
    if b == 0 or n == 0:
        return lam, q, 0
    bad = library(a.dtype, native.cpu_info().isa, vbytes=vbytes).call_unchecked(
        a.data_ptr(), lam.data_ptr(), q.data_ptr(), b, n, int(upper), int(compute_v),
        native.num_threads(),
    )  # fmt: skip
    if bad < 0:
        raise MemoryError(f"eigh: could not allocate the per-thread work space for n = {n}")
    return lam, q, bad
