"""Backward formulas for the native decompositions, in torch ops (real dtypes; all four also
complex, with conjugate transposes and torch's treatment of the diagonal).

They follow ``torch.linalg``'s own derivations (``svd_backward``, ``linalg_eig_backward`` with
``is_hermitian``, ``linalg_qr_backward`` and ``cholesky_backward`` in PyTorch's
``FunctionsManual.cpp``) so that gradients agree with ``torch.linalg`` on the same input:

- SVD, with E_jk = S_k² − S_j² (1 on the diagonal) and skew(X) = X − Xᵀ:
  gA = U [(skew(UᵀgU)/E) S + S (skew(VᵀgV)/E) + diag(gS)] Vᵀ, plus (I − UUᵀ) gU S⁻¹ Vᵀ when m > n
  or U S⁻¹ gVᵀ (I − VVᵀ) when m < n. With ``full_matrices=True`` only the leading k columns of U
  (rows of Vh) enter, as in torch. Distinct, non-zero singular values are assumed (as in torch).
  Complex: ᵀ becomes ᴴ, skew(X) = X − Xᴴ, plus diag(skew(UᴴgU))/(2S) when both gU and gVh are
  given; a loss that depends on the vectors' phases (Im diag(UᴴgU) ≠ −Im diag(VᴴgV)) raises
  torch's RuntimeError.
- eigh: gA = V (diag(gL) + ½(VᴴgV − gVᴴV)/E) Vᴴ with E_ij = L_j − L_i; complex: a loss with
  Im diag(VᴴgV) ≠ 0 depends on the eigenvectors' phases and raises torch's RuntimeError.
- QR, with G = gR Rᴴ − Qᴴ gQ: m ≥ n, gA = (gQ + Q (T + Tᴴ − ½ Re diag(T + Tᴴ))) R⁻ᴴ,
  T = triu(G); m < n, with X = tril(Gᴴ − G): gA = [Q (X − ½ diag X) R₁⁻ᴴ, 0] + Q gR (X's
  diagonal is 2i Im G_jj, zero for real input). The errors for ``mode='r'`` and for
  ``mode='complete'`` with m > n.
- Cholesky: gA = L⁻ᴴ ½ (P + tril(P, −1)ᴴ) L⁻¹, P = tril(Lᴴ gL) (as torch: for complex input not
  Hermitian, its diagonal keeping P's imaginary part).
"""

from __future__ import annotations

import torch


def _e_matrix(x: torch.Tensor) -> torch.Tensor:
    """E_jk = x_k − x_j off the diagonal, 1 on it."""
    e = x.unsqueeze(-2) - x.unsqueeze(-1)
    return e + torch.eye(x.shape[-1], dtype=x.dtype, device=x.device)


def svd_backward(
    gu: torch.Tensor | None,
    gs: torch.Tensor | None,
    gvh: torch.Tensor | None,
    u: torch.Tensor,
    s: torch.Tensor,
    vh: torch.Tensor,
    full_matrices: bool,
) -> torch.Tensor | None:
    """Gradient of a loss through ``A = U diag(S) Vh`` (reduced or full; real or complex)."""
    k = s.shape[-1]
    if full_matrices:
        u, vh = u[..., :k], vh[..., :k, :]
        gu = None if gu is None else gu[..., :k]
        gvh = None if gvh is None else gvh[..., :k, :]
    if gs is None and gu is None and gvh is None:
        return None
    m, n = u.shape[-2], vh.shape[-1]
    if gu is None and gvh is None:
        assert gs is not None
        return (u * gs.unsqueeze(-2)) @ vh
    e = _e_matrix(s * s)
    inner = torch.zeros((*s.shape, k), dtype=u.dtype, device=s.device)
    uhgu = vhgv = None
    if gu is not None:
        uhgu = u.mH @ gu
        uhgu = uhgu - uhgu.mH
        inner = inner + (uhgu / e) * s.unsqueeze(-2)
    if gvh is not None:
        vhgv = vh @ gvh.mH
        vhgv = vhgv - vhgv.mH
        inner = inner + s.unsqueeze(-1) * (vhgv / e)
    if u.is_complex():
        _check_svd_gauge(uhgu, vhgv, s)
        if uhgu is not None and vhgv is not None:
            inner = inner + torch.diag_embed(uhgu.diagonal(0, -2, -1) / (2 * s))
    if gs is not None:
        inner = inner + torch.diag_embed(gs)
    if m > n and gu is not None:
        ga = u @ inner
        gusinv = gu / s.unsqueeze(-2)
        ga = ga + gusinv - u @ (u.mH @ gusinv)
        return ga @ vh
    if m < n and gvh is not None:
        ga = inner @ vh
        sinvgvh = gvh / s.unsqueeze(-1)
        ga = ga + sinvgvh - (sinvgvh @ vh.mH) @ vh
        return u @ ga
    return u @ inner @ vh


