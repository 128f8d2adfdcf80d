"""GEMM findings of session 53."""

from __future__ import annotations

from torchport.autotune import timing
from torchport.gemm.adaptive import ThreadAdaptive


def test_a_runner_whose_native_launches_pack_at_every_call_still_learns(monkeypatch):
    """Every call that packed was left unrecorded, so for a weight packed anew at every call (a
    per-call copy, as autocast makes) the native arms never got a sample: the runner never
    finished learning and ran the first native launch at every call, packing included, though
    ATen (which packs nothing) was four times faster (fake clock)."""
    now = [0.0]
    monkeypatch.setattr(timing, "clock", lambda: now[0])
    misses = [0]
    used: list[str] = []

    def arm(name: str, cost: float, packs: bool):
        def run() -> None:
            if packs:
                misses[0] += 1
            now[0] += cost
            used.append(name)

        return run

    ad = ThreadAdaptive(
        arm("multi", 20e-3, True),
        arm("single", 24e-3, True),
        arm("aten", 5e-3, False),
        events=lambda: misses[0],
        sample_every=1,
    )
    for _ in range(40):
        ad()
    assert ad.current == 2
    assert used[-10:].count("aten") >= 9
    assert all(len(h) >= 3 for h in ad.history)


def test_a_few_packing_calls_in_a_row_are_still_left_out(monkeypatch):
    """The first calls of a new weight pack it once: those stay unrecorded."""
    now = [0.0]
    monkeypatch.setattr(timing, "clock", lambda: now[0])
    misses = [0]

    def arm(cost: float):
        def run() -> None:
            if misses[0] < ThreadAdaptive.packing_calls_skipped:
                misses[0] += 1
                now[0] += 1.0
            now[0] += cost

        return run

    ad = ThreadAdaptive(arm(1e-3), arm(2e-3), events=lambda: misses[0], sample_every=1)
    for _ in range(12):
        ad()
    assert max(max(h) for h in ad.history) < 0.5  # no packing call among the samples
    assert ad.current == 0
