"""``torch.library`` custom ops over the native kernels, with fake shapes and autograd.

Each op takes a float32/float64 CPU tensor of any batch shape ``(*, m, n)`` (svd and eigh also
complex64/complex128, through :mod:`~torchport.linalg.complex_jacobi`, S and the eigenvalues then
real; qr and cholesky_ex through :mod:`~torchport.linalg.complex_factor`), flattens the batch,
calls the kernel launcher and reshapes back. Numerical failures raise
``torch.linalg.LinAlgError`` with ``torch.linalg``'s wording and the flat batch index. Backward
formulas live in :mod:`torchport.linalg.autograd`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from torchport.linalg import autograd as ag
from torchport.linalg import complex_factor, complex_jacobi, kernels

_T = TypeVar("_T")


def _batch_prefix(a: torch.Tensor, bad: int) -> str:
    return f"(Batch element {bad - 1}): " if a.dim() > 2 else ""


def non_finite(op: str, a: torch.Tensor, bad: int, lapack: Callable[[], _T]) -> _T:
    """What every route answers once a native kernel found non-finite values in ``a`` (batch
    element ``bad - 1``): ``torch.linalg``'s result for that input, so that ``"jacobi"``, the
    one-matrix launchers and the LAPACK route of ``"auto"`` agree. LAPACK runs through
    infinities and returns NaNs, but fails on NaN, and torch then raises ``LinAlgError``: raised
    here naming the batch element and the cause."""
    try:
        return lapack()
    except torch.linalg.LinAlgError:
        raise torch.linalg.LinAlgError(
            f"torchport.linalg.{op}: {_batch_prefix(a, bad)}The algorithm failed to converge "
            "because the input matrix contained non-finite values."
        ) from None


def _native_off(op: str) -> bool:
    """True, and the fallback counted, if the native kernels are switched off now. Read on every
    run of a custom op, as the eager route reads it on every call: under ``torch.compile`` the
    ops are opaque, so a graph traced while the kernels were on follows ``TORCHPORT_NATIVE`` (or
    ``config.override(native=False)``) at run time without a recompile."""
    from torchport import native

    if native.enabled():
        return False
    native.note_fallback(f"linalg.{op}", "native kernels are disabled (TORCHPORT_NATIVE=0)")
    return True


def _dense(outs: tuple[torch.Tensor, ...]) -> Any:
    """``outs`` row-major, as the custom ops' fakes promise: torch.linalg's U, Vh, Q, R and L
    are column-major, and a graph compiled by Inductor asserted the fakes' strides on them
    ("expected size 4==4, stride 1==4") on the native-off and non-finite routes."""
    return tuple(t.contiguous() for t in outs)


def _flat(a: torch.Tensor) -> torch.Tensor:
    b = 1
    for d in a.shape[:-2]:
        b *= d
    x = a.reshape((b, *tuple(a.shape[-2:]))).contiguous()
    # the kernels read raw memory: a lazy conjugate (or negative) view must be materialised
    return x.resolve_conj().resolve_neg() if x.is_conj() or x.is_neg() else x


# --- svd -------------------------------------------------------------------------------------------


def svd_impl(
    a: torch.Tensor, full_matrices: bool, compute_uv: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Native SVD of ``a`` (*, m, n): (U, S, Vh); U and Vh are empty when not ``compute_uv``."""
    batch, (_m, _n) = a.shape[:-2], a.shape[-2:]
    run = complex_jacobi.svd if a.is_complex() else kernels.svd
    u, s, vh, bad = run(_flat(a), full_matrices, compute_uv)
    if bad:
        if compute_uv:
            return non_finite("svd", a, bad, lambda: tuple(torch.linalg.svd(a, full_matrices)))
        # (two placeholders of their own: a custom op's outputs may not alias each other)
        return non_finite(
            "svd", a, bad, lambda: (a.new_empty(0), torch.linalg.svdvals(a), a.new_empty(0))
        )
    s = s.reshape(batch + s.shape[-1:])
    if not compute_uv:
        return a.new_empty(0), s, a.new_empty(0)
    return u.reshape(batch + u.shape[-2:]), s, vh.reshape(batch + vh.shape[-2:])


