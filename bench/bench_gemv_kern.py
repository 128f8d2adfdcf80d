"""Decode GEMV kernels alone, A/B: streamed weights on one and two threads against the read peak.

Each variant (``--variants``, specs ``fmt:kernel:hint:prefetch[:rows]``, e.g. ``fp8:shift:NTA:2048``,
``fp8:shift:NTA:2048:2``, ``mxfp4:block:NTA:2048``, ``bf16:native:T0:512``, ``bf16:dp:NTA:2048``, ``fp8:dp:T1:2048``: E4M3 weights on the ``vdpbf16ps`` kernel, ``fp8:dpamx:T1:0``: on AMX-BF16 tiles, ``nvfp4:amx:T1:0``: FP4 on AMX-INT8 tiles, whose prefetch field is unused; ``fp8:dpamx:T1:0:f32``: float32 activations, split
into three bf16 parts) is called on
B = ``--batch`` activation rows against copies of one ``--rows`` × ``--k`` weight on 2 MiB pages,
rotated over twice the largest reported cache (``cold_bytes``). Every repetition times, interleaved in one process, each
variant and the native read peak (:mod:`torchport.gemv.readpeak`, one stream without prefetch and
four streams NTA 512 ahead; the faster is the peak) on one thread and on all threads (wall
time; one thread also thread CPU time). Prints medians: ms per call, GB/s of weight bytes (data +
scales), % of the same repetitions' read peak at the same thread count. ``--rows 96 --copies 1
--inner 20`` keeps the weight in L2 (the decode rate).

Run: ``flock /tmp/tp-bench.lock python bench/bench_gemv_kern.py --variants ... [--reps 11]``.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

import torch

from torchport import native
from torchport.autotune import cold_bytes
from torchport.benchmarks import positive_int
from torchport.gemv.bf16_kernel import gemv_bf16_dp_kernel
from torchport.gemv.fp4_kernel import (
    gemv_fp4_amx_kernel,
    gemv_fp4_block_kernel,
    gemv_fp4_wblock_kernel,
)
from torchport.gemv.fp8_kernel import gemv_fp8_shift_kernel
from torchport.gemv.hugepages import hugepage_copy, hugepage_empty
from torchport.gemv.kernels import gemv_kernel
from torchport.gemv.ops import PackedWeight, _launch, pack_dense
from torchport.gemv.readpeak import READ_CONFIGS, read_launcher
from torchport.lowp import Float8Tensor, MXTensor, NVFP4Tensor

COLD_BYTES = cold_bytes()  # twice the largest reported cache, at least 96 MB


def _pack(fmt: str, n: int, k: int) -> PackedWeight:
    w = torch.randn(n, k) * 0.02
    if fmt == "fp8":
        pw = Float8Tensor.from_float(w, torch.float8_e4m3fn, granularity="row").gemv_pack()
    elif fmt == "nvfp4":
        pw = NVFP4Tensor.from_float(w).gemv_pack()
    elif fmt == "mxfp4":
        pw = MXTensor.from_float(w, "fp4_e2m1").gemv_pack()
    elif fmt in ("f32", "bf16"):
        pw = pack_dense(w if fmt == "f32" else w.bfloat16())
    else:
        raise ValueError(f"unknown format {fmt!r}")
    return PackedWeight(
        pw.fmt,
        hugepage_copy(pw.data),
        hugepage_copy(pw.scales) if pw.scales.numel() else pw.scales,
        pw.rowscale,
        pw.pts,
        pw.n,
        pw.k,
        pw.int8,
    )


def _kernel(spec: str) -> tuple[str, object]:
    """(format, kernel) for ``fmt:kernel:hint:prefetch[:rows]``."""
    fmt, kind, hint, pf, *rest = spec.split(":")
    isa = native.cpu_info().isa
    if kind == "shift":
        rows = int(rest[0]) if rest else 1
        return fmt, gemv_fp8_shift_kernel(isa, int(pf), hint=hint, rows=rows)
    if kind == "block":
        return fmt, gemv_fp4_block_kernel(fmt, isa, int(pf), hint=hint)
    if kind == "wblock":  # rest: rows, xmin, xblock (bytes), load (bits), chunk (bytes a claim)
        rows = int(rest[0]) if rest else 2
        extra = {k: int(v) for k, v in zip(("xmin", "xblock", "load", "chunk"), rest[1:])}
        return fmt, gemv_fp4_wblock_kernel(fmt, isa, int(pf), hint=hint, rows=rows, **extra)
    if kind == "amx":  # FP4 weights on AMX-INT8 tiles
        return fmt, gemv_fp4_amx_kernel(fmt, hint=hint)  # (no prefetch distance: next group)
    if kind in ("dp", "dpamx"):  # bf16 weights, or E4M3 decoded to bf16 (bf16-valued activations)
        if fmt not in ("bf16", "fp8"):
            raise ValueError(f"the dp kernels take bf16 or fp8 weights, got spec {spec!r}")
        weights = "bf16" if fmt == "bf16" else "fp8_e4m3"
        amx = kind == "dpamx"  # on AMX-BF16 tiles (its prefetch field unused)
        return fmt, gemv_bf16_dp_kernel(isa, int(pf), hint=hint, weights=weights, amx=amx)
    if kind == "native":
        r4 = int(rest[0]) if rest else None
        return fmt, gemv_kernel("fp8_e4m3" if fmt == "fp8" else fmt, isa, int(pf), r4)
    raise ValueError(f"unknown kernel kind {kind!r}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--variants", nargs="+", required=True)
    # (unchecked, --reps 0 was a ValueError from max() of no samples, --threads 0 or --rows 0
    # a kernel call on nothing)
    p.add_argument("--reps", type=positive_int, default=11)
    p.add_argument("--rows", type=positive_int, default=11008)
    p.add_argument("--k", type=positive_int, default=4096)
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--threads", type=positive_int, nargs="+", default=None)
    p.add_argument(
        "--copies", type=positive_int, default=None, help="weight copies (default: past L3)"
    )
    p.add_argument(
        "--inner", type=positive_int, default=1, help="calls per sample (time: their mean)"
    )
    args = p.parse_args()
    nt = native.num_threads()
    thread_counts = args.threads or sorted({1, nt})
    x = torch.randn(args.batch, args.k)
    packs: dict[str, list[PackedWeight]] = {}
    fns: dict[str, tuple[Callable[[int, int], object], int]] = {}
    for spec in args.variants:
        fmt, kern = _kernel(spec)
        if fmt not in packs:
            one = _pack(fmt, args.rows, args.k)
            nbytes = one.data.nbytes + one.scales.nbytes
            copies = args.copies or max(2, math.ceil(COLD_BYTES / nbytes))
            packs[fmt] = [one] + [_pack(fmt, args.rows, args.k) for _ in range(copies - 1)]
        ws = packs[fmt]
        out = torch.empty(args.batch, args.rows)

        # bf16 weights and the dp kernels meet bf16-valued activations (a bf16 model's; the
        # vdpbf16ps kernel's pair-dot path takes only those) unless the spec ends ":f32" (the
        # AMX build splits float32 activations of E4M3 weights into three bf16 parts)
        bx = fmt == "bf16" or spec.split(":")[1] in ("dp", "dpamx")
        xv = x.bfloat16().float() if bx and not spec.endswith(":f32") else x

        def run(i: int, th: int, _k=kern, _w=ws, _o=out, _x=xv) -> None:
            _launch(_k, _x, _w[i % len(_w)], None, _o, th)

        fns[spec] = (run, ws[0].data.nbytes + ws[0].scales.nbytes)
    bufs = [hugepage_empty((128 << 20,), torch.uint8).fill_(i + 1) for i in range(2)]
    for cfg in (READ_CONFIGS[0], READ_CONFIGS[-1]):
        for th in thread_counts:
            reads = [read_launcher(b, th, cfg) for b in bufs]

            def read(i: int, t: int, _r=reads) -> object:
                return _r[i % 2]()

            fns[f"read {cfg.name} t{th}"] = (read, 128 << 20)
    samples: dict[tuple[str, int], list[float]] = {}
    cpu: dict[tuple[str, int], list[float]] = {}
    call = 0
    for rep in range(args.reps + 1):
        for name, (fn, _) in fns.items():
            for th in thread_counts:
                if name.startswith("read") and not name.endswith(f"t{th}"):
                    continue
                inner = 1 if name.startswith("read") else args.inner
                c0, t0 = time.thread_time(), time.perf_counter()
                for _ in range(inner):
                    fn(call, th)
                    call += 1
                dt, dc = (time.perf_counter() - t0) / inner, (time.thread_time() - c0) / inner
                if rep:  # the first repetition warms up
                    samples.setdefault((name, th), []).append(dt)
                    cpu.setdefault((name, th), []).append(dc)
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    print(f"# {args.rows}x{args.k} B={args.batch} reps={args.reps} load {' '.join(load)}")
    peak = {}
    for th in thread_counts:
        bw = [
            (128 << 20) / statistics.median(v) / 1e9
            for (n, t), v in samples.items()
            if n.startswith("read") and t == th
        ]
        peak[th] = max(bw)
        print(
            f"read peak {th}t: {peak[th]:.2f} GB/s (configs: {', '.join(f'{b:.2f}' for b in bw)})"
        )
    for name, (_, nbytes) in fns.items():
        if name.startswith("read"):
            continue
        cells = []
        for th in thread_counts:
            m = statistics.median(samples[(name, th)])
            gbs = nbytes / m / 1e9
            cells.append(f"{th}t {m * 1e3:7.3f} ms {gbs:6.2f} GB/s {100 * gbs / peak[th]:4.0f}%")
            if th == 1:  # one thread runs on the calling thread: its CPU time, which the
                # neighbours' share of the core does not inflate
                mc = statistics.median(cpu[(name, th)])
                cells[-1] += f" (cpu {mc * 1e3:7.3f} ms {nbytes / mc / 1e9:6.2f} GB/s)"
        print(f"{name:<28} " + " | ".join(cells))


if __name__ == "__main__":
    main()
