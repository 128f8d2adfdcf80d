"""Decode-bound GEMV on one thread: weights small enough to stay in L2 (no memory stall).

Two-thread decode GEMVs of FP4/FP8 weights run at a fraction of read bandwidth when one thread's
decode + dot is slower than half the memory stream; this benchmark isolates that decode rate.
One thread (``torch.set_num_threads(1)``), B = 1, weights of about 512 KiB per copy (two copies
in rotation, both L2-resident on a 1 MiB L2), against ``F.linear`` on the same weight dequantized
to bfloat16 (also one thread; its 2-4x larger weight may spill to L3). GB/s counts our weight
bytes (data + scales) per call; ``gw_s`` is weights per second of the whole ``gemv_packed`` call;
``kernel_gb_s`` times the tuned native kernel alone (launched as ``gemv_packed`` would, without the
Python around it: validation, plan lookup, output allocation), and ``call_overhead_us`` is the
difference per call. Interleaved medians.

Run: ``torchport bench gemv_decode [--quick]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torchport import config
from torchport import gemv as G
from torchport.benchmarks import BenchTable, arg_parser, compare
from torchport.gemv.ops import _launch, dequantize_packed, native_launch
from torchport.lowp import Float8Tensor, MXTensor, NVFP4Tensor

K = 4096


def _formats(n_fp4: int, n_fp8: int) -> dict:
    def fp8(w: torch.Tensor):
        return Float8Tensor.from_float(w, torch.float8_e4m3fn, granularity="row")

    return {
        "nvfp4": (n_fp4, NVFP4Tensor.from_float),
        "mxfp4": (n_fp4, lambda w: MXTensor.from_float(w, "fp4_e2m1")),
        "fp8": (n_fp8, fp8),
    }


def _repeat(fn, times: int = 20):
    """``fn`` called ``times`` times per timed sample (one sample is ~0.5 ms: timer noise < 1 %)."""
    return lambda i: [fn(i) for _ in range(times)]


def bench_format(table: BenchTable, fmt: str, n: int, make, reps: int) -> None:
    """One format: two rotated L2-resident copies, ours vs ``F.linear`` bf16, one thread."""
    ws = [make(torch.randn(n, K) * 0.02) for _ in range(2)]
    packs = [w.gemv_pack() for w in ws]
    dense = [dequantize_packed(pk).bfloat16() for pk in packs]
    x = torch.randn(1, K)
    xb = x.bfloat16()
    nbytes = packs[0].data.numel() + packs[0].scales.numel() * packs[0].scales.element_size()
    out = torch.empty(1, n)
    launch = native_launch(packs[0], 1)
    if launch is None:
        raise RuntimeError(f"no native GEMV kernel for {fmt} (native kernels disabled?)")
    kern = launch[0]
    fns = {
        "F.linear bf16": _repeat(lambda i: F.linear(xb, dense[i])),
        "ours": _repeat(lambda i: G.gemv_packed(x, packs[i])),
        "kernel": _repeat(lambda i: _launch(kern, x, packs[i], None, out, 1)),
    }
    t = compare(fns, [(0,), (1,)], reps=reps)
    ours = t["ours"] / 20
    table.add(
        f"N={n} K={K} B=1 {fmt} 1 thread (L2)",
        "F.linear bf16",
        t["F.linear bf16"] / 20,
        ours,
        nbytes,
        gw_s=f"{n * K / ours / 1e9:.1f}",
        kernel_gb_s=f"{nbytes / (t['kernel'] / 20) / 1e9:.2f}",
        call_overhead_us=f"{(ours - t['kernel'] / 20) * 1e6:.0f}",
    )


def main() -> None:
    p = arg_parser(__doc__ or "")
    args = p.parse_args()
    config.set("progress", False)
    reps = 15 if args.quick else args.reps
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    table = BenchTable("gemv_decode", unit="GB/s")
    table.start()
    try:
        for fmt, (n, make) in _formats(256, 128).items():
            bench_format(table, fmt, n, make, reps)
    finally:
        torch.set_num_threads(threads)
    table.save(args.json)


if __name__ == "__main__":
    main()
