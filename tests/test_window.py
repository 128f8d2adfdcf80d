"""RMA windows vs the single-process reference, over shared memory and over the tcp server."""

from __future__ import annotations

import gc
import os
import random
import tempfile

import pytest
import torch

from tests.ft_actors import Actors
from torchport.distributed.window import ReferenceWindow, WindowError

WORLD, N = 3, 7  # prime length: offsets and sizes that are not multiples of anything


@pytest.fixture(scope="module")
def trio():
    with Actors(WORLD) as a:
        d = tempfile.mkdtemp()
        a.call_all(
            list(range(WORLD)),
            "init_dist",
            [(f"{d}/s", i, WORLD) for i in range(WORLD)],
            timeout=120,
        )
        a.call_all(list(range(WORLD)), "track_shm")
        yield a


def _left_in_dev_shm(actors: Actors) -> list[str]:
    """The ``/dev/shm`` files the actors' windows made since the last call that are still
    there. Only the test's own: looking for any ``tpwin-*`` file failed whenever another
    window on the host (a parallel test, CI) was up."""
    made = [n for _, names in actors.call_all(list(range(WORLD)), "shm_made") for n in names]
    return [n for n in made if os.path.exists(f"/dev/shm/{n}")]


def _script(seed: int) -> list[tuple]:
    rng = random.Random(seed)
    ops: list[tuple] = []
    for _ in range(3):  # epochs separated by fences: puts, then accumulates, then gets
        shift = rng.randrange(WORLD)  # one writer per target per epoch (racing puts are undefined)
        for src in range(WORLD):
            dst, n = (src + shift) % WORLD, rng.randrange(0, N + 1)
            off = rng.randrange(0, N - n + 1)
            ops.append(("put", src, [rng.uniform(-9, 9) for _ in range(n)], dst, off))
        ops.append(("fence", 0))
        for src in range(WORLD):
            for _ in range(2):
                dst, n = rng.randrange(WORLD), rng.randrange(1, N + 1)
                off = rng.randrange(0, N - n + 1)
                ops.append(("acc", src, [float(rng.randrange(-4, 5)) for _ in range(n)], dst, off))
        ops.append(("fence", 0))
        for src in range(WORLD):
            r, n = rng.randrange(WORLD), rng.randrange(0, N + 1)
            ops.append(("get", src, r, rng.randrange(0, N - n + 1), n))
        ops.append(("fence", 0))
    return ops


def _reference(ops: list[tuple]) -> tuple[list[list[float]], list[list[list[float]]]]:
    ref = ReferenceWindow([torch.full((N,), float(r), dtype=torch.float64) for r in range(WORLD)])
    gets: list[list[list[float]]] = [[] for _ in range(WORLD)]
    for op in ops:
        if op[0] == "put":
            ref.put(op[1], torch.tensor(op[2], dtype=torch.float64), op[3], op[4])
        elif op[0] == "acc":
            ref.accumulate(op[1], torch.tensor(op[2], dtype=torch.float64), op[3], op[4])
        elif op[0] == "get":
            gets[op[1]].append(ref.get(op[2], op[3], op[4]).tolist())
    return [t.tolist() for t in ref.t], gets


@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("seed", [0, 1])
def test_window_matches_reference(trio, transport, seed):
    ops = _script(seed)
    res = trio.call_all(list(range(WORLD)), "window_script", [(ops, [0.0] * N, transport)] * WORLD)
    assert all(s == "ok" for s, _ in res), res
    finals, gets = _reference(ops)
    for r, (_, (final, got, mapped)) in enumerate(res):
        assert final == finals[r]  # integer-valued accumulates: exact in float64
        assert got == gets[r]
        if transport == "shm":
            assert mapped == finals[(r + 1) % WORLD]  # map_remote_tensor is the peer's memory
    assert not _left_in_dev_shm(trio)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_signal_orders_puts(trio, transport):
    res = trio.call_all(list(range(WORLD)), "window_signal", [(40, transport)] * WORLD)
    assert res[0] == ("ok", [])
    for s, seen in res[1:]:
        assert s == "ok" and seen == list(range(1, 41))


