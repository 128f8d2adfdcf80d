"""Plain-torch references for the native kernels: the same algorithms, batched, on any device.

Each function runs the algorithm of the matching kernel in :mod:`torchport.linalg.kernels` step by
step with torch ops vectorised over the batch (a Python loop over pairs/columns, never over batch
elements), so they are slow but obviously follow the description there and run on any device.
The native kernels must agree with them to working precision (tests/test_linalg.py):

- ``svd_reference``: one-sided Jacobi (cyclic order for k ≤ 4, round-robin above, as the
  kernel), tol = eps·sqrt(max(m, n)); descending σ;
  numerically null vectors (σ ≤ σ_max·p·eps) completed by Gram-Schmidt.
- ``svd_lanes_reference``: the same sweeps, then the side that the lane kernel of
  :mod:`torchport.linalg.svd_lanes` does not accumulate recovered from the converged vectors
  (Xᵀ û_j / σ_j, Gram-Schmidt in descending σ) where σ_min > κ_c·eps·sqrt(p)·σ_max.
- ``eigh_reference``: two-sided Jacobi (cyclic, round-robin as the lane kernel, or the block
  order of ``eigh_block``) with threshold eps·max(sqrt|a_pp a_qq|, 0.1‖A‖_F).
- ``eigh_tridiagonal_reference``: Householder tridiagonalization, then implicit QL with
  Wilkinson shifts (tql2/dsteqr), e_j negligible when |e_j| ≤ eps·(|d_j| + |d_j+1|). The
  one-matrix kernel reduces from the last row up (dsytrd 'U'), and for eigenvalues only runs
  the same sweeps in root-free form on e² (dsterf): equal in exact arithmetic.
  The lane kernel (``eigh_tridiag``) takes |e| ≤ eps·‖T‖ as negligible instead (dsteqr's
  normwise test), so its iterates can differ from the reference's in the last bits.
- ``qr_reference``: Householder with LAPACK's sign convention (complex: zgeqrf's, real R
  diagonal; the kernels of :mod:`torchport.linalg.complex_factor`).
- ``cholesky_reference``: Cholesky–Banachiewicz with ``info`` = first failing leading minor
  (complex: A = L Lᴴ, the diagonal's imaginary part ignored).
- ``complex_svd_reference``, ``complex_eigh_reference``: the complex Jacobi kernels of
  :mod:`torchport.linalg.complex_jacobi` (cyclic order, phase-carrying unitary rotations).
"""

from __future__ import annotations

import math

import torch

MAX_SWEEPS = 60


def _eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


