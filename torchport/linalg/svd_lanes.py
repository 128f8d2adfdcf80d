"""One-sided Jacobi SVD, one matrix per SIMD lane, with throughput-shaped sweeps.

``tp_svd_lanes`` runs the same Hestenes sweeps as :mod:`torchport.linalg.kernels`' lane kernel
(round-robin rounds of disjoint column pairs, a lane below threshold takes the identity rotation,
singular values and vectors finished per lane by ``svd_finish``), but arranges each round for
throughput rather than latency:

- **inner products with four accumulators**: the old kernel summed ``w_j·w_k`` in one FMA chain
  (p × 4-cycle latency per pair), which bounded a sweep near convergence, where most pairs are only
  tested and not rotated;
- **rotation from one square root, one inverse square root**: with d = β − α,
  r = √(d² + 4g²) and u = |d| + r, ``y = 1/√(2ru)`` gives c = u·y, s = sign(d)·2g·y and
  t·g = sign(d)·4g²·r·y² (the norm update), the same rotation as
  t = sign(ζ)/(|ζ| + √(1 + ζ²)), ζ = d/2g (algebraically: 1 + t² = 2r/u), without the three
  divisions and two square roots of that form; the threshold test |g| > tol·√(αβ) is compared in
  squares (g² > tol²·α·β);
- **exact per-lane scaling**: each lane's matrix is multiplied by a power of two that brings its
  largest entry into [1, 2) (and the singular values back by the inverse), so the squared forms can
  neither overflow nor lose the threshold to underflow for representable input;
- **V not accumulated**: the sweeps rotate W only; V is recovered from the converged vectors
  (V's column j = Xᵀ w_j / σ_j², X the initial vectors) and orthonormalised by one Gram-Schmidt
  pass in descending σ (``svdl_fast_v``), when every lane of the group has
  σ_min > :data:`KAPPA_C`·eps·√p·σ_max; otherwise the group is solved again accumulating V.
  The sweeps without V touch half the memory (W alone: 32 KB at fp64 n = 32 with ymm lanes,
  64 KB with zmm lanes, where the rounds are taken in chunks of pairs to stay in L1);
- **pairs reordered within each round** (``svdl_recency_order``): a round starts with the pairs
  whose vectors the previous round touched last, so at n = 32 with zmm lanes (W larger than L1)
  the previous round's tail is still in L1. The pairs of a round are disjoint, so the results are
  bit-identical to the round-robin order (tested). Measured (Zen 5, one thread, B = 2000, float64,
  median of alternated thread-CPU times, old/new): n = 32 1.24x, 1.17x; float32 n = 32 1.11x;
  n = 16/24/64 1.03/1.03/1.01x.
- **two rounds per pass over column quartets** (order 3, :func:`pair_order`: min(m, n) a
  multiple of 4 from :data:`BLOCK_FROM`): eigh_block's block order, the pairs (2X, 2X + 1), then
  the blocks' tournament, a quartet (2a, 2a + 1, 2b, 2b + 1) taking the pairs (0, 2), (1, 3) and
  then (0, 3), (1, 2). One pass over the quartet's four vectors forms their six inner products,
  the second round's come from the first round's rotation of that Gram matrix, and one pass
  applies both rounds (``svdl_quartet``): W is read twice and written once per two rounds instead
  of read twice and written once per round.

The plain-torch reference is :func:`torchport.linalg.reference.svd_lanes_reference` (the sweeps of
``svd_reference`` with the same pair order and threshold, the angle by the equivalent classical
formula, then the same V recovery, decided per matrix instead of per lane group), so results agree
to rounding.
"""

from __future__ import annotations

import functools

import torch

from torchport import native
from torchport.linalg._cparams import lane_bytes, lane_params, launcher
from torchport.native import Kernel