def test_window_errors(trio):
    res = trio.call_all(list(range(WORLD)), "window_errors")
    for s, msgs in res:
        assert s == "ok"
        assert "must lie within rank 1's 6 elements" in msgs[0]
        assert "dtype must match rank 1's tensor (torch.float32), got torch.int32" in msgs[1]
        assert f"rank must be in [0, {WORLD}), got 9" in msgs[2]
        assert "no signal from rank" in msgs[3]
        assert "already registered" in msgs[4]
        assert "element count must be >= 0, got -1" in msgs[5]
        assert "an async request failed" in msgs[6]  # fence() had dropped it
        # (it said "the element count must be >= 0, got -3": no count was given)
        assert "get: elements [9, 9) must lie within rank 1's 6 elements" in msgs[7]


def test_shm_accumulate_from_threads_loses_nothing(trio):
    """Two threads in each of two ranks accumulate into the third rank: the file lock alone did
    not exclude a process's own threads (1-4 of 180 accumulates were lost)."""
    res = trio.call_all(list(range(WORLD)), "window_threads", [(2, 30)] * WORLD)
    assert all(s == "ok" for s, _ in res), res
    assert res[-1][1] == 2 * 2 * 30


def test_tcp_window_binds_configured_address_and_authenticates(trio):
    """The tcp server listens on TORCHPORT_DIST_ADDR (here 127.0.0.2), not a hard-coded 127.0.0.1,
    and only peers holding the window's random secret get in."""
    res = trio.call_all(list(range(WORLD)), "window_tcp_addr", [("127.0.0.2",)] * WORLD)
    for r, (s, (addrs, stranger, local)) in enumerate(res):
        assert s == "ok"
        assert [h for h, _ in addrs] == ["127.0.0.2"] * WORLD
        assert stranger.startswith("rejected"), stranger
        src = (r - 1) % WORLD  # rank src put src + 1 at offsets 1..2 of this rank
        assert local == [0.0, float(src + 1), float(src + 1), 0.0]


def test_window_index_arguments_and_overlapping_self_puts_agree_across_transports(trio):
    """np.int64 offsets were refused (Python ints only); a put to this rank from window memory
    overlapping the target raised untyped on shm and read the source first over tcp."""
    ranks = list(range(WORLD))
    by = {t: trio.call_all(ranks, "window_edges", [(t,)] * WORLD) for t in ("shm", "tcp")}
    assert by["shm"] == by["tcp"]
    for r, (s, (got, errors, local)) in enumerate(by["shm"]):
        assert s == "ok"
        assert got == [-1.0, -2.0, 10.0 * ((r + 1) % WORLD) + 3]
        assert errors[0].startswith("put: the offset must be an integer, got 1.0"), errors
        assert errors[1].startswith("get: the offset must be an integer, got 1.5"), errors
        assert errors[2].startswith("accumulate: the offset must be an integer, got True")
        assert errors[3].startswith("get: rank must be an integer, got np.float64(1.0)")
        a = [10.0 * r, -1.0, -2.0, 10.0 * r + 3]  # after the peer's put at 1..2
        after_put = a[:2] + a[:4]
        want = [*after_put[:2], after_put[2] + after_put[1], after_put[3] + after_put[2]]
        assert local == want + after_put[4:]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_deregister_releases_the_mappings_and_later_use_is_typed(trio, transport):
    """tensor_deregister kept every rank's mapping until close(): they are released at once
    (views still held read zeros instead of faulting), later operations raise WindowError
    naming the deregistration, and a new registration works."""
    res = trio.call_all(list(range(WORLD)), "window_dereg", [(transport,)] * WORLD)
    for r, (s, (before, after, errors, views, again)) in enumerate(res):
        assert s == "ok", res
        assert before == (WORLD if transport == "shm" else 1) and after == 0
        assert all("was deregistered" in e for e in errors), errors
        assert errors[0].startswith("get:") and errors[2].startswith("local:")
        assert views == [[0.0] * 3] + ([[0.0] * 4] if transport == "shm" else [])
        assert again == [10.0 + (r + 1) % WORLD] * 2
    assert not _left_in_dev_shm(trio)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_views_held_past_close_and_collection_keep_their_values(trio, transport):
    """A view held past close() and the window's collection keeps its mapping alive (the tensor
    references the mmap object; close() neither unmaps nor truncates), so it reads the last
    values instead of faulting; no file is left in /dev/shm."""
    res = trio.call_all(list(range(WORLD)), "window_close_held", [(transport,)] * WORLD)
    for r, (s, views) in enumerate(res):
        assert s == "ok", res
        peer = [[1.0 + (r + 1) % WORLD] * 5] if transport == "shm" else []
        assert views == [[1.0 + r] * 5, *peer]
    assert not _left_in_dev_shm(trio)


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_window_after_one_on_a_subgroup_agrees_on_its_files(trio, transport):
    """Each process numbered its windows on its own: after a window on ranks 0 and 1, the
    world's window was #2 there and #1 on rank 2, whose files nobody had created
    (FileNotFoundError on every rank, files left in /dev/shm). The name is rank 0's."""
    res = trio.call_all(list(range(WORLD)), "window_after_subgroup", [(transport,)] * WORLD)
    for r, (s, got) in enumerate(res):
        assert s == "ok", res
        assert got == [float((r + 1) % WORLD)] * 3
    assert not _left_in_dev_shm(trio)


