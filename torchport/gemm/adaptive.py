"""Run-time choice between a kernel's all-threads and one-thread launches and ATen (small M).

On a machine shared with other busy processes, a short kernel split across two threads waits, at
its closing barrier, for whichever thread the scheduler descheduled: measured here, an M=1
1024→4096 GEMM took 1.2 ms on one thread and ~6–20 ms on two while one other process was busy,
against 0.6 ms on two threads when the machine was quiet. Which launch is faster changes with the
neighbours' load, after tuning is over, so :class:`ThreadAdaptive` keeps the launches (and ATen,
so a native choice never stays slower than ATen under a load it was not tuned for) and follows
recent timings: it uses the fastest by the median of its last few calls, times another again
every ``probe_every`` calls (the cost of noticing that the load changed), and switches when one is
faster by ``margin``. The one-thread twin returns bitwise the same result; ATen's may differ in
the last bits (within the GEMM's stated tolerance). Timing uses
:data:`torchport.autotune.timing.clock`.

A call during which ``events()`` changes (the GEMM passes the packed-weight cache's miss counter)
did one-off work besides the launch and is not recorded: packing a new weight inside the first
calls of the two-thread launch used to put milliseconds into its few learning samples, so the
runner settled on a slower launch for the next hundreds of calls (measured at M=1 1024→4096:
two-thread median 6.8 ms with packing vs 0.67 ms without). Only the first
``packing_calls_skipped`` such timed calls in a row are left out: a weight packed anew at every
call (a copy made per call, as autocast's) pays it every time, and ATen, which packs nothing,
must be compared with that.

Runners of the same problem and kernel config that differ only in their fused epilogue (bare
``x @ W`` and ``gelu(x @ W + b) + r``) share the statistics of their native arms
(:class:`ArmStats`): the epilogue adds the same few microseconds to every native launch, so the
bare and the fused calls rank the launches alike, and with one shared record they cannot settle
on different launches (before, each learned alone; the fused runner could sit on the two-thread
launch while the bare one had moved to the one-thread launch, or the reverse, which showed as a
fused/bare ratio of 1.15 at M=8 in one run). Each runner keeps its own ATen arm: ATen's cost
grows with the epilogue (one op per step).
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from torchport.autotune import timing

Launch = Callable[..., Any]


class ArmStats:
    """Recent timings of one launch and their median; may be shared by several runners (their
    ``lock`` must then be the same object, see :class:`ThreadAdaptive`)."""

    def __init__(self, window: int = 5) -> None:
        self.hist: deque[float] = deque(maxlen=window)
        self.median = 0.0
        self.best = math.inf  # the fastest timing ever recorded

    def add(self, dt: float) -> None:
        self.hist.append(dt)
        self.best = min(self.best, dt)
        srt = sorted(self.hist)  # statistics.median costs ~2 us
        mid = len(srt) // 2
        self.median = srt[mid] if len(srt) % 2 else 0.5 * (srt[mid - 1] + srt[mid])


class ArmGroup:
    """Arms shared by several runners of one problem: their statistics and one preferred launch
    among them (``current``, an index into each runner's arms, the same in every runner),
    guarded by one lock that every member runner uses for its bookkeeping."""

    def __init__(self, arms: Sequence[int], window: int = 5) -> None:
        assert len(arms) >= 1 and len(set(arms)) == len(arms)
        self.arms = tuple(arms)
        self.stats = {i: ArmStats(window) for i in self.arms}
        self.current = self.arms[0]
        # the launch the members that share every arm last settled on (-1: none yet); such a
        # member takes it at its next call, not only at its next timed call (see ThreadAdaptive)
        self.settled = -1
        self.lock = threading.Lock()


class ThreadAdaptive:
    """Launches of one problem: ``arms[0]`` the tuned kernel (all threads), then alternatives
    (its one-thread twin; ATen). Starts on ``arms[0]``, learns every arm first (round robin),
    then stays on the fastest by recent median and re-times one other arm, in turn, every
    ``probe_every`` calls. Once every arm is learned only every ``sample_every``-th call is timed
    (the current arm's median then follows its last ``window * sample_every`` calls); the calls
    between go straight to the current launch.

    ``group`` (optional) shares some arms (``group.arms``, the same launch at the same index in
    every member) with other runners: their timings go into one record, one preferred launch
    among them is kept for the whole group, and a runner leaves it only for one of its private
    arms that is faster by ``margin``.

    A member that shares all its arms with the group (the bare and fused runners of one
    problem, whose arms are the same launches) takes the launch the group's members last settled
    on at every call: before, it moved only at its own next timed call, up to ``sample_every - 1``
    calls later, so after a switch driven by the bare runner's timings the fused runner kept
    running the old launch for several calls (a fused/bare ratio measured over a few interleaved
    calls then compared two different launches).

    ``home`` (optional, an arm index: the tuner's choice, e.g. ATen) is left only for an arm
    faster by ``margin`` but returned to as soon as its median is lower than the current arm's
    by ``home_margin``, so noise during learning cannot park the runner on a slower launch.
    ``home_probe_every`` (optional, with ``home``): while away from home, the home arm is timed
    every ``home_probe_every`` calls, and one such probe faster than the current arm's median by
    ``home_margin`` brings the runner back at once (the home arm's older samples, taken while the
    load lasted, are dropped); a launch that left home for a burst of load returns within a few
    calls of its end instead of after ``warmup`` probes ``probe_every`` calls apart. Each home
    probe that loses doubles the interval (up to ``probe_every``; reset by any switch): under
    lasting load a probe every 4 calls made half the calls slow (the probe, and the one-thread
    call after it, which shares its core with the idle worker thread still spinning).

    ``warm_switch`` (optional): a sampled call on another arm than the previous call ran is not
    timed but runs again on that arm on the next call, which is timed. The first call after a
    change of launch pays one-off costs (waking the idle OpenMP worker for the two-thread
    launch): measured at 11008×4096 NVFP4, the first two-thread call after six one-thread calls
    0.43 ms against 0.36 steady, the first one-thread call 0.68 against 0.65; timed as they came,
    every probe of the two-thread launch from the one-thread launch read ~20 % slow, about the
    switching margin.

    ``probe_bound`` (optional): a scheduled probe skips every arm whose fastest timing so far is
    not below the current arm's median less ``margin`` (an arm never runs faster than its best:
    such a probe could not win). On a quiet machine the one-thread twin of a streamed GEMV
    (1.7x slower) is then not run every ``probe_every`` calls; once load slows the current
    launch past that bound, probes resume."""

    # _record's shortcut for a sample of the current launch (same decisions; tests turn it off
    # to compare against the full pass)
    steady_check = True
    # timed calls in a row that packed and go unrecorded; from the next one on they count
    packing_calls_skipped = 4

    def __init__(
        self,
        *arms: Launch,
        window: int = 5,
        warmup: int = 3,
        probe_every: int = 64,
        margin: float = 0.2,
        events: Callable[[], int] | None = None,
        sample_every: int = 8,
        group: ArmGroup | None = None,
        home: int | None = None,
        home_margin: float = 0.02,
        home_probe_every: int | None = None,
        warm_switch: bool = False,
        probe_bound: bool = False,
    ) -> None:
        assert len(arms) >= 2 and window >= warmup >= 1 and probe_every >= 2
        assert sample_every >= 1 and probe_every % sample_every == 0
        assert 0.0 <= margin < 1.0
        assert group is None or max(group.arms) < len(arms)
        assert home is None or 0 <= home < len(arms)
        assert 0.0 <= home_margin <= margin
        assert home_probe_every is None or (
            home is not None and home_probe_every >= 2 and home_probe_every % sample_every == 0
        )
        self.launches = arms
        self._group = group
        shared = group.stats if group is not None else {}
        self.stats = [shared.get(i) or ArmStats(window) for i in range(len(arms))]
        self.current = group.current if group is not None else 0
        self.calls = 0
        self.switches = 0
        self._probes = 0
        self._warmup = warmup
        self._probe_every = probe_every
        self._margin = margin
        self._events = events
        self._sample_every = sample_every
        self._home = home
        self._home_margin = home_margin
        self._home_probe = home_probe_every or 0
        self._home_every = self._home_probe  # doubles after each home probe that loses
        self._learned = False  # every arm has its warmup samples
        self._warm_switch = warm_switch
        self._probe_bound = probe_bound
        self._last = self.current  # the arm the previous call ran
        self._packed = 0  # timed calls in a row during which ``events`` moved
        # warm_switch: the arm to run and time on the next call (-1: none). Public for callers
        # that run the current launch themselves between sampled calls (the settled GEMV route):
        # while it is set, the next call must come here.
        self.pending = -1
        # bookkeeping only (launches run concurrently); a group's members share its lock
        self._lock = group.lock if group is not None else threading.Lock()
        # the group, when this runner shares every arm with it (then it takes group.settled)
        self._follow = group if group is not None and len(group.arms) == len(arms) else None

    @property
    def history(self) -> list[deque[float]]:
        """Each arm's recent timings (shared arms: everyone's)."""
        return [s.hist for s in self.stats]

    def _pick(self) -> int:
        if not self._learned:  # (once learned, every arm keeps >= warmup samples)
            counts = [len(s.hist) for s in self.stats]
            if min(counts) < self._warmup:  # learn every arm first, round robin
                return min(range(len(counts)), key=lambda i: (counts[i], i))
        h = self._home
        if self._home_probe and self.current != h and self.calls % self._home_every == 0:
            return h  # type: ignore[return-value]
        if self.calls % self._probe_every:
            return self.current
        others = [i for i in range(len(self.launches)) if i != self.current]
        if self._probe_bound:  # only arms whose best could still beat the current median
            cut = self.stats[self.current].median * (1.0 - self._margin)
            others = [i for i in others if self.stats[i].best < cut]
            if not others:
                return self.current
        self._probes += 1
        return others[self._probes % len(others)]

    def __call__(self, *args: Any) -> Any:
        warm = False
        with self._lock:
            self.calls += 1
            if self._follow is not None and self._follow.settled >= 0:
                self.current = self._follow.settled
            if self.pending >= 0:  # warmed by the previous call: timed now
                arm, self.pending = self.pending, -1
            elif self._learned and self.calls % self._sample_every:
                # between samples: the current launch, untimed (a sampled call costs ~5-10 us
                # of clock reads, events and median bookkeeping; a probe call is always sampled)
                arm = -1
            else:
                arm = self._pick()
                if self._warm_switch and self._learned and arm != self._last:
                    self.pending, warm = arm, True  # first call after a change: untimed
            self._last = self.current if arm < 0 else arm
        if arm < 0:
            return self.launches[self.current](*args)
        if warm:
            return self.launches[arm](*args)
        events = self._events
        before = events() if events is not None else 0
        t0 = timing.clock()
        out = self.launches[arm](*args)
        dt = timing.clock() - t0
        packed = events is not None and events() != before
        with self._lock:
            if packed:
                # the call also did one-off work (packing): not a timing of the launch -- unless
                # it keeps happening (a weight made anew every call, as autocast's copy): then
                # packing is what each call of this launch costs, and without these timings
                # its arms never got a sample, so the runner never learned and stayed on them
                self._packed += 1
                if self._packed <= self.packing_calls_skipped:
                    return out
            else:
                self._packed = 0
            self._record(arm, dt)
            if self._follow is not None:
                self._follow.settled = self.current
        return out

    def seed(self, arm: int, seconds: float) -> None:
        """Record ``warmup`` samples of ``seconds`` for ``arm`` (e.g. times the tuner measured),
        so a caller with known timings starts learned instead of timing every arm first."""
        with self._lock:
            for _ in range(self._warmup):
                self._record(arm, seconds)
            if self._follow is not None:
                self._follow.settled = self.current

    def _record(self, arm: int, dt: float) -> None:
        cur = self.current
        if (
            self._home_probe
            and self._learned
            and arm == self._home
            and cur != arm
            and dt < self.stats[cur].median * (1.0 - self._home_margin)
        ):  # a home probe ahead of the current launch: back home, its stale samples dropped
            self.stats[arm].hist.clear()
            self.stats[arm].add(dt)
            self.current = arm
            self.switches += 1
            self._home_every = self._home_probe
            return
        if self._home_probe and self._learned and arm == self._home and cur != arm:
            # a home probe that lost: under lasting load each one is a slow call (and, through
            # the idle worker's spinning, so is the call after it), so probe half as often
            self._home_every = min(2 * self._home_every, self._probe_every)
        stats = self.stats
        stats[arm].add(dt)
        if arm == cur and self._learned and self._group is None and self.steady_check:
            # Only the current launch's median moved (the steady state: every call of a big
            # GEMV is timed): the choice below changes only if another launch is now ahead of
            # it by the margin, or the home launch is ahead at all. Checked directly, the same
            # outcome in a few operations; a decode call runs this with cold caches, where the
            # full pass cost ~20 µs (lists, min with a key).
            lead = stats[cur].median * (1.0 - self._margin)
            for i, s in enumerate(stats):
                if i != cur and s.median < lead:
                    break
            else:
                h = self._home
                if h is None or h == cur:
                    return
                if stats[h].median >= stats[cur].median * (1.0 - self._home_margin):
                    return
        if self._learned or min(len(s.hist) for s in self.stats) >= self._warmup:
            self._learned = True
            meds = [s.median for s in self.stats]
            keep = 1.0 - self._margin
            g = self._group
            if g is None:
                best = min(range(len(meds)), key=meds.__getitem__)
                if meds[best] >= meds[self.current] * keep:
                    best = self.current
            else:
                # the group's launch moves only by the margin, for every member at once
                top = min(g.arms, key=meds.__getitem__)
                if top != g.current and meds[top] < meds[g.current] * keep:
                    g.current = top
                own = [i for i in range(len(meds)) if i not in g.arms]
                if self.current in g.arms:  # follow the group unless a private arm beats it
                    best = g.current
                    if own:
                        mine = min(own, key=meds.__getitem__)
                        best = mine if meds[mine] < meds[g.current] * keep else g.current
                else:  # on a private arm: leave it only for something faster by the margin
                    best = min([*own, g.current], key=meds.__getitem__)
                    if meds[best] >= meds[self.current] * keep:
                        best = self.current
            h = self._home
            if h is not None and best != h and meds[h] < meds[best] * (1.0 - self._home_margin):
                # back to the home arm (the tuner's choice) as soon as it is ahead at all:
                # the margin guards leaving it, not returning (a runner that left ATen on a
                # noisy learning sample stayed on a 5 % slower native launch)
                best = h
            if best != self.current:
                self.current = best
                self.switches += 1
                self._home_every = self._home_probe


__all__ = ["ArmStats", "ThreadAdaptive"]
