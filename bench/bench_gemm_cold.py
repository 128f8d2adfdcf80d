"""Cold tuning of new GEMM shapes: wall time, compiles and compiler CPU, each cell in a fresh cache.

Issue 3 asks for at most 2 s of cold tuning per new shape. Each cell runs in its own process with an
empty ``TORCHPORT_CACHE_DIR`` (the precompiled headers under it too): first ``linear`` 1024→4096 +
bias (the cache's first shape: every library, the pack kernels and the precompiled headers are
built in it), then ``linear`` 768→3072 + bias + GELU (a new shape and epilogue in the same cache:
new tile libraries, nothing else). For each it prints the first call's wall time (tuning and
compilation), the compiles it made and the CPU time of the compiler processes. There is no
anchor: ATen does not tune. ``--rounds`` repeats the grid (the medians are printed at the end).

Run: ``torchport bench gemm_cold [--cells bf16:8,f32:1] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from torchport.benchmarks import comma_list, one_of, positive_int, scratch_dir
from torchport.cli import int_at_least

_CHILD = r"""
import json, resource, sys, time
import torch
import torchport.nn.functional as TF
from torchport import native
dt = {"f32": torch.float32, "bf16": torch.bfloat16}[sys.argv[1]]
m = int(sys.argv[2])
def gcc():
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ch.ru_utime + ch.ru_stime
out = []
for k, n, act in ((1024, 4096, None), (768, 3072, "gelu")):
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=g).to(dt), torch.randn(n, k, generator=g).to(dt)
    b = torch.randn(n, generator=g).to(dt)
    c0, g0, t0 = native.stats().compiles, gcc(), time.perf_counter()
    TF.linear(x, w, b, epilogue=act)
    out.append([time.perf_counter() - t0, native.stats().compiles - c0, gcc() - g0])
print(json.dumps(out))
"""

CELLS = ("f32:1", "f32:512", "bf16:1", "bf16:8", "bf16:512")
# the largest M of a cell: its input and output take M x 5120 floats (1.3 GiB here)
MAX_M = 1 << 16


def cell(text: str) -> tuple[str, int]:
    """One ``--cells`` entry, ``DTYPE:M`` (f32 or bf16; 1 <= M <= MAX_M). A bad one was a
    ValueError traceback, or every child's failure (M = 0, an allocation of terabytes)."""
    dtype, colon, m = text.partition(":")
    if not colon:
        raise argparse.ArgumentTypeError(f"expected DTYPE:M (e.g. bf16:8), got {text!r}")
    try:
        return one_of("f32", "bf16")(dtype), int_at_least(1, at_most=MAX_M)(m)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} in {text!r}") from None


def run_cell(dtype: str, m: int) -> list[list[float]]:
    """The two cold tunes of one (dtype, M) cell in a fresh process and cache."""
    with scratch_dir("tp-cold-") as cache:  # (removed also on SIGTERM, child killed)
        env = {**os.environ, "TORCHPORT_CACHE_DIR": cache, "TORCHPORT_NATIVE_PCH": ""}
        env["TORCHPORT_PROGRESS"] = "0"
        res = subprocess.run(
            [sys.executable, "-c", _CHILD, dtype, str(m)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        )
    rows: list[list[float]] = json.loads(res.stdout.strip().splitlines()[-1])
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cells",
        type=comma_list(cell),
        default=",".join(CELLS),
        help=f"DTYPE:M,... (f32 or bf16, 1 <= M <= {MAX_M})",
    )
    p.add_argument("--rounds", type=positive_int, default=1)
    args = p.parse_args(argv)
    cells: list[tuple[str, int]] = args.cells
    first: list[float] = []
    later: list[float] = []
    print("# cold tuning per new shape, fresh cache per cell (target <= 2 s)")
    print(
        "cell          round  first shape: s  compiles  gcc CPU s | new shape+GELU: s  compiles  gcc CPU s"
    )
    for r in range(args.rounds):
        for dtype, m in cells:
            (t1, c1, g1), (t2, c2, g2) = run_cell(dtype, m)
            first.append(t1)
            later.append(t2)
            print(
                f"{dtype:4s} M={m:<6d} {r + 1:5d}  {t1:14.2f}  {c1:8.0f}  {g1:9.2f} |"
                f" {t2:17.2f}  {c2:8.0f}  {g2:9.2f}"
            )
    print(
        f"# median: first shape {statistics.median(first):.2f} s "
        f"({sum(t > 2.0 for t in first)} of {len(first)} over 2 s), "
        f"new shape {statistics.median(later):.2f} s ({sum(t > 2.0 for t in later)} over)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