def test_hosts_sharing_a_name_prefix_are_told_apart(trio):
    """The host identity was the hostname's first 7 bytes: ``trainer-0`` .. ``trainer-2`` were
    one host, and ``auto`` took the shared-memory transport across hosts. Now the full
    hostname (and boot id) counts; one hostname is still one host."""
    ranks = list(range(WORLD))
    apart = trio.call_all(ranks, "window_hosts", [(f"trainer-{r}",) for r in ranks])
    assert apart == [("ok", "tcp")] * WORLD
    alike = trio.call_all(ranks, "window_hosts", [("trainer-0",)] * WORLD)
    assert alike == [("ok", "shm")] * WORLD


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_sources_that_require_grad_leave_window_memory_out_of_autograd(trio, transport):
    """Registering, putting or accumulating a tensor that requires grad recorded the copy into
    window memory: ``local`` required grad (shm, and tcp after the registration) and every put
    grew its graph. Only the data is taken now, on both transports."""
    res = trio.call_all(list(range(WORLD)), "window_grad", [(transport,)] * WORLD)
    for r, (s, got) in enumerate(res):
        assert s == "ok", res
        assert got == (False, False, [1.0, 1.0, r + 1.0, r + 1.0])


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_operations_after_close_raise_window_error(trio, transport):
    """signal and wait_signal after close() raised IndexError on the released counters (shm),
    get and tensor_deregister said no tensor was registered, fence ran a barrier: every
    operation names the close."""
    res = trio.call_all(list(range(WORLD)), "window_after_close", [(transport,)] * WORLD)
    for s, errors in res:
        assert s == "ok", res
        names = ["signal", "wait_signal", "get", "put", "map_remote_tensor", "tensor_register"]
        names += ["fence", "tensor_deregister"]
        for name, e in zip(names, errors, strict=True):
            assert e == f"WindowError: {name}: the window was closed (close)", errors


