"""The demo's training stage: train the byte-level GPT on the CPU for a bounded budget."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from torchport import config
from torchport.demo.data import Corpus
from torchport.demo.model import GPT
from torchport.demo.report import StageCheckError


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Training budget and optimiser settings (validated)."""

    steps: int = 600
    time_limit_s: float = 150.0
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 30
    eval_every: int = 50
    eval_batches: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.time_limit_s <= 0:
            raise ValueError(f"time_limit_s must be > 0, got {self.time_limit_s}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.eval_every < 1:  # (step % 0 raised ZeroDivisionError mid-training)
            raise ValueError(f"eval_every must be >= 1, got {self.eval_every}")


@dataclass
class TrainResult:
    """What training produced: loss curves and throughput."""

    steps: int = 0
    seconds: float = 0.0
    tokens: int = 0
    train_curve: list[tuple[int, float]] = field(default_factory=list)
    val_curve: list[tuple[int, float]] = field(default_factory=list)
    stopped_by: str = "steps"

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def final_val(self) -> float:
        return self.val_curve[-1][1] if self.val_curve else math.nan


@torch.no_grad()
def evaluate(model: torch.nn.Module, corpus: Corpus, cfg: TrainConfig, seq_len: int) -> float:
    """Mean validation loss over a fixed set of batches (same windows every call)."""
    gen = torch.Generator().manual_seed(1234)
    was = model.training
    model.eval()
    losses = [
        float(model.loss(*corpus.batch("val", cfg.batch_size, seq_len, gen)))  # type: ignore[operator]
        for _ in range(cfg.eval_batches)
    ]
    model.train(was)
    return sum(losses) / len(losses)


def _check_finite(what: str, step: int, loss: float, cfg: TrainConfig) -> None:
    """Raise :class:`StageCheckError` if ``loss`` is not finite: a diverged run trained on with
    NaN weights, the stage succeeded and a later one failed on them with an unrelated error."""
    if not math.isfinite(loss):
        raise StageCheckError(
            f"training diverged at step {step} ({what} loss {loss}); the loss must stay finite: "
            f"lower --lr (learning rate {cfg.lr:g} here)"
        )


def train(
    model: GPT,
    corpus: Corpus,
    cfg: TrainConfig,
    *,
    step_fn: torch.nn.Module | None = None,
) -> TrainResult:
    """AdamW with warm-up and cosine decay until ``steps`` or ``time_limit_s``, whichever first.
    A non-finite training or validation loss raises :class:`StageCheckError` naming the step.

    ``step_fn`` (default: ``model``) is the module whose ``loss`` is called, so a compiled
    wrapper of the same parameters can be trained.
    """
    runner = step_fn or model
    seq_len = model.cfg.seq_len
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    res = TrainResult()
    res.val_curve.append((0, evaluate(model, corpus, cfg, seq_len)))
    model.train()
    t0 = time.perf_counter()
    with tqdm(
        range(cfg.steps), desc="train", unit="step", disable=not config.get("progress")
    ) as bar:
        for step in bar:
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            x, y = corpus.batch("train", cfg.batch_size, seq_len, gen)
            loss = runner.loss(x, y)  # type: ignore[operator]
            loss_value = loss.item()
            _check_finite("training", step + 1, loss_value, cfg)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            res.steps = step + 1
            res.tokens += x.numel()
            res.train_curve.append((step + 1, loss_value))
            bar.set_postfix(loss=f"{loss_value:.3f}")
            if (step + 1) % cfg.eval_every == 0:
                res.val_curve.append((step + 1, evaluate(model, corpus, cfg, seq_len)))
                _check_finite("validation", step + 1, res.val_curve[-1][1], cfg)
            if time.perf_counter() - t0 >= cfg.time_limit_s:
                res.stopped_by = "time limit"
                break
    res.seconds = time.perf_counter() - t0
    if res.val_curve[-1][0] != res.steps:
        res.val_curve.append((res.steps, evaluate(model, corpus, cfg, seq_len)))
        _check_finite("validation", res.steps, res.val_curve[-1][1], cfg)
    return res
