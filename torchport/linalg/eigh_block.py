"""Block-ordered Jacobi eigh with scaled two-round updates, one matrix per SIMD lane.

The two-sided Jacobi method of :mod:`torchport.linalg.kernels` (same angle formula, same
threshold |a_pq| > eps max(sqrt|a_pp a_qq|, 0.1 ||A||_F), same per-lane power-of-two scaling,
8 float32 / 4 float64 matrices per ymm register, 16 / 8 per zmm register on avx512 where
:data:`WIDE_LANES` says so), in a block order built for throughput. The
r = n rounded up to a multiple of 4 indices (padding rows and columns are zero and never rotate)
form m = r / 2 blocks of two, {2X, 2X+1}. A sweep is

1. one round of the pairs inside each block, (2X, 2X+1);
2. m - 1 block rounds of a round-robin tournament over the blocks: blocks a < b meet as a
   quartet (2a, 2a+1, 2b, 2b+1) = local 0..3 and get two rotation rounds, local pairs
   (0, 2), (1, 3) then (0, 3), (1, 2).

so every pair is rotated once a sweep (r - 1 rounds of r / 2 disjoint pairs, as round-robin).
Two changes cut the update cost against the fused lane kernel (``eigh_vec_fused_round``), whose
rounds load and store every element of A's upper triangle and of V once per round and spend a
multiply and an FMA per element and rotation:

- **two rounds per pass**: a quartet's four rows of V and each 4x4 tile of A between two
  quartets are loaded once, get both rotation rounds in registers, and are stored once;
- **scaled (fast-Givens) rotations**: A = D Ã D and V = D Ṽ with one diagonal scale D shared by
  both, so the rotation c [1 -t; t 1] becomes x̃_p' = x̃_p - al x̃_q, x̃_q' = x̃_q + be x̃_p
  (al = t d_q/d_p, be = t d_p/d_q, d_p and d_q times c): one FMA per element and rotation. Each
  quartet's 4x4 diagonal block is rotated in true values (the angles need them); the scales
  shrink by at most 1/sqrt(2) a rotation and are folded back into A and V after every sweep
  (at most r - 1 rotations per index: d >= 2^-16, no over- or underflow in float32).

Exact arithmetic gives the same rotations as :func:`torchport.linalg.reference.eigh_reference`
with ``order=3`` (this pair order, ordinary rotations), which is the reference the tests hold it
to. Eigenvalues ascending, eigenvectors as columns (torch.linalg.eigh's convention).
"""

from __future__ import annotations

import functools
import hashlib

import torch

from torchport import native
from torchport.linalg._cparams import lane_bytes, lane_params, launcher
from torchport.native import Kernel

MAX_SWEEPS = 60
# Lane vectors of a zmm register (16 float32 / 8 float64 matrices at once) on avx512, per dtype;
# otherwise (and on other ISAs) a ymm register. Measured (Zen 5, B = 2000, one thread, min of 7
# alternated thread-CPU times, ymm/zmm time): f32 n = 16 1.45x, n = 32 1.44x; f64 1.53x, 1.50x.
WIDE_LANES = {torch.float32: True, torch.float64: True}

