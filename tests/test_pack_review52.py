"""Review 52 of the packed-weight cache and the epilogue decoder: entries hold their tensor's
storage weakly (a dead or recomputed weight leaves no entry, a reused address never matches a dead
entry), inference-tensor weights are kept, and a bare ``scale`` step is refused."""

from __future__ import annotations

import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from torchport.gemm.epilogue import EpilogueError, EpilogueSpec
from torchport.gemm.pack import PackCache, pack_b_reference


def test_recomputed_weight_leaves_no_dead_entries():
    """A weight derived afresh on every call (weight_norm, autocast's bf16 copy) holds the same
    values at a reused address: it was kept on its second sighting, the entry holding the dead
    tensor, and a new entry followed every few calls (60 calls: 24 entries, 194 MiB)."""
    cache = PackCache()
    base = torch.randn(48, 64)
    most = 0
    for _ in range(30):
        w = base * 1.0  # a fresh tensor, same values, freed after the call
        got = cache.get(w.t(), 16)
        assert torch.equal(got, pack_b_reference(w.t(), 16))
        del w, got
        most = max(most, len(cache._entries))
    assert most <= 1  # at most the last call's entry, dead as soon as its tensor goes
    assert len(cache) == 0 and cache.nbytes == 0


def test_entry_does_not_keep_its_tensor_alive():
    """The cache holds a weight's storage weakly: deleting the last reference frees it (the
    entry held the tensor before), and the entry and its packing go with it."""
    cache = PackCache()
    w = torch.nn.Parameter(torch.randn(40, 24), requires_grad=False)  # kept from its first use
    cache.get(w.t(), 8)
    assert len(cache) == 1 and cache.nbytes == 5 * 24 * 8 * 4  # 5 panels of K=24 x nr=8
    ref = StorageWeakRef(w.untyped_storage())
    del w
    gc.collect()
    assert ref.expired()
    assert len(cache) == 0 and cache.nbytes == 0


def test_insertion_drops_entries_of_freed_weights():
    """Entries of freed weights are dropped at the next insertion (and by ``prune``), so a
    deleted model's packings do not wait for ``clear``."""
    cache = PackCache()
    model = [torch.nn.Parameter(torch.randn(32, 16), requires_grad=False) for _ in range(3)]
    for w in model:
        cache.get(w.t(), 8)
    assert len(cache._entries) == 3
    del model, w
    other = torch.nn.Parameter(torch.randn(16, 16), requires_grad=False)
    cache.get(other.t(), 8)
    assert len(cache._entries) == 1 and cache.nbytes == 2 * 16 * 8 * 4
    del other
    assert cache.prune() == 1 and len(cache._entries) == 0 and cache.nbytes == 0


def test_new_storage_at_a_dead_entrys_address_is_repacked():
    """A storage made later over the same memory (``torch.frombuffer`` twice: a deterministic
    address reuse) never matches the entry of a freed one, even with equal version counters and
    sampled values: a value outside the sample changed in between."""
    cache = PackCache()
    buf = bytearray(torch.randn(64, 48).numpy().tobytes())
    w = torch.nn.Parameter(torch.frombuffer(buf, dtype=torch.float32).view(64, 48), False)
    first = cache.get(w.t(), 16)
    assert len(cache._entries) == 1
    del w, first
    scratch = torch.frombuffer(buf, dtype=torch.float32)
    scratch[5] = 1234.0  # not one of the 16 sampled elements (0, 204, 409, ...)
    del scratch
    w2 = torch.frombuffer(buf, dtype=torch.float32).view(64, 48)
    got = cache.get(w2.t(), 16)
    assert cache.hits == 0 and float(got[0, 5, 0]) == 1234.0
    assert torch.equal(got, pack_b_reference(w2.t(), 16))


def test_inference_tensor_weights_are_kept_and_validated_by_sampled_values():
    """Inference tensors keep no version counter; their packings were never kept (every call
    repacked: 0 hits in 40 calls). Now they hit, and a write that changes the sampled values
    (every element here) repacks."""
    cache = PackCache()
    with torch.inference_mode():
        lin = torch.nn.Linear(24, 40)
    w = lin.weight
    assert w.is_inference()
    # an inference tensor's view records no base, so weight.t() is kept from its second use
    cache.get(w.t(), 8)
    p1 = cache.get(w.t(), 8)
    for _ in range(3):
        assert cache.get(w.t(), 8) is p1
    assert (cache.hits, cache.misses) == (3, 2)
    with torch.inference_mode():
        w.add_(1.0)
    p2 = cache.get(w.t(), 8)  # (a new version of the view: kept again from its second use)
    assert p2 is not p1 and torch.equal(p2, pack_b_reference(w.t(), 8))
    p2 = cache.get(w.t(), 8)
    assert cache.get(w.t(), 8) is p2 and cache.hits == 4
    direct = cache.get(w, 8)  # the parameter itself: kept from its first use
    assert cache.get(w, 8) is direct and cache.hits == 5


def test_bare_scale_step_is_refused():
    """``scale`` without a value decoded as a multiply by 0.0: the raw op returned zeros."""
    with pytest.raises(
        EpilogueError, match=r"scale must be given as 'scale=<number>', got 'scale'"
    ):
        EpilogueSpec.decode("relu;scale")
    a, b = torch.randn(4, 8), torch.randn(8, 6)
    with pytest.raises(EpilogueError, match=r"got 'scale'"):
        torch.ops.torchport.gemm(a, b, [], "scale")
    assert EpilogueSpec.decode("scale=0.5").ops[0].value == 0.5
