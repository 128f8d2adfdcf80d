"""Cross-host collectives: ranks on two fake hosts (network namespaces joined by a veth pair).

Each "host" is a network namespace with its own address and its own hostname (a UTS
namespace), so the backend sees two hosts: traffic between them goes over TCP across the veth
link, while ranks on the same host may share memory. Needs root (``ip netns``); skipped
otherwise. The namespaces are removed and every process is killed even on failure.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import dist_workers as W
import pytest
from dist_harness import run_world, stop_forkserver_after_module  # noqa: F401 (autouse fixture)

pytestmark = pytest.mark.timeout(150)


def _ip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


@pytest.fixture(scope="module")
def two_hosts():
    """Two namespaces ``tpA<pid>`` (10.x.y.1) and ``tpB<pid>`` (10.x.y.2) linked by a veth."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    pid = os.getpid()
    a, b = f"tpA{pid}", f"tpB{pid}"
    net = f"10.{200 + pid % 50}.{(pid // 50) % 250}"
    ips = (f"{net}.1", f"{net}.2")
    made: list[str] = []
    try:
        for ns in (a, b):
            r = _ip("netns", "add", ns)
            if r.returncode:
                pytest.skip(f"cannot create a network namespace here: {r.stderr.strip()}")
            made.append(ns)
        va, vb = f"tpa{pid}"[:15], f"tpb{pid}"[:15]
        steps = [
            ("link", "add", va, "type", "veth", "peer", "name", vb),
            ("link", "set", va, "netns", a),
            ("link", "set", vb, "netns", b),
            ("-n", a, "addr", "add", f"{ips[0]}/24", "dev", va),
            ("-n", b, "addr", "add", f"{ips[1]}/24", "dev", vb),
            ("-n", a, "link", "set", va, "up"),
            ("-n", b, "link", "set", vb, "up"),
            ("-n", a, "link", "set", "lo", "up"),
            ("-n", b, "link", "set", "lo", "up"),
        ]
        for s in steps:
            r = _ip(*s)
            if r.returncode:
                pytest.skip(f"cannot build the veth link ({' '.join(s)}): {r.stderr.strip()}")
        yield (a, ips[0], f"tphostA{pid}"), (b, ips[1], f"tphostB{pid}")
    finally:
        for ns in made:
            _ip("netns", "del", ns)


def test_collectives_across_two_hosts(two_hosts):
    """4 ranks, 2 per host: every collective vs the reference; same-host subgroups use shm."""
    ha, hb = two_hosts
    hosts = [ha, ha, hb, hb]
    env = {
        "TORCHPORT_DIST_ADDR": ha[1],
        "TORCHPORT_DIST_TCP_CHUNK_BYTES": "262144",
        "TORCHPORT_DIST_MAX_FRAME_BYTES": "4096",  # (frames of 260 KiB: p2p in several)
    }
    res = run_world(W.cross_host_job, 4, hosts, timeout=120, env=env)
    for rank, r in enumerate(res):
        assert r["bad"] == [], (rank, r["bad"])
        assert r["address"].startswith(hosts[rank][1] + ":"), r["address"]
        assert len(r["peer_hosts"]) == 2
        assert r["local_transport"] == "shm"
        assert r["transport"] == "hybrid" and r["sub_transport"] == "hybrid"
        # CommunicatorErrorState: a peer's ABORT reached the group before this rank's call
        # (it is kept for a group not registered yet, so the call fails at once, no hang)
        typed = ("CollectiveMismatchError", "RemoteError", "CommunicatorErrorState")
        assert r["mismatch"] in typed, r["mismatch"]
    assert [r["mismatch"] for r in res].count("CollectiveMismatchError") >= 1
    for r in res[1:]:
        assert "rank 0 called abort()" in r["abort"]["msg"], r["abort"]
        assert r["abort"]["t_fail"] - res[0]["abort"]["t_abort"] < 0.1


@pytest.mark.parametrize("how", ["abort", "timeout"])
def test_a_hybrid_groups_sends_to_a_stopped_host_end_at_abort_and_at_the_timeout(two_hosts, how):
    """Rank 0's sends across hosts go through the mailbox path; with host B's ranks stopped
    they waited in a blocking ``sendall`` through an abort and past the group timeout."""
    ha, hb = two_hosts
    env = {"TORCHPORT_DIST_ADDR": ha[1]}
    r = run_world(W.cross_host_stop_job, 4, [ha, ha, hb, hb], how, timeout=60, env=env)[0]
    if how == "abort":
        assert r["error"] == "CommAbortedError" and r["took"] < 0.3 + 0.2, r
    else:
        assert r["error"] == "CommTimeoutError" and 1.4 < r["took"] < 1.5 + 0.5, r
