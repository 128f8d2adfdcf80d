"""Fault-tolerance review 50: the lighthouse CLI's heartbeat, and a gloo replica's unreachable store.

``python -m torchport.distributed.ft.lighthouse`` had no ``--heartbeat`` flag (the constructor
takes one): a lighthouse started from the command line always evicted after three of
``TORCHPORT_FT_HEARTBEAT``'s periods. And a gloo ``Manager`` whose quorum named a store nobody
answered let torch's ``DistNetworkError`` escape ``start_quorum`` untyped, unretried.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from tests.test_ft_review import _manager
from torchport.distributed._control import connect, recv_msg, send_msg
from torchport.distributed.errors import CommError, TorchportDistError
from torchport.distributed.ft import Lighthouse, QuorumError
from torchport.distributed.ft.lighthouse import main

SECRET = b"q" * 32
CLI = [sys.executable, "-m", "torchport.distributed.ft.lighthouse", "--port", "0"]
BAD = re.compile(
    r"argument --heartbeat: the value must be a finite number of seconds > 0 and at most \S+, "
)


# -- 1: the CLI's --heartbeat ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "value,shown",
    [
        ("0", "0.0"),
        ("-1", "-1.0"),
        ("nan", "nan"),
        ("inf", "inf"),
        ("1e308", "1e+308"),
        ("abc", "'abc'"),
        ("", "''"),
    ],
)
def test_cli_refuses_a_bad_heartbeat_naming_the_flag_and_the_value(capsys, value, shown):
    with pytest.raises(SystemExit) as exit_:
        main(["--port", "0", "--heartbeat", value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert BAD.search(err) and err.rstrip().endswith(f"got {shown}"), err


def test_cli_refuses_a_bad_join_timeout_and_min_replicas_with_a_usage_error(capsys):
    """(--join-timeout -1 and --min-replicas 0 were tracebacks from the constructor.)"""
    for argv, message in (
        (["--join-timeout", "-1"], "argument --join-timeout: the value must be a finite number "
         "of seconds >= 0"),
        (["--min-replicas", "0"], "min_replicas must be an int >= 1, got 0"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            main(["--port", "0", *argv])
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


def test_cli_refuses_a_bad_port_or_host_with_a_usage_error(capsys):
    """(--port 70000 was an OverflowError traceback, --host 256.1.1.1 a gaierror one.)"""
    for argv, message in (
        (["--port", "70000"], "argument --port: must be <= 65535, got 70000"),
        (["--port", "-5"], "argument --port: must be >= 0, got -5"),
        (["--port", "x"], "argument --port: expected an integer, got 'x'"),
        (["--host", "256.1.1.1", "--port", "0"], "cannot listen on --host '256.1.1.1' --port 0"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert message in capsys.readouterr().err


def _spawn(*args: str, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [*CLI, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **env},
    )


def _first_line(proc: subprocess.Popen[str], timeout: float) -> str:
    """The child's first stdout line, or "" if none came within ``timeout``."""
    box: list[str] = []
    assert proc.stdout is not None
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return box[0] if box else ""


def test_cli_process_refuses_a_bad_heartbeat_and_evicts_after_three_good_ones():
    """Two lighthouse processes (started together: each takes seconds to import torch). One
    given ``--heartbeat 0`` exits 2 with the usage error. One started with ``--heartbeat 0.05``
    (the environment's period: 30 s) evicts a replica silent for 1 s: its next beat is answered
    "evicted". Before, both exited with "unrecognized arguments: --heartbeat"."""
    env = {"TORCHPORT_SECRET": SECRET.decode(), "TORCHPORT_FT_HEARTBEAT": "30"}
    bad = _spawn("--heartbeat", "0", env=env)
    good = _spawn("--heartbeat", "0.05", env=env)
    hb = None
    try:
        line = _first_line(good, 90)
        found = re.match(r"lighthouse on (\S+):(\d+)", line)
        assert found, (line, good.poll())
        hb = connect((found[1], int(found[2])), SECRET, "lighthouse", timeout=10)
        hb.settimeout(10)
        send_msg(hb, {"t": "hb", "rid": "quiet", "period": 0.01})  # (its own: shorter)
        time.sleep(1.0)  # silent: 20 of the lighthouse's periods, 1/30 of the environment's
        send_msg(hb, {"t": "b"})
        assert recv_msg(hb).get("t") == "evicted"
        _, err = bad.communicate(timeout=90)
        assert bad.returncode == 2 and BAD.search(err) and "got 0.0" in err, err
    finally:
        if hb is not None:
            hb.close()
        for proc in (bad, good):
            proc.kill()
            proc.wait(10)


# -- 2: an unreachable gloo store ----------------------------------------------------------------
def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    s.close()
    return port


def test_unreachable_gloo_store_is_a_typed_retried_error_naming_the_address(monkeypatch):
    """The quorum names a store port nobody listens on: torch's DistNetworkError escaped
    start_quorum at the first attempt. It is a CommError now (retried until quorum_timeout),
    naming the store's address and the requirement, chained to torch's error."""
    lh = Lighthouse(min_replicas=1, join_timeout=0.05, heartbeat=5.0, secret=SECRET)
    dead = _free_port()
    monkeypatch.setattr(lh, "_gloo_store", lambda infos: dead)
    mgr = _manager(lh, SECRET, "r0", timeout=0.5, quorum_timeout=1.0)
    try:
        with pytest.raises(QuorumError, match=r"no quorum within 1\.0 s") as err:
            mgr.start_quorum()
        cause = err.value.__cause__
        assert isinstance(cause, CommError) and isinstance(err.value, TorchportDistError)
        assert re.search(
            rf"building the gloo group for quorum \d+ needs the lighthouse's store at "
            rf"127\.0\.0\.1:{dead} reachable within timeout=0\.5 s: Dist\w*Error",
            str(cause),
        ), cause
        assert isinstance(cause.__cause__, dist.DistError | RuntimeError)
        assert sum("needs the lighthouse's store" in m for m in mgr.metrics.log) >= 1
    finally:
        mgr.shutdown()
        lh.close()
