"""The demo's report: a console table per section, a JSON file and a PNG loss curve."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Section:
    """One titled table of (label, value) rows, plus free text."""

    title: str
    rows: list[tuple[str, str]] = field(default_factory=list)
    text: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def add(self, label: str, value: object) -> None:
        self.rows.append((label, value if isinstance(value, str) else _fmt(value)))


def _fmt(v: object) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def render_table(section: Section) -> str:
    """Plain-text table for the console."""
    width = max([len(k) for k, _ in section.rows] + [8])
    lines = [f"== {section.title} ==", *(f"  {k:<{width}}  {v}" for k, v in section.rows)]
    if section.text:
        lines.append("  " + section.text.replace("\n", "\n  "))
    return "\n".join(lines)


def plot_curves(
    path: Path,
    train: Sequence[tuple[int, float]],
    val: Sequence[tuple[int, float]],
    title: str,
) -> Path:
    """Write a PNG of train/validation loss against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    if train:
        ax.plot([s for s, _ in train], [v for _, v in train], lw=0.8, alpha=0.7, label="train")
    if val:
        ax.plot([s for s, _ in val], [v for _, v in val], "o-", lw=1.5, label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/byte)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_report(out_dir: Path, sections: Sequence[Section]) -> Path:
    """Write ``report.json`` with every section's rows and data (whole or not at all: a
    temporary file renamed over it)."""
    path = out_dir / "report.json"
    payload = [
        {"title": s.title, "rows": dict(s.rows), "text": s.text, "data": s.data} for s in sections
    ]
    from torchport.distributed.flight_recorder import write_atomic

    write_atomic(path, json.dumps(payload, indent=2, default=str).encode())
    return path
