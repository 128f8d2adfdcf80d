"""Demo stage ``graphs``: the decode loop as one captured graph (``while_loop`` inside ``Graph``).

Greedy decoding of the demo GPT is written as a capture-friendly step (static shapes: attention
over the whole preallocated KV cache with a position mask, cache updates by ``index_copy``). The
whole generation loop — step, append token, stop at the end byte or the length limit — is a
``torchport.while_loop`` captured in a ``torchport.graphs.Graph``; replay runs it with a
data-dependent trip count in one call. The stage reports tokens/s of the replayed loop against the
same step run by an eager Python loop, and checks both produce the same tokens.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from torchport.control import while_loop
from torchport.demo.model import GPT, KVCache
from torchport.demo.report import Section, StageCheckError
from torchport.graphs import Graph

if TYPE_CHECKING:
    from torchport.demo import DemoContext

END_BYTE = 0  # NUL never occurs in the corpus, so runs normally stop at the length limit


def decode_step(
    model: GPT, tok: torch.Tensor, pos: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One greedy step. ``tok``/``pos``: [1] int64; ``kc``/``vc``: [layers, heads, T, hd]."""
    cfg = model.cfg
    heads, hd, d = cfg.n_heads, cfg.d_model // cfg.n_heads, cfg.d_model
    x = F.embedding(tok, model.tok.weight) + F.embedding(pos, model.pos.weight)
    valid = torch.arange(kc.shape[2]) <= pos
    ks, vs = [], []
    blocks: list[Any] = list(model.blocks)
    for layer, blk in enumerate(blocks):
        q, k, v = blk.attn.qkv(blk.ln1(x)).split(d, dim=-1)
        kl = kc[layer].index_copy(1, pos, k.view(heads, 1, hd))
        vl = vc[layer].index_copy(1, pos, v.view(heads, 1, hd))
        att = (q.view(heads, 1, hd) @ kl.transpose(1, 2)) * hd**-0.5
        att = att.masked_fill(~valid, float("-inf")).softmax(-1)
        x = x + blk.attn.proj((att @ vl).reshape(1, d))
        x = x + blk.fc2(F.gelu(blk.fc1(blk.ln2(x))))
        ks.append(kl)
        vs.append(vl)
    nxt = model.head(model.ln_f(x)).argmax(-1)
    return nxt, torch.stack(ks), torch.stack(vs)