def test_a_window_on_a_reconfigured_group_refuses_operations():
    """A window on a reconfigurable group kept the members it was made with: after a shrink
    that dropped rank 1, old rank 2 is rank 1, and rank 0's put to rank 1 landed in the dropped
    process's memory, no error anywhere. Every operation now raises WindowError."""
    with Actors(3) as a:
        ranks = [0, 1, 2]
        handles = [h for _, h in a.call_all(ranks, "init_reconf", timeout=60)]
        first = a.call_all(ranks, "reconf", [(1, handles)] * 3, timeout=60)
        assert all(s == "ok" and r[0] == "ok" for s, r in first), first
        assert a.call_all(ranks, "window_on_group") == [("ok", "shm")] * 3
        kept = [h for _, h in a.call_all([0, 2], "handle")]  # (rotated by the reconfigure)
        shrunk = a.call_all([0, 2], "reconf", [(2, kept)] * 2, timeout=60)
        assert all(s == "ok" and r[0] == "ok" for s, r in shrunk), shrunk
        res = a.call_all([0, 2], "window_on_group_use", [(1,), (0,)])
        (s0, (put0, _)), (s2, (put2, local)) = res
        assert s0 == s2 == "ok", res
        for got in (put0, put2):
            assert got.startswith("WindowError: put: the window's group was reconfigured"), got
        assert local == [2.0, 2.0]


@pytest.mark.parametrize("which", ["s", "d"])
def test_a_peer_failing_during_creation_leaves_no_file_in_dev_shm(trio, which):
    """A rank that failed to map a peer's file (or a peer that never arrived) left its own file
    in /dev/shm: nobody unlinks it later, so the signal counters or a whole registered tensor
    stayed in RAM for good. Each rank unlinks its own file when creation fails. The peer that
    mapped its files no longer waits in a barrier for the group's timeout: the failure
    travels in the exchange that ends the step, and it raises WindowError at once."""
    res = trio.call_all(
        list(range(WORLD)), "window_peer_fails_mapping", [(which,)] * WORLD, timeout=15
    )
    assert res[1] == ("ok", "OSError") and res[2] == ("ok", None), res
    assert res[0] == ("ok", "WindowError"), res
    assert not _left_in_dev_shm(trio)


def test_a_window_on_a_group_this_rank_is_not_in_says_so(trio):
    """new_group gives a non-member GroupMember.NON_GROUP_MEMBER (-100), and a window on it
    raised "group -100 does not support windows"."""
    res = trio.call_all(list(range(WORLD)), "window_nonmember")
    assert res[:2] == [("ok", None)] * 2
    assert res[2][1].startswith("WindowError: this rank is not a member of the group"), res


@pytest.mark.parametrize(
    ("bad", "why"),
    [
        ("dims", "window tensors may have at most 8 dims, got 9"),
        ("sparse", "tensor_register needs a dense (strided) tensor, got layout torch.sparse_coo"),
        ("nospace", "tensor_register could not place the tensor in window memory: could not "),
    ],
)
def test_a_tensor_one_rank_cannot_register_fails_every_rank_at_once(trio, bad, why):
    """A rank whose tensor the window refuses (9 dims) raised before the exchange of shapes, and
    the other ranks waited in it for the group's timeout (30 minutes on gloo). A sparse tensor,
    or a file that could not be allocated, failed on that rank after the exchange: the others
    waited in a barrier, and every rank kept the registration ("already registered" ever
    after). Every rank raises now, and the window takes a registration afterwards."""
    res = trio.call_all(list(range(WORLD)), "window_bad_register", [(bad,)] * WORLD, timeout=15)
    for r, (s, (err, got)) in enumerate(res):
        assert s == "ok", res
        if r == 1:
            assert err.startswith(why), err
        else:
            assert err.startswith("tensor_register: rank(s) [1] gave a tensor"), err
        assert got == [float((r + 1) % WORLD)]


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_refused_window_leaves_no_server_or_fds(trio, transport):
    """A window whose creation failed (here: a tensor every rank refused) is never returned, so
    nobody closes it: its window server thread, listening socket and file descriptors stayed
    (13 fds more after 6 such windows). Every failure path releases them."""
    res = trio.call_all(list(range(WORLD)), "window_refused_leak", [(transport,)] * WORLD)
    for s, (before, after, threads) in res:
        assert s == "ok", res
        assert (after, threads) == (before, 0), res
    assert not _left_in_dev_shm(trio)


