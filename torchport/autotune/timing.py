"""Timing primitives shared by the autotuner and the benchmarks.

``measure`` runs a callable over a rotation of input sets: with one set the caches stay hot; with
enough copies to exceed the last-level cache (:func:`cold_copies`) each call reads its operands
from memory, as a layer does in a real model whose weights do not fit in L3.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from torchport import config

L3_BYTES = 32 << 20  # this machine's L3; cold timing rotates more than this

_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def last_level_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """The largest CPU cache the OS reports for cpu0 (sysfs ``index*/size``, e.g. ``491520K``),
    or :data:`L3_BYTES` where it reports none. A VM may report its host's cache: the Xeon VM of
    the thirty-third session reports 480 MiB, and there repeated reads of 64 MB ran at 48 GB/s,
    of 128 MB at 37, from 256 MB on at 23 (``Tensor.sum``, two threads): a 96 MB rotation was
    partly served from it."""
    import glob

    sizes = []
    for path in glob.glob(f"{root}/index*/size"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except (OSError, ValueError):  # unreadable, or not text (UnicodeDecodeError)
            continue
        unit = _SIZE_UNITS.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in _SIZE_UNITS else text
        if digits.isascii() and digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=L3_BYTES)


def cold_bytes(
    floor: int = 96 << 20, ceiling: int = 2 << 30, cache_bytes: int | None = None
) -> int:
    """Bytes a rotation of weight copies should span so calls read them from memory: twice the
    largest cache (``cache_bytes``, default the one the OS reports), at least ``floor`` and at
    most ``ceiling`` (a benchmark holds such a rotation per format at once)."""
    cache = last_level_cache_bytes() if cache_bytes is None else cache_bytes
    return min(ceiling, max(floor, 2 * cache))


clock: Callable[[], float] = time.perf_counter
"""The timer every measurement reads (tests replace it with a fake clock for exact timings)."""


def nbytes(obj: Any) -> int:
    """Total bytes of the tensors in a (nested) tuple/list of arguments."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(o) for o in obj)
    if isinstance(obj, dict):
        return sum(nbytes(o) for o in obj.values())
    return 0


def _clone(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, tuple):
        return tuple(_clone(o) for o in obj)
    if isinstance(obj, list):
        return [_clone(o) for o in obj]
    return obj


def sample_generator(seed: int = 0) -> torch.Generator:
    """A private CPU generator for a tuner's random inputs: drawing them leaves the caller's global
    random stream (``torch.manual_seed``) where it was, so a first call that tunes returns the
    same later random numbers as one that does not."""
    return torch.Generator().manual_seed(seed)


def cold_copies(
    args: tuple[Any, ...], *, budget: int | None = None, max_copies: int = 64
) -> list[tuple[Any, ...]]:
    """Copies of ``args`` whose total size exceeds ``budget`` bytes (default: config).

    Returns ``[args]`` alone when the arguments are already larger than the budget.
    """
    budget = config.get("cold_cache_bytes") if budget is None else budget
    size = max(1, nbytes(args))
    n = min(max_copies, max(1, math.ceil(budget / size)))
    return [args] + [_clone(args) for _ in range(n - 1)]


# untimed calls :func:`settle_faults` makes at most, and the minor page faults below which a call
# counts as settled (a call's own small allocations may fault a few pages)
SETTLE_FAULT_CALLS = 8
SETTLE_QUIET_FAULTS = 64


def _minor_faults() -> int:
    try:
        import resource
    except ImportError:  # (not on Windows: no settling there)
        return 0
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_minflt)


class Settled(NamedTuple):
    """What :func:`settle_faults` did: calls made, the last one's seconds, and whether that call
    was quiet (took fewer than :data:`SETTLE_QUIET_FAULTS` fresh pages: a timing of the settled
    allocator, as good as a measured call)."""

    calls: int
    last_s: float
    quiet: bool


def settle_faults(
    fn: Callable[..., Any], arg_sets: Sequence[tuple[Any, ...]], max_time_s: float
) -> Settled:
    """Untimed calls of ``fn`` while each one page-faults (at least one, at most
    :data:`SETTLE_FAULT_CALLS` and, past the first, ``max_time_s``); returns how many it made,
    the seconds the last one took and whether it was quiet. A large output can come from fresh pages on
    every call for a while, until the heap's free chunks line up (glibc: a freed 64-byte-aligned
    chunk is too small for the next aligned request of its size): measured in a GEMM tuning,
    M=2048 1024->4096 bf16, 16 MB outputs, the first candidate timed after ATen took 14-16 ms
    per call with ~7500 page faults each for 4-6 calls, then 6.5-7 ms with none, and the tuner
    chose ATen (6.7 ms) over kernels that run at 6.3."""
    n = len(arg_sets)
    start = clock()
    last_s = 0.0
    for i in range(SETTLE_FAULT_CALLS):
        before = _minor_faults()
        t0 = clock()
        fn(*arg_sets[(n - 1 - i) % n])  # from the last set: the first ones stay coldest for timing
        last_s = clock() - t0
        quiet = _minor_faults() - before < SETTLE_QUIET_FAULTS
        if quiet or clock() - start > max_time_s:
            return Settled(i + 1, last_s, quiet)
    return Settled(SETTLE_FAULT_CALLS, last_s, False)


