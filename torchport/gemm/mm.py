"""``torchport.gemm.mm``: autotuned GEMM with a fused epilogue, as a ``torch.library`` custom op.

``mm(a, b, bias=..., epilogue=[...])`` validates its inputs, splits the epilogue into the fused spec
and an unfused tail (:mod:`~torchport.gemm.epilogue`), and calls ``torchport::gemm`` (directly for
plain eager tensors, through the dispatcher under autograd, ``torch.compile`` and ``torch.export``).
The op's implementation asks the autotuner which candidate serves this problem: ATen
(``addmm``/``mm`` + torch epilogue ops, the anchor) or one of at most nine native configurations
(register tile, M block, prefetch), chosen per shape bucket and cached persistently. Backward runs
ATen ops (:func:`_backward`), so the fused op trains.
"""

from __future__ import annotations

import contextvars
import functools
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from torchport import autotune, config, native
from torchport.autotune import ATEN, L3_BYTES, Candidate, InvalidCandidate
from torchport.gemm import kernels
from torchport.gemm.adaptive import ArmGroup, ThreadAdaptive
from torchport.gemm.epilogue import (
    _TAG_DT,
    OPERAND_KINDS,
    Add,
    Bias,
    EpilogueError,
    EpilogueSpec,
    Scale,
    Step,
    apply_tail,
    as_steps,
    fast_split,
    split,
)
from torchport.gemm.kernels import Config, GemmInputError, mm_aten, run_native
from torchport.gemm.pack import pack_b, pack_b_pairs, pack_cache, packed_empty
from torchport.native import functorch_active

SMALL_M = 32
# most rows for which the row-streaming driver (:mod:`~torchport.gemm.rows`) is a candidate
ROWS_M = 4
TUNE_BUDGET_S = 1.0  # timing budget per new shape, at most (compilation is cached on disk)
# wall-clock target for a new shape's first call, compilation from a fresh cache included: the
# compile time comes off the timing budget (issue target: <= 2 s cold per new shape)
COLD_TARGET_S = 1.6
MIN_TUNE_BUDGET_S = 0.35
DTYPES = (torch.float32, torch.bfloat16)
# weight-streaming shapes (M <= SMALL_M): the FINAL_ROUND fastest candidates of the search meet
# in the autotuner's interleaved final round, bounded by FINAL_ROUND_SHARE of the timing budget
# (the M = 1 row driver, 7-14 % faster than the 4x24 tile interleaved, ranked 8th, 5th and 2nd
# in three fresh sequential tunings)
FINAL_ROUND = 3
FINAL_ROUND_SHARE = 0.3


# --- candidates ----------------------------------------------------------------------------------


def _flop_rate(m: int, isa: str, elem_size: int) -> float:
    """About how fast (FLOP/s, conservative) the tuned kernels run a problem of ``m`` rows,
    for tuning-cost estimates: bf16 beyond SMALL_M rows 1e12 on AMX, 2.5e11 on vdpbf16ps;
    anything else 5e10 (small M is costed by its weight bytes besides)."""
    bf16_dp = elem_size == 2 and isa == "avx512" and native.cpu_info().has_avx512_bf16
    if m > SMALL_M and bf16_dp:
        return 1e12 if kernels.amx_ready() else 2.5e11
    return 5e10


