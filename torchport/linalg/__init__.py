"""Batched linear algebra with ``torch.linalg``'s signatures: Jacobi SVD/eigh, QR, Cholesky.

``svd``, ``svdvals``, ``eigh``, ``eigvalsh``, ``qr``, ``cholesky`` and ``cholesky_ex`` take the
arguments of their ``torch.linalg`` namesakes, return the same named tuples (``torch.return_types``)
and keep its conventions: singular values descending, eigenvalues ascending, any batch shape,
float32/float64 and complex64/complex128. Each also takes ``method``:

- ``"jacobi"``: the native batched kernels (:mod:`~torchport.linalg.kernels`; for ``qr`` and the
  Cholesky functions ``"jacobi"`` names the native Householder/Cholesky kernels). On a non-CPU
  device it runs the plain-torch reference of the same algorithm
  (:mod:`~torchport.linalg.reference`). For ``eigh``/``eigvalsh`` it always runs Jacobi, while
  the native route of ``"auto"`` runs batches from ``kernels.EIGH_TRIDIAG_FROM`` through the
  tridiagonalisation + QL lane kernel (:mod:`~torchport.linalg.eigh_tridiag`).
- ``"lapack"``: ``torch.linalg`` itself (MKL/LAPACK on CPU).
- ``"auto"`` (default): whichever was faster when measured by the autotuner for this
  (op, batch bucket, m, n, dtype, options), with ``torch.linalg`` as the anchor; the native kernel
  is chosen only if it beat the anchor by more than the noise margin. For a single matrix the
  native side is the one-matrix launcher (:mod:`~torchport.linalg.one`), whose ``eigh`` from
  order 4 is tridiagonal QL rather than Jacobi: ``"jacobi"`` always gives a Jacobi result,
  ``"auto"`` whichever algorithm is fastest.

Complex64/complex128 inputs have native kernels, one matrix per thread (``svd``/``svdvals``,
``eigh``/``eigvalsh`` through :mod:`~torchport.linalg.complex_jacobi`; ``qr``, ``cholesky`` and
``cholesky_ex`` through :mod:`~torchport.linalg.complex_factor`), and one-matrix launchers
(:mod:`~torchport.linalg.one`; ``eigh`` tridiagonal QL from ``one.EIGH_TRIDIAGONAL_FROM``, as
for real dtypes) but no lane kernels: ``"jacobi"`` runs
them (their references off the CPU) and ``"auto"`` tunes them against ``torch.linalg`` as for
real dtypes.
Autograd follows ``torch.linalg``'s formulas (:mod:`~torchport.linalg.autograd`). Under a
``torch.func`` transform (vmap, grad, jvp, ...) or forward AD every method runs ``torch.linalg``
(the native kernels have no batching rule or forward-mode formula; for ``"jacobi"`` a counted
fallback with a warning once).

A bad argument raises :class:`LinalgInputError`, a ``ValueError`` and a ``RuntimeError`` (what
torch.linalg raises for a non-square or 1-D ``A``, an integer dtype, a bad ``mode``/``UPLO``/
``driver``); one of the wrong type (a list for ``A``, an int for ``UPLO``) is a ``TypeError`` too,
as in torch.
"""

from __future__ import annotations

from collections.abc import Callable
from ctypes import string_at as _string_at
from typing import Any

import torch

from torchport import autotune, config, native
from torchport.autotune import ATEN, Candidate, InvalidCandidate
from torchport.autotune import timing as _timing
from torchport.linalg import complex_factor, complex_jacobi, kernels, one, ops
from torchport.linalg.reference import (
    cholesky_blocked_reference,
    cholesky_reference,
    complex_eigh_reference,
    complex_eigh_tridiagonal_reference,
    complex_svd_reference,
    eigh_reference,
    eigh_tridiagonal_reference,
    qr_reference,
    svd_reference,
)
from torchport.native.launch import is_compiling_here

__all__ = [
    "METHODS",
    "LinalgInputError",
    "cholesky",
    "cholesky_blocked_reference",
    "cholesky_ex",
    "cholesky_reference",
    "complex_eigh_reference",
    "complex_eigh_tridiagonal_reference",
    "complex_svd_reference",
    "eigh",
    "eigh_reference",
    "eigh_tridiagonal_reference",
    "eigvalsh",
    "qr",
    "qr_reference",
    "svd",
    "svd_reference",
    "svdvals",
]

METHODS = ("auto", "jacobi", "lapack")
QR_MODES = ("reduced", "complete", "r")
# Largest min(m, n) for which the native kernel is a candidate at all: beyond it LAPACK's
# blocked O(n³) algorithms win by far on this machine (bench/bench_linalg.py), so tuning skips it.
# The blocked Cholesky still beat torch.linalg at n = 384 / 512 (2.4-5x, B = 2-4, alternated
# minima of 7), so Cholesky stays a candidate up to 1024 and the tuner decides.
NATIVE_MAX_N = {"svd": 96, "eigh": 96, "qr": 256, "cholesky": 1024}
# For a single matrix the one-matrix launcher (torchport.linalg.one) is a candidate up to
# one.ONE_MAX_N; an op listed here only up to its bound. eigh was capped at 12 while its
# launcher ran cyclic Jacobi (0.66x torch.linalg.eigh at n = 16 f64); from n = 4 it runs
# tridiagonal QL (one.EIGH_TRIDIAGONAL_FROM), 2.1-3.0x faster than torch.linalg.eigh at
# n = 16…32 and 1.4-2.3x for eigenvalues only (alternated medians, load 2.6-3.6), so it
# competes up to one.ONE_MAX_N too.
ONE_MATRIX_MAX_N: dict[str, int] = {"eigh": one.ONE_MAX_N}


def _one_candidate(op: str, m: int, n: int) -> bool:
    """Whether the one-matrix launcher competes for a single m x n matrix of ``op``."""
    return one.fits(m, n) and max(m, n) <= ONE_MATRIX_MAX_N.get(op, one.ONE_MAX_N)


class LinalgInputError(ValueError, RuntimeError):
    """An argument to a ``torchport.linalg`` function does not meet its requirement.

    Also a ``RuntimeError``, the class torch.linalg raises for a bad shape, dtype or option
    (code catching torch's ``RuntimeError`` catches this too)."""


class _LinalgTypeError(LinalgInputError, TypeError):
    """A :class:`LinalgInputError` of the wrong type (a list for ``A``, an int for ``UPLO``),
    also a ``TypeError`` as torch.linalg raises it (code catching torch's TypeError catches
    this too)."""


_DTYPES = (torch.float32, torch.float64, torch.complex64, torch.complex128)


