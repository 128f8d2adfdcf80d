"""Batched linear algebra vs torch.linalg (MKL LAPACK): svd, eigh, qr, cholesky over B × n.

Each cell times ``torch.linalg.<op>`` (anchor) and ``torchport.linalg.<op>(method="jacobi")`` (the
native kernel, "ours") interleaved, medians; the ``auto`` column times ``method="auto"`` against
``torch.linalg`` interleaved in a round of their own. Rates are
nominal LAPACK flop counts per matrix (svd 12n³, eigh 9n³, qr 4n³/3 + Q formation 4n³/3,
cholesky n³/3; four times those for complex dtypes) so the GFLOP/s columns are comparable across
methods, not hardware peaks. ``--dtypes complex64,complex128`` times the complex kernels (inputs
complex Gaussian, Hermitian for eigh, Hermitian positive definite for cholesky).

Grid: B ∈ {1, 100, 10000, 100000} × n ∈ {2, 3, 4, 8, 16, 32, 64, 128, 512}, float32 and float64.
Cells are skipped when the input exceeds 1 GB or B·n³ > 4·10⁸ (a single torch.linalg call would
take many seconds; the default run stays near 10 minutes; ``--max-work`` moves that cap). ``--quick`` runs B ∈ {100, 10000} × n ∈ {3, 8, 32} with B·n³ ≤ 4·10⁷;
``--orderings`` instead compares the cyclic and round-robin Jacobi orderings of the kernels.

Run: ``torchport bench linalg [--quick] [--orderings]``; select cells with ``--ops``, ``--sizes``,
``--batches``, ``--dtypes`` (comma-separated), e.g. ``--ops cholesky --sizes 8,16 --batches 10000``;
``--fastest [--threads T] [--method auto] --reps N`` times those cells as alternated minima
(robust to load).
``--sweeps`` measures the lane eigh kernel's time per sweep (see ``sweeps``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import torchport.linalg as tl
from torchport import config
from torchport.benchmarks import (
    BenchTable,
    arg_parser,
    comma_list,
    compare,
    dtype_of,
    one_of,
    positive_int,
)
from torchport.cli import positive_float
from torchport.linalg import kernels

BATCHES = (1, 100, 10_000, 100_000)
SIZES = (2, 3, 4, 8, 16, 32, 64, 128, 512)
FLOPS = {
    "svd": lambda n: 12 * n**3,
    "eigh": lambda n: 9 * n**3,
    "qr": lambda n: 8 * n**3 / 3,
    "cholesky": lambda n: n**3 / 3,
}
OPS = tuple(FLOPS)
MAX_BYTES = 1 << 30
MAX_WORK = 4e8


def _input(op: str, b: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Random input (complex dtypes: complex Gaussian; eigh Hermitian, cholesky Hermitian
    positive-definite)."""
    g = torch.Generator().manual_seed(b * 1000 + n)
    x = torch.randn((b, n, n), generator=g, dtype=dtype)
    if op == "eigh":
        return (x + x.mH).contiguous()
    if op == "cholesky":
        return (x @ x.mH + n * torch.eye(n, dtype=dtype)).contiguous()
    return x


def _flops(op: str, n: int, dtype: torch.dtype) -> float:
    """Nominal real flops of one matrix: a complex multiply-add is 4 real ones."""
    return FLOPS[op](n) * (4 if dtype.is_complex else 1)


def _fns(op: str) -> dict[str, Callable[[torch.Tensor], Any]]:
    """torch.linalg, ours (``method="jacobi"``) and auto for ``op``."""
    if op == "svd":
        return {
            "lapack": lambda a: torch.linalg.svd(a, full_matrices=False),
            "jacobi": lambda a: tl.svd(a, full_matrices=False, method="jacobi"),
            "auto": lambda a: tl.svd(a, full_matrices=False),
        }
    if op == "eigh":
        return {
            "lapack": torch.linalg.eigh,
            "jacobi": lambda a: tl.eigh(a, method="jacobi"),
            "auto": tl.eigh,
        }
    if op == "qr":
        return {
            "lapack": torch.linalg.qr,
            "jacobi": lambda a: tl.qr(a, method="jacobi"),
            "auto": tl.qr,
        }
    return {
        "lapack": torch.linalg.cholesky,
        "jacobi": lambda a: tl.cholesky(a, method="jacobi"),
        "auto": tl.cholesky,
    }


