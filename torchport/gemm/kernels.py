"""Building and launching the generated GEMM kernels; the fp64 reference beside them.

Numerics the native path must match (:func:`mm_reference`: float64 matmul, float64 epilogue, one
rounding to the output dtype): float32 accumulates every product in float32 with FMA over all of K,
so the error bound is the usual ``K * eps32 * sum|a||b|`` (tests use ``2e-5 * sqrt(K)`` relative to
the output scale); bfloat16 inputs widen exactly to float32, accumulate in float32 and round once
(tests: two bf16 ulps of the output scale).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import subprocess
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from torchport import native
from torchport.autotune import InvalidCandidate
from torchport.gemm import rows, templates
from torchport.gemm.epilogue import EpilogueSpec, apply_torch, emit_c
from torchport.gemm.pack import _pack_fn, pack_cache

_TAG = {torch.float32: "f32", torch.bfloat16: "bf16"}

# Register tiles (MR, NR) compiled into every library, per ISA level.
TILES: dict[str, tuple[tuple[int, int], ...]] = {
    "avx2": ((6, 16), (4, 24), (8, 8), (2, 32), (1, 64)),
    # the last two: 24 accumulators, for M > 32 (large-M candidates in mm.py)
    "avx512": ((6, 32), (4, 48), (8, 16), (2, 64), (1, 128), (6, 64), (8, 48)),
    "scalar": ((4, 4), (1, 8)),
}


NO_EPILOGUE = EpilogueSpec()


class GemmInputError(ValueError, RuntimeError):
    """Inputs to a GEMM do not meet its requirements (shape, dtype, device).

    Also a ``RuntimeError``, the class ``torch.mm``/``F.linear`` raise for a K or dtype mismatch
    or a bias that does not broadcast (code catching torch's ``RuntimeError`` catches this too).
    """


@dataclass(frozen=True)
class Config:
    """One native variant: register tile, M block (``mc >= M`` streams B once), prefetch
    distance, K block ``kc`` (0: all of K at once; else partial sums in an fp32 buffer, so a
    ``kc x NR`` slice of B stays in L1 while the rows of an M block use it) and K-split ``ks``
    (> 1: the threads also split K, each summing its share into its own buffer, and a final pass
    adds the shares and applies the epilogue; for small M with large K and few N panels) and a
    thread cap ``nt`` (0: torch's intra-op threads; 1: one thread, which on a shared, loaded
    machine avoids waiting for a descheduled second thread at the end of a short kernel).
    ``dp`` (1): a ``vdpbf16ps`` tile (bf16 operands, AVX512-BF16; :data:`templates.DP_TILES`,
    whose "small" tiles run the weight-streaming pair-dot driver over whole K, ``mc`` unused);
    ``dp`` 2 (:data:`AMX`): the AMX-BF16 kernel, ``mr x nr`` 32 x 32, ``mc`` rows per chunk.
    ``nr`` 1: the row-streaming driver (:mod:`~torchport.gemm.rows`; ``B`` packed as ``[N, K]``
    rows, ``mr`` rows of ``A`` per register block, ``pf`` a non-temporal prefetch distance in
    bytes; ``mc``, ``kc``, ``ks`` unused), for M up to ``rows.MAX_M``."""

    mr: int
    nr: int
    mc: int
    pf: int = 0
    kc: int = 0
    ks: int = 1
    nt: int = 0
    dp: int = 0

    @property
    def name(self) -> str:
        if self.nr == 1:
            return f"r{self.mr}_pf{self.pf}" + (f"_nt{self.nt}" if self.nt else "")
        kind = {0: "t", 1: "dp", 2: "amx"}.get(self.dp, f"dp{self.dp}")
        base = f"{kind}{self.mr}x{self.nr}_mc{self.mc}_pf{self.pf}"
        opt = (f"_kc{self.kc}" if self.kc else "") + (f"_ks{self.ks}" if self.ks > 1 else "")
        return base + opt + (f"_nt{self.nt}" if self.nt else "")


def mm_reference(
    a: torch.Tensor,
    b: torch.Tensor,
    spec: EpilogueSpec = NO_EPILOGUE,
    operands: Sequence[torch.Tensor] = (),
) -> torch.Tensor:
    """``epilogue(a @ b)`` in float64, rounded once to the output dtype."""
    z = a.double() @ b.double()
    z = apply_torch(z, spec, [t.double() for t in operands])
    return z.to(spec.out_dtype(a.dtype))


def mm_aten(
    a: torch.Tensor, b: torch.Tensor, spec: EpilogueSpec, operands: Sequence[torch.Tensor]
) -> torch.Tensor:
    """The ATen path: ``addmm``/``mm`` then the epilogue as separate torch ops.

    A bfloat16 problem with a float32 output (``Cast(torch.float32)``) is multiplied in float32:
    the native kernels keep their float32 sums and round once, and a bfloat16 product had
    rounded them first (relative error ~2e-3 instead of ~1e-7, whenever the tuner picked ATen)."""
    ops = spec.ops
    if a.dtype == torch.bfloat16 and spec.out_dtype(a.dtype) == torch.float32:
        a, b = a.float(), b.float()
    if ops and ops[0].kind == "bias_col" and operands[0].dtype == a.dtype:
        z = apply_torch(torch.addmm(operands[0], a, b), spec, operands[1:], first=1)
    else:
        z = apply_torch(a @ b, spec, operands)
    out = spec.out_dtype(a.dtype)
    return z if z.dtype == out else z.to(out)


@functools.cache
def library(
    spec: EpilogueSpec, btag: str, otag: str, isa: str, mr: int, nr: int, dp: bool = False
) -> ctypes.CDLL:
    """Build (or load) the library of one tile variant for this epilogue and dtypes (``dp``:
    the ``vdpbf16ps`` tile; ``nr`` 1: the row-streaming driver)."""
    if nr == 1:
        body = rows.render_source(spec, btag, otag, isa, mr)
    else:
        body = templates.render_source(spec, btag, otag, isa, ((mr, nr),), dp)
    src = native.render(body.replace("$", "$$"))
    name = f"gemm_{'dp' if dp else ''}{btag}_{otag}_{isa}_{mr}x{nr}_e{len(spec.ops)}"
    # -O2: the tiles are explicit intrinsics with unroll pragmas; -O3 adds compile time, not speed
    return native.build(src, name=name, isa=isa, extra_flags=["-O2"])


def prebuild(
    spec: EpilogueSpec,
    btag: str,
    otag: str,
    isa: str,
    tiles: Sequence[tuple[int, int]],
    dp_tiles: Sequence[tuple[int, int]] = (),
    amx: bool = False,
) -> None:
    """Build several tile libraries (``dp_tiles``: ``vdpbf16ps`` ones; ``amx``: the AMX kernel)
    and the weight-packing kernels concurrently (one compiler process per core)."""
    with ThreadPoolExecutor(max_workers=max(1, native.cpu_info().cores)) as pool:

        def submit(fn: Callable[..., Any], *args: Any) -> Future[Any]:
            # each job runs in a copy of the caller's context: config overrides (cache_dir,
            # compiler flags) are context variables, which pool threads do not inherit; one
            # copy per job because a context cannot be entered by two threads at once
            return pool.submit(contextvars.copy_context().run, fn, *args)

        futures: list[Future[Any]] = [
            submit(library, spec, btag, otag, isa, mr, nr) for mr, nr in tiles
        ]
        futures += [submit(library, spec, btag, otag, isa, mr, nr, True) for mr, nr in dp_tiles]
        if amx:
            futures.append(submit(_amx_library, spec, otag))
        # B's own width; the pair packing runs the 32-bit kernel on k-pair words
        bits = {32 if btag == "f32" else 16} | ({32} if dp_tiles or amx else set())
        futures += [submit(_pack_fn, w) for w in sorted(bits)]
        if spec.ops:  # the ATen launch's epilogue pass (small-M adaptive runners)
            futures.append(submit(_pass_function, spec, btag, otag, isa))
        for f in futures:
            with contextlib.suppress(native.NativeError):  # reported when the candidate builds
                f.result()


@functools.cache
def _function(
    spec: EpilogueSpec, btag: str, otag: str, isa: str, mr: int, nr: int, dp: bool = False
) -> Any:
    lib = library(spec, btag, otag, isa, mr, nr, dp)
    p, i = ctypes.c_void_p, ctypes.c_int64
    argtypes = [p, i, p, i, i, p, i, i, i, i, i, p, p, i, i, i, p]
    return native.c_function(lib, f"tp_gemm_{mr}x{nr}", argtypes, ctypes.c_int)


def check_config(cfg: Config, isa: str) -> None:
    """Raise :class:`InvalidCandidate` if ``cfg`` is not compiled for ``isa``."""
    if cfg.dp == AMX:
        if isa != "avx512" or not amx_ready() or (cfg.mr, cfg.nr) != AMX_TILE:
            raise InvalidCandidate(
                f"AMX tile {cfg.mr}x{cfg.nr} needs AMX-BF16 and isa avx512 "
                f"(this machine: isa {isa}, AMX {amx_ready()})"
            )
        if cfg.kc % 32 or cfg.ks > 1 or cfg.pf > 64:
            raise InvalidCandidate(
                f"the AMX kernel takes kc a multiple of 32 (0: whole K), pf <= 64 k steps and "
                f"no ks, got {cfg}"
            )
    elif cfg.dp:
        small = (cfg.mr, cfg.nr) in templates.DP_TILES["small"]
        if (
            isa != "avx512"
            or not native.cpu_info().has_avx512_bf16
            or not (small or (cfg.mr, cfg.nr) in templates.DP_TILES["large"])
        ):
            raise InvalidCandidate(f"vdpbf16ps tile {cfg.mr}x{cfg.nr} is not built for isa {isa}")
        if cfg.ks > 1 or cfg.kc % 2 or (small and cfg.kc):
            raise InvalidCandidate(
                f"vdpbf16ps tiles need ks=1 and an even kc (kc=0 for the small-M tiles "
                f"{templates.DP_TILES['small']}), got {cfg}"
            )
    elif cfg.nr == 1:
        if isa not in ("avx2", "avx512") or cfg.mr not in rows.ROW_TILES:
            raise InvalidCandidate(
                f"row-streaming driver needs isa avx2/avx512 and mr in {rows.ROW_TILES}, "
                f"got isa {isa}, {cfg}"
            )
        if cfg.kc or cfg.ks > 1:
            raise InvalidCandidate(f"row-streaming driver takes no kc or ks, got {cfg}")
    elif (cfg.mr, cfg.nr) not in TILES[isa]:
        raise InvalidCandidate(f"tile {cfg.mr}x{cfg.nr} is not built for isa {isa}")
    if cfg.mc < 1 or cfg.pf < 0 or cfg.kc < 0 or cfg.ks < 1 or cfg.nt < 0:
        raise InvalidCandidate(f"mc must be >= 1, pf >= 0, kc >= 0, ks >= 1 and nt >= 0, got {cfg}")
    if cfg.kc and cfg.ks > 1:
        raise InvalidCandidate(
            f"K blocking and K-split do not combine, got kc={cfg.kc} ks={cfg.ks}"
        )


def prepare_operands(
    spec: EpilogueSpec, operands: Sequence[torch.Tensor]
) -> tuple[list[torch.Tensor], list[int]]:
    """Operands in the layout the kernel reads (unit column stride) and their row strides."""
    kept: list[torch.Tensor] = []
    lds: list[int] = []
    for t in operands:
        if t.dim() == 1:
            t = t.contiguous()
            lds.append(1)
        else:
            if t.shape[1] > 1 and t.stride(1) != 1:
                t = t.contiguous()
            lds.append(t.stride(0))
        kept.append(t)
    return kept, lds


_Launch = Callable[..., torch.Tensor]


def _deferred_workspace(numel: int) -> torch.Tensor:
    """The per-thread fp32 workspace of the deferred epilogue (at most DEFER_MAX_M rows): made
    once, not per call (torch.empty costs ~1 us of a fused call's budget); a thread runs one
    kernel at a time and the kernel is done with it when it returns."""
    return native.thread_scratch("gemm.deferred_epilogue", numel, torch.float32)


def _operand_args(
    spec: EpilogueSpec,
) -> Callable[[Sequence[torch.Tensor]], tuple[Any, Any, Sequence[torch.Tensor]]]:
    """The epilogue-operand argument blocks of one spec's kernels: a call's operands →
    (pointer array, leading-dimension array, the prepared operand tensors), the arrays as ctypes;
    a one-element null block when the epilogue has no operands. The caller must hold the
    returned tensors until the kernel returns: preparing may make new ones (a contiguous or
    broadcast copy of a scale), which the pointer array points into. Array types are built once
    per spec."""
    n_ops = max(1, spec.n_operands)
    ptrs_t, lds_t = ctypes.c_void_p * n_ops, ctypes.c_int64 * n_ops
    none = ((ctypes.c_void_p * 1)(0), (ctypes.c_int64 * 1)(0), ())

    def args(operands: Sequence[torch.Tensor]) -> tuple[Any, Any, Sequence[torch.Tensor]]:
        if not operands:
            return none
        # operands the kernel reads in place (the usual bias, residual): pointers and row
        # strides straight from the tensors, no prepared copies (~0.5 us less per fused call)
        ptrs: list[int] = []
        lds: list[int] = []
        for t in operands:
            st = t.stride()
            if len(st) == 1:
                if st[0] != 1 and t.shape[0] > 1:
                    break
                lds.append(1)
            else:
                if st[1] != 1 and t.shape[1] > 1:
                    break
                lds.append(st[0])
            ptrs.append(t.data_ptr())
        else:
            return ptrs_t(*ptrs), lds_t(*lds), operands
        ops, lds = prepare_operands(spec, operands)
        return ptrs_t(*[t.data_ptr() for t in ops]), lds_t(*lds), ops

    return args


@functools.cache
def launcher(
    spec: EpilogueSpec, cfg: Config, a_dtype: torch.dtype, b_dtype: torch.dtype, isa: str
) -> _Launch:
    """A launch function for one (epilogue, config, dtypes, ISA): everything that does not
    depend on the call's tensors (validation, library lookup, output dtype) is done once here,
    so a call costs a few tensor attribute reads and the ctypes call."""
    check_config(cfg, isa)
    dp = bool(cfg.dp)
    if dp and (a_dtype, b_dtype) != (torch.bfloat16, torch.bfloat16):
        raise InvalidCandidate(f"vdpbf16ps tiles need bf16 operands, got {a_dtype}, {b_dtype}")
    if cfg.dp == AMX:
        return _amx_launcher(spec, cfg, a_dtype)
    if dp and (cfg.mr, cfg.nr) in templates.DP_TILES["small"]:
        return _dp_launcher(spec, cfg, a_dtype)
    if cfg.nr == 1:
        return _rows_launcher(spec, cfg, a_dtype, b_dtype, isa)
    out_dtype = spec.out_dtype(a_dtype)
    fn = _function(spec, _TAG[b_dtype], _TAG[out_dtype], isa, cfg.mr, cfg.nr, dp)
    mr, nr, mc, pf, kc, ks, nt = cfg.mr, cfg.nr, cfg.mc, cfg.pf, cfg.kc, cfg.ks, cfg.nt
    f32 = torch.float32
    operand_args = _operand_args(spec)
    # no workspace for a deferred epilogue here: the driver applies a GELU/SiLU epilogue per
    # tile (for fp32 output too since templates.TILE_DEFER_MAX_M is 0; deferring bf16 output
    # would need W for the raw sums).
    # Measured bf16 M=8 1024->4096, tile 8x8, one thread, bias+GELU+residual over the bare
    # kernel: 1.042/1.042x deferred through W, 1.020/1.014x per tile (two A/B rounds)

    def launch(
        a: torch.Tensor,
        b: torch.Tensor,
        operands: Sequence[torch.Tensor],
        packed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        m, k = a.shape
        n = b.shape[1]
        c = torch.empty(m, n, dtype=out_dtype)
        if m == 0 or n == 0:
            return c
        if dp:  # bf16 A read in place as k pairs where it can be
            a32 = _pairs(a)
            k += k % 2
        else:
            a32 = a if a.dtype == f32 else a.float()
        if packed is None:
            packed = pack_cache.get(b, nr, pairs=dp)
        eptr, eld, _keep = operand_args(operands)  # _keep: alive until the call returns
        work: torch.Tensor | None = None
        if ks > 1:
            work = torch.empty(ks * m * n, dtype=f32)
        elif 0 < kc < k:  # K blocks' partial sums
            work = torch.empty(m * n, dtype=f32)
        threads = max(1, torch.get_num_threads())
        status = fn(
            c.data_ptr(),
            n,
            a32.data_ptr(),
            a32.stride(0),
            a32.stride(1),
            packed.data_ptr(),
            m,
            n,
            k,
            mc,
            pf,
            eptr,
            eld,
            min(nt, threads) if nt else threads,
            kc,
            ks,
            None if work is None else work.data_ptr(),
        )
        if status != 0:
            raise RuntimeError(f"tp_gemm_{mr}x{nr} returned status {status} for {cfg}")
        return c

    return launch


# --- bf16 on vdpbf16ps: A as k-pair words; the small-M tiles' own driver ----------------------------


def _pairs(a: torch.Tensor) -> torch.Tensor:
    """bf16 ``a [M, K]`` as the ``vdpbf16ps`` tiles read it, rows of whole k pairs on 32-bit
    boundaries: ``a`` itself when it is so laid out (unit column stride, even K, even row
    stride and offset), else a contiguous ``[M, K + K % 2]`` copy (a zero column when K is odd)."""
    m, k = a.shape
    if a.stride(1) == 1 and k % 2 == 0 and a.stride(0) % 2 == 0 and a.storage_offset() % 2 == 0:
        return a
    out = torch.empty(m, k + k % 2, dtype=a.dtype)
    out[:, :k] = a
    if k % 2:
        out[:, k] = 0
    return out


@functools.cache
def _dp_function(spec: EpilogueSpec, otag: str, mr: int, nr: int) -> Any:
    lib = library(spec, "bf16", otag, "avx512", mr, nr, True)
    p, i = ctypes.c_void_p, ctypes.c_int64
    argtypes = [p, i, p, i, p, i, i, i, i, p, p, i, p]
    return native.c_function(lib, f"tp_gemm_dp_{mr}x{nr}", argtypes, ctypes.c_int)


def _dp_launcher(spec: EpilogueSpec, cfg: Config, a_dtype: torch.dtype) -> _Launch:
    """:func:`launcher` of a small-M pair-dot tile (``templates.DP_TILES["small"]``; bf16
    operands, checked there): the weight-streaming driver over whole K, ``b`` pair-packed
    (:func:`~torchport.gemm.pack.pack_b_pairs`), ``a`` as :func:`_pairs`."""
    out_dtype = spec.out_dtype(a_dtype)
    fn = _dp_function(spec, _TAG[out_dtype], cfg.mr, cfg.nr)
    nr, pf, nt = cfg.nr, cfg.pf, cfg.nt
    operand_args = _operand_args(spec)
    defer_ws = spec.deferrable and out_dtype != torch.float32

    def launch(
        a: torch.Tensor,
        b: torch.Tensor,
        operands: Sequence[torch.Tensor],
        packed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        m, k = a.shape
        n = b.shape[1]
        c = torch.empty(m, n, dtype=out_dtype)
        if m == 0 or n == 0:
            return c
        if packed is None:
            packed = pack_cache.get(b, nr, pairs=True)
        a = _pairs(a)
        eptr, eld, _keep = operand_args(operands)  # _keep: alive until the call returns
        work = None
        if defer_ws and m <= templates.DEFER_MAX_M:
            work = _deferred_workspace(m * n)
        threads = max(1, torch.get_num_threads())
        status = fn(
            c.data_ptr(),
            n,
            a.data_ptr(),
            a.stride(0) // 2,
            packed.data_ptr(),
            m,
            n,
            (k + 1) // 2,
            pf,
            eptr,
            eld,
            min(nt, threads) if nt else threads,
            None if work is None else work.data_ptr(),
        )
        if status != 0:
            raise RuntimeError(f"tp_gemm_dp_{cfg.mr}x{nr} returned status {status} for {cfg}")
        return c

    return launch


# --- bf16 on AMX tiles (TDPBF16PS) -----------------------------------------------------------------

# Config.dp of the AMX kernel (1: the vdpbf16ps tiles), and its one output block (MR, NR)
AMX = 2
AMX_TILE = (templates.AMX_MR, templates.AMX_NR)


# set when the plainest AMX library fails to compile (a compiler without -mamx-tile): no AMX
# candidates from then on in this process, rather than a failing compile for every new shape
_amx_unbuildable: list[bool] = []


@functools.cache
def _amx_library(spec: EpilogueSpec, otag: str) -> ctypes.CDLL:
    src = native.render(templates.render_amx_source(spec, otag).replace("$", "$$"))
    name = f"gemm_amx_bf16_{otag}_e{len(spec.ops)}"
    try:
        return native.build(src, name=name, isa="avx512", extra_flags=["-O2", *templates.AMX_FLAGS])
    except native.CompileError as e:
        # a rejection: one epilogue's, or AMX's at all? (A timeout leaves AMX on here; the
        # toolchain remembers it, so the next build of that library is a rejection.)
        if not isinstance(e.__cause__, subprocess.TimeoutExpired):
            if (spec, otag) == (NO_EPILOGUE, "f32"):
                _amx_unbuildable.append(True)
            else:
                with contextlib.suppress(native.NativeError):
                    _amx_library(NO_EPILOGUE, "f32")
        raise


def amx_ready() -> bool:
    """True when the AMX-BF16 kernel can run here: the CPU has AMX-TILE, AMX-BF16 and
    AVX512-BF16 (its K tail), the OS grants the tile state, and no AMX library failed to
    compile in this process (mm.candidates also asks for the avx512 ISA level, which
    ``config.isa`` may lower)."""
    info = native.cpu_info()
    if not (info.has_amx and info.has_avx512_bf16) or _amx_unbuildable:
        return False
    return native.amx_permitted()


@functools.cache
def _amx_function(spec: EpilogueSpec, otag: str) -> Any:
    return amx_bind(_amx_library(spec, otag))


def amx_bind(lib: ctypes.CDLL) -> Any:
    """``tp_gemm_amx_32x32`` of a built AMX library, with the signature :func:`_amx_launcher`
    calls it with."""
    p, i = ctypes.c_void_p, ctypes.c_int64
    argtypes = [p, i, p, i, p, i, i, i, i, i, i, p, p, i, p, p]
    return native.c_function(lib, "tp_gemm_amx_32x32", argtypes, ctypes.c_int)


def _amx_launcher(spec: EpilogueSpec, cfg: Config, a_dtype: torch.dtype, fn: Any = None) -> _Launch:
    """:func:`launcher` of the AMX kernel (bf16 operands, checked there): ``b`` pair-packed with
    panels of 32 (the vdpbf16ps tiles' layout, which is AMX's B tile layout), ``a`` as
    :func:`_pairs`; ``cfg.mc`` rows per work chunk. ``fn``: another build of
    ``tp_gemm_amx_32x32`` with the same signature (``bench gemm_amx_ab``'s edited sources)."""
    out_dtype = spec.out_dtype(a_dtype)
    fn = _amx_function(spec, _TAG[out_dtype]) if fn is None else fn
    mc, kc, pf, nt = cfg.mc, cfg.kc, cfg.pf, cfg.nt
    operand_args = _operand_args(spec)

    def launch(
        a: torch.Tensor,
        b: torch.Tensor,
        operands: Sequence[torch.Tensor],
        packed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        m, k = a.shape
        n = b.shape[1]
        c = torch.empty(m, n, dtype=out_dtype)
        if m == 0 or n == 0:
            return c
        if packed is None:
            packed = pack_cache.get(b, templates.AMX_NR, pairs=True)
        a = _pairs(a)
        eptr, eld, _keep = operand_args(operands)  # _keep: alive until the call returns
        threads = max(1, torch.get_num_threads())
        kp = (k + 1) // 2
        # A's whole k tiles, copied by the kernel (16 rows of 16 k-pair words each)
        work = native.thread_scratch(
            "gemm.amx_a", max(1, (m + 15) // 16 * (kp // 16) * 512), torch.bfloat16
        )
        # each thread's fp32 sums: mc rounded up to 32 rows, times 32 columns per slot (two
        # alternate halves, or a slot per panel of a sub-run with K pieces)
        nthreads = min(nt, threads) if nt else threads
        rows = max(32, (mc + 31) // 32 * 32)
        sums = native.thread_scratch(
            "gemm.amx_sums", nthreads * rows * 32 * templates.AMX_SUM_SLOTS, torch.float32
        )
        status = fn(
            c.data_ptr(),
            n,
            a.data_ptr(),
            a.stride(0) // 2,
            packed.data_ptr(),
            m,
            n,
            kp,
            mc,
            kc,
            pf,
            eptr,
            eld,
            nthreads,
            work.data_ptr(),
            sums.data_ptr(),
        )
        if status != 0:
            raise RuntimeError(f"tp_gemm_amx_32x32 returned status {status} for {cfg}")
        return c

    return launch


# --- the row-streaming small-M driver (B packed as rows) ---------------------------------------


@functools.cache
def _rows_function(spec: EpilogueSpec, btag: str, otag: str, isa: str, mr: int) -> Any:
    lib = library(spec, btag, otag, isa, mr, 1)
    p, i = ctypes.c_void_p, ctypes.c_int64
    argtypes = [p, i, p, i, p, i, i, i, i, i, p, p, i]
    return native.c_function(lib, f"tp_gemm_rows_{mr}", argtypes, ctypes.c_int)


def _rows_launcher(
    spec: EpilogueSpec, cfg: Config, a_dtype: torch.dtype, b_dtype: torch.dtype, isa: str
) -> _Launch:
    """:func:`launcher` of the row-streaming driver (``cfg.nr == 1``): ``b`` packed as rows
    (``pack_b(b, 1)``, ``[N, K]``), ``a`` float32 with unit column stride (widened or copied
    when not), at most ``rows.MAX_M`` rows (:class:`InvalidCandidate` beyond)."""
    out_dtype = spec.out_dtype(a_dtype)
    fn = _rows_function(spec, _TAG[b_dtype], _TAG[out_dtype], isa, cfg.mr)
    pf, nt, f32 = cfg.pf, cfg.nt, torch.float32
    operand_args = _operand_args(spec)

    def launch(
        a: torch.Tensor,
        b: torch.Tensor,
        operands: Sequence[torch.Tensor],
        packed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        m, k = a.shape
        n = b.shape[1]
        if m > rows.MAX_M:
            raise InvalidCandidate(f"row-streaming driver takes M <= {rows.MAX_M}, got M={m}")
        c = torch.empty(m, n, dtype=out_dtype)
        if m == 0 or n == 0:
            return c
        a32 = a if a.dtype == f32 else a.float()
        if k > 1 and a32.stride(1) != 1:
            a32 = a32.contiguous()
        if packed is None:
            packed = pack_cache.get(b, 1)
        eptr, eld, _keep = operand_args(operands)  # _keep: alive until the call returns
        threads = max(1, torch.get_num_threads())
        status = fn(
            c.data_ptr(),
            n,
            a32.data_ptr(),
            a32.stride(0),
            packed.data_ptr(),
            k,
            m,
            n,
            k,
            pf,
            eptr,
            eld,
            min(nt, threads) if nt else threads,
        )
        if status != 0:
            raise RuntimeError(f"tp_gemm_rows_{cfg.mr} returned status {status} for {cfg}")
        return c

    return launch


# --- the epilogue alone, over a finished product (ATen's) -----------------------------------------

_PASS_BODY = r"""
typedef STYPE stype_t;
#define VLOAD_STAG VLOAD_STAG_
#define SLOAD_STAG SLOAD_STAG_
/* C[i, j] = epilogue(S[i, j]) over M x N: S is a finished product (ATen's; float32 or bfloat16,
   row stride lds), C the output (row stride ldc; may be S itself when the dtypes agree: every
   element is read before it is written). Rows are split among threads when there are enough,
   else columns (in whole vectors); one thread below TP_PASS_SPLIT_MIN elements. */
TP_EXPORT int tp_epilogue_pass(otype_t *C, int64_t ldc, const stype_t *S, int64_t lds, int64_t M,
        int64_t N, const void *const *ep, const int64_t *eld, int64_t nthreads) {
    if (M <= 0 || N <= 0) return 0;
    int64_t nt = (M * N < TP_PASS_SPLIT_MIN || nthreads < 1) ? 1 : nthreads;
    #pragma omp parallel num_threads(nt)
    {
        int64_t r0 = 0, r1 = M, j0 = 0, j1 = N;
        int64_t t = omp_get_thread_num(), n = omp_get_num_threads();
        if (M >= n) tp_chunk(M, n, t, 1, &r0, &r1);
        else tp_chunk(N, n, t, VWIDTH, &j0, &j1);
        for (int64_t i = r0; i < r1; ++i) {
            otype_t *c = C + i * ldc;
            const stype_t *x = S + i * lds;
            int64_t j = j0;
            for (; j + VWIDTH <= j1; j += VWIDTH)
                VSTORE_OTAG(c + j, tp_epi_v(VLOAD_STAG(x + j), i, j, ep, eld));
            for (; j < j1; ++j) SSTORE_OTAG(c + j, tp_epi_s(SLOAD_STAG(x + j), i, j, ep, eld));
        }
    }
    return 0;
}
"""


def pass_split_min(spec: EpilogueSpec) -> int:
    """Fewest elements the epilogue pass splits over the threads: 64 Ki for loads and adds
    (~0.1 ns each, so a parallel region's few microseconds are not worth it below), 16 Ki with
    a GELU/SiLU (~0.35 ns each: an 8 x 4096 product's activation is ~12 us on one thread)."""
    return 16384 if spec.deferrable else 65536


def _pass_source(spec: EpilogueSpec, stag: str, otag: str, isa: str) -> str:
    vec, sca = emit_c(spec)
    args = "int64_t i, int64_t j, const void *const *ep, const int64_t *eld"
    unused = "(void)i; (void)j; (void)ep; (void)eld;"
    parts = [
        templates.vocabulary(isa, otag=otag),
        f"typedef {'float' if otag == 'f32' else 'uint16_t'} otype_t;",
        f"#define VWIDTH {templates.VW[isa]}",
        f"#define TP_PASS_SPLIT_MIN {pass_split_min(spec)}",
        f"#define VSTORE_OTAG VSTORE_{otag}\n#define SSTORE_OTAG SSTORE_{otag}",
        f"TP_INLINE VEC tp_epi_v(VEC v, {args}) {{\n    {unused}\n    {vec}\n    return v;\n}}",
        f"TP_INLINE float tp_epi_s(float s, {args}) {{\n    {unused}\n    {sca}\n    return s;\n}}",
        _PASS_BODY.replace("STYPE", "float" if stag == "f32" else "uint16_t")
        .replace("VLOAD_STAG_", f"VLOAD_{stag}")
        .replace("SLOAD_STAG_", f"SLOAD_{stag}"),
    ]
    return "\n".join(parts)


@functools.cache
def _pass_function(spec: EpilogueSpec, stag: str, otag: str, isa: str) -> Any:
    src = native.render(_pass_source(spec, stag, otag, isa).replace("$", "$$"))
    lib = native.build(
        src, name=f"gemm_epi_{stag}_{otag}_{isa}_e{len(spec.ops)}", isa=isa, extra_flags=["-O2"]
    )
    p, i = ctypes.c_void_p, ctypes.c_int64
    return native.c_function(lib, "tp_epilogue_pass", [p, i, p, i, i, i, p, p, i], ctypes.c_int)


_Pass = Callable[[torch.Tensor, Sequence[torch.Tensor]], torch.Tensor]


@functools.cache
def epilogue_pass(spec: EpilogueSpec, s_dtype: torch.dtype, isa: str) -> _Pass:
    """``apply(s, operands)``: the fused epilogue ``spec`` over a finished product ``s [M, N]``
    (float32 or bfloat16, e.g. ATen's ``a @ b``) in one native pass, returning the output (``s``
    itself, overwritten, when the output dtype is ``s``'s). This is the epilogue of the ATen
    launch of a fused problem: ATen's GEMM plus this costs what the bare ATen GEMM costs plus one
    vector pass, instead of one ATen op (and parallel region) per step; numerics are the fused
    kernels' (float32 maths on the product, one rounding) except that a bfloat16 product arrives
    rounded once already."""
    out_dtype = spec.out_dtype(s_dtype)
    fn = _pass_function(spec, _TAG[s_dtype], _TAG[out_dtype], isa)
    operand_args = _operand_args(spec)

    def apply(s: torch.Tensor, operands: Sequence[torch.Tensor]) -> torch.Tensor:
        m, n = s.shape
        if s.dtype != s_dtype:
            raise GemmInputError(f"epilogue pass built for {s_dtype}, got a {s.dtype} product")
        if n > 1 and s.stride(1) != 1:
            s = s.contiguous()
        c = s if out_dtype == s_dtype else torch.empty(m, n, dtype=out_dtype)
        if m == 0 or n == 0:
            return c
        eptr, eld, _keep = operand_args(operands)  # _keep: alive until the call returns
        status = fn(
            c.data_ptr(),
            c.stride(0),
            s.data_ptr(),
            s.stride(0),
            m,
            n,
            eptr,
            eld,
            max(1, torch.get_num_threads()),
        )
        if status != 0:
            raise RuntimeError(f"tp_epilogue_pass returned status {status}")
        return c

    return apply


def run_native(
    a: torch.Tensor,
    b: torch.Tensor,
    spec: EpilogueSpec,
    operands: Sequence[torch.Tensor],
    cfg: Config,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """One native GEMM call (B packed through the cache unless ``packed`` is given)."""
    isa = native.cpu_info().isa
    return launcher(spec, cfg, a.dtype, b.dtype, isa)(a, b, operands, packed)