def _check(op: str, a: object, *, square: bool) -> torch.Tensor:
    if not isinstance(a, torch.Tensor):
        raise _LinalgTypeError(
            f"torchport.linalg.{op}: A must be a torch.Tensor, got {type(a).__name__}"
        )
    if a.dim() < 2:
        raise LinalgInputError(
            f"torchport.linalg.{op}: A must have at least 2 dimensions, got {a.dim()}-D shape "
            f"{tuple(a.shape)}"
        )
    if a.dtype not in _DTYPES:  # (a blacklist let the float8 types through to a KeyError)
        raise LinalgInputError(
            f"torchport.linalg.{op}: A must be float32, float64, complex64 or complex128, "
            f"got {a.dtype}"
        )
    if square and a.shape[-1] != a.shape[-2]:
        raise LinalgInputError(
            f"torchport.linalg.{op}: A must be batches of square matrices, got "
            f"{a.shape[-2]} by {a.shape[-1]} matrices"
        )
    if torch.compiler.is_dynamo_compiling():
        # dynamo cannot trace is_conj()/is_neg() (a bool result breaks fullgraph=True); the
        # resolves trace, and are no-ops on a tensor without the bit
        return a.resolve_conj().resolve_neg()
    if a.is_conj() or a.is_neg():
        # a lazy conjugate (A.conj()) shares A's memory unconjugated, and .contiguous() keeps the
        # bit: the kernels read raw memory, so materialise it (differentiable)
        a = a.resolve_conj().resolve_neg()
    return a


def _bucket(b: int) -> int:
    """Batch sizes tuned together: 1, then powers of 2 (a call of B=100 is tuned with B<=128)."""
    return 1 if b <= 1 else 1 << (b - 1).bit_length()


# torch's named-tuple return types (structseq), e.g. ``linalg_svd(U, S, Vh)``
_rt: Any = torch.return_types
# the LAPACK routes' Cholesky, called without keywords when the defaults hold (a global lookup
# and no keyword parsing)
_chol_ex = torch.linalg.cholesky_ex

_memo: dict[tuple[Any, ...], bool] = {}
# The per-call fast path of method="auto": (op, shape, dtype, device, options) -> route, filled
# after the first call of that exact problem; a hit skips bucketing, the tuner and its cache.
_fast: dict[tuple[Any, ...], str] = {}
# Per op, (shape, dtype, *options as the public function spells them) of real problems that
# "auto" sends to torch.linalg: correct on any device (off the CPU "auto" always means
# torch.linalg), so the key skips the costly ``a.device``. Each public function tests its set
# inline before anything else and returns torch.linalg's result unchanged (~0.1 us over torch
# on the Zen 5 VM; ~0.8 us on the Zen 3, where A.shape alone costs 180-260 ns),
# passing the options positionally where torch.linalg allows it (a keyword costs its argument
# parser ~0.5 us, 7 % of a 3x3 eigh).
_lapack_fast: dict[str, set[tuple[Any, ...]]] = {
    op: set() for op in ("svd", "eigh", "qr", "cholesky")
}
_lk_svd = _lapack_fast["svd"]
_lk_eigh = _lapack_fast["eigh"]
_lk_qr = _lapack_fast["qr"]
_lk_chol = _lapack_fast["cholesky"]
# Per public function, the same keys for a single small CPU matrix (batch of one) that "auto"
# routed to the native kernels -> its one-matrix launcher (torchport.linalg.one), which returns
# the public result. Each public function tests its table right after its LAPACK set; a hit
# then runs only _native_ok and the launcher.
_one: dict[str, dict[tuple[Any, ...], Callable[..., Any]]] = {
    f: {} for f in ("svd", "svdvals", "eigh", "eigvalsh", "qr", "cholesky", "cholesky_ex")
}
_one_svd, _one_svdvals = _one["svd"], _one["svdvals"]
_one_eigh, _one_eigvalsh = _one["eigh"], _one["eigvalsh"]
_one_qr, _one_chol, _one_chol_ex = _one["qr"], _one["cholesky"], _one["cholesky_ex"]


# (method, shape, dtype, upper) of CPU problems that method ("auto" or "jacobi") routed to the
# native Cholesky -> its launcher, resolved once (kernels.cholesky_plan): a repeat call skips
# validation, routing and the op layer (~20 us of a ~45 us call at B = 100, n = 3 without it)
_chol_native: dict[
    tuple[Any, ...], Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, int]]
] = {}
# the same for QR: (method, shape, dtype, mode) -> resolved launcher (kernels.qr_plan)
_qr_native: dict[tuple[Any, ...], Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {}
# (shape, dtype, upper) -> resolved native Cholesky launcher, for every eager CPU native call
_chol_plans: dict[
    tuple[Any, ...], Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, int]]
] = {}


_last_overrides: list[Any] = [(), True]  # (the overrides tuple last checked, its verdict)


def _neutral_overrides() -> bool:
    """True unless a ``config.override`` active in this context sets a routing setting (routes
    and launchers learned outside it would then be stale). The context's tuple of override
    layers is the same object while it lasts, so the verdict is cached by identity."""
    ov = _cfg_overrides.get()
    if ov is _last_overrides[0]:
        return bool(_last_overrides[1])
    ok = not any(_ROUTE_SET.intersection(layer) for layer in ov)
    _last_overrides[0], _last_overrides[1] = ov, ok
    return ok


_functorch_active = native.functorch_active
# (this thread's tracing: torch.compiler.is_compiling() is true in every thread while one compiles)
_compiling = is_compiling_here
_fwad = torch.autograd.forward_ad


def _transformed() -> bool:
    """True while a ``torch.func`` transform (vmap, grad, jvp, ...) or a forward-AD level is
    active: the native kernels have no batching rule, no data pointer to read in the wrapped
    tensors and no forward-mode formula, and the tuner's random probes fail under vmap."""
    return bool(_functorch_active()) or _fwad._current_level >= 0


def _native_ok(a: torch.Tensor) -> bool:
    """May a routed native launcher run on ``a`` (a plain tensor) now? The checks of
    ``native.eager_fast_path`` and ``native.enabled`` written out inline (~1 us instead of
    ~4 us at B = 100, n = 3): a learned route implies the native kernels were on, so "still on"
    is "no setting assigned since (generation), no active override of a routing setting, and
    ``TORCHPORT_NATIVE`` unchanged in the environment"; then a CPU tensor that is no lazy
    conjugate or negative view (the launchers read raw memory: such a view takes the general
    path, which resolves it), no autograd to record, no tracing, no ``torch.func`` transform
    (its wrapped tensors have no data pointer) and no forward AD (a launcher drops tangents)."""
    return not (
        _compiling()  # first: dynamo cannot trace the ContextVar read below
        or _functorch_active()
        or _fwad._current_level >= 0
        or _routes_gen[0] != _cfg_gen[0]
        or not _neutral_overrides()
        or _env_data.get(_NATIVE_ENV) != _native_env[0]
        or not a.is_cpu
        or a.is_conj()
        or a.is_neg()
        or (a.requires_grad and torch.is_grad_enabled())
        or torch._C._len_torch_dispatch_stack()
        or (
            torch._C._is_torch_function_mode_enabled()
            and torch.overrides._get_current_function_mode()
        )
    )