def _skip(b: int, n: int, dtype: torch.dtype, max_work: float) -> str | None:
    size = b * n * n * dtype.itemsize
    if size > MAX_BYTES:
        return f"input {size / 2**30:.1f} GB > 1 GB"
    if b * n**3 > max_work:
        return f"B·n³ = {b * n**3:.1e} > {max_work:.0e}"
    return None


def _ints(values: list[int] | None) -> tuple[int, ...] | None:
    return tuple(values) if values else None


def grid(args: Any) -> None:
    ops = tuple(args.ops) if args.ops else OPS
    batches: tuple[int, ...] = BATCHES if not args.quick else (100, 10_000)
    sizes: tuple[int, ...] = SIZES if not args.quick else (3, 8, 32)
    batches, sizes = _ints(args.batches) or batches, _ints(args.sizes) or sizes
    dtypes = args.dtypes
    max_work = args.max_work if args.max_work is not None else (MAX_WORK if not args.quick else 4e7)
    table = BenchTable("linalg", unit="GFLOP/s")
    table.start()
    skipped: list[str] = []
    for dtype in dtypes:
        for op in ops:
            for n in sizes:
                for b in batches:
                    why = _skip(b, n, dtype, max_work)
                    if why:
                        skipped.append(f"{op} B={b} n={n} {dtype}: {why}")
                        continue
                    a = _input(op, b, n, dtype)
                    fns = _fns(op)
                    fns["auto"](a)  # tune outside the timing (cached per batch bucket)
                    reps = 5 if args.quick else max(3, min(args.reps, 9))
                    # auto vs torch.linalg in a round of their own: a call timed right after
                    # the native kernel runs up to ~40% slower at these ~20 µs sizes whatever
                    # it is (torch.linalg included), which would bias the auto ratio
                    # (alternated calls, the order flipped every round, medians; at least 41
                    # rounds within the time cap: the auto/LAPACK difference of a routed call
                    # is ~1 us on ~10-40 us calls)
                    pair = {"lapack": fns["lapack"], "auto": fns["auto"]}
                    t_auto = compare(pair, [(a,)], reps=max(reps, 41), warmup=1, max_time_s=3.0)
                    del fns["auto"]
                    t = compare(fns, [(a,)], reps=reps, warmup=1, max_time_s=3.0)
                    table.add(
                        f"{op} B={b} n={n} {str(dtype)[6:]}",
                        f"torch.linalg.{op}",
                        t["lapack"],
                        t["jacobi"],
                        b * _flops(op, n, dtype),
                        auto=f"{t_auto['lapack'] / t_auto['auto']:.2f}x",
                    )
    for s in skipped:
        print(f"# skipped {s}")
    table.save(args.json)


def fastest(args: Any) -> None:
    """Cells of ``--ops`` × ``--batches`` × ``--sizes``: torch.linalg and ``--method`` (jacobi or
    auto) called alternately, the minimum of ``--reps`` each, on ``--threads`` threads (both
    sides; auto tuned by the warm-up call, outside the timing). On a
    shared machine the minimum drops the runs a descheduled thread stretched, which medians of a
    few ms calls do not."""
    import time

    torch.set_num_threads(args.threads)
    ops = tuple(args.ops) if args.ops else ("svd", "eigh", "cholesky")
    table = BenchTable(f"linalg_fastest_{args.threads}t", unit="GFLOP/s")
    table.start()
    for dtype in args.dtypes:
        for op in ops:
            for b in _ints(args.batches) or (1000,):
                for n in _ints(args.sizes) or (8, 16):
                    a = _input(op, b, n, dtype)
                    fns = _fns(op)
                    fl, fo = fns["lapack"], fns[args.method]
                    fl(a), fo(a)
                    tl_ = to = float("inf")
                    for _ in range(max(3, args.reps)):
                        t0 = time.perf_counter()
                        fl(a)
                        t1 = time.perf_counter()
                        fo(a)
                        t2 = time.perf_counter()
                        tl_, to = min(tl_, t1 - t0), min(to, t2 - t1)
                    table.add(
                        f"{op} B={b} n={n} {str(dtype)[6:]}",
                        f"torch.linalg.{op}",
                        tl_,
                        to,
                        b * _flops(op, n, dtype),
                        threads=args.threads,
                        method=args.method,
                    )
    table.save(args.json)


