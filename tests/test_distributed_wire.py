"""Frame codec of the TCP transport: round trips, every bad field, and a hypothesis fuzz."""

from __future__ import annotations

import struct

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
        ({"version": 9}, r"unsupported wire version: expected 1, got 9"),
        ({"kind": 200}, r"unknown frame kind 200"),
        ({"flags": 1}, r"reserved frame flags must be 0, got 1"),
        ({"length": 1 << 40}, r"frame length 1099511627776 exceeds the bound of 4096 bytes"),
    ],
)
def test_bad_fields_are_rejected(patch, match):
    fields = {"magic": b"TPRT", "version": 1, "kind": 5, "flags": 0, "length": 10}
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


def test_mailbox_any_source_fires_once_and_leaves_other_frames():
    from torchport.distributed.transport_tcp import Mailbox, Once

    mb, got = Mailbox(), []
    k1, k2 = (0, 6, 1, 5), (0, 6, 2, 5)
    once = Once(lambda f: got.append(f), [k1, k2])
    mb.expect_any(once)
    mb.deliver(k2, ("from2", bytearray()))
    mb.deliver(k1, ("from1", bytearray()))  # the any-source receive already fired: queued
    assert got == [("from2", bytearray())]
    later: list = []
    mb.expect(k1, later.append)
    assert later == [("from1", bytearray())]


def test_mailbox_any_source_takes_a_queued_frame_and_cancel_withdraws():
    from torchport.distributed.transport_tcp import Mailbox, Once

    mb, got = Mailbox(), []
    k1, k2 = (0, 6, 1, 0), (0, 6, 2, 0)
    mb.deliver(k2, ("early", bytearray()))
    mb.expect_any(Once(got.append, [k1, k2]))
    assert got == [("early", bytearray())]
    once = Once(got.append, [k1, k2])
    mb.expect_any(once)
    assert mb.cancel(k1, once) and not mb.cancel(k1, once)
    mb.deliver(k1, ("after-cancel", bytearray()))
    assert got == [("early", bytearray())]  # a withdrawn receive never fires


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


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 8, 13])
def test_binomial_tree_reaches_every_rank_once_in_log_rounds(world):
    from torchport.distributed.algorithms_tcp import _binomial

    links = {pos: _binomial(pos, world) for pos in range(world)}
    assert links[0][0] == -1
    for pos, (parent, kids) in links.items():
        for kid in kids:
            assert links[kid][0] == pos  # every child names this rank as its parent
        if pos:
            assert pos in links[parent][1]
    depth = {0: 0}
    for pos in range(1, world):  # a parent is always a smaller rank
        depth[pos] = depth[links[pos][0]] + 1
    assert max(depth.values()) <= (world - 1).bit_length()  # ceil(log2 world) hops
