"""One autotuner for every op family: candidates as data, same-run ATen anchor, persistent cache.

See :func:`select`. Timing helpers (:func:`measure`, :func:`interleaved`, :func:`alternated_min`,
:func:`cold_copies`) are shared with the benchmarks in ``bench/``; :func:`confirm` is the one
guard against noisy samples (a non-ATen winner re-timed in alternation against the ATen anchor).
"""

from torchport.autotune.cache import (
    ChoiceCache,
    ChoiceCacheWriteWarning,
    CorruptChoiceCacheWarning,
    UnsafeChoiceCacheWarning,
    choice_cache,
)
from torchport.autotune.timing import (
    L3_BYTES,
    alternated_min,
    cold_bytes,
    cold_copies,
    interleaved,
    measure,
    median,
    nbytes,
    sample_generator,
)
from torchport.autotune.tuner import (
    ATEN,
    NATIVE,
    Candidate,
    Choice,
    Confirmation,
    InvalidCandidate,
    TunerStats,
    allowed_backends,
    beats_anchor,
    confirm,
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
    "ChoiceCacheWriteWarning",
    "Confirmation",
    "CorruptChoiceCacheWarning",
    "InvalidCandidate",
    "TunerStats",
    "UnsafeChoiceCacheWarning",
    "allowed_backends",
    "alternated_min",
    "beats_anchor",
    "choice_cache",
    "cold_bytes",
    "cold_copies",
    "confirm",
    "interleaved",
    "measure",
    "median",
    "nbytes",
    "sample_generator",
    "select",
    "stats",
]
