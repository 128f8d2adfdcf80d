"""Regression tests from the forty-seventh session's review of the compiler front end."""

from __future__ import annotations

import warnings

import torch

import torchport
from torchport import STATIC, ShapesSpec, ShapeVar, TensorSpec


def test_inductor_backward_under_a_spec_serves_every_size(fresh_cache):
    """torch 2.13 reported a compiled forward's output strides to AOTAutograd as the first
    call's numbers, and the backward's saved activation was restrided to them: with a static
    dim of 2 and a dynamic one, the backward failed at every size but the first ("expected size
    2==2, stride 3==5 at dim=0"). torchport's Inductor compiles report them symbolically."""

    def f(z: torch.Tensor) -> torch.Tensor:
        return z.sin().sum()

    spec = ShapesSpec({"z": TensorSpec([STATIC, ShapeVar("B", max=64)])})
    g = torchport.compile(f, inner="inductor", dynamic_shapes=spec)
    with torch._inductor.config.patch(force_disable_caches=True), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for n in (5, 3, 1, 0, 7):
            z = torch.randn(2, n, requires_grad=True)
            g(z).backward()
            assert z.grad is not None
            torch.testing.assert_close(z.grad, z.detach().cos())