def _chol_routed_native(
    a: object, upper: bool, method: str
) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """Run a native Cholesky that ``method`` already routed for this problem through its
    resolved launcher, or None to take the general path (unknown problem, non-CPU tensor,
    tracing, autograd, a setting changed or overridden since the route was learned)."""
    if type(a) is not torch.Tensor or type(method) is not str:  # (the key hashes method)
        return None
    run = _chol_native.get((method, a.shape, a.dtype, upper))
    if run is None or not _native_ok(a):
        return None
    return run(a)


# Every auto-routing cache above, keyed by what the route was derived from: the settings that
# can change a route (config.stamp), checked on each slow-path call. A config assignment also
# bumps config's generation counter, which the one-line LAPACK fast path in each public function
# compares (one list read), so ``config.set(...)`` re-routes even problems that only hit it;
# environment edits at run time are seen by the next slow-path call.
_ROUTE_SETTINGS = (
    "native",
    "isa",
    "autotune",
    "autotune_cache",
    "autotune_reps",
    "autotune_noise",
    "cache_dir",
)
_ROUTE_SET = frozenset(_ROUTE_SETTINGS)
_cfg_gen = config._generation
_cfg_overrides = config._overrides
_routes_gen = [_cfg_gen[0]]
_routes_stamp: list[Any] = [config.stamp(_ROUTE_SETTINGS)]
# the raw TORCHPORT_NATIVE environment entry when the native routes were last (re)validated
_env_data = config._env_data
_NATIVE_ENV = config._env_key(config.SETTINGS["native"].env)
_native_env: list[Any] = [_env_data.get(_NATIVE_ENV)]


def _drop_routes() -> None:
    """Forget every route learned in this process (the persistent tuner cache stays)."""
    _memo.clear()
    _fast.clear()
    for keys in _lapack_fast.values():
        keys.clear()
    _chol_native.clear()
    _qr_native.clear()
    for table in _one.values():
        table.clear()


def _sync_routes() -> None:
    """Drop every cached route if a setting that decides routes changed since they were made."""
    st = config.stamp(_ROUTE_SETTINGS)
    if st is None or (st == _routes_stamp[0] and _routes_gen[0] == _cfg_gen[0]):
        return  # under an override: fast hits are still valid (see _route), nothing to drop
    _drop_routes()
    _routes_stamp[0] = st
    _routes_gen[0] = _cfg_gen[0]
    _native_env[0] = _env_data.get(_NATIVE_ENV)


def _lapack_known(op: str, a: object, extra: tuple[Any, ...]) -> bool:
    """True if ``method="auto"`` already routed this exact problem to ``torch.linalg`` and no
    setting changed since: the cheapest check there is, run before any validation (keys are
    stored only for valid calls). The public functions inline this test."""
    return (
        type(a) is torch.Tensor
        and (a.shape, a.dtype, *extra) in _lapack_fast[op]
        and _routes_gen[0] == _cfg_gen[0]
    )


def _check_method(fn: str, method: object) -> None:
    if method not in METHODS:
        raise LinalgInputError(
            f"torchport.linalg.{fn}: method must be one of {METHODS}, got {method!r}"
        )


def _not_bool(fn: str, name: str, value: object) -> None:
    """Raise for a boolean option that is not a bool: torch.linalg takes Python bools only
    (TypeError for 0/1, numpy bools, strings), and ``bool("False")`` is True."""
    raise _LinalgTypeError(
        f"torchport.linalg.{fn}: {name} must be a bool, got {type(value).__name__} {value!r}"
    )


def _route(
    op: str,
    a: torch.Tensor,
    method: str,
    extra: tuple[Any, ...],
    public: Any = None,
    fn: str | None = None,
) -> str:
    """'native', 'lapack' or 'reference' for this call; ``public`` is the options as the public
    function's inline LAPACK test spells them (default ``extra``); ``fn`` the public function
    that errors name (default ``op``)."""
    if torch.compiler.is_dynamo_compiling():
        # No tuning while dynamo traces (nor can it trace the settings and route tables):
        # "jacobi" is the native kernels' custom ops (fake shapes), "auto" torch.linalg.
        _check_method(fn or op, method)
        return "native" if method == "jacobi" else "lapack"
    if _transformed():
        # torch.linalg, which every transform supports; not learned as this problem's route
        # (the shapes seen here are the per-sample ones of a vmap)
        _check_method(fn or op, method)
        if method == "jacobi":
            native.note_fallback(
                f"linalg.{op} under torch.func or forward AD",
                "the native kernels have no batching rule or forward-mode formula",
            )
        return "lapack"
    _sync_routes()
    if method == "auto":
        fast = (op, a.shape, a.dtype, a.device, extra)
        hit_route = _fast.get(fast)
        if hit_route is not None and (hit_route == "lapack" or native.enabled()):
            return hit_route
    _check_method(fn or op, method)
    if method == "lapack" or a.device.type == "meta":
        # meta tensors hold no values: torch.linalg's meta kernels give the shapes and dtypes
        # every method returns (the reference algorithms of "jacobi" read values)
        return "lapack"
    if a.device.type != "cpu":
        return "reference" if method == "jacobi" else "lapack"
    if not native.enabled():
        if method == "jacobi":
            native.note_fallback(f"linalg.{op}", "native kernels are disabled (TORCHPORT_NATIVE=0)")
        return "lapack"
    if method == "jacobi":
        return "native"
    m, n = a.shape[-2:]
    if min(m, n) == 0 or a.numel() == 0:
        return "native"
    b = a.numel() // (m * n)
    # a power-of-two bucket can straddle the lane batch (float32: 9-16 in one bucket, only 16
    # fills the lanes), and the two sides run different kernels: keyed apart
    lanes = kernels.runs_lanes(op, b, m, n, a.dtype)
    key = (op, _bucket(b), lanes, m, n, a.dtype, extra)
    hit = _memo.get(key)
    if hit is None:
        hit = _tune(op, key, b)
        _memo[key] = hit
    route = "native" if hit else "lapack"
    _fast[(op, a.shape, a.dtype, a.device, extra)] = route
    if route == "lapack":
        _lapack_fast[op].add((a.shape, a.dtype, *(extra if public is None else public)))
    return route


