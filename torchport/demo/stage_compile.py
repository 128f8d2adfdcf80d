"""Demo stage "compile": train and evaluate the GPT through ``torchport.compile``.

The GEMM fusion pass rewrites every ``nn.Linear`` (+ GELU, + residual) of the model into the
autotuned ``torchport::gemm`` op; the stage trains for a bounded number of steps, evaluates, checks
the compiled loss against eager on one batch, and prints which GEMM kernel won for each shape.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from torchport.compiler import compile as tp_compile
from torchport.compiler import report_count, reports
from torchport.demo.model import GPT
from torchport.demo.report import Section, StageCheckError
from torchport.demo.train import TrainConfig, train
from torchport.gemm import decisions

if TYPE_CHECKING:
    from torchport.demo import DemoContext

STEPS = 30
TIME_LIMIT_S = 20.0
# compiled vs eager loss on one batch: |compiled - eager| at most this times |eager| (the GEMM
# kernels sum in another order than ATen's; the demo's agree to 5 digits)
LOSS_RTOL = 1e-4


def check_loss(got: float, want: float) -> None:
    """Raise :class:`StageCheckError` unless the compiled loss ``got`` is within
    :data:`LOSS_RTOL` of the eager ``want`` (NaN in either fails)."""
    if not abs(got - want) <= LOSS_RTOL * abs(want):
        raise StageCheckError(
            f"compiled vs eager loss (same batch) must agree within relative {LOSS_RTOL:g}, "
            f"got {got!r} vs {want!r}"
        )


class _CompiledLoss(torch.nn.Module):
    """Something with a ``loss(x, y)`` method, as :func:`train` expects."""

    def __init__(self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self._fn = fn

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._fn(x, y)


def stage_compile(ctx: DemoContext) -> Section:
    """Train/evaluate through torchport.compile and report the GEMM autotuner's winners."""
    from torchport.demo.data import load_corpus

    if ctx.corpus is None:
        ctx.corpus = load_corpus(max_bytes=int(ctx.args.corpus_mb * (1 << 20)))
    torch.manual_seed(ctx.train_cfg.seed)
    model = copy.deepcopy(ctx.model) if ctx.model is not None else GPT(ctx.model_cfg)
    inner = getattr(ctx.args, "compile_inner", "eager")
    compiled = tp_compile(lambda x, y: model.loss(x, y), inner=inner)
    n_reports = report_count()
    cfg = TrainConfig(
        steps=STEPS,
        time_limit_s=TIME_LIMIT_S,
        batch_size=ctx.train_cfg.batch_size,
        lr=ctx.train_cfg.lr * 0.3,
        warmup=5,
        eval_every=STEPS,
        eval_batches=2,
        seed=ctx.train_cfg.seed,
    )
    t0 = time.perf_counter()
    before = dict(decisions)
    gen = torch.Generator().manual_seed(98)
    xw, yw = ctx.corpus.batch("train", cfg.batch_size, model.cfg.seq_len, gen)
    compiled(xw, yw).backward()  # compile + autotune every GEMM shape once, before timing
    model.zero_grad(set_to_none=True)
    warm_s = time.perf_counter() - t0
    res = train(model, ctx.corpus, cfg, step_fn=_CompiledLoss(compiled))
    gen = torch.Generator().manual_seed(99)
    x, y = ctx.corpus.batch("val", cfg.batch_size, model.cfg.seq_len, gen)
    with torch.no_grad():
        got, want = float(compiled(x, y)), float(model.loss(x, y))
    seconds = time.perf_counter() - t0
    s = Section(f"training through torchport.compile (inner={inner}, GEMM fusion + autotuning)")
    s.add("steps", res.steps)
    s.add("compile + autotune seconds (first step)", warm_s)
    s.add("seconds in total", seconds)
    s.add("tokens/s", res.tokens_per_s)
    s.add("validation loss before / after", f"{res.val_curve[0][1]:.4f} / {res.final_val:.4f}")
    s.add("compiled vs eager loss (same batch)", f"{got:.5f} vs {want:.5f}")
    rewrites: dict[str, int] = {}
    for rep in reports(n_reports):
        for rule, n in rep.rule_counts.items():
            rewrites[rule] = rewrites.get(rule, 0) + n
    for rule, n in sorted(rewrites.items()):
        s.add(f"rewrites: {rule}", n)
    won = {k: v for k, v in decisions.items() if before.get(k) != v}
    for (_, label), name in sorted(won.items()):
        s.add(f"kernel {label}", name)
    s.data = {"kernels": {label: name for (_, label), name in won.items()}, "rewrites": rewrites}
    check_loss(got, want)
    return s
