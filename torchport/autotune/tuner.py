"""The autotuner: profile candidates for one operation, keep the winner.

Candidates are data (:class:`Candidate`, frozen). An op supplies a ``factory`` that turns a
candidate into a callable, raising :class:`InvalidCandidate` for a configuration that cannot serve
the problem (the search skips it). The ATen candidate is the anchor: it is always timed in the
same run, and a non-ATen candidate is chosen only if it is correct (checked against the anchor's
output) and faster than the anchor by more than ``config.autotune_noise``.

With ``select(..., confirm=True)`` a non-ATen winner must also survive :func:`confirm`: the winner
and the anchor timed in alternation on the same inputs, so that a burst of load during the
one-after-the-other search cannot crown a slow kernel. A winner read from the persistent cache
(possibly tuned by another, loaded process) is confirmed the same way once per process, thread
count and ISA level (what its cache entry is keyed by that can change in a process); a winner
that fails is replaced by the anchor, in memory and on disk. A failure of the anchor there is no
verdict on the winner (see :func:`select`).

With ``select(..., final_round=n)`` the fastest candidates of the search (the winner and up to
``n - 1`` others close to it that beat the anchor) meet in one interleaved round before the
winner is kept: the search's one-after-the-other samples rank candidates a few per cent apart
by the load of the moment.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from torchport import config
from torchport.autotune import cache as _cache
from torchport.autotune import timing
from torchport.autotune.cache import ChoiceCache, choice_cache
from torchport.autotune.timing import clock, cold_copies, interleaved, measure, median

ATEN = "ATEN"
NATIVE = "NATIVE"

# ``select``'s ``cold``: False (the arguments as made), True (copies over ``cold_cache_bytes``,
# :func:`~torchport.autotune.timing.cold_copies`), or the op's own maker of the rotated argument
# sets from the made arguments (a GEMV's weight copies, placed as its weights live, past the
# cache the OS reports)
Cold = bool | Callable[[tuple[Any, ...]], Sequence[tuple[Any, ...]]]


def _arg_sets(args: tuple[Any, ...], cold: Cold) -> Sequence[tuple[Any, ...]]:
    """The argument sets a search or confirmation rotates for ``cold`` (see :data:`Cold`)."""
    if callable(cold):
        return cold(args)
    return cold_copies(args) if cold else [args]


class InvalidCandidate(Exception):
    """A candidate configuration cannot serve this problem; the search skips it."""


@dataclass(frozen=True)
class Candidate:
    """One point of an op's search space."""

    name: str
    backend: str = NATIVE
    params: tuple[tuple[str, Any], ...] = ()

    def param(self, key: str, default: Any = None) -> Any:
        """Look up one parameter by name."""
        for k, v in self.params:
            if k == key:
                return v
        return default

    @property
    def is_anchor(self) -> bool:
        return self.backend == ATEN


@dataclass
class Choice:
    """The outcome of tuning one problem."""

    op: str
    candidate: Candidate
    timings_s: dict[str, float] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    from_cache: bool = False
    tune_time_s: float = 0.0


@dataclass
class TunerStats:
    """Counters readable from Python: ``torchport.autotune.stats``."""

    tuned: int = 0
    cache_hits: int = 0
    candidates_timed: int = 0
    candidates_failed: int = 0
    confirmed: int = 0
    rejected: int = 0


stats = TunerStats()

# (op, problem key, ISA level, threads, candidate) -> verdict of this process's confirmation
# of a non-ATen choice
_confirmed: dict[tuple[Any, ...], bool] = {}


def _memo_key(op: str, key: Mapping[str, Any], cand: Candidate) -> tuple[Any, ...]:
    """The confirmation memo's key: the choice cache's lookup key (the problem, the ISA level
    the ``isa`` setting resolves to and the thread count, what its entries are keyed by that can
    change in a process) and the candidate. Keyed on the problem alone, a verdict reached under
    one thread count or ISA was served for the choice cached under another, which then ran
    unconfirmed (or was replaced by the anchor unconfirmed); keyed on the raw setting, "auto"
    and the level it resolves to confirmed the one cached choice twice."""
    return (*_cache._memo_key(op, key), cand.name)