class CapturedDecoder:
    """Static buffers plus a graph whose replay generates up to ``limit`` tokens."""

    def __init__(self, model: GPT, max_new: int) -> None:
        cfg = model.cfg
        shape = (cfg.n_layers, cfg.n_heads, cfg.seq_len, cfg.d_model // cfg.n_heads)
        self.model = model
        self.kc, self.vc = torch.zeros(shape), torch.zeros(shape)
        self.tok = torch.zeros(1, dtype=torch.long)
        self.pos = torch.zeros(1, dtype=torch.long)
        self.limit = torch.zeros(1, dtype=torch.long)
        self.max_new = max_new
        self.graph = Graph()
        with torch.no_grad(), self.graph:
            self.n, self.out = self._loop()

    def _loop(self) -> tuple[torch.Tensor, torch.Tensor]:
        def cond(n, tok, pos, kc, vc, out):
            return ((n < self.limit) & (tok != END_BYTE)).reshape(())

        def body(n, tok, pos, kc, vc, out):
            nxt, kc, vc = decode_step(self.model, tok, pos, kc, vc)
            return n + 1, nxt, pos + 1, kc, vc, out.index_copy(0, n, nxt)

        n0 = torch.zeros(1, dtype=torch.long)
        out0 = torch.zeros(self.max_new, dtype=torch.long)
        res = while_loop(cond, body, (n0, self.tok, self.pos, self.kc, self.vc, out0))
        return res[0], res[5]

    @torch.no_grad()
    def generate(self, prompt: bytes, new_tokens: int) -> bytes:
        """Prefill eagerly, then replay the captured loop for up to ``new_tokens`` bytes."""
        cache = _prefill(self.model, prompt)
        self.kc.copy_(cache.k[:, 0])
        self.vc.copy_(cache.v[:, 0])
        self.tok.fill_(prompt[-1])
        self.pos.fill_(len(prompt) - 1)
        self.limit.fill_(min(new_tokens, self.max_new))
        self.graph.replay()
        return bytes(self.out[: int(self.n)].tolist())


def _prefill(model: GPT, prompt: bytes) -> KVCache:
    """Cache of all but the last prompt byte (the loop's first step feeds the last one)."""
    cfg = model.cfg
    cache = KVCache(cfg, 1, cfg.seq_len, next(model.parameters()).dtype)
    if len(prompt) > 1:
        model(torch.tensor([list(prompt[:-1])]), cache, 0)
    return cache


@torch.no_grad()
def generate_eager(model: GPT, prompt: bytes, new_tokens: int) -> bytes:
    """The same greedy decode driven by a Python loop (the baseline)."""
    cache = _prefill(model, prompt)
    kc, vc = cache.k[:, 0].clone(), cache.v[:, 0].clone()
    tok = torch.tensor([prompt[-1]])
    pos = torch.tensor([len(prompt) - 1])
    out: list[int] = []
    while len(out) < new_tokens and int(tok) != END_BYTE:
        tok, kc, vc = decode_step(model, tok, pos, kc, vc)
        out.append(int(tok))
        pos = pos + 1
    return bytes(out)


def check_same_tokens(eager: bytes, graph: bytes) -> None:
    """Raise :class:`StageCheckError` unless the captured loop's greedy tokens are the eager
    loop's (the stage printed ``same tokens as eager  False`` and succeeded)."""
    if eager != graph:
        k = next((i for i, (a, b) in enumerate(zip(eager, graph, strict=False)) if a != b), None)
        k = min(len(eager), len(graph)) if k is None else k
        raise StageCheckError(
            f"the captured loop must generate the eager loop's tokens, got a difference at "
            f"token {k} of {len(eager)} (eager) / {len(graph)} (captured): eager "
            f"{eager[k : k + 16]!r}, captured {graph[k : k + 16]!r} from there"
        )


def stage_graphs(ctx: DemoContext) -> Section:
    """Run generation as a captured while_loop graph; compare tokens/s with the eager loop."""
    model = ctx.model
    trained = model is not None
    if model is None:
        torch.manual_seed(ctx.args.seed)
        model = GPT(ctx.model_cfg)
    model.eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # batch-1 decode is latency-bound; extra OpenMP threads only sync
    try:
        return _run(model, trained)
    finally:
        torch.set_num_threads(threads)


def _run(model: GPT, trained: bool) -> Section:
    prompt = b"def "
    new = model.cfg.seq_len - len(prompt)
    t0 = time.perf_counter()
    dec = CapturedDecoder(model, new)
    capture_s = time.perf_counter() - t0
    times = {"eager": [], "graph": []}  # type: dict[str, list[float]]
    texts = {}
    for _ in range(3):
        for name, fn in (("eager", generate_eager), ("graph", None)):
            t0 = time.perf_counter()
            text = generate_eager(model, prompt, new) if fn else dec.generate(prompt, new)
            times[name].append(time.perf_counter() - t0)
            texts[name] = text
    best = {k: min(v) for k, v in times.items()}
    n = len(texts["graph"])
    s = Section("graphs: generation loop as one captured while_loop (greedy)")
    s.add("model", "trained" if trained else "untrained (run with the train stage)")
    s.add("threads", torch.get_num_threads())
    s.add("tokens per run", n)
    s.add("capture time (s)", capture_s)
    s.add("replay tier", dec.graph.tier)
    s.add("ATen ops recorded", dec.graph.num_ops)
    s.add("eager loop tokens/s", len(texts["eager"]) / best["eager"])
    s.add("captured loop tokens/s", n / best["graph"])
    s.add("speed-up", best["eager"] / best["graph"])
    s.add("same tokens as eager", texts["eager"] == texts["graph"])
    s.text = (prompt + texts["graph"]).decode("utf-8", errors="replace")
    check_same_tokens(texts["eager"], texts["graph"])
    return s
