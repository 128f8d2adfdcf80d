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
two-thread median 6.8 ms with packing vs 0.67 ms without).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from torchport.autotune import timing

Launch = Callable[..., Any]


class ThreadAdaptive:
    """Launches of one problem: ``arms[0]`` the tuned kernel (all threads), then alternatives
    (its one-thread twin; ATen). Starts on ``arms[0]``, learns every arm first (round robin),
    then stays on the fastest by recent median and re-times one other arm, in turn, every
    ``probe_every`` calls. Once every arm is learned only every ``sample_every``-th call is timed
    (the current arm's median then follows its last ``window * sample_every`` calls); the calls
    between go straight to the current launch."""

    def __init__(
        self,
        *arms: Launch,
        window: int = 5,
        warmup: int = 3,
        probe_every: int = 64,
        margin: float = 0.2,
        events: Callable[[], int] | None = None,
        sample_every: int = 8,
    ) -> None:
        assert len(arms) >= 2 and window >= warmup >= 1 and probe_every >= 2
        assert sample_every >= 1 and probe_every % sample_every == 0
        assert 0.0 <= margin < 1.0
        self.launches = arms
        self.history: list[deque[float]] = [deque(maxlen=window) for _ in arms]
        self._medians = [0.0] * len(arms)  # of each history, updated when it gains a sample
        self.current = 0
        self.calls = 0
        self.switches = 0
        self._probes = 0
        self._warmup = warmup
        self._probe_every = probe_every
        self._margin = margin
        self._events = events
        self._sample_every = sample_every
        self._learned = False  # every arm has its warmup samples
        self._lock = threading.Lock()  # bookkeeping only; launches run concurrently

    def _pick(self) -> int:
        counts = [len(h) for h in self.history]
        if min(counts) < self._warmup:  # learn every arm first, round robin
            return min(range(len(counts)), key=lambda i: (counts[i], i))
        if self.calls % self._probe_every:
            return self.current
        self._probes += 1
        others = [i for i in range(len(self.launches)) if i != self.current]
        return others[self._probes % len(others)]

    def __call__(self, *args: Any) -> Any:
        with self._lock:
            self.calls += 1
            if self._learned and self.calls % self._sample_every:
                # between samples: the current launch, untimed (a sampled call costs ~5-10 us
                # of clock reads, events and median bookkeeping; a probe call is always sampled)
                arm = -1
            else:
                arm = self._pick()
        if arm < 0:
            return self.launches[self.current](*args)
        events = self._events
        before = events() if events is not None else 0
        t0 = timing.clock()
        out = self.launches[arm](*args)
        dt = timing.clock() - t0
        if events is not None and events() != before:
            return out  # the call also did one-off work (packing): not a timing of the launch
        with self._lock:
            self._record(arm, dt)
        return out

    def seed(self, arm: int, seconds: float) -> None:
        """Record ``warmup`` samples of ``seconds`` for ``arm`` (e.g. times the tuner measured),
        so a caller with known timings starts learned instead of timing every arm first."""
        with self._lock:
            for _ in range(self._warmup):
                self._record(arm, seconds)

    def _record(self, arm: int, dt: float) -> None:
        hist = self.history[arm]
        hist.append(dt)
        srt = sorted(hist)  # median, only this arm's changed (statistics.median costs ~2 us)
        mid = len(srt) // 2
        self._medians[arm] = srt[mid] if len(srt) % 2 else 0.5 * (srt[mid - 1] + srt[mid])
        if self._learned or min(len(h) for h in self.history) >= self._warmup:
            self._learned = True
            meds = self._medians
            best = min(range(len(meds)), key=meds.__getitem__)
            if best != self.current and meds[best] < meds[self.current] * (1.0 - self._margin):
                self.current = best
                self.switches += 1


__all__ = ["ThreadAdaptive"]