def beats_anchor(t: float, t_anchor: float, noise: float | None = None) -> bool:
    """The rule for keeping a non-ATen candidate: faster than the anchor by more than ``noise``
    (default ``config.autotune_noise``) as a fraction of the anchor's time."""
    margin = float(config.get("autotune_noise")) if noise is None else noise
    return t < t_anchor * (1.0 - margin)


@dataclass(frozen=True)
class Confirmation:
    """Outcome of :func:`confirm`: medians of the alternating timing and the verdict."""

    won: bool
    candidate_s: float
    anchor_s: float


def confirm(
    fn: Callable[..., Any],
    anchor_fn: Callable[..., Any],
    arg_sets: Sequence[tuple[Any, ...]],
    *,
    reps: int | None = None,
    max_time_s: float = 2.0,
    min_rounds: int = 3,
    warmup: int = 1,
) -> Confirmation:
    """Time ``fn`` and ``anchor_fn`` in alternation on ``arg_sets`` (after ``warmup`` untimed
    rounds); ``won`` if ``fn`` still :func:`beats_anchor`. Used by :func:`select`
    (``confirm=True``) and by ops that decide between ATen and a native route themselves."""
    n = max(5, int(config.get("autotune_reps")) if reps is None else reps)
    t_fn, t_anchor = interleaved(
        [fn, anchor_fn],
        arg_sets,
        reps=n,
        warmup=warmup,
        max_time_s=max_time_s,
        min_rounds=min_rounds,
    )
    won = beats_anchor(t_fn, t_anchor)
    if won:
        stats.confirmed += 1
    else:
        stats.rejected += 1
    return Confirmation(won, t_fn, t_anchor)


def allowed_backends() -> set[str]:
    """Backends enabled by ``config.max_autotune_gemm_backends`` and ``config.native``."""
    allowed = set(config.get("max_autotune_gemm_backends").split(","))
    if not config.get("native"):
        allowed.discard(NATIVE)
    return allowed


def same_result(out: Any, ref: Any) -> bool:
    """The default result check: the same tree of values as the anchor's, each tensor of the
    same shape and dtype and, for floating-point ones, close (``rtol`` 1e-3, ``atol`` 1e-5 of
    the anchor's largest magnitude, NaN where the anchor has NaN); other values equal."""
    import torch
    import torch.utils._pytree as pytree

    leaves, spec = pytree.tree_flatten(out)
    ref_leaves, ref_spec = pytree.tree_flatten(ref)
    if spec != ref_spec:
        return False
    for a, b in zip(leaves, ref_leaves):
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
                return False
            if not (a.is_floating_point() or a.is_complex()):
                if not torch.equal(a, b):
                    return False
                continue
            scale = float(b.abs().nan_to_num(0.0, 0.0, 0.0).max()) if b.numel() else 0.0
            if not torch.allclose(a, b, rtol=1e-3, atol=1e-5 * max(scale, 1.0), equal_nan=True):
                return False
        elif a != b:
            return False
    return True


