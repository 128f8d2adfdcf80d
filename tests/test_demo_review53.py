"""Fifty-third session review of the demo: parity checks that can fail, NaN in the dynamic
stage's difference, a diverged training run, --corpus-mb bounds, and a killed compiler's
temporaries."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch

import torchport
from torchport import demo
from torchport.demo.data import load_corpus
from torchport.demo.model import GPT, GPTConfig
from torchport.demo.report import StageCheckError
from torchport.demo.stage_compile import check_loss
from torchport.demo.stage_dynamic import check_logits, nan_max, stage_dynamic
from torchport.demo.stage_graphs import check_same_tokens
from torchport.demo.train import TrainConfig, train
from torchport.native import toolchain

TINY = GPTConfig(seq_len=8, d_model=16, n_layers=1, n_heads=2)


def _dynamic_ctx(tmp_path: Path) -> demo.DemoContext:
    torch.manual_seed(0)
    return demo.DemoContext(
        args=argparse.Namespace(),
        out_dir=tmp_path,
        model_cfg=TINY,
        train_cfg=TrainConfig(steps=1),
        model=GPT(TINY),
    )


def test_dynamic_difference_keeps_nan() -> None:
    """``max(worst, diff)`` kept 0.0 when diff was NaN: NaN logits printed a difference of 0."""
    assert math.isnan(nan_max(0.0, math.nan)) and math.isnan(nan_max(math.nan, 1.0))
    assert nan_max(2e-7, 6e-7) == 6e-7
    check_logits(6e-7, 5.0)  # the demo's usual difference passes
    with pytest.raises(StageCheckError, match=r"max \|compiled - eager\| = nan, must be <= "):
        check_logits(math.nan, 0.3)
    with pytest.raises(StageCheckError, match=r"= 0\.01, must be <= 0\.0005 .*= 5\)"):
        check_logits(0.01, 5.0)


def test_dynamic_stage_fails_on_nan_logits(tmp_path, monkeypatch) -> None:
    """The stage printed ``max |compiled - eager| logits  0`` for NaN logits and succeeded (the
    compiler is replaced by the eager model here, with a NaN in its output, to keep it cheap)."""

    def fake_compile(model, dynamic_shapes=None):
        def run(idx):
            out = model(idx).clone()
            out[0, 0, 5] = math.nan
            return out

        return run

    monkeypatch.setattr(torchport, "compile", fake_compile)
    with pytest.raises(StageCheckError, match=r"compiled logits differ from eager: .* = nan"):
        stage_dynamic(_dynamic_ctx(tmp_path))
    monkeypatch.setattr(torchport, "compile", lambda model, dynamic_shapes=None: model)
    s = stage_dynamic(_dynamic_ctx(tmp_path))
    assert dict(s.rows)["max |compiled - eager| logits"] == "0"


def test_compile_stage_loss_check() -> None:
    """The compile stage printed ``compiled vs eager loss`` and never compared them."""
    check_loss(4.38060, 4.38061)
    with pytest.raises(StageCheckError, match=r"within relative 0\.0001, got 4\.5 vs 4\.38"):
        check_loss(4.5, 4.38)
    with pytest.raises(StageCheckError, match=r"got nan vs 4\.38"):
        check_loss(math.nan, 4.38)


def test_graphs_stage_token_check() -> None:
    """``same tokens as eager  False`` was printed and the stage succeeded."""
    check_same_tokens(b"def f(x):", b"def f(x):")
    with pytest.raises(StageCheckError, match=r"difference at token 2 of 3 \(eager\) / 3 .*"):
        check_same_tokens(b"abc", b"abd")
    with pytest.raises(StageCheckError, match=r"token 2 of 2 \(eager\) / 3 \(captured\)"):
        check_same_tokens(b"ab", b"abc")


def test_a_diverged_training_run_fails_naming_the_step_and_lr() -> None:
    """--lr 100 trained on with NaN weights; the train stage succeeded and the sample stage
    died with torch.multinomial's RuntimeError."""
    corpus = load_corpus(max_bytes=50_000)
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=16, d_model=16, n_layers=1, n_heads=2))
    cfg = TrainConfig(steps=12, batch_size=4, lr=100.0, eval_every=4, warmup=1)
    with pytest.raises(
        StageCheckError,
        match=r"training diverged at step \d+ \(training loss nan\).*lower --lr "
        r"\(learning rate 100 here\)",
    ):
        train(model, corpus, cfg)
    torch.manual_seed(0)  # a sane rate trains to the end
    res = train(model.__class__(model.cfg), corpus, TrainConfig(steps=4, batch_size=4, warmup=1))
    assert res.steps == 4 and math.isfinite(res.final_val)


def _demo_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="torchport demo")
    demo.add_arguments(p)
    return p.parse_args(argv)


