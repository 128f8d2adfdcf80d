"""Decode GEMV (``[B, K] x W[N, K]^T``) vs ATen, weight stream in GB/s vs measured read bandwidth.

Anchors, measured in the same run: ``F.linear`` fp32 and bf16, and torch's int4 CPU GEMV
(``torch._weight_int4pack_mm_for_cpu``, group 32); the read-bandwidth baseline is a large
``Tensor.sum`` over two tensors of :data:`PEAK_BYTES` (half the weights' rotation, at least 128
MiB), timed interleaved with every cell (its % column uses that cell's sum, so a load change
between cells does not skew it). The second baseline is the native read peak (:mod:`torchport.gemv.readpeak`): every :data:`~torchport.gemv.readpeak.READ_CONFIGS`
streaming of two such buffers on 2 MiB pages (all threads; the first configuration on one
thread too), interleaved among themselves right after the cell's calls (among them, their
streams slowed the calls after them); the fastest is the cell's peak (``of_peak``). Weight
copies rotate over twice the largest cache the OS reports, at least 96 MB
(:func:`torchport.autotune.cold_bytes`), so calls read them from memory.
GB/s counts weight bytes (data + scales) per call. Every packed copy's settled route (see
:func:`torchport.gemv.gemv_packed`) is made before timing: decode's steady state. The FP8 and FP4
rows take float32 activations; ``fp8 bf16-x`` and ``nvfp4 bf16-x`` take the bf16 activations the
bf16 anchor takes and return bf16 results (E4M3 weights then run on ``vdpbf16ps`` where the CPU
has AVX512-BF16; every kernel has a bf16-in, bf16-out entry). ``--quick``: (11008, 4096), B = 1 only; ``--batches 8``: other activation row counts (up to 8). ``--cpu-time`` adds a single-thread table of process CPU
time per call, which time lost to other processes on a shared machine does not inflate.

Run: ``torchport bench gemv [--quick]``.
"""

from __future__ import annotations

import functools
import math
import resource
from collections.abc import Callable

import torch
import torch.nn.functional as F

from torchport import config
from torchport import gemv as G
from torchport.autotune import cold_bytes
from torchport.benchmarks import BenchTable, arg_parser, comma_list, compare
from torchport.cli import int_at_least
from torchport.gemv.hugepages import hugepage_empty
from torchport.gemv.readpeak import READ_CONFIGS, read_launcher
from torchport.lowp import Float8Tensor, MXTensor, NVFP4Tensor

# the weights' rotation: twice the largest cache the OS reports (this Xeon VM reports 480 MiB and
# served much of a 96 MB rotation from it), at least 96 MB
COLD_BYTES = cold_bytes()


def _copies(make, nbytes: int) -> list:
    return [make(i) for i in range(max(2, math.ceil(COLD_BYTES / max(1, nbytes))))]


