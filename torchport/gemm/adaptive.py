"""Run-time choice between a kernel's all-threads and one-thread launches (small-M GEMMs).

On a machine shared with other busy processes, a short kernel split across two threads waits, at
its closing barrier, for whichever thread the scheduler descheduled: measured here, an M=1
1024→4096 GEMM took 1.2 ms on one thread and ~6–20 ms on two while one other process was busy,
against 0.6 ms on two threads when the machine was quiet. Which launch is faster changes with the
neighbours' load, after tuning is over, so :class:`ThreadAdaptive` keeps both and follows recent
timings: it uses the faster by the median of its last few calls, times the other again every
``probe_every`` calls (the cost of noticing that the load changed), and switches when the other
is faster by ``margin``. Timing uses :data:`torchport.autotune.timing.clock`.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from typing import Any

from torchport.autotune import timing

Launch = Callable[..., Any]


class ThreadAdaptive:
    """Two launches of one kernel (``launches[0]``: all threads, ``[1]``: one thread)."""

    def __init__(
        self,
        multi: Launch,
        single: Launch,
        *,
        window: int = 5,
        warmup: int = 3,
        probe_every: int = 64,
        margin: float = 0.2,
    ) -> None:
        assert window >= warmup >= 1 and probe_every >= 2 and 0.0 <= margin < 1.0
        self.launches = (multi, single)
        self.history: tuple[deque[float], deque[float]] = (
            deque(maxlen=window),
            deque(maxlen=window),
        )
        self.current = 0
        self.calls = 0
        self.switches = 0
        self._warmup = warmup
        self._probe_every = probe_every
        self._margin = margin

    def _pick(self) -> int:
        other = 1 - self.current
        if len(self.history[other]) < self._warmup:  # learn both first, alternating
            return (
                other
                if len(self.history[other]) < len(self.history[self.current])
                else (self.current)
            )
        return other if self.calls % self._probe_every == 0 else self.current

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        arm = self._pick()
        t0 = timing.clock()
        out = self.launches[arm](*args)
        self.history[arm].append(timing.clock() - t0)
        other = 1 - self.current
        if len(self.history[other]) >= self._warmup and len(self.history[self.current]) >= 1:
            mine = statistics.median(self.history[self.current])
            theirs = statistics.median(self.history[other])
            if theirs < mine * (1.0 - self._margin):
                self.current = other
                self.switches += 1
        return out


__all__ = ["ThreadAdaptive"]
