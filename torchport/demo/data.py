"""The demo's corpus: the Python standard library's own source, present on every machine.

Text is byte-level (vocabulary 256), so nothing needs a tokenizer or a download. Files are read
in sorted order until ``max_bytes``; the last ``val_fraction`` of the bytes is held out.
"""

from __future__ import annotations

import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB = 256


class CorpusError(RuntimeError):
    """The corpus could not be assembled (for example, no standard-library sources found)."""


@dataclass
class Corpus:
    """Train and validation byte streams."""

    train: torch.Tensor  # uint8 → int64 indices
    val: torch.Tensor
    files: int

    def batch(
        self, split: str, batch_size: int, seq_len: int, gen: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows (inputs, next-byte targets) of shape [batch_size, seq_len]."""
        data = self.train if split == "train" else self.val
        if data.numel() <= seq_len + 1:
            raise CorpusError(f"{split} split has {data.numel()} bytes, need > {seq_len + 1}")
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=gen)
        idx = starts[:, None] + torch.arange(seq_len + 1)[None, :]
        win = data[idx]
        return win[:, :-1], win[:, 1:]


def stdlib_sources(root: Path | None = None) -> list[Path]:
    """Sorted ``.py`` files under the standard library (site-packages excluded)."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)


def load_corpus(max_bytes: int = 4 << 20, val_fraction: float = 0.1) -> Corpus:
    """Read up to ``max_bytes`` of standard-library source into train/val splits."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    chunks: list[bytes] = []
    total = 0
    files = 0
    for path in stdlib_sources():
        try:
            b = path.read_bytes()
        except OSError:
            continue
        chunks.append(b)
        total += len(b)
        files += 1
        if total >= max_bytes:
            break
    if total < 10_000:
        raise CorpusError(f"found only {total} bytes of standard-library source")
    blob = b"".join(chunks)[:max_bytes]
    data = torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()
    cut = int(data.numel() * (1.0 - val_fraction))
    return Corpus(train=data[:cut], val=data[cut:], files=files)