def test_shm_create_failing_after_the_file_was_made_cleans_up(monkeypatch):
    """A failure of the allocation or the mapping after ``O_CREAT`` (an address-space limit,
    a full /dev/shm) left the file in /dev/shm and its fd open, with an untyped OSError."""
    import errno
    import mmap as mmap_mod
    import secrets

    from torchport.distributed import window

    def no_memory(*args, **kwargs):
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    monkeypatch.setattr(mmap_mod, "mmap", no_memory)
    name = f"tpwin-test-{secrets.token_hex(6)}"
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(window.WindowError, match=r"4096 bytes .*\(errno 12\)"):
        window._shm_create(name, 4096)
    assert not os.path.exists(f"/dev/shm/{name}")
    assert len(os.listdir("/proc/self/fd")) == fds


def test_host_identity_tells_private_dev_shm_mounts_apart(monkeypatch):
    """Containers with one hostname (and so one boot id) but their own /dev/shm mount counted
    as one host: ``auto`` took shared memory and creation failed (FileNotFoundError) opening
    the peers' files. The device of /dev/shm is part of the identity now (windows and the
    collectives' shm-or-tcp choice alike)."""
    from torchport.distributed import groups, window

    real = os.stat
    here = (groups.host_id(), window._host_id())

    def other_mount(path, *args, **kwargs):
        st = real(path, *args, **kwargs)
        if path != "/dev/shm":
            return st
        fields = list(st)
        fields[2] = st.st_dev + 1  # (st_dev)
        return os.stat_result(fields)

    monkeypatch.setattr(os, "stat", other_mount)
    other = groups.host_id()
    assert other != here[0] and window._host_id() != here[1]
    monkeypatch.undo()
    assert (groups.host_id(), window._host_id()) == here
    # CPUs are the machine's: the tcp mesh counts both mounts' ranks together for pinning
    # and busy polling (counted apart, each container pinned from the first CPU up)
    from torchport.distributed.transport_tcp import _cpu_host

    assert _cpu_host(other) == _cpu_host(here[0]) != _cpu_host("elsewhere" + here[0])


def test_after_the_groups_own_close_the_window_names_the_close():
    """After ReconfigurableGroup.close() (its communicator dropped), a window operation said
    the group was reconfigured."""
    from types import SimpleNamespace

    from torchport.distributed import window

    win = window.Window.__new__(window.Window)
    win._closed, win._pg = False, object()
    win._c = SimpleNamespace(g=SimpleNamespace(pg=None))
    with pytest.raises(window.WindowError, match=r"^put: the window's group was closed"):
        win._check_members("put")
    win._c.g.pg = object()
    with pytest.raises(window.WindowError, match=r"^put: the window's group was reconfigured"):
        win._check_members("put")


def test_tcp_get_from_a_stopped_peer_times_out_typed(trio):
    """A SIGSTOPped peer blocked a tcp ``get`` forever: every request is bounded by the
    window's timeout, raises CommTimeoutError naming the peer and the request, and the next
    request (on a new connection) works once the peer runs again."""
    import signal

    ranks = list(range(WORLD))
    assert trio.call_all(ranks, "window_open", [("tcp", 0.5)] * WORLD) == [("ok", 0.5)] * WORLD
    try:
        assert trio.call(0, "window_get", 2)[0] == [2.0] * 4  # the connection is open
        trio.kill(2, signal.SIGSTOP)
        try:
            (kind, msg), took = trio.call(0, "window_get", 2, timeout=10)
        finally:
            trio.kill(2, signal.SIGCONT)
        assert kind == "CommTimeoutError" and "window get on rank 2" in msg, msg
        assert 0.4 < took < 3.0
        assert trio.call(0, "window_get", 2)[0] == [2.0] * 4
    finally:
        assert trio.call_all(ranks, "window_close") == [("ok", None)] * WORLD


