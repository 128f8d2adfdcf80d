"""GEMM fusion review 50: a graph whose GEMM mixes dtypes fuses nothing.

A bf16 input into a float32 layer: eager refuses it when the layer runs ("mat1 and mat2 must
have the same dtype"). The fake ``F.linear`` traced it as float32, so the next layer was fused,
and Inductor's lowering, which gives the first layer a bf16 output, then failed the fused op's
fake at compile time, naming the second layer. Now the graph runs as traced and fails as eager.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import torchport
from torchport import config


@pytest.mark.parametrize("inner", ["eager", "inductor"])
def test_a_mixed_dtype_gemm_fails_as_eager_not_at_the_next_layer(inner):
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError) as eager:
        mlp(x)
    torch._dynamo.reset()
    with config.override(autotune=False):
        compiled = torchport.compile(mlp, inner=inner)
        with pytest.raises(RuntimeError) as got:
            compiled(x)
        assert str(got.value).splitlines()[0] == str(eager.value).splitlines()[0]
        assert type(got.value) is type(eager.value), type(got.value)
        # the same model with a matching input still fuses and matches eager
        xf = x.float()
        torch.testing.assert_close(compiled(xf), mlp(xf), rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()