def select(
    op: str,
    key: Mapping[str, Any],
    candidates: Sequence[Candidate],
    factory: Callable[[Candidate], Callable[..., Any]],
    make_args: Callable[[], tuple[Any, ...]],
    *,
    cold: Cold = True,
    check: Callable[[Any, Any], bool] | None = None,
    cache: ChoiceCache | None = None,
    backends: set[str] | None = None,
    confirm: bool = False,
    budget_s: float | None = None,
    final_round: int = 0,
    final_round_s: float | None = None,
    final_factory: Callable[[Sequence[Candidate]], Sequence[Callable[..., Any]]] | None = None,
) -> Choice:
    """Choose the fastest valid candidate for ``(op, key)``, using and filling the choice cache.

    ``make_args`` builds representative arguments (called only when timing is needed);
    ``cold`` says how the timed calls rotate copies of them (:data:`Cold`);
    ``check(out, anchor_out)`` accepts a candidate's result (default :func:`same_result`: without
    one, a candidate returning a wrong result was timed and could be chosen). Backends outside ``backends``
    (default: :func:`allowed_backends`) are never chosen, but the ATen anchor is always timed:
    an anchor that raises before giving its result leaves nothing to check the others against,
    and ``select`` raises its error (nothing is chosen or cached; the next call tunes again).
    ``confirm=True`` re-times a non-ATen winner against the anchor in alternation before it is
    kept (fresh winners before they are saved, cached ones once per process per thread count
    and ISA level); a candidate that fails there is rejected, but the anchor's failure is no
    verdict: one that raises before returning in a cached choice's confirmation makes
    ``select`` raise as above (the cached choice stays, unconfirmed), and one that fails on a
    later call, there or in the search, leaves the native choice unjudged and kept, the
    anchor's error in ``failures``. ``budget_s`` caps the timing of the search: each candidate
    gets an equal share (at least three calls), so a loaded machine gives fewer samples rather
    than a longer search.

    ``final_round=n`` (n >= 2) lets a fresh non-ATen winner meet, in one interleaved round of at
    most ``final_round_s`` seconds (default :data:`FINAL_ROUND_S`), up to ``n - 1`` other
    candidates from the search that are within :data:`FINAL_ROUND_SPREAD` of it and beat the
    anchor there; the best median of the round is kept (then confirmed, with ``confirm``) and
    cached, and the round's medians are recorded as ``final:<name>``. ``final_factory`` builds
    the round's callables for its candidates together (default: ``factory`` of each), for ops
    whose candidates share argument state that the alternation must split between them.
    """
    cache = cache or choice_cache
    allowed = allowed_backends() if backends is None else backends
    anchors = [c for c in candidates if c.is_anchor]
    if len(anchors) != 1:
        raise ValueError(f"{op}: exactly one ATen anchor candidate is required, got {len(anchors)}")
    anchor = anchors[0]
    by_name = {c.name: c for c in candidates}
    eligible = [c for c in candidates if c.backend in allowed]
    if not eligible:
        return Choice(op, anchor)
    if len(eligible) == 1 and eligible[0].is_anchor:
        return Choice(op, anchor)

    hit = cache.get(op, key)
    if (
        hit is not None
        and hit["choice"] in by_name
        and _usable(by_name[hit["choice"]], hit, eligible)
    ):
        stats.cache_hits += 1
        chosen = by_name[hit["choice"]]
        timings = dict(hit.get("timings_s", {}))
        if confirm and not chosen.is_anchor and anchor in eligible and config.get("autotune"):
            memo = _memo_key(op, key, chosen)
            ok = _confirmed.get(memo)
            if ok is None:
                t0 = clock()
                # long calls: two alternating rounds after the warm-up (a round of bf16 M=2048
                # 4096->11008 is 0.17 s; five of them took a process's first call 1 s longer,
                # for every such cached shape); others: rounds for up to 2 s, three at least
                long = timings.get(anchor.name, 0.0) > LONG_CALL_S
                failures: dict[str, str] = {}
                # (an anchor that raises before returning raises here: the choice stays cached
                # and unconfirmed, and the next call confirms it again)
                ok = _confirm_choice(
                    chosen,
                    anchor,
                    factory,
                    make_args,
                    cold,
                    timings,
                    confirm_s=0.0 if long else 2.0,
                    min_rounds=2 if long else 3,
                    failures=failures,
                )
                if ok is None:  # the anchor failed on a later call: kept unjudged, not memoised
                    return Choice(op, chosen, timings, failures, from_cache=True)
                _confirmed[memo] = ok
                if not ok:
                    cache.put(op, key, anchor.name, timings)
                    return Choice(op, anchor, timings, tune_time_s=clock() - t0)
            if not ok:
                return Choice(op, anchor, timings, from_cache=True)
        return Choice(op, chosen, timings, from_cache=True)

    if not config.get("autotune"):
        for c in eligible:
            if c.is_anchor:
                continue
            try:
                factory(c)
                return Choice(op, c)
            except InvalidCandidate:
                continue
        return Choice(op, anchor)

    final = _Final(
        final_round,
        FINAL_ROUND_S if final_round_s is None else final_round_s,
        final_factory or (lambda cs: [factory(c) for c in cs]),
    )
    return _tune(
        op, key, anchor, eligible, factory, make_args, cold, check, cache, confirm, budget_s, final
    )


