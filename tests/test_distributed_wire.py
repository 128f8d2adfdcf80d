"""Frame codec of the TCP transport: round trips, every bad field, and a hypothesis fuzz."""

from __future__ import annotations

import contextlib
import errno
import re
import socket
import struct
import threading
import time
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchport.distributed import auth
from torchport.distributed.errors import WireError
from torchport.distributed.wire import (
    HEADER,
    HEADER_SIZE,
    Kind,
    decode_header,
    encode_header,
    signed_seq,
)


def test_round_trip():
    raw = encode_header(Kind.P2P, 7, 3, -5, 100, (1, -2, 3, 4))
    h = decode_header(raw, max_length=100)
    assert (h.kind, h.group, h.src, signed_seq(h.seq), h.sig, h.length) == (
        Kind.P2P,
        7,
        3,
        -5,
        (1, -2, 3, 4),
        100,
    )


@pytest.mark.parametrize(
    ("patch", "match"),
    [
        ({"magic": b"XXXX"}, r"bad frame magic: expected b'TPRT', got b'XXXX'"),
        ({"version": 9}, r"unsupported wire version: expected 2, got 9"),
        ({"version": 1}, r"unsupported wire version: expected 2, got 1"),
        ({"kind": 200}, r"unknown frame kind 200"),
        # FLAG_RING is a P2P frame's only flag (kind 5 is COLL)
        ({"flags": 1}, r"frame flags must be 0 \(or 1 on a P2P frame\), got 1"),
        ({"flags": 2, "kind": 6}, r"frame flags must be 0 \(or 1 on a P2P frame\), got 2"),
        ({"flags": 1, "kind": 10}, r"frame flags must be 0 \(or 1 on a P2P frame\), got 1"),
        ({"length": 1 << 40}, r"frame length 1099511627776 exceeds the bound of 4096 bytes"),
    ],
)
def test_bad_fields_are_rejected(patch, match):
    fields = {"magic": b"TPRT", "version": 2, "kind": 5, "flags": 0, "length": 10}
    fields.update(patch)
    raw = HEADER.pack(
        fields["magic"],
        fields["version"],
        fields["kind"],
        fields["flags"],
        0,
        0,
        0,
        0,
        0,
        0,
        0,
        fields["length"],
    )
    with pytest.raises(WireError, match=match):
        decode_header(raw, max_length=4096)


def test_short_header_is_rejected():
    with pytest.raises(WireError, match=r"frame header must be 64 bytes, got 10"):
        decode_header(b"\0" * 10, max_length=10)


@settings(max_examples=400, deadline=None)
@given(st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE))
def test_fuzz_decoder_never_fails_untyped(data):
    try:
        h = decode_header(data, max_length=1 << 20)
    except WireError:
        return
    assert h.length <= 1 << 20 and isinstance(h.kind, Kind)
    assert data[:4] == b"TPRT"


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from(list(Kind)),
    st.integers(0, 2**32 - 1),
    st.integers(0, 2**32 - 1),
    st.integers(-(2**63), 2**63 - 1),
    st.integers(0, 1 << 20),
    st.tuples(*[st.integers(-(2**63), 2**63 - 1)] * 4),
)
def test_fuzz_round_trip(kind, group, src, seq, length, sig):
    h = decode_header(encode_header(kind, group, src, seq, length, sig), max_length=1 << 20)
    assert (h.kind, h.group, h.src, signed_seq(h.seq), h.length, h.sig) == (
        kind,
        group,
        src,
        seq,
        length,
        sig,
    )


def test_mac_binds_rank_and_nonces():
    s, a, b = auth.new_secret(), auth.new_nonce(), auth.new_nonce()
    m = auth.mac(s, b"cli", a, b, 1)
    assert auth.verify(m, auth.mac(s, b"cli", a, b, 1))
    assert not auth.verify(m, auth.mac(s, b"cli", a, b, 2))
    assert not auth.verify(m, auth.mac(s, b"cli", b, a, 1))
    assert not auth.verify(m, auth.mac(auth.new_secret(), b"cli", a, b, 1))
    assert struct.calcsize("<4sBBHIIQ4qQ") == HEADER_SIZE


def _p2p(body: str, sig: tuple[int, int, int, int] = (0, 0, 0, 0)):
    """A point-to-point frame carrying ``body`` (as the mailbox receives it)."""
    from torchport.distributed.wire import Kind, decode_header, encode_header

    data = bytearray(body.encode())
    return decode_header(encode_header(Kind.P2P, 0, 1, 5, len(data), sig), max_length=4096), data


def test_mailbox_any_source_fires_once_and_leaves_other_frames():
    from torchport.distributed.transport_tcp import Mailbox, Once

    mb, got = Mailbox(), []
    k1, k2 = (0, 6, 1, 5), (0, 6, 2, 5)
    once = Once(lambda f: got.append(f), [k1, k2])
    mb.expect_any(once)
    mb.deliver(k2, _p2p("from2"))
    mb.deliver(k1, _p2p("from1"))  # the any-source receive already fired: queued
    assert got == [_p2p("from2")]
    later: list = []
    mb.expect(k1, later.append)
    assert later == [_p2p("from1")]


def test_mailbox_any_source_takes_a_queued_frame_and_cancel_withdraws():
    from torchport.distributed.transport_tcp import Mailbox, Once

    mb, got = Mailbox(), []
    k1, k2 = (0, 6, 1, 0), (0, 6, 2, 0)
    mb.deliver(k2, _p2p("early"))
    mb.expect_any(Once(got.append, [k1, k2]))
    assert got == [_p2p("early")]
    once = Once(got.append, [k1, k2])
    mb.expect_any(once)
    assert mb.cancel(k1, once) and not mb.cancel(k1, once)
    mb.deliver(k1, _p2p("after-cancel"))
    assert got == [_p2p("early")]  # a withdrawn receive never fires


def test_mailbox_hands_a_message_in_frames_whole_to_one_receive():
    """A message cut into frames (sig: dtype, numel, byte offset, frame count) goes whole to
    the receive that took its first frame, though another receive waits on the same key, and
    whether its frames were queued, delivered later, or both; ``kill`` forgets it."""
    from torchport.distributed.transport_tcp import Mailbox, Once, frames_after

    def piece(name: str, off: int, count: int = 3):
        return _p2p(name, (1, 9, off, count))

    k, other = (0, 6, 1, 5), (0, 6, 2, 5)
    assert [frames_after(piece("a", 0)), frames_after(piece("b", 4))] == [2, 0]
    assert frames_after(_p2p("one")) == 0 and frames_after(piece("two", 0, 1)) == 0
    # both receives wait before anything arrives
    mb, a, b = Mailbox(), [], []
    mb.expect(k, a.append)
    mb.expect(k, b.append)
    for f in (piece("a0", 0), piece("a1", 2), piece("a2", 4), _p2p("next")):
        mb.deliver(k, f)
    assert [bytes(f[1]) for f in a] == [b"a0", b"a1", b"a2"] and b == [_p2p("next")]
    # two frames queued, then taken; the third arrives after another receive waits
    mb, a, b = Mailbox(), [], []
    mb.deliver(k, piece("a0", 0))
    mb.deliver(k, piece("a1", 2))
    mb.expect(k, a.append)
    mb.expect(k, b.append)
    mb.deliver(k, piece("a2", 4))
    mb.deliver(k, _p2p("next"))
    assert [bytes(f[1]) for f in a] == [b"a0", b"a1", b"a2"] and b == [_p2p("next")]
    # an any-source receive takes the message of the key whose first frame came first
    mb, got, b = Mailbox(), [], []
    mb.deliver(k, piece("a0", 0))
    once = Once(got.append, [other, k])
    mb.expect_any(once)
    mb.expect(k, b.append)
    mb.deliver(other, _p2p("other"))
    for f in (piece("a1", 2), piece("a2", 4), _p2p("next")):
        mb.deliver(k, f)
    assert [bytes(f[1]) for f in got] == [b"a0", b"a1", b"a2"] and b == [_p2p("next")]
    # a group that dies forgets its unfinished messages
    mb, a, b = Mailbox(), [], []
    mb.expect(k, a.append)
    mb.deliver(k, piece("a0", 0))
    mb.kill(0)
    mb.revive(0)
    mb.expect(k, b.append)
    mb.deliver(k, _p2p("fresh"))
    assert len(a) == 1 and b == [_p2p("fresh")]


def test_a_receives_own_target_takes_only_its_frame():
    """``expect(key, cb, target)``: the first receive waiting on a key has the next matching
    frame read into its target and gets ``(header, RECEIVED)``; the target goes with the frame,
    with a frame that did not match it (buffered), and with a cancel; a receive cancelled while
    its frame is read into it never passes that frame on to the next receive."""
    from torchport.distributed.transport_tcp import (
        DROPPING,
        FAILED,
        FILLING,
        RECEIVED,
        Mailbox,
        Target,
    )

    k, sig = (0, 6, 1, 5), (1, 4, 0, 0)

    def frame(n: int, s=sig):
        return _p2p("x" * n, s)

    def into():
        return Target(1234, 4, sig)

    def sink():  # (one callable: a list's ``append`` is a new bound method at every access)
        got: list = []
        return got, got.append

    (mb, (a, ca), (b, cb)) = Mailbox(), sink(), sink()
    ta, tb = into(), into()
    mb.expect(k, ca, ta)
    mb.expect(k, cb, tb)  # a second receive on the key: no target of its own
    assert ta.owner is ca and tb.owner is None
    hdr = frame(4)[0]
    assert mb.claim(k, frame(5)[0]) is None and mb.claim(k, hdr) is ta
    mb.finish(ta, True, k, hdr)
    assert a == [(hdr, RECEIVED)] and b == [] and mb.claim(k, hdr) is None
    mb.deliver(k, frame(4))  # b's frame comes the buffered way
    assert len(b) == 1 and b[0][1] is not RECEIVED
    # a frame that does not match the target is delivered buffered; the target goes with it
    mb, (a, ca) = Mailbox(), sink()
    mb.expect(k, ca, into())
    mb.deliver(k, frame(5, (1, 5, 0, 0)))
    assert len(a) == 1 and mb.claim(k, hdr) is None and mb.waiters.value == 0
    # a cancelled receive's target goes at once
    mb, (a, ca) = Mailbox(), sink()
    mb.expect(k, ca, into())
    assert mb.cancel(k, ca) and mb.claim(k, hdr) is None and mb.waiters.value == 0
    # cancelled while its frame is read into it: the cancel waits until the reader sends the
    # rest to a sink (its next slice: dropping), and the frame is dropped, not handed to b
    (mb, (a, ca), (b, cb)) = Mailbox(), sink(), sink()
    t = into()
    mb.expect(k, ca, t)
    mb.expect(k, cb)
    assert mb.claim(k, hdr) is t and t.state == FILLING
    reader = threading.Timer(0.1, mb.dropping, args=(t,))
    reader.start()
    t0 = time.monotonic()
    assert mb.cancel(k, ca, time.monotonic() + 5, lambda: pytest.fail("not stuck"))
    assert t.state == DROPPING and time.monotonic() - t0 >= 0.09
    reader.join()
    mb.finish(t, True, k, hdr)
    assert a == [] and b == [] and mb.dropped == 1
    mb.deliver(k, frame(4))
    assert len(b) == 1
    # a reader that never reaches its next slice (a stalled sender): past the deadline the
    # connection is shut, which ends its read (here: the read fails at once)
    (mb, (a, ca)) = Mailbox(), sink()
    t = into()
    mb.expect(k, ca, t)
    assert mb.claim(k, hdr) is t
    shut: list[bool] = []
    mb.cancel(k, ca, time.monotonic() + 0.05, lambda: (shut.append(True), mb.finish(t, False)))
    assert shut == [True] and t.state == FAILED and a == []


def test_a_receives_own_target_follows_its_message_frame_by_frame():
    """A target for a message in frames (``total``) moves on to each next frame after one is
    read into it; every frame goes to its owner, not to a receive waiting behind it; a frame
    that comes buffered ends the target (the rest of the message comes buffered too)."""
    from torchport.distributed.transport_tcp import RECEIVED, Mailbox, Target

    k = (0, 6, 1, 5)

    def hdr(off: int, n: int):
        return _p2p("x" * n, (1, 10, off, 3))[0]

    def sink():
        got: list = []
        return got, got.append

    (mb, (a, ca), (b, cb)) = Mailbox(), sink(), sink()
    t = Target(1000, 4, (1, 10, 0, 3), total=10)
    mb.expect(k, ca, t)
    mb.expect(k, cb)
    for off, n in ((0, 4), (4, 4), (8, 2)):
        h = hdr(off, n)
        assert mb.claim(k, h) is t and t.ptr == 1000 + off and t.size == n
        mb.finish(t, True, k, h)
    assert [f[0].sig[2] for f in a] == [0, 4, 8] and all(f[1] is RECEIVED for f in a)
    assert b == [] and mb.claim(k, hdr(0, 4)) is None  # the target went with the last frame
    # the second frame comes buffered (a sender with another bound): the target goes
    (mb, (a, ca)) = Mailbox(), sink()
    t = Target(1000, 4, (1, 10, 0, 3), total=10)
    mb.expect(k, ca, t)
    first = hdr(0, 4)
    assert mb.claim(k, first) is t
    mb.finish(t, True, k, first)
    mb.deliver(k, _p2p("yyyy", (1, 10, 4, 3)))
    assert mb.claim(k, hdr(8, 2)) is None
    mb.deliver(k, _p2p("zz", (1, 10, 8, 3)))
    assert [bytes(f[1]) for f in a] == [b"", b"yyyy", b"zz"] and mb.waiters.value == 0


def test_mailbox_hands_a_callbacks_exception_to_its_operation():
    """A raising callback fails its own operation (``Delivery.on_error``) instead of raising
    into the thread that delivered the frame, whether delivered later or already queued."""
    from torchport.distributed.transport_tcp import Delivery, Mailbox, Once

    def boom(frame):
        raise RuntimeError(f"cannot write {bytes(frame[1]).decode()}")

    mb, errors = Mailbox(), []
    k1, k2 = (0, 6, 1, 0), (0, 6, 2, 0)
    mb.expect(k1, Delivery(boom, errors.append))
    mb.deliver(k1, _p2p("late"))  # the reader's path: must not raise
    mb.deliver(k2, _p2p("queued"))
    mb.expect_any(Once(boom, [k1, k2], errors.append))  # the issuing thread's path
    assert [str(e) for e in errors] == ["cannot write late", "cannot write queued"]
    assert mb.callback_errors == 0
    with pytest.warns(RuntimeWarning, match="names no operation to fail: RuntimeError"):
        mb.expect(k1, boom)
        mb.deliver(k1, _p2p("orphan"))
    assert mb.callback_errors == 1 and str(mb.last_callback_error) == "cannot write orphan"


