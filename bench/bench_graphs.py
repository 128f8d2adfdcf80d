"""Graph capture, switch and while_loop: per-call overhead and dispatch cost; MemPool reserve.

Run: ``torchport bench graphs`` (or ``python bench/bench_graphs.py [--quick]``). Cases (each
anchor and ours timed interleaved in one run, medians):

1. 200 small ATen ops (25 blocks of linear+6 pointwise ops on [8, 64]): eager vs ``torch.compile``
   (Inductor) vs ``Graph.replay``;
2. an 8-way ``switch`` compiled vs a nested ``torch.cond`` chain compiled, and the captured switch;
3. a ``while_loop`` of 1000 small iterations: eager Python loop vs captured loop replayed;
4. MemPool ``reserved / peak allocated`` on a re-captured decode-like trace with varying sequence
   lengths vs an exact-size cache (graph-private buffers reused only for equal sizes).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import torchport
from torchport.benchmarks import BenchTable, arg_parser, compare
from torchport.graphs import Graph, MemPool

D, B, BLOCKS = 64, 8, 25


def tiny_mlp(x: torch.Tensor, ws: list[torch.Tensor], bs: list[torch.Tensor]) -> torch.Tensor:
    """25 blocks x 8 ATen ops (t, addmm, relu, mul, add, tanh, sigmoid, mul) = 200 ops."""
    for w, b in zip(ws, bs):
        h = F.linear(x, w, b).relu() * 0.5
        x = (x + h).tanh() * torch.sigmoid(h)
    return x


def bench_overhead(table: BenchTable, reps: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(B, D)
    ws = [torch.randn(D, D) / 8 for _ in range(BLOCKS)]
    bs = [torch.randn(D) / 8 for _ in range(BLOCKS)]
    with torch.no_grad():
        t0 = time.perf_counter()
        g = Graph()
        with g:
            y = tiny_mlp(x, ws, bs)
        capture_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        compiled = torch.compile(tiny_mlp)
        compiled(x, ws, bs)
        compile_s = time.perf_counter() - t0
        g.replay()
        torch.testing.assert_close(y, tiny_mlp(x, ws, bs))
        t = compare(
            {
                "eager": lambda: tiny_mlp(x, ws, bs),
                "compile": lambda: compiled(x, ws, bs),
                "graph": g.replay,
            },
            [()],
            reps=reps,
        )
    flops = BLOCKS * 2 * B * D * D
    extra = {"ops": g.num_ops, "capture_s": round(capture_s, 2), "compile_s": round(compile_s, 1)}
    table.add("200 ops [8,64]: eager vs Graph", "eager", t["eager"], t["graph"], flops, **extra)
    table.add("200 ops [8,64]: compile vs Graph", "torch.compile", t["compile"], t["graph"], flops)


def _branch(k: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda t: (t * (k + 1)).sin() + k


BRANCHES = [_branch(k) for k in range(8)]


def nested_cond(i: torch.Tensor, x: torch.Tensor, k: int = 0) -> torch.Tensor:
    if k == len(BRANCHES) - 1:
        return BRANCHES[k](x)
    return torch.cond(i == k, BRANCHES[k], lambda t: nested_cond(i, t, k + 1), (x,))


def bench_switch(table: BenchTable, reps: int) -> None:
    x = torch.randn(B, D)
    idx = [torch.tensor(k) for k in range(8)]
    sw = torch.compile(lambda i, t: torchport.switch(i, BRANCHES, (t,)), fullgraph=True)
    nc = torch.compile(nested_cond, fullgraph=True)
    sel = torch.tensor(0)
    g = Graph()
    with torch.no_grad(), g:
        y = torchport.switch(sel, BRANCHES, (x,))

    def replay(i: torch.Tensor) -> None:
        sel.copy_(i)
        g.replay()

    with torch.no_grad():
        for i in idx:  # compile / warm every path
            torch.testing.assert_close(sw(i, x), nc(i, x))
            replay(i)
            torch.testing.assert_close(y, BRANCHES[int(i)](x))
        sets = [(i,) for i in idx]
        t = compare(
            {
                "cond": lambda i: nc(i, x),
                "switch": lambda i: sw(i, x),
                "graph": replay,
            },
            sets,
            reps=reps * 4,
        )
    work = B * D * 3
    table.add("switch 8-way compiled", "nested cond", t["cond"], t["switch"], work)
    table.add("switch 8-way in Graph", "nested cond", t["cond"], t["graph"], work, tier=g.tier)


def bench_while(table: BenchTable, reps: int, iters: int) -> None:
    def cond(i: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return i < iters

    def body(i: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return i + 1, x * 0.999 + 0.001

    x = torch.randn(B, D)
    g = Graph()
    with torch.no_grad(), g:
        out = torchport.while_loop(cond, body, (torch.tensor(0), x))

    def eager() -> tuple[torch.Tensor, torch.Tensor]:
        i, v = torch.tensor(0), x
        while bool(cond(i, v)):
            i, v = body(i, v)
        return i, v

    with torch.no_grad():
        g.replay()
        torch.testing.assert_close(out[1], eager()[1])
        t = compare({"eager": eager, "graph": g.replay}, [()], reps=max(3, reps // 4))
    per_iter = {k: round(v / iters * 1e6, 3) for k, v in t.items()}
    table.add(
        f"while_loop {iters} iters",
        "eager Python loop",
        t["eager"],
        t["graph"],
        0.0,
        tier=g.tier,
        eager_us_per_iter=per_iter["eager"],
        graph_us_per_iter=per_iter["graph"],
    )


class ExactSizeCache:
    """Baseline: buffers cached and reused only for an identical byte size, never released."""

    def __init__(self) -> None:
        self.free: dict[int, int] = {}
        self.reserved = self.allocated = self.peak = 0

    def alloc(self, n: int) -> int:
        if self.free.get(n, 0):
            self.free[n] -= 1
        else:
            self.reserved += n
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        return n

    def release(self, n: int) -> None:
        self.free[n] = self.free.get(n, 0) + 1
        self.allocated -= n


def decode_trace(steps: int) -> list[int]:
    g = torch.Generator().manual_seed(0)
    return [int(v) for v in torch.randint(16, 513, (steps,), generator=g)]


def bench_pool(table: BenchTable, steps: int) -> None:
    """Re-capture a decode-like step per sequence length; static buffers come from the pool."""
    layers, heads, hd = 6, 4, 64
    pool = MemPool()
    base = ExactSizeCache()
    held: list[torch.Tensor] = []
    g = Graph(pool=pool)
    q = torch.randn(1, heads, 1, hd)
    for seq in decode_trace(steps):
        g.reset()
        held.clear()
        gc.collect()
        kv = [pool.empty((2, 1, heads, seq, hd)) for _ in range(layers)]  # per-step KV view
        for t in kv:
            t.normal_()
        sizes = [t.numel() * 4 for t in kv]
        with torch.no_grad(), g:
            outs = [F.scaled_dot_product_attention(q, t[0], t[1]) for t in kv]
            scores = [q @ t[0].transpose(-1, -2) for t in kv]
        held[:] = kv + outs + scores
        sizes += [o.numel() * o.element_size() for o in outs + scores]
        for n in sizes:
            base.alloc(n)
        for n in sizes:
            base.release(n)
        g.replay()
        del kv, outs, scores, t  # only `held` keeps this step's buffers
    held.clear()
    g.reset()
    gc.collect()
    s = pool.stats()
    mib = 2**20
    # (not a row: the table's columns are times, and the ratios were printed as milliseconds)
    table.note(
        "pool",  # reserved / peak allocated over the re-captures: lower is better
        re_captures=steps,
        ours_reserved_mib=round(s.peak_reserved / mib, 2),
        ours_peak_mib=round(s.peak_allocated / mib, 2),
        ours_reserved_per_peak=round(s.peak_reserved / max(1, s.peak_allocated), 3),
        anchor="exact-size-cache",
        anchor_reserved_mib=round(base.reserved / mib, 2),
        anchor_peak_mib=round(base.peak / mib, 2),
        anchor_reserved_per_peak=round(base.reserved / max(1, base.peak), 3),
    )


def main() -> None:
    args = arg_parser(__doc__ or "").parse_args()
    torch.set_num_threads(1)
    table = BenchTable("graphs", unit="GFLOP/s")
    table.start()
    bench_overhead(table, args.reps * 10)
    bench_switch(table, args.reps * 10)
    bench_while(table, args.reps, 200 if args.quick else 1000)
    bench_pool(table, 20 if args.quick else 60)
    table.save(args.json)


if __name__ == "__main__":
    main()
