"""Fused-epilogue cost at the kernel level: one native GEMM config with and without an epilogue.

Where ``bench gemm --epilogue`` times the whole ``linear`` call (autotuner, adaptive runner,
Python), this times ``torchport.gemm.kernels.launcher`` of one fixed config, round robin over
``bare``, ``bare2`` (a second launcher of the same bare kernel: the control, which should read
1.00), ``gelu`` (bias + GELU + residual), ``silu`` (bias + SiLU), ``bias`` (bias alone) and ``res`` (the
residual alone: its cold read without an activation), every call on the least
recently used of enough weight copies that the weights stream from DRAM. A one-thread config
(``nt=1``, the default) is timed in thread CPU time, which a busy machine disturbs far less than
wall time; a multi-thread one in wall time. Prints each launcher's median and minimum over the
bare median and minimum.

Run: ``torchport bench gemm_epilogue_ab --m 32 --d 1024 --h 4096 --dtype bfloat16
--cfg 4:24:32:32:0:1:1`` (``cfg`` is ``mr:nr:mc:pf:kc:ks:nt[:dp]`` of ``kernels.Config``; a
``vdpbf16ps`` config, ``dp`` 1, gets pair-packed weights).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import astuple

import torch

from torchport import native
from torchport.benchmarks import MAX_GEMM_DIM, arg_parser, gemm_config, gemm_dim
from torchport.gemm import epilogue as G
from torchport.gemm import kernels
from torchport.gemm.kernels import Config
from torchport.gemm.pack import pack_b, pack_b_pairs

ROTATE_BYTES = 64 << 20  # weight copies: twice this machine's L3


def copy_count(nbytes: int, launchers: int) -> int:
    """How many weight (and residual) copies of ``nbytes`` to rotate over: enough to fill
    :data:`ROTATE_BYTES`, and sharing no factor with the number of launchers, so that the running
    call count (``call % copies``) takes every call from the least recently used copy (the same
    reuse distance for every launcher) and still moves each launcher over every copy. Eight bf16
    copies for six launchers pinned bare, gelu and bias to the even copies (a copy whose pages run
    slower biased their ratios); rotating by round instead gave launchers different reuse
    distances (fp32's bare reread the copy the previous call had just streamed: warm)."""
    copies = max(1, -(-ROTATE_BYTES // nbytes))  # (rounded up: 40 MiB copies fill it twice)
    while math.gcd(copies, launchers) != 1:
        copies += 1
    return copies


def main() -> None:
    p = arg_parser(__doc__ or "", writes_json=False)  # --reps (rounds), --quick (2 rounds)
    dim = f"1 to {MAX_GEMM_DIM}"
    p.add_argument("--m", type=gemm_dim, default=32, help=f"M ({dim})")
    p.add_argument("--d", type=gemm_dim, default=1024, help=f"K ({dim})")
    p.add_argument("--h", type=gemm_dim, default=4096, help=f"N ({dim})")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument(
        "--cfg",
        type=gemm_config,
        default="4:24:32:32:0:1:1",
        help="mr:nr:mc[:pf:kc:ks:nt:dp] of kernels.Config, a tile this CPU builds",
    )
    args = p.parse_args()
    if args.quick:
        args.reps = 2
    m, d, h = args.m, args.d, args.h
    dt = getattr(torch, args.dtype)
    cfg: Config = args.cfg
    clock: Callable[[], float] = time.thread_time if cfg.nt == 1 else time.perf_counter
    isa = native.cpu_info().isa
    torch.manual_seed(0)
    x = torch.randn(m, d).to(dt)
    copies = copy_count(d * h * dt.itemsize, 6)  # (six launchers, below)
    weights = [(torch.randn(h, d) * d**-0.5).to(dt) for _ in range(copies)]
    packs = [(pack_b_pairs if cfg.dp else pack_b)(w.t(), cfg.nr) for w in weights]
    bias = torch.randn(h).to(dt)
    # one residual per weight copy, rotated with it: the residual is read cold, as in a model
    # (and in ``bench gemm --epilogue``), not from the cache the previous call left it in
    ress = [torch.randn(m, h).to(dt) for _ in range(copies)]
    res = ress[0]
    splits = {
        "bare": G.split(None, m, h),
        "bare2": G.split(None, m, h),
        "gelu": G.split(["gelu", G.Add(res)], m, h, bias=bias),
        "silu": G.split(["silu"], m, h, bias=bias),
        "bias": G.split(None, m, h, bias=bias),
        "res": G.split([G.Add(res)], m, h),
    }
    launches = {k: kernels.launcher(s.spec, cfg, dt, dt, isa) for k, s in splits.items()}
    b = weights[0].t()
    for k, s in splits.items():  # build, and check against the float64 reference
        out = launches[k](x, b, s.operands, packed=packs[0])
        ref = kernels.mm_reference(x, b, s.spec, s.operands)
        tol = 3e-2 if dt == torch.bfloat16 else 1e-4
        torch.testing.assert_close(out.double(), ref.double(), rtol=tol, atol=tol)
    samples: dict[str, list[float]] = {k: [] for k in launches}
    call = 0
    for _ in range(args.reps):
        for k, launch in launches.items():
            c, call = call % copies, call + 1
            packed = packs[c]
            ops = [ress[c] if t is res else t for t in splits[k].operands]
            t0 = clock()
            launch(x, b, ops, packed=packed)
            samples[k].append(clock() - t0)
    med = {k: statistics.median(v) for k, v in samples.items()}
    low = {k: min(v) for k, v in samples.items()}
    what = "thread CPU" if cfg.nt == 1 else "wall"
    print(
        f"M={m} {d}->{h} {args.dtype} cfg={':'.join(map(str, astuple(cfg)))} ({what} time, "
        f"{args.reps} rounds): bare "
        f"median {med['bare'] * 1e3:.3f} ms; median/min over bare: "
        + "  ".join(
            f"{k} {med[k] / med['bare']:.3f}/{low[k] / low['bare']:.3f}"
            for k in launches
            if k != "bare"
        )
    )


if __name__ == "__main__":
    main()
