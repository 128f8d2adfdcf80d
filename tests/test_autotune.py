"""The autotuner: anchor rules, invalid/crashing/wrong candidates, persistent concurrent cache."""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
import sys
import threading
import time
import warnings
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from torchport import autotune, config
from torchport.autotune import ATEN, Candidate, ChoiceCache, InvalidCandidate, tuner
from torchport.autotune import cache as cache_mod
from torchport.native import toolchain


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


def test_cold_callable_makes_the_rotated_sets(fresh_cache):
    """``cold`` as a callable: the search and the confirmation rotate the argument sets it
    makes from the made arguments (every timed call reads one of them)."""
    made: list[int] = []
    seen: set[int] = set()

    def sets(args):
        made.append(len(args))
        return [args] + [(args[0] + i,) for i in range(1, 4)]

    def make(c: Candidate):
        inner = factory(0.002)(c)

        def f(x):
            seen.add(int(x[0]))
            return inner(torch.ones(4))

        return f

    def select():
        with config.override(autotune_reps=5):
            return autotune.select(
                "toy",
                {"n": "cold-callable"},
                CANDS[:3],
                make,
                lambda: (torch.zeros(4),),
                cold=sets,
                check=_check,
                confirm=True,
            )

    assert select().candidate.name == "fast"
    assert made == [1, 1]  # the search's sets and the confirmation's, from the made arguments
    assert seen == {0, 1, 2, 3}  # the calls rotated its sets
    tuner._confirmed.clear()  # a cached choice is confirmed once per process: on its sets too
    again = select()
    assert again.from_cache and again.candidate.name == "fast" and made == [1, 1, 1]


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


def test_native_only_outcome_where_every_native_fails_is_a_cache_hit(fresh_cache):
    """With backends={NATIVE} and every native candidate failing, the ATen outcome was cached but
    never served (the anchor is not an eligible backend), so each new process tuned again; it
    is now a hit. An anchor cached for beating timed native candidates is still not served."""
    failing = [c for c in CANDS if c.is_anchor or c.name in ("invalid", "crashes")]
    calls: list[str] = []

    def make(c: Candidate):
        calls.append(c.name)
        return factory(0.0)(c)

    def pick(key, cands):
        return autotune.select(
            "toy", key, cands, make, lambda: (torch.ones(4),), cold=False, backends={"NATIVE"}
        )

    with config.override(autotune_reps=3):
        first = pick({"n": 30}, failing)
        assert first.candidate.is_anchor and not first.from_cache
        autotune.choice_cache.clear_memory()  # as a new process
        calls.clear()
        again = pick({"n": 30}, failing)
        assert again.candidate.is_anchor and again.from_cache and calls == []
        _select({"n": 31}, aten_delay=0.0, fast_delay=0.002)  # ATen allowed: the anchor wins
        assert not pick({"n": 31}, CANDS).from_cache  # native only: tuned again


def test_another_cache_dir_does_not_serve_the_first_ones_choices(fresh_cache, tmp_path):
    with config.override(autotune_reps=3):
        first = _select({"n": 7}, aten_delay=0.002)
    assert first.candidate.name == "fast" and _select({"n": 7}, aten_delay=0.002).from_cache
    with config.override(cache_dir=str(tmp_path / "other"), autotune_reps=3):
        other = _select({"n": 7}, aten_delay=0.0)  # an empty cache: tuned afresh
        assert not other.from_cache
    assert _select({"n": 7}, aten_delay=0.0).candidate.name == "fast"  # the first one's again


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


def test_cache_file_of_binary_garbage_is_ignored_and_rewritten(tmp_path):
    path = tmp_path / "choices.json"
    path.write_bytes(b"\xff\xfe\x00torn block\x80")  # not UTF-8: read_text() raised on it
    cache = ChoiceCache(path)
    with pytest.warns(autotune.CorruptChoiceCacheWarning, match="ignoring corrupt"):
        assert cache.get("op", {"k": 1}) is None
    with pytest.warns(autotune.CorruptChoiceCacheWarning):
        cache.put("op", {"k": 1}, "fast", {"fast": 1.0})
    assert ChoiceCache(path).get("op", {"k": 1})["choice"] == "fast"


@pytest.mark.parametrize(
    "entry",
    [
        {"choice": ["fast"]},
        {"choice": "fast", "timings_s": 3},
        {"choice": "fast", "timings_s": {"a": "x"}},
        # timings no measurement gives (JSON's NaN and Infinity, a negative, past float's range)
        # were served, and the choices they steered kept
        {"choice": "fast", "timings_s": {"fast": 1e-3, "aten": float("nan")}},
        {"choice": "fast", "timings_s": {"fast": 1e-3, "aten": float("inf")}},
        {"choice": "fast", "timings_s": {"fast": float("-inf"), "aten": 1e-3}},
        {"choice": "fast", "timings_s": {"fast": -1.0, "aten": 1e-3}},
        {"choice": "fast", "timings_s": {"fast": 1e-3, "aten": 10**400}},
    ],
    ids=["list-choice", "int-timings", "string-timing", "nan", "inf", "-inf", "negative", "huge"],
)
def test_malformed_entry_is_ignored_and_retuned(fresh_cache, entry):
    key = {"n": 5}
    path = autotune.choice_cache.path
    path.write_text(
        json.dumps(
            {
                "format": "torchport-autotune-v1",
                "entries": {
                    autotune.cache.entry_key("toy", key): entry,
                    "other": {"choice": "slow"},
                },
            }
        )
    )
    warns = pytest.warns(autotune.CorruptChoiceCacheWarning, match="ignoring 1 malformed entries")
    with warns, config.override(autotune_reps=3):
        choice = _select(key, aten_delay=0.002)
    assert not choice.from_cache and choice.candidate.name == "fast"
    assert autotune.choice_cache.entries()["other"]["choice"] == "slow"  # a sound entry stays


