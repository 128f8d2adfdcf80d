"""AMX kernel variants in one process: the AMX library's C source as built, and edited copies of it.

Separate-process A/Bs on the development VM moved by 5–10 % between runs, more than most kernel
changes are worth. This renders ``templates.render_amx_source`` for one epilogue, applies each
variant's textual edits (``old>>new``), builds every variant as its own library and calls them
round robin (the order reversed every other round) on the same operands, each through the
engine's own AMX launcher (its workspaces, its output allocation); ``--aten`` adds ``torch.addmm`` with the same bias. A
variant named ``mMC_kKC`` runs the source as built with its own M block and K block. Every
variant's output must equal the first one's (NaN where it has NaN). Prints each median and its
ratio to the first variant (> 1: slower).

Run: ``torchport bench gemm_amx_ab --shape 2048x3072x768 --mc 256 --kc 256 --epilogue
bias_col:bf16 --variant 'ordinary=#define TP_AMX_STREAM_MIN_BYTES 1048576>>#define
TP_AMX_STREAM_MIN_BYTES 1073741824' --variant m512_k256 --aten`` (shape ``MxNxK``; ``--variant``
is ``name=old>>new[|old>>new...]`` or ``mMC_kKC``; needs AMX-BF16).
"""

from __future__ import annotations

import argparse
import itertools
import re
import statistics
import time
from typing import Any

import torch

from torchport import native
from torchport.autotune import InvalidCandidate, cold_copies
from torchport.benchmarks import MAX_COPY_BYTES, MAX_GEMM_DIM, arg_parser, gemm_dim
from torchport.cli import int_at_least
from torchport.gemm import kernels, templates
from torchport.gemm.epilogue import EpilogueError, EpilogueSpec
from torchport.gemm.kernels import Config
from torchport.gemm.pack import pack_cache


def build(src: str, name: str) -> Any:
    """The ``tp_gemm_amx_32x32`` of ``src`` built as its own library."""
    lib = native.build(src, name=name, isa="avx512", extra_flags=["-O2", *templates.AMX_FLAGS])
    return kernels.amx_bind(lib)


def operands(spec: EpilogueSpec, m: int, n: int) -> list[torch.Tensor]:
    """Random epilogue operands of ``spec``'s kinds and dtypes."""
    dts = {"bf16": torch.bfloat16, "f32": torch.float32}
    shapes = {"add": (m, n), "bias_row": (m,), "scale_row": (m,), "bias_col": (n,)}
    shapes["scale_col"] = (n,)
    return [torch.randn(shapes[op.kind]).to(dts[op.dtype]) for op in spec.ops if op.kind in shapes]


def shape(text: str) -> tuple[int, int, int]:
    """``--shape MxNxK``, each in [1, MAX_GEMM_DIM] (a bad one was a ValueError traceback, a
    huge one an allocation until the memory ran out)."""
    parts = text.split("x")
    if len(parts) != 3:
        raise argparse.ArgumentTypeError(f"expected MxNxK (e.g. 2048x3072x768), got {text!r}")
    try:
        m, n, k = (gemm_dim(v) for v in parts)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} in {text!r}") from None
    return m, n, k


# the M block (rows of each thread's fp32 sums workspace) and K block of a variant or option
MAX_BLOCK = 1 << 16
block = int_at_least(1, at_most=MAX_BLOCK)


def epilogue(text: str) -> EpilogueSpec:
    """``--epilogue``: an :class:`EpilogueSpec`'s text (a bad one was an EpilogueError
    traceback)."""
    try:
        return EpilogueSpec.decode(text)
    except EpilogueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def variant(text: str) -> str:
    """``--variant``: ``mMC_kKC`` (blocks in [1, MAX_BLOCK]) or ``NAME=old>>new[|old>>new...]``
    (a name, and edits each with a non-empty ``old``: an empty one inserted ``new`` between
    every two characters of the source; a missing ``>>`` deleted ``old``)."""
    blocks = re.fullmatch(r"m(\d+)_k(\d+)", text)
    if blocks:
        try:
            for size in blocks.groups():
                block(size)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{e} in {text!r}") from None
        return text
    name, eq, edits = text.partition("=")
    if not (name and eq) or any(
        not old or not arrow
        for old, arrow, _ in (e.partition(">>") for e in filter(None, edits.split("|")))
    ):
        raise argparse.ArgumentTypeError(
            f"expected NAME=old>>new[|old>>new...] or mMC_kKC, got {text!r}"
        )
    return text


def variant_name(text: str) -> str:
    """The name a parsed ``--variant`` is reported (and kept) under."""
    return text if re.fullmatch(r"m(\d+)_k(\d+)", text) else text.partition("=")[0]


# the names of the other rows: the source as built, and torch.addmm (--aten)
RESERVED_NAMES = ("as_built", "aten")


class Variants(argparse.Action):
    """``--variant``, repeated: each name at most once and none of :data:`RESERVED_NAMES` (a
    second one of a name replaced the first in the results, unreported; an ``aten`` variant was
    replaced by ``--aten``'s row, an ``as_built`` one replaced the source as built)."""

    def __call__(
        self, parser: Any, namespace: argparse.Namespace, values: Any, option: Any = None
    ) -> None:
        earlier = list(getattr(namespace, self.dest) or [])
        name = variant_name(values)
        if name in RESERVED_NAMES:
            raise argparse.ArgumentError(
                self,
                f"a variant's name must not be as_built (the source as built's row) or aten "
                f"(--aten's), got {values!r}",
            )
        if name in map(variant_name, earlier):
            raise argparse.ArgumentError(
                self, f"each variant's name must be given once, {name!r} is repeated in {values!r}"
            )
        setattr(namespace, self.dest, [*earlier, values])