def _rotation(zeta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Smaller root t of t² + 2ζt − 1 = 0, and c = 1/sqrt(1+t²), s = c·t."""
    sign = torch.where(zeta >= 0, 1.0, -1.0).to(zeta.dtype)
    big = zeta.abs() > 1e15
    safe = torch.where(big, torch.ones_like(zeta), zeta)
    t = torch.where(big, 0.5 / zeta, sign / (safe.abs() + torch.sqrt(1 + safe * safe)))
    c = 1 / torch.sqrt(1 + t * t)
    return t, c, c * t


def pairs_for(q: int, order: int) -> list[tuple[int, int]]:
    """Pairs of one sweep: cyclic row order (0), the round-robin tournament (1, 2) of the
    kernels, or the block order (3) of :mod:`torchport.linalg.eigh_block`."""
    if order == 0 or q < 2:
        return [(j, k) for j in range(q) for k in range(j + 1, q)]
    if order == 3:
        return _block_pairs(q)
    r = q + (q & 1)
    out = []
    for rnd in range(r - 1):
        for i in range(r // 2):
            a = 0 if i == 0 else 1 + (rnd + i - 1) % (r - 1)
            b = 1 + (rnd + r - 2 - i) % (r - 1)
            if a < q and b < q:
                out.append((min(a, b), max(a, b)))
    return out


def _block_pairs(q: int) -> list[tuple[int, int]]:
    """The block order: r = q rounded up to a multiple of 4 indices in m = r/2 blocks {2X, 2X+1};
    first the pair inside each block, then for each round of the blocks' tournament (for m a
    power of two from 4 block x meets x ^ s in the round of s, s in the order of
    :func:`_xor_rounds`, else the circle method with block m-1 fixed) each quartet (2a, 2a+1, 2b, 2b+1), a < b, takes the
    pairs (2a, 2b), (2a+1, 2b+1) and then (2a, 2b+1), (2a+1, 2b). Pairs touching a padding
    index (>= q) are left out: its row and column are zero, so the kernel never rotates them."""
    r = (q + 3) // 4 * 4
    m = r // 2
    xor = m >= 4 and m & (m - 1) == 0
    out = [(2 * x, 2 * x + 1) for x in range(m)]
    xs = _xor_rounds(m) if xor else []
    for k in range(m - 1):
        if xor:  # block x meets x ^ s in the round of s
            quartets = [(x, x ^ xs[k]) for x in range(m) if x < x ^ xs[k]]
        else:
            quartets = []
            for i in range(m // 2):
                a = m - 1 if i == 0 else (k + i) % (m - 1)
                b = (k + m - 1 - i) % (m - 1)
                quartets.append((min(a, b), max(a, b)))
        for lp, lq in (((0, 2), (1, 3)), ((0, 3), (1, 2))):
            for a, b in quartets:
                g = (2 * a, 2 * a + 1, 2 * b, 2 * b + 1)
                out += [(g[lp[0]], g[lp[1]]), (g[lq[0]], g[lq[1]])]
    return [(p, q_) for p, q_ in out if q_ < q]


def _xor_rounds(m: int) -> list[int]:
    """The XOR tournament's round order of ``eigh_block`` (its ``block_pairs``): s = 1 .. m-1
    taken greedily in groups closed under XOR, (a, b, a ^ b) with a the smallest left and b the
    smallest partner whose a ^ b is also left, else (a, b), else (a); above m = 64 consecutive
    pairs. The order only decides which rounds share a pass over V in the kernel."""
    if m > 64:
        return list(range(1, m))
    used: set[int] = set()
    out: list[int] = []
    for a in range(1, m):
        if a in used:
            continue
        left = [x for x in range(a + 1, m) if x not in used]
        grp = next(([a, x, a ^ x] for x in left if a ^ x not in used), [a, *left[:1]])
        used.update(grp)
        out += grp
    return out


def _complete_basis(ub: torch.Tensor, good: torch.Tensor, want: int) -> torch.Tensor:
    """Rows of ``ub`` (B, ≥want, p) beyond the ``good`` (B,) leading ones, replaced by an
    orthonormal completion: Gram-Schmidt (twice, inner product uᴴv, so real or complex ``ub``) of
    the unit vector least represented so far."""
    bsz, _, p = ub.shape
    out = torch.zeros(bsz, want, p, dtype=ub.dtype, device=ub.device)
    out[:, : min(want, ub.shape[1])] = ub[:, :want]
    eye = torch.eye(p, dtype=ub.dtype, device=ub.device)
    tiny = torch.finfo(ub.real.dtype).tiny
    for j in range(want):
        redo = good <= j
        if not bool(redo.any()):
            continue
        prev = out[:, :j]  # (B, j, p)
        weight = (prev * prev.conj()).real.sum(1)  # (B, p): how much of e_i the basis holds
        best = weight.argmin(-1)
        v = eye[best]
        for _ in range(2):
            v = v - ((prev.conj() @ v.unsqueeze(-1)) * prev).sum(1)
        v = v / torch.linalg.vector_norm(v, dim=-1, keepdim=True).clamp_min(tiny)
        out[:, j] = torch.where(redo.unsqueeze(-1), v, out[:, j])
    return out


def svd_reference(
    a: torch.Tensor,
    full_matrices: bool = False,
    compute_uv: bool = True,
    order: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One-sided Jacobi SVD of (B, m, n) ``a``: (U, S, Vh) with S descending.

    ``order``: 0 cyclic, 1 round-robin, 3 the block order (:func:`pairs_for`), None = the
    kernel's default for this size. As the kernel, each matrix is first scaled by the power of
    two that brings its largest entry into [1, 2) (:func:`_pow2_scale`; exact, S scaled back):
    unscaled, the squared norms underflowed (float32 entries ~1e-30: S = 0) or overflowed.
    """
    bsz, m, n = a.shape
    trans = m < n
    p, q = (n, m) if trans else (m, n)
    sc = _pow2_scale(a.reshape(bsz, m * n))[:, None, None]
    w = (a * sc if trans else (a * sc).mT).clone()  # (B, q, p): the vectors being orthogonalised
    v = torch.eye(q, dtype=a.dtype, device=a.device).expand(bsz, q, q).clone()
    tol = _eps(a.dtype) * p**0.5
    if order is None:
        order = int(q >= 5)
    pairs = pairs_for(q, order)
    for _ in range(MAX_SWEEPS):
        nrm = (w * w).sum(-1)
        rotated = torch.zeros(bsz, dtype=torch.bool, device=a.device)
        for j, k in pairs:
            al, be = nrm[:, j].clone(), nrm[:, k].clone()
            g = (w[:, j] * w[:, k]).sum(-1)
            act = (al > 0) & (be > 0) & (g.abs() > tol * al.sqrt() * be.sqrt())
            rotated |= act
            zeta = (be - al) / (2 * torch.where(act, g, torch.ones_like(g)))
            t, c, s = _rotation(zeta)
            t, c, s = (torch.where(act, x, y) for x, y in ((t, 0.0), (c, 1.0), (s, 0.0)))
            wj, wk = w[:, j].clone(), w[:, k].clone()
            w[:, j] = c[:, None] * wj - s[:, None] * wk
            w[:, k] = s[:, None] * wj + c[:, None] * wk
            vj, vk = v[:, j].clone(), v[:, k].clone()
            v[:, j] = c[:, None] * vj - s[:, None] * vk
            v[:, k] = s[:, None] * vj + c[:, None] * vk
            # as the kernel: a running norm that lost half its digits or more to cancellation
            # (<= sqrt(eps) times the pair's smaller one) is recomputed
            lo = _eps(a.dtype) ** 0.5 * torch.minimum(al, be)
            nj, nk = al - t * g, be + t * g
            nrm[:, j] = torch.where(nj > lo, nj, (w[:, j] * w[:, j]).sum(-1))
            nrm[:, k] = torch.where(nk > lo, nk, (w[:, k] * w[:, k]).sum(-1))
        if not bool(rotated.any()):
            break
    sig = w.norm(dim=-1)
    s_sorted, perm = torch.sort(sig, dim=-1, descending=True, stable=True)
    s_out = s_sorted / sc[:, :, 0]
    if not compute_uv:
        return a.new_empty(0), s_out, a.new_empty(0)
    w = torch.gather(w, 1, perm.unsqueeze(-1).expand(bsz, q, p))
    v = torch.gather(v, 1, perm.unsqueeze(-1).expand(bsz, q, q))
    thresh = s_sorted[:, :1] * p * _eps(a.dtype)
    ok = (s_sorted > thresh) & (s_sorted > 0)
    good = ok.to(torch.int64).cumprod(-1).sum(-1)  # leading run of well-defined vectors
    ub = w / torch.where(ok, s_sorted, torch.ones_like(s_sorted)).unsqueeze(-1)
    ub = _complete_basis(ub, good, p if full_matrices else q)
    if not trans:
        return ub.mT, s_out, v
    return v.mT, s_out, ub