def test_shm_accumulate_behind_a_rank_holding_the_targets_lock_times_out_typed(trio):
    """A rank stopped inside its own accumulate keeps the target file's lock (a POSIX record
    lock goes with the process, not with a stop): another rank's accumulate to that target
    blocked in ``lockf`` for as long as it stayed stopped. Now it raises CommTimeoutError at
    the window's timeout, adding nothing, and works once the lock is free. Rank 2 holds rank
    0's lock here, as its stopped accumulate would."""
    ranks = list(range(WORLD))
    assert trio.call_all(ranks, "window_open", [("shm", 0.5)] * WORLD) == [("ok", 0.5)] * WORLD
    try:
        trio.call(2, "window_file_lock", 0, True)
        try:
            (kind, msg), took = trio.call(1, "window_accumulate", 0, timeout=10)
        finally:
            trio.call(2, "window_file_lock", 0, False)
        assert kind == "CommTimeoutError" and "window accumulate on rank 0" in msg, msg
        assert 0.4 < took < 3.0
        assert trio.call(1, "window_accumulate", 0)[0] is None
        assert trio.call(1, "window_get", 0)[0] == [1.0] * 4  # (the timed-out one added nothing)
    finally:
        assert trio.call_all(ranks, "window_close") == [("ok", None)] * WORLD


def test_tcp_requests_queued_behind_one_that_timed_out_fail_at_once(trio):
    """Requests to one target run one after another; after one timed out, each queued behind
    it dialled the stopped peer again and waited a whole timeout: three async puts took three
    timeouts to fail (fence() after N of them, N timeouts). Now those issued before the
    timeout fail at once with CommTimeoutError, and a request issued after it dials again
    (it works once the peer runs)."""
    import signal
    import time

    ranks = list(range(WORLD))
    assert trio.call_all(ranks, "window_open", [("tcp", 0.5)] * WORLD) == [("ok", 0.5)] * WORLD
    fenced = False
    try:
        assert trio.call(0, "window_get", 2)[0] == [2.0] * 4  # the connection is open
        trio.kill(2, signal.SIGSTOP)
        try:
            errors, took = trio.call(0, "window_async_puts", 2, 3, timeout=20)
        finally:
            trio.kill(2, signal.SIGCONT)
        assert errors == ["CommTimeoutError"] * 3, errors
        assert 0.4 < took < 0.5 + 0.8, took  # one timeout, not three
        # a later request dials again; the timed-out put, left in the old connection's buffer,
        # lands when rank 2 serves that connection (either before or after this get)
        end = time.monotonic() + 5
        got = trio.call(0, "window_get", 2)[0]
        while got != [1.0] * 4 and time.monotonic() < end:
            time.sleep(0.05)
            got = trio.call(0, "window_get", 2)[0]
        assert got == [1.0] * 4, got
        fences = trio.call_all(ranks, "window_fence_close")
        fenced = True
        assert fences == [("ok", "CommTimeoutError"), ("ok", None), ("ok", None)], fences
    finally:
        if not fenced:
            trio.call_all(ranks, "window_fence_close")


def test_tcp_window_first_connect_to_a_stopped_peer_times_out_typed(trio):
    """A peer stopped before the first request: the kernel accepts the connection, nobody
    answers the handshake. That gave a CommError; it is the same CommTimeoutError as a later
    request's, within the window's timeout."""
    import signal

    ranks = list(range(WORLD))
    assert trio.call_all(ranks, "window_open", [("tcp", 0.5)] * WORLD) == [("ok", 0.5)] * WORLD
    try:
        trio.kill(2, signal.SIGSTOP)
        try:
            (kind, msg), took = trio.call(0, "window_get", 2, timeout=10)
        finally:
            trio.kill(2, signal.SIGCONT)
        assert kind == "CommTimeoutError" and "window get on rank 2" in msg, msg
        assert 0.4 < took < 3.0
        assert trio.call(0, "window_get", 2)[0] == [2.0] * 4
    finally:
        assert trio.call_all(ranks, "window_close") == [("ok", None)] * WORLD