def _usable(chosen: Candidate, hit: Mapping[str, Any], eligible: Sequence[Candidate]) -> bool:
    """Whether a cached choice serves a call allowing ``eligible``: an eligible candidate, or the
    anchor when the tuning that cached it timed no eligible one (they all failed, as with
    backends={NATIVE} where no native candidate builds). Such an outcome was retuned by every
    new process; an anchor cached for beating timed native candidates is still not served where
    ATen is not allowed."""
    if chosen in eligible:
        return True
    timed = hit.get("timings_s", {})
    return chosen.is_anchor and not any(c.name in timed for c in eligible if not c.is_anchor)


def _watch(fn: Callable[..., Any]) -> tuple[Callable[..., Any], list[int]]:
    """``fn`` counting its calls that returned (``counts[0]``) and that raised (``counts[1]``).
    A confirmation wraps both of its callables alike (the same cost on each side), so that an
    error is put down to the one that raised it."""
    counts = [0, 0]

    def call(*args: Any) -> Any:
        try:
            out = fn(*args)
        except Exception:
            counts[1] += 1
            raise
        counts[0] += 1
        return out

    return call, counts


def _confirm_choice(
    chosen: Candidate,
    anchor: Candidate,
    factory: Callable[[Candidate], Callable[..., Any]],
    make_args: Callable[[], tuple[Any, ...]],
    cold: Cold,
    timings: dict[str, float],
    args: tuple[Any, ...] | None = None,
    confirm_s: float = 2.0,
    min_rounds: int = 3,
    warm_anchor: bool = True,
    failures: dict[str, str] | None = None,
    anchor_ran: bool = False,
) -> bool | None:
    """Alternating timing of ``chosen`` against ``anchor`` after a warm-up round; records both
    in ``timings``. ``warm_anchor=False``: the warm-up calls ``chosen`` alone (a new callable may
    pack its weights on its first call; an anchor that already ran needs none).

    The verdict: True or False, False also for a candidate that cannot be built or run now
    (rejected like a slow one). Arguments that cannot be made raise, as in the search. An error
    of the anchor is no evidence against the candidate, and is handled as in the search: an
    anchor that gives no result (it cannot be built or raises before returning once, and
    ``anchor_ran`` does not say that it returned in this tuning already) raises its error, the
    caller's; one that fails on a later call leaves ``chosen`` unjudged: None, the error
    recorded in ``failures``.
    """
    if args is None:
        args = make_args()
    arg_sets = _arg_sets(args, cold)
    anchor_calls = [0, 1]  # (until it is built: its factory raising is the anchor raising)
    try:
        anchor_fn, anchor_calls = _watch(factory(anchor))
        fn, _ = _watch(factory(chosen))
        if not warm_anchor:
            fn(*arg_sets[0])
        res = confirm(
            fn,
            anchor_fn,
            arg_sets,
            max_time_s=confirm_s,
            min_rounds=min_rounds,
            warmup=int(warm_anchor),
        )
    except Exception as e:
        if not anchor_calls[1]:  # the candidate failed: never chosen
            stats.rejected += 1
            return False
        if not (anchor_ran or anchor_calls[0]):
            raise
        if failures is not None:
            failures[anchor.name] = f"{type(e).__name__}: {e}"
        stats.candidates_failed += 1
        return None
    timings[f"confirm:{chosen.name}"] = res.candidate_s
    timings[f"confirm:{anchor.name}"] = res.anchor_s
    return res.won