def svd_lanes_reference(
    a: torch.Tensor,
    full_matrices: bool = False,
    compute_uv: bool = True,
    kappa_c: float = 32.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The algorithm of ``tp_svd_lanes`` on (B, m, n) ``a``: (U, S, Vh), S descending.

    The sweeps are :func:`svd_reference`'s in the kernel's order (``svd_lanes.pair_order``:
    round-robin, or the block order for k a multiple of 4 from ``svd_lanes.BLOCK_FROM``). With X the p × q matrix of
    the vectors being orthogonalised (A, or Aᵀ when m < n) and û_j the converged unit vectors, the
    other side's vector j is Xᵀ û_j / σ_j, orthonormalised by one classical Gram-Schmidt pass in
    descending σ; used where σ_min > ``kappa_c``·eps·sqrt(p)·σ_max (per matrix here, per lane
    group in the kernel), the accumulated rotations elsewhere.
    """
    from torchport.linalg.svd_lanes import pair_order

    u, s, vh = svd_reference(a, full_matrices, compute_uv, order=pair_order(min(a.shape[-2:])))
    bsz, m, n = a.shape
    q, p = min(m, n), max(m, n)
    if not compute_uv or q == 0 or bsz == 0:
        return u, s, vh
    trans = m < n
    uh = vh[:, :q, :] if trans else u[:, :, :q].mT  # (B, q, p): the unit vectors, as rows
    x = a.mT if trans else a  # (B, p, q)
    other = (uh @ x) / torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(-1)  # (B, q, q)
    for j in range(q):
        v = other[:, j]
        if j:
            prev = other[:, :j]
            v = v - ((prev @ v.unsqueeze(-1)) * prev).sum(1)
        other[:, j] = v / v.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(a.dtype).tiny)
    ok = (s[:, -1] > kappa_c * _eps(a.dtype) * p**0.5 * s[:, 0]).view(bsz, 1, 1)
    if trans:
        return torch.where(ok, other.mT, u), s, vh
    return u, s, torch.where(ok, other, vh)


def eigh_reference(
    a: torch.Tensor, upper: bool = False, compute_v: bool = True, order: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-sided Jacobi eigendecomposition of (B, n, n) symmetric ``a``: (L asc, Q).

    ``order``: 0 cyclic, 1 or 2 round-robin (the lane kernel's orders; its order 2 applies the
    same rotations with each round's row and column updates fused), 3 the block order of
    :mod:`torchport.linalg.eigh_block` (which applies these rotations in scaled form, equal in
    exact arithmetic). A round's pairs are disjoint, so applying them one after another here
    equals the kernel's computing every angle of the round first.
    """
    bsz, n, _ = a.shape
    tri = a.triu() if upper else a.tril()
    x = tri + tri.mT - torch.diag_embed(tri.diagonal(0, -2, -1))
    frob = x.flatten(1).norm(dim=-1)
    vt = torch.eye(n, dtype=a.dtype, device=a.device).expand(bsz, n, n).clone()
    eps = _eps(a.dtype)
    pairs = pairs_for(n, order)
    for _ in range(MAX_SWEEPS):
        rotated = torch.zeros(bsz, dtype=torch.bool, device=a.device)
        for p, q in pairs:
            apq, app, aqq = (x[:, p, q].clone(), x[:, p, p].clone(), x[:, q, q].clone())
            scale = torch.maximum(app.abs().sqrt() * aqq.abs().sqrt(), 0.1 * frob)
            act = (apq != 0) & (apq.abs() > eps * scale)
            rotated |= act
            theta = (aqq - app) / (2 * torch.where(act, apq, torch.ones_like(apq)))
            t, c, s = _rotation(theta)
            t, c, s = (torch.where(act, u, w) for u, w in ((t, 0.0), (c, 1.0), (s, 0.0)))
            rp, rq = x[:, p].clone(), x[:, q].clone()
            x[:, p] = c[:, None] * rp - s[:, None] * rq
            x[:, q] = s[:, None] * rp + c[:, None] * rq
            x[:, :, p] = x[:, p].clone()
            x[:, :, q] = x[:, q].clone()
            x[:, p, p] = app - t * apq
            x[:, q, q] = aqq + t * apq
            x[:, p, q] = torch.where(act, 0.0, apq)
            x[:, q, p] = x[:, p, q]
            vp, vq = vt[:, p].clone(), vt[:, q].clone()
            vt[:, p] = c[:, None] * vp - s[:, None] * vq
            vt[:, q] = s[:, None] * vp + c[:, None] * vq
        if not bool(rotated.any()):
            break
    lam, perm = torch.sort(x.diagonal(0, -2, -1), dim=-1, stable=True)
    if not compute_v:
        return lam, a.new_empty(0)
    vt = torch.gather(vt, 1, perm.unsqueeze(-1).expand(bsz, n, n))
    return lam, vt.mT


def _pow2_scale(x: torch.Tensor) -> torch.Tensor:
    """Per row of ``x`` (B, len), real or complex: the power of two 2^-e that brings its largest
    |Re|, |Im| into [1, 2) (1 for a zero row; e clamped at the smallest normal exponent, as the
    kernels' TP_SCALE_EXP). The reflectors form their norms in this scale, as LAPACK's dnrm2: in
    the matrix's one scale a column far below its largest entry has subnormal squares."""
    r = torch.view_as_real(x).flatten(-2) if x.is_complex() else x
    mx = r.abs().amax(-1) if r.shape[-1] else r.new_zeros(r.shape[:-1])
    fi = torch.finfo(r.dtype)
    e = torch.frexp(mx)[1] - 1  # mx = m 2^(e + 1), m in [0.5, 1)
    e = torch.where(mx > 0, e.clamp_min(math.frexp(fi.tiny)[1] - 1), 0)
    return torch.ldexp(torch.ones_like(mx), -e)


def _reflector(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Householder reflector of each row of ``x`` (B, len) in LAPACK's convention (dlarfg/zlarfg):
    ``v`` (v[0] = 1), ``tau`` and the value ``x`` maps to, beta = -sign(Re x0)·‖x‖ (real); a row
    whose tail is zero and whose x0 is real gets tau = 0 and keeps x0. H = I − tau v vᴴ.
    Computed on the row scaled by :func:`_pow2_scale` (tau and v do not depend on it; beta is
    scaled back)."""
    cs = _pow2_scale(x)
    x = x * cs.to(x.dtype)[:, None]
    alpha = x[:, 0]
    tail = x[:, 1:]
    xn2 = (tail * tail.conj()).real.sum(-1)
    ar = alpha.real
    act = xn2 != 0
    if x.is_complex():
        act = act | (alpha.imag != 0)
    beta = torch.sqrt((alpha * alpha.conj()).real + xn2)
    # complex: zlarfg's -sign(Re x0) with both zeros counted positive (+0 and -0 -> -‖x‖), as
    # torch.linalg.qr gives it; real: the real kernel's x0 > 0 (it differs from dlarfg only at 0)
    flip = ar >= 0 if x.is_complex() else ar > 0
    beta = torch.where(flip, -beta, beta)
    safe = torch.where(act, beta, torch.ones_like(beta))
    tau = torch.where(act, (beta - alpha) / safe, torch.zeros_like(alpha))
    denom = torch.where(act, alpha - beta, torch.ones_like(alpha))
    scale = torch.where(act, 1 / denom, torch.zeros_like(alpha))
    v = torch.cat([torch.ones_like(alpha)[:, None], tail * scale[:, None]], dim=1)
    return v, tau, torch.where(act, beta.to(alpha.dtype), alpha) / cs.to(x.dtype)


def qr_reference(a: torch.Tensor, mode: str = "reduced") -> tuple[torch.Tensor, torch.Tensor]:
    """Householder QR of (B, m, n) ``a`` (LAPACK sign convention): (Q, R) for ``mode``. Complex
    ``a``: R = H_kᴴ…H_1ᴴ A (real diagonal, as zgeqrf), Q = H_1…H_k."""
    bsz, m, n = a.shape
    k = min(m, n)
    r = a.clone()
    vs: list[torch.Tensor] = []
    taus: list[torch.Tensor] = []
    for j in range(k):
        v, tau, sd = _reflector(r[:, j:, j].clone())
        w = tau.conj()[:, None] * (v.conj().unsqueeze(1) @ r[:, j:, j:]).squeeze(1)  # (B, n - j)
        r[:, j:, j:] -= v.unsqueeze(-1) * w.unsqueeze(1)
        r[:, j, j] = sd
        vs.append(v)
        taus.append(tau)
    rows = m if mode == "complete" else k
    rr = r[:, :rows].triu()
    if mode == "r":
        return a.new_empty(0), rr
    qc = m if mode == "complete" else k
    q = torch.eye(m, qc, dtype=a.dtype, device=a.device).expand(bsz, m, qc).clone()
    for j in range(k - 1, -1, -1):
        v, tau = vs[j], taus[j]
        w = tau[:, None] * (v.conj().unsqueeze(1) @ q[:, j:, :]).squeeze(1)
        q[:, j:, :] -= v.unsqueeze(-1) * w.unsqueeze(1)
    return q, rr


def cholesky_reference(a: torch.Tensor, upper: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Cholesky–Banachiewicz of (B, n, n) ``a``: (factor, int32 info); failed matrices are zero.
    Complex ``a``: A = L Lᴴ from the lower triangle (the upper one conjugated when ``upper``,
    giving U = Lᴴ), the diagonal's imaginary part ignored."""
    bsz, n, _ = a.shape
    src = a.mH if upper else a
    lw = torch.zeros_like(a)
    info = torch.zeros(bsz, dtype=torch.int32, device=a.device)
    for i in range(n):
        for j in range(i + 1):
            s = src[:, i, j] - (lw[:, i, :j] * lw[:, j, :j].conj()).sum(-1)
            if j < i:
                lw[:, i, j] = s / lw[:, j, j]
            else:
                s = s.real
                fail = ~(s > 0) & (info == 0)
                info = torch.where(fail, i + 1, info).to(torch.int32)
                lw[:, i, i] = torch.sqrt(torch.where(s > 0, s, torch.ones_like(s)))
    lw = torch.where((info == 0)[:, None, None], lw, torch.zeros_like(lw))
    return (lw.mH if upper else lw), info


def cholesky_blocked_reference(
    a: torch.Tensor, upper: bool = False, nb: int = 16
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-looking blocked Cholesky of (B, n, n) ``a`` in panels of ``nb`` columns, the steps of
    :mod:`torchport.linalg.blocked`: diagonal block, panel solve ``L21 = A21 L11⁻ᵀ``, trailing
    update ``A22 -= L21 L21ᵀ``. Returns (factor, int32 info); failed matrices are zero."""
    bsz, n, _ = a.shape
    w = (a.mT if upper else a).tril().clone()
    info = torch.zeros(bsz, dtype=torch.int32, device=a.device)
    for k0 in range(0, n, nb):
        k1 = min(n, k0 + nb)
        for j in range(k0, k1):  # diagonal block, column by column (reciprocal of the pivot)
            s = w[:, j, j] - (w[:, j, k0:j] * w[:, j, k0:j]).sum(-1)
            fail = ~(s > 0) & (info == 0)
            info = torch.where(fail, j + 1, info).to(torch.int32)
            d = torch.sqrt(torch.where(s > 0, s, torch.ones_like(s)))
            w[:, j, j] = d
            x = w[:, j + 1 : k1, j] - (w[:, j + 1 : k1, k0:j] * w[:, j : j + 1, k0:j]).sum(-1)
            w[:, j + 1 : k1, j] = x * (1 / d)[:, None]
        if k1 == n:
            break
        l11 = w[:, k0:k1, k0:k1]
        inv = 1 / l11.diagonal(0, -2, -1)
        panel = w[:, k1:, k0:k1].clone()  # (B, m, kb): forward substitution along its columns
        for j in range(k1 - k0):
            x = panel[:, :, j] - (panel[:, :, :j] * l11[:, j : j + 1, :j]).sum(-1)
            panel[:, :, j] = x * inv[:, j : j + 1]
        w[:, k1:, k0:k1] = panel
        w[:, k1:, k1:] -= (panel @ panel.mT).tril()
    w = torch.where((info == 0)[:, None, None], w.tril(), torch.zeros_like(w))
    return (w.mT if upper else w), info


def _tridiagonalize(
    x: torch.Tensor, compute_v: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Householder reduction of symmetric (B, n, n) ``x`` to tridiagonal T = Zᵀ x Z: (d, e, Z),
    d the diagonal, e (B, n) the subdiagonal (e[j] couples d[j] and d[j+1], e[n-1] = 0), Z the
    product H_0 H_1 … H_{n-3} (identity without ``compute_v``). Step k zeroes x[k+2:, k] with
    H_k = I - τ v vᵀ on rows/columns k+1…, v[0] = 1, β = -sign(α)‖x[k+1:, k]‖ (LAPACK's sign);
    a column already zero below the subdiagonal gets τ = 0."""
    bsz, n, _ = x.shape
    a = x.clone()
    z = torch.eye(n, dtype=x.dtype, device=x.device).expand(bsz, n, n).clone()
    for k in range(n - 2):
        v, tau, sd = _reflector(a[:, k + 1 :, k])
        sub = a[:, k + 1 :, k + 1 :]
        p = tau[:, None] * (sub @ v.unsqueeze(-1)).squeeze(-1)  # τ A v
        w = p - (0.5 * tau * (p * v).sum(-1))[:, None] * v  # H A H = A - v wᵀ - w vᵀ
        a[:, k + 1 :, k + 1 :] = (
            sub - v.unsqueeze(-1) * w.unsqueeze(1) - w.unsqueeze(-1) * v.unsqueeze(1)
        )
        a[:, k + 1, k] = sd
        a[:, k, k + 1] = sd
        a[:, k + 2 :, k] = 0
        a[:, k, k + 2 :] = 0
        if compute_v:  # Z ← Z H_k
            zk = z[:, :, k + 1 :]
            zv = (zk @ v.unsqueeze(-1)).squeeze(-1)  # (B, n)
            z[:, :, k + 1 :] = zk - (tau[:, None] * zv).unsqueeze(-1) * v.unsqueeze(1)
    d = a.diagonal(0, -2, -1).clone()
    e = torch.zeros_like(d)
    if n > 1:
        e[:, : n - 1] = a.diagonal(-1, -2, -1)
    return d, e, z


def _negligible(d: torch.Tensor, e: torch.Tensor, eps: float) -> torch.Tensor:
    """(B, n) mask: e[j] is negligible, |e_j| <= eps·(|d_j| + |d_j+1|) (always for j = n-1)."""
    n = d.shape[-1]
    dn = torch.cat([d[:, 1:], torch.zeros_like(d[:, :1])], dim=1)
    small = e.abs() <= eps * (d.abs() + dn.abs())
    small[:, n - 1] = True
    return small


def eigh_tridiagonal_reference(
    a: torch.Tensor, upper: bool = False, compute_v: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Householder tridiagonalization + implicit QL with Wilkinson shifts of (B, n, n)
    symmetric ``a`` (its ``upper`` or lower triangle): (L asc, Q), as :func:`eigh_reference`.

    After :func:`_tridiagonalize`, eigenvalue l = 0 … n-1 in turn: let m ≥ l be the first index
    whose e[m] is negligible (:func:`_negligible`); while m > l, one implicit QL sweep on the
    block l…m with the shift of d[l]'s 2×2 block (EISPACK tql2 / LAPACK dsteqr's QL branch):
    g = (d[l+1] - d[l]) / (2 e[l]), r = hypot(g, 1), g = d[m] - d[l] + e[l] / (g ± r), then for
    i = m-1 down to l the Givens rotation (c, s) = (g, f) / hypot(f, g), f = s·e[i],
    applied to T and to Z's columns i, i+1. The sweeps run batched: a matrix whose m = l (or
    outside its l…m window) gets the identity rotation c = 1, s = 0. A rotation with
    hypot(f, g) = 0 (underflow) deflates at i+1 and ends that matrix's sweep, as in tql2.
    At most 30 sweeps per eigenvalue. Eigenvalues sorted ascending with their vectors.
    All of it on the matrix scaled, as the kernels, by the power of two that brings its largest
    entry into [1, 2) (:func:`_pow2_scale`; the eigenvalues scaled back): unscaled, a rank-
    deficient matrix scaled by 1e-35 (float32) or 1e-300 (float64) had subnormal noise
    eigenvalues whose relative test |e_j| <= eps (|d_j| + |d_j+1|) never held, and the 30-sweep
    cap left eigenvalues off by 0.1-0.4 ‖A‖.
    """
    tri = a.triu() if upper else a.tril()
    x = tri + tri.mT - torch.diag_embed(tri.diagonal(0, -2, -1))
    sc = _pow2_scale(x.flatten(1))
    d, e, z = _tridiagonalize(x * sc[:, None, None], compute_v)
    lam, vec = _tridiagonal_ql(d, e, z, compute_v)
    return lam / sc[:, None], vec


def _tridiagonal_ql(
    d: torch.Tensor, e: torch.Tensor, z: torch.Tensor, compute_v: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The QL sweeps of :func:`eigh_tridiagonal_reference` on real (B, n) ``d``, ``e``, each
    rotation applied to columns i, i+1 of ``z`` (B, n, n; real or complex: the rotation is real):
    (L ascending, z's columns in L's order), or (L, empty) without ``compute_v``."""
    bsz, n = d.shape
    eps = _eps(d.dtype)
    idx = torch.arange(n, device=d.device)
    one = torch.ones(bsz, dtype=d.dtype, device=d.device)
    zero = torch.zeros_like(one)
    for lo in range(n - 1):
        for _ in range(30):
            small = _negligible(d, e, eps) & (idx >= lo)
            m = small.to(torch.int8).argmax(-1)  # first negligible e at or after lo
            run = m > lo
            if not bool(run.any()):
                break
            el = torch.where(run, e[:, lo], one)
            g = (d[:, lo + 1] - d[:, lo]) / (2 * el)
            r = torch.hypot(g, one)
            g = d.gather(1, m[:, None]).squeeze(1) - d[:, lo] + el / (g + torch.copysign(r, g))
            s, c, p = one.clone(), one.clone(), zero.clone()
            live = run.clone()
            for i in range(n - 2, lo - 1, -1):
                act = live & (i < m)
                f = s * e[:, i]
                b = c * e[:, i]
                r = torch.hypot(f, g)
                e[:, i + 1] = torch.where(act, r, e[:, i + 1])
                under = act & (r == 0)
                d[:, i + 1] = torch.where(under, d[:, i + 1] - p, d[:, i + 1])
                e.scatter_(
                    1,
                    m[:, None],
                    torch.where(under, 0.0, e.gather(1, m[:, None]).squeeze(1))[:, None],
                )
                act = act & ~under
                live = live & ~under
                # c, s from (f, g) / max(|f|, |g|): r may be subnormal (a rank-deficient
                # matrix's noise block), and f / r, g / r with its few bits are not a rotation
                mfg = torch.where(act, torch.maximum(f.abs(), g.abs()), one)
                rs = torch.hypot(f / mfg, g / mfg)
                s = torch.where(act, f / mfg / rs, s)
                c = torch.where(act, g / mfg / rs, c)
                g = torch.where(act, d[:, i + 1] - p, g)
                r = (d[:, i] - g) * s + 2 * c * b
                p = torch.where(act, s * r, p)
                d[:, i + 1] = torch.where(act, g + p, d[:, i + 1])
                g = torch.where(act, c * r - b, g)
                if compute_v:
                    ca, sa = torch.where(act, c, one)[:, None], torch.where(act, s, zero)[:, None]
                    zi, zj = z[:, :, i].clone(), z[:, :, i + 1].clone()
                    z[:, :, i + 1] = sa * zi + ca * zj
                    z[:, :, i] = ca * zi - sa * zj
            fin = live  # sweeps that ran to lo without an underflow deflation
            d[:, lo] = torch.where(fin, d[:, lo] - p, d[:, lo])
            e[:, lo] = torch.where(fin, g, e[:, lo])
            e.scatter_(
                1, m[:, None], torch.where(fin, 0.0, e.gather(1, m[:, None]).squeeze(1))[:, None]
            )
    lam, perm = torch.sort(d, dim=-1, stable=True)
    if not compute_v:
        return lam, z.new_empty(0)
    return lam, torch.gather(z, 2, perm.unsqueeze(1).expand(bsz, n, n))


# --- complex (complex64/complex128): the algorithms of torchport.linalg.complex_jacobi ----------


def _complex_rotate(
    x: torch.Tensor, y: torch.Tensor, c: torch.Tensor, s: torch.Tensor, f: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(c·x − s·f·y, s·f̄·x + c·y) for rows x, y (B, len), real c, s and a phase f (B,): the
    unitary rotation [[c, −s·f], [s·f̄, c]], the identity as s → 0 (the real rotation between
    the phase diag(1, f) and its inverse)."""
    sf = (s * f)[:, None]
    return c[:, None] * x - sf * y, sf.conj() * x + c[:, None] * y


def complex_svd_reference(
    a: torch.Tensor, full_matrices: bool = False, compute_uv: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One-sided Jacobi SVD of complex (B, m, n) ``a`` in cyclic order: (U, real S desc, Vh).

    The vectors are A's columns, or the columns of Aᴴ when m < n; pair (j, k) with
    g = w_jᴴ w_k is rotated while |g| > eps·sqrt(p)·‖w_j‖‖w_k‖ (false for a NaN threshold) by
    :func:`_complex_rotate` with f = ḡ/|g|, (c, s, t) the real rotation of (‖w_j‖², ‖w_k‖², |g|);
    the running ‖w_j‖² − t|g| recomputed when not > 0; null vectors completed as in
    :func:`svd_reference`.
    """
    bsz, m, n = a.shape
    trans = m < n
    p, q = (n, m) if trans else (m, n)
    w = (a.conj() if trans else a.mT).clone()  # (B, q, p)
    v = torch.eye(q, dtype=a.dtype, device=a.device).expand(bsz, q, q).clone()
    real = a.real.dtype
    tol = _eps(real) * p**0.5
    pairs = pairs_for(q, 0)
    for _ in range(MAX_SWEEPS):
        nrm = (w.abs() ** 2).sum(-1)
        rotated = torch.zeros(bsz, dtype=torch.bool, device=a.device)
        for j, k in pairs:
            al, be = nrm[:, j].clone(), nrm[:, k].clone()
            gc = (w[:, j].conj() * w[:, k]).sum(-1)
            g = gc.abs()
            act = (al != 0) & (be != 0) & (g > tol * al.sqrt() * be.sqrt())
            rotated |= act
            safe = torch.where(act, g, torch.ones_like(g))
            t, c, s = _rotation((be - al) / (2 * safe))
            t, c, s = (torch.where(act, x, y) for x, y in ((t, 0.0), (c, 1.0), (s, 0.0)))
            f = torch.where(act, gc.conj() / safe, torch.ones_like(gc))
            w[:, j], w[:, k] = _complex_rotate(w[:, j].clone(), w[:, k].clone(), c, s, f)
            v[:, j], v[:, k] = _complex_rotate(v[:, j].clone(), v[:, k].clone(), c, s, f)
            # as the kernel: a running norm that cancelled to <= 0 is recomputed
            nj = al - t * g
            nrm[:, j] = torch.where(nj > 0, nj, (w[:, j].abs() ** 2).sum(-1))
            nrm[:, k] = be + t * g
        if not bool(rotated.any()):
            break
    sig = torch.linalg.vector_norm(w, dim=-1)
    s_sorted, perm = torch.sort(sig, dim=-1, descending=True, stable=True)
    if not compute_uv:
        return a.new_empty(0), s_sorted, a.new_empty(0)
    w = torch.gather(w, 1, perm.unsqueeze(-1).expand(bsz, q, p))
    v = torch.gather(v, 1, perm.unsqueeze(-1).expand(bsz, q, q))
    thresh = s_sorted[:, :1] * p * _eps(real)
    ok = (s_sorted > thresh) & (s_sorted > 0)
    good = ok.to(torch.int64).cumprod(-1).sum(-1)
    ub = w / torch.where(ok, s_sorted, torch.ones_like(s_sorted)).unsqueeze(-1)
    ub = _complete_basis(ub, good, p if full_matrices else q)
    if not trans:  # A V = W: U = the unit vectors as columns, Vh = Vᴴ
        return ub.mT, s_sorted, v.conj()
    return v.mT, s_sorted, ub.conj()  # Aᴴ = Ub S Vᴴ


def complex_eigh_reference(
    a: torch.Tensor, upper: bool = False, compute_v: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-sided cyclic Jacobi of Hermitian complex (B, n, n) ``a`` from its ``upper`` (else
    lower) triangle, the imaginary part of the diagonal ignored: (real L ascending, Q).

    Pair (p, q) with a_pq = g·e, g = |a_pq|, is rotated while
    g > eps·max(sqrt|a_pp a_qq|, 0.1‖A‖_F) by :func:`_complex_rotate`, (c, s, t) the real
    rotation of [[a_pp, g], [g, a_qq]]: rows p, q with f = e (= a_pq / g), columns the
    conjugates of the rows, the eigenvector columns with f = ē.
    """
    bsz, n, _ = a.shape
    tri = a.triu(1).mH if upper else a.tril(-1)
    x = tri + tri.mH + torch.diag_embed(a.diagonal(0, -2, -1).real.to(a.dtype))
    frob = torch.linalg.vector_norm(x.flatten(1), dim=-1)
    vt = torch.eye(n, dtype=a.dtype, device=a.device).expand(bsz, n, n).clone()
    eps = _eps(a.real.dtype)
    for _ in range(MAX_SWEEPS):
        rotated = torch.zeros(bsz, dtype=torch.bool, device=a.device)
        for p, q in pairs_for(n, 0):
            apq = x[:, p, q].clone()
            app, aqq = x[:, p, p].real.clone(), x[:, q, q].real.clone()
            g = apq.abs()
            scale = torch.maximum(app.abs().sqrt() * aqq.abs().sqrt(), 0.1 * frob)
            act = (g != 0) & (g > eps * scale)
            rotated |= act
            safe = torch.where(act, g, torch.ones_like(g))
            t, c, s = _rotation((aqq - app) / (2 * safe))
            t, c, s = (torch.where(act, u, w) for u, w in ((t, 0.0), (c, 1.0), (s, 0.0)))
            e = torch.where(act, apq / safe, torch.ones_like(apq))
            x[:, p], x[:, q] = _complex_rotate(x[:, p].clone(), x[:, q].clone(), c, s, e)
            x[:, :, p] = x[:, p].conj()
            x[:, :, q] = x[:, q].conj()
            x[:, p, p] = (app - t * g).to(a.dtype)
            x[:, q, q] = (aqq + t * g).to(a.dtype)
            x[:, p, q] = torch.where(act, torch.zeros_like(apq), apq)
            x[:, q, p] = x[:, p, q].conj()
            vt[:, p], vt[:, q] = _complex_rotate(vt[:, p].clone(), vt[:, q].clone(), c, s, e.conj())
        if not bool(rotated.any()):
            break
    lam, perm = torch.sort(x.diagonal(0, -2, -1).real, dim=-1, stable=True)
    if not compute_v:
        return lam, a.new_empty(0)
    vt = torch.gather(vt, 1, perm.unsqueeze(-1).expand(bsz, n, n))
    return lam, vt.mT


def complex_eigh_tridiagonal_reference(
    a: torch.Tensor, upper: bool = False, compute_v: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hermitian complex (B, n, n) ``a`` (its ``upper`` or lower triangle, the imaginary part of
    the diagonal ignored) by Householder tridiagonalisation and the real implicit QL of
    :func:`eigh_tridiagonal_reference`: (real L ascending, Q).

    Step k = n-1 … 2 (LAPACK zhetrd with UPLO = 'U'): x = A[0:k, k], α = x[k-1], ‖x[0:k-1]‖ > 0:
    β = -sign(Re α)‖x‖, τ = (β - α)/β, v = x/(α - β) with v[k-1] = 1 (zlarfg), H = I - τ v vᴴ
    (Hᴴ x = β e_{k-1}), A ← Hᴴ A H, Q ← Q H; a column already zero above α is left (its
    coupling stays complex). Then T = Qᴴ A Q is tridiagonal with real diagonal d and subdiagonal
    e_j = T[j+1, j]; the phases δ_0 = 1, δ_{j+1} = δ_j e_j/|e_j| (δ_j when e_j = 0) make
    Dᴴ T D real with subdiagonal |e_j|, and its QL (L, Z) gives V = Q D Z.
    """
    bsz, n, _ = a.shape
    tri = a.triu(1) if upper else a.tril(-1)
    x = tri + tri.mH + torch.diag_embed(a.diagonal(0, -2, -1).real.to(a.dtype))
    q = torch.eye(n, dtype=a.dtype, device=a.device).expand(bsz, n, n).clone()
    for k in range(n - 1, 1, -1):
        cs = _pow2_scale(x[:, :k, k])  # norms in the column's scale (see _pow2_scale)
        col = x[:, :k, k] * cs.to(a.dtype)[:, None]
        alpha, xn = col[:, k - 1], torch.linalg.vector_norm(col[:, : k - 1], dim=-1)
        act = xn > 0
        beta = -torch.copysign(torch.linalg.vector_norm(col, dim=-1), alpha.real)
        safe = torch.where(act, beta, torch.ones_like(beta))
        tau = torch.where(act, (beta - alpha) / safe, torch.zeros_like(alpha))
        v = col / torch.where(act, alpha - beta, torch.ones_like(alpha))[:, None]
        v[:, k - 1] = 1
        h = torch.eye(n, dtype=a.dtype, device=a.device).expand(bsz, n, n).clone()
        h[:, :k, :k] -= tau[:, None, None] * v[:, :, None] * v.conj()[:, None, :]
        x = h.mH @ x @ h
        q = q @ h
    d = x.diagonal(0, -2, -1).real.clone()
    sub = x.diagonal(-1, -2, -1)
    mag = sub.abs()
    phase = torch.where(mag > 0, sub / torch.where(mag > 0, mag, 1.0), torch.ones_like(sub))
    delta = torch.cat([torch.ones_like(d[:, :1]).to(a.dtype), torch.cumprod(phase, -1)], -1)
    e = torch.cat([mag, torch.zeros_like(d[:, :1])], -1)
    return _tridiagonal_ql(d, e, q * delta[:, None, :], compute_v)