def _one_learn(
    fn: str, a: torch.Tensor, public: tuple[Any, ...], make: Callable[[], Callable[..., Any]]
) -> Callable[..., Any] | None:
    """The one-matrix launcher for ``a``, remembered under public function ``fn``'s key, if
    ``a`` is a single matrix the launchers take, on a plain eager CPU call (nothing to record
    for autograd, no tracing) outside any override of a routing setting; else None. For calls
    that ``method="auto"`` routed to the native kernels."""
    m, n = a.shape[-2:]
    if not (
        a.numel() == m * n
        and one.fits(m, n)
        and a.is_cpu
        and native.eager_fast_path(a)
        and _neutral_overrides()
    ):
        return None
    table = _one[fn]
    if len(table) >= 4096:  # bound the table for programs with ever-new shapes
        table.clear()
    run = table[(a.shape, a.dtype, *public)] = make()
    return run


def _time_pair(
    fa: Callable[[torch.Tensor], Any], fb: Callable[[torch.Tensor], Any], x: torch.Tensor
) -> tuple[float, float]:
    """Median seconds of ``fa(x)`` and ``fb(x)``, timed alternately so a burst of load on a
    shared machine hits both alike (:func:`torchport.autotune.interleaved`)."""
    reps = max(5, int(config.get("autotune_reps")))
    ta, tb = autotune.interleaved([fa, fb], [(x,)], reps=reps)
    return ta, tb


# Calls whose torch.linalg side the tuner timed under this get their verdict, either way, from
# _time_short once per process. At 10-25 us a call the tuner's samples (medians of 15, one side
# after the other) flipped with the load of the moment: three fresh-cache processes chose native,
# native and LAPACK for float32 Cholesky B = 100 n = 3, the last at 25.4 us a call against 16.7
# for native in that same process. Decided by alternated minima, the re-check costs a few ms.
SHORT_CALL_S = 50e-6
# _time_short's rounds, the length of one timed group of calls, and its time cap (nominally
# 60 x 2 x 100 us = 12 ms; 29-32 ms measured for float32 eigh B = 100 n = 2 at load 6; under
# such load torch.linalg's batched calls can take ms, waiting for their second thread)
SHORT_ROUNDS = 60
SHORT_GROUP_S = 100e-6
SHORT_MAX_S = 0.25


def _time_short(
    fa: Callable[[torch.Tensor], Any], fb: Callable[[torch.Tensor], Any], x: torch.Tensor
) -> tuple[float, float]:
    """Least seconds per call of ``fa(x)`` and ``fb(x)`` over :data:`SHORT_ROUNDS` alternated
    rounds of groups of about :data:`SHORT_GROUP_S` (:func:`torchport.autotune.alternated_min`):
    robust to load for calls of a few to tens of µs, where medians of single calls are not."""
    fa(x)
    t0 = _timing.clock()
    fa(x)
    once = max(_timing.clock() - t0, 1e-7)
    group = max(1, min(64, round(SHORT_GROUP_S / once)))
    ta, tb = autotune.alternated_min(
        [fa, fb], (x,), rounds=SHORT_ROUNDS, group=group, max_time_s=SHORT_MAX_S
    )
    return ta, tb


# What the tuner times, part of every choice's key: a change of the timed path re-tunes.
TUNED_ON = (
    "call batch (capped, not below the lane batch for a lane call; lane side in the key), "
    "routed path (cholesky and qr: resolved launcher; one matrix: one-matrix launcher, batched "
    "route beyond it; cholesky against its LAPACK route), confirmed interleaved"
)


def _tune_batch(op: str, b: int, m: int, n: int, dtype: torch.dtype) -> int:
    """The batch the tuner times for a call of ``b`` m x n matrices: ``b`` capped so that one
    anchor call stays around a few ms (m·n·min(m, n)·batch ≤ 2²¹), but never capped below
    ``kernels.lane_batch`` when the call runs the lane kernel (``kernels.runs_lanes``: from that
    batch, within the op's lane sizes): under it another kernel runs. Beyond the lane sizes the
    cap stands (a floor there would only make first calls dearer). Capped at 8, a call of 100
    float32 64 x 64 matrices was tuned on the one-matrix-per-thread eigh (0.41x
    torch.linalg.eigh at B = 8) and kept LAPACK, where its lane kernel runs 2.9x (B = 16) to
    4.2x (B = 100) faster."""
    cap = (1 << 21) // max(1, m * n * min(m, n))
    if kernels.runs_lanes(op, b, m, n, dtype):
        cap = max(cap, kernels.lane_batch(dtype))
    return max(1, min(b, cap))


def _refuse_tuning_in_capture(op: str, b: int, m: int, n: int, dtype: torch.dtype) -> None:
    """Tuning inside a graph capture: a ``CaptureError`` naming the op and the warm-up that
    avoids it, instead of the capture's refusal of the tuner's probe input (``aten.randn.generator
    takes an explicit torch.Generator``), which named neither."""
    from torchport.graphs.capture import CaptureError, current_recorder

    if current_recorder() is not None:
        raise CaptureError(
            f"torchport.linalg.{op}: the first call for a batch of {b} {m}x{n} {dtype} matrices "
            "tunes the native kernels against torch.linalg (random probe inputs, timed runs), "
            "which a graph capture cannot record; call it outside the capture (a warm-up call "
            "before it fixes the route, but only a LAPACK route without an error check, such as "
            "qr's, can then be recorded: the native kernels are not ATen ops, and torch.linalg's "
            "eigh/svd/cholesky read their error flag as a Python value)"
        )


def _tune(op: str, key: tuple[Any, ...], b: int) -> bool:
    """Ask the autotuner (persistent cache) whether the native kernel beats torch.linalg.

    Tuning runs on the batch of the call that triggered it (capped: :func:`_tune_batch`), not
    on the top of its bucket. A native win, fresh or cached, is then
    confirmed once per process by timing both alternately on that batch: the native kernel is
    used only if it still beats ``torch.linalg`` by more than ``config.autotune_noise``.
    Short calls (``torch.linalg`` under :data:`SHORT_CALL_S`) whose native side passed the
    tuner's check are decided that way whichever side the tuner chose, by alternated minima
    (:func:`_time_short`): there one sample of load could crown either side.
    """
    _, bucket, lanes, m, n, dtype, extra = key
    k = min(m, n)
    tb = _tune_batch(op, b, m, n, dtype)

    def make_args() -> tuple[torch.Tensor]:
        _refuse_tuning_in_capture(op, b, m, n, dtype)
        g = autotune.sample_generator()
        wide = torch.complex128 if dtype.is_complex else torch.float64
        x = torch.randn((tb, m, n), generator=g, dtype=wide)
        if op in ("eigh", "cholesky"):
            x = x @ x.mH + n * torch.eye(n, dtype=wide)
        return (x.to(dtype).contiguous(),)

    def factory(c: Candidate) -> Callable[[torch.Tensor], Any]:
        if c.is_anchor:
            return _anchor(op, extra)
        if k > NATIVE_MAX_N[op]:
            raise InvalidCandidate(f"min(m, n) = {k} > {NATIVE_MAX_N[op]}: LAPACK territory")
        return _candidate_fn(op, extra, bucket, m, n, dtype)

    choice = autotune.select(
        f"linalg.{op}",
        {
            "batch": bucket,
            "lanes": lanes,
            "m": m,
            "n": n,
            "dtype": str(dtype),
            "options": list(extra),
            "kernels": _kernels_tag(op, dtype),
            "tuned_on": TUNED_ON,
        },
        [Candidate("torch.linalg", ATEN), Candidate("native")],
        factory,
        make_args,
        cold=False,
        check=_close_at(_VALUES_AT[op]),
        backends={"NATIVE", "ATEN"},
    )
    t_anchor = choice.timings_s.get("torch.linalg")
    # a native side that was timed passed the tuner's check against torch.linalg's result
    short = "native" in choice.timings_s and t_anchor is not None and t_anchor < SHORT_CALL_S
    if choice.candidate.is_anchor and not short:
        return False
    (x,) = make_args()
    fn = _candidate_fn(op, extra, bucket, m, n, dtype)
    timer = _time_short if short else _time_pair
    t_lapack, t_native = timer(_anchor(op, extra), fn, x)
    return autotune.beats_anchor(t_native, t_lapack)


