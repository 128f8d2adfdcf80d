"""The demo's model: a small byte-level GPT (pre-LayerNorm transformer) with a KV cache.

``forward(idx)`` trains on full windows; ``forward(idx, cache=KVCache, pos=p)`` decodes one
step at a time against preallocated key/value buffers (static shapes, so later stages can capture
the decode loop).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Model hyper-parameters (validated)."""

    vocab: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive int, got {v!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )


class KVCache:
    """Preallocated keys/values for every layer: [layers, B, heads, max_len, head_dim]."""

    def __init__(self, cfg: GPTConfig, batch: int, max_len: int, dtype: torch.dtype) -> None:
        hd = cfg.d_model // cfg.n_heads
        shape = (cfg.n_layers, batch, cfg.n_heads, max_len, hd)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.max_len = max_len


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.layer = layer
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, pos: int = 0) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q = q.view(b, t, self.n_heads, -1).transpose(1, 2)
        k = k.view(b, t, self.n_heads, -1).transpose(1, 2)
        v = v.view(b, t, self.n_heads, -1).transpose(1, 2)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            cache.k[self.layer, :, :, pos : pos + t] = k
            cache.v[self.layer, :, :, pos : pos + t] = v
            keys = cache.k[self.layer, :, :, : pos + t]
            vals = cache.v[self.layer, :, :, : pos + t]
            if t == 1:
                y = F.scaled_dot_product_attention(q, keys, vals)
            else:
                mask = torch.ones(t, pos + t, dtype=torch.bool).tril(diagonal=pos)
                y = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg, layer)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc1 = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, pos: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln1(x), cache, pos)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Byte-level causal language model."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", "fc2.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(
        self, idx: torch.Tensor, cache: KVCache | None = None, pos: int = 0
    ) -> torch.Tensor:
        """Logits [B, T, vocab] for byte indices [B, T] starting at position ``pos``."""
        t = idx.shape[1]
        if pos + t > self.cfg.seq_len:
            raise ValueError(
                f"sequence of {pos + t} positions exceeds the model's seq_len {self.cfg.seq_len}"
            )
        x = self.tok(idx) + self.pos(torch.arange(pos, pos + t))
        for blk in self.blocks:
            x = blk(x, cache, pos)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy."""
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


@torch.no_grad()
def generate(
    model: GPT,
    prompt: bytes,
    new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int = 40,
    gen: torch.Generator | None = None,
) -> bytes:
    """Sample ``new_tokens`` bytes after ``prompt`` with a KV cache (window = model seq_len)."""
    if not prompt:
        raise ValueError("prompt must be at least one byte")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    cfg = model.cfg
    dtype = next(model.parameters()).dtype
    out = list(prompt[-(cfg.seq_len // 2) :])
    produced: list[int] = []
    while len(produced) < new_tokens:
        # (Re)fill the cache with the recent context, then decode until the window is full.
        ctx = out[-(cfg.seq_len // 2) :]
        cache = KVCache(cfg, 1, cfg.seq_len, dtype)
        logits = model(torch.tensor([ctx]), cache, 0)[:, -1]
        pos = len(ctx)
        while len(produced) < new_tokens:
            probs = _sample_probs(logits.float(), temperature, top_k)
            nxt = int(torch.multinomial(probs, 1, generator=gen).item())
            out.append(nxt)
            produced.append(nxt)
            if pos >= cfg.seq_len:
                break
            logits = model(torch.tensor([[nxt]]), cache, pos)[:, -1]
            pos += 1
    return bytes(produced)


def _sample_probs(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.softmax(logits, dim=-1)
