"""``torchport demo``: the end-to-end showcase, built from stages.

Each stage is a function ``(ctx) -> Section`` listed in :data:`STAGES`; later capabilities add their
stage (compiled kernels, fault-tolerant data-parallel training, quantized decoding) to that list.
Stages share a :class:`DemoContext` holding options, the corpus and the trained model.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from torchport.cli import int_at_least, positive_float
from torchport.demo.data import Corpus, load_corpus
from torchport.demo.model import GPT, GPTConfig, generate
from torchport.demo.report import Section, plot_curves, render_table, write_report
from torchport.demo.stage_dynamic import stage_dynamic
from torchport.demo.stage_graphs import stage_graphs
from torchport.demo.stage_quant import stage_quant
from torchport.demo.train import TrainConfig, TrainResult, evaluate, train


@dataclass
class DemoContext:
    """State shared by the demo's stages."""

    args: argparse.Namespace
    out_dir: Path
    model_cfg: GPTConfig
    train_cfg: TrainConfig
    corpus: Corpus | None = None
    model: GPT | None = None
    result: TrainResult | None = None
    sections: list[Section] = field(default_factory=list)


def stage_data(ctx: DemoContext) -> Section:
    """Load the standard-library corpus."""
    t0 = time.perf_counter()
    ctx.corpus = load_corpus(max_bytes=int(ctx.args.corpus_mb * (1 << 20)))
    s = Section("corpus: Python standard library source (bytes)")
    s.add("files", ctx.corpus.files)
    s.add("train bytes", ctx.corpus.train.numel())
    s.add("validation bytes", ctx.corpus.val.numel())
    s.add("load time (s)", time.perf_counter() - t0)
    return s


def stage_train(ctx: DemoContext) -> Section:
    """Train the byte-level GPT and plot its loss."""
    assert ctx.corpus is not None
    torch.manual_seed(ctx.train_cfg.seed)
    ctx.model = GPT(ctx.model_cfg)
    ctx.result = res = train(ctx.model, ctx.corpus, ctx.train_cfg)
    png = plot_curves(
        ctx.out_dir / "loss.png",
        res.train_curve,
        res.val_curve,
        f"byte-level GPT, {ctx.model.num_params() / 1e6:.2f} M params",
    )
    s = Section("training (eager, CPU)")
    s.add("parameters", ctx.model.num_params())
    s.add("steps", res.steps)
    s.add("stopped by", res.stopped_by)
    s.add("seconds", res.seconds)
    s.add("tokens/s", res.tokens_per_s)
    s.add("initial validation loss", res.val_curve[0][1])
    s.add("final validation loss", res.final_val)
    s.add("loss curve", str(png))
    s.data = {"train_curve": res.train_curve, "val_curve": res.val_curve}
    return s


def stage_sample(ctx: DemoContext) -> Section:
    """Sample text from the trained model."""
    assert ctx.model is not None and ctx.corpus is not None
    ctx.model.eval()
    gen = torch.Generator().manual_seed(ctx.train_cfg.seed)
    prompt = b"def "
    t0 = time.perf_counter()
    text = generate(ctx.model, prompt, ctx.args.sample_tokens, gen=gen)
    dt = time.perf_counter() - t0
    s = Section("sample (eager decode with KV cache)")
    s.add("tokens", ctx.args.sample_tokens)
    s.add("tokens/s", ctx.args.sample_tokens / dt if dt > 0 else 0.0)
    s.add("validation loss", evaluate(ctx.model, ctx.corpus, ctx.train_cfg, ctx.model_cfg.seq_len))
    s.text = (prompt + text).decode("utf-8", errors="replace")
    (ctx.out_dir / "sample.txt").write_text(s.text)
    return s


Stage = Callable[[DemoContext], Section]


def _stage_compile(ctx: DemoContext) -> Section:
    from torchport.demo.stage_compile import stage_compile

    return stage_compile(ctx)


def _stage_ft(ctx: DemoContext) -> Section:
    from torchport.demo.stage_ft import stage_ft

    return stage_ft(ctx)


STAGES: list[tuple[str, Stage]] = [
    ("data", stage_data),
    ("train", stage_train),
    ("sample", stage_sample),
    ("compile", _stage_compile),  # GEMM engine through torchport.compile
    ("dynamic", stage_dynamic),  # @dynamic_spec: one graph for every sequence length
    ("quant", stage_quant),  # NVFP4 weights, decode GEMV
    ("graphs", stage_graphs),  # generation as a captured while_loop
    ("ft", _stage_ft),  # fault-tolerant data-parallel training with a SIGKILL
]


# the shortest sequence every stage can run with: sampling keeps half of it as context, the
# graphs stage generates seq_len - 4 tokens after a 4-byte prompt
MIN_SEQ_LEN = 8
# a stage's prerequisites, added when only the stage is named (it read what they build)
NEEDS = {"train": ("data",), "sample": ("data", "train")}
# The size options' bounds, 8-32 times the defaults: a typo (12800 for 128) allocated until an
# untyped RuntimeError. Each alone, the others at their defaults, trains in a few GB (d_model
# 2048: ~200 M parameters, ~3.2 GB with AdamW's state); bounds per option, not a guarantee for
# every combination.
MAX_BATCH_SIZE = 1024
MAX_SEQ_LEN = 4096
MAX_D_MODEL = 2048
MAX_LAYERS = 64
MAX_SAMPLE_TOKENS = 1 << 14
# --corpus-mb: load_corpus needs 10,000 bytes (0.0095 MiB) or reports "found only N bytes of
# standard-library source" (less than the standard library holds); above the bound is more than
# any standard library holds (~30 MiB: reading stops at its end), and 1e308 MiB overflowed int()
MIN_CORPUS_MB = 0.01
MAX_CORPUS_MB = 1024.0