def candidates(m: int, n: int, k: int, isa: str, elem_size: int = 4) -> list[Candidate]:
    """ATen anchor plus at most nine native configurations for this problem size: register
    tiles and prefetch for the weight-streaming small-M path (plus a K-split across the threads
    when K is large; up to ROWS_M rows, the row-streaming driver first), M and K cache blocks
    for larger M. A weight larger than L3
    (``elem_size`` bytes per element) gets at most five, over two panel widths and, up to
    ROWS_M rows, the row layout (each layout is one packing of the whole weight during tuning),
    without one-thread variants (the small-M
    runner times those at run time). bf16 (``elem_size`` 2) on an AVX512-BF16 machine tries the
    ``vdpbf16ps`` tiles (twice the fp32 tiles' rate) first: ``templates.DP_TILES["small"]`` up
    to SMALL_M rows, ``"large"`` beyond."""
    cands = [Candidate("aten", ATEN)]
    scale = {"avx2": 1, "avx512": 2, "scalar": 0}[isa]
    # bf16 weights on vdpbf16ps (AVX512-BF16): one instruction per two products and no widening,
    # where the fp32 tiles are compute-bound on bf16 (measured one thread, weights streamed:
    # M=8 1024->4096 0.59 vs 0.81 ms = 105 % of torch.sum's bandwidth; M=32 1.09 vs 2.02 ms)
    dp = elem_size == 2 and isa == "avx512" and native.cpu_info().has_avx512_bf16
    # bf16 on AMX tiles where the machine has them (Sapphire Rapids and later): 16 x 16 x 32
    # products per instruction, the rate ATen's oneDNN reaches there with its own AMX kernels
    amx = dp and kernels.amx_ready()
    if scale == 0:
        cfgs = [Config(4, 4, max(m, 1)), Config(1, 8, max(m, 1))]
    elif m <= SMALL_M:
        # weight streaming: every panel of B read once (mc >= M), rows reuse it from L1/L2.
        # One-thread variants: a short kernel on a loaded machine otherwise waits for its
        # descheduled second thread (measured: 1.2 ms alone, ~20 ms with two threads at load 7).
        # Ordered by promise: big problems keep only the first few (cold-tuning budget).
        mm_, big_k = max(m, 1), k >= 1024
        t6 = Config(
            6, 16 * scale, mm_, kc=256 if big_k and m > 8 else 0
        )  # K blocks if compute-bound
        # prefetch distances in panel rows, 2-4 KB ahead (measured, M=8 1024->4096 fp32, 8x8
        # tile on huge pages: 16 rows = 512 B ran at 92-97 % of torch.sum's bandwidth, 64 rows
        # at 100-104 %)
        # bf16 weights on the AVX2 tiles are compute-bound: there the 4x24 tile streams faster
        # with the panel prefetched 64 rows (3 KB) ahead (measured with the widening loads,
        # before the even/odd pairs of templates._eo_pairs: Zen 3, two threads, 4096->11008,
        # weights rotated, interleaved medians of 15-21: M=4 3.43 vs 4.24 ms; M=8 5.22-5.56
        # vs 5.85-6.12; at M=16 pf 32 was best, at M=32 none; fp32 weights, bandwidth-bound,
        # within 2 %)
        pf24 = 64 if elem_size == 2 and scale == 1 and m <= 8 else 0
        cfgs = [
            Config(8, 8 * scale, mm_, 64),
            Config(4, 24 * scale, mm_, pf24),
            t6,
            Config(4, 24 * scale, mm_, nt=1),
            Config(8, 8 * scale, mm_, 128),
            Config(2, 32 * scale, mm_, nt=1) if m <= 2 else Config(8, 8 * scale, mm_, 64, nt=1),
        ]
        if big_k:  # the threads may also split K (helps when N has few panels)
            cfgs.append(Config(4, 24 * scale, mm_, ks=2))
        cfgs += [Config(4, 24 * scale, mm_, 32), Config(2, 32 * scale, mm_)]
        if m <= 2:
            cfgs.append(Config(1, 64 * scale, mm_))
        if m < 8:
            # an 8-row tile never runs below 8 rows: its one-row fallback does, a vector of
            # weights per FMA from L2 for every row (measured on a Zen 3, 4096->11008, two
            # threads: bf16 M=4 14.7 ms against 3.4 for the 4x24 tile, fp32 M=4 16.4 vs 6.6,
            # bf16 M=2 7.4 vs 3.4 for the row driver)
            cfgs = [c for c in cfgs if c.mr != 8]
        if m <= ROWS_M:
            # the row-streaming driver (B packed as [N, K] rows, four weight rows side by side
            # per thread, as the decode GEMV), no software prefetch (measured one thread, M=1
            # 1024->4096 fp32, 16 MB weights rotated, load ~4, best of 31: 0.87 ms, 19.3 GB/s,
            # against 0.96-1.11 with a 256-1024 byte NTA or T0 prefetch, 0.98-1.00 for the
            # 4x24 tile and 0.94-0.98 for torch.sum of the same huge-page bytes)
            cfgs.insert(0, Config(2 if m >= 2 else 1, 1, mm_))
        if dp:
            t = (8, 32) if m >= 8 else (4, 64) if m >= 4 else (2, 128)
            # prefetch at least 8 KB of the panel stream ahead (pf in k pairs of NR words):
            # 8x32 64 k pairs, was 32 (4 KB). Measured dp8x32, bf16 weights rotated, pf 64 vs
            # 32 in one interleaved run, median time ratio (load 1-1.8): two threads M=8
            # 1024->4096 0.88, 0.96, M=16 0.93, M=32 0.96-0.99, M=8 4096->11008 0.98, M=32
            # 0.94; one thread (thread CPU time) M=8 0.82, 0.82; 128 k pairs no better
            pf = max(32, 8192 // (4 * t[1]))
            # no prefetch (pf 0) only below 8 rows: for 8x32 it measured slower and bimodal,
            # which the tuner's noise could still pick (interleaved, pf 0 over 64, 10th
            # percentiles, load 3.6-4.3: two threads M=16 1.13, M=32 1.11; one thread M=8
            # 1.09, M=32 1.06; two threads M=8 over pf 32, median 1.17-1.19 at load 1.8;
            # chosen in one of two cold tunings of M=8 1024->4096, whose bare call then took
            # 0.59 ms against 0.32 with pf 64)
            cfgs = [
                Config(*t, mm_, pf, dp=1),
                *([Config(*t, mm_, dp=1)] if m < 8 else []),
                Config(*t, mm_, pf, nt=1, dp=1),
                *cfgs,
            ]
            if amx and m >= 8:
                # a 32 x 32 block per tile step, weights streamed once (mc >= M), the panel
                # stream prefetched 4 k steps (8 KB) ahead: measured bf16 M=32 1024->4096,
                # weights rotated over 256 MB, medians of 200: 0.39-0.47 ms against 0.46-0.49
                # without
                cfgs = [
                    Config(*kernels.AMX_TILE, 32, 4, dp=kernels.AMX),
                    Config(*kernels.AMX_TILE, 32, dp=kernels.AMX),
                    *cfgs,
                ]
    else:
        cfgs = [
            Config(6, 16 * scale, 96),
            Config(6, 16 * scale, 96, kc=256),  # K blocks: a 256 x NR slice of B stays in L1
            Config(4, 24 * scale, 128),
            Config(6, 16 * scale, 48),
            Config(4, 24 * scale, 64),
            Config(4, 24 * scale, 128, kc=384),
            Config(8, 8 * scale, 64),
        ]
        if isa == "avx512":
            # 24 of the 32 zmm registers accumulate (measured fp32 M=512 1024->4096, two
            # threads: 440 GFLOP/s for 6x64 and 8x48, 421 for 6x32; peak about 490 here)
            cfgs = [Config(6, 64, 96), Config(8, 48, 512), *cfgs]
        if dp:
            # vdpbf16ps: 6x64 first (24 accumulators, the fewest loads per dot-accumulate);
            # K blocks of 4096 when K is larger (a 64-wide panel of K=11008 is 1.4 MB, more
            # than L2; measured M=512 11008->1024 on a Zen 5: 843 GFLOP/s with kc=4096, 796
            # with 2048, 767 without). M blocks of 256 rows: from templates.PANEL_CHUNK_M
            # rows the threads take (panel, M block) chunks, so they finish within one block
            # of each other (measured on a Zen 4, two threads, interleaved medians of 9, mc=M
            # as before vs 256: M=512 768->3072 5.98 vs 5.82 ms, 1024->4096 10.28 vs 9.97,
            # M=2048 1024->4096 44.6 vs 42.2; one thread reaches 93-97 % of the dot
            # instruction's measured peak, 232 GFLOP/s per core there)
            kb = 4096 if k > 4096 else 0
            cfgs = [
                Config(6, 64, min(m, 256), kc=kb, dp=1),
                Config(8, 48, min(m, 256), kc=kb, dp=1),
                Config(6, 64, 128, dp=1),
                Config(4, 96, min(m, 256), dp=1),
                *cfgs[:1],
            ]
            if amx:
                # K blocks of 256 (the panel's 16 KB slice stays in L1 while the chunk's 32-row
                # blocks use it); M blocks of up to 512 rows, since every M block streams all of B
                # again and this machine's memory feeds a core ~12 GB/s against AMX's ~3 TFLOP/s.
                # An M block's A beyond 1 MiB runs in K pieces that stay in L2
                # (templates.AMX_A_PIECE_BYTES), so large M blocks no longer cost an L3 stream of
                # A per panel: in-process, weights rotated over 256 MiB, interleaved medians of 9,
                # bias, mc 512 with / without K pieces: M=512 4096->11008 17.4 / 28.5 ms (ATen
                # 26.3), 512 11008->4096 19.0 / 34.3 (ATen 27.2), 2048 4096->11008 83.9 / 131.6
                # (ATen 93.0); before the pieces, M blocks were sized to keep A within ~2 MB
                # (mc 128 from K = 4096: 512 4096->11008 22.5 ms, 11008->4096 33.5). At least 128
                # rows: below that every M block streams the weight again (M=512 11008->4096: mc
                # 64 37.5 ms, 128 29.2 in an earlier session's A/B)
                fit = max(128, min(512, (m + 31) // 32 * 32))
                kb = 256 if k > 256 else 0  # (one K block would be the whole K anyway)
                cfgs = list(
                    dict.fromkeys(  # (distinct: fit and fit / 2 are both 128 up to M = 128)
                        [
                            Config(*kernels.AMX_TILE, fit, kc=kb, dp=kernels.AMX),
                            Config(*kernels.AMX_TILE, max(128, fit // 2), kc=kb, dp=kernels.AMX),
                            Config(*kernels.AMX_TILE, 128, dp=kernels.AMX),
                        ]
                    )
                )
                # no vdpbf16ps tiles beside them: 4-6x slower than AMX and ATen there (tuning
                # of M=2048 768->3072: 44-46 ms per call against 7-11 ms), they took timing
                # budget from the two that decide
        cfgs = [c for c in cfgs if c.kc < k]
    # problems whose single call is long get fewer candidates (cold-tuning budget)
    est_s = 2.0 * m * n * k / _flop_rate(m, isa, elem_size)
    if est_s > 0.05:
        cfgs = cfgs[: max(1, int(0.4 / est_s))]
    if n * k * elem_size >= L3_BYTES:
        # two panel widths, and the row layout (nr 1) where it is offered
        widths = [1, *list(dict.fromkeys(c.nr for c in cfgs if c.nr != 1))[:2]]
        cfgs = [c for c in cfgs if c.nr in widths and (c.nt == 0 or m > SMALL_M)][:5]
    for c in cfgs[:9]:
        params: tuple[tuple[str, int], ...] = (("mr", c.mr), ("nr", c.nr), ("mc", c.mc))
        params += (("pf", c.pf), ("kc", c.kc), ("ks", c.ks), ("nt", c.nt))
        params += (("dp", c.dp),) if c.dp else ()
        cands.append(Candidate(c.name, params=params))
    return cands


def _config(c: Candidate) -> Config:
    return Config(
        int(c.param("mr")),
        int(c.param("nr")),
        int(c.param("mc")),
        int(c.param("pf")),
        int(c.param("kc", 0)),
        int(c.param("ks", 1)),
        int(c.param("nt", 0)),
        int(c.param("dp", 0)),
    )


@dataclass
class _Rotation:
    """Cold-cache argument copies; the packed weights of every copy are made once per panel
    width ``nr``, untimed, and shared by the candidates that use that width.

    Random copies keep the packs of one width at a time, in one reused buffer per copy: packs of
    >= 4 MiB live in 2 MiB huge pages, whose first touch costs ~4 ms per MiB on this machine's
    hypervisor (fresh guest memory), so a buffer per (copy, width) made a new 16 MB shape's
    tuning pack 15-16 fresh buffers (~1 s) where one per copy, refilled, costs ~5 ms per pack.
    The tuner runs the candidates grouped by width (:func:`_tuning_order`)."""

    copies: list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]]
    shared_pack: bool = False
    packs: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)
    buffers: dict[int, torch.Tensor] = field(default_factory=dict)

    def packed(self, idx: int, nr: int, dp: int = 0) -> torch.Tensor:
        """Copy ``idx``'s weight packed for panel width ``nr`` (``dp``: pair-packed for the
        vdpbf16ps tiles, :func:`~torchport.gemm.pack.pack_b_pairs`, in the same buffer)."""
        dp = int(bool(dp))  # the AMX kernel (dp 2) reads the vdpbf16ps tiles' pair packing
        hit = self.packs.get((idx, nr, dp))
        if hit is None:
            b = self.copies[idx][1]
            if self.shared_pack:
                hit = pack_cache.get(b, nr, pairs=bool(dp))
            else:
                # copy idx's buffer held another layout: that pack is refilled
                for old in [p for p in self.packs if p[0] == idx and p[1:] != (nr, dp)]:
                    del self.packs[old]
                buf = self._buffer(idx, b, nr, bool(dp))
                hit = pack_b_pairs(b, nr, out=buf) if dp else pack_b(b, nr, out=buf)
            self.packs[(idx, nr, dp)] = hit
        return hit

    def _buffer(self, idx: int, b: torch.Tensor, nr: int, pairs: bool) -> torch.Tensor:
        k, n = b.shape
        shape: tuple[int, ...] = ((n + nr - 1) // nr, k, nr)
        if pairs:
            shape = (shape[0], (k + 1) // 2, nr, 2)
        need = math.prod(shape)
        buf = self.buffers.get(idx)
        if buf is None or buf.numel() < need or buf.dtype != b.dtype:
            # room for every width up to 128 (a width pads N by at most nr - 1 columns)
            buf = self.buffers[idx] = packed_empty((max(need, (n + 127) * k),), b.dtype)
        return buf[:need].view(shape)


def _tuning_order(cands: list[Candidate]) -> list[Candidate]:
    """``cands`` with the anchor first and the native candidates grouped by panel layout (width
    and pairing; stable within one), so a rotation packs each layout's copies once (see
    :class:`_Rotation`)."""
    first: dict[tuple[int, int], int] = {}
    for c in cands:
        if not c.is_anchor:
            first.setdefault(_pack_layout(c), len(first))
    return sorted(cands, key=lambda c: -1 if c.is_anchor else first[_pack_layout(c)])


def _pack_layout(c: Candidate) -> tuple[int, int]:
    """A native candidate's packing of B: (panel width, 1 if pair-packed); the vdpbf16ps tiles
    (dp 1) and the AMX kernel (dp 2) read the same pair packing."""
    return int(c.param("nr")), int(bool(int(c.param("dp", 0))))


def _tuning_fn(c: Candidate, spec: EpilogueSpec) -> Callable[[_Rotation], torch.Tensor]:
    state = {"i": 0}
    if c.is_anchor:

        def aten(rot: _Rotation) -> torch.Tensor:
            a, b, ops = rot.copies[state["i"] % len(rot.copies)]
            state["i"] += 1
            return mm_aten(a, b, spec, ops)

        return aten
    cfg = _config(c)
    kernels.check_config(cfg, native.cpu_info().isa)
    primed: list[bool] = []

    def ours(rot: _Rotation) -> torch.Tensor:
        if not primed:  # pack every copy on the first (untimed) call
            for idx in range(len(rot.copies)):
                rot.packed(idx, cfg.nr, cfg.dp)
            primed.append(True)
        idx = state["i"] % len(rot.copies)
        state["i"] += 1
        a, b, ops = rot.copies[idx]
        return run_native(a, b, spec, ops, cfg, packed=rot.packed(idx, cfg.nr, cfg.dp))

    return ours


def _round_fns(
    cands: Sequence[Candidate], spec: EpilogueSpec
) -> list[Callable[[_Rotation], torch.Tensor]]:
    """The autotuner's final interleaved round: one callable per candidate, each layout rotating
    over its own share of the copies (copy i to layout i mod layouts, packed on the first,
    untimed call), so no call repacks a buffer another layout just filled; a single copy of the
    real operands (whose packs of every width live in the pack cache) is read by all. The round
    as a whole still rotates over every copy."""
    layouts = list(dict.fromkeys(_pack_layout(c) for c in cands))
    isa = native.cpu_info().isa

    def one(cfg: Config, lane: int) -> Callable[[_Rotation], torch.Tensor]:
        kernels.check_config(cfg, isa)
        calls = [0]

        def ours(rot: _Rotation) -> torch.Tensor:
            n = len(rot.copies)
            if n < len(layouts) and not rot.shared_pack:
                raise InvalidCandidate("fewer argument copies than layouts in the round")
            own = [i for i in range(n) if i % len(layouts) == lane] or [0]
            if calls[0] == 0:
                for i in own:
                    rot.packed(i, cfg.nr, cfg.dp)
            idx = own[calls[0] % len(own)]
            calls[0] += 1
            a, b, ops = rot.copies[idx]
            return run_native(a, b, spec, ops, cfg, packed=rot.packed(idx, cfg.nr, cfg.dp))

        return ours

    return [one(_config(c), layouts.index(_pack_layout(c))) for c in cands]


CLOSE_BLOCK_ELEMS = 1 << 20  # elements per block of agree's comparison


def _close(out: torch.Tensor, ref: torch.Tensor) -> bool:
    """A candidate's result against ATen's (a bf16 problem's float32 output included: ATen
    multiplies it in float32, as the kernels keep float32 sums; see ``kernels.mm_aten``)."""
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return False
    return agree(out, ref, 3e-2 if out.dtype == torch.bfloat16 else 1e-3)


def agree(out: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
    """Whether ``out`` agrees with the anchor's ``ref`` (same shape, float32 or bfloat16): within
    ``tol * (scale + 1)`` where ``ref`` is finite (``scale``: its largest finite magnitude), and
    the same NaN, inf or -inf where it is not. The result check of the GEMM engine's tuning and
    of the low-precision panels' (both tune on a first call's real operands in places: with a
    NaN in them a check refusing every NaN failed each native candidate, and ATen was saved
    for the shape for good)."""
    if out.numel() == 0:
        return True
    # in row blocks of about 4 MB of float32 (exact for both dtypes' values), whose buffers the
    # heap reuses: whole-output float copies came from fresh pages, 125 ms for a 2048 x 11008
    # bf16 output (24 ms so), twice per tuning of that shape
    rows = max(1, CLOSE_BLOCK_ELEMS // max(1, out.shape[-1]))
    o2, r2 = out.reshape(-1, out.shape[-1]), ref.reshape(-1, ref.shape[-1])
    scale = diff = 0.0
    for i in range(0, o2.shape[0], rows):
        o, r = o2[i : i + rows].float(), r2[i : i + rows].float()
        d = float((o - r).abs_().max())
        s = float(r.abs().max())  # (not in place: a float32 `ref` block is a view)
        if not (d < math.inf and s < math.inf):  # a NaN or inf in either block
            off = ~torch.isfinite(r)
            if not torch.equal(off, ~torch.isfinite(o)):
                return False
            if not torch.allclose(o[off], r[off], rtol=0.0, atol=0.0, equal_nan=True):
                return False  # (equal infinities are close, NaN to NaN with equal_nan)
            d = float((o - r).abs_().masked_fill_(off, 0.0).max())
            s = float(r.abs().masked_fill_(off, 0.0).max())
        diff, scale = max(diff, d), max(scale, s)
    return diff <= tol * (scale + 1.0)


def bucket(m: int) -> int:
    """Tuning bucket for M: exact up to SMALL_M, then the next power of two."""
    return m if m <= SMALL_M else 1 << (m - 1).bit_length()


# choices made in this process, for reports (demo, bench): (op, key) -> winner
decisions: dict[tuple[str, str], str] = {}
_decisions_lock = threading.Lock()


# settled choices for this process: (problem, settings stamp) -> (candidate, runner). A hit skips
# the candidate list, the tuning key, the choice-cache lookup and every config read: the runner
# is called directly (``torch.addmm`` for an ATen choice), so a call the autotuner gave to ATen
# costs about what the ATen call costs. Emptied whenever the choice cache forgets its in-memory
# view (``clear_memory``); the settings enter as the values they resolve to, re-read only when
# :func:`torchport.config.stamp` changes (any assignment or change of the environment variables)
# and on every call under an override; ``isa`` as the level it resolves to (``cpu_info().isa``,
# as the tuner's memos key it), so "auto" and the level it names are one state, one settling.
_Runner = Callable[[torch.Tensor, torch.Tensor, Sequence[torch.Tensor]], torch.Tensor]
_settled: dict[tuple[Any, ...], tuple[Candidate, _Runner]] = {}
# native launches shared by the small-M runners of one problem and config whose epilogues differ
# (:class:`~torchport.gemm.adaptive.ArmGroup`); emptied with ``_settled``
_groups: dict[tuple[Any, ...], ArmGroup] = {}
_settled_view: list[object] = [None]
_STATE_SETTINGS = (
    "isa",  # entered as cpu_info().isa: this setting capped by the (fixed) hardware
    "native",
    "max_autotune_gemm_backends",
    "autotune",
    "autotune_cache",
    "cache_dir",
)
# (stamp, resolved values) of the last resolution outside an override, replaced as one tuple
_state_memo: list[tuple[Any, tuple[Any, ...]]] = [(None, ())]


def _resolved_settings() -> tuple[Any, ...]:
    return (native.cpu_info().isa, *(config.get(name) for name in _STATE_SETTINGS[1:]))


def _settings_state() -> tuple[Any, ...]:
    """What, besides the problem, decides :func:`choose`'s answer (cheap to read per call)."""
    view = autotune.choice_cache._memo
    if view is not _settled_view[0]:  # identity, not id(): the old view is kept alive here
        _settled.clear()
        _groups.clear()
        _settled_view[0] = view
    st = config.stamp(_STATE_SETTINGS)
    if st is None:  # an override is active: its values, read one by one
        return (_resolved_settings(), torch.get_num_threads())
    memo = _state_memo[0]
    if memo[0] != st:
        memo = _state_memo[0] = (st, _resolved_settings())
    return (memo[1], torch.get_num_threads())


def _layout(b: torch.Tensor) -> str:
    s0, s1 = b.stride()
    return "t" if s0 == 1 and s1 != 1 else "n"


def _settled_key(a: torch.Tensor, b: torch.Tensor, spec: str) -> tuple[Any, ...]:
    # on every eager call: bucket() and _layout() inlined (one stride() call), ~1.5 us less
    m, k = a.shape
    s0, s1 = b.stride()
    return (
        m if m <= SMALL_M else 1 << (m - 1).bit_length(),
        b.shape[1],
        k,
        a.dtype,
        "t" if s0 == 1 and s1 != 1 else "n",
        spec,
        _settings_state(),
    )


def _aten_runner(spec: EpilogueSpec, encoded: str) -> _Runner:
    """The ATen path for ``spec`` as a direct call where one op does it all."""
    if encoded == "":
        return lambda a, b, ops: torch.mm(a, b)
    if encoded in _BIAS_SPECS.values():
        return lambda a, b, ops: (
            torch.addmm(ops[0], a, b) if ops[0].dtype == a.dtype else mm_aten(a, b, spec, ops)
        )
    return lambda a, b, ops: mm_aten(a, b, spec, ops)


def _native_runner(
    spec: EpilogueSpec,
    cfg: Config,
    adapt: bool = False,
    aten: _Runner | None = None,
    group_key: tuple[Any, ...] | None = None,
) -> _Runner:
    """Runner of one native config; with ``adapt`` (small M, all threads) a
    :class:`~torchport.gemm.adaptive.ThreadAdaptive` over the config, its thread twin (one
    thread for an all-threads config, all threads for a one-thread one) and ATen. ``aten`` (the ATen runner, when the tuner chose ATen) puts ATen first: the runner
    starts on it and moves to a native launch only while that is measurably faster. Runners
    given the same ``group_key`` (one problem, any epilogue) share their native launches'
    timings and the choice among them (:class:`~torchport.gemm.adaptive.ArmGroup`)."""
    launches: dict[tuple[torch.dtype, torch.dtype], Callable[..., torch.Tensor]] = {}
    aten_run = aten or (lambda a, b, ops: mm_aten(a, b, spec, ops))

    def group(
        a: torch.Tensor, b: torch.Tensor, isa: str, arms: tuple[int, ...], aten_shared: bool
    ) -> Any:
        if group_key is None:
            return None
        gk = (*group_key, a.dtype, b.dtype, isa, cfg, aten is not None, aten_shared)
        with _decisions_lock:
            g = _groups.get(gk)
            if g is None:
                if len(_groups) > 4096:
                    _groups.clear()
                g = _groups[gk] = ArmGroup(arms)
        return g

    def aten_arm(a: torch.Tensor, isa: str) -> tuple[_Runner, bool]:
        """The ATen launch of an adaptive runner and whether the group shares it: ATen's bare
        product then, for an epilogue, one native pass over it (:func:`kernels.epilogue_pass`),
        so the bare and the fused runners' ATen launches differ by that pass alone, as their
        native launches do, and the group can rank ATen among the shared launches too (before,
        the fused ATen launch ran one op per step and was ranked per runner: a bare call on
        ATen and a fused call on a native launch measured 1.07-1.14x the bare time at M=1)."""
        if not spec.ops:
            return aten_run, True
        if a.dtype == torch.bfloat16 and spec.out_dtype(a.dtype) == torch.float32:
            return aten_run, False  # (a float32 product: mm_aten; the pass takes a bf16 one)
        try:
            epi = kernels.epilogue_pass(spec, a.dtype, isa)
        except native.NativeError as e:
            native.note_fallback("gemm", e)
            return aten_run, False
        return (lambda a, b, ops: epi(torch.mm(a, b), ops)), True

    def make(a: torch.Tensor, b: torch.Tensor) -> Callable[..., torch.Tensor]:
        isa = native.cpu_info().isa  # part of the settled key: fixed for this runner
        if adapt and spec.ops:
            # a new epilogue of a tuned shape: its tile library and its ATen launch's pass are
            # compiled side by side (one compiler per core), not one after the other
            otag = spec.out or kernels._TAG[a.dtype]
            tile = [(cfg.mr, cfg.nr)]
            kernels.prebuild(
                spec,
                kernels._TAG[b.dtype],
                otag,
                isa,
                [] if cfg.dp else tile,
                tile if cfg.dp == 1 else [],
                amx=cfg.dp == kernels.AMX,
            )
        tuned = kernels.launcher(spec, cfg, a.dtype, b.dtype, isa)
        events = lambda: pack_cache.misses  # noqa: E731
        if adapt and aten is not None and native.num_threads() < 2:
            arm, sh = aten_arm(a, isa)
            g = group(a, b, isa, (0, 1) if sh else (1,), sh)
            return ThreadAdaptive(arm, tuned, events=events, group=g, home=0)
        if not adapt or cfg.nt > 1 or native.num_threads() < 2:
            return aten_run if aten is not None else tuned
        # the tuned config's thread twin: one thread for an all-threads config and, for a
        # one-thread winner, the all-threads config (a one-thread choice made under load, kept
        # alone, ran every later call at about half the weight stream: measured M=8
        # 1024->4096 fp32, 52 % of torch.sum's bandwidth against 82-89 % with two threads)
        twin = kernels.launcher(spec, replace(cfg, nt=0 if cfg.nt else 1), a.dtype, b.dtype, isa)
        arm, sh = aten_arm(a, isa)
        if aten is not None:
            arms, shared = (arm, tuned, twin), ((0, 1, 2) if sh else (1, 2))
        else:
            arms, shared = (tuned, twin, arm), ((0, 1, 2) if sh else (0, 1))
        home = 0 if aten is not None else None  # ATen, the tuner's choice: see ThreadAdaptive
        g = group(a, b, isa, shared, sh)
        return ThreadAdaptive(*arms, events=events, group=g, home=home)

    def run(a: torch.Tensor, b: torch.Tensor, ops: Sequence[torch.Tensor]) -> torch.Tensor:
        try:
            launch = launches.get((a.dtype, b.dtype))
            if launch is None:
                launch = launches[(a.dtype, b.dtype)] = make(a, b)
            return launch(a, b, ops)
        except native.NativeError as e:
            native.note_fallback("gemm", e)
            return mm_aten(a, b, spec, ops)

    return run


def _settle(
    a: torch.Tensor,
    b: torch.Tensor,
    spec: EpilogueSpec,
    encoded: str,
    operands: Sequence[torch.Tensor],
) -> tuple[Candidate, _Runner]:
    """Candidate and runner for this problem, from the settled table or by asking the tuner."""
    key = _settled_key(a, b, encoded)
    hit = _settled.get(key)
    if hit is not None:
        return hit
    if key[0] <= SMALL_M and encoded:
        # small M streams the weight: the epilogue costs the same few microseconds on every
        # config, so all epilogues of a shape share one choice (tuned once per shape, under the
        # bare problem's key, by whichever epilogue comes first: its libraries are the ones
        # compiled for the tuning) rather than separate tunings that, on a noisy machine, could
        # settle a fused call on a slower config than the bare call's
        cand, runner_up = _choose(a, b, spec, operands, key[0], key[4], shape_key=True)
        with _decisions_lock:
            label = f"M={a.shape[0]} N={key[1]} K={key[2]} {str(a.dtype).removeprefix('torch.')}"
            decisions[("gemm", f"{label} [{encoded}]")] = cand.name
    else:
        cand, runner_up = _choose(a, b, spec, operands, key[0], key[4])
    # small M over a weight of >= 1 MiB fp32: calls of ~0.1 ms and up, where the per-call
    # timing of the adaptive launches (a few us) is noise
    adapt = key[0] <= SMALL_M and key[1] * key[2] >= 1 << 18
    group_key = (*key[:5], *key[6:])  # the problem without its epilogue
    if cand.is_anchor and adapt and runner_up is not None:
        # ATen won the tuning, but on a shared machine its two-thread calls (one parallel
        # region per op of the epilogue) stall whenever a neighbour runs: the runner starts on
        # ATen and keeps the best native config and its one-thread twin as alternatives
        aten = _aten_runner(spec, encoded)
        run = _native_runner(spec, _config(runner_up), True, aten=aten, group_key=group_key)
    elif cand.is_anchor:
        run = _aten_runner(spec, encoded)
    else:
        run = _native_runner(spec, _config(cand), adapt=adapt, group_key=group_key)
    if config.get("autotune_cache"):  # without the choice cache every call re-tunes, as before
        if len(_settled) > 4096:
            _settled.clear()
            _groups.clear()
        _settled[key] = (cand, run)
    return cand, run


def choose(
    a: torch.Tensor, b: torch.Tensor, spec: EpilogueSpec, operands: Sequence[torch.Tensor]
) -> Candidate:
    """Autotuned candidate for this problem (ATen when native kernels are off or disallowed)."""
    return _settle(a, b, spec, spec.encode(), operands)[0]


def _choose(
    a: torch.Tensor,
    b: torch.Tensor,
    spec: EpilogueSpec,
    operands: Sequence[torch.Tensor],
    mb: int,
    layout: str,
    shape_key: bool = False,
) -> tuple[Candidate, Candidate | None]:
    """The tuner's choice and, when that is ATen, the fastest native candidate it timed (None
    when native kernels are not allowed or none was timed). ``shape_key``: the choice is kept
    under the bare problem's key (shared by every epilogue of the shape); ``spec`` is only what
    the candidates are timed with."""
    m, k = a.shape
    n = b.shape[1]
    isa = native.cpu_info().isa
    key = {
        "m": mb,
        "n": n,
        "k": k,
        "dtype": str(a.dtype).removeprefix("torch."),
        "b": layout,
        "epilogue": "" if shape_key else spec.encode(),
        "isa": isa,
    }

    def with_candidates() -> list[Candidate]:
        cands = candidates(mb, n, k, isa, b.element_size())
        key.pop("tiles", None)
        if any(c.param("dp", 0) for c in cands):
            # choices cached before the vdpbf16ps tiles (or, where it runs, the AMX kernel)
            # existed are re-tuned
            amx = any(int(c.param("dp", 0)) == kernels.AMX for c in cands)
            key["tiles"] = "amx" if amx else "dp"
        return cands

    cands = with_candidates()

    def make_args() -> tuple[Any, ...]:
        def one() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
            g = autotune.sample_generator()
            aa = torch.randn(mb, k, generator=g).to(a.dtype)
            bb = (
                torch.randn(n, k, generator=g).to(b.dtype).t()
                if layout == "t"
                else torch.randn(k, n, generator=g).to(b.dtype)
            )
            ops = []
            kinds = [op.kind for op in spec.ops if op.kind in OPERAND_KINDS]
            for kind, t in zip(kinds, operands):
                shape = {"add": (mb, n), "bias_row": (mb,), "scale_row": (mb,)}.get(kind, (n,))
                ops.append(torch.randn(shape, generator=g).to(t.dtype))
            return aa, bb, ops

        if k * n * b.element_size() >= L3_BYTES and tuple(a.shape) == (mb, k):
            # weights larger than L3 are cold by themselves: tune on the real operands (no
            # random copies to generate), sharing packed weights with the runtime cache
            real = (a.detach(), b.detach(), [t.detach() for t in operands])
            return (_Rotation([real], shared_pack=True),)
        first = one()
        size = sum(t.numel() * t.element_size() for t in (first[0], first[1], *first[2]))
        # the other copies are the first's values in their own memory (what cold timing needs):
        # a clone costs its page faults, randn several times that (measured at load 6-7, eight
        # bf16 1024x4096 copies: 843 ms generated, 183 ms as clones of one)
        extra = min(15, math.ceil(config.get("cold_cache_bytes") / max(size, 1)) - 1)
        copies = [first] + [
            (first[0].clone(), first[1].clone(), [t.clone() for t in first[2]])
            for _ in range(extra)
        ]
        return (_Rotation(copies),)

    premade: list[tuple[Any, ...]] = []  # arguments made during compilation
    t_start = time.perf_counter()
    budget = TUNE_BUDGET_S
    native_ok = native.enabled() and autotune.NATIVE in autotune.allowed_backends()

    def prebuild() -> bool:
        """Compile every candidate's tile library (and the pack kernel) in parallel, the
        argument copies made meanwhile (once: a second build keeps the first's); False when the
        AMX library the candidates need did not compile (AMX is then off in this process)."""
        tiles = {
            (int(c.param("mr")), int(c.param("nr")), int(c.param("dp", 0)))
            for c in cands
            if not c.is_anchor
        }
        otag = spec.out or kernels._TAG[a.dtype]
        fp32_tiles = sorted((mr, nr) for mr, nr, dp in tiles if not dp)
        dp_tiles = sorted((mr, nr) for mr, nr, dp in tiles if dp == 1)
        amx = any(dp == kernels.AMX for _, _, dp in tiles)
        # the argument copies (random operands: tens of ms each, up to 16 of them) are made
        # meanwhile, on this process's otherwise idle thread, while the compilers run
        with ThreadPoolExecutor(max_workers=1) as pool:
            # in the caller's context: config overrides (cold_cache_bytes) are context variables
            made = None if premade else pool.submit(contextvars.copy_context().run, make_args)
            kernels.prebuild(spec, kernels._TAG[b.dtype], otag, isa, fp32_tiles, dp_tiles, amx)
            if made is not None:
                premade.append(made.result())
        return not amx or kernels.amx_ready()

    def untuned() -> bool:
        """No saved choice the tuner would use for ``key``: a new shape, or a choice saved
        before its candidate left the list (the tuner replaces it)."""
        hit = autotune.choice_cache.get("gemm", key)
        return hit is None or hit["choice"] not in {c.name for c in cands}

    if native_ok and untuned() and config.get("autotune"):
        # its libraries first; what that took comes off the timing budget
        if not prebuild():
            # the AMX library did not compile: the shape's other candidates, under their own
            # key (tuning the AMX ones would time ATen alone and keep it under the AMX key, for
            # this and every later process)
            cands = with_candidates()
            if untuned():
                prebuild()
        spent = time.perf_counter() - t_start
        budget = min(TUNE_BUDGET_S, max(MIN_TUNE_BUDGET_S, COLD_TARGET_S - spent))

    def tuning_args() -> tuple[Any, ...]:
        return premade.pop() if premade else make_args()

    # fit the timing into the cold-tuning budget: reps so that candidates x calls x est <= budget
    # (at 5e10 FLOP/s for every shape an AMX call of 7 ms was costed 0.34 s: one timed call
    # per candidate, and the first candidate after the anchor absorbed the allocator's warm-up,
    # a fresh 16 MB output of page faults per call for the first few calls, 16 against 7 ms)
    est = 2.0 * mb * n * k / _flop_rate(mb, isa, b.element_size())
    est += (k * n * b.element_size()) / 2e10
    reps = int(budget / (len(cands) * max(est, 1e-6))) - 2
    reps = max(1, min(config.get("autotune_reps"), reps))
    with config.override(autotune_reps=reps):
        choice = autotune.select(
            "gemm",
            key,
            _tuning_order(cands),
            lambda c: _tuning_fn(c, spec),
            tuning_args,
            cold=False,
            check=_close,
            backends=autotune.allowed_backends(),
            confirm=True,
            budget_s=budget,
            final_round=FINAL_ROUND if mb <= SMALL_M else 0,
            final_round_s=FINAL_ROUND_SHARE * budget,
            final_factory=lambda cs: _round_fns(cs, spec),
        )
    with _decisions_lock:
        label = f"M={m} N={n} K={k} {key['dtype']} [{key['epilogue'] or 'none'}]"
        decisions[("gemm", label)] = choice.candidate.name
    runner_up = None
    if choice.candidate.is_anchor and autotune.NATIVE in autotune.allowed_backends():
        timed = [c for c in cands if not c.is_anchor and c.name in choice.timings_s]
        if timed:
            runner_up = min(timed, key=lambda c: choice.timings_s[c.name])
    return choice.candidate, runner_up


# --- the custom op ---------------------------------------------------------------------------------


# the operand shape each step kind needs, from (M, N)
_OPERAND_SHAPES = {
    "bias_col": lambda m, n: (n,),
    "scale_col": lambda m, n: (n,),
    "bias_row": lambda m, n: (m,),
    "scale_row": lambda m, n: (m,),
    "add": lambda m, n: (m, n),
}


def _check_op_args(
    a: torch.Tensor, b: torch.Tensor, operands: list[torch.Tensor], sp: EpilogueSpec, spec: str
) -> None:
    """The raw op's arguments against its spec: :func:`mm` builds them right, but the op is public
    (``torch.ops.torchport.gemm``) and the kernels read each operand's full span unchecked (a
    ``[1]`` bias for N = 17 read past its end; a missing operand crashed the process)."""
    meta = _check_ab(a, b, "gemm")
    kinds = [op for op in sp.ops if op.kind in OPERAND_KINDS]
    if len(operands) != len(kinds):
        raise GemmInputError(
            f"gemm: epilogue {spec!r} takes {len(kinds)} operand tensors, got {len(operands)}"
        )
    m, n = a.shape[0], b.shape[1]
    for i, (op, t) in enumerate(zip(kinds, operands)):
        want, dt = _OPERAND_SHAPES[op.kind](m, n), _TAG_DT[op.dtype]
        on = isinstance(t, torch.Tensor) and (t.is_meta if meta else t.is_cpu)
        if not (on and t.dtype == dt and t.shape == want):
            got = f"{t.dtype} {tuple(t.shape)} on {t.device}" if isinstance(t, torch.Tensor) else t
            raise GemmInputError(
                f"gemm: operand {i} of epilogue {spec!r} ({op.kind}:{op.dtype}) must be a "
                f"{'meta' if meta else 'cpu'} {dt} tensor of shape {want}, got {got}"
            )


def _check_scales(sp: EpilogueSpec, operands: Sequence[torch.Tensor]) -> None:
    """Scale operands (a row or column, a learnable scalar) must be finite, as constant scales
    must (:func:`epilogue.split`): checked when the op runs, so eager and compiled calls agree
    (a traced split cannot read a tensor's values)."""
    kinds = [op.kind for op in sp.ops if op.kind in OPERAND_KINDS]
    for i, (kind, t) in enumerate(zip(kinds, operands)):
        if kind.startswith("scale_") and t.numel() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).nonzero()[0, 0])
            raise EpilogueError(
                f"epilogue operand {i} ({kind}) must be finite, got {float(t[bad])} at index {bad}"
            )


def _gemm_impl(
    a: torch.Tensor, b: torch.Tensor, operands: list[torch.Tensor], spec: str
) -> torch.Tensor:
    if _any_autocast() and torch.is_autocast_enabled("cpu"):  # the op computes in its inputs'
        # dtypes, as its fake says: the ATen runners' torch.mm would give the autocast dtype
        with torch.autocast("cpu", enabled=False):
            return _gemm_impl(a, b, operands, spec)
    sp = EpilogueSpec.decode(spec)
    _check_op_args(a, b, operands, sp, spec)
    if "scale_" in spec:
        _check_scales(sp, operands)
    if native.enabled() and a.shape[0] > 0 and b.shape[1] > 0:
        try:
            _, run = _settle(a, b, sp, spec, operands)
            return run(a, b, operands)
        except (native.NativeError, InvalidCandidate) as e:
            native.note_fallback("gemm", e)
    return mm_aten(a, b, sp, operands)


_gemm_op = torch.library.custom_op("torchport::gemm", _gemm_impl, mutates_args=())


@_gemm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, operands: list[torch.Tensor], spec: str) -> torch.Tensor:
    _check_op_args(a, b, operands, EpilogueSpec.decode(spec), spec)
    out = EpilogueSpec.decode(spec).out_dtype(a.dtype)
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out)


# the steps whose backward reads the value they were applied to (the rest need no recompute)
_READS_INPUT = frozenset(("scale_col", "scale_row", "relu", "gelu", "gelu_tanh", "silu"))


@functools.lru_cache(maxsize=1024)
def _backward_reads(spec: str) -> tuple[int, tuple[bool, ...]]:
    """What the backward of a call with this spec reads: the last step that reads its input
    value (-1 for none: nothing is recomputed from ``a @ b``) and, per operand, whether the
    backward reads it (a scale operand always, the gradient flows through it; a bias or a
    residual only to recompute the input of a later step that reads it)."""
    ops = EpilogueSpec.decode(spec).ops
    last = max((i for i, op in enumerate(ops) if op.kind in _READS_INPUT), default=-1)
    keep = tuple(
        op.kind in ("scale_col", "scale_row") or i < last
        for i, op in enumerate(ops)
        if op.kind in OPERAND_KINDS
    )
    return last, keep


def _setup(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    # saves only what _backward reads, as eager's ops do (mm saves mat1 only for mat2's gradient,
    # add and addmm save no bias or residual): every tensor saved is one the caller may not
    # modify in place before the backward, and an inference tensor cannot be saved at all
    # (saving all of them failed where eager's ops work: a residual or a frozen bias updated in
    # place, a bias made under inference_mode, the input of a frozen weight's layer modified)
    a, b, operands, spec = inputs
    last, keep = _backward_reads(spec)
    ctx.spec, ctx.dtype = spec, a.dtype
    ctx.operand_dtypes = [t.dtype for t in operands]
    # a for b's gradient, b for a's; both to recompute a step's input (needs_input_grad holds
    # the flattened inputs here: a, b, then the operands)
    ctx.saved_ab = (last >= 0 or ctx.needs_input_grad[1], last >= 0 or ctx.needs_input_grad[0])
    ab = [t for t, saved in zip((a, b), ctx.saved_ab) if saved]
    ctx.save_for_backward(*ab, *(t for t, k in zip(operands, keep) if k))


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    saved = iter(ctx.saved_tensors)
    a, b = (next(saved) if s else None for s in ctx.saved_ab)
    last, keep = _backward_reads(ctx.spec)
    operands = [next(saved) if k else None for k in keep]
    sp = EpilogueSpec.decode(ctx.spec)
    dt = ctx.dtype
    # recompute the chain's intermediate values with ATen ops, in float32 as the kernels compute
    # them (a float32 accumulator, the epilogue on it; one rounding at the store): recomputed in
    # bf16, a bf16 GEMM's product and a float32 bias were rounded to bf16 before a float32
    # Scale's gradient multiplied by them (its sum was off by the bias's rounding times sum(g)).
    # Only a step that reads its input value (a scale operand's gradient, an activation's
    # derivative) needs it: without one (plain mm/linear, bias, add, a constant scale) nothing is
    # recomputed, and the chain stops at the last such step. torch 2.13 has no CPU GEMM from
    # bf16 to a float32 product (mm/addmm/bmm's out_dtype overloads are CUDA only), so for a
    # bf16 GEMM the recompute holds float32 copies of a and b and the float32 product at once,
    # 4 x (M*K + K*N + M*N) bytes (twice a and b's own size, plus the product); after it, one
    # M x N float32 value per reading step, and one more while a step or derivative runs. For a
    # float32 GEMM the casts are no-ops (only the product is new)
    cdt = torch.float32
    reads = [op.kind in _READS_INPUT for op in sp.ops]
    h = None
    if last >= 0:
        assert a is not None and b is not None
        h = a.to(cdt) @ b.to(cdt)
    hs: list[torch.Tensor | None] = []
    it = iter(zip(operands, ctx.operand_dtypes))
    vals: list[torch.Tensor | None] = []
    # per step: the dtype its operand's gradient is summed in, the wider of the GEMM's and the
    # operand's (eager's promotion: a bf16 bias of a float32 GEMM is added in float32, and its
    # gradient summed there; summed in bf16, each element was rounded first, 0.0625 off)
    accs: list[torch.dtype] = []
    for i, op in enumerate(sp.ops):
        hs.append(h if reads[i] else None)
        # a scale operand keeps its dtype: _step and the gradient multiply in the wider dtype
        # and round once, as the forward does (a float32 column of 0.1 cast to bf16 first was
        # 0.10009765625); a bias or add operand is added to the float32 value by promotion
        # (exact, no float32 copy of a bf16 residual), and only read (saved) where a later
        # step's input is recomputed
        raw, odt = next(it) if op.kind in OPERAND_KINDS else (None, None)
        vals.append(raw if op.kind in ("scale_col", "scale_row") else None)
        accs.append(dt if odt is None else torch.promote_types(dt, odt))
        if h is not None:
            h = _step(h, op, raw) if i < last else None
    g = grad.to(dt)
    grads_ops: list[torch.Tensor | None] = []
    # a float32 bias or scale of a bf16 GEMM gets its gradient summed in float32 from exact
    # products (bf16 x bf16 fits float32), as eager's float32 autograd sums: the bf16 sum was
    # rounded to bf16 (1 bf16 ulp off, 0.03 on a bias gradient of ~8). A bf16 operand's sum is
    # rounded to bf16 once, as F.linear's bias gradient; a bf16 operand of a float32 GEMM is
    # summed in float32 and rounded once (all as eager). Memory, only where a bf16 gradient is
    # summed in float32: ATen's CPU sum with dtype= widens its input first (an M x N float32
    # temporary, 16 MiB at 2048 x 2048), and a scale's product takes two (32 MiB; mul_ into the
    # widened copy allocates the same, CPU TensorIterator widens the bf16 factor too). Eager's
    # own float32 autograd widens the whole gradient as well. A bf16 ones-vector matmul rounds
    # its sums to bf16, and a row-chunked sum equals ATen's only where the chunks line up with
    # its cascade's levels (16-row steps, then sums of 16), not in general: not eager's bits.
    for op, x, t, acc in zip(reversed(sp.ops), reversed(hs), reversed(vals), reversed(accs)):
        k = op.kind
        if k == "bias_col":
            grads_ops.append(g.sum(0, dtype=acc))
        elif k == "bias_row":
            grads_ops.append(g.sum(1, dtype=acc))
        elif k == "add":
            grads_ops.append(g)
        elif k == "scale_col":
            assert t is not None and x is not None
            grads_ops.append((g.to(acc) * x).sum(0))
            g = (g * t).to(dt)
        elif k == "scale_row":
            assert t is not None and x is not None
            grads_ops.append((g.to(acc) * x).sum(1))
            g = (g * t[:, None]).to(dt)
        elif k == "scale":
            g = g * op.value
        elif k == "relu":
            assert x is not None
            # as eager's relu backward (zero where the input is <= 0): a NaN input passes the
            # gradient (where(x > 0, ...) zeroed it, so a NaN row's grad_a was 0, not g @ b.T)
            g = torch.ops.aten.threshold_backward(g.to(cdt), x, 0).to(dt)
        elif k in ("gelu", "gelu_tanh"):
            assert x is not None
            approx = "none" if k == "gelu" else "tanh"
            g = torch.ops.aten.gelu_backward(g.to(cdt), x, approximate=approx).to(dt)
        else:
            assert x is not None
            if torch.is_grad_enabled():  # create_graph: silu_backward has no derivative
                s = torch.sigmoid(x)
                g = (g.to(cdt) * s * (1 + x * (1 - s))).to(dt)
            else:
                g = torch.ops.aten.silu_backward(g.to(cdt), x).to(dt)
    grads_ops.reverse()
    ga = gb = None
    if ctx.needs_input_grad[0]:
        assert b is not None
        ga = g @ b.t()
    if ctx.needs_input_grad[1]:
        assert a is not None
        gb = a.t() @ g
    gops = [None if go is None else go.to(o) for go, o in zip(grads_ops, ctx.operand_dtypes)]
    return ga, gb, gops, None


def _step(h: torch.Tensor, op: Any, t: torch.Tensor | None) -> torch.Tensor:
    k = op.kind
    if k in ("bias_col", "add"):
        assert t is not None
        return h + t
    if k == "bias_row":
        assert t is not None
        return h + t[:, None]
    if k == "scale_col":
        assert t is not None
        return (h * t).to(h.dtype)
    if k == "scale_row":
        assert t is not None
        return (h * t[:, None]).to(h.dtype)
    if k == "scale":
        return h * op.value
    if k == "relu":
        return torch.relu(h)
    if k == "gelu":
        return torch.nn.functional.gelu(h)
    if k == "gelu_tanh":
        return torch.nn.functional.gelu(h, approximate="tanh")
    return torch.nn.functional.silu(h)


torch.library.register_autograd("torchport::gemm", _backward, setup_context=_setup)


# --- public API ------------------------------------------------------------------------------------


_Tensor, _strided = torch.Tensor, torch.strided
# whether any autocast region is on (a C call, ~75 ns: mm's per-call test before the CPU one)
_any_autocast = torch._C._is_any_autocast_enabled


class _GemmTypeError(GemmInputError, TypeError):
    """A :class:`GemmInputError` of the wrong type (a list, a number, None or a numpy array for
    a tensor), also a ``TypeError`` as ``torch.mm`` and ``F.linear`` raise it (code catching
    torch's TypeError catches this too)."""


def _check_ab(a: object, b: object, who: str) -> bool:
    """``a [M, K]`` and ``b [K, N]`` for a GEMM: dense 2-D CPU tensors of one dtype, float32 or
    bfloat16, with matching K (:func:`mm`'s checks, and the raw op's; ``who`` names the caller
    in the error). Plain tensors that pass are recognised in one expression (mm's per-call
    cost); anything else takes the checks one by one, each with its own message. True when
    both are meta tensors (shapes only) that pass, False for CPU ones."""
    if (
        type(a) is _Tensor
        and type(b) is _Tensor
        and a.is_cpu
        and b.is_cpu
        and a.layout is _strided
        and b.layout is _strided
        and a.dim() == 2
        and b.dim() == 2
        and a.dtype in DTYPES
        and a.dtype is b.dtype
        and a.shape[1] == b.shape[0]
    ):
        return False
    for name, t in (("a", a), ("b", b)):  # both first: mm(meta, [..]) blamed a's device
        if not isinstance(t, torch.Tensor):
            raise _GemmTypeError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    meta = a.is_meta and b.is_meta
    for name, t in (("a", a), ("b", b)):
        if not (t.is_cpu or meta):
            raise GemmInputError(f"{who}: {name} must be on device 'cpu', got {t.device}")
        if t.layout != torch.strided:  # (sparse and mkldnn tensors failed later, untyped)
            raise GemmInputError(f"{who}: {name} must be a dense (strided) tensor, got {t.layout}")
        if t.dim() != 2:
            raise GemmInputError(
                f"{who}: {name} must be 2-D, got {t.dim()}-D shape {tuple(t.shape)}"
            )
        if t.dtype not in DTYPES:
            raise GemmInputError(f"{who}: {name} must be float32 or bfloat16, got {t.dtype}")
    if a.dtype != b.dtype:
        raise GemmInputError(
            f"{who}: a and b must have the same dtype, got {a.dtype} and {b.dtype}"
        )
    if a.shape[1] != b.shape[0]:
        raise GemmInputError(
            f"{who}: inner dimensions must match (a is {tuple(a.shape)}, b is {tuple(b.shape)}: "
            f"K={a.shape[1]} vs {b.shape[0]})"
        )
    return meta


# encoded spec of a lone column bias, per bias dtype (what :func:`split` yields for it)
_BIAS_SPECS = {torch.float32: "bias_col:f32", torch.bfloat16: "bias_col:bf16"}


def _plain_bias(t: object, n: int) -> bool:
    """True for a bias :func:`split` would accept as is: a CPU float32/bfloat16 tensor ``[n]``."""
    return (
        isinstance(t, torch.Tensor)
        and t.is_cpu
        and t.dtype in _BIAS_SPECS
        and t.dim() == 1
        and t.shape[0] == n
    )


def mm(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    epilogue: Sequence[Step] | Step | None = None,
) -> torch.Tensor:
    """``epilogue(a @ b + bias)`` for 2-D CPU float32/bfloat16 ``a [M, K]``, ``b [K, N]``.

    Any strides are accepted (``b = weight.t()`` is read in place). ``bias`` is ``[N]``.
    ``epilogue`` is a sequence of steps from :mod:`torchport.gemm.epilogue` (or the names
    ``"relu"``, ``"gelu"``, ``"gelu_tanh"``, ``"silu"``); the fused ones run inside the kernel's
    store, anything else (a callable) runs afterwards as torch ops.
    """
    if _check_ab(a, b, "mm"):
        return _mm_meta(a, b, bias, epilogue)
    if _any_autocast() and torch.is_autocast_enabled("cpu"):
        return _mm_autocast(a, b, bias, epilogue)
    if functorch_active():  # torch.func: torch ops, which every transform supports (the
        # custom op has no forward-mode formula: jvp gave a zero tangent)
        sp = split(epilogue, a.shape[0], b.shape[1], bias=bias)
        # (under vmap a batched value has no single truth to test: left unchecked; a scale
        # that is read and fails is refused, EpilogueError being a RuntimeError too)
        try:
            _check_scales(sp.spec, sp.operands)
        except EpilogueError:
            raise
        except RuntimeError:
            pass
        y = mm_aten(a, b, sp.spec, sp.operands)
        return apply_tail(y, sp.tail) if sp.tail else y
    if (epilogue is None or (isinstance(epilogue, (list, tuple)) and not epilogue)) and (
        bias is None or _plain_bias(bias, b.shape[1])
    ):
        # plain GEMM or GEMM + bias (nn.Linear): the spec is known without walking the steps
        operands = [] if bias is None else [bias]
        spec = "" if bias is None else _BIAS_SPECS[bias.dtype]
        if native.eager_fast_path(a, b, *operands):
            return _eager(a, b, operands, spec)
        return _gemm_op(a, b, operands, spec)
    hit = fast_split(epilogue, a.shape[0], b.shape[1], bias)
    if hit is not None:  # an epilogue of activations and residuals seen before: no Split
        encoded, operands = hit
        if native.eager_fast_path(a, b, *operands):
            return _eager(a, b, operands, encoded)
        return _gemm_op(a, b, operands, encoded)
    sp = split(epilogue, a.shape[0], b.shape[1], bias=bias)
    encoded = sp.spec.encode()
    if native.eager_fast_path(a, b, *sp.operands):
        y = _eager(a, b, sp.operands, encoded)
    else:
        y = _gemm_op(a, b, sp.operands, encoded)
    return apply_tail(y, sp.tail) if sp.tail else y


def _mm_meta(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    epilogue: Sequence[Step] | Step | None,
) -> torch.Tensor:
    """:func:`mm` of meta tensors (shapes only): the CPU call itself runs under a fake-tensor
    mode, on stand-ins of the meta tensors, so the operands are checked and the result's dtype
    is chosen exactly as for a real call (the custom op's fake gives it), then the result is
    handed back as a meta tensor. An operand tensor must be on meta too, except a 0-d one (a
    scalar, which torch's own ops take from the CPU as well)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def cpu(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and (t.is_meta or t.dim() == 0):
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype)
        return t

    def step_on_cpu(step: Any) -> Any:
        if isinstance(step, Bias):
            return Bias(cpu(step.t), step.dim)
        if isinstance(step, Add):
            return Add(cpu(step.t))
        if isinstance(step, Scale):
            return Scale(cpu(step.value), step.dim)
        return step

    steps = as_steps(epilogue)
    # operands on another device (a real tensor under the fake mode failed untyped: "Please
    # convert all Tensors to FakeTensors first"), numbered as split numbers the steps
    named: list[tuple[str, object]] = [] if bias is None else [("bias", bias)]
    for st in steps:
        if isinstance(st, (Bias, Add)):
            named.append(("bias" if isinstance(st, Bias) else "residual", st.t))
        else:
            named.append(("scale", st.value if isinstance(st, Scale) else None))
    for idx, (what, t) in enumerate(named):
        if isinstance(t, torch.Tensor) and not (t.is_meta or t.dim() == 0):
            raise EpilogueError(
                f"epilogue step {idx} {what} must be on device 'meta' as a and b are, "
                f"got {t.device}"
            )
    with FakeTensorMode():
        y = mm(cpu(a), cpu(b), bias=cpu(bias), epilogue=[step_on_cpu(st) for st in steps])
    return torch.empty_strided(y.shape, y.stride(), dtype=y.dtype, device="meta")


def _mm_autocast(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    epilogue: Sequence[Step] | Step | None,
) -> torch.Tensor:
    """:func:`mm` inside a CPU autocast region. With bfloat16 as the region's dtype the GEMM runs
    in bfloat16, as ``F.linear``'s does there (float32 ``a`` and ``b`` are cast; epilogue
    operands are read in their own dtypes, in the float32 accumulator) and the result is
    bfloat16; with another dtype (float16, which the kernels lack) it runs in the inputs' own
    dtypes. Autocast is off inside: the ATen runners' ``torch.mm`` gave the region's dtype
    while the native kernels gave float32, so the result's dtype depended on the tuner's
    choice (and an epilogue pass built for a float32 product failed on a bfloat16 one)."""
    dt = torch.get_autocast_dtype("cpu")
    if dt == torch.bfloat16:
        a = a.to(dt) if a.dtype == torch.float32 else a
        b = b.to(dt) if b.dtype == torch.float32 else b
    with torch.autocast("cpu", enabled=False):
        return mm(a, b, bias=bias, epilogue=epilogue)


def _eager(
    a: torch.Tensor, b: torch.Tensor, operands: list[torch.Tensor], spec: str
) -> torch.Tensor:
    """Plain eager call: a settled problem goes straight to its runner (no dispatcher, no spec
    decoding, no config reads); anything else takes the custom op's implementation."""
    if a.shape[0] > 0 and b.shape[1] > 0:
        hit = _settled.get(_settled_key(a, b, spec))
        if hit is not None:
            if "scale_" in spec:
                _check_scales(EpilogueSpec.decode(spec), operands)
            return hit[1](a, b, operands)
    return _gemm_impl(a, b, operands, spec)


def gemm_op(
    a: torch.Tensor, b: torch.Tensor, operands: list[torch.Tensor], spec: str
) -> torch.Tensor:
    """The raw custom op (``torch.ops.torchport.gemm``) for compiler rewrites."""
    return _gemm_op(a, b, operands, spec)


__all__ = ["DTYPES", "SMALL_M", "bucket", "candidates", "choose", "decisions", "gemm_op", "mm"]