def _kernels_tag(op: str, dtype: torch.dtype) -> str:
    """The source tag of the kernels ``op`` runs for ``dtype``, part of the tuner's key."""
    if not dtype.is_complex:
        return kernels.SOURCE_TAG
    return complex_jacobi.SOURCE_TAG if op in ("svd", "eigh") else complex_factor.SOURCE_TAG


def _candidate_fn(
    op: str, extra: tuple[Any, ...], bucket: int, m: int, n: int, dtype: torch.dtype
) -> Callable[[torch.Tensor], Any]:
    """The native path a routed call of this problem runs: for one matrix the one-matrix
    launcher within its sizes (``_one_candidate``), else the batched route (for one matrix
    beyond the launcher's sizes, what the public functions run when ``_one_learn`` declines).
    One matrix used to be LAPACK's beyond the launcher, but the blocked Cholesky beat
    ``torch.linalg.cholesky`` on a single matrix of n = 64…512 by 1.3-3.3x (f32 n = 64 1.70x,
    128 3.32x, 512 1.44x; f64 64 1.32x, 512 1.60x; interleaved medians, load 2.1-2.6)."""
    if bucket == 1 and _one_candidate(op, m, n):
        return _one_fn(op, extra, m, n, dtype)
    return _native_fn(op, extra)


def _anchor(op: str, extra: tuple[Any, ...]) -> Callable[[torch.Tensor], Any]:
    """torch.linalg as the tuner times it; Cholesky as ``cholesky``'s LAPACK route runs it
    (cholesky_ex, then info read). Timed as bare ``cholesky_ex`` the anchor was ≈ 2 µs cheaper
    than that route, which at B = 100, n = 3 (≈ 11 µs calls) kept LAPACK although the native
    launcher beat the route ``cholesky`` then took (auto 0.92-0.94× ``torch.linalg.cholesky``
    in the ninth, eleventh and twelfth sessions' quick grids)."""
    if op == "svd":
        full, uv = extra
        if uv:
            return lambda x: tuple(torch.linalg.svd(x, full_matrices=full))
        return lambda x: (None, torch.linalg.svdvals(x), None)
    if op == "eigh":
        upper, wantv = extra
        uplo = "U" if upper else "L"
        if wantv:
            return lambda x: tuple(torch.linalg.eigh(x, UPLO=uplo))
        return lambda x: (torch.linalg.eigvalsh(x, UPLO=uplo), None)
    if op == "qr":
        (mode,) = extra
        return lambda x: tuple(torch.linalg.qr(x, mode=mode))
    (upper,) = extra
    return lambda x: (_chol_lapack(x, upper),)


def _chol_lapack(a: torch.Tensor, upper: bool) -> torch.Tensor:
    """``cholesky``'s LAPACK route on a CPU tensor (inlined there)."""
    fac, info = torch.linalg.cholesky_ex(a, upper=True) if upper else _chol_ex(a)
    if _info_bad(info):
        _raise_not_pd("cholesky", a, info)
    return fac


# all-zero info bytes per byte count, compared against (bounded: one entry per batch size seen)
_zero_info: dict[int, bytes] = {}


def _info_bad(info: torch.Tensor) -> bool:
    """Whether a CPU ``cholesky_ex`` info tensor flags any matrix: ``item()`` for one matrix
    (0.21 us against 0.80 for the byte read, which a 13 us call of n = 32 felt: auto measured
    0.93-0.95x ``torch.linalg.cholesky`` there), for a batch its bytes compared with as many
    zero bytes (one memcmp: B = 100 1.06 us, B = 10000 3.0 us, where stripping the zeros took
    2.0-5.1 and 102 us, a sixth of a 600 us call at n = 2; alternated minima, load 3-4)."""
    if info.dim() == 0:
        return bool(info.item())
    nb = 4 * info.numel()
    zeros = _zero_info.get(nb)
    if zeros is None:
        if len(_zero_info) >= 64:
            _zero_info.clear()
        zeros = _zero_info[nb] = bytes(nb)
    return _string_at(info.data_ptr(), nb) != zeros


def _native_fn(op: str, extra: tuple[Any, ...]) -> Callable[[torch.Tensor], Any]:
    # the path a routed call takes (ops.*: custom op, reshapes, error checks), not the bare
    # launcher: at ~20 us sizes the difference decides which side wins
    if op == "svd":
        return lambda x: ops.svd(x, extra[0], extra[1])
    if op == "eigh":
        return lambda x: ops.eigh(x, extra[0], extra[1])
    if op == "qr":  # a routed eager QR runs the resolved launcher (see qr)
        return lambda x: _qr_plan(x, extra[0])(x)
    # a routed eager Cholesky runs the resolved launcher (_cholesky_ex), so that is what is timed
    return lambda x: _cholesky_ex(x, extra[0], False, "native")


def _one_fn(
    op: str, extra: tuple[Any, ...], m: int, n: int, dtype: torch.dtype
) -> Callable[[torch.Tensor], Any]:
    """The one-matrix launcher a routed call of one m x n matrix runs, as ``_anchor``'s
    outputs are laid out (tuned on a (1, m, n) input)."""
    shape = torch.Size((1, m, n))
    if op == "svd":
        full, uv = extra
        svd_run = one.svd_plan(shape, dtype, full, uv)
        return svd_run if uv else (lambda x: (None, svd_run(x), None))
    if op == "eigh":
        upper, wantv = extra
        eigh_run = one.eigh_plan(shape, dtype, upper, wantv)
        return eigh_run if wantv else (lambda x: (eigh_run(x), None))
    if op == "qr":
        return one.qr_plan(shape, dtype, extra[0])
    # the cholesky launcher (cholesky_ex's differs by an info tensor: 4.9 vs 3.7 us at n = 2,
    # against 6.2 us for torch.linalg.cholesky_ex and 8.0 for cholesky's LAPACK route)
    chol_run = one.cholesky_plan(shape, dtype, extra[0], _raise_not_pd)
    return lambda x: (chol_run(x),)


