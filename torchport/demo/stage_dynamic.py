"""Demo stage: the GPT declares its dynamic sequence length once and compiles once for all lengths."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from torchport.demo import DemoContext
from torchport.demo.report import Section, StageCheckError

# compiled vs eager logits: max |difference| at most this times max(1, max |eager logit|) (the
# demo model's are within 6e-7 of eager; float32 reassociation, not a different result)
LOGITS_RTOL = 1e-4


def nan_max(a: float, b: float) -> float:
    """``max(a, b)``, NaN if either is (Python's ``max(0.0, nan)`` is 0.0: NaN logits were
    reported as a difference of 0)."""
    return a if math.isnan(a) else b if math.isnan(b) else max(a, b)


def check_logits(worst: float, scale: float) -> None:
    """Raise :class:`StageCheckError` unless ``worst`` is within :data:`LOGITS_RTOL` of the
    logits' scale (NaN, a non-finite logit, fails)."""
    tol = LOGITS_RTOL * max(1.0, scale)
    if not worst <= tol:
        raise StageCheckError(
            f"compiled logits differ from eager: max |compiled - eager| = {worst:.4g}, must be "
            f"<= {tol:.3g} ({LOGITS_RTOL:g} * max(1, max |eager| = {scale:.4g}))"
        )


def stage_dynamic(ctx: DemoContext) -> Section:
    """Compile the demo model with a ``ShapesSpec`` on the sequence length; count recompiles."""
    import torchport
    from torchport.compiler import report_count
    from torchport.demo.model import GPT

    cfg = ctx.model_cfg
    model = ctx.model if ctx.model is not None else GPT(cfg)
    model.eval()
    T = torchport.ShapeVar("T", min=2, max=cfg.seq_len)
    spec = torchport.ShapesSpec({"idx": torchport.TensorSpec([torchport.STATIC, T])})
    compiled = torchport.compile(model, dynamic_shapes=spec)
    lengths = sorted({max(2, (cfg.seq_len * k) // 10) for k in range(1, 11)} | {2, 3, cfg.seq_len})
    gen = torch.Generator().manual_seed(ctx.train_cfg.seed)
    n0 = report_count()
    times: list[float] = []
    worst = scale = 0.0
    with torch.no_grad():
        for t in lengths:
            idx = torch.randint(0, cfg.vocab, (2, t), generator=gen)
            t0 = time.perf_counter()
            out = compiled(idx)
            times.append(time.perf_counter() - t0)
            want = model(idx)
            worst = nan_max(worst, (out - want).abs().max().item())
            scale = max(scale, want.abs().nan_to_num(0.0).max().item())
    compiles = report_count() - n0
    s = Section("dynamic shapes: one compile for every sequence length (ShapesSpec)")
    s.add("spec", f"idx: [STATIC, T], 2 <= T <= {cfg.seq_len}")
    s.add("sequence lengths run", len(lengths))
    s.add("graphs compiled", compiles)
    s.add("recompiles across lengths", max(0, compiles - 1))
    s.add("first call incl. compile (s)", times[0])
    s.add(
        "later calls, median (ms)",
        sorted(times[1:])[len(times[1:]) // 2] * 1e3 if len(times) > 1 else 0.0,
    )
    s.add("max |compiled - eager| logits", worst)
    s.data = {"lengths": lengths, "call_s": times, "compiles": compiles}
    check_logits(worst, scale)
    return s