@pytest.mark.parametrize("t", [float("nan"), float("inf"), -1e-3, True, "1"])
def test_a_timing_no_measurement_gives_is_not_written(tmp_path, t):
    cache = ChoiceCache(tmp_path / "choices.json")
    with pytest.raises(ValueError, match=r"timings must be finite numbers of seconds >= 0, got"):
        cache.put("op", {"k": 1}, "fast", {"fast": 1e-3, "aten": t})
    assert not cache.path.exists() and cache.get("op", {"k": 1}) is None
    cache.put("op", {"k": 1}, "fast", {"fast": 0.0, "aten": 2})  # zero and ints are times
    assert ChoiceCache(cache.path).get("op", {"k": 1})["timings_s"] == {"fast": 0.0, "aten": 2}


def test_unwritable_cache_keeps_choices_in_memory(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")  # the same for a read-only or forbidden directory
    monkeypatch.setenv("TORCHPORT_CACHE_DIR", str(tmp_path / "file" / "cache"))
    autotune.choice_cache.clear_memory()
    try:
        with pytest.warns(autotune.ChoiceCacheWriteWarning), config.override(autotune_reps=3):
            first = _select({"n": 6}, aten_delay=0.002)
        assert first.candidate.name == "fast" and not first.from_cache
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", autotune.ChoiceCacheWriteWarning)
            again = _select({"n": 6}, aten_delay=0.002)
        assert again.candidate.name == "fast" and again.from_cache
    finally:
        autotune.choice_cache.clear_memory()


def _planted(path, choice: str = "evil") -> None:
    """A well-formed choice file naming ``choice`` for ("op", {"k": 1})."""
    entry = {"choice": choice, "timings_s": {choice: 1e-9}}
    body = {"format": cache_mod.FORMAT, "entries": {cache_mod.entry_key("op", {"k": 1}): entry}}
    path.write_text(json.dumps(body))


def test_choice_file_others_can_write_is_not_read(tmp_path, monkeypatch):
    # a choice file anyone could rewrite steered which candidate ran
    monkeypatch.setattr(toolchain, "_private_dirs", set())
    path = tmp_path / "choices.json"
    _planted(path)
    path.chmod(0o666)
    cache = ChoiceCache(path)
    with pytest.warns(autotune.UnsafeChoiceCacheWarning, match=r"the file must not be writable"):
        assert cache.get("op", {"k": 1}) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once
        assert cache.get("op", {"k": 1}) is None
        cache.put("op", {"k": 1}, "fast", {"fast": 1.0})  # replaced by a file of our own
    assert stat.S_IMODE(path.stat().st_mode) & 0o022 == 0
    assert ChoiceCache(path).get("op", {"k": 1})["choice"] == "fast"


def test_choice_file_of_another_user_is_not_read(tmp_path, monkeypatch):
    # the directory counts as checked: as another (non-root) user the directory check failed
    # first, so the test passed without the file's own check
    monkeypatch.setattr(toolchain, "_private_dirs", {str(tmp_path)})
    path = tmp_path / "choices.json"
    _planted(path)
    if os.geteuid() == 0:
        os.chown(path, 65534, 65534)
    else:  # the same as seen by another (non-root) user
        monkeypatch.setattr(os, "geteuid", lambda: 65534)
    with pytest.warns(autotune.UnsafeChoiceCacheWarning, match=r"the file must be owned by"):
        assert ChoiceCache(path).get("op", {"k": 1}) is None


def test_choice_cache_in_a_directory_not_made_yet_creates_it(tmp_path, monkeypatch):
    # the trust check of a missing directory failed ("cannot check ... No such file or
    # directory"): a warning on every put and the file never written
    monkeypatch.setattr(toolchain, "_private_dirs", set())
    path = tmp_path / "new" / "sub" / "choices.json"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ChoiceCache(path).get("op", {"k": 1}) is None  # nothing to read: no warning
        ChoiceCache(path).put("op", {"k": 1}, "fast", {"fast": 1.0})
    assert ChoiceCache(path).get("op", {"k": 1})["choice"] == "fast"
    for d in (path.parent, path.parent.parent):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700


def test_choice_cache_in_a_directory_others_can_write_stays_in_memory(tmp_path, monkeypatch):
    monkeypatch.setattr(toolchain, "_private_dirs", set())
    shared = tmp_path / "shared"
    shared.mkdir()
    _planted(shared / "choices.json")
    shared.chmod(0o777)  # not sticky: anyone may put their own file in place
    cache = ChoiceCache(shared / "choices.json")
    with pytest.warns(autotune.UnsafeChoiceCacheWarning, match=r"shared must not be writable"):
        assert cache.get("op", {"k": 1}) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cache.put("op", {"k": 1}, "fast", {"fast": 1.0})
        assert cache.get("op", {"k": 1})["choice"] == "fast"  # this process only
    assert json.loads((shared / "choices.json").read_text())["entries"] != {}  # not rewritten
    assert "fast" not in (shared / "choices.json").read_text()


def test_threads_with_their_own_cache_dir_get_their_own_choices(tmp_path):
    # the directory check ran before the cache's lock: with config.override(cache_dir=...) in
    # two threads, each was served the other directory's choice (98 of ~10^4 lookups in 1.5 s)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # thread switches inside get(), as a loaded machine makes them
    cache, wrong = ChoiceCache(), []
    for name in ("a", "b"):
        with config.override(cache_dir=str(tmp_path / name)):
            _planted(config.cache_path("autotune") / "choices-v1.json", name)

    def lookups(name: str) -> None:
        with config.override(cache_dir=str(tmp_path / name)):
            end = time.monotonic() + 0.6
            while time.monotonic() < end:
                hit = cache.get("op", {"k": 1})
                if hit is None or hit["choice"] != name:
                    wrong.append((name, hit))

    try:
        threads = [threading.Thread(target=lookups, args=(n,), daemon=True) for n in "ab"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads)
    assert wrong == []


def test_cache_file_nested_too_deep_is_ignored(tmp_path):
    path = tmp_path / "choices.json"
    path.write_text("[" * 100_000)  # the parser's recursion limit: RecursionError escaped
    with pytest.warns(autotune.CorruptChoiceCacheWarning, match="ignoring corrupt"):
        assert ChoiceCache(path).get("op", {"k": 1}) is None


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


def test_cold_bytes_from_the_reported_caches(tmp_path):
    """The largest cache sysfs reports (units K/M/G or bytes; unreadable, non-UTF-8 or malformed
    entries skipped) sets the rotation: twice it, within the floor and the ceiling; none
    reported: L3_BYTES."""
    from torchport.autotune.timing import last_level_cache_bytes

    for i, size in enumerate(["48K", "2048K", "491520K", "garbage", "1M", "\u00b2K", "12.5M"]):
        (tmp_path / f"index{i}").mkdir()
        (tmp_path / f"index{i}" / "size").write_text(size + "\n")
    (tmp_path / "index8").mkdir()
    (tmp_path / "index8" / "size").write_bytes(b"\xff\xfeK")  # not UTF-8
    (tmp_path / "index9").mkdir()  # no size file
    assert last_level_cache_bytes(str(tmp_path)) == 491520 << 10
    assert last_level_cache_bytes(str(tmp_path / "missing")) == autotune.L3_BYTES
    assert autotune.cold_bytes() == autotune.cold_bytes(cache_bytes=last_level_cache_bytes())
    assert autotune.cold_bytes(cache_bytes=480 << 20) == 960 << 20
    assert autotune.cold_bytes(cache_bytes=32 << 20) == 96 << 20  # the floor
    assert autotune.cold_bytes(floor=1 << 40, ceiling=1 << 41) == 1 << 40
    assert autotune.cold_bytes(floor=1 << 40) == 2 << 30  # the ceiling wins


# --- noise guard: confirmation of native winners, with injected timings --------------------------


class FakeClock:
    """A clock that only moves when a fake candidate 'runs' (exact, load-free timings)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _costed(clock: FakeClock, costs, calls: list | None = None, name: str = ""):
    """A candidate whose i-th call takes costs(i) fake seconds."""
    state = {"i": 0}

    def f(x):
        clock.t += costs(state["i"])
        state["i"] += 1
        if calls is not None:
            calls.append(name)
        return x * 2

    return f


def _fake_factory(clock: FakeClock, aten_costs, native_costs, calls: list | None = None):
    fns = {}

    def make(c: Candidate):
        if c.name not in fns:  # one callable per candidate, so call counts span phases
            costs = aten_costs if c.is_anchor else native_costs
            fns[c.name] = _costed(clock, costs, calls, c.name)
        return fns[c.name]

    return make


PAIR = [Candidate("aten", ATEN), Candidate("native")]


@pytest.fixture
def fake_clock(monkeypatch):
    from torchport.autotune import timing

    clock = FakeClock()
    monkeypatch.setattr(timing, "clock", clock)
    return clock


def _select_pair(key, make, **kw):
    return autotune.select(
        "toy.pair", key, PAIR, make, lambda: (torch.ones(4),), cold=False, check=_check, **kw
    )


def test_beats_anchor_margin():
    with config.override(autotune_noise=0.03):
        assert autotune.beats_anchor(0.96, 1.0)
        assert not autotune.beats_anchor(0.98, 1.0)
        assert not autotune.beats_anchor(1.0, 1.0)
    assert autotune.beats_anchor(0.98, 1.0, noise=0.0)


def test_interleaved_alternates_and_takes_medians(fake_clock):
    calls: list = []
    fa = _costed(fake_clock, lambda i: [1e-3, 9e-3, 1e-3, 1e-3, 1e-3, 1e-3][i], calls, "a")
    fb = _costed(fake_clock, lambda i: 2e-3, calls, "b")
    ta, tb = autotune.interleaved([fa, fb], [(torch.ones(1),)], reps=5, warmup=1)
    # one warm-up round, then five rounds, the order reversed every round
    assert calls == ["a", "b"] + ["a", "b", "b", "a"] * 2 + ["a", "b"]
    # the one slow sample (9 ms) does not move the median
    assert (ta, tb) == pytest.approx((1e-3, 2e-3))


def test_interleaved_rotates_every_function_through_every_set():
    """Each function steps through all the sets, the functions a third of the rotation apart:
    between two reads of one set come at least n - k other calls (n = 6 sets, k = 3 functions;
    the reversed order moves a call by up to k - 1 places), and every function reads every set
    (with one set per round, the round's later calls read it warm)."""
    seen: list[tuple[str, int]] = []
    fns = [lambda s, name=name: seen.append((name, s)) for name in "abc"]
    autotune.interleaved(fns, [(i,) for i in range(6)], reps=12, warmup=1, min_rounds=12)
    assert [n for n, _ in seen] == list("abc") + list("abc" + "cba") * 6
    for name in "abc":
        assert sorted({s for n, s in seen if n == name}) == list(range(6))
    last: dict[int, int] = {}
    for i, (_, s) in enumerate(seen):
        assert i - last.get(s, -6) > 6 - 3, (i, s)
        last[s] = i


def test_alternated_min_drops_loaded_groups_and_flips_order(fake_clock):
    """Groups of calls, the order reversed every round; load bursts stretch most of "a"'s
    groups (its median would move), but the least group is the unloaded call."""
    calls: list = []
    # a: 10 us a call, but every call of its first 20 groups of 4 (80 calls) is 3x as long
    fa = _costed(fake_clock, lambda i: 30e-6 if 1 <= i <= 80 else 10e-6, calls, "a")
    fb = _costed(fake_clock, lambda i: 12e-6, calls, "b")
    ta, tb = autotune.alternated_min([fa, fb], (torch.ones(1),), rounds=25, group=4)
    assert (ta, tb) == pytest.approx((10e-6, 12e-6))
    assert calls[:2] == ["a", "b"]  # warm-up
    rounds = [calls[2 + 8 * r : 2 + 8 * (r + 1)] for r in range(25)]
    assert rounds[0] == ["a"] * 4 + ["b"] * 4 and rounds[1] == ["b"] * 4 + ["a"] * 4
    assert all(r == rounds[i % 2] for i, r in enumerate(rounds))
    assert len(calls) == 2 + 25 * 8


def test_alternated_min_stops_at_its_time_cap(fake_clock):
    fa = _costed(fake_clock, lambda i: 0.1)
    fb = _costed(fake_clock, lambda i: 0.2)
    ta, tb = autotune.alternated_min(
        [fa, fb], (torch.ones(1),), rounds=100, group=2, max_time_s=1.0
    )
    assert (ta, tb) == pytest.approx((0.1, 0.2))
    # each round takes 0.6 s: past 1 s after min_rounds (3) rounds it stops
    assert fake_clock.t == pytest.approx(0.3 + 3 * 0.6)


def test_noisy_search_win_is_rejected_by_confirmation(fresh_cache, fake_clock):
    """The case seen in the field: ATen's samples were inflated by a load burst during the
    one-after-the-other search (20 ms), so a native kernel at 12 ms 'won'; timed alternately,
    ATen is 1.6 ms and the native kernel is rejected, in memory and on disk."""
    search_calls = 2 + 5  # check call (the warm-up), the settling call, five timed repetitions
    make = _fake_factory(
        fake_clock, lambda i: 0.020 if i < search_calls else 0.0016, lambda i: 0.012
    )
    before = autotune.stats.rejected
    with config.override(autotune_reps=5, autotune_noise=0.03):
        ch = _select_pair({"case": "burst"}, make, confirm=True)
    assert ch.timings_s["aten"] == pytest.approx(0.020)  # the search was fooled ...
    assert ch.timings_s["native"] == pytest.approx(0.012)
    assert ch.timings_s["confirm:aten"] == pytest.approx(0.0016)  # ... the confirmation not
    assert ch.candidate.name == "aten"
    assert autotune.stats.rejected == before + 1
    assert autotune.choice_cache.get("toy.pair", {"case": "burst"})["choice"] == "aten"


def test_same_search_without_confirmation_would_pick_native(fresh_cache, fake_clock):
    search_calls = 2 + 5
    make = _fake_factory(
        fake_clock, lambda i: 0.020 if i < search_calls else 0.0016, lambda i: 0.012
    )
    with config.override(autotune_reps=5):
        ch = _select_pair({"case": "burst"}, make, confirm=False)
    assert ch.candidate.name == "native"  # what the guard exists for


def test_real_native_win_survives_confirmation(fresh_cache, fake_clock):
    make = _fake_factory(fake_clock, lambda i: 0.002, lambda i: 0.001)
    with config.override(autotune_reps=5):
        ch = _select_pair({"case": "real"}, make, confirm=True)
    assert ch.candidate.name == "native"
    assert ch.timings_s["confirm:native"] == pytest.approx(0.001)
    assert ch.timings_s["confirm:aten"] == pytest.approx(0.002)


def test_win_within_noise_margin_is_not_kept(fresh_cache, fake_clock):
    make = _fake_factory(fake_clock, lambda i: 0.0100, lambda i: 0.0099)  # 1 % faster
    with config.override(autotune_reps=5, autotune_noise=0.03):
        assert _select_pair({"case": "margin"}, make, confirm=True).candidate.name == "aten"


def test_saved_native_choice_is_revalidated_once_per_process(fresh_cache, fake_clock):
    """A choice saved by another (loaded) process is confirmed before its first use here; a
    wrong one is replaced by ATen on disk, a right one is timed only once per process."""
    autotune.choice_cache.put("toy.pair", {"case": "saved-bad"}, "native", {"aten": 0.02})
    calls: list = []
    make = _fake_factory(fake_clock, lambda i: 0.0016, lambda i: 0.012, calls)
    with config.override(autotune_reps=5):
        ch = _select_pair({"case": "saved-bad"}, make, confirm=True)
        assert ch.candidate.name == "aten" and calls  # timed, rejected
        assert autotune.choice_cache.get("toy.pair", {"case": "saved-bad"})["choice"] == "aten"

        autotune.choice_cache.put("toy.pair", {"case": "saved-good"}, "native", {"aten": 0.02})
        calls.clear()
        make = _fake_factory(fake_clock, lambda i: 0.002, lambda i: 0.001, calls)
        first = _select_pair({"case": "saved-good"}, make, confirm=True)
        assert first.candidate.name == "native" and first.from_cache
        n_timed = len(calls)
        assert n_timed >= 10  # warm-up plus at least five alternating rounds
        again = _select_pair({"case": "saved-good"}, make, confirm=True)
        assert again.candidate.name == "native" and len(calls) == n_timed  # not timed again


def test_saved_native_choice_of_long_calls_is_revalidated_in_two_rounds(fresh_cache, fake_clock):
    """A saved native choice whose anchor took longer than LONG_CALL_S is confirmed in two
    alternating rounds after the warm-up (one process's first call of such a shape spent five
    rounds, about 1 s at 85 ms calls); a choice that loses them goes back to ATen."""
    for case, native_s in (("long-good", 0.2), ("long-bad", 0.5)):
        autotune.choice_cache.put("toy.pair", {"case": case}, "native", {"aten": 0.4})
        calls: list = []
        make = _fake_factory(fake_clock, lambda i: 0.4, lambda i, s=native_s: s, calls)
        with config.override(autotune_reps=5):
            ch = _select_pair({"case": case}, make, confirm=True)
        assert calls.count("aten") == 1 + 2 and calls.count("native") == 1 + 2
        assert ch.candidate.name == ("native" if native_s < 0.4 else "aten")


def test_saved_native_choice_that_now_fails_is_not_used(fresh_cache, fake_clock):
    autotune.choice_cache.put("toy.pair", {"case": "saved-broken"}, "native", {"aten": 0.02})

    def make(c: Candidate):
        if c.is_anchor:
            return _costed(fake_clock, lambda i: 0.001)

        def boom(x):
            raise RuntimeError("kernel library went away")

        return boom

    ch = _select_pair({"case": "saved-broken"}, make, confirm=True)
    assert ch.candidate.name == "aten"


def test_budget_caps_the_search_time(fresh_cache, fake_clock):
    """Each candidate gets an equal share of budget_s (at least three timed calls), so a slow
    machine gives fewer samples instead of a longer search."""
    calls: list = []
    make = _fake_factory(fake_clock, lambda i: 0.05, lambda i: 0.02, calls)
    with config.override(autotune_reps=100):
        ch = _select_pair({"case": "budget"}, make, budget_s=0.3)
    # per candidate: one checked call (the warm-up), one settling call (no page faults here),
    # then timed calls until its 0.15 s share, which includes the settling call
    assert calls.count("aten") == 2 + 3  # 0.05 s each: the three-call minimum
    assert calls.count("native") == 2 + 7  # 0.02 s each: 7 calls reach 0.14 s >= 0.15 - 0.02
    assert ch.candidate.name == "native"


def test_budget_times_calls_over_long_call_s_once(fresh_cache, fake_clock):
    """Calls longer than LONG_CALL_S are timed once even when the budget share would allow
    more (cold tuning of ~0.1 s GEMMs): the settling call after the checked one is that timed
    call; a 1.5x winner skips the confirmation."""
    from torchport.autotune import tuner

    calls: list = []
    t_long = 3 * tuner.LONG_CALL_S  # both calls over the threshold
    make = _fake_factory(fake_clock, lambda i: t_long, lambda i: t_long / 2, calls)
    with config.override(autotune_reps=100):
        ch = _select_pair({"case": "over-long"}, make, budget_s=100.0, confirm=True)
    assert calls.count("aten") == 2 and calls.count("native") == 2
    assert ch.candidate.name == "native"


def test_budget_times_long_calls_once(fresh_cache, fake_clock):
    """A candidate whose single call outlasts its share of budget_s is timed once, on the call
    after the checked one, and a winner by more than 1.5x over such an anchor is kept without
    the alternating confirmation (a burst of load does not make calls this long 1.5x apart)."""
    calls: list = []
    make = _fake_factory(fake_clock, lambda i: 0.4, lambda i: 0.2, calls)
    with config.override(autotune_reps=100):
        ch = _select_pair({"case": "long"}, make, budget_s=0.3, confirm=True)
    assert calls.count("aten") == 2 and calls.count("native") == 2
    assert ch.candidate.name == "native"
    calls.clear()
    close = _fake_factory(fake_clock, lambda i: 0.4, lambda i: 0.3, calls)
    with config.override(autotune_reps=100):
        ch = _select_pair({"case": "long-close"}, close, budget_s=0.3, confirm=True)
    # 1.33x: confirmed in alternation, one round (the search spent the budget) after the
    # candidate's own warm-up call (the anchor has none)
    assert calls.count("aten") == 2 + 1 and calls.count("native") == 2 + 1 + 1
    assert ch.candidate.name == "native"


def test_long_anchor_is_not_timed_again_for_a_clear_winner(fresh_cache, fake_clock):
    """Under a budget, a long anchor call (ATen's bf16 addmm without AVX512-BF16: ~220 ms
    against the kernels' ~25 ms) is timed after the other candidates: by one call after its
    checked one (the faster of the two) when the fastest of them is ANCHOR_CLEAR_WIN times
    faster than the checked call, with the usual settling and timed calls otherwise."""
    calls: list = []
    t_long = 2 * tuner.LONG_CALL_S
    clear = t_long / (tuner.ANCHOR_CLEAR_WIN + 1)
    make = _fake_factory(fake_clock, lambda i: t_long, lambda i: clear, calls)
    with config.override(autotune_reps=5):
        ch = _select_pair({"case": "clear"}, make, budget_s=100.0, confirm=True)
    assert calls.count("aten") == 2 and calls[0] == "aten" and calls[-1] == "aten"
    assert ch.candidate.name == "native"
    assert ch.timings_s["aten"] == ch.timings_s["first:aten"] == pytest.approx(t_long)
    # a checked call inflated by one-time work: the next call is the anchor's time, and the
    # kernel, 4x faster than the checked call but 2x slower than that one, is not chosen
    calls.clear()
    make = _fake_factory(
        fake_clock, lambda i: t_long if i == 0 else clear / 2, lambda i: clear, calls
    )
    with config.override(autotune_reps=5):
        ch = _select_pair({"case": "inflated"}, make, budget_s=100.0, confirm=True)
    assert ch.timings_s["aten"] == pytest.approx(clear / 2)
    assert ch.timings_s["first:aten"] == pytest.approx(t_long)
    assert ch.candidate.name == "aten"
    # the checked call was slow by one-time work, within 3x: the anchor is timed, and wins
    calls.clear()
    make = _fake_factory(
        fake_clock, lambda i: t_long if i == 0 else clear / 2, lambda i: t_long / 2, calls
    )
    with config.override(autotune_reps=5):
        ch = _select_pair({"case": "not-clear"}, make, budget_s=100.0, confirm=True)
    assert calls.count("aten") > 1 and calls[-1] == "aten"  # timed after the candidate
    assert "first:aten" not in ch.timings_s
    assert ch.candidate.name == "aten"
    # without a budget the anchor is timed first as before
    calls.clear()
    make = _fake_factory(fake_clock, lambda i: t_long, lambda i: clear, calls)
    with config.override(autotune_reps=5):
        ch = _select_pair({"case": "no-budget"}, make)
    assert calls[:3] == ["aten"] * 3 and ch.candidate.name == "native"


def test_long_anchor_alone_is_not_timed_when_every_candidate_failed(fresh_cache, fake_clock):
    calls: list = []
    t_long = 2 * tuner.LONG_CALL_S

    def make(c: Candidate):
        if c.is_anchor:
            return _costed(fake_clock, lambda i: t_long, calls, "aten")

        def boom(x):
            raise RuntimeError("no kernel")

        return boom

    ch = _select_pair({"case": "alone"}, make, budget_s=100.0, confirm=True)
    assert ch.candidate.name == "aten" and calls == ["aten"]
    assert "native" in ch.failures


def _select_long(case: str, make, budget_s: float = 0.3):
    """A confirmed toy tuning under a budget (long calls), 3 % noise margin."""
    with config.override(autotune_reps=100, autotune_noise=0.03):
        return _select_pair({"case": case}, make, budget_s=budget_s, confirm=True)


def test_long_calls_burst_on_the_candidates_confirmation_keeps_it(fresh_cache, fake_clock):
    """Long calls (timed once in the search, one alternating round to confirm): a burst of load
    on the native kernel's confirmation calls no longer rejects a kernel whose fastest call, in
    the search, beat the anchor's fastest (the case seen with bf16 M=2048 768->3072)."""
    calls: list = []
    # ATen 0.4 s a call; native 0.3 s, but 0.5 s through its confirmation (calls 2 and up)
    make = _fake_factory(fake_clock, lambda i: 0.4, lambda i: 0.3 if i < 2 else 0.5, calls)
    ch = _select_long("long-burst", make)
    assert ch.timings_s["confirm:native"] == pytest.approx(0.5)  # the confirmation was hit ...
    assert ch.timings_s["confirm:aten"] == pytest.approx(0.4)
    assert calls.count("native") == 2 + 1 + 1  # ... in its one round, after its warm-up
    assert ch.candidate.name == "native"
    assert autotune.choice_cache.get("toy.pair", {"case": "long-burst"})["choice"] == "native"


def test_long_calls_burst_on_the_anchors_search_is_still_rejected(fresh_cache, fake_clock):
    """The guard's own case at long calls: ATen's search call was slowed (0.44 s, so a 0.3 s
    kernel looked 1.47x faster, just short of the 1.5x that skips the confirmation: at exactly
    1.5x the fake clock's rounding decided it); ATen's confirmation shows 0.28 s and the kernel
    is rejected."""
    make = _fake_factory(fake_clock, lambda i: 0.44 if i < 2 else 0.28, lambda i: 0.3)
    ch = _select_long("long-anchor-burst", make)
    assert ch.timings_s["aten"] == pytest.approx(0.44)
    assert ch.timings_s["confirm:aten"] == pytest.approx(0.28)
    assert ch.candidate.name == "aten"


def test_long_calls_confirm_in_what_the_search_left_of_the_budget(fresh_cache, fake_clock):
    """The confirmation of long calls runs alternating rounds only while the search left some
    of budget_s (one round at least), with a warm-up call of the candidate alone: 0.1 s calls,
    a budget of 1.2 s, a search of two calls each (0.2 + 0.18 s) leaves 0.82 s, so rounds of
    0.19 s until past it: five."""
    calls: list = []
    make = _fake_factory(fake_clock, lambda i: 0.1, lambda i: 0.09, calls)
    ch = _select_long("long-left", make, budget_s=1.2)
    assert ch.candidate.name == "native"
    assert calls.count("aten") == 2 + 5 and calls.count("native") == 2 + 1 + 5


def test_narrow_search_loss_is_confirmed_in_alternation(fresh_cache, fake_clock):
    """Short calls too: the search timed ATen during a lull (1.00 ms against its 1.20) and a
    1.02 ms kernel lost by less than the noise margin; within NARROW_RECHECK it meets ATen in
    the alternating confirmation and is kept. Without confirmation the search decides."""
    search = 2 + 5  # the checked call, the settling call, five timed calls
    make = _fake_factory(fake_clock, lambda i: 1.0e-3 if i < search else 1.2e-3, lambda i: 1.02e-3)
    with config.override(autotune_reps=5, autotune_noise=0.03):
        ch = _select_pair({"case": "narrow"}, make, confirm=True)
    assert ch.timings_s["aten"] == pytest.approx(1.0e-3)
    assert ch.timings_s["confirm:aten"] == pytest.approx(1.2e-3)
    assert ch.candidate.name == "native"
    make = _fake_factory(fake_clock, lambda i: 1.0e-3 if i < search else 1.2e-3, lambda i: 1.02e-3)
    with config.override(autotune_reps=5, autotune_noise=0.03):
        ch = _select_pair({"case": "narrow-unconfirmed"}, make)
    assert ch.candidate.name == "aten"


def test_long_call_settled_on_a_faulting_call_gets_one_more(fresh_cache, fake_clock, monkeypatch):
    """A long call's settling call is its one timed call only when it was quiet; a settling
    that ran out of its share on a faulting call (here native's, 0.6 s) is followed by one more
    call and the faster of the two is the sample."""
    from torchport.autotune import timing

    calls: list = []

    def settle(fn, arg_sets, max_time_s):
        t0 = timing.clock()
        fn(*arg_sets[-1])
        return timing.Settled(1, timing.clock() - t0, quiet=calls[-1] != "native")

    monkeypatch.setattr(timing, "settle_faults", settle)
    make = _fake_factory(fake_clock, lambda i: 0.4, lambda i: 0.6 if i == 1 else 0.3, calls)
    with config.override(autotune_reps=100, autotune_noise=0.03):
        ch = _select_pair({"case": "long-faulting"}, make, budget_s=0.3)
    assert calls.count("aten") == 2 and calls.count("native") == 3
    assert ch.timings_s["native"] == pytest.approx(0.3) and ch.candidate.name == "native"


def test_long_calls_narrow_loss_to_a_lucky_anchor_call_is_confirmed(fresh_cache, fake_clock):
    """One timed call each decides a long-call search: the anchor's lucky call (0.39 s, where it
    takes 0.44) beat a kernel of 0.40 s by less than the noise margin; a native candidate within
    NARROW_RECHECK of the anchor meets it in the alternating confirmation and is kept. A
    kernel that is as slow in the confirmation stays behind the anchor."""
    make = _fake_factory(fake_clock, lambda i: 0.39 if i < 2 else 0.44, lambda i: 0.40)
    ch = _select_long("long-lucky-anchor", make)
    assert ch.timings_s["aten"] == pytest.approx(0.39)
    assert ch.timings_s["confirm:aten"] == pytest.approx(0.44)
    assert ch.candidate.name == "native"
    make = _fake_factory(fake_clock, lambda i: 0.39, lambda i: 0.40)
    ch = _select_long("long-slower", make)
    assert "confirm:native" in ch.timings_s and ch.candidate.name == "aten"
    calls: list = []
    far = _fake_factory(fake_clock, lambda i: 0.39, lambda i: 0.45, calls)  # beyond 1.10x
    ch = _select_long("long-far", far)
    assert ch.candidate.name == "aten" and calls.count("native") == 2  # no confirmation
    # only a confirmed tuning promotes a narrow loser; the search alone keeps the anchor
    near = _fake_factory(fake_clock, lambda i: 0.39, lambda i: 0.36 if i > 1 else 0.40)
    with config.override(autotune_reps=100, autotune_noise=0.03):
        ch = _select_pair({"case": "long-unconfirmed"}, near, budget_s=0.3)
    assert ch.candidate.name == "aten" and "confirm:native" not in ch.timings_s


# --- final round: the fastest candidates of the search meet in one interleaved round ----------

TRIO = [Candidate("aten", ATEN), Candidate("a"), Candidate("b")]


def _trio_factory(clock: FakeClock, costs: dict, calls: list | None = None):
    """One callable per candidate (call counts span the search and the round); ``costs[name](i)``
    is the fake duration of its i-th call."""
    fns: dict = {}

    def make(c: Candidate):
        if c.name not in fns:
            fns[c.name] = _costed(clock, costs[c.name], calls, c.name)
        return fns[c.name]

    return make


def _select_trio(key, make, cands=TRIO, **kw):
    with config.override(autotune_reps=5, autotune_noise=0.03):
        return autotune.select(
            "toy.trio", key, cands, make, lambda: (torch.ones(4),), cold=False, check=_check, **kw
        )


SEARCH_CALLS = 2 + 5  # per candidate: the checked call (the warm-up), the settling call (see
# timing.settle_faults), five timed repetitions

# "b" is slow only during the search (its first calls), so the search ranks it behind "a"
LIED = {
    "aten": lambda i: 5e-3,
    "a": lambda i: 1.0e-3,
    "b": lambda i: 1.2e-3 if i < SEARCH_CALLS else 0.8e-3,
}


def test_without_final_round_the_lying_search_decides(fresh_cache, fake_clock):
    ch = _select_trio({"case": "lied"}, _trio_factory(fake_clock, LIED))
    assert ch.candidate.name == "a" and not any(k.startswith("final:") for k in ch.timings_s)


def test_final_round_picks_the_interleaved_winner_and_caches_it(fresh_cache, fake_clock):
    calls: list = []
    key = {"case": "lied"}
    ch = _select_trio(key, _trio_factory(fake_clock, LIED, calls), final_round=2)
    assert ch.candidate.name == "b"
    assert ch.timings_s["a"] == pytest.approx(1.0e-3)  # the search's medians are kept ...
    assert ch.timings_s["b"] == pytest.approx(1.2e-3)
    assert ch.timings_s["final:a"] == pytest.approx(1.0e-3)  # ... beside the round's
    assert ch.timings_s["final:b"] == pytest.approx(0.8e-3)
    # the round alternates the two (the anchor is not in it), after one warm-up round, the
    # order reversed every round
    round_calls = calls[3 * SEARCH_CALLS :]
    assert "aten" not in round_calls and len(round_calls) >= 2 * (1 + tuner.FINAL_ROUND_MIN)
    rounds = [round_calls[i : i + 2] for i in range(2, len(round_calls), 2)]
    assert round_calls[:2] == ["a", "b"] and len(round_calls) % 2 == 0
    assert rounds == [["a", "b"] if r % 2 == 0 else ["b", "a"] for r in range(len(rounds))]
    assert autotune.choice_cache.get("toy.trio", key)["choice"] == "b"
    calls.clear()
    again = _select_trio(key, _trio_factory(fake_clock, LIED, calls), final_round=2)
    assert again.from_cache and again.candidate.name == "b" and calls == []


def test_final_round_confirms_its_winner_against_the_anchor(fresh_cache, fake_clock):
    calls: list = []
    ch = _select_trio(
        {"case": "lied-confirm"},
        _trio_factory(fake_clock, LIED, calls),
        final_round=2,
        confirm=True,
    )
    assert (
        ch.candidate.name == "b" and "confirm:b" in ch.timings_s and "confirm:a" not in ch.timings_s
    )


def test_final_round_respects_its_time_bound(fresh_cache, fake_clock):
    """The round stops past its bound once FINAL_ROUND_MIN rounds are timed; a bound too short
    for those rounds (with the warm-up round) skips the round, keeping the search's choice."""
    costs = {"aten": lambda i: 0.05, "a": lambda i: 0.010, "b": lambda i: 0.012}
    search_s = SEARCH_CALLS * (0.05 + 0.010 + 0.012)
    ch = _select_trio({"case": "bound"}, _trio_factory(fake_clock, costs), final_round=2)
    assert "final:b" in ch.timings_s
    assert fake_clock.t - search_s <= tuner.FINAL_ROUND_S + 1e-9
    for bound in (0.3, 1.0):
        fake_clock.t = 0.0
        ch = _select_trio(
            {"case": "bound", "s": bound},
            _trio_factory(fake_clock, costs),
            final_round=2,
            final_round_s=bound,
        )
        assert fake_clock.t - search_s <= bound + 1e-9
        assert fake_clock.t - search_s >= bound - 0.022 - 1e-9  # it used the time it had
    fake_clock.t = 0.0
    short = 0.022 * (1 + tuner.FINAL_ROUND_MIN + 1) - 1e-3  # not enough for the minimum
    ch = _select_trio(
        {"case": "short"}, _trio_factory(fake_clock, costs), final_round=2, final_round_s=short
    )
    assert ch.candidate.name == "a" and not any(k.startswith("final:") for k in ch.timings_s)
    assert fake_clock.t == pytest.approx(search_s)


def _failing_after(clock: FakeClock, cost: float, n: int):
    """A candidate of ``cost`` fake seconds per call whose calls raise from the ``n``-th on."""
    state = {"i": 0}

    def f(x):
        state["i"] += 1
        if state["i"] > n:
            raise RuntimeError("kernel fault")
        clock.t += cost
        return x * 2

    return f


def test_final_round_never_keeps_a_winner_that_fails_in_it(fresh_cache, fake_clock):
    """The search's winner raising in the final round is never chosen nor saved: the anchor is
    (before, the round was dropped and the failing winner saved); a runner-up raising there
    leaves the search's winner. Either way the failure is recorded."""
    fns = {
        "aten": _costed(fake_clock, lambda i: 5e-3),
        "a": _failing_after(fake_clock, 1.0e-3, SEARCH_CALLS),
        "b": _costed(fake_clock, lambda i: 1.2e-3),
    }
    for confirm in (False, True):  # (confirmed: the narrow-loss recheck took it back)
        key = {"case": "winner-fails-in-round", "confirm": confirm}
        fns["a"] = _failing_after(fake_clock, 1.0e-3, SEARCH_CALLS)
        ch = _select_trio(key, lambda c: fns[c.name], final_round=2, confirm=confirm)
        # the anchor; confirmed, the recheck may give it to "b" (it beat the anchor in the
        # search and in the alternating confirmation), never to "a"
        assert ch.candidate.name == ("b" if confirm else "aten"), (confirm, ch)
        assert "final round" in ch.failures["a"] and "kernel fault" in ch.failures["a"]
        assert autotune.choice_cache.get("toy.trio", key)["choice"] == ch.candidate.name
    fns = {
        "aten": _costed(fake_clock, lambda i: 5e-3),
        "a": _costed(fake_clock, lambda i: 1.0e-3),
        "b": _failing_after(fake_clock, 1.2e-3, SEARCH_CALLS),
    }
    key = {"case": "runner-up-fails-in-round"}
    ch = _select_trio(key, lambda c: fns[c.name], final_round=2)
    assert ch.candidate.name == "a" and "final round" in ch.failures["b"]
    assert autotune.choice_cache.get("toy.trio", key)["choice"] == "a"


def test_final_round_never_overrides_the_anchor_verdict(fresh_cache, fake_clock):
    """A candidate that lost to the anchor in the search never enters the round, however fast it
    is later; nor does one that failed its check; and an anchor choice has no round at all."""
    calls: list = []
    costs = {
        "aten": lambda i: 1.0e-3,
        "a": lambda i: 0.9e-3,  # beats the anchor by 10 %
        "b": lambda i: 1.0e-3 if i < SEARCH_CALLS else 0.1e-3,  # lost to it (within noise)
    }
    ch = _select_trio({"case": "anchor"}, _trio_factory(fake_clock, costs, calls), final_round=3)
    assert ch.candidate.name == "a" and not any(k.startswith("final:") for k in ch.timings_s)
    assert len(calls) == 3 * SEARCH_CALLS  # no round was run
    wrong = [*TRIO, Candidate("wrong")]
    costs["wrong"] = lambda i: 0.95e-3

    def make(c: Candidate):
        fn = _trio_factory(fake_clock, costs)(c)
        return (lambda x: fn(x) * 3) if c.name == "wrong" else fn

    ch = _select_trio({"case": "wrong"}, make, cands=wrong, final_round=3)
    assert ch.candidate.name == "a" and "wrong" in ch.failures
    assert not any(k.startswith("final:") for k in ch.timings_s)
    slow = {"aten": lambda i: 1.0e-3, "a": lambda i: 2e-3, "b": lambda i: 2e-3}
    ch = _select_trio({"case": "slow"}, _trio_factory(fake_clock, slow), final_round=3)
    assert ch.candidate.name == "aten" and not any(k.startswith("final:") for k in ch.timings_s)


def test_final_round_leaves_candidates_outside_the_spread_out(fresh_cache, fake_clock):
    calls: list = []
    costs = {
        "aten": lambda i: 5e-3,
        "a": lambda i: 1.0e-3,
        "b": lambda i: 1.0e-3 * tuner.FINAL_ROUND_SPREAD * 1.01,
    }
    ch = _select_trio({"case": "spread"}, _trio_factory(fake_clock, costs, calls), final_round=3)
    assert ch.candidate.name == "a" and len(calls) == 3 * SEARCH_CALLS


def test_final_round_uses_final_factory_and_keeps_the_choice_when_it_fails(fresh_cache, fake_clock):
    built: list = []

    def build(cs):
        built.append([c.name for c in cs])
        raise RuntimeError("cannot build the round")

    ch = _select_trio(
        {"case": "ff"}, _trio_factory(fake_clock, LIED), final_round=2, final_factory=build
    )
    assert built == [["a", "b"]] and ch.candidate.name == "a"
    assert autotune.choice_cache.get("toy.trio", {"case": "ff"})["choice"] == "a"


@pytest.mark.skipif(sys.platform != "linux", reason="counts the process's minor page faults")
def test_settle_faults_calls_until_a_call_takes_no_fresh_pages():
    """The allocator's settling before a candidate is timed: untimed calls while each touches
    fresh pages (here the first three map and write 4 MiB), at most SETTLE_FAULT_CALLS; it
    returns the calls made and the last one's duration."""
    import mmap

    from torchport.autotune import timing

    made: list[int] = []

    def fresh_then_quiet(x):
        made.append(1)
        if len(made) <= 3:
            with mmap.mmap(-1, 4 << 20) as m:
                m.write(b"\1" * (4 << 20))  # ~1024 page faults
        return x

    n, last_s, quiet = timing.settle_faults(fresh_then_quiet, [(1,)], max_time_s=10.0)
    assert n == 4 and len(made) == 4 and last_s >= 0.0 and quiet

    def always_fresh(x):
        with mmap.mmap(-1, 4 << 20) as m:
            m.write(b"\1" * (4 << 20))
        return x

    assert timing.settle_faults(always_fresh, [(1,)], max_time_s=10.0)[0] == (
        timing.SETTLE_FAULT_CALLS
    )
    # past max_time_s it stops after the first call, faults or not
    assert timing.settle_faults(always_fresh, [(1,)], max_time_s=0.0)[:3:2] == (1, False)


def test_a_wrong_result_is_refused_without_a_check(fresh_cache):
    """Without ``check`` the tuner compared nothing: a fast candidate returning zeros was timed
    and chosen. The default check (``same_result``) holds it to the anchor's result."""
    x = torch.randn(64, 64)

    def factory(c):
        if c.is_anchor:
            return lambda x: x.sum(1)
        if c.name == "right":
            return lambda x: x.sum(1, dtype=torch.float64).float()
        return lambda x: torch.zeros(x.shape[0])

    cands = [Candidate("aten", ATEN), Candidate("wrong"), Candidate("right")]
    ch = autotune.select("toy.default_check", {"s": 1}, cands, factory, lambda: (x,), cold=False)
    assert ch.failures["wrong"] == "invalid: result does not match the ATen anchor"
    assert "right" in ch.timings_s and ch.candidate.name != "wrong"
    assert autotune.tuner.same_result((x, 3), (x.clone(), 3))
    assert not autotune.tuner.same_result((x, 3), (x, 4))
    assert not autotune.tuner.same_result(x.double(), x)
