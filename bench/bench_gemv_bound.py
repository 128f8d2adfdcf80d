"""Is the low-precision decode GEMV bound by its decode or by the memory stream? (one run, A/B)

For FP8 (E4M3 shift decode), NVFP4 and MXFP4 (lane-block int8 kernel), B = 1, K = 4096, the
native kernel alone (no Python dispatch) is timed on:

- an L2-resident weight (``--l2-rows`` rows, one copy), one thread, thread CPU time per call
  less that of an 8-row call (the fixed cost: activation prep, launch): the decode rate, ns per
  weight;
- a streamed weight (``--rows`` rows, copies rotated past L3), one thread (thread CPU time and
  wall) and all threads (wall);

next to ``Tensor.sum`` over a 128 MiB float32 tensor on one thread and on all threads, timed
interleaved with the kernels: the read bandwidth a stream can reach. Prints medians and minima.
``--packed`` adds the whole eager call (``gemv_packed``: tuned plan, thread choice) and the
pair-split FP4 kernel on the same weights.

Run: ``flock /tmp/tp-bench.lock python bench/bench_gemv_bound.py [--reps 15] [--prefetch 4096]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from torchport import gemv as G
from torchport import native
from torchport.benchmarks import positive_int
from torchport.cli import int_at_least
from torchport.gemv.fp4_kernel import gemv_fp4_block_kernel, gemv_fp4_pair_kernel
from torchport.gemv.fp8_kernel import gemv_fp8_shift_kernel
from torchport.gemv.ops import _launch
from torchport.lowp import Float8Tensor, MXTensor, NVFP4Tensor

K = 4096
COLD_BYTES = 64 << 20


def _packs(fmt: str, n: int, copies: int) -> list:
    makers: dict[str, Callable[[torch.Tensor], Any]] = {
        "fp8": lambda w: Float8Tensor.from_float(w, torch.float8_e4m3fn, granularity="row"),
        "nvfp4": lambda w: NVFP4Tensor.from_float(w),
        "mxfp4": lambda w: MXTensor.from_float(w, "fp4_e2m1"),
    }
    make = makers[fmt]
    return [make(torch.randn(n, K) * 0.02).gemv_pack() for _ in range(copies)]


def _nbytes(pw) -> int:
    return pw.data.nbytes + pw.scales.nbytes


def _bpw(name: str) -> float:
    """Weight bytes (data + scales) per weight of the format that ``name`` starts with."""
    return {"fp8": 1.0, "nvfp4": 0.5 + 1 / 16, "mxfp4": 0.5 + 1 / 32}[name.split()[0]]


def _kernel(fmt: str, isa: str, prefetch: int, chunk: int | None):
    if fmt == "fp8":
        return gemv_fp8_shift_kernel(isa, prefetch, chunk)
    return gemv_fp4_block_kernel(fmt, isa, prefetch, chunk)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    # (unchecked, --reps 0 was a StatisticsError, --l2-rows 8 a ZeroDivisionError: the L2 rate
    # is the time less that of an 8-row call)
    p.add_argument("--reps", type=positive_int, default=15)
    p.add_argument("--rows", type=positive_int, default=11008)
    p.add_argument("--l2-rows", type=int_at_least(9), default=96)
    p.add_argument("--prefetch", type=int_at_least(0), nargs="*", default=[], help="bytes ahead")
    p.add_argument("--chunk", type=positive_int, default=None)
    p.add_argument("--packed", action="store_true", help="also gemv_packed and the pair kernel")
    p.add_argument(
        "--formats", nargs="*", choices=("fp8", "nvfp4", "mxfp4"), default=["fp8", "nvfp4", "mxfp4"]
    )
    args = p.parse_args()
    isa = native.cpu_info().isa
    nt = native.num_threads()
    x = torch.randn(1, K)
    bufs = [torch.rand(32 << 20) for _ in range(2)]
    # name -> (fn(i), bytes (streamed) or weights (L2) per call, kind); native kernels launched
    # with 0 threads use torch.get_num_threads(), set per sample
    fns: dict[str, tuple[Callable[[int], Any], float, str]] = {}

    fns["sum"] = (lambda i: bufs[i % 2].sum(), bufs[0].nbytes, "mem")
    for fmt in args.formats:
        defaults = [8192 if fmt == "fp8" else 4096]
        for pf in args.prefetch or defaults:
            kern = _kernel(fmt, isa, pf, args.chunk)
            small = _packs(fmt, args.l2_rows, 1)[0]  # one copy: hot in L2 after the first call
            tiny = _packs(fmt, 8, 1)[0]  # the fixed cost of a call (prep, launch, reduction)
            big_copies = max(2, math.ceil(COLD_BYTES / (args.rows * K)))
            big = _packs(fmt, args.rows, big_copies)
            out_s, out_b = torch.empty(1, args.l2_rows), torch.empty(1, args.rows)

            def l2(i: int, _k=kern, _p=small, _o=out_s) -> None:
                _launch(_k, x, _p, None, _o, 1)

            def l2_tiny(i: int, _k=kern, _p=tiny, _o=out_s) -> None:
                _launch(_k, x, _p, None, _o, 1)

            def dram(i: int, _k=kern, _p=big, _o=out_b) -> None:
                _launch(_k, x, _p[i % len(_p)], None, _o, 0)

            fns[f"{fmt} p{pf} L2"] = (l2, args.l2_rows * K, "l2")
            fns[f"{fmt} p{pf} 8 rows"] = (l2_tiny, 8 * K, "l2")
            fns[f"{fmt} p{pf} dram"] = (dram, _nbytes(big[0]), "mem")
        if args.packed:  # the whole eager call (plan lookup, thread choice) on the same weights

            def packed(i: int, _p=big) -> None:
                G.gemv_packed(x, _p[i % len(_p)])

            fns[f"{fmt} gemv_packed"] = (packed, _nbytes(big[0]), "mem_nt")
            if fmt != "fp8":
                pk = gemv_fp4_pair_kernel(fmt, isa, 512)

                def pair(i: int, _k=pk, _p=big, _o=out_b) -> None:
                    _launch(_k, x, _p[i % len(_p)], None, _o, 0)

                fns[f"{fmt} pair p512"] = (pair, _nbytes(big[0]), "mem")
    # samples[name][threads] = list of (wall, thread cpu)
    samples: dict[str, dict[int, list[tuple[float, float]]]] = {n: {1: [], nt: []} for n in fns}
    for fn, _, _ in fns.values():
        fn(0)
    call = 0
    for _ in range(args.reps):
        for name, (fn, _, kind) in fns.items():
            for threads in {"mem": (1, nt), "mem_nt": (nt,), "l2": (1,)}[kind]:
                torch.set_num_threads(threads)
                inner = 20 if kind == "l2" else 1
                c0, t0 = time.thread_time(), time.perf_counter()
                for _ in range(inner):
                    fn(call)
                    call += 1
                t1, c1 = time.perf_counter(), time.thread_time()
                samples[name][threads].append(((t1 - t0) / inner, (c1 - c0) / inner))
    torch.set_num_threads(nt)

    def med(v: list[float]) -> float:
        return statistics.median(v)

    sum_bw = {th: fns["sum"][1] / med([s[0] for s in samples["sum"][th]]) / 1e9 for th in (1, nt)}
    print(f"# isa={isa} threads={nt} reps={args.reps}")
    print(f"sum: 1 thread {sum_bw[1]:.2f} GB/s, {nt} threads {sum_bw[nt]:.2f} GB/s (medians)")
    for name, (_, work, kind) in fns.items():
        if name == "sum":
            continue
        if kind == "l2" and name.endswith("L2"):
            cpu = [s[1] for s in samples[name][1]]
            tiny = [s[1] for s in samples[name.replace("L2", "8 rows")][1]]
            per_w = (med(cpu) - med(tiny)) / (work - 8 * K)
            print(
                f"{name:<18} 1t cpu/weight less the 8-row call: {per_w * 1e9:.4f} ns "
                f"({1 / per_w / 1e9:.2f} Gw/s, {_bpw(name) / per_w / 1e9:.2f} GB/s of weights);"
                f" 8-row call {med(tiny) * 1e6:.1f} us"
            )
        if kind == "l2":
            continue
        if kind == "mem_nt":
            wn = [s[0] for s in samples[name][nt]]
            print(
                f"{name:<18} {nt}t wall med {work / med(wn) / 1e9:.2f} GB/s best {work / min(wn) / 1e9:.2f}"
                f" ({100 * work / med(wn) / 1e9 / sum_bw[nt]:.0f}% of {nt}t sum)"
            )
            continue
        w1 = [s[0] for s in samples[name][1]]
        cpu1 = [s[1] for s in samples[name][1]]
        wn = [s[0] for s in samples[name][nt]]
        print(
            f"{name:<18} 1t wall {work / med(w1) / 1e9:.2f} GB/s ({100 * work / med(w1) / 1e9 / sum_bw[1]:.0f}% of 1t sum)"
            f" cpu {work / med(cpu1) / 1e9:.2f} GB/s | {nt}t wall med {work / med(wn) / 1e9:.2f} GB/s"
            f" best {work / min(wn) / 1e9:.2f} ({100 * work / med(wn) / 1e9 / sum_bw[nt]:.0f}% of {nt}t sum)"
        )


if __name__ == "__main__":
    main()