def orderings(args: Any) -> None:
    """Cyclic (0) vs round-robin (1) Jacobi ordering, and the eigh lane kernel's fused
    round-robin rounds (2) vs unfused (1), interleaved in one run."""
    table = BenchTable("linalg_orderings", unit="GFLOP/s")
    table.start()
    cells = ((100_000, 3), (10_000, 8), (10_000, 16), (1000, 32), (100, 64))
    for dtype in (torch.float32, torch.float64):
        for b, n in cells[:3] if args.quick else cells:
            a = _input("svd", b, n, dtype)
            s = _input("eigh", b, n, dtype)
            t = compare(
                {
                    "svd0": lambda x: kernels.svd(x, False, True, 0),
                    "svd1": lambda x: kernels.svd(x, False, True, 1),
                },
                [(a,)],
                reps=5,
                warmup=1,
            )
            table.add(
                f"svd B={b} n={n} {dtype}", "cyclic", t["svd0"], t["svd1"], b * FLOPS["svd"](n)
            )
            for lanes in (False, True):  # the per-thread kernel and the SIMD-lane kernel
                t = compare(
                    {
                        "e0": lambda x, v=lanes: kernels.eigh(x, False, True, 0, lanes=v),
                        "e1": lambda x, v=lanes: kernels.eigh(x, False, True, 1, lanes=v),
                    },
                    [(s,)],
                    reps=5,
                    warmup=1,
                )
                kind = "lanes" if lanes else "per-thread"
                table.add(
                    f"eigh {kind} B={b} n={n} {dtype}",
                    "cyclic",
                    t["e0"],
                    t["e1"],
                    b * FLOPS["eigh"](n),
                )
            # the lane kernel's round-robin rounds fused by symmetry (order 2) vs unfused (1)
            t = compare(
                {
                    "e1": lambda x: kernels.eigh(x, False, True, 1, lanes=True),
                    "e2": lambda x: kernels.eigh(x, False, True, 2, lanes=True),
                },
                [(s,)],
                reps=5,
                warmup=1,
            )
            table.add(
                f"eigh lanes fused B={b} n={n} {dtype}",
                "round-robin",
                t["e1"],
                t["e2"],
                b * FLOPS["eigh"](n),
            )
    table.save(args.json)