def _check_svd_gauge(uhgu: torch.Tensor | None, vhgv: torch.Tensor | None, s: torch.Tensor) -> None:
    """torch's check that a loss does not depend on the phases of the singular vectors
    (U, V → U e^{iφ}, V e^{iφ}): Im diag(UᴴgU) = −Im diag(VᴴgV), loosely (rtol = atol = 1e-2)."""
    zero = torch.zeros_like(s)
    im_u = zero if uhgu is None else uhgu.diagonal(0, -2, -1).imag
    im_v = zero if vhgv is None else vhgv.diagonal(0, -2, -1).imag
    if not torch.allclose(im_u, -im_v, rtol=1e-2, atol=1e-2):
        raise RuntimeError(
            "torchport.linalg.svd backward: The singular vectors in the complex case are "
            "specified up to multiplication by e^{i phi}. The specified loss function depends "
            "on this phase term, making it ill-defined."
        )


def eigh_backward(
    gl: torch.Tensor | None, gv: torch.Tensor | None, lam: torch.Tensor, v: torch.Tensor
) -> torch.Tensor | None:
    """Gradient of a loss through ``A = V diag(L) Vᴴ`` (V orthogonal or unitary)."""
    if gl is None and gv is None:
        return None
    if gv is None:
        assert gl is not None
        return (v * gl.unsqueeze(-2)) @ v.mH
    vhgv = v.mH @ gv
    if v.is_complex():
        im = vhgv.diagonal(0, -2, -1).imag
        if not torch.allclose(im, torch.zeros_like(im), rtol=1e-2, atol=1e-2):
            raise RuntimeError(
                "torchport.linalg.eigh backward: The eigenvectors in the complex case are "
                "specified up to multiplication by e^{i phi}. The specified loss function "
                "depends on this quantity, so it is ill-defined."
            )
    inner = 0.5 * (vhgv - vhgv.mH) / _e_matrix(lam)
    inner = inner - torch.diag_embed(inner.diagonal(0, -2, -1))
    if gl is not None:
        inner = inner + torch.diag_embed(gl)
    return v @ inner @ v.mH


def qr_backward(
    gq: torch.Tensor | None, gr: torch.Tensor | None, q: torch.Tensor, r: torch.Tensor, mode: str
) -> torch.Tensor | None:
    """Gradient of a loss through ``A = Q R``."""
    if mode == "r":
        raise RuntimeError(
            "The derivative of torchport.linalg.qr depends on Q, which is not computed when "
            "mode='r'. Please use qr(A, mode='reduced') if you are going to differentiate it."
        )
    m, n = q.shape[-2], r.shape[-1]
    if mode == "complete" and m > n:
        raise RuntimeError(
            "The QR decomposition is not differentiable when mode='complete' and nrows > ncols "
            f"(got {m} > {n})."
        )
    if gq is None and gr is None:
        return None
    if gq is not None and gr is not None:
        ga = gr @ r.mH - q.mH @ gq
    elif gq is not None:
        ga = -(q.mH @ gq)
    else:
        assert gr is not None
        ga = gr @ r.mH
    if m >= n:
        t = ga.triu()
        t = t + t.mH
        t = t - 0.5 * torch.diag_embed(t.diagonal(0, -2, -1).real)
        ga = q @ t
        if gq is not None:
            ga = ga + gq
        return torch.linalg.solve_triangular(r.mH, ga, upper=False, left=False)
    x = -ga
    x = (x - x.mH).tril()
    ga = q @ (x - 0.5 * torch.diag_embed(x.diagonal(0, -2, -1)))
    ga = torch.linalg.solve_triangular(r[..., :m].mH, ga, upper=False, left=False)
    ga = torch.cat([ga, ga.new_zeros((*ga.shape[:-1], n - m))], dim=-1)
    if gr is not None:
        ga = ga + q @ gr
    return ga


def cholesky_backward(
    gl: torch.Tensor | None, lfac: torch.Tensor, upper: bool
) -> torch.Tensor | None:
    """Gradient of a loss through ``A = L Lᵀ`` (or ``Uᵀ U`` when ``upper``)."""
    if gl is None:
        return None
    low = lfac.mH if upper else lfac
    glow = gl.mH if upper else gl
    phi = (low.mH @ glow).tril()
    phi = 0.5 * (phi + phi.tril(-1).mH)
    x = torch.linalg.solve_triangular(low.mH, phi, upper=True, left=True)
    return torch.linalg.solve_triangular(low, x, upper=False, left=False)
