"""The demo model: KV-cache decoding equals full recomputation; config validation."""

from __future__ import annotations

import pytest
import torch

from torchport.demo.data import load_corpus
from torchport.demo.model import GPT, GPTConfig, KVCache, generate


def test_kv_cache_matches_full_forward():
    torch.manual_seed(0)
    cfg = GPTConfig(seq_len=32, d_model=32, n_layers=2, n_heads=4)
    m = GPT(cfg).eval()
    idx = torch.randint(0, 256, (2, 20))
    full = m(idx)
    cache = KVCache(cfg, 2, 32, torch.float32)
    first = m(idx[:, :12], cache, 0)
    steps = [m(idx[:, t : t + 1], cache, t) for t in range(12, 20)]
    inc = torch.cat([first, *steps], dim=1)
    torch.testing.assert_close(inc, full, rtol=1e-5, atol=1e-5)


def test_generate_is_deterministic_and_bounded():
    cfg = GPTConfig(seq_len=16, d_model=16, n_layers=1, n_heads=2)
    m = GPT(cfg).eval()
    a = generate(m, b"abc", 50, gen=torch.Generator().manual_seed(3))
    b = generate(m, b"abc", 50, gen=torch.Generator().manual_seed(3))
    assert a == b and len(a) == 50  # longer than the window: the cache is refilled


def test_config_and_input_errors():
    with pytest.raises(ValueError, match=r"d_model \(30\) must be divisible by n_heads \(4\)"):
        GPTConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match=r"n_layers must be a positive int, got 0"):
        GPTConfig(n_layers=0)
    m = GPT(GPTConfig(seq_len=8, d_model=16, n_layers=1, n_heads=2))
    with pytest.raises(ValueError, match=r"sequence of 9 positions exceeds the model's seq_len 8"):
        m(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(ValueError, match="prompt must be at least one byte"):
        generate(m, b"", 3)


def test_corpus_split_and_batches():
    c = load_corpus(max_bytes=200_000)
    assert c.files > 0 and c.train.numel() + c.val.numel() == 200_000
    x, y = c.batch("train", 4, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match=r"val_fraction must be in \(0, 1\), got 1.5"):
        load_corpus(val_fraction=1.5)
