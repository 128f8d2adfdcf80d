"""The autotuner: anchor rules, invalid/crashing/wrong candidates, persistent concurrent cache."""

from __future__ import annotations

import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from torchport import autotune, config
from torchport.autotune import ATEN, Candidate, ChoiceCache, InvalidCandidate


def _sleepy(seconds: float):
    def f(x):
        t = time.perf_counter() + seconds
        while time.perf_counter() < t:
            pass
        return x * 2

    return f


CANDS = [
    Candidate("aten", ATEN),
    Candidate("fast", params=(("delay", 0.0),)),
    Candidate("slow", params=(("delay", 0.004),)),
    Candidate("invalid", params=(("delay", -1.0),)),
    Candidate("crashes", params=(("delay", -2.0),)),
    Candidate("wrong", params=(("delay", -3.0),)),
]


def factory(aten_delay: float, fast_delay: float = 0.0):
    def make(c: Candidate):
        if c.is_anchor:
            return _sleepy(aten_delay)
        d = c.param("delay")
        if d == -1.0:
            raise InvalidCandidate("tile does not fit")
        if d == -2.0:

            def boom(x):
                raise RuntimeError("segfault-like failure")

            return boom
        if d == -3.0:
            return lambda x: x * 3  # fast but wrong
        return _sleepy(fast_delay if d == 0.0 else d)

    return make


def _check(out, ref):
    return torch.equal(out, ref)


def _select(key, aten_delay, fast_delay=0.0, **kw):
    return autotune.select(
        "toy",
        key,
        CANDS,
        factory(aten_delay, fast_delay),
        lambda: (torch.ones(4),),
        cold=False,
        check=_check,
        **kw,
    )


def test_picks_fastest_correct_candidate(fresh_cache):
    with config.override(autotune_reps=5):
        ch = _select({"n": 1}, aten_delay=0.002)
    assert ch.candidate.name == "fast"
    assert "invalid" in ch.failures and ch.failures["invalid"].startswith("invalid")
    assert "RuntimeError" in ch.failures["crashes"]
    assert "does not match" in ch.failures["wrong"]
    assert set(ch.timings_s) == {"aten", "fast", "slow"}  # ATen always timed in the same run


def test_never_chooses_a_loser_to_aten(fresh_cache):
    with config.override(autotune_reps=5):
        ch = _select({"n": 2}, aten_delay=0.0005, fast_delay=0.0006)
    assert ch.candidate.name == "aten"
    assert ch.timings_s["fast"] > ch.timings_s["aten"]


def test_aten_only_backend_disables_native(fresh_cache):
    with config.override(max_autotune_gemm_backends="ATEN"):
        ch = _select({"n": 3}, aten_delay=0.01)
    assert ch.candidate.is_anchor and not ch.timings_s


def test_autotune_off_takes_first_valid_native(fresh_cache):
    with config.override(autotune=False):
        ch = _select({"n": 4}, aten_delay=0.01)
    assert ch.candidate.name == "fast"


def test_cache_persists_and_hits_fast(fresh_cache):
    with config.override(autotune_reps=3):
        first = _select({"n": 5}, aten_delay=0.002)
    autotune.choice_cache.clear_memory()
    again = _select({"n": 5}, aten_delay=0.0)  # would now pick aten if it re-tuned
    assert again.from_cache and again.candidate.name == first.candidate.name
    t0 = time.perf_counter()
    for _ in range(100):
        _select({"n": 5}, aten_delay=0.0)
    assert (time.perf_counter() - t0) / 100 < 1e-3


def test_requires_exactly_one_anchor():
    with pytest.raises(ValueError, match=r"exactly one ATen anchor candidate is required, got 0"):
        autotune.select("x", {}, [Candidate("a")], factory(0.0), lambda: (torch.ones(1),))


def test_corrupt_cache_file_is_ignored_and_rewritten(tmp_path):
    path = tmp_path / "choices.json"
    path.write_text("{ this is not json")
    cache = ChoiceCache(path)
    with pytest.warns(autotune.CorruptChoiceCacheWarning, match="ignoring corrupt"):
        assert cache.get("op", {"k": 1}) is None
    with pytest.warns(autotune.CorruptChoiceCacheWarning):
        cache.put("op", {"k": 1}, "fast", {"fast": 1.0})
    data = json.loads(path.read_text())
    assert data["format"] == "torchport-autotune-v1" and len(data["entries"]) == 1
    assert ChoiceCache(path).get("op", {"k": 1})["choice"] == "fast"


def test_foreign_format_is_ignored(tmp_path):
    path = tmp_path / "choices.json"
    path.write_text(json.dumps({"format": "other", "entries": {}}))
    with pytest.warns(autotune.CorruptChoiceCacheWarning):
        assert ChoiceCache(path).get("op", {}) is None


def _writer(args):
    path, worker = args
    cache = ChoiceCache(__import__("pathlib").Path(path))
    for i in range(20):
        cache.put("op", {"w": worker, "i": i}, f"c{worker}", {"t": float(i)})
    return worker


def test_concurrent_writers_lose_nothing(tmp_path):
    path = tmp_path / "choices.json"
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=4, mp_context=ctx) as ex:
        list(ex.map(_writer, [(str(path), w) for w in range(4)], timeout=120))
    cache = ChoiceCache(path)
    assert len(cache.entries()) == 80
    for w in range(4):
        for i in range(20):
            assert cache.get("op", {"w": w, "i": i})["choice"] == f"c{w}"


def test_cold_copies_exceed_budget():
    x = torch.zeros(1 << 18)  # 1 MiB
    sets = autotune.cold_copies((x,), budget=8 << 20)
    assert len(sets) == 8 and sets[0][0] is x
    assert sets[1][0].data_ptr() != x.data_ptr()
    assert len(autotune.cold_copies((x,), budget=0)) == 1