# With a tuning budget, a call at least this long is timed once after its checked call (a
# scheduler timeslice, ~4 ms, is then under 7 % of it), and a long anchor lets a > 1.5x winner skip
# the alternating confirmation: GEMMs of ~0.1 s (M=128 4096->11008) cost 8-14 calls otherwise.
LONG_CALL_S = 0.06

# Under a budget, an anchor whose checked call took longer than LONG_CALL_S is timed after the
# other candidates: in full if the fastest of them is within this factor of that call, else by
# one more call (the faster of the two is its time: a first call may carry one-time work, such
# as a library's set-up or JIT, that a second does not). Measured, cold tuning of bf16 M=512
# 1024->4096 on the Zen 3 (no AVX512-BF16): ATen's addmm takes ~220 ms a call against the
# kernels' ~25 ms, and its settling and timed calls (three calls with the checked one) were a
# third of the shape's tuning.
ANCHOR_CLEAR_WIN = 3.0


# A native candidate within this factor of the anchor's search time is confirmed against it in
# alternation even when the search ranked the anchor first (``select(confirm=True)``).
NARROW_RECHECK = 1.10


def _long_call_verdict(timings: Mapping[str, float], name: str, anchor: str) -> bool:
    """Whether ``name`` beats ``anchor`` by their fastest recorded calls, search and
    confirmation together: for calls longer than LONG_CALL_S the search times each candidate
    once and the confirmation takes one or two alternating rounds, so one burst of load on the
    candidate's confirmation call rejected a kernel that was faster in both phases' best calls
    (measured, bf16 M=2048 768->3072 on vdpbf16ps, load 3-4: search 77.4 vs ATen 114.3 ms,
    confirmation 98.1 vs 95.4 ms: ATen kept, 0.80x max-autotune in that run). Load only
    lengthens a compute-bound call, so the fastest call of each is the closer estimate; a win
    that came from a burst on the anchor's search call still fails here, on the anchor's
    confirmation time."""
    mine = min(timings[name], timings.get(f"confirm:{name}", math.inf))
    theirs = min(timings[anchor], timings.get(f"confirm:{anchor}", math.inf))
    return beats_anchor(mine, theirs)


# The search times candidates one after the other, a few calls each: on a shared machine a burst
# of load decides between candidates a few per cent apart (a fresh cache picked T0 4096 over NTA
# 2048 prefetch for NVFP4 11008x4096 GEMV on one such sample each, where NTA 2048 streamed faster
# in interleaved runs; the GEMM's row driver, 7-14 % faster than the 4x24 tile at M = 1
# interleaved, ranked 8th, 5th and 2nd in three fresh tunings). ``select(final_round=n)`` settles
# it: the n fastest candidates within FINAL_ROUND_SPREAD of the winner (each having beaten the
# anchor in the search) meet in one interleaved round, FINAL_ROUND_MIN rounds at least (the round is cut to the candidates whose sequential
# medians fit that many rounds, and its warm-up, in the time bound), FINAL_ROUND_S by default.
FINAL_ROUND_SPREAD = 1.25
FINAL_ROUND_S = 0.5
FINAL_ROUND_MIN = 5
FINAL_ROUND_REPS = 64


@dataclass(frozen=True)
class _Final:
    """The final round asked of :func:`select`: candidates (0: none), time bound, builder."""

    n: int = 0
    bound_s: float = FINAL_ROUND_S
    build: Callable[[Sequence[Candidate]], Sequence[Callable[..., Any]]] | None = None