# Sweep cap of the public path (as kernels.MAX_SWEEPS, which converged input never reaches).
MAX_SWEEPS = 60
# The fast V (see svdl_fast_v) is used when every lane of a group has
# sigma_min > KAPPA_C * eps * sqrt(p) * sigma_max, i.e. V's first-order error is below 1/32.
KAPPA_C = 32.0
# Lane vectors of a zmm register (16 float32 / 8 float64 matrices at once) on avx512, per dtype;
# otherwise (and on other ISAs) a ymm register. Measured (Zen 5, B = 2000, one thread, min of 7
# alternated thread-CPU times, ymm/zmm time): f32 n = 16 1.34x, n = 32 0.88x; f64 1.44x, 0.94x
# (at n = 32 a group's W, p q vectors, outgrows the 48 KiB L1 at zmm width); with the rounds
# taken in chunks (SVDL_CHUNK), ymm/zmm: f32 n = 16 1.28x, n = 32 0.97x; f64 1.46x, 1.05x; and
# (whole rounds) n = 8 1.17x / 1.35x, n = 24 1.39x / 1.52x, n = 64 1.08x / 1.14x.
WIDE_LANES = {torch.float32: True, torch.float64: True}
# From this min(m, n), when a multiple of 4, the sweeps run in the block order (order 3: two
# rounds per pass over each quartet's vectors, svdl_quartet) instead of round-robin (order 1).
BLOCK_FROM = 8
# kernels._SOURCE up to this line holds the helpers this kernel shares (not the other kernels).
_HELPERS_END = (
    "/* ---------------------------------------------------------------- SVD (one-sided Jacobi) */"
)

# eigh_block's source between these two lines: block_pairs, the blocks' tournament (order 3).
_BLOCK_PAIRS_SPAN = ("/* The blocks' tournament", "TP_EXPORT int tp_eigh_block")