def test_tcp_window_request_is_bounded_as_a_whole_by_the_timeout():
    """A window server trickling its reply (a byte every 20 ms, each recv well inside the
    0.3 s timeout) stretched a get of 64 bytes to ~1.6 s: the whole request ends at the
    timeout, with the typed error."""
    import threading
    import time

    from torchport.distributed import CommTimeoutError
    from torchport.distributed._control import MAGIC, Server, recv_msg
    from torchport.distributed.window import Window

    secret = b"s" * 32

    def trickle(conn) -> None:
        recv_msg(conn)  # hello
        recv_msg(conn)  # the get
        body = b'{"t":"ok"}'
        for b in MAGIC + len(body).to_bytes(4, "big") + body + bytes(64):
            conn.sendall(bytes([b]))
            time.sleep(0.02)

    srv = Server(trickle, secret=secret, role="window")
    win = Window.__new__(Window)  # only what a tcp request uses
    win.rank, win.timeout_s, win._secret = 0, 0.3, secret
    win._addrs, win._socks = [("", 0), srv.address], {}
    win._sock_locks = [threading.Lock(), threading.Lock()]
    win._timeouts = [0, 0]
    try:
        t0 = time.monotonic()
        with pytest.raises(CommTimeoutError, match="window get on rank 1"):
            win._rpc(1, {"t": "get", "off": 0, "n": 16}, None, torch.empty(16))
        assert time.monotonic() - t0 < 0.9
    finally:
        srv.close()


def test_tcp_window_request_to_a_peer_that_closed_the_connection_is_typed_and_redials():
    """A peer whose side of the connection went away (it died: here a server that closes each
    connection after one request): the request raised a raw BrokenPipeError or
    ConnectionResetError, and the dead socket was kept, so every later request failed too.
    The failure is a CommError naming the peer and the request, and the next one dials again."""
    import threading

    from torchport.distributed import CommError
    from torchport.distributed._control import Server, recv_msg, send_msg
    from torchport.distributed.window import Window

    secret = b"s" * 32

    def one_request(conn) -> None:
        recv_msg(conn)  # hello
        recv_msg(conn)  # the get (of nothing)
        send_msg(conn, {"t": "ok"})
        conn.shutdown(2)  # (a dead process's kernel does the same)

    srv = Server(one_request, secret=secret, role="window")
    win = Window.__new__(Window)  # only what a tcp request uses
    win.rank, win.timeout_s, win._secret = 0, 5.0, secret
    win._addrs, win._socks = [("", 0), srv.address], {}
    win._sock_locks = [threading.Lock(), threading.Lock()]
    win._timeouts = [0, 0]
    get = {"t": "get", "off": 0, "n": 0}
    try:
        win._rpc(1, get, None, torch.empty(0))
        with pytest.raises(CommError, match="window get on rank 1 failed"):
            win._rpc(1, get, None, torch.empty(0))
        win._rpc(1, get, None, torch.empty(0))  # on a new connection
    finally:
        srv.close()


def test_a_window_without_a_group_uses_the_reconfigurable_default(monkeypatch):
    """After init_process_group(enable_reconfigure=True), _reconfigure and the handles take the
    reconfigurable group as the default, but _new_window(t) raised ValueError "Default process
    group has not been initialized"."""
    from torchport.distributed import _new_window, reconfigure

    monkeypatch.setattr(reconfigure, "_default", None)
    g = reconfigure.init_process_group(enable_reconfigure=True)
    assert g is not None
    try:
        reconfigure._reconfigure(1, [reconfigure._get_reconfigure_handle()]).wait()
        win = _new_window(torch.arange(3.0))
        assert win.size == 1 and win.get(0).tolist() == [0.0, 1.0, 2.0]
        win.fence()
        win.close()
    finally:
        g.close()


