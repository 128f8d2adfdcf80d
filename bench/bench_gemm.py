"""GEMM engine vs ATen and Inductor: single linear layers and the transformer MLP block.

Cells: ``y = x @ W.T + b`` (d → h) and ``x + W2·gelu(W1·x + b1) + b2``, fp32 and bf16, over the
issue's M × (d, h) grid. Anchors timed in the same run, interleaved: eager ATen,
``torch.compile`` (default) and ``torch.compile(mode="max-autotune")`` with
``torch._inductor.config.freezing = True`` (weights frozen into the graph, compiled once per
cell). Ours is ``torchport.nn.functional.linear`` with fused epilogues, autotuned before timing
(tuning time reported). The frozen graph reads one copy of its weights, so its row compares it
with ours on one copy of the same values (inputs rotated alike for both); ``vs_rotated_ours`` is
its ratio against ours over the rotated weights, the comparison of the earlier sessions. For M ≤ 32 the weight-stream bandwidth of ours is reported as a fraction
of the measured read bandwidth: ``bw_pct`` against ``torch.sum`` over the cell's own weights,
timed interleaved with the GEMMs on copies of the same size (its own: ours reads its packed
copies, and `sum`, eager and `torch.compile` each rotate over copies no other function reads), and
``bw512_pct`` against ``torch.sum`` over a 512 MiB tensor timed once at the start of the run.
Weights smaller than :data:`ROTATE_BYTES` (4× L3) are rotated over enough copies that every call
streams its weights from DRAM (a 1024×4096 fp32 weight is 16 MB, half of L3).

Run: ``torchport bench gemm [--quick] [--max-autotune-cells N] [--cells linear,mlp]``;
``--epilogue`` runs only the fused/bare ratios (bias+GELU+residual and bias+SiLU against the bare
GEMM, interleaved medians, more rounds for short calls) over M = 1, 8, 32, both dtypes,
1024→4096 and 4096→11008.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchport.gemm as G
from torchport.autotune import L3_BYTES, cold_copies
from torchport.benchmarks import (
    MAX_GEMM_DIM,
    BenchTable,
    arg_parser,
    comma_list,
    compare,
    dtype_of,
    gemm_dim,
    one_of,
)
from torchport.cli import int_at_least
from torchport.nn.functional import linear

# Copies of a cell's arguments rotated per call: more than 4x L3 in all, so between two calls on
# one copy at least 3 L3-fulls of other data stream through (with 64 MiB, 4 copies of a 16 MB
# weight, part of a copy could survive in the 32 MiB L3 between its calls)
ROTATE_BYTES = 4 * L3_BYTES
# the functions of a cell that read the weights as given (ours reads its packed copies)
SELF_READERS = ("eager", "sum", "compile")


def read_bandwidth() -> float:
    """GB/s of ``torch.sum`` over 512 MiB of float32 (median of 5)."""
    x = torch.ones(128 << 20)
    x.sum()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        x.sum()
        ts.append(time.perf_counter() - t0)
    return x.numel() * 4 / sorted(ts)[2] / 1e9


class Linear(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


class Block(nn.Module):
    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, h), nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


def ours_fn(kind: str) -> Callable[..., torch.Tensor]:
    if kind == "linear":
        return lambda x, w, b: linear(x, w, b)
    return lambda x, w1, b1, w2, b2: linear(
        linear(x, w1, b1, epilogue=["gelu"]), w2, b2, epilogue=[G.Add(x)]
    )


def eager_fn(kind: str) -> Callable[..., torch.Tensor]:
    if kind == "linear":
        return lambda x, w, b: F.linear(x, w, b)
    return lambda x, w1, b1, w2, b2: x + F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def weight_sum(*args: torch.Tensor) -> torch.Tensor:
    """``torch.sum`` of every weight matrix among ``args`` (the read-bandwidth reference)."""
    total = args[1].sum()
    for t in args[2:]:
        if t.dim() == 2:
            total = total + t.sum()
    return total


def max_autotune(model: nn.Module, x: torch.Tensor) -> Callable[..., torch.Tensor]:
    """``torch.compile(mode="max-autotune")`` with freezing (weights as graph constants)."""
    import torch._inductor.config as ic

    with ic.patch(freezing=True), torch.no_grad():
        c = torch.compile(model, mode="max-autotune")
        c(x)  # compile and tune once, outside the timing

    def run(*args: Any) -> torch.Tensor:
        with torch.no_grad():
            return c(args[0])

    return run


def cell(
    table: BenchTable,
    kind: str,
    m: int,
    d: int,
    h: int,
    dtype: torch.dtype,
    reps: int,
    with_max_autotune: bool,
    bw: float,
    epilogue_cost: bool = True,
) -> None:
    torch.manual_seed(0)
    model = (Linear(d, h) if kind == "linear" else Block(d, h)).to(dtype).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    x = torch.randn(m, d).to(dtype)
    params = tuple(p.detach() for p in model.parameters())
    args = (x, *params)
    weight_bytes = sum(p.numel() * p.element_size() for p in params if p.dim() == 2)
    sets = cold_copies(args, budget=ROTATE_BYTES) if weight_bytes < ROTATE_BYTES else [args]
    ours = ours_fn(kind)
    t0 = time.perf_counter()
    with torch.no_grad():
        ours(*args)
        tune_s = time.perf_counter() - t0
        # pack every copy's weights (settle: twice each) and let small-M runners learn their launches
        # (ThreadAdaptive's round robin), outside the timing
        settle(ours, sets)
        fns: dict[str, Callable[..., Any]] = {"eager": eager_fn(kind), "ours": ours}
        if m <= 32:  # the read-bandwidth reference: the same weight bytes, summed
            fns["sum"] = weight_sum
        fns["compile"] = torch.compile(eager_fn(kind), dynamic=False)
        fns["compile"](*args)
        if with_max_autotune:
            fns["max_autotune"] = max_autotune(model, x)
            # the frozen graph reads one copy of its weights (constants, they cannot rotate):
            # against it, ours on one copy of those values with the inputs rotated alike (before
            # the thirtieth session ours rotated over ROTATE_BYTES of weights in this row too).
            # A clone: set 0's own weights would keep set 0's packing warm for the rotated calls
            one = tuple(p.clone() for p in params)
            fns["ours_one_weight"] = lambda x_, *_: ours(x_, *one)
        # the anchors and `sum` read the weights themselves, ours its packed copies: each rotates
        # over copies of its own (see compare's own_sets)
        # (copies of a clone: cold_copies' first set is its argument itself, which the shared
        # sets start with too)
        own = {}
        if len(sets) > 1:
            own = {
                k: cold_copies(tuple(t.clone() for t in args), budget=ROTATE_BYTES)
                for k in fns
                if k in SELF_READERS
            }
        t = compare(fns, sets, reps=reps, own_sets=own)
    flops = 2.0 * m * d * h * (1 if kind == "linear" else 2)
    dt = str(dtype).removeprefix("torch.")
    name = f"{kind} M={m} d={d} h={h} {dt}"
    won = sorted(
        {
            v
            for (_, k), v in G.decisions.items()
            if k.startswith(f"M={m} ") and dt in k and (f"K={d} " in k or f"K={h} " in k)
        }
    )
    extra: dict[str, Any] = {"tune_s": round(tune_s, 2), "kernel": ",".join(won)}
    if m <= 32:
        extra["weight_GBps"] = round(weight_bytes / t["ours"] / 1e9, 1)
        extra["sum_GBps"] = round(weight_bytes / t["sum"] / 1e9, 1)
        extra["bw_pct"] = round(100 * t["sum"] / t["ours"], 1)
        extra["bw512_pct"] = round(100 * weight_bytes / t["ours"] / 1e9 / bw, 1)
    for anchor in ("eager", "compile", "max_autotune"):
        if anchor == "max_autotune" and anchor in t:
            rotated = {"vs_rotated_ours": round(t[anchor] / t["ours"], 2)}
            table.add(name, anchor, t[anchor], t["ours_one_weight"], flops, **rotated)
        elif anchor in t:
            table.add(
                name, anchor, t[anchor], t["ours"], flops, **(extra if anchor == "eager" else {})
            )
    if kind == "linear" and epilogue_cost:
        epilogue_overhead(table, name, sets, reps, flops)


SETTLE_CALLS = 12  # > the adaptive runner's learning round (3 launches x 3 calls)


def settle_calls(sets: list[tuple[Any, ...]]) -> int:
    """How many calls :func:`settle` makes over ``sets``."""
    return max(2 * len(sets), SETTLE_CALLS)


def settle(fn: Callable[..., Any], sets: list[tuple[Any, ...]]) -> None:
    """Untimed calls of ``fn``: every argument set twice, at least :data:`SETTLE_CALLS`. Twice:
    the pack cache keeps a plain tensor's packing from its second sighting (a Parameter's from
    its first), and the rotated copies are plain clones, so after one pass every timed call of
    the first pass repacked its copy (2-12 ms for a 1024x4096 bf16 weight into fresh huge pages
    on the twenty-eighth session's VM, against 0.3-0.5 ms for the GEMM)."""
    for i in range(settle_calls(sets)):
        fn(*sets[i % len(sets)])


def epilogue_overhead(
    table: BenchTable,
    name: str,
    sets: list[tuple[Any, ...]],
    reps: int,
    flops: float,
    budget_s: float = 0.0,
) -> dict[str, float]:
    """Fused bias+GELU+residual and bias+SiLU vs the bare GEMM, all ours, interleaved in one
    run (issue target: fused <= 1.05x the bare time). Prints and returns the ratios.

    ``budget_s`` > 0: short calls get more rounds than ``reps`` (as many as fit ``budget_s``,
    at most :data:`MAX_EPILOGUE_REPS`): a median of 20 calls of 0.3-2 ms moved by 5-10 % between
    runs, the size of the effect measured. (No bare/bare control: a second bare function
    shares the bare call's adaptive runner, so the runner's sampled and probe calls can all fall
    on one of the two; such a control read 0.89-1.01x in four runs, mostly below 1.)"""
    res = [torch.randn(s[0].shape[0], s[1].shape[0]).to(s[0].dtype) for s in sets]
    with_res = [(*s, r) for s, r in zip(sets, res)]

    def bare(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return linear(x, w)

    def fused(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return linear(x, w, b, epilogue=["gelu", G.Add(r)])

    def silu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
        return linear(x, w, b, epilogue=["silu"])

    fns: dict[str, Callable[..., Any]] = {"bare": bare, "fused": fused, "silu": silu}
    with torch.no_grad():
        for fn in fns.values():
            settle(fn, with_res)
        if budget_s > 0:
            t0 = time.perf_counter()
            settle(bare, with_res)
            per_call = (time.perf_counter() - t0) / settle_calls(with_res)
            reps = max(reps, min(MAX_EPILOGUE_REPS, int(budget_s / (len(fns) * per_call))))
        t = compare(fns, with_res, reps=reps)
    table.add(name + " +bias,gelu,res", "ours, no epilogue", t["bare"], t["fused"], flops)
    table.add(name + " +bias,silu", "ours, no epilogue", t["bare"], t["silu"], flops)
    ratios = {"gelu_res": t["fused"] / t["bare"], "silu": t["silu"] / t["bare"]}
    print(
        f"# fused/bare {name}: bias+gelu+residual {ratios['gelu_res']:.3f}x, "
        f"bias+silu {ratios['silu']:.3f}x (bare {t['bare'] * 1e3:.3f} ms, {reps} rounds; "
        "target <= 1.05x)",
        flush=True,
    )
    return ratios


# rounds of the epilogue grid's cells at most (see epilogue_overhead), and the time each may take
MAX_EPILOGUE_REPS = 200
EPILOGUE_BUDGET_S = 1.5


def epilogue_grid(table: BenchTable, dtypes: list[torch.dtype], reps: int, quick: bool) -> None:
    """Only the fused/bare ratios, over M in (1, 8, 32), fp32/bf16, 1024->4096 and 4096->11008
    (``--epilogue``); ends with the worst ratio."""
    worst = 0.0
    shapes = ((1024, 4096),) if quick else ((1024, 4096), (4096, 11008))
    for dtype in dtypes:
        for d, h in shapes:
            for m in (1, 8, 32):
                torch.manual_seed(0)
                x = torch.randn(m, d).to(dtype)
                w, b = (torch.randn(h, d) * d**-0.5).to(dtype), torch.randn(h).to(dtype)
                big = w.numel() * w.element_size() >= ROTATE_BYTES
                sets = [] if big else cold_copies((x, w, b), budget=ROTATE_BYTES)
                sets = sets or [(x, w, b)]
                dt = str(dtype).removeprefix("torch.")
                name = f"linear M={m} d={d} h={h} {dt}"
                r = epilogue_overhead(
                    table, name, sets, reps, 2.0 * m * d * h, budget_s=EPILOGUE_BUDGET_S
                )
                worst = max(worst, *r.values())
    print(f"# worst fused/bare over the grid: {worst:.3f}x (target <= 1.05x)")


def grid_cell(text: str) -> tuple[str, int, int, int]:
    """One ``--grid`` entry, ``KIND:M:D:H`` (KIND linear or mlp; 1 <= M, D, H <= MAX_GEMM_DIM:
    unbounded, a typo allocated until the memory ran out)."""
    parts = text.split(":")
    if len(parts) != 4:
        raise ValueError(f"expected KIND:M:D:H (e.g. linear:8:4096:11008), got {text!r}")
    try:
        kind = one_of("linear", "mlp")(parts[0])
        m, d, h = (gemm_dim(x) for x in parts[1:])
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} in {text!r}") from None
    return kind, m, d, h


def main() -> None:
    p = arg_parser(__doc__ or "")
    p.add_argument(
        "--max-autotune-cells",
        type=int_at_least(0),
        default=None,
        help="cap on max-autotune anchors (0: none)",
    )
    p.add_argument(
        "--cells",
        type=comma_list(one_of("linear", "mlp")),
        default="linear,mlp",
        help="comma-separated: linear, mlp",
    )
    p.add_argument(
        "--dtypes",
        type=comma_list(dtype_of("float32", "bfloat16")),
        default="float32,bfloat16",
        help="comma-separated: float32, bfloat16",
    )
    p.add_argument(
        "--epilogue",
        action="store_true",
        help="only the fused/bare epilogue ratios (M = 1, 8, 32; both dtypes; two shapes)",
    )
    p.add_argument(
        "--grid",
        type=comma_list(grid_cell),
        default=None,
        help="explicit cells KIND:M:D:H, e.g. linear:8:4096:11008,mlp:1:768:3072 "
        f"(1 <= M, D, H <= {MAX_GEMM_DIM})",
    )
    args = p.parse_args()
    if args.epilogue:
        table = BenchTable("gemm", unit="GFLOP/s")
        table.start()
        dts = args.dtypes
        epilogue_grid(table, dts[:1] if args.quick else dts, min(args.reps, 20), args.quick)
        table.save(args.json)
        return
    kinds, dtypes = args.cells, args.dtypes  # (an unknown cell kind gave an empty table)
    if args.quick:
        grid = [("linear", m, 1024, 4096) for m in (1, 8)] + [("mlp", 8, 768, 3072)]
        cap = 1 if args.max_autotune_cells is None else args.max_autotune_cells
        dtypes, reps = dtypes[:1], min(args.reps, 8)
    else:
        grid = [("linear", m, 4096, 11008) for m in (1, 8, 32, 128, 512)]
        grid += [("linear", m, 1024, 4096) for m in (1, 8, 32, 512, 2048)]
        grid += [("linear", m, 768, 3072) for m in (8, 2048)]
        grid += [("mlp", m, 768, 3072) for m in (1, 8, 32, 512)]
        cap = 6 if args.max_autotune_cells is None else args.max_autotune_cells
        reps = args.reps
        print(
            "# skipped by default (minutes per call or per max-autotune compile on 2 cores): "
            "M=2048 at (4096, 11008); MLP at (1024, 4096) and (4096, 11008); max-autotune beyond "
            f"the first {cap} cells per dtype"
        )
    if args.grid:
        grid = args.grid
    bw = read_bandwidth()
    table = BenchTable("gemm", unit="GFLOP/s")
    table.start()
    print(f"# torch.sum read bandwidth (512 MiB fp32): {bw:.1f} GB/s")
    for dtype in dtypes:
        done = 0
        for kind, m, d, h in grid:
            if kind not in kinds:
                continue
            want_ma = done < cap and (m <= 32 or m >= 512)
            cell(table, kind, m, d, h, dtype, reps, want_ma, bw)
            done += int(want_ma)
    table.save(args.json)


if __name__ == "__main__":
    main()
