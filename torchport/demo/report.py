"""The demo's report: a console table per section, a JSON file and a PNG loss curve."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class StageCheckError(RuntimeError):
    """A stage's check failed (compiled vs eager parity, a diverged training run): the message
    names the check and the values. Raised from the stage, it ends the run as a failed stage
    (``report.json``'s ``stage 'X' failed`` section); a check that only printed its numbers
    never failed the run."""


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


def _finite(v: Any) -> Any:
    """``v`` with every NaN or infinite float in it (in dicts, lists, tuples) made None."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def write_report(out_dir: Path, sections: Sequence[Section]) -> Path:
    """Write ``report.json`` with every section's rows and data (whole or not at all: a
    temporary file renamed over it). A number that is NaN or infinite (the losses of a run that
    diverged) is written as ``null``: ``json.dumps`` wrote the tokens ``NaN`` and ``Infinity``,
    which are not JSON, and strict parsers refused the whole report. (The rows hold the console
    text, where it is ``nan``.)"""
    path = out_dir / "report.json"
    payload = [
        {"title": s.title, "rows": dict(s.rows), "text": s.text, "data": s.data} for s in sections
    ]
    from torchport.distributed.flight_recorder import write_atomic

    text = json.dumps(_finite(payload), indent=2, default=str)
    write_atomic(path, text.encode())
    return path