def sweeps(args: Any) -> None:
    """Time per sweep of the eigh lane kernel, one thread: builds capped at 2 and 4 sweeps and the
    uncapped one, alternated minima; (t4 - t2) / 2 is a full sweep (every pair still rotates in
    the first sweeps), t2 - 2 sweeps the cost outside the sweeps, and the rest over a sweep the
    effective number of sweeps. Rates count the rotation updates' vector multiplies/FMAs per
    round (16 per 2x2 block of A, 4 per element of V's two rows per pair)."""
    import time

    torch.set_num_threads(1)
    from torchport import native

    isa = native.cpu_info().isa
    print("# eigh lane kernel, 1 thread; us per lane group; ops = vector mul/FMA of the updates")
    for dtype in args.dtypes:
        lanes = 32 // dtype.itemsize
        ks = {c: kernels.library(dtype, isa, c)["eigh_vec"] for c in (2, 4, kernels.MAX_SWEEPS)}
        for n in _ints(args.sizes) or (16, 32):
            b = (_ints(args.batches) or (400,))[0] // lanes * lanes
            a = _input("eigh", b, n, dtype)
            lam, q = a.new_empty((b, n)), a.new_empty((b, n, n))
            call = (a.data_ptr(), lam.data_ptr(), q.data_ptr(), b, n, 0, 1, 2, 1)  # lower, V, fused
            best = dict.fromkeys(ks, float("inf"))
            for k in ks.values():
                k.call_unchecked(*call)
            for _ in range(max(3, args.reps)):
                for c, k in ks.items():
                    t0 = time.perf_counter()
                    k.call_unchecked(*call)
                    best[c] = min(best[c], time.perf_counter() - t0)
            g = b // lanes
            t2, t4, tc = (best[c] / g * 1e6 for c in ks)
            per = (t4 - t2) / 2
            outside = t2 - 2 * per
            r = n + (n & 1)
            h = r // 2
            ops = (r - 1) * (16 * h * (h - 1) // 2 + 4 * h * r)
            print(
                f"eigh {str(dtype)[6:]} n={n} B={b}: sweep {per:.2f} us ({ops} ops, "
                f"{ops / per / 1e3:.2f} per ns), outside the sweeps {outside:.2f} us, converged "
                f"{tc:.2f} us = {(tc - outside) / per:.1f} effective sweeps"
            )
            _block_sweeps(dtype, n, a, lam, q, args.reps)


def _block_sweeps(dtype: torch.dtype, n: int, a: Any, lam: Any, q: Any, reps: int) -> None:
    """``sweeps`` for the block-ordered kernel (eigh_block); ops = its scaled updates' FMAs."""
    import time

    from torchport import native
    from torchport.linalg import eigh_block
    from torchport.linalg._cparams import lane_bytes

    isa = native.cpu_info().isa
    ks = {c: eigh_block.library(dtype, isa, c) for c in (2, 4, eigh_block.MAX_SWEEPS)}
    b = a.shape[0]
    call = (a.data_ptr(), lam.data_ptr(), q.data_ptr(), b, n, 0, 1, 1)  # lower, V, 1 thread
    best = dict.fromkeys(ks, float("inf"))
    for k in ks.values():
        k.call_unchecked(*call)
    for _ in range(max(3, reps)):
        for c, k in ks.items():
            t0 = time.perf_counter()
            k.call_unchecked(*call)
            best[c] = min(best[c], time.perf_counter() - t0)
    g = b // (lane_bytes(isa, eigh_block.WIDE_LANES[dtype]) // dtype.itemsize)  # lane groups
    t2, t4, tc = (best[c] / g * 1e6 for c in ks)
    per = (t4 - t2) / 2
    outside = t2 - 2 * per
    r = (n + 3) // 4 * 4
    m, h = r // 2, r // 4
    ops = m * (m - 1) // 2 * 8 + 2 * m * r + (m - 1) * (h * (h - 1) // 2 * 64 + 8 * h * r)
    print(
        f"eigh_block {str(dtype)[6:]} n={n} B={b}: sweep {per:.2f} us ({ops} FMA, "
        f"{ops / per / 1e3:.2f} per ns), outside the sweeps {outside:.2f} us, converged "
        f"{tc:.2f} us = {(tc - outside) / per:.1f} effective sweeps"
    )


def main() -> None:
    p = arg_parser(__doc__ or "")
    p.add_argument("--orderings", action="store_true", help="cyclic vs round-robin Jacobi")
    # (a bad entry was a usage error for --ops only: an unknown op timed the cholesky functions
    # and failed on a non-PD input; the others ended in tracebacks, --batches 0 ran)
    p.add_argument(
        "--ops", type=comma_list(one_of(*OPS)), help=f"comma-separated subset of {','.join(OPS)}"
    )
    p.add_argument(
        "--sizes", type=comma_list(positive_int), help="comma-separated n (replaces the grid's)"
    )
    p.add_argument(
        "--batches", type=comma_list(positive_int), help="comma-separated B (replaces the grid's)"
    )
    p.add_argument(
        "--dtypes",
        type=comma_list(dtype_of("float32", "float64", "complex64", "complex128")),
        default="float32,float64",
        help="comma-separated dtypes",
    )
    p.add_argument("--fastest", action="store_true", help="min of --reps, alternated (see fastest)")
    p.add_argument(
        "--threads", type=positive_int, default=2, help="threads for --fastest (both sides)"
    )
    p.add_argument(
        "--method", default="jacobi", choices=("jacobi", "auto"), help="ours in --fastest"
    )
    p.add_argument("--sweeps", action="store_true", help="eigh lane kernel time per sweep")
    p.add_argument(
        "--max-work",
        type=positive_float,
        help=f"skip cells with B·n³ above this (default {MAX_WORK:.0e}; the 1 GB input cap stays)",
    )
    args = p.parse_args()
    with config.override(progress=False):
        if args.orderings:
            orderings(args)
        elif args.fastest:
            fastest(args)
        elif args.sweeps:
            sweeps(args)
        else:
            grid(args)


if __name__ == "__main__":
    main()