def _final_round(
    choice: Candidate,
    ranked: Sequence[Candidate],
    timings: dict[str, float],
    anchor_s: float | None,
    final: _Final,
    arg_sets: Sequence[tuple[Any, ...]],
    failures: dict[str, str],
) -> Candidate | None:
    """``choice`` or the candidate with the best median of one interleaved round among the
    search's fastest (see FINAL_ROUND_SPREAD); ``anchor_s``: the anchor's time when its verdict
    applies (a candidate that did not beat it never enters). Records ``final:<name>`` medians.
    A candidate that raises in the round is recorded in ``failures``; None when that is
    ``choice`` (a candidate that fails is never chosen: the caller takes the anchor)."""
    best = timings[choice.name]
    top = sorted(
        (
            c
            for c in ranked
            if not c.is_anchor
            and timings[c.name] <= best * FINAL_ROUND_SPREAD
            and (anchor_s is None or beats_anchor(timings[c.name], anchor_s))
        ),
        key=lambda c: timings[c.name],
    )[: final.n]
    warm = len(arg_sets)
    # the warm-up, FINAL_ROUND_MIN rounds and one round past the time check fit in the bound
    while len(top) > 1 and (
        (warm + FINAL_ROUND_MIN + 1) * sum(timings[c.name] for c in top) > final.bound_s
    ):
        top.pop()
    if len(top) < 2 or final.build is None:
        return choice
    round_s = sum(timings[c.name] for c in top)
    watched: list[tuple[Callable[..., Any], list[int]]] = []
    try:
        watched = [_watch(fn) for fn in final.build(top)]
        meds = timing.interleaved(
            [fn for fn, _ in watched],
            arg_sets,
            reps=FINAL_ROUND_REPS,
            warmup=warm,
            max_time_s=max(0.0, final.bound_s - (warm + 1) * round_s),
            min_rounds=FINAL_ROUND_MIN,
        )
    except Exception as e:
        # the round is lost; the search's choice stays unless it is the one that raised (one
        # that fails is never chosen; before, a winner failing here was saved). Built
        # together, a failed build names no one: the choice stays, as it passed the search.
        stats.candidates_failed += 1
        failed = [c.name for c, (_, calls) in zip(top, watched) if calls[1]]
        for name in failed:
            failures[name] = f"final round: {type(e).__name__}: {e}"
        return None if choice.name in failed else choice
    timings.update({f"final:{c.name}": m for c, m in zip(top, meds)})
    return top[min(range(len(top)), key=meds.__getitem__)]