def test_a_raising_callback_does_not_end_the_connections_reader(mesh_pair):
    """The reader thread ran a waiting callback unguarded: one that raised ended the thread,
    and every later frame on that connection was silently never delivered."""
    m0, m1 = mesh_pair

    def boom(frame):
        raise RuntimeError("copy failed")

    m0.mailbox.expect((5, int(Kind.P2P), 1, 1), boom)
    with pytest.warns(RuntimeWarning, match="copy failed"):
        m1.send(0, Kind.P2P, 5, 1, b"first", (0, 0, 0, 0))
        m1.send(0, Kind.P2P, 5, 2, b"second", (0, 0, 0, 0))
        _, body = m0.mailbox.get((5, int(Kind.P2P), 1, 2), time.monotonic() + 5, lambda: None)
    assert bytes(body) == b"second" and m0.mailbox.callback_errors == 1


def _hdr(length: int, sig: tuple[int, int, int, int]):
    from torchport.distributed.wire import Kind, decode_header, encode_header

    return decode_header(encode_header(Kind.COLL, 1, 2, 3, length, sig), max_length=1 << 20)


def test_receive_target_only_claims_a_matching_frame():
    from torchport.distributed.transport_tcp import FILLED, Mailbox, Target

    mb, key, sig = Mailbox(), (1, 1, 2, 3), (7, 8, 9, 10)
    t = Target(1234, 16, sig)
    mb.post(key, t)
    assert mb.claim(key, _hdr(17, sig)) is None  # wrong length: buffered path
    assert mb.claim(key, _hdr(16, (7, 8, 9, 11))) is None  # wrong signature
    assert mb.claim((1, 1, 2, 4), _hdr(16, sig)) is None  # another step
    assert mb.claim(key, _hdr(16, sig)) is t
    assert mb.claim(key, _hdr(16, sig)) is None  # claimed once
    mb.finish(t, True)
    assert t.state == FILLED
    mb.withdraw(key, 0.0, lambda: pytest.fail("nothing was stuck"))
    assert mb.claim(key, _hdr(16, sig)) is None  # withdrawn


def test_withdraw_waits_for_a_receive_in_progress_and_ends_a_stuck_one():
    import threading
    import time

    from torchport.distributed.transport_tcp import Mailbox, Target

    mb, key, sig = Mailbox(), (1, 1, 2, 3), (1, 2, 3, 4)
    t = Target(1234, 8, sig)
    mb.post(key, t)
    assert mb.claim(key, _hdr(8, sig)) is t
    # a receive that completes in time: withdraw waits for it, without ending it
    done = threading.Timer(0.05, lambda: mb.finish(t, True))
    done.start()
    mb.withdraw(key, time.monotonic() + 5.0, lambda: pytest.fail("not stuck"))
    done.join()
    # a stuck one: past the deadline on_stuck runs (a real one shuts the socket, which ends
    # recv_into with an error; here it marks the receive failed)
    t2 = Target(1234, 8, sig)
    mb.post(key, t2)
    assert mb.claim(key, _hdr(8, sig)) is t2
    stuck = []
    t0 = time.monotonic()
    mb.withdraw(key, t0 + 0.1, lambda: (stuck.append(1), mb.finish(t2, False)))
    assert stuck == [1] and 0.1 <= time.monotonic() - t0 < 2.0


def _meshes(ring_bytes: int = 0, world: int = 2):
    """``world`` authenticated meshes (ranks 0, 1, ...) in this process, over loopback, of one
    host; with ``ring_bytes``, large P2P payloads go through shared-memory rings of that size."""
    import threading

    import torch.distributed as dist

    from torchport.distributed.tcp_kernels import tcp_lib
    from torchport.distributed.transport_tcp import Mesh

    tcp_lib()  # built (or loaded) before any test times a transfer: a cold cache took 0.5 s
    store = dist.HashStore()
    made: dict[int, Mesh] = {}

    def make(rank: int) -> None:
        made[rank] = Mesh(
            store,
            rank,
            world,
            secret=b"s" * 32,
            addr="127.0.0.1",
            timeout_s=10.0,
            max_frame=1 << 26,
            host_id="h",
            ring_bytes=ring_bytes,
        )

    others = [threading.Thread(target=make, args=(r,)) for r in range(1, world)]
    for t in others:
        t.start()
    make(0)
    for t in others:
        t.join(10.0)
    yield tuple(made[r] for r in range(world))
    for m in made.values():
        m.close()


@pytest.fixture
def mesh_pair():
    """Two meshes of one host without rings (P2P payloads by the socket)."""
    yield from _meshes()


@pytest.fixture
def mesh_trio():
    """Three meshes of one host without rings."""
    yield from _meshes(world=3)


@pytest.fixture
def ring_pair():
    """Two meshes of one host with the smallest rings (64 KiB)."""
    yield from _meshes(1 << 16)


def _exchange_on(meshes, payloads, sigs, *, after=-1, timeout=10.0):
    """Run one ``Mesh.transfer`` per mesh at once: rank r sends ``payloads[r]`` to the other,
    expecting the other's bytes under ``sigs[1 - r]``; returns ``(frames, received)``."""
    import threading
    import time

    import torch

    from torchport.distributed.transport_tcp import XRecv, XSend

    out: dict[int, object] = {}
    bufs = {r: torch.zeros(len(payloads[1 - r]), dtype=torch.uint8) for r in (0, 1)}
    srcs = {r: torch.tensor(list(payloads[r]), dtype=torch.uint8) for r in (0, 1)}

    def run(r: int) -> None:
        m, q = meshes[r], 1 - r
        sends = [XSend(q, Kind.COLL, 5, 9, srcs[r].data_ptr(), len(payloads[r]), sigs[r], after)]
        recvs = [XRecv(q, 5, 9, sigs[q], bufs[r].data_ptr(), len(payloads[q]))]
        try:
            out[r] = m.transfer(sends, recvs, time.monotonic() + timeout, lambda: None)
        except Exception as e:
            out[r] = e

    ts = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout + 5)
    return out, {r: bytes(bufs[r].tolist()) for r in (0, 1)}


def test_native_transfer_moves_frames_both_ways_into_place(mesh_pair):
    from torchport.distributed.transport_tcp import RECEIVED

    sig = (1, 2, 3, 4)
    big = bytes(range(256)) * 4099  # > socket buffers: both sides must read while sending
    frames, got = _exchange_on(mesh_pair, [big, b"xyz" * 7], [sig, sig])
    for r in (0, 1):
        assert isinstance(frames[r], list), frames[r]
        ((hdr, body),) = frames[r]
        assert body is RECEIVED and hdr.sig == sig
    assert got[1] == big and got[0] == b"xyz" * 7


def test_native_transfer_routes_a_foreign_frame_as_the_reader_would(mesh_pair):
    """A frame of another kind on the socket (a P2P message sent just before the collective's
    frame) is handed to the mailbox as the reader thread would; the transfer still receives
    its own frame into place."""
    from torchport.distributed.transport_tcp import RECEIVED

    m0, m1 = mesh_pair
    m1.send(0, Kind.P2P, 5, 77, b"hello", (0, 0, 0, 0))
    frames, got = _exchange_on(mesh_pair, [b"a" * 10, b"b" * 10], [(1, 1, 1, 1), (2, 2, 2, 2)])
    assert all(f[0][1] is RECEIVED for f in frames.values())
    assert got[0] == b"b" * 10 and got[1] == b"a" * 10
    p2p = m0.mailbox.take((5, int(Kind.P2P), 1, 77))
    assert p2p is not None and bytes(p2p[1]) == b"hello"


