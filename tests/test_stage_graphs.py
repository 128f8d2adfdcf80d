"""Demo stage 'graphs': the captured generation loop produces the eager loop's tokens."""

from __future__ import annotations

import torch

from torchport.demo.model import GPT, GPTConfig
from torchport.demo.stage_graphs import CapturedDecoder, generate_eager


def test_captured_decoder_matches_eager_loop() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=24, d_model=32, n_layers=2, n_heads=2)).eval()
    dec = CapturedDecoder(model, max_new=20)
    assert dec.graph.tier == "native"  # the whole decode loop is one C function
    for prompt, new in ((b"ab", 20), (b"x", 5), (b"hello", 0), (b"q", 1)):
        want = generate_eager(model, prompt, new)
        got = dec.generate(prompt, new)
        assert len(got) == new
        assert got == want