def _tune(
    op: str,
    key: Mapping[str, Any],
    anchor: Candidate,
    eligible: Sequence[Candidate],
    factory: Callable[[Candidate], Callable[..., Any]],
    make_args: Callable[[], tuple[Any, ...]],
    cold: Cold,
    check: Callable[[Any, Any], bool] | None,
    cache: ChoiceCache,
    confirm_win: bool = False,
    budget_s: float | None = None,
    final: _Final = _Final(),
) -> Choice:
    t_start = time.perf_counter()
    args = make_args()
    arg_sets = _arg_sets(args, cold)
    reps = config.get("autotune_reps")
    order = [anchor] + [c for c in eligible if not c.is_anchor]
    cap_s = 2.0 if budget_s is None else max(0.01, budget_s / len(order))
    search_t0 = timing.clock()
    timings: dict[str, float] = {}
    failures: dict[str, str] = {}
    anchor_out: Any = None
    bar = tqdm(
        order,
        desc=f"autotune {op}",
        leave=False,
        delay=1.0,
        disable=not config.get("progress"),
    )

    def time_calls(fn: Callable[..., Any], first_s: float) -> list[float]:
        # with one argument set, the checked call was the warm-up (and, for packed kernels, the
        # packing); rotated cold sets start with one more warm-up call
        warm = 1 if len(arg_sets) > 1 else 0
        # The allocator settles first (see timing.settle_faults). Under a budget, a call that
        # takes longer than the candidate's share or than LONG_CALL_S is timed once: such
        # calls (large, compute-bound problems, tenths of a second) are not moved by load
        # bursts of milliseconds, and a scheduler timeslice is a few per cent of one. The
        # settling's last call must be that long too, not only the checked first one, which
        # may include one-time work (the first candidate of a packing packs every copy's
        # weights); before, a 7 ms kernel whose first call packed for 0.1 s was timed once,
        # on a call of 4096 fresh pages (20 ms).
        t0 = timing.clock()
        settled = timing.settle_faults(fn, arg_sets, cap_s / 4)
        left_s = max(0.0, cap_s - (timing.clock() - t0))  # (the share includes the settling)
        once = budget_s is not None and min(first_s, settled.last_s) > min(cap_s, LONG_CALL_S)
        if once and settled.quiet:
            # a quiet settling call is that one timed call (bf16 M=2048 4096->11008, 85 ms
            # calls: one more call per candidate was a tenth of the 2 s bound)
            return [settled.last_s]
        if once:
            # the share ran out on a faulting call: one more call, the faster of the two
            # (an output under glibc's 32 MiB mmap threshold usually comes from reused
            # memory on the next call; one over it faults on every call alike)
            again = measure(fn, arg_sets, reps=1, warmup=warm, min_reps=1)
            return [min(settled.last_s, again[0])]
        return measure(fn, arg_sets, reps=reps, warmup=warm, max_time_s=left_s)

    # a long anchor call (under a budget) is timed after the other candidates, in full only
    # when they need it: see ANCHOR_CLEAR_WIN
    deferred: tuple[Callable[..., Any], float] | None = None
    for cand in bar:
        try:
            fn = factory(cand)
            t0 = timing.clock()
            out = fn(*args)
            first_s = timing.clock() - t0
            if cand.is_anchor:
                anchor_out = out
                if budget_s is not None and first_s > LONG_CALL_S:
                    deferred = (fn, first_s)
                    continue
            elif anchor_out is not None and not (check or same_result)(out, anchor_out):
                raise InvalidCandidate("result does not match the ATen anchor")
            timings[cand.name] = median(time_calls(fn, first_s))
            stats.candidates_timed += 1
        except Exception as e:  # a candidate that crashes is skipped, never chosen
            if cand.is_anchor and anchor_out is None:
                # the anchor gave no result: no candidate can be checked against it (one
                # returning zeros was chosen and saved), so nothing is chosen or saved; the
                # error is the caller's, and the next call tunes again
                bar.close()
                raise
            if isinstance(e, InvalidCandidate):
                failures[cand.name] = f"invalid: {e}"
                continue
            failures[cand.name] = f"{type(e).__name__}: {e}"
            stats.candidates_failed += 1
    if deferred is not None:
        fn, first_s = deferred
        best = min(
            (timings[c.name] for c in eligible if not c.is_anchor and c.name in timings),
            default=math.inf,
        )
        try:
            if best == math.inf:  # no candidate to judge: the checked call is its time
                timings[anchor.name] = first_s
                timings[f"first:{anchor.name}"] = first_s
            elif best * ANCHOR_CLEAR_WIN <= first_s:
                # a clear winner by the checked call: one more call, free of one-time work
                # (library set-up, JIT), is the anchor's time (the faster of the two), which
                # the 1.5x confirmation shortcut below then rests on
                again = measure(fn, arg_sets, reps=1, warmup=0, min_reps=1)[0]
                timings[anchor.name] = min(first_s, again)
                timings[f"first:{anchor.name}"] = first_s
                stats.candidates_timed += 1
            else:
                timings[anchor.name] = median(time_calls(fn, first_s))
                stats.candidates_timed += 1
        except Exception as e:  # the anchor failed on a later call: it is not judged
            failures[anchor.name] = f"{type(e).__name__}: {e}"
            stats.candidates_failed += 1
    bar.close()
    ranked = [c for c in order if c.name in timings and c in eligible]
    if not ranked:
        choice = anchor
    else:
        choice = min(ranked, key=lambda c: timings[c.name])
        judged = anchor.name in timings and anchor in eligible
        if (
            not choice.is_anchor
            and judged
            and not beats_anchor(timings[choice.name], timings[anchor.name])
        ):
            choice = anchor
        if not choice.is_anchor and final.n > 1:
            anchor_s = timings[anchor.name] if judged else None
            picked = _final_round(choice, ranked, timings, anchor_s, final, arg_sets, failures)
            if picked is None:  # the winner raised in the round: out of the running (also of
                # the narrow-loss recheck below, which took it back and saved it)
                ranked = [c for c in ranked if c.name != choice.name]
                choice = anchor
            else:
                choice = picked
        long_calls = (
            judged and budget_s is not None and timings[anchor.name] > min(cap_s, LONG_CALL_S)
        )
        if confirm_win and judged and choice.is_anchor:
            # the search times one candidate after the other: a native candidate that lost
            # narrowly meets the anchor in the alternating confirmation a narrow winner gets
            # (measured, bf16 M=2048 4096->11008, one call each: ATen's 80.7 ms, the kernels'
            # 78.5 and 79.9, where ATen typically takes 86-93 and the kernels 82-85: ATen kept,
            # by its lucky call; at 2048 768->3072, 3.5 ms calls: ATen 3.64 ms against 3.59,
            # where the kernel runs 3.3-3.4 against ATen's 3.6-3.8 in alternation)
            near = [
                c
                for c in ranked
                if not c.is_anchor and timings[c.name] < timings[anchor.name] * NARROW_RECHECK
            ]
            if near:
                choice = min(near, key=lambda c: timings[c.name])
        if confirm_win and not choice.is_anchor and judged:
            ok: bool | None
            if long_calls and timings[choice.name] < timings[anchor.name] / 1.5:
                ok = True  # calls this long are not 1.5x apart through a burst of load
            elif long_calls:
                # the anchor ran already: only the candidate's warm-up call (a new callable may
                # repack), and rounds only while the search left some of the budget, one at least
                # (a warm-up round and 2 * cap_s of rounds took 0.9 s at bf16 M=2048 4096->11008,
                # 85 ms calls)
                left_s = max(0.0, (budget_s or 0.0) - (timing.clock() - search_t0))
                ok = _confirm_choice(
                    choice,
                    anchor,
                    factory,
                    make_args,
                    cold,
                    timings,
                    args,
                    confirm_s=left_s,
                    min_rounds=1,
                    warm_anchor=False,
                    failures=failures,
                    anchor_ran=True,
                )
                if ok is False and f"confirm:{choice.name}" in timings:  # (not when it raised)
                    ok = _long_call_verdict(timings, choice.name, anchor.name)
                    if ok:  # overturned: the rejection confirm() counted is a confirmation
                        stats.rejected -= 1
                        stats.confirmed += 1
            else:
                ok = _confirm_choice(
                    choice,
                    anchor,
                    factory,
                    make_args,
                    cold,
                    timings,
                    args,
                    confirm_s=2 * cap_s,
                    failures=failures,
                    anchor_ran=True,
                )
            # None: the anchor failed on a later call (as one in the search): ``choice`` is kept
            # unjudged, and confirmed again where it is read from the cache
            if ok is not None:
                _confirmed[_memo_key(op, key, choice)] = ok
            if ok is False:
                choice = anchor
    stats.tuned += 1
    cache.put(op, key, choice.name, timings)
    return Choice(op, choice, timings, failures, tune_time_s=time.perf_counter() - t_start)
