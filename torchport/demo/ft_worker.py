"""One replica of fault-tolerant data-parallel training, with faults injected at (replica, step).

Run as ``python -m torchport.demo.ft_worker --lighthouse HOST:PORT --rid r1 ...``; used by the FT
demo stage, the tests and ``bench/bench_ft.py``. The replica trains until it has committed
``--steps`` steps *and* the quorum holds ``--world`` replicas (so a restarted replica always gets
to rejoin and heal), then writes its parameters' raw bytes to ``--out`` and a JSON summary next to it.

Faults (``--fault KIND --fault-step S``, fired once at the first step >= S, after backward and
before the commit vote):
``kill`` (SIGKILL itself), ``stop`` (SIGSTOP itself; the parent sends SIGCONT), ``close`` (close
its lighthouse sockets), ``slow`` (sleep ``--slow-s``).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import os
import signal
import time
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from torchport.distributed.flight_recorder import FlightRecorder, enable_signal_dump
from torchport.distributed.ft import DistributedDataParallel, Manager, OptimizerWrapper


def build_model(kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return nn.Sequential(
            nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8)
        )
    from torchport.demo.model import GPT, GPTConfig

    return GPT(GPTConfig(seq_len=64, d_model=64, n_layers=2, n_heads=4))


def make_batch(
    kind: str, step: int, rid: str, corpus: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(step * 1000003 + zlib.crc32(rid.encode()))
    if kind == "mlp":
        x = torch.randn(64, 32, generator=g)
        return x, torch.sin(x[:, :8] * 2.0)
    assert corpus is not None
    starts = torch.randint(0, corpus.numel() - 65, (16,), generator=g)
    xs = torch.stack([corpus[s : s + 65] for s in starts.tolist()]).long()
    return xs[:, :-1], xs[:, 1:]


def loss_of(kind: str, model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    x, y = batch
    out = model(x)
    if kind == "mlp":
        return nn.functional.mse_loss(out, y)
    logits = out[0] if isinstance(out, tuple) else out
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def stage_corpus(path: Path | None = None) -> torch.Tensor:
    """The gpt replicas' training bytes (1 MB of standard-library source, train split); with
    ``path``, also written there for ``--corpus``."""
    from torchport.demo.data import load_corpus

    train = load_corpus(max_bytes=1 << 20).train
    if path is not None:
        path.write_bytes(train.to(torch.uint8).numpy().tobytes())
    return train


def spawn(argv: list[str]) -> Any:
    """Start a replica as a process forked from a preloaded forkserver (fast restarts)."""
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torchport.demo.ft_worker"])
    proc = ctx.Process(target=main, args=(argv,), daemon=True)
    proc.start()
    return proc


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--rid", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--world", type=int, default=3)
    p.add_argument("--model", choices=("mlp", "gpt"), default="mlp")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fault", choices=("none", "kill", "stop", "close", "slow"), default="none")
    p.add_argument("--fault-step", type=int, default=-1)
    p.add_argument("--slow-s", type=float, default=0.5)
    p.add_argument("--step-sleep", type=float, default=0.0, help="extra seconds per step")
    p.add_argument("--out", required=True)
    p.add_argument("--fr-dir", default="")
    p.add_argument("--timeout", type=float, default=20.0)
    p.add_argument("--backend", choices=("torchport", "gloo"), default="torchport")
    p.add_argument(
        "--steps-file",
        default="",
        help="if this file appears, the step count it holds replaces --steps (timed runs end "
        "at one step number on every replica)",
    )
    p.add_argument(
        "--corpus",
        default="",
        help="gpt: file holding the training bytes, staged by the driver (a restarted replica "
        "then starts in milliseconds); default: read standard-library sources",
    )
    a = p.parse_args(argv)
    faulthandler.enable()  # a crash of a replica leaves its threads' stacks on stderr
    torch.set_num_threads(1)

    model = build_model(a.model, a.seed + zlib.crc32(a.rid.encode()))  # differ on purpose
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    corpus = None
    if a.model == "gpt" and a.corpus:
        corpus = torch.frombuffer(bytearray(Path(a.corpus).read_bytes()), dtype=torch.uint8).long()
    elif a.model == "gpt":
        corpus = stage_corpus()
    rec = None
    if a.fr_dir:
        rec = FlightRecorder(dump_dir=a.fr_dir)
        rec.set_identity(int(a.rid.lstrip("r") or 0), a.world)
        enable_signal_dump(recorder=rec)

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load(s: dict[str, Any]) -> None:
        model.load_state_dict(s["model"])
        opt.load_state_dict(s["optim"])

    mgr = Manager(
        lighthouse=a.lighthouse,  # (Manager parses host:port, [v6]:port, http://)
        replica_id=a.rid,
        state_dict=state,
        load_state_dict=load,
        timeout=a.timeout,
        quorum_timeout=4 * a.timeout,
        recorder=rec,
        backend=a.backend,
    )
    ddp = DistributedDataParallel(model, mgr, bucket_cap_mb=0.05)
    optim = OptimizerWrapper(mgr, opt)
    progress = Path(a.out + ".progress")
    progress_tmp = Path(a.out + ".progress.tmp")
    steps_file = Path(a.steps_file) if a.steps_file else None
    target = a.steps
    fired = False
    t0 = time.perf_counter()
    losses: list[float] = []
    while True:
        optim.zero_grad()
        step = mgr.current_step()
        loss = loss_of(a.model, ddp, make_batch(a.model, step, a.rid, corpus))
        loss.backward()
        if not fired and a.fault != "none" and step >= a.fault_step:  # may have healed past it
            fired = True
            if a.fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif a.fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif a.fault == "close":
                mgr._inject_close()
            elif a.fault == "slow":
                time.sleep(a.slow_s)
        committed = optim.step()
        if committed:
            losses.append(float(loss.detach()))
        if a.step_sleep:
            time.sleep(a.step_sleep)
        progress_tmp.write_text(str(mgr.current_step()))
        os.replace(progress_tmp, progress)  # a reader never sees a half-written count
        if steps_file is not None and steps_file.exists():
            with contextlib.suppress(ValueError):  # the driver writes it atomically
                target = int(steps_file.read_text())
        # stop only after a step committed by the full world, so a rejoiner has healed
        if committed and mgr.current_step() >= target and mgr.num_participants() == a.world:
            break
    seconds = time.perf_counter() - t0
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    Path(a.out).write_bytes(flat.numpy().tobytes())
    m = mgr.metrics
    summary = {
        "rid": a.rid,
        "steps": mgr.current_step(),
        "seconds": seconds,
        "commits": m.commits,
        "quorums": m.quorums,
        "quorums_with_commit": m.quorums_with_commit,
        "aborted_steps": m.aborted_steps,
        "heals": m.heals,
        "heal_bytes": m.heal_bytes,
        "heal_s": m.heal_s,
        "group_build_s": m.group_build_s,
        "failures": m.failures,
        "losses": losses,
        "log": m.log,
    }
    Path(a.out + ".json").write_text(json.dumps(summary))
    if rec is not None:
        rec.dump(
            "end of training", path=Path(a.fr_dir) / "end" / f"rank_{a.rid.lstrip('r') or 0}.json"
        )
    # leaves the lighthouse's membership (peers are not told it died: they wrote failure dumps
    # over the real ones at every normal end) and waits, bounded, for a failure dump its
    # listener thread is writing: os._exit cut one off, leaving an empty temporary file
    mgr.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
