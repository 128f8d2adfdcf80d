"""GEMV row scheduling A/B: static equal split vs rows claimed in chunks, one thread vs two.

For each weight format at N=11008, K=4096, B=1 (cold: weight copies rotate past L3), times the
same kernel built with the static per-thread split (``chunk=0``, the anchor) and with row ranges
of about ``chunk`` bytes claimed from a shared counter (:data:`torchport.gemv.kernels.CHUNK_BYTES`
by default), plus the static kernel on one thread, interleaved in one run, and prints each as %
of the read bandwidth of a large ``Tensor.sum`` measured in the same run. ``--quick``: FP4/FP8
formats and the default chunk only.

Run: ``torchport bench gemv_sched [--quick]``.
"""

from __future__ import annotations

import dataclasses

import torch

from torchport import native
from torchport.benchmarks import BenchTable, arg_parser, compare
from torchport.gemv import ops as gops
from torchport.gemv.fp4_kernel import gemv_fp4_pair_kernel
from torchport.gemv.fp8_kernel import gemv_fp8_shift_kernel
from torchport.gemv.hugepages import hugepage_copy
from torchport.gemv.kernels import CHUNK_BYTES, gemv_kernel
from torchport.lowp import Float8Tensor, MXTensor, NVFP4Tensor

COLD_BYTES = 96 << 20
N = 11008


def _kernel(fmt: str, isa: str, chunk: int):
    if fmt in ("nvfp4", "mxfp4"):
        return gemv_fp4_pair_kernel(fmt, isa, 512, chunk)
    if fmt == "fp8_e4m3":
        return gemv_fp8_shift_kernel(isa, 2048, chunk)
    return gemv_kernel(fmt, isa, 512, None, chunk)


def _packs(fmt: str, n: int, k: int) -> list[gops.PackedWeight]:
    base = torch.randn(n, k) * 0.02
    make = {
        "nvfp4": lambda w: NVFP4Tensor.from_float(w).gemv_pack(),
        "mxfp4": lambda w: MXTensor.from_float(w).gemv_pack(),
        "fp8_e4m3": lambda w: Float8Tensor.from_float(w).gemv_pack(),
        "bf16": lambda w: gops.pack_dense(w.bfloat16()),
    }[fmt]
    first = make(base)
    nbytes = first.data.numel() * first.data.element_size() + first.scales.numel()
    copies = max(2, -(-COLD_BYTES // nbytes))
    return [first] + [make(base + i * 1e-4) for i in range(1, copies)]


def bench_format(
    table: BenchTable, fmt: str, chunks: list[int], x: torch.Tensor, bufs: list, reps: int
) -> None:
    """Static split on one and on all threads vs each claim size, interleaved with a sum."""
    isa, nth = native.cpu_info().isa, native.num_threads()
    k = x.shape[1]
    packs = _packs(fmt, N, k)
    nbytes = packs[0].data.numel() * packs[0].data.element_size() + packs[0].scales.numel()

    def run(kern, threads: int):
        def f(i: int) -> None:
            out = torch.empty(1, N)
            gops._launch(kern, x, packs[i % len(packs)], None, out, threads)

        return f

    huge = [
        dataclasses.replace(pw, data=hugepage_copy(pw.data), scales=hugepage_copy(pw.scales))
        for pw in packs
    ]

    def run_huge(kern, threads: int):
        def f(i: int) -> None:
            out = torch.empty(1, N)
            gops._launch(kern, x, huge[i % len(huge)], None, out, threads)

        return f

    fns = {
        "sum": lambda i: bufs[i % 2].sum(),
        "static t1": run(_kernel(fmt, isa, 0), 1),
        f"static t{nth}": run(_kernel(fmt, isa, 0), nth),
    }
    for c in chunks:
        fns[f"chunk{c >> 10}K t{nth}"] = run(_kernel(fmt, isa, c), nth)
    fns[f"chunk{CHUNK_BYTES >> 10}K t{nth} 2M pages"] = run_huge(
        _kernel(fmt, isa, CHUNK_BYTES), nth
    )
    fns["static t1 2M pages"] = run_huge(_kernel(fmt, isa, 0), 1)
    t = compare(fns, [(i,) for i in range(len(packs) * 2)], reps=reps)
    bw = (32 << 20) * 4 / t["sum"] / 1e9
    anchor = f"static t{nth}"
    for name, s in t.items():
        if name != "sum":
            pct = 100 * nbytes / s / 1e9 / bw
            table.add(f"{fmt} {name}", anchor, t[anchor], s, nbytes, of_bw=f"{pct:.0f}%")
    print(f"# {fmt}: Tensor.sum {bw:.2f} GB/s in the same run")


def main() -> None:
    p = arg_parser(__doc__ or "")
    args = p.parse_args()
    fmts = ["nvfp4", "mxfp4", "fp8_e4m3"] + ([] if args.quick else ["bf16"])
    chunks = [CHUNK_BYTES] if args.quick else sorted({64 << 10, CHUNK_BYTES, 1 << 20})
    reps = 9 if args.quick else max(args.reps, 15)
    table = BenchTable("gemv_sched", unit="GB/s")
    table.start()
    x = torch.randn(1, 4096)
    bufs = [torch.rand(32 << 20) for _ in range(2)]
    for fmt in fmts:
        bench_format(table, fmt, chunks, x, bufs, reps)
    table.save(args.json)


if __name__ == "__main__":
    main()
