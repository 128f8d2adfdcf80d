"""A real ``torchrun --nproc-per-node 2`` job (``torch.distributed.run``) on the ``torchport``
backend: loopback rendezvous (``env://``, TCPStore at 127.0.0.1), bounded by a hard timeout;
the launcher's whole process group is killed on failure."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(150)
def test_torchrun_two_processes(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "1",
        "--nproc-per-node",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        "--max-restarts",
        "0",
        str(HERE / "torchrun_job.py"),
        str(tmp_path),
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log = out.decode(errors="replace")[-3000:]
    assert proc.returncode == 0, log
    res = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, x in enumerate(res):
        assert (x["rank"], x["world"], x["local_rank"]) == (r, 2, r)
        assert (x["backend"], x["transport"]) == ("torchport", "shm")
        assert x["allreduce"] == [3.0]
        assert x["broadcast"] == [float(i) for i in range(7)]
        assert x["allgather"] == [0.0, 0.0, 1.0, 1.0]
        assert x["grad_matches_mean"]  # DDP averaged the two ranks' gradients
