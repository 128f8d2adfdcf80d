"""Demo stage ``quant``: decode the trained model with fp32, bf16 and NVFP4 weights.

NVFP4 weights come from ``torchport.quantize_(model, NVFP4WeightOnlyConfig())``; their linears
run the native decode GEMV in eager mode. The stage reports tokens/s for each weight type (same
prompt, same sampling seed) and the held-out loss with each, i.e. the quality cost of 4.5-bit
weights.

The demo model (d_model 128: 16–64 K weights per linear) decodes at a rate set by Python and
dispatch overhead, not by weight bytes, so the stage also decodes an untrained *weight-bound*
model of the same architecture (:data:`WEIGHT_BOUND`, ≈ 50 M weights: 200 MB in fp32, 28 MB in
NVFP4), where reading and decoding the weights dominates and the format's bytes show. Both run on
one thread: on a shared 2-core machine a second OpenMP thread stalls whenever its core is taken.
"""

from __future__ import annotations

import copy
import time
from typing import TYPE_CHECKING, Any

import torch

from torchport import config
from torchport.demo.model import GPT, GPTConfig, KVCache, generate
from torchport.demo.report import Section
from torchport.demo.stage_graphs import CapturedDecoder, generate_eager
from torchport.demo.train import evaluate
from torchport.lowp import NVFP4WeightOnlyConfig, quantize_

if TYPE_CHECKING:
    from torchport.demo import DemoContext