def test_native_transfer_reports_a_signature_it_did_not_expect(mesh_pair):
    import threading
    import time

    import torch

    from torchport.distributed.transport_tcp import RECEIVED, XRecv, XSend

    m0, m1 = mesh_pair
    src, dst = torch.arange(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    res: dict[str, object] = {}

    def rank1() -> None:  # sends a frame signed (9, 9, 9, 9) where rank 0 expects (1, 2, 3, 4)
        x = XSend(0, Kind.COLL, 5, 3, src.data_ptr(), 8, (9, 9, 9, 9))
        res["1"] = m1.transfer([x], [], time.monotonic() + 10, lambda: None)

    t = threading.Thread(target=rank1)
    t.start()
    want = XRecv(1, 5, 3, (1, 2, 3, 4), dst.data_ptr(), 8)
    frames = m0.transfer([], [want], time.monotonic() + 10, lambda: None)
    t.join(10)
    assert frames is not None
    ((hdr, body),) = frames
    assert body is not RECEIVED and hdr.sig == (9, 9, 9, 9) and bytes(body) == bytes(range(8))
    assert dst.sum().item() == 0  # nothing written into place


def test_native_transfer_stops_at_check_and_deadline_and_yields_an_owned_socket(mesh_pair):
    import time

    import torch

    from torchport.distributed.errors import CommTimeoutError
    from torchport.distributed.tcp_kernels import OWN_COLL, tcp_lib
    from torchport.distributed.transport_tcp import XRecv

    m0, _ = mesh_pair
    dst = torch.zeros(4, dtype=torch.uint8)
    want = [XRecv(1, 5, 1, (0, 0, 0, 1), dst.data_ptr(), 4)]

    def check() -> None:
        raise _Aborted("group aborted")

    t0 = time.monotonic()
    with pytest.raises(_Aborted, match="group aborted"):
        m0.transfer([], want, time.monotonic() + 10, check)
    assert time.monotonic() - t0 < 0.1  # an abort is seen within one 10 ms slice
    with pytest.raises(CommTimeoutError, match="timed out"):
        m0.transfer([], want, time.monotonic() + 0.05, lambda: None)
    conn = m0.peers[1]
    assert conn.own.value == 0  # released after each error
    assert tcp_lib().conn_claim(conn.own_addr) == 1  # another collective owns it now
    assert conn.own.value == OWN_COLL
    try:
        assert m0.transfer([], want, time.monotonic() + 1, lambda: None) is None
    finally:
        tcp_lib().conn_release(conn.own_addr)


def test_native_transfer_waiting_for_a_busy_send_lock_sees_abort_and_deadline(mesh_pair):
    """The connection's send lock held elsewhere (a sender thread's frame to a peer that
    stopped reading): the transfer's wait for it ends at the group's abort or its deadline,
    and the socket it owned meanwhile goes back to its reader."""
    import time

    import torch

    from torchport.distributed.errors import CommTimeoutError
    from torchport.distributed.transport_tcp import XSend

    m0, m1 = mesh_pair
    src = torch.arange(4, dtype=torch.uint8)
    sends = [XSend(1, Kind.COLL, 5, 4, src.data_ptr(), 4, (1, 1, 1, 1))]
    conn = m0.peers[1]

    def check() -> None:
        raise _Aborted("group aborted")

    with conn.lock:  # held by "another thread" for the whole test
        t0 = time.monotonic()
        with pytest.raises(_Aborted, match="group aborted"):
            m0.transfer(sends, [], time.monotonic() + 10, check)
        assert time.monotonic() - t0 < 0.1
        t0 = time.monotonic()
        with pytest.raises(CommTimeoutError, match="busy"):
            m0.transfer(sends, [], time.monotonic() + 0.1, lambda: None)
        assert time.monotonic() - t0 < 0.5
        assert conn.own.value == 0
    m0.send(1, Kind.P2P, 5, 1, b"after")  # the connection is intact: nothing half-sent
    _, body = m1.mailbox.get((5, int(Kind.P2P), 0, 1), time.monotonic() + 5, lambda: None)
    assert bytes(body) == b"after" and m1.mailbox.take((5, int(Kind.COLL), 0, 4)) is None


def test_native_transfer_over_more_peers_than_it_tracks_takes_the_mailbox_path(
    mesh_pair, monkeypatch
):
    """Above ``MAXFD`` distinct peers the native loop cannot keep its per-socket order: the
    transfer returns None having sent nothing and owning nothing (the caller's mailbox path)."""
    import time

    import torch

    from torchport.distributed import transport_tcp
    from torchport.distributed.transport_tcp import XRecv, XSend

    m0, m1 = mesh_pair
    src, dst = torch.arange(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
    monkeypatch.setattr(transport_tcp, "MAXFD", 0)
    sends = [XSend(1, Kind.COLL, 5, 2, src.data_ptr(), 4, (1, 1, 1, 1))]
    recvs = [XRecv(1, 5, 2, (1, 1, 1, 1), dst.data_ptr(), 4)]
    assert m0.transfer(sends, recvs, time.monotonic() + 5, lambda: None) is None
    assert m0.peers[1].own.value == 0
    m0.send(1, Kind.P2P, 5, 1, b"probe")  # the first frame rank 1 sees: nothing went before
    _, body = m1.mailbox.get((5, int(Kind.P2P), 0, 1), time.monotonic() + 5, lambda: None)
    assert bytes(body) == b"probe" and m1.mailbox.take((5, int(Kind.COLL), 0, 2)) is None


def test_native_transfer_releases_the_sockets_when_setting_up_its_receives_fails(mesh_pair):
    """An error raised after the sockets are owned (here: a signature word that does not fit
    the header) still hands them back to their readers: later frames are read as usual."""
    import struct
    import time

    import torch

    from torchport.distributed.transport_tcp import XRecv

    m0, m1 = mesh_pair
    dst = torch.zeros(4, dtype=torch.uint8)
    bad = [XRecv(1, 5, 1, (1 << 64, 0, 0, 0), dst.data_ptr(), 4)]
    with pytest.raises(struct.error):
        m0.transfer([], bad, time.monotonic() + 5, lambda: None)
    assert m0.peers[1].own.value == 0
    m1.send(0, Kind.P2P, 5, 3, b"still read")
    _, body = m0.mailbox.get((5, int(Kind.P2P), 1, 3), time.monotonic() + 5, lambda: None)
    assert bytes(body) == b"still read"


class _Aborted(Exception):
    """What a test's ``check`` raises once its group counts as aborted."""


def _abort_after(delay: float) -> tuple[Callable[[], None], list[float]]:
    """A transfer ``check`` that raises :class:`_Aborted` once ``delay`` seconds have passed,
    and the list that receives the abort's monotonic time."""
    aborted_at: list[float] = []
    threading.Timer(delay, lambda: aborted_at.append(time.monotonic())).start()

    def check() -> None:
        if aborted_at:
            raise _Aborted("group aborted")

    return check, aborted_at


def _trickle(mesh, to: int, data: bytes, gap_s: float):
    """Send ``data`` on ``mesh``'s raw socket to rank ``to`` one byte at a time, ``gap_s``
    apart (a slow peer), starting once the receiving side's transfer owns its socket (so
    that side's reader thread never starts the frame). Returns (thread, stop event)."""
    import threading
    import time

    from torchport.distributed.tcp_kernels import OWN_COLL

    conn, stop = mesh.peers[to], threading.Event()

    def run(peer_conn) -> None:
        t_end = time.monotonic() + 10
        while peer_conn.own.value != OWN_COLL and time.monotonic() < t_end:
            time.sleep(0.001)
        with conn.lock:
            for k in range(len(data)):
                if stop.is_set():
                    return
                try:
                    conn.sock.send(data[k : k + 1])
                except OSError:
                    return
                time.sleep(gap_s)

    return run, stop


def test_native_transfer_sees_an_abort_while_a_peer_trickles_bytes(mesh_pair):
    """Bytes arriving every millisecond are progress, but the loop still returns each slice:
    an abort is seen within one slice, not when the frame ends (seconds later)."""
    import threading
    import time

    import torch

    from torchport.distributed.transport_tcp import XRecv
    from torchport.distributed.wire import encode_header

    m0, m1 = mesh_pair
    n, sig = 3000, (4, 3, 2, 1)
    dst = torch.zeros(n, dtype=torch.uint8)
    run, stop = _trickle(m1, 0, encode_header(Kind.COLL, 5, 1, 11, n, sig) + bytes(n), 0.001)
    feeder = threading.Thread(target=run, args=(m0.peers[1],))
    feeder.start()
    check, aborted_at = _abort_after(0.2)

    try:
        with pytest.raises(_Aborted, match="group aborted"):
            m0.transfer([], [XRecv(1, 5, 11, sig, dst.data_ptr(), n)], time.monotonic() + 10, check)
        assert time.monotonic() - aborted_at[0] < 0.5  # the whole frame takes >= 3 s
    finally:
        stop.set()
        feeder.join(10)


def test_a_frame_cut_by_a_timeout_is_completed_and_the_connection_kept(mesh_pair):
    """A transfer that times out while a frame is part-way received finishes that frame
    (within ``TIMEOUT_FINISH_S``) before the reader gets the socket back: the next frame on the
    connection is read as usual instead of payload bytes being taken for a header."""
    import threading
    import time

    import torch

    from torchport.distributed.errors import CommTimeoutError
    from torchport.distributed.transport_tcp import XRecv
    from torchport.distributed.wire import encode_header

    m0, m1 = mesh_pair
    n, sig = 150, (5, 6, 7, 8)
    payload = bytes(range(1, 151))
    dst = torch.zeros(n, dtype=torch.uint8)
    run, stop = _trickle(m1, 0, encode_header(Kind.COLL, 5, 1, 12, n, sig) + payload, 0.001)
    feeder = threading.Thread(target=run, args=(m0.peers[1],))
    feeder.start()
    try:
        with pytest.raises(CommTimeoutError, match="timed out"):
            recv = XRecv(1, 5, 12, sig, dst.data_ptr(), n)
            m0.transfer([], [recv], time.monotonic() + 0.12, lambda: None)
    finally:
        feeder.join(10)
        stop.set()
    assert bytes(dst.tolist()) == payload  # the frame was completed, into place
    assert m0.peers[1].own.value == 0
    m1.send(0, Kind.P2P, 5, 4, b"next frame")
    _, body = m0.mailbox.get((5, int(Kind.P2P), 1, 4), time.monotonic() + 5, lambda: None)
    assert bytes(body) == b"next frame"


def _reads_to_eof(sock, limit_s: float = 10.0) -> bool:
    """Whether reading ``sock`` (what is buffered, then) reaches end of file within
    ``limit_s``."""
    sock.settimeout(0.2)
    end = time.monotonic() + limit_s
    try:
        while time.monotonic() < end:
            try:
                if not sock.recv(1 << 20):
                    return True
            except TimeoutError:
                continue
            except OSError:
                return True  # (reset: ended too)
        return False
    finally:
        sock.settimeout(None)


def _stalled(m1):
    """Claim rank 1's socket to rank 0 as a collective would: its reader stops reading it, so
    rank 0's sends fill the socket buffers and stall (a receiver that stopped reading)."""
    from torchport.distributed.tcp_kernels import tcp_lib

    conn = m1.peers[0]
    assert tcp_lib().conn_claim(conn.own_addr) == 1
    return conn


def test_send_all_to_a_stalled_peer_ends_at_abort_and_cuts_the_frame_left_part_way(mesh_pair):
    """The mailbox path's sends (hybrid groups, exchanges the native transfer cannot claim)
    blocked in ``sendall`` for as long as the receiver stopped reading: an abort or the
    deadline never ended them. Now ``check()`` ends the call; a frame part-way sent gets
    ABORT_FINISH_S, then its connection is shut and reported lost."""
    import torch

    from torchport.distributed.transport_tcp import ABORT_FINISH_S

    m0, m1 = mesh_pair
    conn1 = _stalled(m1)
    lost = _Lost()
    m0.register(9, lost)
    payload = memoryview(torch.ones(8 << 20, dtype=torch.uint8).numpy())  # > socket buffers
    check, aborted_at = _abort_after(0.2)
    with pytest.raises(_Aborted):
        m0.send_all([(1, Kind.COLL, 9, 1, payload, (1, 2, 3, 4))], time.monotonic() + 30, check)
    late = time.monotonic() - aborted_at[0]
    assert late < ABORT_FINISH_S + 0.25, late
    assert any("part-way sent" in x for x in lost.lost), lost.lost
    assert _reads_to_eof(conn1.sock)  # the connection was shut: no later byte is a header


def test_send_all_to_a_stalled_peer_ends_at_its_deadline(mesh_pair):
    import torch

    from torchport.distributed.errors import CommTimeoutError
    from torchport.distributed.transport_tcp import TIMEOUT_FINISH_S

    m0, m1 = mesh_pair
    _stalled(m1)
    payload = memoryview(torch.ones(8 << 20, dtype=torch.uint8).numpy())
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match="send timed out"):
        m0.send_all([(1, Kind.COLL, 9, 1, payload, (1, 2, 3, 4))], t0 + 0.2, lambda: None)
    took = time.monotonic() - t0
    assert 0.2 <= took < 0.2 + TIMEOUT_FINISH_S + 0.3, took


def test_send_all_completes_a_frame_part_way_and_keeps_the_connection(mesh_pair, monkeypatch):
    """A frame part-way sent when the group is aborted completes if the peer reads it within
    the budget; the connection then stays (the next frame is read as usual)."""
    from torchport.distributed import transport_tcp
    from torchport.distributed.tcp_kernels import tcp_lib

    # a budget no scheduling delay of the draining thread outlasts: what is tested is that a
    # frame completed in time keeps its connection
    monkeypatch.setattr(transport_tcp, "ABORT_FINISH_S", 5.0)
    m0, m1 = mesh_pair
    conn1 = _stalled(m1)
    lost = _Lost()
    m0.register(9, lost)
    n = 8 << 20
    payload = bytes(range(256)) * (n // 256)
    head = encode_header(Kind.COLL, 9, 0, 1, n, (1, 2, 3, 4))
    got = bytearray()

    def drain() -> None:  # reads exactly the one frame off rank 1's socket (still claimed)
        end = time.monotonic() + 10
        while len(got) < HEADER_SIZE + n and time.monotonic() < end:
            got.extend(conn1.sock.recv(HEADER_SIZE + n - len(got)))

    reader = threading.Thread(target=drain)
    t0 = time.monotonic()

    def check() -> None:
        if time.monotonic() - t0 > 0.2:
            if not reader.is_alive() and not got:
                reader.start()
            raise _Aborted("group aborted")

    try:
        with pytest.raises(_Aborted):
            m0.send_all([(1, Kind.COLL, 9, 1, payload, (1, 2, 3, 4))], t0 + 30, check)
        reader.join(10)
    finally:
        tcp_lib().conn_release(conn1.own_addr)
    assert bytes(got[:HEADER_SIZE]) == head and got[HEADER_SIZE:] == payload
    assert lost.lost == []
    m0.send(1, Kind.P2P, 9, 2, b"next frame")
    _, body = m1.mailbox.get((9, int(Kind.P2P), 0, 2), time.monotonic() + 5, lambda: None)
    assert bytes(body) == b"next frame"


def test_send_all_lets_a_live_peers_frame_complete_when_another_peers_connection_breaks(
    mesh_trio,
):
    """Frames part-way to ranks 1 and 2 (both stalled); rank 1's connection is reset and rank
    2 starts reading: the call fails (CommError) after rank 2's frame completed, whose
    connection stays (a review saw the first broken peer end the wait for all, rank 2's frame
    cut at half and its connection shut)."""
    from torchport.distributed.errors import CommError

    m0, m1, m2 = mesh_trio
    c1, c2 = _stalled(m1), _stalled(m2)
    lost = _Lost()
    m0.register(9, lost)
    n = 8 << 20
    payload = bytes(range(256)) * (n // 256)
    got = bytearray()

    def drain() -> None:
        end = time.monotonic() + 10
        while len(got) < HEADER_SIZE + n and time.monotonic() < end:
            got.extend(c2.sock.recv(HEADER_SIZE + n - len(got)))

    go = threading.Event()
    reader = threading.Thread(target=lambda: (go.wait(10), drain()))
    reader.start()

    def breaker() -> None:
        time.sleep(0.2)
        c1.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        c1.sock.close()  # a reset: rank 0's next send to rank 1 fails
        go.set()

    threading.Thread(target=breaker).start()
    frames = [(q, Kind.COLL, 9, 1, payload, (1, 2, 3, 4)) for q in (1, 2)]
    with pytest.raises(CommError):
        m0.send_all(frames, time.monotonic() + 30, lambda: None)
    reader.join(10)
    assert len(got) == HEADER_SIZE + n and got[HEADER_SIZE:] == payload
    assert all("rank 2" not in x for x in lost.lost), lost.lost
    assert m0.peers[2].lock.acquire(blocking=False)  # released
    m0.peers[2].lock.release()


def test_send_all_releases_a_peers_send_lock_once_its_frames_are_out(mesh_trio):
    """A call still waiting for a stalled rank 1 no longer holds rank 2's send lock once rank
    2's frame is out: another group's send to rank 2 goes through (it timed out behind it)."""
    m0, m1, m2 = mesh_trio
    _stalled(m1)
    payload = memoryview(bytes(8 << 20))
    done: list[float] = []
    stop = threading.Event()

    def first() -> None:
        def check() -> None:
            if stop.is_set():
                raise _Aborted("group aborted")

        with contextlib.suppress(_Aborted):
            m0.send_all(
                [(q, Kind.COLL, 9, 1, payload, (1, 2, 3, 4)) for q in (1, 2)],
                time.monotonic() + 10,
                check,
            )
        done.append(time.monotonic())

    t = threading.Thread(target=first)
    t.start()
    try:
        m2.mailbox.get((9, int(Kind.COLL), 0, 1), time.monotonic() + 5, lambda: None)
        t0 = time.monotonic()
        m0.send_all([(2, Kind.COLL, 8, 1, b"other group", (0, 0, 0, 1))], t0 + 2, lambda: None)
        _, body = m2.mailbox.get((8, int(Kind.COLL), 0, 1), time.monotonic() + 5, lambda: None)
        assert bytes(body) == b"other group" and time.monotonic() - t0 < 1.0
        assert not done  # (the first call still waits for rank 1)
    finally:
        stop.set()
        t.join(10)


class _FlakySocket:
    """A connection's socket whose next ``sendmsg`` fails once ``fail`` is set (a transient
    error: ENOBUFS), everything else passed through."""

    def __init__(self, sock) -> None:
        self.sock, self.fail = sock, False

    def sendmsg(self, *args):
        if self.fail:
            self.fail = False
            raise OSError(errno.ENOBUFS, "No buffer space available")
        return self.sock.sendmsg(*args)

    def __getattr__(self, name: str):
        return getattr(self.sock, name)


def test_send_all_cuts_a_frame_part_way_whose_socket_fails_while_it_completes(mesh_pair):
    """After an abort, the frame part-way gets its time to complete; a socket error then (a
    transient one: the stream is intact but the frame is not whole) must still cut the
    connection. A review saw such a peer leave the finishing pass uncut and unreported, the
    next frame's header to be read as payload."""
    m0, m1 = mesh_pair
    conn1 = _stalled(m1)
    lost = _Lost()
    m0.register(9, lost)
    conn = m0.peers[1]
    real, flaky = conn.sock, _FlakySocket(conn.sock)
    payload = memoryview(bytes(8 << 20))
    t0 = time.monotonic()

    def check() -> None:
        if time.monotonic() - t0 > 0.2:
            flaky.fail = True
            raise _Aborted("group aborted")

    conn.sock = flaky
    try:
        with pytest.raises(_Aborted):
            m0.send_all([(1, Kind.COLL, 9, 1, payload, (1, 2, 3, 4))], t0 + 30, check)
    finally:
        conn.sock = real
    assert any("part-way sent" in x for x in lost.lost), lost.lost
    assert _reads_to_eof(conn1.sock)


class _FullSocket(_FlakySocket):
    """A connection's socket that takes no byte (its send buffer stays full)."""

    def sendmsg(self, *args):
        raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")


@pytest.mark.timeout(60)
def test_a_ring_offer_an_abort_kept_from_going_out_is_neither_used_nor_left(ring_pair):
    """The first large P2P message to a peer offers it a ring. An abort while the socket is
    full, before any byte of the offer went out: the ring is dropped (no name left in
    /dev/shm) and offered again by the next large message; a review saw it kept as if sent,
    the next message go through it and the receiver drop the connection."""
    import glob

    m0, _m1 = ring_pair
    conn = m0.peers[1]
    real = conn.sock
    rings = set(glob.glob("/dev/shm/torchport-ring-*"))
    _data, parts, source = _p2p_parts(1 << 17)
    conn.sock = _FullSocket(real)  # the socket's buffer stays full: nothing goes out
    try:
        with pytest.raises(_Aborted):
            m0.send_frames(1, Kind.P2P, 9, 1, parts, check=_abort_after(0.1)[0], source=source)
    finally:
        conn.sock = real
    assert conn.ring_out is None and not conn.ring_tried
    assert set(glob.glob("/dev/shm/torchport-ring-*")) <= rings


def test_send_all_waiting_for_a_busy_send_lock_sees_abort_and_deadline(mesh_pair):
    """The connection's send lock held elsewhere: the wait ends at the abort or the deadline,
    with nothing sent (the connection stays whole)."""
    from torchport.distributed.errors import CommTimeoutError

    m0, m1 = mesh_pair
    frames = [(1, Kind.COLL, 9, 1, b"abcd", (1, 2, 3, 4))]

    def check() -> None:
        raise _Aborted("group aborted")

    with m0.peers[1].lock:
        t0 = time.monotonic()
        with pytest.raises(_Aborted):
            m0.send_all(frames, t0 + 10, check)
        assert time.monotonic() - t0 < 0.1
        t0 = time.monotonic()
        with pytest.raises(CommTimeoutError):
            m0.send_all(frames, t0 + 0.1, lambda: None)
        assert time.monotonic() - t0 < 0.5
    m0.send(1, Kind.P2P, 9, 2, b"after")
    _, body = m1.mailbox.get((9, int(Kind.P2P), 0, 2), time.monotonic() + 5, lambda: None)
    assert bytes(body) == b"after" and m1.mailbox.take((9, int(Kind.COLL), 0, 1)) is None


def test_a_control_frame_waiting_for_its_connection_ends_at_its_deadline_or_check(mesh_pair):
    """``Mesh.send`` (the elastic mesh's control frames and fault notices) waited on the
    connection's send lock, then blocked in ``sendall``, for as long as the lock's holder or a
    receiver that stopped reading took: now the wait ends at its deadline or at ``check()``,
    nothing of the frame sent (the connection stays whole)."""
    from torchport.distributed.errors import CommTimeoutError

    m0, m1 = mesh_pair
    with m0.peers[1].lock:
        t0 = time.monotonic()
        with pytest.raises(CommTimeoutError, match="send to rank 1 timed out"):
            m0.send(1, Kind.P2P, 9, 1, b"late", deadline=t0 + 0.1)
        assert time.monotonic() - t0 < 0.1 + 0.3
        t0 = time.monotonic()
        with pytest.raises(_Aborted):
            m0.send(1, Kind.P2P, 9, 1, b"late", deadline=t0 + 10, check=_abort_after(0.1)[0])
        assert time.monotonic() - t0 < 0.1 + 0.3
    m0.send(1, Kind.P2P, 9, 2, b"after", deadline=time.monotonic() + 5)
    _, body = m1.mailbox.get((9, int(Kind.P2P), 0, 2), time.monotonic() + 5, lambda: None)
    assert bytes(body) == b"after" and m1.mailbox.take((9, int(Kind.P2P), 0, 1)) is None


def test_a_control_frame_a_stalled_peer_took_in_part_is_finished_from_a_thread(mesh_pair):
    """A frame larger than the socket buffers, to a receiver that stopped reading: ``Mesh.send``
    stayed in ``sendall`` under the connection's lock until the receiver took it all. Now the
    socket takes what it can, a thread of its own finishes the frame holding the lock, and the
    call returns at once; a frame behind it waits for the lock until its deadline (nothing of
    it sent). Once the receiver reads again the first frame arrives whole, the lock is free
    and the connection still works (nothing was cut)."""
    from torchport.distributed.errors import CommTimeoutError
    from torchport.distributed.tcp_kernels import tcp_lib

    m0, m1 = mesh_pair
    conn1 = _stalled(m1)
    lost = _Lost()
    m0.register(9, lost)
    payload = bytes(range(256)) * (32 << 10)  # 8 MiB: more than the socket buffers hold
    lock = m0.peers[1].lock
    try:
        t0 = time.monotonic()
        m0.send(1, Kind.P2P, 9, 1, payload, deadline=t0 + 5)
        assert time.monotonic() - t0 < 0.5
        assert lock.locked()  # (the thread sending the rest holds it)
        t0 = time.monotonic()
        with pytest.raises(CommTimeoutError, match="send to rank 1 timed out"):
            m0.send(1, Kind.P2P, 9, 2, b"behind", deadline=t0 + 0.2)
        assert 0.2 <= time.monotonic() - t0 < 0.2 + 0.3
    finally:
        tcp_lib().conn_release(conn1.own_addr)
    _, body = m1.mailbox.get((9, int(Kind.P2P), 0, 1), time.monotonic() + 10, lambda: None)
    assert bytes(body) == payload
    end = time.monotonic() + 5
    while lock.locked() and time.monotonic() < end:
        time.sleep(0.01)
    assert not lock.locked()
    m0.send(1, Kind.P2P, 9, 3, b"after", deadline=time.monotonic() + 5)
    _, body = m1.mailbox.get((9, int(Kind.P2P), 0, 3), time.monotonic() + 5, lambda: None)
    assert bytes(body) == b"after" and m1.mailbox.take((9, int(Kind.P2P), 0, 2)) is None
    assert lost.lost == []


def test_a_part_way_control_frame_with_no_thread_to_finish_it_shuts_the_connection(
    mesh_pair, monkeypatch
):
    """No thread for the rest of a frame the socket took in part (the mesh closing, or no thread
    to be had): the connection is shut down, so that no later byte is read as a header, the
    send lock is released and the call raises ``CommError``. The socket here takes 3 bytes."""
    from torchport.distributed.errors import CommError

    m0, _m1 = mesh_pair
    conn = m0.peers[1]
    real = conn.sock

    class _Full:
        def send(self, data: bytes, flags: int = 0) -> int:
            return real.send(bytes(data[:3]), flags)

        def shutdown(self, how: int) -> None:
            real.shutdown(how)

        def fileno(self) -> int:
            return real.fileno()

    def no_thread(*_args: object, **_kw: object) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(m0, "_spawn", no_thread)
    conn.sock = _Full()  # type: ignore[assignment]
    try:
        with pytest.raises(CommError, match="no thread to finish the frame"):
            m0.send(1, Kind.P2P, 9, 1, b"cut", deadline=time.monotonic() + 5)
    finally:
        conn.sock = real
    assert not conn.lock.locked()
    assert _reads_to_eof(real)


def test_a_frame_part_way_when_its_send_times_out_gets_the_timeout_budget(mesh_pair):
    """``send_frames`` without a source (its frames queued whole; in the engine, a zero-element
    send's header) to a receiver that stopped reading: once ``late()`` has failed the group,
    ``check()`` raises the group's error (not a ``CommTimeoutError``, but raised from one).
    The frame part-way got the abort's 50 ms (ABORT_FINISH_S) to complete before its
    connection was cut; now it gets a timeout's 200 ms (TIMEOUT_FINISH_S)."""
    import torch

    from torchport.distributed.errors import CommTimeoutError, CommunicatorErrorState
    from torchport.distributed.transport_tcp import ABORT_FINISH_S, TIMEOUT_FINISH_S

    m0, m1 = mesh_pair
    _stalled(m1)
    lost = _Lost()
    m0.register(9, lost)
    payload = memoryview(torch.ones(8 << 20, dtype=torch.uint8).numpy())  # > socket buffers
    failed: list[BaseException] = []

    def late() -> bool:  # past the send's deadline it fails the group, as engine.send_p2p's
        if time.monotonic() - t0 > 0.1 and not failed:
            failed.append(CommTimeoutError("send timed out"))
        return bool(failed)

    def check() -> None:  # the group's error once late() failed it (Communicator.check)
        if failed:
            raise CommunicatorErrorState("in error state") from failed[0]

    t0 = time.monotonic()
    with pytest.raises(CommunicatorErrorState):
        m0.send_frames(1, Kind.P2P, 9, 1, [(payload, (1, 0, 0, 0))], check=check, late=late)
    took = time.monotonic() - t0
    assert 0.1 + TIMEOUT_FINISH_S - 0.05 < took < 0.1 + TIMEOUT_FINISH_S + 0.3, took
    assert took > 0.1 + ABORT_FINISH_S + 0.1
    assert any("part-way sent" in x for x in lost.lost), lost.lost


def test_withdraw_until_gives_a_receive_in_progress_the_budget_of_the_error_in_flight():
    from torchport.distributed.errors import (
        CommAbortedError,
        CommTimeoutError,
        CommunicatorErrorState,
    )
    from torchport.distributed.shm_kernels import ABORTED as SHM_ABORTED
    from torchport.distributed.shm_kernels import MISMATCH as SHM_MISMATCH
    from torchport.distributed.shm_kernels import TIMEOUT as SHM_TIMEOUT
    from torchport.distributed.transport_shm import StepError
    from torchport.distributed.transport_tcp import (
        ABORT_FINISH_S,
        FINISH_S,
        TIMEOUT_FINISH_S,
        withdraw_until,
    )

    def until(error: BaseException | None, deadline: float) -> float:
        return withdraw_until(deadline, error) - time.monotonic()

    far = time.monotonic() + 100.0
    assert until(None, far) > 99.0  # no error: the operation's deadline
    failed = CommunicatorErrorState("in error state")
    failed.__cause__ = CommTimeoutError("timed out")
    for error, budget in [
        (CommunicatorErrorState("aborted"), ABORT_FINISH_S),
        (CommAbortedError("aborted"), ABORT_FINISH_S),
        (CommTimeoutError("timed out"), TIMEOUT_FINISH_S),
        (failed, TIMEOUT_FINISH_S),  # (the group failed by its own timeout)
        (ValueError("mismatch"), FINISH_S),
        (StepError(SHM_ABORTED), ABORT_FINISH_S),  # (a hybrid group's shared-memory step)
        (StepError(SHM_TIMEOUT), TIMEOUT_FINISH_S),
        (StepError(SHM_MISMATCH), FINISH_S),
    ]:
        left = until(error, far)
        assert budget - 0.05 < left <= budget, (error, left)
        assert until(error, time.monotonic() + 0.01) <= 0.01  # never past the deadline


def test_an_abort_while_a_reader_fills_a_posted_target_ends_within_the_abort_budget(mesh_pair):
    """The mailbox paths (hybrid groups, collectives whose sockets another one holds) withdraw
    their posted receive targets when they end, waiting for a receive in progress: until the
    operation's deadline, so a peer stopped mid-frame held an aborted collective far past the
    100 ms abort bound. Now ``PostedTargets`` gives it ABORT_FINISH_S, then shuts the
    connection. Here rank 1 sends a frame's header and 1000 of its 1 MiB, and stops."""
    import ctypes

    from torchport.distributed.errors import CommunicatorErrorState
    from torchport.distributed.transport_tcp import (
        ABORT_FINISH_S,
        FILLING,
        PostedTargets,
        Target,
    )
    from torchport.distributed.wire import encode_header

    m0, m1 = mesh_pair
    n = 1 << 20
    buf = (ctypes.c_char * n)()
    sig = (7, 1, n, 0)
    key = (9, int(Kind.COLL), 1, 5)
    target = Target(ctypes.addressof(buf), n, sig)
    conn = m1.peers[0]
    # (an aborted collective of a mailbox path: exchange, the chain broadcast, ...)
    with (
        conn.lock,
        pytest.raises(CommunicatorErrorState),
        PostedTargets(m0, time.monotonic() + 30) as posted,
    ):
        posted.post(key, target, 1)
        conn.sock.sendall(encode_header(Kind.COLL, 9, 1, 5, n, sig) + b"x" * 1000)
        end = time.monotonic() + 5
        while target.state != FILLING and time.monotonic() < end:
            time.sleep(0.005)
        assert target.state == FILLING
        t0 = time.monotonic()
        raise CommunicatorErrorState("communicator is in error state: aborted")
    took = time.monotonic() - t0
    assert ABORT_FINISH_S <= took < ABORT_FINISH_S + 0.3, took
    assert bytes(buf[:1000]) == b"x" * 1000


def test_an_empty_p2p_frame_waiting_for_its_connection_sees_abort_and_its_deadline(mesh_pair):
    """A zero-element send (a header-only frame, no source) blocked on the connection's send
    lock (held by a frame's rest going out to a receiver that stopped reading) for as long as
    that frame took: now ``check()`` and ``late()`` end the wait; nothing of it is sent."""
    from torchport.distributed.errors import CommTimeoutError

    m0, m1 = mesh_pair
    parts = [(memoryview(b""), (1, 0, 0, 0))]
    timed_out: list[float] = []

    def late() -> bool:  # past the send's deadline it fails the group, as engine.send_p2p's
        if time.monotonic() - t0 > 0.1:
            timed_out.append(time.monotonic())
            return True
        return False

    def check() -> None:  # the group's error once late() failed it
        if timed_out:
            raise CommTimeoutError("send timed out")

    with m0.peers[1].lock:
        t0 = time.monotonic()
        with pytest.raises(_Aborted):
            m0.send_frames(1, Kind.P2P, 9, 1, parts, check=_abort_after(0.1)[0])
        assert time.monotonic() - t0 < 0.1 + 0.2
        t0 = time.monotonic()
        with pytest.raises(CommTimeoutError, match="timed out"):
            m0.send_frames(1, Kind.P2P, 9, 1, parts, check=check, late=late)
        assert timed_out and time.monotonic() - t0 < 0.1 + 0.2
    m0.send_frames(1, Kind.P2P, 9, 2, parts)
    hdr, _body = m1.mailbox.get((9, int(Kind.P2P), 0, 2), time.monotonic() + 5, lambda: None)
    assert hdr.length == 0 and m1.mailbox.take((9, int(Kind.P2P), 0, 1)) is None


def test_skip_receives_leaves_a_frame_part_way_received():
    import ctypes

    from torchport.distributed.tcp_kernels import OPW
    from torchport.distributed.transport_tcp import HEADER_SIZE, _skip_receives

    # send not started, waits on a receive | send started | receives: 0, part-way, done
    rows = [(0, 100, 0, 1), (0, 100, 30, 1), (1, 100, 0, -1), (1, 100, 70, -1), (1, 8, 72, -1)]
    ops = (ctypes.c_int64 * (OPW * len(rows)))()
    for i, (kind, size, done, after) in enumerate(rows):
        ops[OPW * i : OPW * i + 8] = [3, kind, 0, 0, size, done, after, 0]
    _skip_receives(ops, 2, len(rows))
    progress = [ops[OPW * i + 5] for i in range(len(rows))]
    assert progress == [HEADER_SIZE + 100, 30, HEADER_SIZE + 100, 70, HEADER_SIZE + 8]


def test_a_foreign_frame_read_on_the_collective_thread_still_sees_an_abort(mesh_pair):
    """Another frame (P2P) found where the transfer expected its own is read by the
    collective's thread in slices: a trickling payload does not hide an abort, and the
    connection, its stream cut mid-frame, is closed rather than misread."""
    import threading
    import time

    import torch

    from torchport.distributed.transport_tcp import XRecv
    from torchport.distributed.wire import encode_header

    m0, m1 = mesh_pair
    n = 3000
    dst = torch.zeros(4, dtype=torch.uint8)
    run, stop = _trickle(m1, 0, encode_header(Kind.P2P, 5, 1, 8, n) + bytes(n), 0.001)
    feeder = threading.Thread(target=run, args=(m0.peers[1],))
    feeder.start()
    check, aborted_at = _abort_after(0.2)

    try:
        with pytest.raises(_Aborted, match="group aborted"):
            recv = XRecv(1, 5, 13, (1, 1, 1, 1), dst.data_ptr(), 4)
            m0.transfer([], [recv], time.monotonic() + 10, check)
        assert time.monotonic() - aborted_at[0] < 0.5  # the P2P frame takes >= 3 s
    finally:
        stop.set()
        feeder.join(10)
    assert m0.mailbox.take((5, int(Kind.P2P), 1, 8)) is None  # never delivered cut short


def test_check_sig_names_the_first_differing_word():
    from torchport.distributed.exchange import check_sig
    from torchport.distributed.transport_shm import MISMATCH, StepError

    check_sig(2, (1, 2, 3, 4), (1, 2, 3, 4))  # equal: nothing
    with pytest.raises(StepError) as e:
        check_sig(2, (1, 9, 3, 8), (1, 2, 3, 4))
    assert e.value.status == MISMATCH and e.value.detail == (2, 1, 9)


class _Handler:
    """A group handler that records the aborts the mesh routes to it."""

    def __init__(self) -> None:
        self.aborts: list[tuple[int, int]] = []

    def on_remote_abort(self, src: int, reason: int) -> None:
        self.aborts.append((src, reason))

    def on_peer_lost(self, src: int, error: BaseException) -> None:
        pass  # the fixture closing the meshes


def _wait_for(cond: Callable[[], bool], timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(0.005)
    return cond()


def _handled(m0, m1, tag: int) -> None:
    """Return once rank 0 handled every frame rank 1 sent before: a P2P frame sent after
    them (one connection, one reader: frames are routed in order) has arrived."""
    m1.send(0, Kind.P2P, 0, tag, b"!")
    m0.mailbox.get((0, int(Kind.P2P), 1, tag), time.monotonic() + 5.0, lambda: None)


def test_an_abort_before_the_group_registers_reaches_it_when_it_does(mesh_pair):
    """A peer fails group 42 before this rank created it: the ABORT frame is kept and handed
    to the group's handler as it registers (once); other groups see nothing."""
    m0, m1 = mesh_pair
    m1.send(0, Kind.ABORT, 42, 3)
    m1.send(0, Kind.ABORT, 42, 4)  # a second abort of the same group: the first one counts
    _handled(m0, m1, 1)
    other, late = _Handler(), _Handler()
    m0.register(7, other)
    m0.register(42, late)
    assert late.aborts == [(1, 3)] and other.aborts == []
    m0.unregister(42)
    m0.register(42, again := _Handler())
    assert again.aborts == []


def test_an_abort_of_a_closed_group_is_not_kept_for_a_later_one(mesh_pair):
    m0, m1 = mesh_pair
    m0.register(9, first := _Handler())
    m1.send(0, Kind.ABORT, 9, 1)
    assert _wait_for(lambda: first.aborts == [(1, 1)])
    m0.unregister(9)
    m1.send(0, Kind.ABORT, 9, 2)  # late: the group is gone here
    _handled(m0, m1, 2)
    m0.register(9, later := _Handler())
    assert later.aborts == []


def test_an_abort_racing_the_registration_is_handled_exactly_once(mesh_pair):
    m0, m1 = mesh_pair
    handlers = []
    for g in range(100, 140):
        m1.send(0, Kind.ABORT, g, 2)
        h = _Handler()
        m0.register(g, h)
        handlers.append(h)
    _handled(m0, m1, 3)
    assert all(h.aborts == [(1, 2)] for h in handlers)


def test_mailbox_kill_purges_a_dead_groups_frames_and_drops_later_ones():
    from torchport.distributed.transport_tcp import Mailbox

    mb = Mailbox()
    coll, p2p, ctrl = int(Kind.COLL), int(Kind.P2P), int(Kind.CTRL)
    for key in [(5, coll, 1, 0), (5, coll, 1, 1), (5, p2p, 1, 7), (5, ctrl, 1, 0), (6, coll, 1, 0)]:
        mb.deliver(key, (_hdr(0, (0, 0, 0, 0)), bytearray()))
    assert mb.kill(5) == 3 and mb.dropped == 3
    assert mb.take((5, coll, 1, 0)) is None and mb.take((5, p2p, 1, 7)) is None
    assert mb.take((5, ctrl, 1, 0)) is not None  # CTRL: a group forming under a reused id
    assert mb.take((6, coll, 1, 0)) is not None  # other groups keep theirs
    got = []
    mb.expect((5, coll, 1, 2), got.append)
    mb.deliver((5, coll, 1, 2), (_hdr(0, (0, 0, 0, 0)), bytearray()))
    assert got == [] and mb.take((5, coll, 1, 2)) is None and mb.dropped == 4
    mb.revive(5)
    mb.deliver((5, coll, 1, 3), (_hdr(0, (0, 0, 0, 0)), bytearray()))
    assert mb.take((5, coll, 1, 3)) is not None


def test_a_failed_or_closed_groups_late_frames_are_purged_and_dropped(mesh_pair):
    """Frames of a group that failed here (``bury``) or closed (``unregister``) arriving later
    no longer stay in the mailbox until the process exits; a new group of the same id
    receives again, and a stale handler cannot bury its successor."""
    m0, m1 = mesh_pair
    coll = int(Kind.COLL)
    m0.register(11, h := _Handler())
    m1.send(0, Kind.COLL, 11, 0, b"x" * 100)
    _handled(m0, m1, 10)
    m0.bury(11, h)  # the group failed: the queued frame goes, later ones are dropped
    m1.send(0, Kind.COLL, 11, 1, b"y" * 100)
    _handled(m0, m1, 11)
    assert m0.mailbox.take((11, coll, 1, 0)) is None and m0.mailbox.take((11, coll, 1, 1)) is None
    assert m0.mailbox.dropped == 2
    m0.unregister(11, h)
    m0.register(11, again := _Handler())  # the id reused: its frames are delivered
    m0.bury(11, h)  # the old handler no longer owns the id: nothing happens
    m0.unregister(11, h)
    m1.send(0, Kind.COLL, 11, 2, b"z")
    _handled(m0, m1, 12)
    assert m0.mailbox.take((11, coll, 1, 2)) is not None
    m0.unregister(11, again)
    m1.send(0, Kind.COLL, 11, 3, b"w")
    _handled(m0, m1, 13)
    assert m0.mailbox.take((11, coll, 1, 3)) is None and m0.mailbox.dropped == 3


def _frame_sent(sock, kind: Kind, body: bytes, sig=(0, 0, 0, 0)) -> None:
    sock.sendall(encode_header(kind, 5, 1, 9, len(body), sig) + body)


def test_a_reader_lingers_on_a_collective_frame_and_leaves_it_to_a_collective():
    """``tp_conn_wait`` leaves a COLL frame arriving on a free, idle socket unread for up to
    the linger: a collective taking the socket meanwhile receives it itself. Other kinds,
    and a COLL frame right after one the reader read (``stream``), are taken at once; with
    no collective coming the reader takes the frame when the linger ends."""
    import ctypes
    import socket

    from torchport.distributed.tcp_kernels import tcp_lib

    lib = tcp_lib()
    a, b = socket.socketpair()
    own = ctypes.c_int32()
    addr = ctypes.addressof(own)
    waiters = ctypes.c_int32(0)
    try:

        def wait(
            linger_us: int, stream: int, slice_ms: int = 3000, big_us: int = 0, big: int = 1 << 40
        ) -> tuple[int, float]:
            t0 = time.monotonic()
            got = lib.conn_wait(
                addr,
                a.fileno(),
                slice_ms,
                linger_us,
                big_us,
                big,
                stream,
                ctypes.addressof(waiters),
            )
            return got, time.monotonic() - t0

        def drain(n: int) -> bytes:
            return a.recv(n, socket.MSG_WAITALL)

        out: list[tuple[int, float]] = []
        reader = threading.Thread(target=lambda: out.append(wait(2_000_000, 0, 1500)))
        reader.start()
        time.sleep(0.05)
        _frame_sent(b, Kind.COLL, b"abc")
        time.sleep(0.05)
        assert lib.conn_claim(addr) == 1  # the reader left it: the collective has it
        assert drain(HEADER_SIZE + 3)[-3:] == b"abc"
        lib.conn_release(addr)
        reader.join(10)
        assert out and out[0][0] == 0  # it never took the socket (its slice ended)

        _frame_sent(b, Kind.ABORT, b"")  # not a collective's: taken at once
        got, dt = wait(2_000_000, 0)
        assert got == 1 and dt < 1.0
        drain(HEADER_SIZE)
        lib.conn_release(addr)
        _frame_sent(b, Kind.COLL, b"xy")  # back to back after a frame: taken at once
        got, dt = wait(2_000_000, 1)
        assert got == 1 and dt < 1.0
        drain(HEADER_SIZE + 2)
        lib.conn_release(addr)
        _frame_sent(b, Kind.COLL, b"z")  # nobody takes it: the reader does after the linger
        got, dt = wait(100_000, 0)
        assert got == 1 and dt >= 0.09
        drain(HEADER_SIZE + 1)
        lib.conn_release(addr)
        _frame_sent(b, Kind.COLL, b"big")  # a frame of at least `big` bytes: its own linger
        got, dt = wait(0, 0, big_us=100_000, big=3)
        assert got == 1 and dt >= 0.09
        drain(HEADER_SIZE + 3)
        lib.conn_release(addr)
        _frame_sent(b, Kind.COLL, b"sm")  # ... a smaller one is read at once (no linger_us)
        got, dt = wait(0, 0, big_us=2_000_000, big=3)
        assert got == 1 and dt < 1.0
        drain(HEADER_SIZE + 2)
        lib.conn_release(addr)
        waiters.value = 1  # a consumer waits on the mailbox: no linger
        _frame_sent(b, Kind.COLL, b"w")
        got, dt = wait(2_000_000, 0)
        assert got == 1 and dt < 1.0
        drain(HEADER_SIZE + 1)
        lib.conn_release(addr)
        waiters.value = 0
        out.clear()  # a poke ends a linger already begun
        reader = threading.Thread(target=lambda: out.append(wait(2_000_000, 0)))
        reader.start()
        _frame_sent(b, Kind.COLL, b"v")
        time.sleep(0.1)
        lib.conn_poke(addr)
        reader.join(10)
        assert out and out[0][0] == 1 and out[0][1] < 1.5
        drain(HEADER_SIZE + 1)
        lib.conn_release(addr)
    finally:
        a.close()
        b.close()


def test_a_collective_claims_a_socket_its_reader_is_reading_and_gets_it_handed_over():
    """``tp_conn_claim`` never waits: a free socket is owned at once; one whose reader is
    mid-frame is claimed (3) and handed over when the reader ends that frame
    (``tp_conn_done``), waking a collective waiting in ``tp_conn_await``; a claim given up
    (``tp_conn_unclaim``) leaves the socket to the reader, or releases it when it had been
    handed over already. A second claimant is refused (0)."""
    import ctypes

    from torchport.distributed.tcp_kernels import (
        OWN_CLAIMED,
        OWN_COLL,
        OWN_FREE,
        OWN_READER,
        tcp_lib,
    )

    lib = tcp_lib()
    own = ctypes.c_int32(OWN_FREE)
    addr = ctypes.addressof(own)
    assert lib.conn_claim(addr) == 1 and own.value == OWN_COLL
    assert lib.conn_claim(addr) == 0  # another collective owns it
    lib.conn_release(addr)
    own.value = OWN_READER  # the reader is mid-frame
    assert lib.conn_claim(addr) == -1 and own.value == OWN_CLAIMED
    assert lib.conn_claim(addr) == 0  # claimed by another collective already
    t0 = time.monotonic()
    assert lib.conn_await(addr, 20_000) == 0 and time.monotonic() - t0 >= 0.015
    lib.conn_done(addr)  # the reader's frame is in: handed over, not freed
    assert own.value == OWN_COLL and lib.conn_await(addr, 0) == 1
    lib.conn_release(addr)
    assert own.value == OWN_FREE
    own.value = OWN_READER
    assert lib.conn_claim(addr) == -1
    lib.conn_unclaim(addr)  # given up before the handover: the reader's again
    assert own.value == OWN_READER
    lib.conn_done(addr)
    assert own.value == OWN_FREE
    own.value = OWN_READER
    assert lib.conn_claim(addr) == -1
    lib.conn_done(addr)
    lib.conn_unclaim(addr)  # given up after the handover: released
    assert own.value == OWN_FREE
    own.value = OWN_READER  # a collective waiting for the handover wakes at it
    assert lib.conn_claim(addr) == -1
    out: list[tuple[int, float]] = []

    def wait() -> None:
        t = time.monotonic()
        out.append((lib.conn_await(addr, 5_000_000), time.monotonic() - t))

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.05)
    lib.conn_done(addr)
    waiter.join(10)
    assert out and out[0][0] == 1 and out[0][1] < 2.0
    lib.conn_release(addr)


def test_a_transfer_sends_while_the_reader_finishes_a_frame_then_takes_the_socket(mesh_pair):
    """A transfer whose receive socket is mid-frame on its reader thread (the peer ahead) does
    not wait for that frame before sending: its frame reaches the peer while the reader still
    reads; the socket is handed over once the frame is in, and the frame the reader read is
    the transfer's receive, settled into place."""
    import torch

    from torchport.distributed.tcp_kernels import OWN_CLAIMED, OWN_FREE, OWN_READER
    from torchport.distributed.transport_tcp import RECEIVED, XRecv, XSend
    from torchport.distributed.wire import encode_header

    m0, m1 = mesh_pair
    m0.linger_us = m0.linger_big_us = 0
    time.sleep(0.25)  # the readers' next slices use it (READER_SLICE_MS)
    n, sig, seq = 1 << 16, (7, 6, 5, 4), 21
    payload = bytes(torch.randint(0, 256, (n,), dtype=torch.uint8).tolist())
    dst = torch.zeros(n, dtype=torch.uint8)
    src = torch.tensor(list(b"hello"), dtype=torch.uint8)
    conn0, conn1 = m0.peers[1], m1.peers[0]
    out: list[object] = []

    def run() -> None:
        try:
            out.append(
                m0.transfer(
                    [XSend(1, Kind.COLL, 5, seq, src.data_ptr(), 5, sig)],
                    [XRecv(1, 5, seq, sig, dst.data_ptr(), n)],
                    time.monotonic() + 20,
                    lambda: None,
                )
            )
        except Exception as e:
            out.append(e)

    with conn1.lock:
        conn1.sock.sendall(encode_header(Kind.COLL, 5, 1, seq, n, sig) + payload[:100])
        end = time.monotonic() + 5
        while conn0.own.value != OWN_READER and time.monotonic() < end:
            time.sleep(0.001)
        assert conn0.own.value == OWN_READER  # m0's reader is part-way through the frame
        t = threading.Thread(target=run)
        t.start()
        _, body = m1.mailbox.get((5, int(Kind.COLL), 0, seq), time.monotonic() + 10, lambda: None)
        assert bytes(body) == b"hello"  # sent while the receive waits on the reader
        assert conn0.own.value == OWN_CLAIMED and not out
        conn1.sock.sendall(payload[100:])
    t.join(30)
    assert out and isinstance(out[0], list), out
    ((hdr, got),) = out[0]
    assert got is RECEIVED and hdr.sig == sig and hdr.length == n
    assert bytes(dst.tolist()) == payload
    assert conn0.own.value == OWN_FREE


def test_an_abort_while_a_claimed_socket_is_still_read_gives_the_claim_up(mesh_pair):
    """A transfer aborted while it waits for a claimed socket fails within the abort bound,
    leaves the socket to its reader (the claim given up, not a wedged ownership word), and the
    frame the reader finishes goes to the mailbox, never into the failed call's buffer."""
    import torch

    from torchport.distributed.tcp_kernels import OWN_CLAIMED, OWN_FREE, OWN_READER
    from torchport.distributed.transport_tcp import XRecv
    from torchport.distributed.wire import encode_header

    m0, m1 = mesh_pair
    m0.linger_us = m0.linger_big_us = 0
    time.sleep(0.25)  # the readers' next slices use it (READER_SLICE_MS)
    n, sig, seq = 1 << 16, (7, 6, 5, 3), 22
    dst = torch.zeros(n, dtype=torch.uint8)
    conn0, conn1 = m0.peers[1], m1.peers[0]
    aborted = threading.Event()
    out: list[object] = []

    def check() -> None:
        if aborted.is_set():
            raise _Aborted("group aborted")

    def run() -> None:
        t0 = time.monotonic()
        try:
            m0.transfer([], [XRecv(1, 5, seq, sig, dst.data_ptr(), n)], t0 + 20, check)
            out.append("returned")
        except _Aborted:
            out.append(time.monotonic())

    with conn1.lock:
        conn1.sock.sendall(encode_header(Kind.COLL, 5, 1, seq, n, sig) + b"\x07" * 100)
        end = time.monotonic() + 5
        while conn0.own.value != OWN_READER and time.monotonic() < end:
            time.sleep(0.001)
        t = threading.Thread(target=run)
        t.start()
        end = time.monotonic() + 5
        while conn0.own.value != OWN_CLAIMED and time.monotonic() < end:
            time.sleep(0.001)
        assert conn0.own.value == OWN_CLAIMED
        at = time.monotonic()
        aborted.set()
        t.join(10)
        assert out and isinstance(out[0], float) and out[0] - at < 0.1, out
        assert conn0.own.value == OWN_READER  # the reader still has its frame
        conn1.sock.sendall(b"\x07" * (n - 100))
    frame = m0.mailbox.get((5, int(Kind.COLL), 1, seq), time.monotonic() + 10, lambda: None)
    assert bytes(frame[1]) == b"\x07" * n and not dst.any()
    end = time.monotonic() + 5
    while conn0.own.value != OWN_FREE and time.monotonic() < end:
        time.sleep(0.001)
    assert conn0.own.value == OWN_FREE
    m1.send(0, Kind.P2P, 5, 23, b"next")  # the connection still works
    _, body = m0.mailbox.get((5, int(Kind.P2P), 1, 23), time.monotonic() + 5, lambda: None)
    assert bytes(body) == b"next"


def test_an_abort_while_a_reader_fills_the_calls_buffer_shuts_that_connection_in_time(
    mesh_pair, monkeypatch
):
    """The claimed socket's reader is part-way through the call's own frame, straight into the
    call's buffer (a posted target): an abort waits at most ABORT_FINISH_S for that frame, then
    shuts the connection, and the call fails with nothing written into its buffer afterwards."""
    import torch

    from torchport.distributed import transport_tcp
    from torchport.distributed.tcp_kernels import OWN_CLAIMED
    from torchport.distributed.transport_tcp import ABORT_FINISH_S, XRecv
    from torchport.distributed.wire import encode_header

    m0, m1 = mesh_pair
    m0.linger_us = m0.linger_big_us = 0
    time.sleep(0.25)  # the readers' next slices use it (READER_SLICE_MS)
    monkeypatch.setattr(transport_tcp, "POST_BYTES", 1024)  # this frame's target is posted
    n, sig, seq = 1 << 16, (7, 6, 5, 2), 24
    dst = torch.zeros(n, dtype=torch.uint8)
    conn0, conn1 = m0.peers[1], m1.peers[0]
    posted, aborted = threading.Event(), threading.Event()
    own = m0._own

    def late_own(peers: list[int]):  # the frame's header arrives between post and claim
        posted.set()
        time.sleep(0.3)
        return own(peers)

    monkeypatch.setattr(m0, "_own", late_own)
    out: list[object] = []

    def check() -> None:
        if aborted.is_set():
            raise _Aborted("group aborted")

    def run() -> None:
        try:
            m0.transfer(
                [], [XRecv(1, 5, seq, sig, dst.data_ptr(), n)], time.monotonic() + 20, check
            )
            out.append("returned")
        except _Aborted:
            out.append(time.monotonic())

    t = threading.Thread(target=run)
    with conn1.lock:
        t.start()
        assert posted.wait(5)
        conn1.sock.sendall(encode_header(Kind.COLL, 5, 1, seq, n, sig) + b"\x09" * 1000)
        end = time.monotonic() + 5
        while conn0.own.value != OWN_CLAIMED and time.monotonic() < end:
            time.sleep(0.001)
        assert conn0.own.value == OWN_CLAIMED
        assert dst[:1000].eq(9).all()  # the reader fills the call's own buffer
        at = time.monotonic()
        aborted.set()
        t.join(10)
        assert out and isinstance(out[0], float), out
        assert out[0] - at < 2 * ABORT_FINISH_S + 0.06, out[0] - at
        with contextlib.suppress(OSError):
            conn1.sock.sendall(b"\x09" * (n - 1000))
    time.sleep(0.2)
    assert not dst[1000:].any()  # nothing written after the call failed
    with pytest.raises(OSError):  # that connection was shut
        conn0.sock.send(b"x")


def test_a_quiet_target_does_not_count_as_a_mailbox_waiter():
    """A transfer's own posted targets (quiet) leave lingering readers lingering; others count."""
    from torchport.distributed.transport_tcp import Mailbox, Target

    box = Mailbox()
    key, other = (5, int(Kind.COLL), 1, 3), (5, int(Kind.COLL), 2, 3)
    box.post(key, Target(1, 8, (0, 0, 0, 0), quiet=True))
    assert box.waiters.value == 0
    box.post(other, Target(1, 8, (0, 0, 0, 0)))
    assert box.waiters.value == 1
    box.post(key, Target(1, 8, (0, 0, 0, 0)))  # replaced by a loud one
    assert box.waiters.value == 2
    box.withdraw(key, time.monotonic() + 1, lambda: None)
    box.withdraw(other, time.monotonic() + 1, lambda: None)
    assert box.waiters.value == 0


def test_a_consumer_waiting_on_the_mailbox_is_not_kept_waiting_by_the_linger(mesh_pair):
    """Collective frames that a mailbox consumer waits for (hybrid groups, the mailbox
    fallbacks) are never lingered on, whether the consumer waits first or the frame arrived
    first: a linger of a whole second here would show in the elapsed time."""
    from torchport.distributed.transport_tcp import READER_SLICE_MS

    m0, m1 = mesh_pair
    m0.linger_us = 1_000_000
    time.sleep(READER_SLICE_MS / 1000 + 0.05)  # the readers' next slices use it
    coll = int(Kind.COLL)
    got: list[float] = []

    def consume(seq: int) -> None:
        m0.mailbox.get((6, coll, 1, seq), time.monotonic() + 5, lambda: None)
        got.append(time.monotonic())

    t = threading.Thread(target=consume, args=(1,))
    t.start()
    time.sleep(0.05)  # the consumer waits first
    sent = time.monotonic()
    m1.send(0, Kind.COLL, 6, 1, b"a")
    t.join(10)
    assert got and got[0] - sent < 0.5
    assert m0.mailbox.waiters.value == 0
    m1.send(0, Kind.COLL, 6, 2, b"b")  # the frame first: the reader lingers on it ...
    time.sleep(0.05)
    asked = time.monotonic()
    consume(2)  # ... until the consumer's wait pokes it
    assert got[1] - asked < 0.5


def test_early_frame_buffers_over_the_bound_are_not_kept(mesh_pair, monkeypatch):
    """Only buffers up to SPARE_MAX_BYTES are kept for reuse (a frame bound of 256 MiB must
    not keep two such buffers per peer alive)."""
    import torch

    from torchport.distributed import transport_tcp
    from torchport.distributed.transport_tcp import XRecv

    monkeypatch.setattr(transport_tcp, "SPARE_MAX_BYTES", 2048)
    m0, m1 = mesh_pair
    conn = m0.peers[1]
    conn.spares.clear()
    coll = int(Kind.COLL)
    for seq, n in ((30, 4096), (31, 1024)):
        sig = (3, 1, n, 0)
        dst = torch.zeros(n, dtype=torch.uint8)
        m1.send(0, Kind.COLL, 5, seq, b"\5" * n, sig)
        assert _wait_for(lambda seq=seq: (5, coll, 1, seq) in m0.mailbox._frames)
        frames = m0.transfer(
            [], [XRecv(1, 5, seq, sig, dst.data_ptr(), n)], time.monotonic() + 5, lambda: None
        )
        assert frames is not None and bool((dst == 5).all())
    assert [len(b) for b in conn.spares] == [1024]


def test_an_early_frame_is_copied_into_place_and_its_buffer_reused(mesh_pair):
    """A COLL frame the reader thread read before the transfer owned the socket lands in
    place all the same; its buffer goes back to the connection (at most SPARE_BUFFERS) and the
    next early frame of that length is received into it, every byte rewritten. A frame with
    another signature is returned as received and its buffer is not reused."""
    import torch

    from torchport.distributed.transport_tcp import RECEIVED, SPARE_BUFFERS, XRecv

    m0, m1 = mesh_pair
    sig, n = (3, 1, 4096, 0), 4096
    conn = m0.peers[1]
    dst = torch.zeros(n, dtype=torch.uint8)
    coll = int(Kind.COLL)
    seen = []
    for seq, fill in ((20, 7), (21, 9), (22, 11)):
        m1.send(0, Kind.COLL, 5, seq, bytes([fill]) * n, sig)
        assert _wait_for(lambda seq=seq: (5, coll, 1, seq) in m0.mailbox._frames)
        seen.append(m0.mailbox._frames[(5, coll, 1, seq)][0][1])
        frames = m0.transfer(
            [], [XRecv(1, 5, seq, sig, dst.data_ptr(), n)], time.monotonic() + 5, lambda: None
        )
        assert frames is not None and frames[0] is not None and frames[0][1] is RECEIVED
        assert bool((dst == fill).all())
        assert 1 <= len(conn.spares) <= SPARE_BUFFERS
    assert seen[1] is seen[0] and seen[2] is seen[0]  # one buffer, reused
    spares = len(conn.spares)
    m1.send(0, Kind.COLL, 5, 23, b"\1" * n, (3, 1, 4096, 1))  # another step: a mismatch
    assert _wait_for(lambda: (5, coll, 1, 23) in m0.mailbox._frames)
    frames = m0.transfer(
        [], [XRecv(1, 5, 23, sig, dst.data_ptr(), n)], time.monotonic() + 5, lambda: None
    )
    assert frames is not None and frames[0] is not None and frames[0][1] is not RECEIVED
    assert frames[0][0].sig == (3, 1, 4096, 1) and len(conn.spares) == spares - 1


# --- the TCP drain after an abort (Mesh._finish_partial), one process over a socketpair ------


def _drain_fixture():
    """A connected socket pair, a fake mesh holding one connection (reading end ``b``), and
    the pieces ``Mesh._finish_partial`` is given."""
    import ctypes
    import socket
    import types

    a, b = socket.socketpair()
    own = ctypes.c_int32(2)  # taken by the transfer
    conn = types.SimpleNamespace(
        sock=b, own_addr=ctypes.addressof(own), peer=1, lock=threading.Lock(), seen=0.0
    )
    mesh = types.SimpleNamespace(peers={1: conn}, closed=False, shutdown_peer=lambda p: None)
    return a, b, own, conn, mesh


@pytest.mark.timeout(30)
@pytest.mark.parametrize("first", [30, 64, 64 + 1000, 64 + 49_999])
def test_abort_drain_sends_the_rest_of_a_received_frame_to_scratch(first):
    """A frame part-way received when the group failed is read to its end (the stream stays
    readable) but from the cut on into scratch: the caller's buffer keeps what had arrived and
    nothing more, and the operation is reported failed (``on_cut``) once."""
    import ctypes

    from torchport.distributed.tcp_kernels import SLICE, tcp_lib
    from torchport.distributed.transport_tcp import OPW, Mesh

    n_bytes = 50_000
    a, b, _own, conn, mesh = _drain_fixture()  # _own: the ownership word stays alive
    try:
        lib = tcp_lib()
        head = encode_header(Kind.COLL, 7, 1, 3, n_bytes, (1, 2, 3, 4))
        heads = ctypes.create_string_buffer(head + bytes(HEADER_SIZE))
        base = ctypes.addressof(heads)
        user = (ctypes.c_ubyte * n_bytes)()
        ops = (ctypes.c_int64 * OPW)(
            b.fileno(), 1, base, ctypes.addressof(user), n_bytes, 0, -1, base + HEADER_SIZE, 0, 0
        )
        frame = head + bytes([0xAA]) * n_bytes
        a.sendall(frame[:first])
        out = (ctypes.c_int64 * 1)()
        assert lib.xfer(ops, 1, 20, out) == SLICE and ops[5] == first
        a.sendall(frame[first:])  # the rest, for the drain
        cuts: list[int] = []
        lost: list = []
        stuck = Mesh._finish_partial(
            mesh, ops, 1, [conn], RuntimeError("abort"), lost, set(), 5.0, [],
            lambda: cuts.append(ops[5]),
        )  # fmt: skip
        assert cuts and len(cuts) == 1 and not lost and not stuck
        assert ops[5] == HEADER_SIZE + n_bytes  # the whole frame was read off the socket
        k = max(first - HEADER_SIZE, 0)
        got = bytes(user)
        assert set(got[:k]) <= {0xAA} and set(got[k:]) <= {0}, (k, got.count(0xAA))
        a.sendall(b"next")  # the stream is at a frame boundary
        assert b.recv(4) == b"next"
    finally:
        a.close()
        b.close()


@pytest.mark.timeout(30)
def test_abort_reports_failure_only_once_partial_sends_are_whole_and_unlocked():
    """A send part-way when the group failed still reads the caller's tensor: the failure is
    reported (``on_cut``) only after it is whole, with the transfer's send locks released
    (a Work callback that sends on the mesh must not block on them)."""
    import ctypes

    from torchport.distributed.tcp_kernels import tcp_lib
    from torchport.distributed.transport_tcp import OPW, Mesh

    n_bytes = 8 << 20  # larger than the socket buffers: the send stops part-way
    a, b, _own, conn, mesh = _drain_fixture()  # _own: the ownership word stays alive
    try:
        lib = tcp_lib()
        head = encode_header(Kind.COLL, 7, 0, 3, n_bytes, (1, 2, 3, 4))
        heads = ctypes.create_string_buffer(head)
        src = (ctypes.c_ubyte * n_bytes)()
        ctypes.memset(src, 0x5A, n_bytes)
        ops = (ctypes.c_int64 * OPW)(
            b.fileno(), 0, ctypes.addressof(heads), ctypes.addressof(src), n_bytes, 0, -1, 0, 0, 0
        )
        out = (ctypes.c_int64 * 1)()
        lib.xfer(ops, 1, 20, out)
        assert 0 < ops[5] < HEADER_SIZE + n_bytes
        got = bytearray()

        def read_all() -> None:
            end = time.monotonic() + 20
            while len(got) < HEADER_SIZE + n_bytes and time.monotonic() < end:
                got.extend(a.recv(1 << 20))

        reader = threading.Thread(target=read_all)
        conn.lock.acquire()  # held by the transfer, as Mesh.transfer holds its send locks
        seen: dict[str, object] = {}

        def on_cut() -> None:
            seen["sent"] = ops[5]
            seen["lock_free"] = conn.lock.acquire(blocking=False)
            if seen["lock_free"]:
                conn.lock.release()

        locked = [conn]
        reader.start()
        Mesh._finish_partial(
            mesh, ops, 1, [conn], RuntimeError("abort"), [], set(), 10.0, locked, on_cut
        )
        reader.join(25)
        assert seen == {"sent": HEADER_SIZE + n_bytes, "lock_free": True}, seen
        assert not locked and len(got) == HEADER_SIZE + n_bytes
        assert bytes(got[:HEADER_SIZE]) == head and set(got[HEADER_SIZE:]) == {0x5A}
    finally:
        if conn.lock.locked():
            conn.lock.release()
        a.close()
        b.close()


def test_spread_cpu_deals_a_hosts_ranks_over_the_allowed_cpus(monkeypatch):
    """A host's ranks take the allowed CPUs in turn, lowest first, wrapping when there are
    more ranks than CPUs (two each at four ranks on two CPUs)."""
    from torchport.distributed import transport_tcp

    monkeypatch.setattr(transport_tcp.os, "sched_getaffinity", lambda pid: {7, 3, 5})
    assert [transport_tcp._spread_cpu(i) for i in range(5)] == [3, 5, 7, 3, 5]
    monkeypatch.setattr(transport_tcp.os, "sched_getaffinity", lambda pid: {2})
    assert [transport_tcp._spread_cpu(i) for i in range(3)] == [2, 2, 2]


def test_only_the_first_concurrent_transfer_takes_the_ranks_cpu():
    """Two transfers pinned at once on one rank (two groups' engine threads): the first takes
    the rank's CPU, the second the CPU its thread runs on (-1), so they do not share one CPU;
    once both ended the next takes the rank's CPU again."""
    from torchport.distributed import transport_tcp

    mesh = object.__new__(transport_tcp.Mesh)  # only the pin bookkeeping, no sockets
    mesh.pin_cpu, mesh._pins, mesh._pins_lock = 1, 0, threading.Lock()
    assert mesh._pin_begin() == 1
    assert mesh._pin_begin() == -1
    mesh._pin_end()
    mesh._pin_end()
    assert mesh._pin_begin() == 1
    mesh._pin_end()
    assert mesh._pins == 0


@pytest.mark.timeout(30)
def test_tp_pin_pins_the_calling_thread_and_restores_its_mask():
    """``tp_pin(cpu)`` pins the calling thread to ``cpu`` when its mask allows it, else (a CPU
    outside the mask, or -1) to the CPU it runs on; ``tp_pin(-2)`` restores the mask it had.
    Run on a thread of its own: ``os.sched_getaffinity(0)`` reads the calling thread's mask."""
    import os

    from torchport.distributed.tcp_kernels import tcp_lib

    lib = tcp_lib()
    seen: dict[str, object] = {}

    def run() -> None:
        mask = os.sched_getaffinity(0)
        top = max(mask)
        seen["chosen"] = lib.pin(top), os.sched_getaffinity(0)
        seen["restored"] = lib.pin(-2), os.sched_getaffinity(0) == mask
        for name, cpu in (("current", -1), ("outside", max(mask) + 1), ("too_big", 1 << 20)):
            got = lib.pin(cpu)
            seen[name] = got in mask, os.sched_getaffinity(0) == {got}
            lib.pin(-2)
        seen["end"] = os.sched_getaffinity(0) == mask
        seen["top"] = top

    t = threading.Thread(target=run)
    t.start()
    t.join(20)
    top = seen.pop("top")
    assert seen == {
        "chosen": (top, {top}),
        "restored": (0, True),
        "current": (True, True),
        "outside": (True, True),
        "too_big": (True, True),
        "end": True,
    }, seen


def test_interpreter_exit_waits_for_groups_being_retired(tmp_path):
    """A group's teardown handed to the background (retire / retire_group) finishes before the
    process exits (bounded by EXIT_WAIT_S): exiting under a gloo destructor aborted in C++."""
    import subprocess
    import sys

    flag = tmp_path / "done"
    code = (
        "import pathlib, time\n"
        "from torchport.distributed._threads import in_background\n"
        f"in_background(lambda: (time.sleep(0.5), pathlib.Path({str(flag)!r}).write_text('x')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True)
    assert proc.returncode == 0, proc.stderr
    assert flag.exists()


def test_the_arena_meets_in_the_store_and_its_creator_gives_up_with_the_store(tmp_path):
    """Rank 0 waits in the store for the last rank's mapping (no polling), at most as long as
    the others wait for its path (the store's timeout, when shorter than the group's)."""
    import datetime

    import torch.distributed as dist

    from torchport.distributed.errors import CommTimeoutError
    from torchport.distributed.groups import _make_arena

    store = dist.FileStore(str(tmp_path / "store"), 3)
    arenas: dict[int, object] = {}

    def make(rank: int) -> None:
        arenas[rank] = _make_arena(store, rank, 3, 4096, 60.0, key="t/arena")

    threads = [threading.Thread(target=make, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(arenas) == [0, 1, 2]
    for a in arenas.values():
        a.close()  # type: ignore[attr-defined]
    store.set_timeout(datetime.timedelta(seconds=0.5))
    t0 = time.monotonic()
    with pytest.raises(
        CommTimeoutError, match=r"did not map the shared-memory arena within 0\.5 s"
    ):
        _make_arena(store, 0, 2, 4096, 1800.0, key="t/alone")  # no peer ever maps it
    assert time.monotonic() - t0 < 10


# -- shared-memory rings: large P2P payloads between ranks of one host ----------------------


def _ring_ends(cap: int = 1 << 16):
    """A ring's two ends in this process: the writer's (created) and the reader's (mapped)."""
    from torchport.distributed.transport_shm import ShmRing

    w = ShmRing("", cap, create=True)
    r = ShmRing(w.path, cap, create=False)
    r.unlink()
    return w, r


def _move_all(ring, buf, *, put: bool, steps, errors: list, budget_ns: int = 20_000_000) -> None:
    """Move every byte of the numpy array ``buf`` through ``ring``, pieces of the sizes
    ``steps`` cycles through, for at most 20 s; a failure is appended to ``errors``."""
    import itertools

    done, sizes, end = 0, itertools.cycle(steps), time.monotonic() + 20
    while done < len(buf) and time.monotonic() < end:
        k = min(next(sizes), len(buf) - done)
        got = ring.move(buf.ctypes.data + done, k, put=put, budget_ns=budget_ns)
        if got < 0:
            errors.append(f"{'put' if put else 'get'} saw the ring closed at {done}")
            return
        done += got
    if done != len(buf):
        errors.append(f"{'put' if put else 'get'} moved {done} of {len(buf)} bytes")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("cap", [1 << 16, 3 << 16, 1 << 20])
def test_a_ring_carries_bytes_in_order_across_its_wrap(cap):
    """Writer and reader on two threads, pieces of unrelated sizes (1 byte to several rings):
    the bytes come out as they went in, through many wraps of the ring."""
    import numpy

    w, r = _ring_ends(cap)
    try:
        data = numpy.random.default_rng(cap).integers(0, 256, 3_000_017, dtype=numpy.uint8)
        out = numpy.zeros_like(data)
        errors: list[str] = []
        t = threading.Thread(
            target=_move_all,
            args=(w, data),
            kwargs=dict(put=True, steps=[70_001, 1, 300_000], errors=errors),
        )
        t.start()
        _move_all(r, out, put=False, steps=[1, 4095, 65536, 200_000, 13], errors=errors)
        t.join(30)
        assert errors == [] and numpy.array_equal(out, data)
    finally:
        w.close()
        r.close()


def test_a_ring_move_with_no_room_or_data_returns_after_its_budget():
    import numpy

    w, r = _ring_ends()
    try:
        buf = numpy.ones(1 << 16, dtype=numpy.uint8)
        t0 = time.monotonic()
        assert r.move(buf.ctypes.data, 10, put=False, budget_ns=30_000_000) == 0  # empty
        assert 0.025 <= time.monotonic() - t0 < 2.0
        assert w.move(buf.ctypes.data, len(buf), put=True, budget_ns=30_000_000) == len(buf)
        t0 = time.monotonic()
        assert w.move(buf.ctypes.data, 10, put=True, budget_ns=30_000_000) == 0  # full
        assert 0.025 <= time.monotonic() - t0 < 2.0
        out = numpy.zeros(5, dtype=numpy.uint8)
        assert r.move(out.ctypes.data, 5, put=False, budget_ns=0) == 5 and out.tolist() == [1] * 5
        assert r.move(0, (1 << 16) - 5, put=False, budget_ns=0) == (1 << 16) - 5  # dropped
    finally:
        w.close()
        r.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("closer", ["reader", "writer"])
def test_closing_a_ring_ends_the_other_ends_wait(closer):
    """A reader waiting for data (or a writer for room) with a long budget returns -1 soon
    after the other end closes the ring; every later move of either end returns -1."""
    import numpy

    w, r = _ring_ends()
    buf = numpy.zeros(1 << 17, dtype=numpy.uint8)
    if closer == "reader":  # the writer fills the ring, then waits for room
        assert w.move(buf.ctypes.data, 1 << 16, put=True, budget_ns=0) == 1 << 16
        waiter, put, other = w, True, r
    else:
        waiter, put, other = r, False, w
    got: list[tuple[int, float]] = []

    def wait() -> None:
        t0 = time.monotonic()
        got.append(
            (
                waiter.move(buf.ctypes.data, 100, put=put, budget_ns=10_000_000_000),
                time.monotonic() - t0,
            )
        )

    t = threading.Thread(target=wait)
    t.start()
    time.sleep(0.1)
    other.close()
    t.join(5)
    assert got and got[0][0] == -1 and got[0][1] < 1.0, got
    assert waiter.move(buf.ctypes.data, 1, put=put, budget_ns=0) == -1
    waiter.close()
    assert waiter.move(buf.ctypes.data, 1, put=put, budget_ns=0) == -1  # (unmapped: no call)


def test_a_ring_is_mapped_only_from_a_ring_name_with_its_size_and_header(tmp_path):
    import os
    import secrets

    from torchport.distributed.errors import CommError
    from torchport.distributed.shm_kernels import RING_DATA
    from torchport.distributed.transport_shm import ShmRing

    with pytest.raises(CommError, match=r"refusing to map '/etc/passwd': not a torchport ring"):
        ShmRing("/etc/passwd", 1 << 16, create=False)
    name = f"/dev/shm/torchport-ring-{os.getpid()}-{secrets.token_hex(8)}"
    try:
        with open(name, "wb") as f:
            f.write(bytes(RING_DATA + 100))
        os.chmod(name, 0o600)
        with pytest.raises(CommError, match=rf"ring {name} has {RING_DATA + 100} bytes, expected"):
            ShmRing(name, 1 << 16, create=False)
        with open(name, "wb") as f:
            f.write(bytes(RING_DATA + (1 << 16)))
        with pytest.raises(CommError, match=rf"ring {name} has a foreign header"):
            ShmRing(name, 1 << 16, create=False)
        os.unlink(name)
        w, _ = _ring_ends()
        os.symlink(w.path, name)  # (the reader's _ring_ends unlinked w's name; make it again)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(name)
        raise
    try:
        with pytest.raises(OSError):  # O_NOFOLLOW: a link named like a ring is not followed
            ShmRing(name, 1 << 16, create=False)
    finally:
        os.unlink(name)
        w.close()


class _Lost(_Handler):
    """A group handler that records lost connections."""

    def __init__(self) -> None:
        super().__init__()
        self.lost: list[str] = []

    def on_peer_lost(self, src: int, error: BaseException) -> None:
        self.lost.append(str(error))


def _p2p_parts(n: int, seed: int = 0):
    """``n`` random bytes, as one P2P frame's parts and as the send's source (what
    ``Communicator.send_p2p`` hands ``Mesh.send_frames``)."""
    import numpy
    import torch

    from torchport.distributed.transport_tcp import SendSource

    data = numpy.random.default_rng(seed).integers(0, 256, n, dtype=numpy.uint8)
    return data, [(memoryview(data), (1, n, 0, 0))], SendSource(torch.from_numpy(data))


@pytest.mark.timeout(60)
def test_large_p2p_payloads_of_one_host_go_through_a_ring_small_ones_by_the_socket(ring_pair):
    """Rank 1's first P2P message from 64 KiB makes a ring and offers it (the payload is
    then taken from the ring: four times its size here), rank 0 maps it and removes its name;
    a smaller message goes by the socket; every payload arrives whole, in order."""
    import os

    import numpy

    m0, m1 = ring_pair
    big, parts, parts_src = _p2p_parts(300_007)
    small, small_parts, small_parts_src = _p2p_parts(1000, 1)
    t = threading.Thread(target=m1.send_frames, args=(0, Kind.P2P, 5, 7, parts, None, parts_src))
    t.start()
    hdr, body = m0.mailbox.get((5, int(Kind.P2P), 1, 7), time.monotonic() + 20, lambda: None)
    t.join(10)
    assert hdr.flags == 1 and numpy.array_equal(numpy.frombuffer(body, numpy.uint8), big)
    out, into = m1.peers[0].ring_out, m0.peers[1].ring_in
    assert out is not None and into is not None and not os.path.exists(out.path)
    m1.send_frames(0, Kind.P2P, 5, 8, small_parts, source=small_parts_src)
    hdr, body = m0.mailbox.get((5, int(Kind.P2P), 1, 8), time.monotonic() + 20, lambda: None)
    assert hdr.flags == 0 and bytes(body) == small.tobytes()
    assert m0.peers[1].ring_out is None  # (rank 0 sent nothing large)


def test_no_ring_without_ring_bytes_or_to_another_host(mesh_pair, ring_pair):
    import numpy

    for (m0, m1), other_host in ((mesh_pair, False), (ring_pair, True)):
        if other_host:
            m1.hosts[0] = "elsewhere"
        big, parts, parts_src = _p2p_parts(100_000)
        t = threading.Thread(
            target=m1.send_frames, args=(0, Kind.P2P, 5, 7, parts, None, parts_src)
        )
        t.start()
        hdr, body = m0.mailbox.get((5, int(Kind.P2P), 1, 7), time.monotonic() + 20, lambda: None)
        t.join(10)
        assert hdr.flags == 0 and numpy.array_equal(numpy.frombuffer(body, numpy.uint8), big)
        assert m1.peers[0].ring_out is None and m0.peers[1].ring_in is None


@pytest.mark.timeout(60)
def test_a_ring_frame_read_by_a_collectives_transfer_is_routed_from_the_ring(ring_pair):
    """A large P2P message sent just before a collective's frame: the transfer that owns the
    socket finds its header, takes its payload from the ring (bounded reads) and hands it to
    the mailbox; its own frame is still received into place."""
    import numpy

    from torchport.distributed.transport_tcp import RECEIVED

    m0, m1 = ring_pair
    big, parts, parts_src = _p2p_parts(200_000)
    t = threading.Thread(target=m1.send_frames, args=(0, Kind.P2P, 5, 77, parts, None, parts_src))
    t.start()
    frames, got = _exchange_on(ring_pair, [b"a" * 10, b"b" * 10], [(1, 1, 1, 1), (2, 2, 2, 2)])
    t.join(10)
    assert all(f[0][1] is RECEIVED for f in frames.values()), frames
    assert got[0] == b"b" * 10 and got[1] == b"a" * 10
    _, body = m0.mailbox.get((5, int(Kind.P2P), 1, 77), time.monotonic() + 10, lambda: None)
    assert numpy.array_equal(numpy.frombuffer(body, numpy.uint8), big)


@pytest.mark.parametrize(
    ("frame", "match"),
    [
        ("unoffered", r"rank 1 sent a frame through a ring it never offered"),
        ("bad_path", r"cannot map the shared-memory ring rank 1 offered \(refusing to map "),
        ("huge", r"rank 1 offered a shared-memory ring of 4294967296 bytes \(out of bounds\)"),
    ],
)
def test_a_bad_ring_frame_breaks_the_connection_with_a_clear_error(ring_pair, frame, match):
    from torchport.distributed.wire import FLAG_RING

    m0, m1 = ring_pair
    m0.register(5, h := _Lost())
    conn = m1.peers[0]
    if frame == "unoffered":
        head = encode_header(Kind.P2P, 5, 1, 9, 100, (1, 100, 0, 0), FLAG_RING)
        m1._send_frame(conn, head, b"")
    else:
        path = b"/etc/passwd" if frame == "bad_path" else b"/dev/shm/x"
        cap = 1 << 16 if frame == "bad_path" else 1 << 32
        m1._send_frame(conn, encode_header(Kind.RING, 0, 1, 0, len(path), (cap, 0, 0, 0)), path)
    assert _wait_for(lambda: bool(h.lost)), "the connection was not given up"
    assert re.search(match, h.lost[0]), h.lost


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["ring_closed", "socket_closed"])
def test_a_peer_gone_part_way_through_a_ring_frame_ends_the_read(ring_pair, monkeypatch, how):
    """Rank 1 sends a ring frame's header and part of its payload, then goes: closing its
    ring (a process that shuts down), or only its socket (a killed process leaves the ring
    open): rank 0's reader gives the connection up within a second, not waiting for ever."""
    from torchport.distributed.wire import FLAG_RING

    m0, m1 = ring_pair
    m0.register(5, h := _Lost())
    big, parts, parts_src = _p2p_parts(100_000)
    t = threading.Thread(target=m1.send_frames, args=(0, Kind.P2P, 5, 1, parts, None, parts_src))
    t.start()
    m0.mailbox.get((5, int(Kind.P2P), 1, 1), time.monotonic() + 20, lambda: None)
    t.join(10)
    conn, ring = m1.peers[0], m1.peers[0].ring_out
    assert ring is not None
    m1._send_frame(
        conn, encode_header(Kind.P2P, 5, 1, 2, 1 << 20, (1, 1 << 20, 0, 0), FLAG_RING), b""
    )
    assert ring.move(big.ctypes.data, 10_000, put=True, budget_ns=1_000_000_000) == 10_000
    time.sleep(0.1)
    t0 = time.monotonic()
    if how == "ring_closed":
        ring.close()
    else:
        monkeypatch.setattr(m1, "_close_rings", lambda conn: None)  # as if killed
        conn.sock.shutdown(socket.SHUT_RDWR)
    assert _wait_for(lambda: bool(h.lost), 5.0), "rank 0 still waits for the frame"
    assert time.monotonic() - t0 < 1.0, time.monotonic() - t0
    assert "ring from rank 1 was closed" in h.lost[0] or "closed by peer" in h.lost[0], h.lost


def test_a_peer_scribbling_on_the_ring_breaks_it_not_this_process():
    """The file is the peer's to write: a position out of bounds (or a capacity word of 0 or
    1 TiB) makes the copy refuse (RING_CORRUPT) instead of dividing by zero or writing past
    the data area; the capacity in use is the one checked when the ring was mapped."""
    import struct

    import numpy

    from torchport.distributed.shm_kernels import RING_CORRUPT, RING_HEAD_OFF, RING_TAIL_OFF

    buf = numpy.zeros(1 << 16, dtype=numpy.uint8)
    for word, value, end in (
        (RING_HEAD_OFF, -(1 << 20) - 8192, "reader"),  # head behind the reader's position
        (RING_HEAD_OFF, 1 << 40, "reader"),  # more bytes than the ring holds
        (RING_TAIL_OFF, 1 << 40, "writer"),  # the reader claims more read than was written
        (RING_TAIL_OFF, -(1 << 17), "writer"),  # ... or to be more than a ring behind
    ):
        w, r = _ring_ends()
        try:
            for cap_word in (0, 1 << 40):
                struct.pack_into("<q", r._mm, 8, cap_word)  # (ignored: the mapped size counts)
                assert w.move(buf.ctypes.data, 10, put=True, budget_ns=0) == 10
                assert r.move(buf.ctypes.data, 10, put=False, budget_ns=0) == 10
            struct.pack_into("<q", r._mm, word, value)
            side, put = (r, False) if end == "reader" else (w, True)
            assert side.move(buf.ctypes.data, 100, put=put, budget_ns=0) == RING_CORRUPT
        finally:
            w.close()
            r.close()


def test_a_writers_drain_close_leaves_the_reader_what_is_in_the_ring():
    import numpy

    for drain in (True, False):
        w, r = _ring_ends()
        try:
            data = numpy.arange(1000, dtype=numpy.uint8)
            assert w.move(data.ctypes.data, 1000, put=True, budget_ns=0) == 1000
            w.close(drain=drain)
            out = numpy.zeros(2000, dtype=numpy.uint8)
            got = r.move(out.ctypes.data, 2000, put=False, budget_ns=10_000_000)
            if drain:  # the 1000 bytes, then closed (nothing more will come)
                assert got == 1000 and numpy.array_equal(out[:1000], data)
                assert r.move(out.ctypes.data, 1, put=False, budget_ns=10_000_000) == -1
            else:
                assert got == -1
        finally:
            w.close()
            r.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mapped", [False, True])
def test_a_send_that_returned_is_delivered_after_its_mesh_closes(ring_pair, monkeypatch, mapped):
    """Rank 1's send returns once its payload is in the ring; rank 1 then closes its mesh
    (a destroyed group) while rank 0's reader lags -- before mapping the offer, or on the
    frame before: the message still arrives whole, as over the socket, and the ring's name
    is gone afterwards."""
    import os

    import numpy

    m0, m1 = ring_pair
    if mapped:  # a first message makes and maps the ring; the next one's reader lags
        _, parts, parts_src = _p2p_parts(70_000)
        t = threading.Thread(
            target=m1.send_frames, args=(0, Kind.P2P, 5, 1, parts, None, parts_src)
        )
        t.start()
        m0.mailbox.get((5, int(Kind.P2P), 1, 1), time.monotonic() + 20, lambda: None)
        t.join(10)
        deliver = m0.mailbox.deliver

        def slow(key, frame):
            if key[3] == 2:
                time.sleep(0.5)
            deliver(key, frame)

        monkeypatch.setattr(m0.mailbox, "deliver", slow)
        m1.send(0, Kind.P2P, 5, 2, b"x")  # (by the socket; its delivery lags)
    else:
        offered = m0._ring_offered

        def slow(*a):
            time.sleep(0.5)
            offered(*a)

        monkeypatch.setattr(m0, "_ring_offered", slow)
    big, parts, parts_src = _p2p_parts(1 << 16, 3)  # fits the 64 KiB ring: the send need not wait
    m1.send_frames(0, Kind.P2P, 5, 3, parts, source=parts_src)
    ring = m1.peers[0].ring_out
    assert ring is not None and ring.mapped == mapped
    m1.close()
    _, body = m0.mailbox.get((5, int(Kind.P2P), 1, 3), time.monotonic() + 20, lambda: None)
    assert numpy.array_equal(numpy.frombuffer(body, numpy.uint8), big)
    assert not os.path.exists(ring.path)


def test_stale_ring_names_of_dead_creators_are_swept_when_a_ring_is_made():
    import os
    import secrets
    import subprocess

    from torchport.distributed.transport_shm import STALE_RING_S

    proc = subprocess.Popen(["true"])  # (its pid, once it exited and was reaped: a dead one)
    proc.wait()
    dead = proc.pid
    old = time.time() - STALE_RING_S - 60
    names = {
        "dead_old": (dead, old),
        "dead_new": (dead, time.time()),
        "live_old": (os.getpid(), old),
    }
    paths = {
        k: f"/dev/shm/torchport-ring-{pid}-{secrets.token_hex(8)}" for k, (pid, _) in names.items()
    }
    try:
        for k, path in paths.items():
            with open(path, "wb"):
                pass
            os.utime(path, (names[k][1], names[k][1]))
        w, r = _ring_ends()
        w.close()
        r.close()
        assert {k: os.path.exists(p) for k, p in paths.items()} == {
            "dead_old": False,
            "dead_new": True,
            "live_old": True,
        }
    finally:
        for p in paths.values():
            with contextlib.suppress(OSError):
                os.unlink(p)