_VALUES_AT = {"svd": 1, "eigh": 0, "qr": 1, "cholesky": 0}


def _close_at(i: int) -> Callable[[Any, Any], bool]:
    """Gauge-invariant agreement used by the tuner: compare output ``i`` (S, L, R or the factor)
    in absolute value, relative to its largest entry."""

    def close(out: Any, ref: Any) -> bool:
        ours, theirs = out[i], ref[i]
        if ours.shape != theirs.shape:
            return False
        tol = 1e-3 if ours.dtype in (torch.float32, torch.complex64) else 1e-8
        scale = max(1.0, float(theirs.abs().max())) if theirs.numel() else 1.0
        return bool(torch.allclose(ours.abs(), theirs.abs(), rtol=tol, atol=tol * scale))

    return close


# --- public API ----------------------------------------------------------------------------------


def svd(
    A: torch.Tensor,
    full_matrices: bool = True,
    *,
    driver: str | None = None,
    method: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Singular value decomposition ``A = U diag(S) Vh`` (``torch.linalg.svd``'s contract).

    Returns ``(U, S, Vh)`` with S descending; ``full_matrices`` picks (m×m, n×n) or reduced
    (m×k, k×n) factors, k = min(m, n). U and Vh stay orthonormal for rank-deficient input.
    ``driver``: None (as torch for CPU tensors; a cuSOLVER name raises).
    """
    if driver is not None:
        _driver("svd", driver)
    if full_matrices is not True and full_matrices is not False:  # (1 == True in the keys)
        _not_bool("svd", "full_matrices", full_matrices)
    if method == "auto" and type(A) is torch.Tensor:
        key = (A.shape, A.dtype, full_matrices, True)
        if key in _lk_svd and _routes_gen[0] == _cfg_gen[0]:
            return torch.linalg.svd(A, full_matrices)
        run = _one_svd.get(key)
        if run is not None and _native_ok(A):
            return run(A)
    a = _check("svd", A, square=False)
    route = _route("svd", a, method, (full_matrices, True))
    if route == "lapack":
        return torch.linalg.svd(a, full_matrices=full_matrices)
    if route == "native" and method == "auto":
        run = _one_learn(
            "svd",
            a,
            (full_matrices, True),
            lambda: one.svd_plan(a.shape, a.dtype, full_matrices, True),
        )
        if run is not None:
            return run(a)
    if route == "reference":
        flat = ops._flat(a)
        bad = _non_finite_at(flat)
        if bad:  # as the native routes: torch.linalg's answer
            return ops.non_finite("svd", a, bad, lambda: torch.linalg.svd(a, full_matrices))
        ref = complex_svd_reference if a.is_complex() else svd_reference
        u, s, vh = ref(flat, full_matrices)
        batch = a.shape[:-2]
        u, s, vh = (t.reshape(batch + t.shape[1:]) for t in (u, s, vh))
    else:
        u, s, vh = ops.svd(a, full_matrices, True)
    return _rt.linalg_svd((u, s, vh))


def svdvals(A: torch.Tensor, *, driver: str | None = None, method: str = "auto") -> torch.Tensor:
    """Singular values of ``A``, descending (``torch.linalg.svdvals``; ``driver`` as in
    :func:`svd`)."""
    if driver is not None:
        _driver("svdvals", driver)
    if method == "auto" and type(A) is torch.Tensor:
        key = (A.shape, A.dtype, False, False)
        if key in _lk_svd and _routes_gen[0] == _cfg_gen[0] and not A.requires_grad:
            return torch.linalg.svdvals(A)
        run = _one_svdvals.get(key)
        if run is not None and _native_ok(A):
            return run(A)
    a = _check("svdvals", A, square=False)
    if a.requires_grad and torch.is_grad_enabled():
        _check_method("svdvals", method)
        return svd(a, full_matrices=False, method=method)[1]
    route = _route("svd", a, method, (False, False), fn="svdvals")
    if route == "lapack":
        return torch.linalg.svdvals(a)
    if route == "native" and method == "auto":
        run = _one_learn(
            "svdvals", a, (False, False), lambda: one.svd_plan(a.shape, a.dtype, False, False)
        )
        if run is not None:
            return run(a)
    if route == "reference":
        flat = ops._flat(a)
        bad = _non_finite_at(flat)
        if bad:  # as the native routes: torch.linalg's answer
            return ops.non_finite("svd", a, bad, lambda: torch.linalg.svdvals(a))
        ref = complex_svd_reference if a.is_complex() else svd_reference
        s = ref(flat, False, compute_uv=False)[1]
        return s.reshape(a.shape[:-2] + s.shape[-1:])
    return ops.svd(a, False, False)[1]


def _non_finite_at(flat: torch.Tensor) -> int:
    """1 + the first batch index of ``flat`` (B, m, n) holding a NaN or inf, or 0 (the native
    kernels' report, for the reference route, whose algorithms just return NaNs)."""
    finite = torch.isfinite(flat).flatten(-2).all(-1)
    if bool(finite.all()):
        return 0
    return int((~finite).nonzero()[0, 0]) + 1


def _uplo(op: str, UPLO: str) -> bool:
    if UPLO not in ("L", "U", "l", "u"):  # (torch takes either case)
        err = LinalgInputError if isinstance(UPLO, str) else _LinalgTypeError
        raise err(f"torchport.linalg.{op}: UPLO must be 'L' or 'U', got {UPLO!r}")
    return UPLO in ("U", "u")


def _driver(op: str, driver: str | None) -> None:
    """``driver=``, as torch on CPU tensors: None only (it names a cuSOLVER routine)."""
    if driver is not None:
        raise (LinalgInputError if isinstance(driver, str) else _LinalgTypeError)(
            f"torchport.linalg.{op}: driver= is only supported on CUDA inputs (cuSOLVER), "
            f"got {driver!r}"
        )


def eigh(
    A: torch.Tensor, UPLO: str = "L", *, method: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigendecomposition of symmetric (Hermitian) ``A`` from its ``UPLO`` triangle (``torch.linalg.eigh``).

    Returns ``(eigenvalues, eigenvectors)``, eigenvalues ascending, eigenvectors as columns.
    """
    # (UPLO a str: the keys hash it, and an unhashable one gets _uplo's typed error below)
    if method == "auto" and type(A) is torch.Tensor and type(UPLO) is str:
        key = (A.shape, A.dtype, UPLO, True)
        if key in _lk_eigh and _routes_gen[0] == _cfg_gen[0]:
            return torch.linalg.eigh(A, UPLO)
        run = _one_eigh.get(key)
        if run is not None and _native_ok(A):
            return run(A)
    a = _check("eigh", A, square=True)
    upper = _uplo("eigh", UPLO)
    route = _route("eigh", a, method, (upper, True), (UPLO, True))
    if route == "lapack":
        return torch.linalg.eigh(a, UPLO=UPLO)
    if route == "native" and method == "auto":
        run = _one_learn(
            "eigh", a, (UPLO, True), lambda: one.eigh_plan(a.shape, a.dtype, upper, True)
        )
        if run is not None:
            return run(a)
    if route == "reference":
        flat = ops._flat(a)
        bad = ops.read_triangle(flat, upper)[1]
        if bad:  # as the native routes: torch.linalg's answer
            return ops.non_finite("eigh", a, bad, lambda: torch.linalg.eigh(a, UPLO))
        ref = complex_eigh_reference if a.is_complex() else eigh_reference
        lam, q = ref(flat, upper)
        lam, q = lam.reshape(a.shape[:-1]), q.reshape(a.shape)
    else:
        lam, q = ops.eigh(a, upper, True, method == "jacobi")
    return _rt.linalg_eigh((lam, q))


def eigvalsh(A: torch.Tensor, UPLO: str = "L", *, method: str = "auto") -> torch.Tensor:
    """Eigenvalues of symmetric (Hermitian) ``A``, ascending (``torch.linalg.eigvalsh``)."""
    if method == "auto" and type(A) is torch.Tensor and type(UPLO) is str:  # (as in eigh)
        key = (A.shape, A.dtype, UPLO, False)
        if key in _lk_eigh and _routes_gen[0] == _cfg_gen[0] and not A.requires_grad:
            return torch.linalg.eigvalsh(A, UPLO)
        run = _one_eigvalsh.get(key)
        if run is not None and _native_ok(A):
            return run(A)
    a = _check("eigvalsh", A, square=True)
    upper = _uplo("eigvalsh", UPLO)
    if a.requires_grad and torch.is_grad_enabled():
        _check_method("eigvalsh", method)
        return eigh(a, UPLO, method=method)[0]
    route = _route("eigh", a, method, (upper, False), (UPLO, False), fn="eigvalsh")
    if route == "lapack":
        return torch.linalg.eigvalsh(a, UPLO=UPLO)
    if route == "native" and method == "auto":
        run = _one_learn(
            "eigvalsh", a, (UPLO, False), lambda: one.eigh_plan(a.shape, a.dtype, upper, False)
        )
        if run is not None:
            return run(a)
    if route == "reference":
        flat = ops._flat(a)
        bad = ops.read_triangle(flat, upper)[1]
        if bad:  # as the native routes: torch.linalg's answer
            return ops.non_finite("eigh", a, bad, lambda: torch.linalg.eigvalsh(a, UPLO))
        ref = complex_eigh_reference if a.is_complex() else eigh_reference
        return ref(flat, upper, compute_v=False)[0].reshape(a.shape[:-1])
    return ops.eigh(a, upper, False, method == "jacobi")[0]


def qr(
    A: torch.Tensor, mode: str = "reduced", *, method: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Householder QR ``A = Q R`` (``torch.linalg.qr``); ``mode`` is reduced, complete or r.

    With ``mode='r'`` Q is an empty tensor, as in torch. R's diagonal follows LAPACK's signs.
    """
    # (mode and method str: the keys hash them, and unhashable ones get the typed errors below)
    if method == "auto" and type(A) is torch.Tensor and type(mode) is str:
        key = (A.shape, A.dtype, mode)
        if key in _lk_qr and _routes_gen[0] == _cfg_gen[0]:
            return torch.linalg.qr(A, mode)
        run = _one_qr.get(key)
        if run is not None and _native_ok(A):
            return run(A)
    # a problem already routed to the native kernel: its launcher
    if type(A) is torch.Tensor and type(mode) is str and type(method) is str:
        run = _qr_native.get((method, A.shape, A.dtype, mode))
        if run is not None and _native_ok(A):
            return _rt.linalg_qr(run(A))
    a = _check("qr", A, square=False)
    if mode not in QR_MODES:
        err = LinalgInputError if isinstance(mode, str) else _LinalgTypeError
        raise err(f"torchport.linalg.qr: mode must be one of {QR_MODES}, got {mode!r}")
    route = _route("qr", a, method, (mode,))
    if route == "lapack":
        return torch.linalg.qr(a, mode=mode)
    if route == "native" and method == "auto":
        run = _one_learn("qr", a, (mode,), lambda: one.qr_plan(a.shape, a.dtype, mode))
        if run is not None:
            return run(a)
    learn = route == "native" and a.is_cpu and a.numel() and not _compiling()
    if learn and _neutral_overrides():
        if len(_qr_native) >= 4096:  # bound the table for programs with ever-new shapes
            _qr_native.clear()
        _qr_native[(method, a.shape, a.dtype, mode)] = run = _qr_plan(a, mode)
        if native.eager_fast_path(a):
            return _rt.linalg_qr(run(a))
    if route == "reference":
        q, r = qr_reference(ops._flat(a), mode)
        batch = a.shape[:-2]
        q = q.reshape(batch + q.shape[1:]) if mode != "r" else q
        r = r.reshape(batch + r.shape[1:])
    else:
        q, r = ops.qr(a, mode)
    return _rt.linalg_qr((q, r))


def cholesky_ex(
    A: torch.Tensor, *, upper: bool = False, check_errors: bool = False, method: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cholesky factor and ``info`` (``torch.linalg.cholesky_ex``).

    ``info`` (int32, batch-shaped) is 0 on success, else the order of the leading minor that is
    not positive-definite; the factor of such a matrix is zero. ``check_errors=True`` raises
    like :func:`cholesky` instead.
    """
    if upper is not False and upper is not True:  # (1 == True in the keys; bool("False"))
        _not_bool("cholesky_ex", "upper", upper)
    if check_errors is not False and check_errors is not True:
        _not_bool("cholesky_ex", "check_errors", check_errors)
    if method == "auto" and type(A) is torch.Tensor:
        key = (A.shape, A.dtype, upper)
        if key in _lk_chol and _routes_gen[0] == _cfg_gen[0]:
            if upper or check_errors:
                return torch.linalg.cholesky_ex(A, upper=upper, check_errors=check_errors)
            return _chol_ex(A)  # no keywords to parse: +0.5-0.9 us over torch, was +0.8-1.2
        run = _one_chol_ex.get(key)
        if run is not None and _native_ok(A):
            return run(A, check_errors)
    got = _chol_routed_native(A, upper, method)
    if got is not None:
        if check_errors and got[2]:
            _raise_not_pd("cholesky_ex", A, got[1])
        return _rt.linalg_cholesky_ex(got[:2])
    a = _check("cholesky_ex", A, square=True)
    route = _route("cholesky", a, method, (upper,), fn="cholesky_ex")
    if route == "native" and method == "auto":
        run = _one_learn(
            "cholesky_ex",
            a,
            (upper,),
            lambda: one.cholesky_ex_plan(a.shape, a.dtype, upper, _raise_not_pd),
        )
        if run is not None:
            return run(a, check_errors)
    _learn_native(a, upper, method, route)
    return _cholesky_ex(a, upper, check_errors, route)


def _learn_native(a: torch.Tensor, upper: bool, method: str, route: str) -> None:
    """Remember the launcher of a CPU Cholesky that ``method`` routed to native, for repeats
    (not under an override of a routing setting: the fast path assumes the settings it was
    learned with)."""
    learn = route == "native" and a.is_cpu and a.numel() and not _compiling()
    if learn and _neutral_overrides():
        if len(_chol_native) >= 4096:  # bound the table for programs with ever-new shapes
            _chol_native.clear()
        _chol_native[(method, a.shape, a.dtype, upper)] = _chol_plan(a, upper)


def _chol_plan(
    a: torch.Tensor, upper: bool
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, int]]:
    """The resolved native launcher for ``a``'s shape (kernels.cholesky_plan), cached."""
    key = (a.shape, a.dtype, upper)
    run = _chol_plans.get(key)
    if run is None:
        if len(_chol_plans) >= 4096:  # bound the cache for programs with ever-new shapes
            _chol_plans.clear()
        n = a.shape[-1]
        plan = complex_factor.cholesky_plan if a.is_complex() else kernels.cholesky_plan
        run = plan(a.numel() // (n * n), n, a.dtype, upper, a.shape[:-2])
        _chol_plans[key] = run
    return run


_qr_plans: dict[tuple[Any, ...], Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]] = {}


def _qr_plan(
    a: torch.Tensor, mode: str
) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """The resolved native QR launcher for ``a``'s shape (kernels.qr_plan), cached; m, n ≥ 1."""
    key = (a.shape, a.dtype, mode)
    run = _qr_plans.get(key)
    if run is None:
        if len(_qr_plans) >= 4096:  # bound the cache for programs with ever-new shapes
            _qr_plans.clear()
        m, n = a.shape[-2:]
        plan = complex_factor.qr_plan if a.is_complex() else kernels.qr_plan
        run = plan(a.numel() // (m * n), m, n, a.dtype, mode, a.shape[:-2])
        _qr_plans[key] = run
    return run


def _cholesky_ex(
    a: torch.Tensor, upper: bool, check_errors: bool, route: str, op: str = "cholesky_ex"
) -> tuple[torch.Tensor, torch.Tensor]:
    if route == "lapack":
        return torch.linalg.cholesky_ex(a, upper=upper, check_errors=check_errors)
    if route == "reference":
        fac, info = cholesky_reference(ops._flat(a), upper)
        fac, info = fac.reshape(a.shape), info.reshape(a.shape[:-2])
    elif a.numel() and native.eager_fast_path(a):  # plain eager CPU call: resolved launcher
        fac, info, bad = _chol_plan(a, bool(upper))(a)
        if check_errors and bad:
            _raise_not_pd(op, a, info)
        return _rt.linalg_cholesky_ex((fac, info))
    elif check_errors and _compiling():  # the check inside the traced op
        return _rt.linalg_cholesky_ex(ops.cholesky_checked(a, bool(upper), op))
    else:
        fac, info = ops.cholesky_ex(a, bool(upper))
    if check_errors:
        _raise_not_pd(op, a, info)
    return _rt.linalg_cholesky_ex((fac, info))


def _raise_not_pd(op: str, a: torch.Tensor, info: torch.Tensor) -> None:
    if info.numel() == 0:
        return
    flat = info.reshape(-1)
    bad = torch.nonzero(flat)
    if bad.numel() == 0:
        return
    idx = int(bad[0, 0])
    where = f"(Batch element {idx}): " if a.dim() > 2 else ""
    raise torch.linalg.LinAlgError(
        f"torchport.linalg.{op}: {where}The factorization could not be completed because the "
        f"input is not positive-definite (the leading minor of order {int(flat[idx])} is not "
        "positive-definite)."
    )


def cholesky(A: torch.Tensor, *, upper: bool = False, method: str = "auto") -> torch.Tensor:
    """Cholesky factor ``L`` with ``A = L Lᴴ`` (or ``U`` with ``A = Uᴴ U``), ``torch.linalg.cholesky``.

    Raises ``torch.linalg.LinAlgError`` naming the batch element and the failing leading minor
    when ``A`` is not positive-definite (NaN counts as not positive-definite).
    """
    if upper is not False and upper is not True:  # (1 == True in the keys; bool("False"))
        _not_bool("cholesky", "upper", upper)
    if method == "auto" and type(A) is torch.Tensor:
        key = (A.shape, A.dtype, upper)
        if key in _lk_chol and _routes_gen[0] == _cfg_gen[0]:
            # (no data pointer for _info_bad then; while dynamo traces, _info_bad's .item() and
            # ctypes read broke a fullgraph=True compile once an eager call had routed the
            # shape to LAPACK)
            if not A.is_cpu or _functorch_active() or _compiling():
                return torch.linalg.cholesky(A, upper=upper)
            # torch.linalg.cholesky's own info check costs ~4 us a call (B = 100, n = 3: 15.1
            # vs 10.4 us for cholesky_ex, interleaved medians); testing info's bytes ~1 us
            # (the tuner times this as _chol_lapack)
            fac, info = torch.linalg.cholesky_ex(A, upper=True) if upper else _chol_ex(A)
            if _info_bad(info):
                _raise_not_pd("cholesky", A, info)
            return fac
        run = _one_chol.get(key)
        if run is not None and _native_ok(A):
            return run(A)
    got = _chol_routed_native(A, upper, method)
    if got is not None:
        if got[2]:
            _raise_not_pd("cholesky", A, got[1])
        return got[0]
    a = _check("cholesky", A, square=True)
    route = _route("cholesky", a, method, (upper,))
    if route == "native" and method == "auto":
        run = _one_learn(
            "cholesky",
            a,
            (upper,),
            lambda: one.cholesky_plan(a.shape, a.dtype, upper, _raise_not_pd),
        )
        if run is not None:
            return run(a)
    _learn_native(a, upper, method, route)
    if route == "lapack":
        return torch.linalg.cholesky(a, upper=upper)  # no info round trip on the LAPACK path
    return _cholesky_ex(a, upper, True, route, op="cholesky")[0]