def test_a_diverged_run_is_a_failed_train_stage_in_the_report(tmp_path) -> None:
    tiny = ["--steps", "12", "--batch-size", "4", "--seq-len", "16", "--d-model", "16"]
    tiny += ["--layers", "1", "--heads", "2", "--eval-every", "4", "--corpus-mb", "0.05"]
    args = _demo_args([*tiny, "--lr", "100", "--stages", "sample", "--out", str(tmp_path)])
    ctx, stages = demo.prepare(args)
    with pytest.raises(StageCheckError, match="training diverged at step"):
        demo.execute(ctx, stages)
    report = json.loads((tmp_path / "report.json").read_text())
    assert [s["title"] for s in report] == [
        "corpus: Python standard library source (bytes)",
        "stage 'train' failed",
    ]
    assert report[-1]["rows"]["error"].startswith("StageCheckError: training diverged at step")
    assert report[-1]["rows"]["not run"] == "sample"


@pytest.mark.parametrize("value", ["1e308", "1e-9", "0.001", "2000"])
def test_corpus_mb_out_of_range_is_a_usage_error(value, capsys) -> None:
    """1e308 raised OverflowError from int() in stage_data; 0.001 read one file and reported
    "found only 5218 bytes of standard-library source"."""
    with pytest.raises(SystemExit) as e:
        _demo_args(["--corpus-mb", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --corpus-mb: must be between 0.01 and 1024 (MiB), got" in err


def test_corpus_mb_lower_bound_loads() -> None:
    mb = _demo_args(["--corpus-mb", "0.01"]).corpus_mb
    c = load_corpus(max_bytes=int(mb * (1 << 20)))
    assert c.train.numel() + c.val.numel() == int(0.01 * (1 << 20))


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


def test_a_timed_out_compiler_gets_sigterm_first(tmp_path) -> None:
    """_kill_group sent SIGKILL at once: gcc never ran its SIGTERM handler, which removes its
    temporaries (cc*.s, cc*.o, cc*.res in $TMPDIR), and they stayed."""
    marker = tmp_path / "cleaned-up"
    cc = tmp_path / "cc-cleans-up-on-term"
    cc.write_text(f"#!/bin/sh\ntrap 'echo yes > \"{marker}\"; exit 143' TERM\nsleep 30 & wait\n")
    cc.chmod(0o755)
    t0 = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        toolchain.run_compiler([str(cc)], timeout=0.3)
    assert time.monotonic() - t0 < toolchain.KILL_GRACE_S + 5.0
    assert marker.read_text() == "yes\n"


def test_a_compiler_ignoring_sigterm_is_killed_after_the_grace(tmp_path) -> None:
    pids = tmp_path / "pids"
    cc = tmp_path / "cc-ignores-term"
    cc.write_text(f"#!/bin/sh\ntrap '' TERM\nsleep 30 &\necho $! > \"{pids}\"\nwait\n")
    cc.chmod(0o755)
    t0 = time.monotonic()
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            toolchain.run_compiler([str(cc)], timeout=0.3)
        took = time.monotonic() - t0
        assert toolchain.KILL_GRACE_S <= took + 0.3 < toolchain.KILL_GRACE_S + 5.0
        assert _wait_gone(int(pids.read_text()), 5.0)
    finally:
        if pids.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pids.read_text()), 9)


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc")
def test_a_timed_out_gcc_leaves_no_temporaries(tmp_path, monkeypatch) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    src = tmp_path / "big.c"
    src.write_text(
        "".join(
            f"double f{i}(double x){{double y=x; for(int k=0;k<{i % 7 + 3};k++) "
            f"y=y*1.0001+{i}.0/(k+1); return y;}}\n"
            for i in range(3000)
        )
    )
    cmd = ["gcc", "-O2", "-shared", "-fPIC", str(src), "-o", str(tmp_path / "big.so")]
    with pytest.raises(subprocess.TimeoutExpired):
        toolchain.run_compiler(cmd, timeout=0.3)
    assert sorted(os.listdir(tmp)) == []


def test_a_diverged_run_is_a_clean_cli_error(tmp_path, capsys) -> None:
    """The CLI prints the failed check on one line and exits 1 (it was a traceback)."""
    from torchport.cli import main

    tiny = ["--steps", "12", "--batch-size", "4", "--seq-len", "16", "--d-model", "16"]
    tiny += ["--layers", "1", "--heads", "2", "--eval-every", "4", "--corpus-mb", "0.05"]
    rc = main(["demo", *tiny, "--lr", "100", "--stages", "sample", "--out", str(tmp_path)])
    assert rc == 1
    err = capsys.readouterr().err
    assert "torchport demo: error: training diverged at step" in err
    assert "Traceback" not in err