_SOURCE = r"""
typedef ${elem} T;
typedef T VT __attribute__((vector_size(${vbytes}), aligned(${vbytes})));
typedef ${ielem} VI __attribute__((vector_size(${vbytes}), aligned(${vbytes})));
#define VLN ((int64_t)(${vbytes} / sizeof(T)))
#define EPS ((T)${eps})
#define MAX_SWEEPS ${max_sweeps}
/* row stride of the lane matrices A and V: r + 1 vectors, so that rows are not a multiple of
   4 KiB apart (loads of one row then alias stores to another in the store buffer) */
#define RS (r + 1)

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

/* Scaled (tangent-form) rotation of a pair: with A = D Ã D and V = D Ṽ, the rotation
   x_p' = c (x_p - t x_q), x_q' = c (x_q + t x_p) of the true rows becomes
   x̃_p' = x̃_p - al x̃_q, x̃_q' = x̃_q + be x̃_p with al = t d_q / d_p, be = t d_p / d_q and
   d_p, d_q multiplied by c: one FMA per element instead of a multiply and an FMA. */
typedef struct { VT al, be; } rot_t;

/* The lanes where pair (p, q) passes the rotation threshold:
   a_pq^2 > eps^2 max(|a_pp a_qq|, floor2) and a_pq != 0 (rot_pair and would_rotate). */
TP_INLINE VI passes(VT apq, VT app, VT aqq, VT floor2) {
    const VT zero = {0};
    VT scale2 = vabs(app * aqq);
    scale2 = vsel(scale2 > floor2, scale2, floor2);
    return (apq * apq > (EPS * EPS) * scale2) & (apq != zero);
}

/* One Jacobi rotation of local pair (p, q), p < q, of the true symmetric sz x sz block S (upper
   triangle only; global indices g[]): the angle (same formula and threshold as the fused lane kernel), S rotated in
   the ordinary form, the scaled coefficients into *o, d (scales) and e = 1/d updated.
   Returns 1 if some lane rotated. */
TP_INLINE int rot_pair(VT S[4][4], int sz, int p, int q, const int64_t *g, VT *d, VT *e,
                       VT floor2, rot_t *o) {
    const VT zero = {0}, one = zero + 1;
    VT apq = S[p][q], app = S[p][p], aqq = S[q][q];
    VI act = passes(apq, app, aqq, floor2);
    if (!vany(act)) { o->al = zero; o->be = zero; return 0; }
    VT dd = aqq - app, gg = apq + apq;
    VI same = (dd == zero) | ((dd > zero) == (gg > zero));
    VT num = vsel(same, vabs(gg), -vabs(gg));
    VT t = vsel(act, num / (vabs(dd) + vsqrt(dd * dd + gg * gg)), zero);
    VT sq = vsqrt(one + t * t), c = one / sq, s = c * t;
    for (int k = 0; k < sz; ++k) {
        if (k == p || k == q) continue;
        VT *xp = &S[TP_MIN(p, k)][TP_MAX(p, k)], *yp = &S[TP_MIN(q, k)][TP_MAX(q, k)];
        VT x = *xp, y = *yp;
        *xp = c * x - s * y;
        *yp = s * x + c * y;
    }
    S[p][p] = app - t * apq; S[q][q] = aqq + t * apq;
    S[p][q] = vsel(act, zero, apq);
    const int64_t gp = g[p], gq = g[q];
    o->al = t * d[gq] * e[gp]; o->be = t * d[gp] * e[gq];
    d[gp] *= c; d[gq] *= c; e[gp] *= sq; e[gq] *= sq;
    return 1;
}

/* x̃_p' = x̃_p - al x̃_q, x̃_q' = x̃_q + be x̃_p */
#define ROT(X, Y, R) do { VT x_ = (X), y_ = (Y); (X) = x_ - (R).al * y_; (Y) = y_ + (R).be * x_; } while (0)

/* One sweep's first round: the pairs (2X, 2X + 1) inside each block X of two indices. */
TP_INLINE int intra_round(VT *A, VT *V, int64_t r, int wantv, VT *d, VT *e, VT floor2, rot_t *co,
                          int32_t *live) {
    const int64_t m = r / 2;
    int any = 0;
    for (int64_t X = 0; X < m; ++X) {
        const int64_t g[2] = {2 * X, 2 * X + 1};
        VT *b = A + g[0] * RS + g[0];
        VT S[4][4];
        S[0][0] = b[0]; S[0][1] = b[1]; S[1][1] = b[RS + 1];
        live[X] = rot_pair(S, 2, 0, 1, g, d, e, floor2, co + X);
        if (!live[X]) continue;
        any = 1;
        b[0] = S[0][0]; b[1] = S[0][1]; b[RS + 1] = S[1][1];
    }
    if (!any) return 0;
    for (int64_t X = 0; X < m; ++X)
        for (int64_t Y = X + 1; Y < m; ++Y) {
            if (!live[X] && !live[Y]) continue;
            VT *b = A + 2 * X * RS + 2 * Y;
            VT x = b[0], y = b[1], z = b[RS], w = b[RS + 1];
            ROT(x, z, co[X]); ROT(y, w, co[X]);
            ROT(x, y, co[Y]); ROT(z, w, co[Y]);
            b[0] = x; b[1] = y; b[RS] = z; b[RS + 1] = w;
        }
    if (wantv)
        for (int64_t X = 0; X < m; ++X) {
            if (!live[X]) continue;
            VT *vp = V + 2 * X * RS, *vq = vp + RS;
            const rot_t R = co[X];
            for (int64_t k = 0; k < r; ++k) ROT(vp[k], vq[k], R);
        }
    return 1;
}

/* The 2x2 tile of rows of block X and columns of block Y (X != Y) in the upper triangle: its
   first element, and the offsets of elements (0, 1) and (1, 0) (stored as is when X < Y,
   transposed otherwise; no branch). */
TP_INLINE VT *tile_at(VT *A, int64_t r, int64_t X, int64_t Y, int64_t *o01, int64_t *o10) {
    const int64_t lo = X < Y ? X : Y, hi = X ^ Y ^ lo, tr = X > Y;
    *o01 = 1 + tr * (RS - 1);
    *o10 = RS - tr * (RS - 1);
    return A + 2 * lo * RS + 2 * hi;
}

/* A block round: blocks paired as quartets (a, b), a < b, indices (2a, 2a+1, 2b, 2b+1) =
   local 0..3; two rotation rounds per quartet, local pairs (0, 2), (1, 3) then (0, 3), (1, 2).
   Each quartet's 4x4 diagonal block is rotated in true values; every other 4x4 tile of the
   upper triangle and the quartet's four rows of V get both rounds in one pass (loaded and
   stored once for two rounds). */
TP_INLINE int block_round(VT *A, VT *V, int64_t r, int applyv, const int32_t *bp, VT *d, VT *e,
                          VT floor2, rot_t *co, int32_t *live, VT (*S)[4][4]) {
    const int64_t h = r / 4;
    int any = 0;
    /* each rotation round over all quartets before the next (the quartets' angle
       computations are independent: their sqrt/div latency chains overlap) */
    for (int64_t t = 0; t < h; ++t) {
        const int64_t a = bp[2 * t], b = bp[2 * t + 1];
        const int64_t g[4] = {2 * a, 2 * a + 1, 2 * b, 2 * b + 1};
        for (int i = 0; i < 4; ++i)
            for (int j = i; j < 4; ++j) {
                VT x = A[g[i] * RS + g[j]];
                S[t][i][j] = (i >> 1) == (j >> 1) ? x : x * d[g[i]] * d[g[j]];
            }
        live[t] = rot_pair(S[t], 4, 0, 2, g, d, e, floor2, co + 4 * t);
        live[t] |= rot_pair(S[t], 4, 1, 3, g, d, e, floor2, co + 4 * t + 1);
    }
    for (int64_t t = 0; t < h; ++t) {
        const int64_t a = bp[2 * t], b = bp[2 * t + 1];
        const int64_t g[4] = {2 * a, 2 * a + 1, 2 * b, 2 * b + 1};
        live[t] |= rot_pair(S[t], 4, 0, 3, g, d, e, floor2, co + 4 * t + 2);
        live[t] |= rot_pair(S[t], 4, 1, 2, g, d, e, floor2, co + 4 * t + 3);
        if (!live[t]) continue;
        any = 1;
        for (int i = 0; i < 4; ++i)
            for (int j = i; j < 4; ++j)
                A[g[i] * RS + g[j]] = (i >> 1) == (j >> 1) ? S[t][i][j] : S[t][i][j] * e[g[i]] * e[g[j]];
    }
    if (!any) return 0;
    for (int64_t I = 0; I < h; ++I) {
        const int64_t ia = bp[2 * I], ib = bp[2 * I + 1];
        const rot_t *oi = co + 4 * I;
        for (int64_t J = I + 1; J < h; ++J) {
            if (!live[I] && !live[J]) continue;
            const int64_t ja = bp[2 * J], jb = bp[2 * J + 1];
            const rot_t *oj = co + 4 * J;
            int64_t o[4][2];
            VT *b0 = tile_at(A, r, ia, ja, &o[0][0], &o[0][1]), *b1 = tile_at(A, r, ia, jb, &o[1][0], &o[1][1]);
            VT *b2 = tile_at(A, r, ib, ja, &o[2][0], &o[2][1]), *b3 = tile_at(A, r, ib, jb, &o[3][0], &o[3][1]);
            VT M[4][4];
#define TLOAD(B, K, I, J) M[I][J] = B[0]; M[I][J + 1] = B[o[K][0]]; M[I + 1][J] = B[o[K][1]]; M[I + 1][J + 1] = B[RS + 1];
#define TSTORE(B, K, I, J) B[0] = M[I][J]; B[o[K][0]] = M[I][J + 1]; B[o[K][1]] = M[I + 1][J]; B[RS + 1] = M[I + 1][J + 1];
            TLOAD(b0, 0, 0, 0) TLOAD(b1, 1, 0, 2) TLOAD(b2, 2, 2, 0) TLOAD(b3, 3, 2, 2)
            for (int j = 0; j < 4; ++j) {  /* rows: quartet I's two rounds */
                ROT(M[0][j], M[2][j], oi[0]); ROT(M[1][j], M[3][j], oi[1]);
                ROT(M[0][j], M[3][j], oi[2]); ROT(M[1][j], M[2][j], oi[3]);
            }
            for (int i = 0; i < 4; ++i) {  /* columns: quartet J's two rounds */
                ROT(M[i][0], M[i][2], oj[0]); ROT(M[i][1], M[i][3], oj[1]);
                ROT(M[i][0], M[i][3], oj[2]); ROT(M[i][1], M[i][2], oj[3]);
            }
            TSTORE(b0, 0, 0, 0) TSTORE(b1, 1, 0, 2) TSTORE(b2, 2, 2, 0) TSTORE(b3, 3, 2, 2)
#undef TLOAD
#undef TSTORE
        }
    }
    if (applyv)
        for (int64_t t = 0; t < h; ++t) {
            if (!live[t]) continue;
            const int64_t a = bp[2 * t], b = bp[2 * t + 1];
            VT *v0 = V + 2 * a * RS, *v1 = v0 + RS, *v2 = V + 2 * b * RS, *v3 = v2 + RS;
            const rot_t R0 = co[4 * t], R1 = co[4 * t + 1], R2 = co[4 * t + 2], R3 = co[4 * t + 3];
            for (int64_t k = 0; k < r; ++k) {
                VT x0 = v0[k], x1 = v1[k], x2 = v2[k], x3 = v3[k];
                ROT(x0, x2, R0); ROT(x1, x3, R1);
                ROT(x0, x3, R2); ROT(x1, x2, R3);
                v0[k] = x0; v1[k] = x1; v2[k] = x2; v3[k] = x3;
            }
        }
    return 1;
}

/* A quartet's two rotation rounds on one element of each of its four rows (a0, a1: rows of
   block a; b0, b1: of block b; a < b). */
#define QUAD(A0, A1, B0, B1, R) do { ROT(A0, B0, (R)[0]); ROT(A1, B1, (R)[1]); ROT(A0, B1, (R)[2]); ROT(A1, B0, (R)[3]); } while (0)

/* V's rows for two consecutive XOR block rounds s1, s2 (block X meets X ^ s): the blocks
   X, X^s1, X^s2, X^s1^s2 are closed under both rounds, so their eight rows of V get the four
   rotation rounds in one pass (loaded and stored once for four rounds instead of two). q1/q2:
   the quartet index of each block in the two rounds; c1/c2, l1/l2 their coefficients and
   live flags. */
TP_INLINE void v_two_rounds(VT *V, int64_t r, int64_t m, int64_t s1, int64_t s2,
                            const int32_t *q1, const int32_t *q2, const rot_t *c1,
                            const rot_t *c2, const int32_t *l1, const int32_t *l2) {
    for (int64_t X = 0; X < m; ++X) {
        const int64_t B1 = X ^ s1, B2 = X ^ s2, B3 = X ^ s1 ^ s2;
        if (X > B1 || X > B2 || X > B3) continue;  /* X is the smallest block of its group */
        const int64_t ta = q1[X], tb = q1[B2], tc = q2[X], td = q2[B1];
        if (!l1[ta] && !l1[tb] && !l2[tc] && !l2[td]) continue;
        const rot_t *Ra = c1 + 4 * ta, *Rb = c1 + 4 * tb, *Rc = c2 + 4 * tc, *Rd = c2 + 4 * td;
        VT *v0 = V + 2 * X * RS, *v1 = v0 + RS, *v2 = V + 2 * B1 * RS, *v3 = v2 + RS;
        VT *v4 = V + 2 * B2 * RS, *v5 = v4 + RS, *v6 = V + 2 * B3 * RS, *v7 = v6 + RS;
#define VLOOP(P0, P1, Q0, Q1, U0, U1, W0, W1)                                              \
        for (int64_t k = 0; k < r; ++k) {                                                  \
            VT x0 = v0[k], x1 = v1[k], x2 = v2[k], x3 = v3[k];                             \
            VT x4 = v4[k], x5 = v5[k], x6 = v6[k], x7 = v7[k];                             \
            QUAD(x0, x1, x2, x3, Ra); QUAD(P0, P1, Q0, Q1, Rb);                            \
            QUAD(x0, x1, x4, x5, Rc); QUAD(U0, U1, W0, W1, Rd);                            \
            v0[k] = x0; v1[k] = x1; v2[k] = x2; v3[k] = x3;                                \
            v4[k] = x4; v5[k] = x5; v6[k] = x6; v7[k] = x7;                                \
        }
        if (B2 < B3 && B1 < B3) VLOOP(x4, x5, x6, x7, x2, x3, x6, x7)
        else if (B2 < B3) VLOOP(x4, x5, x6, x7, x6, x7, x2, x3)
        else if (B1 < B3) VLOOP(x6, x7, x4, x5, x2, x3, x6, x7)
        else VLOOP(x6, x7, x4, x5, x6, x7, x2, x3)
#undef VLOOP
    }
}

/* V's rows for three consecutive XOR block rounds s1, s2, s3 = s1 ^ s2: the group of four
   blocks X, X^s1, X^s2, X^s3 is closed under all three (X meets X^s in round s, the other two
   blocks meet each other), so its eight rows get the six rotation rounds in one pass. q, c, l:
   each round's quartet indices, coefficients and live flags. */
TP_INLINE void v_three_rounds(VT *V, int64_t r, int64_t m, int64_t s1, int64_t s2,
                              const int32_t *q[3], const rot_t *c[3], const int32_t *l[3]) {
    for (int64_t X = 0; X < m; ++X) {
        const int64_t B1 = X ^ s1, B2 = X ^ s2, B3 = X ^ s1 ^ s2;
        if (X > B1 || X > B2 || X > B3) continue;  /* X is the smallest block of its group */
        /* round 1: (X, B1), (B2, B3); round 2: (X, B2), (B1, B3); round 3: (X, B3), (B1, B2) */
        const int64_t t0 = q[0][X], t1 = q[0][B2], t2 = q[1][X], t3 = q[1][B1];
        const int64_t t4 = q[2][X], t5 = q[2][B1];
        if (!l[0][t0] && !l[0][t1] && !l[1][t2] && !l[1][t3] && !l[2][t4] && !l[2][t5]) continue;
        const rot_t *R0 = c[0] + 4 * t0, *R1 = c[0] + 4 * t1, *R2 = c[1] + 4 * t2;
        const rot_t *R3 = c[1] + 4 * t3, *R4 = c[2] + 4 * t4, *R5 = c[2] + 4 * t5;
        const int o1 = B2 < B3, o2 = B1 < B3, o3 = B1 < B2;
        VT *v0 = V + 2 * X * RS, *v1 = v0 + RS, *v2 = V + 2 * B1 * RS, *v3 = v2 + RS;
        VT *v4 = V + 2 * B2 * RS, *v5 = v4 + RS, *v6 = V + 2 * B3 * RS, *v7 = v6 + RS;
        for (int64_t k = 0; k < r; ++k) {
            VT x0 = v0[k], x1 = v1[k], x2 = v2[k], x3 = v3[k];
            VT x4 = v4[k], x5 = v5[k], x6 = v6[k], x7 = v7[k];
            QUAD(x0, x1, x2, x3, R0);
            if (o1) QUAD(x4, x5, x6, x7, R1); else QUAD(x6, x7, x4, x5, R1);
            QUAD(x0, x1, x4, x5, R2);
            if (o2) QUAD(x2, x3, x6, x7, R3); else QUAD(x6, x7, x2, x3, R3);
            QUAD(x0, x1, x6, x7, R4);
            if (o3) QUAD(x2, x3, x4, x5, R5); else QUAD(x4, x5, x2, x3, R5);
            v0[k] = x0; v1[k] = x1; v2[k] = x2; v3[k] = x3;
            v4[k] = x4; v5[k] = x5; v6[k] = x6; v7[k] = x7;
        }
    }
}

/* Fold the scales back in (Ã_ij d_i d_j for i, j in different blocks, Ṽ_i d_i) and reset them
   to 1. The entries inside a block of two (the diagonal among them) are kept in true values:
   they are only touched by the rotations of their own quartet or block, which work in true
   values, so they never take a scale round trip (d e = 1 only to rounding, and a round trip
   every block round would add that error to the eigenvalues each time). */
TP_INLINE void unscale(VT *A, VT *V, int64_t r, int wantv, VT *d, VT *e) {
    const VT one = (VT){0} + 1;
    for (int64_t i = 0; i < r; ++i) {
        for (int64_t j = (i | 1) + 1; j < r; ++j) A[i * RS + j] *= d[i] * d[j];
        if (wantv) for (int64_t k = 0; k < r; ++k) V[i * RS + k] *= d[i];
    }
    for (int64_t i = 0; i < r; ++i) { d[i] = one; e[i] = one; }
}

/* Whether a sweep from this A (true values, scales 1) would rotate: some pair passes rot_pair's
   threshold (``passes``). If none does, the sweep's first round rotates nothing and
   leaves A as it is, and so does every later round: the sweep would change nothing, and this
   test replaces it (the last sweep of every call; for its A, rounds of r - 1 angle tests, 4x4
   loads and the scale round trip cost more than one pass of compares). */
TP_INLINE int would_rotate(const VT *A, int64_t r, VT floor2) {
    for (int64_t i = 0; i < r; ++i) {
        const VT app = A[i * RS + i];
        VI act = (VI){0};
        for (int64_t j = i + 1; j < r; ++j) act |= passes(A[i * RS + j], app, A[j * RS + j], floor2);
        if (vany(act)) return 1;
    }
    return 0;
}

TP_INLINE int eigh_block(const T *in, T *L, T *Q, int64_t cnt, int64_t n, int upper, int wantv,
                         VT *A, VT *V, VT *d, VT *e, int64_t *perm, const int32_t *bp,
                         const int32_t *qof, const int32_t *grp, rot_t *co, int32_t *live,
                         VT (*S)[4][4]) {
    const VT zero = {0}, one = zero + 1;
    const int64_t r = (n + 3) & ~(int64_t)3, m = r / 2;
    const int64_t nn = n * n;
    for (int64_t l = 0; l < cnt; ++l) {  /* x * 0 is NaN exactly for non-finite x */
        T acc = 0;
        #pragma omp simd reduction(+:acc)
        for (int64_t i = 0; i < nn; ++i) acc += in[l * nn + i] * 0;
        if (acc != acc) return (int)l + 1;
    }
    /* the triangle read row by row (contiguous) into the lanes of the upper triangle of A; each
       lane is then scaled by the power of two that brings its largest entry into [1, 2) (exact;
       the eigenvalues are scaled back at the end) */
    for (int64_t i = 0; i < r; ++i)
        for (int64_t j = i; j < r; ++j) A[i * RS + j] = zero;
    for (int64_t l = 0; l < cnt; ++l) {
        const T *src = in + l * nn;
        for (int64_t i = 0; i < n; ++i) {
            const int64_t j0 = upper ? i : 0, j1 = upper ? n : i + 1;
            for (int64_t j = j0; j < j1; ++j) A[upper ? i * RS + j : j * RS + i][l] = src[i * n + j];
        }
    }
    /* each lane's largest |entry|: lane-parallel maxima over the triangle (four independent
       chains; a scalar running maximum per lane is one long latency chain) */
    VT mxv[4] = {zero, zero, zero, zero};
    for (int64_t i = 0; i < n; ++i)
        for (int64_t j = i; j < n; ++j) {
            VT x = vabs(A[i * RS + j]);
            VT *mp = &mxv[j & 3];
            *mp = vsel(x > *mp, x, *mp);
        }
    for (int k = 1; k < 4; ++k) mxv[0] = vsel(mxv[k] > mxv[0], mxv[k], mxv[0]);
    int ex[VLN];
    VT fac = one;
    for (int64_t l = 0; l < VLN; ++l) {
        const T mx = ${fabs}(mxv[0][l]);
        ex[l] = TP_SCALE_EXP(mx);
        fac[l] = ${ldexp}((T)1, -ex[l]);
    }
    VT frob = zero, frob2 = zero;
    for (int64_t i = 0; i < n; ++i) {
        VT x = A[i * RS + i] * fac;
        A[i * RS + i] = x;
        frob += x * x;
        for (int64_t j = i + 1; j < n; ++j) {
            x = A[i * RS + j] * fac;
            A[i * RS + j] = x;
            frob2 += x * x;
        }
    }
    frob += frob2 + frob2;
    const VT floor2 = (T)0.01 * frob;
    for (int64_t i = 0; i < r; ++i) { d[i] = one; e[i] = one; }
    if (wantv) { for (int64_t j = 0; j < r * RS; ++j) V[j] = zero; for (int64_t j = 0; j < r; ++j) V[j * RS + j] = one; }
    for (int sweep = 0; sweep < MAX_SWEEPS; ++sweep) {
        int rotated = intra_round(A, V, r, wantv, d, e, floor2, co, live);
        for (int64_t k = 0; k < m - 1; ++k) {
            /* XOR tournament: V of a group of two or three rounds (grp) in one pass after
               the group's last round */
            const int gl = grp[3 * k + 1], gp = grp[3 * k + 2], fused = gl > 1 && wantv;
            rotated |= block_round(A, V, r, wantv && !fused, bp + k * m, d, e, floor2,
                                   co + gp * (r + 4), live + gp * (m + 1), S);
            if (fused && gp == 1 && gl == 2)
                v_two_rounds(V, r, m, grp[3 * k - 3], grp[3 * k], qof + (k - 1) * m, qof + k * m,
                             co, co + (r + 4), live, live + (m + 1));
            if (fused && gp == 2) {
                const int32_t *qs[3] = {qof + (k - 2) * m, qof + (k - 1) * m, qof + k * m};
                const rot_t *cs[3] = {co, co + (r + 4), co + 2 * (r + 4)};
                const int32_t *ls[3] = {live, live + (m + 1), live + 2 * (m + 1)};
                v_three_rounds(V, r, m, grp[3 * k - 6], grp[3 * k - 3], qs, cs, ls);
            }
        }
        unscale(A, V, r, wantv, d, e);
        if (!rotated || !would_rotate(A, r, floor2)) break;
    }
    /* ascending order, stable (ties keep index order): each lane's rank of diagonal entry j,
       #{k < j: a_kk <= a_jj} + #{k > j: a_kk < a_jj}, counted for all lanes at once with
       branch-free compares (a per-lane insertion sort mispredicts a branch per move);
       perm[l n + rank] = j */
    for (int64_t j = 0; j < n; ++j) {
        const VT x = A[j * RS + j];
        VI rk = (VI){0};
        for (int64_t k = 0; k < j; ++k) rk -= A[k * RS + k] <= x;
        for (int64_t k = j + 1; k < n; ++k) rk -= A[k * RS + k] < x;
        for (int64_t l = 0; l < cnt; ++l) perm[l * n + rk[l]] = j;
    }
    for (int64_t l = 0; l < cnt; ++l) {
        const int64_t *pl = perm + l * n;
        for (int64_t j = 0; j < n; ++j) L[l * n + j] = ${ldexp}(A[pl[j] * RS + pl[j]][l], ex[l]);
        if (wantv)  /* Q[i][j] = row perm[j] of V, element i: Q written row by row (contiguous
                       stores; a column at a time stalls on one cache-line miss per store) */
            for (int64_t i = 0; i < n; ++i) {
                T *qo = Q + l * nn + i * n;
                for (int64_t j = 0; j < n; ++j) qo[j] = V[pl[j] * RS + i][l];
            }
    }
    return 0;
}

/* The blocks' tournament, m - 1 rounds of m / 2 disjoint pairs (a < b) at bp[k m ...]. For m a
   power of two (from 4) the XOR tournament, block X meets X ^ s in the round of s (1 <= s < m),
   the s taken greedily in groups closed under XOR, {a, b, a ^ b} (a the smallest left, b the
   smallest partner with a ^ b also left; for m = 16 five such triples), else pairs, else single
   ones: a group's rounds close groups of four blocks, whose rows of V get all of the group's
   rounds in one pass (v_two_rounds, v_three_rounds). grp[3 k ...] = (s, group length, position
   in the group) of round k; qof[k m + X] is the index of block X's pair in round k. Otherwise
   the circle method (block m - 1 fixed), groups of one. The reference's _block_pairs mirrors
   this order. */
static void block_pairs(int32_t *bp, int32_t *qof, int32_t *grp, int64_t m) {
    const int xo = m >= 4 && (m & (m - 1)) == 0;
    if (xo) {
        int32_t used[64 + 1] = {0};  /* only read for m <= 64; larger m: pairs of consecutive s */
        int64_t k = 0;
        for (int64_t a = 1; a < m; ++a) {
            if (m <= 64 && used[a]) continue;
            if (m > 64) {  /* pairs (a, a + 1) */
                const int gl = a + 1 < m ? 2 : 1;
                for (int i = 0; i < gl; ++i, ++k) { grp[3 * k] = (int32_t)(a + i); grp[3 * k + 1] = gl; grp[3 * k + 2] = i; }
                a += gl - 1;
                continue;
            }
            int64_t b = 0, c = 0;
            for (int64_t x = a + 1; x < m && !c; ++x)
                if (!used[x] && !used[a ^ x]) { b = x; c = a ^ x; }
            if (!c)
                for (int64_t x = a + 1; x < m && !b; ++x)
                    if (!used[x]) b = x;
            const int64_t sv[3] = {a, b, c};
            const int gl = c ? 3 : b ? 2 : 1;
            for (int i = 0; i < gl; ++i, ++k) {
                used[sv[i]] = 1;
                grp[3 * k] = (int32_t)sv[i]; grp[3 * k + 1] = gl; grp[3 * k + 2] = i;
            }
        }
    }
    for (int64_t k = 0; k < m - 1; ++k) {
        int64_t i = 0;
        for (int64_t X = 0; X < m && xo; ++X) {
            const int64_t Y = X ^ grp[3 * k];
            if (X > Y) continue;
            bp[k * m + 2 * i] = (int32_t)X; bp[k * m + 2 * i + 1] = (int32_t)Y;
            qof[k * m + X] = qof[k * m + Y] = (int32_t)i;
            ++i;
        }
        for (i = 0; i < m / 2 && !xo; ++i) {
            int64_t a = i == 0 ? m - 1 : (k + i) % (m - 1);
            int64_t b = (k + m - 1 - i) % (m - 1);
            bp[k * m + 2 * i] = (int32_t)TP_MIN(a, b);
            bp[k * m + 2 * i + 1] = (int32_t)TP_MAX(a, b);
            grp[3 * k] = 0; grp[3 * k + 1] = 1; grp[3 * k + 2] = 0;
        }
    }
}

TP_EXPORT int tp_eigh_block(const T *a, T *L, T *Q, int64_t B, int64_t n, int64_t upper,
                            int64_t wantv, int64_t nthreads) {
    const int64_t groups = (B + VLN - 1) / VLN;
    const int64_t r = (n + 3) & ~(int64_t)3, m = r / 2;
    int64_t nt = (groups < 2 || B * n * n * n < 100000) ? 1 : nthreads;
    int64_t bad = INT64_MAX;
    int oom = 0;
    #pragma omp parallel num_threads(nt) reduction(min:bad) reduction(|:oom)
    {
        VT *A = (VT *)aligned_alloc(sizeof(VT), sizeof(VT) * (2 * r * (r + 1) + 2 * r + 4 * r + 4 * r));
        VT *V = A + r * (r + 1), *d = V + r * (r + 1), *e = d + r;
        VT (*S)[4][4] = (VT (*)[4][4])(e + r);  /* r / 4 quartets' 4x4 blocks */
        rot_t *co = (rot_t *)aligned_alloc(sizeof(VT), sizeof(rot_t) * 3 * (r + 4));
        int64_t *perm = (int64_t *)malloc(sizeof(int64_t) * VLN * (n + 1));
        int32_t *live = (int32_t *)malloc(sizeof(int32_t) * 3 * (m + 1));
        int32_t *bp = (int32_t *)malloc(sizeof(int32_t) * (2 * (m * m + 2) + 3 * m));
        int32_t *qof = bp + m * m + 2, *grp = qof + m * m + 2;
        const int ok = A && co && perm && live && bp;
        if (ok) block_pairs(bp, qof, grp, m);
        if (!ok) oom = 1;
        int64_t chunk = TP_MAX(1, groups / (nt * 16));
        #pragma omp for schedule(dynamic, chunk)
        for (int64_t gi = 0; gi < groups; ++gi) {
            if (!ok) continue; /* every thread still meets the worksharing loop */
            int64_t b0 = gi * VLN, cnt = TP_MIN(VLN, B - b0);
            const T *src = a + b0 * n * n;
            T *lo = L + b0 * n, *qo = wantv ? Q + b0 * n * n : Q;
            int st;
#define EIGH_BLOCK(N) eigh_block(src, lo, qo, cnt, N, (int)upper, (int)wantv, A, V, d, e, perm, bp, qof, grp, co, live, S)
            if (n == 16) st = EIGH_BLOCK(16);
            else if (n == 32) st = EIGH_BLOCK(32);
            else st = EIGH_BLOCK(n);
#undef EIGH_BLOCK
            if (st && b0 + st - 1 < bad) bad = b0 + st - 1;
        }
        free(A); free(co); free(perm); free(live); free(bp);
    }
    if (oom) return -1;
    return bad == INT64_MAX ? 0 : (int)TP_MIN(bad + 1, 2147483647);
}
"""


