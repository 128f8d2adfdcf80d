"""Elementwise kernels vs ATen: fused axpy (a*x+y) and row sums, working sets larger than L3.

Run: ``torchport bench elementwise`` (or ``python bench/bench_elementwise.py [--quick]``).
"""

from __future__ import annotations

import torch

from torchport import ops
from torchport.autotune import cold_copies
from torchport.benchmarks import BenchTable, arg_parser, compare


def main() -> None:
    args = arg_parser(__doc__ or "").parse_args()
    sizes = [1 << 20] if args.quick else [1 << 16, 1 << 22, 1 << 24]
    table = BenchTable("elementwise", unit="GB/s")
    table.start()
    for dtype in (torch.float32, torch.bfloat16):
        for n in sizes:
            x, y = torch.randn(n).to(dtype), torch.randn(n).to(dtype)
            sets = cold_copies((x, y))
            t = compare(
                {
                    "aten": lambda a, b: torch.add(b, a, alpha=1.5),
                    "ours": lambda a, b: ops.axpy(1.5, a, b),
                },
                sets,
                reps=args.reps,
            )
            moved = 3 * n * x.element_size()
            table.add(f"axpy n={n} {dtype}", "torch.add", t["aten"], t["ours"], moved)
        for rows, cols in (
            [(4096, 4096)] if args.quick else [(64, 1 << 18), (4096, 4096), (1 << 18, 64)]
        ):
            m = torch.randn(rows, cols).to(dtype)
            sets = cold_copies((m,))
            ops.rowsum(m)  # autotune once, outside the timing
            t = compare(
                {"aten": lambda a: a.sum(dim=1), "ours": lambda a: ops.rowsum(a)},
                sets,
                reps=args.reps,
            )
            moved = m.numel() * m.element_size()
            table.add(f"rowsum {rows}x{cols} {dtype}", "Tensor.sum(1)", t["aten"], t["ours"], moved)
    table.save(args.json)


if __name__ == "__main__":
    main()
