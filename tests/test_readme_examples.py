"""Every ```python block of README.md runs as written, each in its own interpreter.

A README example that no longer runs is a broken promise to the first user who pastes it, and
nothing else in the suite would notice. A block that continues the previous one (it uses names
the previous block defined, without imports of its own) is listed in :data:`CONTINUES` and runs
after it in the same process. The distributed example's fixed port is replaced by a free one;
the ``env://`` one gets a one-rank rendezvous in its environment.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
# blocks that continue their predecessor, recognised by their first statement
CONTINUES = ("lin = torch.nn.Linear(256, 64)",)
TIMEOUT_S = 240


def _blocks() -> list[tuple[int, str]]:
    """(line of the opening fence, code) for each block; continuation blocks prefixed with
    the block they continue."""
    text = README.read_text()
    out: list[tuple[int, str]] = []
    for m in BLOCK.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        code = m.group(1)
        if out and code.startswith(CONTINUES):
            code = out[-1][1] + "\n" + code
        out.append((line, code))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


BLOCKS = _blocks()


def test_readme_has_examples() -> None:
    assert len(BLOCKS) >= 10, f"found {len(BLOCKS)} python blocks in README.md"


@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"line{ln}" for ln, _ in BLOCKS])
def test_readme_example_runs(line: int, code: str, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
    if "29533" in code:  # the multi-process example's rendezvous port
        code = code.replace("29533", str(_free_port()))
    if 'init_process_group("torchport", enable_reconfigure=True)' in code:  # env://, one rank
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0")
        env["WORLD_SIZE"] = "1"
    script = tmp_path / f"readme_line{line}.py"
    script.write_text(code)
    try:
        proc = subprocess.run(
            [sys.executable, str(script)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as e:  # run() killed the child
        pytest.fail(f"README block at line {line} ran past {TIMEOUT_S} s: {e.stdout!r}")
    assert proc.returncode == 0, (
        f"README block at line {line} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    )