def main(argv: list[str] | None = None) -> None:
    p = arg_parser(__doc__.split("\n\n")[0], writes_json=False)  # (prints its medians)
    p.add_argument(
        "--shape", type=shape, default="2048x3072x768", help=f"MxNxK, each 1 to {MAX_GEMM_DIM}"
    )
    p.add_argument("--mc", type=block, default=256, help=f"M block, 1 to {MAX_BLOCK}")
    p.add_argument("--kc", type=block, default=256, help=f"K block, 1 to {MAX_BLOCK}")
    p.add_argument(
        "--epilogue", type=epilogue, default="bias_col:bf16", help="an EpilogueSpec's text"
    )
    p.add_argument(
        "--variant",
        type=variant,
        action=Variants,
        default=[],
        help="NAME=old>>new[|old>>new...] or mMC_kKC, each name once (not as_built or aten)",
    )
    p.add_argument("--aten", action="store_true", help="also time torch.addmm (bias_col only)")
    p.add_argument(
        "--cold",
        type=int_at_least(0, at_most=MAX_COPY_BYTES),
        default=0,
        help="bytes of weight copies to rotate through (each call reads the next copy; 0: one; "
        f"at most {MAX_COPY_BYTES})",
    )
    args = p.parse_args(argv)
    if not kernels.amx_ready():
        raise SystemExit("bench gemm_amx_ab: this machine has no AMX-BF16 the kernel may use")
    reps = 3 if args.quick else max(3, args.reps)
    m, n, k = args.shape
    spec: EpilogueSpec = args.epilogue
    text = spec.encode()
    base = native.render(templates.render_amx_source(spec, spec.out or "bf16").replace("$", "$$"))

    def launcher(fn: Any, mc: int, kc: int) -> Any:  # (the launcher the engine runs, on fn)
        cfg = Config(*kernels.AMX_TILE, mc, kc=kc, dp=kernels.AMX)
        try:  # (kc a multiple of 32)
            kernels.check_config(cfg, "avx512")
        except InvalidCandidate as e:
            p.error(f"argument --mc/--kc or --variant m{mc}_k{kc}: {e}")
        return kernels._amx_launcher(spec, cfg, torch.bfloat16, fn=fn)

    built = build(base, "amxab_base")
    launches = {"as_built": launcher(built, args.mc, args.kc)}
    for v in args.variant:
        blocks = re.fullmatch(r"m(\d+)_k(\d+)", v)
        if blocks:
            launches[v] = launcher(built, int(blocks.group(1)), int(blocks.group(2)))
            continue
        name, _, edits = v.partition("=")
        src = base
        for edit in filter(None, edits.split("|")):
            old, _, new = edit.partition(">>")
            if "TP_AMX_SUM_SLOTS" in old:  # (the launcher sizes the workspace from the Python one)
                raise SystemExit(
                    "the sums workspace follows templates.AMX_SUM_SLOTS: edit it there"
                )
            if old not in src:
                raise SystemExit(f"variant {name!r}: {old!r} is not in the source")
            src = src.replace(old, new)
        launches[name] = launcher(build(src, f"amxab_{name}"), args.mc, args.kc)
    torch.manual_seed(0)
    a, b = torch.randn(m, k).to(torch.bfloat16), torch.randn(k, n).to(torch.bfloat16)
    # weight copies (each with its packed panels) rotated so that a call reads a cold weight
    # when their total exceeds the last-level cache, as a model's layers do
    copies = [
        (w, pack_cache.get(w, templates.AMX_NR, pairs=True))
        for (w,) in cold_copies((b,), budget=args.cold)
    ]
    ops = operands(spec, m, n)

    def rotated(call: Any) -> Any:
        turns = itertools.cycle(copies)
        return lambda: call(*next(turns))

    runs: dict[str, Any] = {
        name: rotated(lambda w, packed, f=f: f(a, w, ops, packed=packed))
        for name, f in launches.items()
    }
    if args.aten:
        if [op.kind for op in spec.ops] != ["bias_col"]:
            raise SystemExit("--aten compares with torch.addmm: --epilogue bias_col:bf16 only")
        runs["aten"] = rotated(lambda w, packed: torch.addmm(ops[0], a, w))
    first = runs["as_built"]().float()
    for name in launches:
        if not torch.equal(runs[name]().float().nan_to_num(), first.nan_to_num()):
            raise SystemExit(f"variant {name!r} computes another result than the source as built")
    samples: dict[str, list[float]] = {name: [] for name in runs}
    order = list(runs.items())
    for r in range(reps):
        for name, run in order if r % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            run()
            samples[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(v) for name, v in samples.items()}
    flops = 2.0 * m * n * k
    print(
        f"# AMX kernel variants, M={m} N={n} K={k}, {text or 'no epilogue'}, {reps} rounds, "
        f"{len(copies)} weight copies"
    )
    for name, t in med.items():
        ratio = t / med["as_built"]
        print(f"{name:24s} {t * 1e3:9.3f} ms  {flops / t / 1e9:8.0f} GFLOP/s  {ratio:6.3f}x")


if __name__ == "__main__":
    main()