def test_window_timeout_defaults_to_the_groups(trio):
    """Without ``timeout=`` a window takes its group's (gloo here: c10d's 30 minutes)."""
    ranks = list(range(WORLD))
    assert trio.call_all(ranks, "window_open", [("tcp", None)] * WORLD) == [("ok", 1800.0)] * WORLD
    assert trio.call_all(ranks, "window_close") == [("ok", None)] * WORLD


def test_control_secret_file_is_private_and_shared(tmp_path, monkeypatch):
    """Without TORCHPORT_SECRET the control servers' secret comes from a 0600 file of 32 random
    bytes in the cache dir, the same for every process of the user; it was derived from the
    user id, which anyone could compute and authenticate with. A file others may read, or a
    symbolic link, raises AuthError."""
    import os

    from torchport import config
    from torchport.distributed import AuthError
    from torchport.distributed._control import default_secret

    monkeypatch.delenv("TORCHPORT_SECRET", raising=False)
    with config.override(cache_dir=str(tmp_path)):
        first = default_secret()
        path = tmp_path / "control-secret"
        assert len(first) == 32 and path.stat().st_mode & 0o777 == 0o600
        assert default_secret() == first
        monkeypatch.setenv("TORCHPORT_SECRET", "job-secret")
        assert default_secret() == b"job-secret"
        monkeypatch.delenv("TORCHPORT_SECRET")
        os.chmod(path, 0o644)
        with pytest.raises(AuthError, match="no group/other permissions"):
            default_secret()
        os.remove(path)
        os.symlink(tmp_path / "elsewhere", path)
        with pytest.raises(AuthError, match="cannot be opened safely"):
            default_secret()


def test_a_corrupt_peer_meta_leaves_nothing_registered():
    """A peer's shape record naming no dtype the window knows raised after the registration
    was counted and outside the clean-up: this rank's file stayed in /dev/shm with its fd and
    mapping. It is decoded inside the guarded exchange now."""
    import secrets

    from torchport.distributed import window

    win = window.Window.__new__(window.Window)  # only what tensor_register uses
    win._closed, win._pg, win._local, win._regs = False, None, None, 0
    win._name, win.rank, win.size = f"tpwin-test-{secrets.token_hex(6)}", 0, 2

    def allgather(t: torch.Tensor) -> list[torch.Tensor]:
        bad = t.clone()
        bad[0] = len(window._DTYPE_LIST)  # (no such dtype)
        return [t, bad]

    win._c = type("Coll", (), {"allgather": staticmethod(allgather)})()
    gc.collect()  # (an earlier test's leftover fd closed by a collection in between)
    fds = len(os.listdir("/proc/self/fd"))
    with pytest.raises(WindowError, match=r"rank\(s\) \[1\] sent dtype index"):
        win.tensor_register(torch.ones(3))
    assert win._regs == 0 and win._local is None
    assert not os.path.exists(f"/dev/shm/{win._name}-d1-0")
    assert len(os.listdir("/proc/self/fd")) == fds


def test_window_memory_takes_no_tangent_from_a_forward_mode_dual():
    """A put of a forward-mode dual (requires_grad False) gave window memory a tangent while
    the level was open; the source is always detached, and a grad-requiring one too."""
    import torch.autograd.forward_ad as fwad

    from torchport.distributed import window

    win = window.Window.__new__(window.Window)  # one rank, shared memory: what a put uses
    win._closed, win._pg, win.rank, win.size, win.transport = False, None, 0, 1, "shm"
    win._local = torch.zeros(5)
    win._remote, win._remote_fds, win._meta = [win._local], [-1], [(torch.float32, [5])]
    with fwad.dual_level():
        win.put(fwad.make_dual(torch.ones(2), torch.full((2,), 7.0)), 0, 1)
        assert fwad.unpack_dual(win._local).tangent is None
    win.put(torch.full((2,), 2.0, requires_grad=True), 0, 3)
    assert win._local.tolist() == [0.0, 1.0, 1.0, 2.0, 2.0] and not win._local.requires_grad
