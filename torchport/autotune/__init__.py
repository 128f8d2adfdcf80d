"""One autotuner for every op family: candidates as data, same-run ATen anchor, persistent cache.

See :func:`select`. Timing helpers (:func:`measure`, :func:`cold_copies`) are shared with the
benchmarks in ``bench/``.
"""

from torchport.autotune.cache import ChoiceCache, CorruptChoiceCacheWarning, choice_cache
from torchport.autotune.timing import L3_BYTES, cold_copies, measure, median, nbytes
from torchport.autotune.tuner import (
    ATEN,
    NATIVE,
    Candidate,
    Choice,
    InvalidCandidate,
    TunerStats,
    allowed_backends,
    select,
    stats,
)

__all__ = [
    "ATEN",
    "L3_BYTES",
    "NATIVE",
    "Candidate",
    "Choice",
    "ChoiceCache",
    "CorruptChoiceCacheWarning",
    "InvalidCandidate",
    "TunerStats",
    "allowed_backends",
    "choice_cache",
    "cold_copies",
    "measure",
    "median",
    "nbytes",
    "select",
    "stats",
]
