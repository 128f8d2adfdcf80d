"""Prefill GEMMs with low-precision weights, and the grouped-reduction epilogue.

1. FP8 ``scaled_mm`` (row-wise) and NVFP4/MXFP4 ``block_scaled_mm`` at M ≥ 128 vs the anchor
   "dequantize the weight to bf16, then bf16 ``F.linear``" (what torch offers on CPU); GFLOP/s.
   Each row also times, in the same interleaved run, the pre-engine path (decoded float32 panels
   through ``torch.mm`` (MKL) and the scaling/bias/cast as separate torch ops) as ``mkl_ms``, and
   ``vs_mkl`` = engine time / that time; the GEMM engine's choices are listed after the table.
2. ``linear_quantize`` (GEMM + per-group amax + NVFP4/MX/FP8 quantize in one pass over each output
   panel) vs the bare float32 GEMM ``x @ W.T`` — the target is ≤ 1.10× the GEMM's time.

``--cpu-time`` adds a single-thread table of process CPU time for the epilogue vs the bare GEMM
(insensitive to time lost to other processes on a shared machine).

``--recipes`` times 2.14's recipe-based ``F.scaled_mm`` instead
(:func:`torchport.nn.functional.scaled_mm`): tensor-wise and row-wise FP8 against torch's own CPU
``F.scaled_mm``, and the block-scaled recipes torch's CPU build refuses (NVFP4 two-level with
swizzled scales, MXFP8, 1x128 x 128x128 FP8) against "dequantize both operands to bf16, then bf16
``F.linear``".

Run: ``torchport bench lowp_gemm [--quick] [--cpu-time] [--recipes]``.
"""

from __future__ import annotations

import functools
import resource
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from torchport.benchmarks import BenchTable, arg_parser, compare
from torchport.lowp import (
    Float8Tensor,
    MXTensor,
    NVFP4Tensor,
    block_scaled_mm,
    fp8_quantize,
    linear_quantize,
    scaled_mm,
)


def _mkl_scaled_mm(a, b, sa, sb, od):
    """The pre-engine ``scaled_mm`` for M > 8: float32 MKL GEMM, then torch epilogue ops."""
    return (torch.mm(a.float(), b.float()) * sa * sb.reshape(1, -1)).to(od)