def measure(
    fn: Callable[..., Any],
    arg_sets: Sequence[tuple[Any, ...]],
    *,
    reps: int,
    warmup: int = 2,
    min_time_s: float = 0.0,
    max_time_s: float = 10.0,
    min_reps: int = 3,
) -> list[float]:
    """Seconds per call for ``reps`` calls (more while under ``min_time_s``), rotating arg sets;
    past ``max_time_s`` it stops once ``min_reps`` calls are timed."""
    n = len(arg_sets)
    for i in range(warmup):
        fn(*arg_sets[i % n])
    times: list[float] = []
    start = clock()
    i = 0
    while True:
        args = arg_sets[i % n]
        t0 = clock()
        fn(*args)
        times.append(clock() - t0)
        i += 1
        elapsed = clock() - start
        if i >= reps and elapsed >= min_time_s:
            break
        if elapsed >= max_time_s and i >= min_reps:
            break
    return times


def interleaved(
    fns: Sequence[Callable[..., Any]],
    arg_sets: Sequence[tuple[Any, ...]],
    *,
    reps: int,
    warmup: int = 1,
    max_time_s: float = 10.0,
    min_rounds: int = 3,
) -> list[float]:
    """Median seconds per call of each of ``fns``, timed in alternation (f0, f1, f1, f0, f0, f1,
    ...: the order reversed every round).

    A burst of load on a shared machine then hits every function alike, where timing one after
    the other lets the burst decide. Each function steps through every argument set in turn, the
    functions ``len(arg_sets) // len(fns)`` sets apart, so a set is read again only after about
    ``len(arg_sets) - len(fns)`` other calls: with one set per round every call after the round's
    first read its operands warm, which decided a GEMV tuner's final round (NVFP4 4096x4096 B=1,
    9.4 MB weights, on a VM whose cache held them: the second and third candidates of each round
    timed 0.22-0.30 ms, the first 0.38, where the search had all three at 0.33-0.35). Reversing
    the order puts every function after another alike (a call right after another function's
    runs slower).
    """
    n, k = len(arg_sets), len(fns)
    stride = max(1, n // k)  # function j reads set (round + j * stride) % n

    def args_of(r: int, j: int) -> tuple[Any, ...]:
        return arg_sets[(r + j * stride) % n]

    for r in range(warmup):
        for j, fn in enumerate(fns):
            fn(*args_of(r, j))
    samples: list[list[float]] = [[] for _ in fns]
    order = list(range(k))
    start = clock()
    for i in range(max(1, reps)):
        r = warmup + i
        for j in order if i % 2 == 0 else order[::-1]:
            args = args_of(r, j)
            t0 = clock()
            fns[j](*args)
            samples[j].append(clock() - t0)
        if i + 1 >= min_rounds and clock() - start >= max_time_s:
            break
    return [median(s) for s in samples]


def alternated_min(
    fns: Sequence[Callable[..., Any]],
    args: tuple[Any, ...],
    *,
    rounds: int,
    group: int,
    max_time_s: float = 1.0,
    min_rounds: int = 3,
) -> list[float]:
    """Least seconds per call of each of ``fns`` over ``rounds`` rounds, for calls of a few µs.

    Each round times every function on a group of ``group`` back-to-back calls (the clock is
    read once per group, not per call), in an order reversed every round: the call right after
    another function's runs slower whatever it is, and this puts both sides there alike. Load
    on a shared machine only ever adds time, so the least group of many is the unloaded call,
    where a median of short samples moves with the load of the moment. Stops after
    ``max_time_s`` once ``min_rounds`` rounds are done.
    """
    for fn in fns:  # one warm-up call each
        fn(*args)
    best = [math.inf] * len(fns)
    order = list(range(len(fns)))
    start = clock()
    for r in range(max(1, rounds)):
        for i in order if r % 2 == 0 else order[::-1]:
            fn = fns[i]
            t0 = clock()
            for _ in range(group):
                fn(*args)
            best[i] = min(best[i], (clock() - t0) / group)
        if r + 1 >= min_rounds and clock() - start >= max_time_s:
            break
    return best


def median(times: Sequence[float]) -> float:
    """Median of a non-empty sequence of timings."""
    return float(statistics.median(times))
