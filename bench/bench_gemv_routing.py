"""GEMV routing in ``torchport.compile``: decode-shaped linears go native only where it wins.

A model of 16 small parallel heads (bench_frontend's ``Heads``: 16 x Linear(256, 16) + GELU, then
16 x Linear(16, 16); 8 activation rows, every linear decode-shaped) compiled by ``torch.compile``
(anchor) and by ``torchport.compile`` with small-kernel batching off, so only the per-linear
passes decide. The GEMV pass leaves these tiny dense linears to Inductor/ATen (under
``TUNE_MIN_WEIGHTS`` weights), and GEMM fusion respects that. The ``rewrites`` column counts the
passes' rewrites (0 expected).

Run: ``torchport bench gemv_routing [--quick]``.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

import torchport
from torchport.benchmarks import BenchTable, arg_parser, compare

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_frontend import Heads, _fresh_forward


def main() -> None:
    parser = arg_parser(__doc__ or "")
    args = parser.parse_args()
    table = BenchTable("gemv_routing", unit="GFLOP/s")
    table.start()
    torch.manual_seed(0)
    heads, batch = 16, 8
    base = Heads(heads).eval()
    anchor = torch.compile(_fresh_forward(copy.deepcopy(base), "routing_anchor"))
    ours = torchport.compile(_fresh_forward(copy.deepcopy(base), "routing_ours"), batching=False)
    x = torch.randn(batch, 256)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), anchor(x), rtol=1e-4, atol=1e-5)
        rep = torchport.compiler.last_report()
        assert rep is not None
        t = compare({"anchor": anchor, "ours": ours}, [(x,)], reps=max(args.reps, 30))
    table.add(
        f"{heads} heads, batch {batch}, {torch.get_num_threads()} thr",
        "torch.compile",
        t["anchor"],
        t["ours"],
        2 * batch * heads * (256 * 16 + 16 * 16),
        rewrites=sum(rep.rule_counts.values()),
    )
    table.save(args.json)


if __name__ == "__main__":
    main()
