"""Shared helpers of the graph capture tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from torchport import config, native
from torchport.graphs import Graph

# (native_tier, id): a capture on the native tier, then on the TorchScript one
TIERS = [pytest.param(True, id="native"), pytest.param(False, id="torchscript")]


def native_graph(fn: Callable[[], Any]) -> tuple[Graph, Any]:
    """Capture ``fn`` on the native tier (skip where there is no native toolchain)."""
    if not native.enabled():
        pytest.skip("no native toolchain")
    g = Graph()
    with config.override(native=True), torch.no_grad(), g:
        out = fn()
    assert g.tier == "native"
    return g, out