def _decode_rates(
    variants: dict[str, GPT], tokens: int, seed: int, rounds: int = 3
) -> tuple[dict[str, float], bytes]:
    """Median tokens/s of each variant over ``rounds`` interleaved runs (load drift hits all alike)."""
    for m in variants.values():
        generate(m, b"def ", 8, gen=torch.Generator().manual_seed(seed))  # warm-up (kernel builds)
    samples: dict[str, list[float]] = {n: [] for n in variants}
    text = b""
    per = max(8, tokens // rounds)
    for _ in range(rounds):
        for name, m in variants.items():
            gen = torch.Generator().manual_seed(seed)
            t0 = time.perf_counter()
            out = generate(m, b"def ", per, gen=gen)
            dt = time.perf_counter() - t0
            samples[name].append(per / dt if dt > 0 else 0.0)
            if name == "nvfp4":
                text = out
    return {n: sorted(v)[len(v) // 2] for n, v in samples.items()}, text


@torch.no_grad()
def greedy_eager(model: GPT, prompt: bytes, new_tokens: int) -> bytes:
    """Greedy decoding with the model's KV-cache forward (one Python step per token)."""
    cfg = model.cfg
    cache = KVCache(cfg, 1, cfg.seq_len, next(model.parameters()).dtype)
    logits = model(torch.tensor([list(prompt)]), cache, 0)[:, -1]
    pos, out = len(prompt), list[int]()
    while len(out) < new_tokens:
        out.append(int(logits.argmax(-1)))
        if pos >= cfg.seq_len:
            break
        logits = model(torch.tensor([[out[-1]]]), cache, pos)[:, -1]
        pos += 1
    return bytes(out)


def captured_rates(
    model: GPT, quantized: GPT, rounds: int = 5, fp32_graph: bool = True
) -> dict[str, Any]:
    """Greedy decode tokens/s: bf16 eager vs NVFP4 as one captured graph (median of interleaved
    rounds), plus NVFP4 eager and (``fp32_graph``) fp32 captured for reference; ``agreement``:
    how many leading tokens of the captured NVFP4 loop agree with the same step run eagerly."""
    prompt = b"def "
    new = model.cfg.seq_len - len(prompt)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    t0 = time.perf_counter()
    dq = CapturedDecoder(quantized, new)
    capture_s = time.perf_counter() - t0
    runs: dict[str, Any] = {
        "bf16 eager": lambda: greedy_eager(bf16, prompt, new),
        "nvfp4 eager": lambda: generate_eager(quantized, prompt, new),
        "nvfp4 captured": lambda: dq.generate(prompt, new),
    }
    if fp32_graph:  # float32 GEMMs repack their weights at every replay: small models only
        df = CapturedDecoder(model, new)
        runs["fp32 captured"] = lambda: df.generate(prompt, new)
    samples: dict[str, list[float]] = {n: [] for n in runs}
    outs: dict[str, bytes] = {}
    for _ in range(rounds):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            outs[name] = fn()
            samples[name].append(len(outs[name]) / (time.perf_counter() - t0))
    rates = {n: sorted(v)[len(v) // 2] for n, v in samples.items()}
    return {
        "rates": rates,
        "tier": dq.graph.tier,
        "capture_s": capture_s,
        "tokens": len(outs["nvfp4 captured"]),
        "agreement": _agreement(outs["nvfp4 captured"], outs["nvfp4 eager"]),
        "text": prompt + outs["nvfp4 captured"],
    }


def _agreement(a: bytes, b: bytes) -> str:
    """``"k/n"``: the first ``k`` of ``n`` tokens agree (greedy runs diverge from the first
    difference on; the graph's GEMVs are bit-exact with eager mode, its other float32 ops
    — gelu, the softmax exponential — round differently from ATen's)."""
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return f"{k}/{max(len(a), len(b))}"


WEIGHT_BOUND = GPTConfig(seq_len=64, d_model=1024, n_layers=4, n_heads=8)


def _weight_bound_rates(seed: int, tokens: int = 24) -> tuple[dict[str, float], dict[str, Any]]:
    """Decode tokens/s of an untrained :data:`WEIGHT_BOUND` model in fp32, bf16 and NVFP4 (eager,
    sampled), and greedy bf16 eager vs NVFP4 captured (:func:`captured_rates`)."""
    torch.manual_seed(seed)
    big = GPT(WEIGHT_BOUND).eval()
    variants: dict[str, GPT] = {"fp32": big, "bf16": copy.deepcopy(big).to(torch.bfloat16)}
    q = copy.deepcopy(big)
    quantize_(q, NVFP4WeightOnlyConfig())
    variants["nvfp4"] = q
    with torch.no_grad(), config.override(progress=False):  # GEMV tuning on first use: no bars
        rates, _ = _decode_rates(variants, tokens, seed)
        cap = captured_rates(big, q, rounds=3, fp32_graph=False)
    return rates, cap


def stage_quant(ctx: DemoContext) -> Section:
    """Quantize the trained model to NVFP4 and compare decode speed and held-out loss."""
    s = Section("quantized decoding (NVFP4 weights, native GEMV)")
    model = ctx.model
    if model is None:  # run alone (--stages quant): an untrained model still measures speed
        torch.manual_seed(ctx.train_cfg.seed)
        model = GPT(ctx.model_cfg)
        s.add("note", "no trained model in this run: untrained weights")
    model.eval()
    variants: dict[str, GPT] = {"fp32": model, "bf16": copy.deepcopy(model).to(torch.bfloat16)}
    q = copy.deepcopy(model)
    t0 = time.perf_counter()
    rep = quantize_(q, NVFP4WeightOnlyConfig())
    s.add("NVFP4 linears quantized", len(rep.quantized))
    s.add("quantize time (s)", time.perf_counter() - t0)
    variants["nvfp4"] = q
    tokens = max(16, int(ctx.args.sample_tokens))
    threads = torch.get_num_threads()
    # Decode of a d_model-128 model is a chain of tiny ops: one thread avoids OpenMP hand-offs
    # that cost more than the work (the same setting for every variant).
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            rates, text = _decode_rates(variants, tokens, ctx.train_cfg.seed)
        for name, rate in rates.items():
            s.add(f"{name} tokens/s (eager, sampled, 1 thread, median of 3)", rate)
        s.add("NVFP4 / bf16 eager speed-up (sampled)", rates["nvfp4"] / max(rates["bf16"], 1e-9))
        s.add("NVFP4 / fp32 eager speed-up (sampled)", rates["nvfp4"] / max(rates["fp32"], 1e-9))
        s.text = (b"def " + text).decode("utf-8", errors="replace")
        cap = captured_rates(model, q)
    finally:
        torch.set_num_threads(threads)
    tag = "greedy, 1 thread, median of 5"
    s.add("captured graph tier (NVFP4 decode loop)", cap["tier"])
    s.add("capture time (s)", cap["capture_s"])
    for name, rate in cap["rates"].items():
        s.add(f"{name} tokens/s ({tag})", rate)
    s.add("captured NVFP4 tokens agreeing with eager NVFP4", cap["agreement"])
    s.add(
        "NVFP4 captured / bf16 eager decode speed-up",
        cap["rates"]["nvfp4 captured"] / max(cap["rates"]["bf16 eager"], 1e-9),
    )
    s.add(
        "NVFP4 captured / fp32 captured",
        cap["rates"]["nvfp4 captured"] / max(cap["rates"]["fp32 captured"], 1e-9),
    )
    with torch.no_grad():
        if ctx.corpus is not None:
            seq = ctx.model_cfg.seq_len
            losses = {n: evaluate(m, ctx.corpus, ctx.train_cfg, seq) for n, m in variants.items()}
            for n, v in losses.items():
                s.add(f"{n} held-out loss", v)
            s.add("NVFP4 loss change", losses["nvfp4"] - losses["fp32"])
    torch.set_num_threads(1)
    try:
        big, big_cap = _weight_bound_rates(ctx.train_cfg.seed)
    finally:
        torch.set_num_threads(threads)
    n_weights = sum(p.numel() for p in GPT(WEIGHT_BOUND).parameters())
    tag = f"weight-bound model (d_model {WEIGHT_BOUND.d_model}, {n_weights / 1e6:.0f} M weights)"
    for name, rate in big.items():
        s.add(f"{tag} {name} tokens/s (1 thread)", rate)
    s.add(f"{tag} NVFP4 / bf16 eager speed-up (sampled)", big["nvfp4"] / max(big["bf16"], 1e-9))
    for name, rate in big_cap["rates"].items():
        s.add(f"{tag} {name} tokens/s (greedy, 1 thread, median of 3)", rate)
    s.add(f"{tag} captured NVFP4 tokens agreeing with eager", big_cap["agreement"])
    s.add(
        f"{tag} NVFP4 captured / bf16 eager decode speed-up",
        big_cap["rates"]["nvfp4 captured"] / max(big_cap["rates"]["bf16 eager"], 1e-9),
    )
    s.data = {
        "tokens_per_s": rates,
        "greedy_tokens_per_s": cap["rates"],
        "captured_same_tokens": cap["agreement"],
        "weight_bound_tokens_per_s": big,
        "weight_bound_greedy_tokens_per_s": big_cap["rates"],
    }
    return s