def _corpus_mb(text: str) -> float:
    """An argparse ``type=`` for ``--corpus-mb``: a number in [MIN_CORPUS_MB, MAX_CORPUS_MB]."""
    v = positive_float(text)
    if not MIN_CORPUS_MB <= v <= MAX_CORPUS_MB:
        raise argparse.ArgumentTypeError(
            f"must be between {MIN_CORPUS_MB:g} and {MAX_CORPUS_MB:g} (MiB), got {v:g}"
        )
    return v


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's command-line options (values checked here: a bad one is a usage error)."""
    p.add_argument("--out", default="torchport-demo", help="output folder (report, PNG, sample)")
    p.add_argument("--steps", type=int_at_least(1), default=600, help="max training steps")
    p.add_argument("--time-limit", type=positive_float, default=150.0, help="max training seconds")
    p.add_argument("--batch-size", type=int_at_least(1, at_most=MAX_BATCH_SIZE), default=32)
    p.add_argument("--seq-len", type=int_at_least(MIN_SEQ_LEN, at_most=MAX_SEQ_LEN), default=128)
    p.add_argument("--d-model", type=int_at_least(1, at_most=MAX_D_MODEL), default=128)
    p.add_argument("--layers", type=int_at_least(1, at_most=MAX_LAYERS), default=4)
    p.add_argument("--heads", type=int_at_least(1, at_most=MAX_D_MODEL), default=4)
    p.add_argument("--lr", type=positive_float, default=3e-3)
    p.add_argument("--eval-every", type=int_at_least(1), default=50)
    p.add_argument(
        "--corpus-mb",
        type=_corpus_mb,
        default=4.0,
        help=f"MiB of stdlib source to read ({MIN_CORPUS_MB:g} to {MAX_CORPUS_MB:g})",
    )
    p.add_argument("--sample-tokens", type=int_at_least(0, at_most=MAX_SAMPLE_TOKENS), default=300)
    p.add_argument(
        "--seed",
        type=int_at_least(-(1 << 63), at_most=(1 << 64) - 1),  # (torch.manual_seed's range)
        default=0,
    )
    p.add_argument(
        "--stages",
        default="all",
        help=f"comma-separated subset of: {', '.join(n for n, _ in STAGES)} (default all)",
    )


def selected_stages(spec: str) -> list[str]:
    """The stage names ``--stages`` selects, with their prerequisites (``NEEDS``), in order."""
    names = [n for n, _ in STAGES]
    wanted = names if spec == "all" else [s.strip() for s in spec.split(",")]
    unknown = [w for w in wanted if w not in names]
    if unknown or not wanted:
        raise ValueError(f"unknown demo stage(s) {unknown or [spec]}; known: {names}")
    wanted += [need for w in wanted for need in NEEDS.get(w, ())]
    return [n for n in names if n in wanted]


def prepare(args: argparse.Namespace) -> tuple[DemoContext, list[str]]:
    """The run's context and stages, every option checked before anything runs (a
    ``ValueError`` naming it); a stage named alone brings its prerequisites (``--stages
    sample`` runs data and train first)."""
    stages = selected_stages(args.stages)
    if args.d_model % args.heads:
        raise ValueError(f"--d-model ({args.d_model}) must be divisible by --heads ({args.heads})")
    if "ft" in stages:
        from torchport.demo.stage_ft import ft_steps

        ft_steps(args)  # (its TORCHPORT_DEMO_FT_STEPS, read by the stage, checked here)
    out_dir = Path(args.out)
    ctx = DemoContext(
        args=args,
        out_dir=out_dir,
        model_cfg=GPTConfig(
            seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads
        ),
        train_cfg=TrainConfig(
            steps=args.steps,
            time_limit_s=args.time_limit,
            batch_size=args.batch_size,
            lr=args.lr,
            eval_every=args.eval_every,
            warmup=min(30, max(1, args.steps // 10)),
            seed=args.seed,
        ),
    )
    return ctx, stages


def run(args: argparse.Namespace) -> list[Section]:
    """Run the selected stages in order, print each section, write the report."""
    ctx, stages = prepare(args)
    return execute(ctx, stages)


def _failed(name: str, error: BaseException, stages: list[str]) -> Section:
    """The report's last section when stage ``name`` raised ``error``."""
    not_run = stages[stages.index(name) + 1 :]
    s = Section(f"stage {name!r} failed")
    s.add("error", f"{type(error).__name__}: {error}")
    s.add("not run", ", ".join(not_run) or "-")
    s.data = {"failed_stage": name, "not_run": not_run}
    return s


def execute(ctx: DemoContext, stages: list[str]) -> list[Section]:
    """Run ``stages`` (checked by :func:`prepare`) in order; print each section; write the
    report. A stage that fails (or is interrupted) ends the run: the report then holds the
    stages that completed and a section naming the failed one, and the exception goes on (one
    failing stage lost every result); an earlier run's report is removed first, so none is
    left looking like this run's."""
    out_dir = ctx.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").unlink(missing_ok=True)
    for name, fn in STAGES:
        if name in stages:
            try:
                section = fn(ctx)
            except BaseException as e:
                path = write_report(out_dir, [*ctx.sections, _failed(name, e, stages)])
                print(f"stage {name!r} failed; the report of those before it: {path}", flush=True)
                raise
            ctx.sections.append(section)
            print(render_table(section), flush=True)
    path = write_report(out_dir, ctx.sections)
    print(f"report written to {path}")
    return ctx.sections