@functools.cache
def bw_bufs() -> list[torch.Tensor]:
    """The read-bandwidth baseline's inputs: two tensors of :data:`PEAK_BYTES`, summed in
    alternation."""
    return [torch.rand(PEAK_BYTES // 4) for _ in range(2)]


PEAK_BYTES = max(128 << 20, COLD_BYTES // 2)  # each of the two read baselines' buffers


@functools.cache
def peak_reads() -> dict[str, list[Callable[[], int]]]:
    """The native read peak's launches: per read configuration (all threads; the first also on
    one thread), one launcher per buffer (two buffers of :data:`PEAK_BYTES` on 2 MiB pages,
    read in alternation as the sum's)."""
    bufs = [hugepage_empty((PEAK_BYTES,), torch.uint8).fill_(i + 1) for i in range(2)]
    reads = {f"read {c.name}": [read_launcher(b, 0, c) for b in bufs] for c in READ_CONFIGS}
    # one thread too: on a shared machine a two-thread read waits for a descheduled thread (as
    # a two-thread GEMV does, which then runs on one thread: the ceiling must allow for that)
    c = READ_CONFIGS[0]
    reads[f"read {c.name}_t1"] = [read_launcher(b, 1, c) for b in bufs]
    return reads


def _alternate(gos: list[Callable[[], int]]) -> Callable[[int], int]:
    return lambda i: gos[i % 2]()


def _bf16x(xb: torch.Tensor, pws: list, i: int) -> torch.Tensor:
    return G.gemv_packed(xb, pws[i % len(pws)])


def _bytes(w) -> int:
    if isinstance(w, torch.Tensor) and type(w) is torch.Tensor:
        return w.numel() * w.element_size()
    return w.qdata.numel() * w.qdata.element_size() + w.scale.numel() * w.scale.element_size()


def bench_batch(
    table: BenchTable,
    weights: dict,
    packs: dict,
    nbytes: dict,
    sz: torch.Tensor,
    n: int,
    k: int,
    b: int,
    reps: int,
) -> None:
    """One (N, K, B) cell: a large sum (the read-bandwidth baseline), every anchor and every
    format of ours, interleaved in one run; % of bandwidth is against this cell's sum."""
    x = torch.randn(b, k)
    xb = x.bfloat16()
    sets = [(i,) for i in range(max(len(v) for v in weights.values()))]

    def pick(f: str, i: int):  # the i-th rotated copy of format f
        ws = weights[f]
        return ws[i % len(ws)]

    def ours_packed(f: str):
        return lambda i: G.gemv_packed(x, packs[f][i % len(packs[f])])

    # Decode's steady state: every weight copy's route settled before timing. ``gemv_packed``
    # settles a route from a weight's second call; with the copies rotating, each got two or
    # three calls in a --quick run, so most timed calls were first-use or settling calls (cold
    # Python, kernel stubbed, load 5.4: 262 and 324 us against 151 us for a settled call).
    for pws in packs.values():
        for pw in pws:
            G.gemv_packed(x, pw)
            G.gemv_packed(x, pw)
    for pw in packs["fp8"] + packs["nvfp4"]:  # E4M3 and NVFP4 also meet bf16 activations
        G.gemv_packed(xb, pw)
        G.gemv_packed(xb, pw)

    fns = {
        "sum": lambda i: bw_bufs()[i % 2].sum(),
        "F.linear f32": lambda i: F.linear(x, pick("f32", i)),
        "F.linear bf16": lambda i: F.linear(xb, pick("bf16", i)),
        "int4pack_mm": lambda i: torch._weight_int4pack_mm_for_cpu(xb, pick("int4", i), 32, sz),
        "ours f32": lambda i: G.gemv(x, pick("f32", i)),
        "ours bf16": lambda i: G.gemv(xb, pick("bf16", i)),
    }
    for f in packs:
        fns[f"ours {f}"] = ours_packed(f)
    for f in ("fp8", "nvfp4"):  # the anchor's own (bf16) activations in, bf16 results out
        fns[f"ours {f} bf16x"] = functools.partial(_bf16x, xb, packs[f])
    t = compare(fns, sets, reps=reps)
    # The native read peaks in a rotation of their own right after the cell's: among the cell's
    # calls their 480 MiB streams slowed the calls after them (4096^2 B=1, the same rotation
    # without / with them: ours MXFP4 0.39 / 0.49 ms, bf16 F.linear 1.61 / 1.87 ms)
    t.update(compare({k: _alternate(g) for k, g in peak_reads().items()}, sets[:2], reps=reps))
    tag = f"N={n} K={k} B={b}"
    bw = PEAK_BYTES / t["sum"] / 1e9  # this cell's own read bandwidth (interleaved sum)
    reads = {name: PEAK_BYTES / t[name] / 1e9 for name in peak_reads()}
    top = max(reads, key=reads.__getitem__)
    peak = reads[top]  # this cell's native read peak: the fastest read configuration
    print(f"# {tag}: Tensor.sum {bw:.2f} GB/s interleaved with this cell")
    each = ", ".join(f"{name[5:]} {v:.2f}" for name, v in reads.items())
    print(f"# {tag}: native read peak {peak:.2f} GB/s ({top[5:]}; {each})")

    def pct(f: str, s: float) -> str:
        return f"{100 * nbytes[f] / s / 1e9 / bw:.0f}%"

    def pct_peak(f: str, s: float) -> str:
        return f"{100 * nbytes[f] / s / 1e9 / peak:.0f}%"

    for f in ("f32", "bf16"):
        a = f"F.linear {f}"
        o = t[f"ours {f}"]
        table.add(f"{tag} {f}", a, t[a], o, nbytes[f], of_bw=pct(f, o), of_peak=pct_peak(f, o))
    # the quantized formats, then E4M3 and NVFP4 weights with the anchor's own (bf16)
    # activations and bf16 results (the vdpbf16ps kernel's case for E4M3; the lane-block kernel's
    # bf16 entry for NVFP4): (row name, timing name, weight format)
    rows = [(f, f"ours {f}", f) for f in packs]
    rows += [(f"{f} bf16-x", f"ours {f} bf16x", f) for f in ("fp8", "nvfp4")]
    for row, name, f in rows:
        table.add(
            f"{tag} {row}",
            "F.linear bf16",
            t["F.linear bf16"],
            t[name],
            nbytes[f],
            of_bw=pct(f, t[name]),
            of_peak=pct_peak(f, t[name]),
            vs_int4=f"{t['int4pack_mm'] / t[name]:.2f}x",
        )
    table.add(
        f"{tag} int4 anchor",
        "F.linear bf16",
        t["F.linear bf16"],
        t["int4pack_mm"],
        nbytes["int4"],
        of_bw=pct("int4", t["int4pack_mm"]),
        of_peak=pct_peak("int4", t["int4pack_mm"]),
    )


def bench_shape(table: BenchTable, n: int, k: int, batches: list[int], reps: int) -> None:
    """Build rotated weight copies of every format for one (N, K), then time each batch size."""
    base = torch.randn(n, k) * 0.02
    weights: dict[str, list] = {
        "f32": _copies(lambda i: base + i * 1e-4, n * k * 4),
        "bf16": _copies(lambda i: (base + i * 1e-4).bfloat16(), n * k * 2),
        "int4": _copies(
            lambda i: torch._convert_weight_to_int4pack_for_cpu(
                torch.randint(0, 16, (n, k), dtype=torch.int32), 1
            ),
            n * k // 2,
        ),
        "fp8": _copies(lambda i: Float8Tensor.from_float(base + i * 1e-4), n * k),
        "nvfp4": _copies(lambda i: NVFP4Tensor.from_float(base + i * 1e-4), n * k // 2),
        "mxfp4": _copies(lambda i: MXTensor.from_float(base + i * 1e-4), n * k // 2),
    }
    sz = torch.rand(k // 32, n, 2).bfloat16()
    packs = {f: [w.gemv_pack() for w in weights[f]] for f in ("fp8", "nvfp4", "mxfp4")}
    nbytes = {f: _bytes(ws[0]) for f, ws in weights.items()}
    nbytes["int4"] = n * k // 2 + sz.numel() * 2
    for b in batches:
        bench_batch(table, weights, packs, nbytes, sz, n, k, b, reps)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_time_table(n: int, k: int, reps: int) -> None:
    """One thread, process CPU seconds per call (median): insensitive to time lost to other
    processes on a shared machine, though not to their memory traffic."""
    torch.set_num_threads(1)
    base = torch.randn(n, k) * 0.02
    x = torch.randn(1, k)
    xb = x.bfloat16()
    wb = _copies(lambda i: (base + i * 1e-4).bfloat16(), n * k * 2)
    packs = {
        "nvfp4": [
            w.gemv_pack()
            for w in _copies(lambda i: NVFP4Tensor.from_float(base + i * 1e-4), n * k // 2)
        ],
        "mxfp4": [
            w.gemv_pack()
            for w in _copies(lambda i: MXTensor.from_float(base + i * 1e-4), n * k // 2)
        ],
        "fp8": [
            w.gemv_pack()
            for w in _copies(lambda i: Float8Tensor.from_float(base + i * 1e-4), n * k)
        ],
    }

    def ours(f: str):
        return lambda i: G.gemv_packed(x, packs[f][i % len(packs[f])])

    fns = {
        "F.linear bf16": lambda i: F.linear(xb, wb[i % len(wb)]),
        "ours bf16": lambda i: G.gemv(xb, wb[i % len(wb)]),
    }
    fns.update({f"ours {f}": ours(f) for f in packs})
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn(0)
    for i in range(reps):
        for name, fn in fns.items():
            c0 = _cpu_s()
            fn(i)
            samples[name].append(_cpu_s() - c0)
    med = {name: sorted(v)[len(v) // 2] for name, v in samples.items()}
    print(f"# single-thread CPU time per call, N={n} K={k} B=1 (median of {reps})")
    for name, t in med.items():
        print(f"{name:<16} {t * 1e3:8.2f} ms   vs F.linear bf16: {med['F.linear bf16'] / t:5.2f}x")


def main() -> None:
    p = arg_parser(__doc__ or "")
    p.add_argument("--cpu-time", action="store_true", help="also: 1-thread CPU time per call")
    p.add_argument(
        "--batches",
        type=comma_list(int_at_least(1, at_most=G.MAX_ROWS)),
        default=None,
        help=f"comma-separated activation rows, 1 to {G.MAX_ROWS} (default 1,4; --quick 1)",
    )
    args = p.parse_args()
    config.set(
        "progress", False
    )  # the GEMV tunes its launch parameters on first use: keep output clean
    shapes = [(11008, 4096)] if args.quick else [(4096, 4096), (11008, 4096), (4096, 11008)]
    batches = [1] if args.quick else [1, 4]
    if args.batches:
        batches = args.batches
    reps = 11 if args.quick else args.reps
    table = BenchTable("gemv", unit="GB/s")
    table.start()
    for n, k in shapes:
        bench_shape(table, n, k, batches, reps)
    table.save(args.json)
    if args.cpu_time:
        cpu_time_table(11008, 4096, max(reps, 8))


if __name__ == "__main__":
    main()