_SOURCE = r"""
typedef T VT __attribute__((vector_size(${vbytes}), aligned(${vbytes})));
typedef ${ielem} VI __attribute__((vector_size(${vbytes}), aligned(${vbytes})));
#define VLN ((int64_t)(${vbytes} / sizeof(T)))
#define TP_UNROLL _Pragma("GCC unroll 4")
/* pairs per chunk of a round (svdl_sweeps): zmm, one thread, B = 2000, old (whole rounds) / new
   time: n = 32 f32 1.09x, f64 1.10x; n = 16 (one chunk a round) 1.00-1.02x; 4 gave 1.10-1.12x
   at n = 32 but 0.97x at n = 16, 2 0.88-0.96x at n = 16 */
#define SVDL_CHUNK 8

TP_INLINE VT vsel(VI m, VT a, VT b) { return (VT)(((VI)a & m) | ((VI)b & ~m)); }
TP_INLINE VT vabs(VT x) { VT z = x - x; return vsel(x < z, -x, x); }
TP_INLINE VT vsqrt(VT x) {
#if ${vguard}
    return (VT)${lsqrt}((${lvec})x);
#else
    VT r; for (int l = 0; l < VLN; ++l) r[l] = TSQRT(x[l]); return r;
#endif
}
TP_INLINE int vany(VI m) { ${ielem} r = 0; for (int l = 0; l < VLN; ++l) r |= m[l]; return r != 0; }
/* ---------------------------------------------------------------- lane SVD, throughput form */
TP_INLINE VT ldot(const VT *x, const VT *y, int64_t p) {
    VT a0 = {0}, a1 = a0, a2 = a0, a3 = a0;
    int64_t i = 0;
    for (; i + 4 <= p; i += 4) {
        a0 += x[i] * y[i]; a1 += x[i + 1] * y[i + 1];
        a2 += x[i + 2] * y[i + 2]; a3 += x[i + 3] * y[i + 3];
    }
    for (; i < p; ++i) a0 += x[i] * y[i];
    return (a0 + a1) + (a2 + a3);
}

TP_INLINE void lrot(VT *x, VT *y, int64_t p, VT c, VT s) {
    TP_UNROLL
    for (int64_t i = 0; i < p; ++i) {
        VT a = x[i], b = y[i];
        x[i] = c * a - s * b;
        y[i] = s * a + c * b;
    }
}

/* Whether some lane of the comparison mask m is set. */
TP_INLINE int lany(VI m) {
#if ${vguard}
    return ${lmovemask}((${lmask})m) != 0;
#else
    return vany(m);
#endif
}

/* One pair per lane, from the squared norms al, be and the inner product g: svdl_act, the mask
   of the lanes that rotate (g^2 > tol2 al be, neither vector zero); svdl_angle, c and s of the
   rotation and tg, the norm update (al - tg, be + tg), with c = 1, s = tg = 0 in the other
   lanes (no square root when no lane rotates). */
TP_INLINE VI svdl_act(VT al, VT be, VT g, T tol2) {
    const VT zero = {0};
    return (al != zero) & (be != zero) & (g * g > tol2 * al * be);
}

TP_INLINE void svdl_angle(VI act, VT al, VT be, VT g, VT *c, VT *s, VT *tg) {
    const VT zero = {0}, one = zero + 1;
    if (!lany(act)) { *c = one; *s = zero; *tg = zero; return; }
    VT gg = vsel(act, g, zero);
    VT d = be - al;
    VT sgn = vsel(d >= zero, one, -one);
    /* the angle from d and g scaled by the power of two 2^-e, 2^e <= |al| + |be| < 2^(e+1)
       (exponent bits 2 bias - E: |d|, |2g| < 2): the squares below neither underflow (two
       vectors of norm 1e-10 give d^2 ~ 1e-40, subnormal in float32: c^2 + s^2 off by up to
       1e-2 in the rank-one tests) nor overflow; a bit mask and a subtraction, no division */
    const VI ebits = (VI)(zero + (T)INFINITY);
    VT sc = (VT)(2 * (VI)one - ((VI)vsel(act, vabs(al) + vabs(be), one) & ebits));
    VT dh = d * sc, gh = gg * sc;
    VT r = vsqrt(dh * dh + 4 * gh * gh);
    VT u = vabs(dh) + r;
    VT y = one / vsqrt(vsel(act, 2 * r * u, one));
    *c = vsel(act, u * y, one);
    *s = sgn * 2 * gh * y;
    *tg = sgn * 4 * gg * gh * r * y * y;
}

/* One round of np disjoint pairs (lp[t], lq[t]) taken SVDL_CHUNK at a time in three passes: the
   inner products, then every angle of the pairs where some lane rotates (independent
   square-root/division chains), then their rotations; the pairs are disjoint, so the chunks
   give the rotations of the whole round at once, and a chunk's 2 SVDL_CHUNK vectors stay in L1
   from its inner products to its rotations (at n = 32 a zmm group's W, 64 KiB, does not).
   Returns whether some lane rotated. */
TP_INLINE int svdl_round(VT *W, VT *V, int64_t p, int64_t q, int uv, const int64_t *lp,
                         const int64_t *lq, int64_t np, VT *nv, VT *cs, T tol2) {
    char fl[64];
    int any = 0;
    for (int64_t c0 = 0; c0 < np; c0 += SVDL_CHUNK) {
        const int64_t c1 = TP_MIN(np, c0 + SVDL_CHUNK);
        for (int64_t t = c0; t < c1; ++t)
            cs[3 * t + 2] = ldot(W + lp[t] * p, W + lq[t] * p, p);
        int some = 0;
        for (int64_t t = c0; t < c1; ++t) {
            const VT al = nv[lp[t]], be = nv[lq[t]], g = cs[3 * t + 2];
            VI act = svdl_act(al, be, g, tol2);
            fl[t] = (char)lany(act);
            if (!fl[t]) continue;
            some = 1;
            svdl_angle(act, al, be, g, cs + 3 * t, cs + 3 * t + 1, cs + 3 * t + 2);
        }
        if (!some) continue;
        any = 1;
        for (int64_t t = c0; t < c1; ++t) {
            if (!fl[t]) continue;
            const int64_t j = lp[t], kk = lq[t];
            const VT c = cs[3 * t], s = cs[3 * t + 1];
            lrot(W + j * p, W + kk * p, p, c, s);
            if (uv) lrot(V + j * q, V + kk * q, q, c, s);
            nv[j] -= cs[3 * t + 2];
            nv[kk] += cs[3 * t + 2];
        }
    }
    return any;
}

/* Both rotation rounds of a quartet on n elements of its four vectors x0..x3 (local indices
   0..3): (0, 2) by (c[0], s[0]) and (1, 3) by (c[1], s[1]), then (0, 3) by (c[2], s[2]) and
   (1, 2) by (c[3], s[3]); each element loaded and stored once. */
TP_INLINE void qrot(VT *x0, VT *x1, VT *x2, VT *x3, int64_t n, const VT *c, const VT *s) {
    const VT c0 = c[0], s0 = s[0], c1 = c[1], s1 = s[1], c2 = c[2], s2 = s[2], c3 = c[3], s3 = s[3];
    TP_UNROLL
    for (int64_t i = 0; i < n; ++i) {
        VT a0 = x0[i], a1 = x1[i], a2 = x2[i], a3 = x3[i];
        VT b0 = c0 * a0 - s0 * a2, b2 = s0 * a0 + c0 * a2;
        VT b1 = c1 * a1 - s1 * a3, b3 = s1 * a1 + c1 * a3;
        x0[i] = c2 * b0 - s2 * b3; x3[i] = s2 * b0 + c2 * b3;
        x1[i] = c3 * b1 - s3 * b2; x2[i] = s3 * b1 + c3 * b2;
    }
}

/* A quartet's two rounds, pairs (0, 2), (1, 3) then (0, 3), (1, 2) of its vectors (2a, 2a + 1,
   2b, 2b + 1): one pass for the six inner products, the first round's angles from them, the
   second round's inner products from the first round's rotation of the 4x4 Gram matrix (equal in
   exact arithmetic to the inner products of the rotated vectors; with no rotation in the first
   round, the same bits), then one pass applying both rounds. Returns whether some lane rotated. */
TP_INLINE int svdl_quartet(VT *W, VT *V, int64_t p, int64_t q, int uv, int64_t a, int64_t b,
                           VT *nv, T tol2) {
    VT *x0 = W + 2 * a * p, *x1 = x0 + p, *x2 = W + 2 * b * p, *x3 = x2 + p;
    VT g01 = {0}, g23 = g01, g02 = g01, g13 = g01, g03 = g01, g12 = g01;
    for (int64_t i = 0; i < p; ++i) {  /* six independent accumulator chains */
        VT a0 = x0[i], a1 = x1[i], a2 = x2[i], a3 = x3[i];
        g01 += a0 * a1; g23 += a2 * a3; g02 += a0 * a2; g13 += a1 * a3; g03 += a0 * a3; g12 += a1 * a2;
    }
    VT *n0 = nv + 2 * a, *n1 = n0 + 1, *n2 = nv + 2 * b, *n3 = n2 + 1;
    VT c[4], s[4], tg[4];
    VI m0 = svdl_act(*n0, *n2, g02, tol2), m1 = svdl_act(*n1, *n3, g13, tol2);
    svdl_angle(m0, *n0, *n2, g02, c, s, tg);
    svdl_angle(m1, *n1, *n3, g13, c + 1, s + 1, tg + 1);
    VT d0 = *n0 - tg[0], d2 = *n2 + tg[0], d1 = *n1 - tg[1], d3 = *n3 + tg[1];
    /* <w0', w3'> and <w1', w2'> after w0' = c0 w0 - s0 w2, w2' = s0 w0 + c0 w2 (1, 3 likewise) */
    VT f03 = c[0] * (c[1] * g03 + s[1] * g01) - s[0] * (c[1] * g23 + s[1] * g12);
    VT f12 = c[1] * (c[0] * g12 + s[0] * g01) - s[1] * (c[0] * g23 + s[0] * g03);
    VI m2 = svdl_act(d0, d3, f03, tol2), m3 = svdl_act(d1, d2, f12, tol2);
    svdl_angle(m2, d0, d3, f03, c + 2, s + 2, tg + 2);
    svdl_angle(m3, d1, d2, f12, c + 3, s + 3, tg + 3);
    if (!lany(m0 | m1 | m2 | m3)) return 0;
    *n0 = d0 - tg[2]; *n3 = d3 + tg[2]; *n1 = d1 - tg[3]; *n2 = d2 + tg[3];
    qrot(x0, x1, x2, x3, p, c, s);
    if (uv) {
        VT *v0 = V + 2 * a * q, *v2 = V + 2 * b * q;
        qrot(v0, v0 + q, v2, v2 + q, q, c, s);
    }
    return 1;
}

/* The Jacobi sweeps on the q vectors W (length p) of a lane group, rotating V (q x q) as well
   when uv. Pair order 1 (bp null): the round-robin rounds of pairs[] (h a round), each by
   svdl_round. Block order (bp: the m - 1 rounds of m / 2 block pairs of block_pairs, m = q / 2,
   q a multiple of 4): the round of the pairs (2X, 2X + 1), then each block round's quartets by
   svdl_quartet (two rounds per pass over their vectors: half the loads and stores of W).
   Every sweep repeats the same rounds, so any run of as many consecutive rounds (a block round
   counted as one) as a sweep holds tests each pair once: the sweeps stop as soon as such a run
   rotated nothing (every pair below threshold in the final state), often inside the sweep after
   the last rotation, not at the end of a whole check-only sweep. */
TP_INLINE void svdl_sweeps(VT *W, VT *V, int64_t p, int64_t q, int uv, const int32_t *pairs,
                           int64_t npairs, int64_t h, const int32_t *bp, VT *nv, VT *cs,
                           int64_t *lp, int64_t *lq) {
    const T tol2 = EPS * EPS * (T)p;
    const int64_t m = q / 2, nrounds = bp ? m : (npairs + h - 1) / h;
    int64_t quiet = 0;  /* rounds in a row (across sweeps) that rotated no pair */
    for (int sweep = 0; sweep < MAX_SWEEPS; ++sweep) {
        for (int64_t j = 0; j < q; ++j) nv[j] = ldot(W + j * p, W + j * p, p);
        if (bp) {
            if (quiet >= nrounds) return;
            for (int64_t x = 0; x < m; ++x) { lp[x] = 2 * x; lq[x] = 2 * x + 1; }
            if (svdl_round(W, V, p, q, uv, lp, lq, m, nv, cs, tol2)) quiet = 0; else ++quiet;
            for (int64_t k = 0; k < m - 1; ++k) {
                if (quiet >= nrounds) return;
                int any = 0;
                for (int64_t i = 0; i < m / 2; ++i)
                    any |= svdl_quartet(W, V, p, q, uv, bp[k * m + 2 * i], bp[k * m + 2 * i + 1], nv, tol2);
                if (any) quiet = 0; else ++quiet;
            }
            if (quiet >= nrounds) return;
            continue;
        }
        for (int64_t base = 0; base < npairs; base += h) {
            if (quiet >= nrounds) return;
            int64_t np = 0;
            for (int64_t t = base; t < base + h; ++t) {
                if (pairs[2 * t] < 0) continue;
                lp[np] = pairs[2 * t]; lq[np] = pairs[2 * t + 1]; ++np;
            }
            if (svdl_round(W, V, p, q, uv, lp, lq, np, nv, cs, tol2)) quiet = 0; else ++quiet;
        }
        if (quiet >= nrounds) return;
    }
}

/* Reorders the pairs inside each round of h (order 1) so a round starts with the pairs whose
   vectors the previous round touched last (descending recency of the older of the two, as a
   serpentine scan): the round's pairs are disjoint, so any order within it gives the same
   rotations bit for bit, and at n = 32 with zmm lanes (W 64 KiB > 48 KiB L1) the tail of one
   round is still in L1 when the next round begins. Two passes, so round 0 follows the last. */
static void svdl_recency_order(int32_t *pairs, int64_t npairs, int64_t h, int64_t q) {
    int64_t last[q + 1], key[h];
    int64_t tick = 0;
    for (int64_t j = 0; j <= q; ++j) last[j] = -1;
    for (int pass = 0; pass < 2; ++pass)
        for (int64_t base = 0; base < npairs; base += h) {
            int32_t *rp = pairs + 2 * base;
            for (int64_t t = 0; t < h; ++t)
                key[t] = rp[2 * t] < 0 ? -2 : TP_MIN(last[rp[2 * t]], last[rp[2 * t + 1]]);
            for (int64_t t = 1; t < h; ++t) {  /* insertion sort, descending key, stable */
                int64_t kx = key[t], i = t;
                int32_t a = rp[2 * t], b = rp[2 * t + 1];
                while (i > 0 && key[i - 1] < kx) {
                    key[i] = key[i - 1]; rp[2 * i] = rp[2 * i - 2]; rp[2 * i + 1] = rp[2 * i - 1]; --i;
                }
                key[i] = kx; rp[2 * i] = a; rp[2 * i + 1] = b;
            }
            for (int64_t t = 0; t < h; ++t)
                if (rp[2 * t] >= 0) { last[rp[2 * t]] = tick; last[rp[2 * t + 1]] = tick; ++tick; }
        }
}

/* V from the converged vectors instead of accumulated rotations: with X the p x q matrix whose
   columns are the initial vectors (X0, lane layout, column i at X0 + i p), X V = W and V
   orthogonal give row j of V (V's column j) = X^T w_j / sigma_j^2. Its error is about
   eps sqrt(p) sigma_max / sigma_j relative, so it is used only when every lane has sigma_min >
   kappa_c eps sqrt(p) sigma_max (returns 0 otherwise, V untouched). The rows are then permuted per lane into
   descending sigma (W's columns are not moved: lane l's order is left in perm[l q ...] for the caller) and orthonormalised by classical Gram-Schmidt
   in that order (once: V is orthogonal to within 1/32 by the condition, and a second pass
   changed nothing measurable): a vector is corrected only along those of larger sigma, so the reconstruction
   error stays ~ eps ||A|| (sigma_j times an error of eps sigma_max / sigma_j). */
TP_INLINE int svdl_fast_v(VT *W, VT *V, const VT *X0, int64_t p, int64_t q, const VT *nv,
                          VT *d, T *tmp, int64_t *perm, T kappa_c) {
    const VT zero = {0};
    VT mx = zero, mn = nv[0];
    for (int64_t j = 0; j < q; ++j) { mx = vsel(nv[j] > mx, nv[j], mx); mn = vsel(nv[j] < mn, nv[j], mn); }
    const T lim = kappa_c * EPS;
    if (vany(~(mn > mx * (lim * lim * (T)p)))) return 0;
    int64_t j0 = 0;
    for (; j0 + 2 <= q; j0 += 2) {  /* 2 rows x 4 columns of V per pass over p: 8 accumulators */
        const VT *w0 = W + j0 * p, *w1 = w0 + p;
        int64_t i0 = 0;
        for (; i0 + 4 <= q; i0 += 4) {
            const VT *x0 = X0 + i0 * p, *x1 = x0 + p, *x2 = x1 + p, *x3 = x2 + p;
            VT a00 = zero, a01 = zero, a02 = zero, a03 = zero, a10 = zero, a11 = zero, a12 = zero, a13 = zero;
            for (int64_t r = 0; r < p; ++r) {
                VT y0 = w0[r], y1 = w1[r];
                a00 += x0[r] * y0; a01 += x1[r] * y0; a02 += x2[r] * y0; a03 += x3[r] * y0;
                a10 += x0[r] * y1; a11 += x1[r] * y1; a12 += x2[r] * y1; a13 += x3[r] * y1;
            }
            VT *v0 = V + j0 * q + i0, *v1 = v0 + q;
            v0[0] = a00; v0[1] = a01; v0[2] = a02; v0[3] = a03;
            v1[0] = a10; v1[1] = a11; v1[2] = a12; v1[3] = a13;
        }
        for (; i0 < q; ++i0) {
            V[j0 * q + i0] = ldot(X0 + i0 * p, w0, p);
            V[(j0 + 1) * q + i0] = ldot(X0 + i0 * p, w1, p);
        }
    }
    for (; j0 < q; ++j0)
        for (int64_t i = 0; i < q; ++i) V[j0 * q + i] = ldot(X0 + i * p, W + j0 * p, p);
    for (int64_t l = 0; l < VLN; ++l, perm += q) {  /* lane l's order kept in perm[l q ...] */
        for (int64_t j = 0; j < q; ++j) perm[j] = j;
        for (int64_t j = 1; j < q; ++j) {
            int64_t x = perm[j], i = j;
            while (i > 0 && nv[perm[i - 1]][l] < nv[x][l]) { perm[i] = perm[i - 1]; --i; }
            perm[i] = x;
        }
        for (int64_t i = 0; i < q * q; ++i) tmp[i] = V[i][l];
        for (int64_t j = 0; j < q; ++j) for (int64_t i = 0; i < q; ++i) V[j * q + i][l] = tmp[perm[j] * q + i];
    }
    for (int64_t j = 0; j < q; ++j) {
        VT *v = V + j * q;
        for (int64_t i = 0; i < j; ++i) d[i] = ldot(V + i * q, v, q);
        int64_t r = 0;
        for (; r + 8 <= q; r += 8) {  /* eight independent accumulators along v */
            VT a0 = v[r], a1 = v[r + 1], a2 = v[r + 2], a3 = v[r + 3];
            VT a4 = v[r + 4], a5 = v[r + 5], a6 = v[r + 6], a7 = v[r + 7];
            for (int64_t i = 0; i < j; ++i) {
                const VT di = d[i], *vi = V + i * q + r;
                a0 -= di * vi[0]; a1 -= di * vi[1]; a2 -= di * vi[2]; a3 -= di * vi[3];
                a4 -= di * vi[4]; a5 -= di * vi[5]; a6 -= di * vi[6]; a7 -= di * vi[7];
            }
            v[r] = a0; v[r + 1] = a1; v[r + 2] = a2; v[r + 3] = a3;
            v[r + 4] = a4; v[r + 5] = a5; v[r + 6] = a6; v[r + 7] = a7;
        }
        for (; r < q; ++r) {
            VT acc = v[r];
            for (int64_t i = 0; i < j; ++i) acc -= d[i] * V[i * q + r];
            v[r] = acc;
        }
        VT inv = 1 / vsqrt(ldot(v, v, q));
        for (int64_t e = 0; e < q; ++e) v[e] *= inv;
    }
    return 1;
}

TP_INLINE int svdl_vec(const T *a, T *S, T *U, T *Vh, int64_t cnt, int64_t m, int64_t n, int uv,
                       int full, const int32_t *pairs, int64_t npairs, int64_t h,
                       const int32_t *bp, VT *W, VT *V,
                       VT *X0, VT *nv, VT *cs, int64_t *lp, int64_t *lq, T *Ws, T *Vs, T *nrm,
                       int64_t *perm, int64_t *lperm, T *Ub, T kappa_c) {
    const int trans = m < n;
    const int64_t p = trans ? n : m, q = trans ? m : n, k = q;
    const VT zero = {0}, one = zero + 1;
    for (int64_t l = 0; l < cnt; ++l) if (!all_finite(a + l * m * n, m * n)) return (int)l + 1;
    int ex[VLN], gr[VLN];
    VT sc = one;
    for (int64_t l = 0; l < cnt; ++l) {
        T x;
        gr[l] = svd_graded_input(a + l * m * n, m, n, &x);
        if (gr[l]) x = 0;
        ex[l] = TP_SCALE_EXP(x);
        sc[l] = ${ldexp}((T)1, -ex[l]);
    }
    /* lanes past cnt, and graded lanes (svd_graded_input: solved by svd_graded after the
       sweeps), hold the identity (converged at once, well conditioned) */
    for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
            VT x = zero + (i == j ? (T)1 : (T)0);
            for (int64_t l = 0; l < cnt; ++l) if (!gr[l]) x[l] = a[l * m * n + i * n + j];
            if (!trans) W[j * p + i] = x * sc; else W[i * p + j] = x * sc;
        }
    if (uv) memcpy(X0, W, sizeof(VT) * p * q);
    svdl_sweeps(W, V, p, q, 0, pairs, npairs, h, bp, nv, cs, lp, lq);
    int fast = uv && svdl_fast_v(W, V, X0, p, q, nv, cs, Ws, lperm, kappa_c);
    if (uv && !fast) {
        memcpy(W, X0, sizeof(VT) * p * q);
        for (int64_t j = 0; j < q * q; ++j) V[j] = zero;
        for (int64_t j = 0; j < q; ++j) V[j * q + j] = one;
        svdl_sweeps(W, V, p, q, 1, pairs, npairs, h, bp, nv, cs, lp, lq);
    }
    const int64_t usz = uv ? m * (full ? m : k) : 0, vsz = uv ? n * (full ? n : k) : 0;
    for (int64_t l = 0; l < cnt; ++l) {
        if (gr[l]) {
            svd_graded(a + l * m * n, S + l * k, U + l * usz, Vh + l * vsz, m, n, uv, full);
            continue;
        }
        if (fast)  /* W's columns in the lane's order of V's rows */
            for (int64_t j = 0; j < q; ++j) {
                const VT *w = W + lperm[l * q + j] * p;
                for (int64_t i = 0; i < p; ++i) Ws[j * p + i] = w[i][l];
            }
        else
            for (int64_t i = 0; i < q * p; ++i) Ws[i] = W[i][l];
        if (uv) for (int64_t i = 0; i < q * q; ++i) Vs[i] = V[i][l];
        svd_finish(Ws, Vs, nrm, perm, Ub, S + l * k, U + l * usz, Vh + l * vsz, m, n, uv, full, NULL);
        for (int64_t i = 0; i < k; ++i) S[l * k + i] = ${ldexp}(S[l * k + i], ex[l]);
    }
    return 0;
}

TP_EXPORT int tp_svd_lanes(const T *a, T *S, T *U, T *Vh, int64_t B, int64_t m, int64_t n,
                           int64_t uv, int64_t full, int64_t order, double kappa_c,
                           int64_t nthreads) {
    const int64_t p = TP_MAX(m, n), k = TP_MIN(m, n);
    const int64_t usz = uv ? m * (full ? m : k) : 0, vsz = uv ? n * (full ? n : k) : 0;
    const int64_t groups = (B + VLN - 1) / VLN;
    int64_t nt = (groups < 2 || B * p * k * k < 100000) ? 1 : nthreads;
    int64_t bad = INT64_MAX;
    #pragma omp parallel num_threads(nt) reduction(min:bad)
    {
        VT *W = (VT *)aligned_alloc(sizeof(VT), sizeof(VT) * (2 * p * k + k * k + 4 * k + 8));
        VT *V = W + p * k, *X0 = V + k * k, *nv = X0 + p * k, *cs = nv + k;
        T *Ws = (T *)malloc(sizeof(T) * (p * k + k * k + k + p * p + 8));
        T *Vs = Ws + p * k, *nrm = Vs + k * k, *Ub = nrm + k;
        int64_t *perm = (int64_t *)malloc(sizeof(int64_t) * ((3 + VLN) * k + 6));
        int64_t *lp = perm + k + 2, *lq = lp + k + 2, *lperm = lq + k + 2;
        int32_t *pairs = (int32_t *)malloc(sizeof(int32_t) * ((k + 2) * (k + 2) + 2 * k * k + 3 * k));
        /* order 3 (k a multiple of 4): the block order, the blocks' tournament in bp */
        const int blk = order == 3 && k % 4 == 0 && k >= 4;
        int32_t *bp = blk ? pairs + (k + 2) * (k + 2) : NULL;
        if (blk) block_pairs(bp, bp + k * k, bp + 2 * k * k, k / 2);
        /* the round-robin (or cyclic) pairs: not read in the block order */
        int64_t np = blk ? 0 : make_pairs(pairs, k, order ? 1 : 0);
        int64_t h = order ? (k + (k & 1)) / 2 : 1;
        if (!blk && order && ${reorder}) svdl_recency_order(pairs, np, h, k);
        int64_t chunk = TP_MAX(1, groups / (nt * 16));
        #pragma omp for schedule(dynamic, chunk)
        for (int64_t gi = 0; gi < groups; ++gi) {
            int64_t b0 = gi * VLN, cnt = TP_MIN(VLN, B - b0);
            const T *src = a + b0 * m * n;
            T *so = S + b0 * k, *uo = U + b0 * usz, *vo = Vh + b0 * vsz;
            int st;
#define SVDL(M, N) svdl_vec(src, so, uo, vo, cnt, M, N, (int)uv, (int)full, pairs, np, h, bp, W, V, X0, nv, cs, lp, lq, Ws, Vs, nrm, perm, lperm, Ub, (T)kappa_c)
            if (m == 16 && n == 16) st = SVDL(16, 16);
            else if (m == 32 && n == 32) st = SVDL(32, 32);
            else st = SVDL(m, n);
#undef SVDL
            if (st && b0 + st - 1 < bad) bad = b0 + st - 1;
        }
        free(W); free(Ws); free(perm); free(pairs);
    }
    return bad == INT64_MAX ? 0 : (int)TP_MIN(bad + 1, 2147483647);
}
"""