def _svd_op_impl(
    a: torch.Tensor, full_matrices: bool, compute_uv: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _native_off("svd"):  # torch.linalg's answer, as the eager route gives it
        if not compute_uv:
            return a.new_empty(0), torch.linalg.svdvals(a), a.new_empty(0)
        return _dense(tuple(torch.linalg.svd(a, full_matrices)))
    return _dense(svd_impl(a, full_matrices, compute_uv))


_svd_op = torch.library.custom_op("torchport::linalg_svd", _svd_op_impl, mutates_args=())


@_svd_op.register_fake
def _(a: torch.Tensor, full_matrices: bool, compute_uv: bool) -> tuple[Any, Any, Any]:
    batch, (m, n) = a.shape[:-2], a.shape[-2:]
    k = min(m, n)
    s = a.new_empty((*batch, k), dtype=a.dtype.to_real())
    if not compute_uv:
        return a.new_empty(0), s, a.new_empty(0)
    u = a.new_empty((*batch, m, m if full_matrices else k))
    vh = a.new_empty((*batch, n if full_matrices else k, n))
    return u, s, vh


def _svd_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
    ctx.full_matrices, ctx.compute_uv = inputs[1], inputs[2]
    # unused outputs' grads as None, not zeros: svd_backward takes the S-only formula only then
    # (with zeros, a loss of S alone divided 0 by 0 for repeated singular values)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*output)


def _svd_bwd(ctx: Any, gu: Any, gs: Any, gvh: Any) -> tuple[Any, None, None]:
    if not ctx.compute_uv:
        raise RuntimeError(
            "torchport.linalg.svd: compute_uv=False is not differentiable; use svdvals"
        )
    u, s, vh = ctx.saved_tensors
    return ag.svd_backward(gu, gs, gvh, u, s, vh, ctx.full_matrices), None, None


_svd_op.register_autograd(_svd_bwd, setup_context=_svd_setup)


def svd(a: torch.Tensor, full_matrices: bool, compute_uv: bool) -> tuple[Any, Any, Any]:
    """Dispatch: direct kernel call on plain eager tensors, else through the custom op."""
    if _fast(a):
        return svd_impl(a, full_matrices, compute_uv)
    return _svd_op(a, full_matrices, compute_uv)


# --- eigh ------------------------------------------------------------------------------------------


def read_triangle(a: torch.Tensor, upper: bool) -> tuple[torch.Tensor, int]:
    """(B, n, n) ``a`` rebuilt from the triangle eigh reads (the other one its conjugate mirror)
    and 0, or ``a`` and 1 + the first batch index whose read triangle holds a non-finite value.
    The kernels test all n² entries (one pass, no branch per entry) while torch.linalg.eigh reads
    one triangle: after a kernel's non-finite report, a call whose non-finite values all lie in
    the unread triangle is rerun on the rebuilt input instead of failing."""
    tri = a.triu() if upper else a.tril()
    finite = torch.isfinite(tri).flatten(-2).all(-1)
    if not bool(finite.all()):
        return a, int((~finite).nonzero()[0, 0]) + 1
    off = (a.triu(1) if upper else a.tril(-1)).mH
    return (tri + off).contiguous(), 0


def _eigh_kernel(
    flat: torch.Tensor, upper: bool, compute_v: bool, jacobi: bool
) -> tuple[torch.Tensor, torch.Tensor, int]:
    if flat.is_complex():
        return complex_jacobi.eigh(flat, upper, compute_v)
    return kernels.eigh(flat, upper, compute_v, jacobi=jacobi)


def eigh_impl(
    a: torch.Tensor, upper: bool, compute_v: bool, jacobi: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Native symmetric eigendecomposition of ``a`` (*, n, n): (L ascending, Q); ``jacobi``:
    only the Jacobi kernels (``method="jacobi"``), else the measured fastest native one."""
    batch, n = a.shape[:-2], a.shape[-1]
    flat = _flat(a)
    lam, q, bad = _eigh_kernel(flat, upper, compute_v, jacobi)
    if bad:  # rerun if only the triangle eigh does not read held non-finite values
        mirrored, bad = read_triangle(flat, upper)
        if not bad:
            lam, q, bad = _eigh_kernel(mirrored, upper, compute_v, jacobi)
    if bad:
        uplo = "U" if upper else "L"
        if compute_v:
            return non_finite("eigh", a, bad, lambda: tuple(torch.linalg.eigh(a, uplo)))
        return non_finite("eigh", a, bad, lambda: (torch.linalg.eigvalsh(a, uplo), a.new_empty(0)))
    lam = lam.reshape((*batch, n))
    return lam, (q.reshape((*batch, n, n)) if compute_v else a.new_empty(0))


def _eigh_op_impl(
    a: torch.Tensor, upper: bool, compute_v: bool, jacobi: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    if _native_off("eigh"):
        uplo = "U" if upper else "L"
        if not compute_v:
            return torch.linalg.eigvalsh(a, uplo), a.new_empty(0)
        return _dense(tuple(torch.linalg.eigh(a, uplo)))
    return _dense(eigh_impl(a, upper, compute_v, jacobi))


_eigh_op = torch.library.custom_op("torchport::linalg_eigh", _eigh_op_impl, mutates_args=())


@_eigh_op.register_fake
def _(a: torch.Tensor, upper: bool, compute_v: bool, jacobi: bool = False) -> tuple[Any, Any]:
    lam = a.new_empty((*a.shape[:-2], a.shape[-1]), dtype=a.dtype.to_real())
    return lam, (a.new_empty(a.shape) if compute_v else a.new_empty(0))


def _eigh_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
    ctx.compute_v = inputs[2]
    # as _svd_setup: gv None for a loss of the eigenvalues alone (0/0 for repeated ones else)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(*output)


def _eigh_bwd(ctx: Any, gl: Any, gv: Any) -> tuple[Any, None, None, None]:
    if not ctx.compute_v:
        raise RuntimeError("torchport.linalg.eigh: compute_v=False is not differentiable")
    lam, v = ctx.saved_tensors
    return ag.eigh_backward(gl, gv, lam, v), None, None, None


_eigh_op.register_autograd(_eigh_bwd, setup_context=_eigh_setup)


def eigh(a: torch.Tensor, upper: bool, compute_v: bool, jacobi: bool = False) -> tuple[Any, Any]:
    """Dispatch: direct kernel call on plain eager tensors, else through the custom op."""
    if _fast(a):
        return eigh_impl(a, upper, compute_v, jacobi)
    return _eigh_op(a, upper, compute_v, jacobi)


# --- qr --------------------------------------------------------------------------------------------


def qr_impl(a: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Native Householder QR of ``a`` (*, m, n)."""
    batch = a.shape[:-2]
    q, r = (complex_factor.qr if a.is_complex() else kernels.qr)(_flat(a), mode)
    r = r.reshape(batch + r.shape[-2:])
    return (q.reshape(batch + q.shape[-2:]) if mode != "r" else a.new_empty(0)), r


def _qr_op_impl(a: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    if _native_off("qr"):
        q, r = torch.linalg.qr(a, mode)
        return _dense(((q if mode != "r" else a.new_empty(0)), r))
    return qr_impl(a, mode)


_qr_op = torch.library.custom_op("torchport::linalg_qr", _qr_op_impl, mutates_args=())


@_qr_op.register_fake
def _(a: torch.Tensor, mode: str) -> tuple[Any, Any]:
    batch, (m, n) = a.shape[:-2], a.shape[-2:]
    k = min(m, n)
    rows = m if mode == "complete" else k
    q = a.new_empty((*batch, m, rows)) if mode != "r" else a.new_empty(0)
    return q, a.new_empty((*batch, rows, n))


def _qr_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
    ctx.mode = inputs[1]
    ctx.save_for_backward(*output)


def _qr_bwd(ctx: Any, gq: Any, gr: Any) -> tuple[Any, None]:
    q, r = ctx.saved_tensors
    return ag.qr_backward(gq, gr, q, r, ctx.mode), None


_qr_op.register_autograd(_qr_bwd, setup_context=_qr_setup)


def qr(a: torch.Tensor, mode: str) -> tuple[Any, Any]:
    """Dispatch: direct kernel call on plain eager tensors, else through the custom op."""
    if _fast(a):
        return qr_impl(a, mode)
    return _qr_op(a, mode)


# --- cholesky --------------------------------------------------------------------------------------


def cholesky_impl(a: torch.Tensor, upper: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Native Cholesky of ``a`` (*, n, n): (factor, int32 info of shape ``*``)."""
    batch = a.shape[:-2]
    run = complex_factor.cholesky if a.is_complex() else kernels.cholesky
    fac, info, _ = run(_flat(a), upper)
    return fac.reshape(a.shape), info.reshape(batch)


def _chol_op_impl(a: torch.Tensor, upper: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if _native_off("cholesky"):
        return _dense(tuple(torch.linalg.cholesky_ex(a, upper=upper)))
    return cholesky_impl(a, upper)


_chol_op = torch.library.custom_op("torchport::linalg_cholesky_ex", _chol_op_impl, mutates_args=())


@_chol_op.register_fake
def _(a: torch.Tensor, upper: bool) -> tuple[Any, Any]:
    return a.new_empty(a.shape), a.new_empty(a.shape[:-2], dtype=torch.int32)


def _chol_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Any, ...]) -> None:
    ctx.upper = inputs[1]
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(output[0])


def _chol_bwd(ctx: Any, gl: Any, ginfo: Any) -> tuple[Any, None]:
    (fac,) = ctx.saved_tensors
    return ag.cholesky_backward(gl, fac, ctx.upper), None


_chol_op.register_autograd(_chol_bwd, setup_context=_chol_setup)


def cholesky_checked_impl(
    a: torch.Tensor, upper: bool, op: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cholesky_impl`, raising ``LinAlgError`` for a matrix that is not positive-definite
    inside the op: under ``torch.compile`` the check cannot be a data-dependent branch after it."""
    fac, info = _chol_op_impl(a, upper)
    from torchport.linalg import _raise_not_pd

    _raise_not_pd(op, a, info)
    return fac, info


_chol_checked_op = torch.library.custom_op(
    "torchport::linalg_cholesky_checked", cholesky_checked_impl, mutates_args=()
)


@_chol_checked_op.register_fake
def _(a: torch.Tensor, upper: bool, op: str) -> tuple[Any, Any]:
    return a.new_empty(a.shape), a.new_empty(a.shape[:-2], dtype=torch.int32)


def _chol_checked_bwd(ctx: Any, gl: Any, ginfo: Any) -> tuple[Any, None, None]:
    return _chol_bwd(ctx, gl, ginfo)[0], None, None


_chol_checked_op.register_autograd(_chol_checked_bwd, setup_context=_chol_setup)


def cholesky_checked(a: torch.Tensor, upper: bool, op: str) -> tuple[Any, Any]:
    """The checked Cholesky through its custom op (for traced calls)."""
    return _chol_checked_op(a, upper, op)


def cholesky_ex(a: torch.Tensor, upper: bool) -> tuple[Any, Any]:
    """Dispatch: direct kernel call on plain eager tensors, else through the custom op."""
    if _fast(a):
        return cholesky_impl(a, upper)
    return _chol_op(a, upper)


def _fast(a: torch.Tensor) -> bool:
    from torchport import native

    return native.eager_fast_path(a)