SOURCE_TAG = hashlib.sha256(_SOURCE.encode()).hexdigest()[:12]


@functools.cache
def library(
    dtype: torch.dtype, isa: str, max_sweeps: int = MAX_SWEEPS, vbytes: int | None = None
) -> Kernel:
    """Build (or load from the disk cache) ``tp_eigh_block`` for one dtype.

    ``max_sweeps`` caps the sweeps (the public path uses 60, which converged input never
    reaches); ``bench linalg --sweeps`` builds capped copies to time one sweep. ``vbytes``:
    bytes per lane vector (32 or 64; None = :data:`WIDE_LANES`' choice for the dtype on this
    ISA).
    """
    is64 = dtype == torch.float64
    vbytes = vbytes or lane_bytes(isa, WIDE_LANES[dtype])
    src = native.render(
        "#include <stdlib.h>\n" + _SOURCE,
        **lane_params(dtype, max_sweeps, vbytes),
    )
    name = f"linalg_eigh_block_{'f64' if is64 else 'f32'}_{isa}_v{vbytes}"
    lib = native.build(src, name=name, isa=isa)
    return launcher(lib, "tp_eigh_block", dtype, "A L:r Q", "B n upper wantv nthreads")


def eigh(
    a: torch.Tensor, upper: bool, compute_v: bool, vbytes: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Batched symmetric eigendecomposition of contiguous ``a`` (B, n, n) with the block-ordered
    lane kernel: L (B, n) ascending, Q (B, n, n) (empty unless ``compute_v``), and 1 + the first
    batch index with a non-finite entry (0 when there is none); MemoryError when a
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