def pair_order(k: int) -> int:
    """The pair order ``tp_svd_lanes`` is called with for min(m, n) = ``k``: 3 (the block order)
    from :data:`BLOCK_FROM` when ``k`` is a multiple of 4, else 1 (round-robin)."""
    return 3 if k >= BLOCK_FROM and k % 4 == 0 else 1


@functools.cache
def library(
    dtype: torch.dtype,
    isa: str,
    max_sweeps: int = MAX_SWEEPS,
    vbytes: int | None = None,
    reorder: bool = True,
) -> Kernel:
    """Build (or load from the disk cache) ``tp_svd_lanes`` for one dtype and ISA.

    The source follows the shared helpers at the head of :mod:`torchport.linalg.kernels`' source
    (``make_pairs``, ``all_finite``, ``svd_finish``: everything before its SVD section), rendered
    with the same parameters; the call takes ``kappa_c`` (see :data:`KAPPA_C`) before
    ``nthreads``. ``vbytes``: bytes per lane vector (32 or 64; None = :data:`WIDE_LANES`' choice
    for the dtype on this ISA). ``reorder``: reorder the pairs within each round for cache reuse
    (``svdl_recency_order``; the results are the same bits either way).
    """
    from torchport.linalg import eigh_block, kernels  # kernels imports this module for its routing

    cut = kernels._SOURCE.index(_HELPERS_END)
    helpers = kernels._SOURCE[:cut]
    b0, b1 = (eigh_block._SOURCE.index(x) for x in _BLOCK_PAIRS_SPAN)
    helpers += eigh_block._SOURCE[b0:b1]
    is64 = dtype == torch.float64
    vbytes = vbytes or lane_bytes(isa, WIDE_LANES[dtype])
    src = native.render(
        "#include <stdlib.h>\n#include <string.h>\n" + helpers + _SOURCE,
        **lane_params(dtype, max_sweeps, vbytes),
        reorder=str(int(reorder)),
    )
    name = f"linalg_svdl_{'f64' if is64 else 'f32'}_{isa}_v{vbytes}{'' if reorder else '_r0'}"
    lib = native.build(src, name=name, isa=isa)
    return launcher(
        lib, "tp_svd_lanes", dtype, "A S:r U Vh", "B m n uv full order kappa_c:f nthreads"
    )