def _mkl_block_scaled_mm(x, w):
    """The pre-engine ``block_scaled_mm``: native panel decode, ``torch.mm`` per panel."""
    from torchport.lowp.scaled_mm import PANEL_BYTES, _dequant_rows

    n, k = w.shape
    x2 = x.reshape(-1, k).float()
    out = torch.empty(x2.shape[0], n)
    step = max(16, PANEL_BYTES // (4 * k))
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        torch.mm(x2, _dequant_rows(w, lo, hi).t(), out=out[:, lo:hi])
    return out.to(x.dtype)


def bench_shape(
    table: BenchTable, m: int, k: int, n: int, reps: int, prefill_only: bool = False
) -> None:
    """Prefill GEMMs and the epilogue for one (M, K, N)."""
    w = torch.randn(n, k) * 0.02
    x = torch.randn(m, k)
    flops = 2.0 * m * n * k
    f8 = Float8Tensor.from_float(w, act_dtype=torch.float8_e4m3fn)
    nv = NVFP4Tensor.from_float(w)
    mx4 = MXTensor.from_float(w)
    xq, xs = fp8_quantize(x)
    ws = f8.scale.reshape(1, -1).float()
    xb = x.bfloat16()

    def deq_bf16(t):  # the anchor: dequantize to bf16, then bf16 GEMM
        return lambda: F.linear(xb, t.dequantize(torch.bfloat16))

    cases = {
        "fp8 scaled_mm rowwise": (
            deq_bf16(f8),
            lambda: _mkl_scaled_mm(xq, f8.qdata.t(), xs, ws, torch.bfloat16),
            lambda: scaled_mm(xq, f8.qdata.t(), xs, ws, out_dtype=torch.bfloat16),
        ),
        "nvfp4 block_scaled_mm": (
            deq_bf16(nv),
            lambda: _mkl_block_scaled_mm(xb, nv),
            lambda: block_scaled_mm(xb, nv),
        ),
        "mxfp4 block_scaled_mm": (
            deq_bf16(mx4),
            lambda: _mkl_block_scaled_mm(xb, mx4),
            lambda: block_scaled_mm(xb, mx4),
        ),
    }
    for name, (anchor, mkl, ours) in cases.items():
        t = compare({"anchor": anchor, "mkl": mkl, "ours": ours}, [()], reps=reps)
        table.add(
            f"M={m} K={k} N={n} {name}",
            "dequant+bf16 mm",
            t["anchor"],
            t["ours"],
            flops,
            mkl_ms=f"{t['mkl'] * 1e3:.1f}",
            vs_mkl=f"{t['ours'] / t['mkl']:.3f}x",
        )
    if prefill_only:
        return
    wt = w.t()
    for fmt in ("nvfp4", "mxfp4", "fp8"):
        fns: dict[str, Callable[..., Any]] = {
            "gemm": lambda: torch.mm(x, wt),
            "fused": functools.partial(linear_quantize, x, w, fmt=fmt),
        }
        t = compare(fns, [()], reps=reps)
        table.add(
            f"M={m} K={k} N={n} epilogue {fmt}",
            "bare fp32 GEMM",
            t["gemm"],
            t["fused"],
            flops,
            overhead=f"{t['fused'] / t['gemm']:.3f}x",
        )


def bench_recipes(table: BenchTable, m: int, k: int, n: int, reps: int) -> None:
    """``F.scaled_mm`` recipes: ours vs torch's CPU kernel, or vs dequantize + bf16 ``F.linear``."""
    from torchport.lowp import mx_quantize, nvfp4_quantize
    from torchport.lowp.nvfp4 import per_tensor_amax_to_scale
    from torchport.lowp.scaled_recipes import _prepare, to_blocked_scales
    from torchport.nn import functional as TPF

    recipe, swz, fp4 = F.ScalingType, F.SwizzleType, torch.float4_e2m1fn_x2
    x, w = torch.randn(m, k), torch.randn(n, k) * 0.02
    flops = 2.0 * m * n * k
    a8, b8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn).t()
    gx, gw = per_tensor_amax_to_scale(x.abs().max()), per_tensor_amax_to_scale(w.abs().max())
    (xq, xs), (wq, ws) = nvfp4_quantize(x, gx), nvfp4_quantize(w, gw)
    (mxq, mxs), (mwq, mws) = mx_quantize(x, "fp8_e4m3"), mx_quantize(w, "fp8_e4m3")
    kb = -(-k // 128)
    cases: dict[str, tuple[tuple[Any, ...], bool]] = {
        "tensorwise": ((a8, b8, torch.tensor(0.5), recipe.TensorWise, torch.tensor(2.0),
                        recipe.TensorWise), True),
        "rowwise": ((a8, b8, torch.rand(m, 1), recipe.RowWise, torch.rand(1, n),
                     recipe.RowWise), True),
        "nvfp4 2-level swizzled": ((
            xq.view(fp4), wq.view(fp4).t(),
            [to_blocked_scales(xs), torch.tensor(gx)], [recipe.BlockWise1x16, recipe.TensorWise],
            [to_blocked_scales(ws), torch.tensor(gw)], [recipe.BlockWise1x16, recipe.TensorWise],
            [swz.SWIZZLE_32_4_4, swz.NO_SWIZZLE], [swz.SWIZZLE_32_4_4, swz.NO_SWIZZLE]), False),
        "mxfp8": ((mxq, mwq.t(), mxs.view(torch.float8_e8m0fnu), recipe.BlockWise1x32,
                   mws.view(torch.float8_e8m0fnu), recipe.BlockWise1x32), False),
        "fp8 1x128 x 128x128": ((a8, b8, torch.rand(m, kb), recipe.BlockWise1x128,
                                 torch.rand(kb, -(-n // 128)), recipe.BlockWise128x128), False),
    }  # fmt: skip
    for name, (args, torch_has_it) in cases.items():
        if torch_has_it:
            anchor_name = "torch F.scaled_mm (CPU)"

            def anchor(args: tuple[Any, ...] = args) -> torch.Tensor:
                return F.scaled_mm(*args)
        else:
            # the anchor decodes with our native dequantizers (torch has none for these
            # recipes on CPU): a faster anchor than a plain-torch decode would be
            anchor_name = "dequant+bf16 linear"

            def anchor(args: tuple[Any, ...] = args) -> torch.Tensor:
                ma, mb, sa, ra, sb, rb, *swz = args
                za, zb = (*swz, None, None)[:2]  # the swizzles default to None
                a, b, _, _ = _prepare(ma, mb, sa, ra, sb, rb, za, zb, None, torch.bfloat16, ())
                return F.linear(
                    a.dequantize(torch.float32).bfloat16(), b.dequantize(torch.float32).bfloat16()
                )

        def ours(args: tuple[Any, ...] = args) -> torch.Tensor:
            return TPF.scaled_mm(*args)

        t = compare({"anchor": anchor, "ours": ours}, [()], reps=reps)
        table.add(
            f"M={m} K={k} N={n} F.scaled_mm {name}", anchor_name, t["anchor"], t["ours"], flops
        )


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def epilogue_cpu_time(m: int, k: int, n: int, reps: int) -> None:
    """One thread, process CPU seconds per call (median): fused GEMM + quantize vs bare GEMM."""
    torch.set_num_threads(1)
    w, x = torch.randn(n, k) * 0.02, torch.randn(m, k)
    wt = w.t()
    fns: dict[str, Callable[[], Any]] = {"gemm": lambda: torch.mm(x, wt)}
    for fmt in ("nvfp4", "mxfp4", "fp8"):
        fns[fmt] = functools.partial(linear_quantize, x, w, fmt=fmt)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            c0 = _cpu_s()
            fn()
            samples[name].append(_cpu_s() - c0)
    med = {name: sorted(v)[len(v) // 2] for name, v in samples.items()}
    print(f"# single-thread CPU time per call, M={m} K={k} N={n} (median of {reps})")
    for name, t in med.items():
        print(f"{name:<8} {t * 1e3:9.2f} ms   over bare GEMM: {t / med['gemm']:.3f}x")


def main() -> None:
    p = arg_parser(__doc__ or "")
    p.add_argument("--cpu-time", action="store_true", help="also: 1-thread CPU time, epilogue")
    p.add_argument("--prefill-only", action="store_true", help="skip the epilogue rows")
    p.add_argument("--recipes", action="store_true", help="only 2.14's F.scaled_mm recipes")
    args = p.parse_args()
    shapes = (
        [(128, 4096, 4096)]
        if args.quick
        else [(128, 4096, 4096), (512, 4096, 4096), (256, 4096, 11008)]
    )
    reps = max(3, args.reps // 4)
    table = BenchTable("lowp_gemm", unit="GFLOP/s")
    table.start()
    if args.recipes:
        for m, k, n in [(1, 4096, 4096), *shapes[:1]]:
            bench_recipes(table, m, k, n, reps)
        table.save(args.json)
        return
    for m, k, n in shapes:
        bench_shape(table, m, k, n, reps, args.prefill_only)
    table.save(args.json)
    from torchport.gemm import decisions

    for (op, label), pick in sorted(decisions.items()):
        print(f"# engine choice {op} {label}: {pick}")
    if args.cpu_time:
        epilogue_cpu_time(*shapes[-1 if not args.quick else 0], reps=max(reps, 5))


if __name__ == "__main__":
    main()
