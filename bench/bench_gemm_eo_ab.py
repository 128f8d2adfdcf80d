"""bf16 AVX2 tiles with and without the even/odd reading of B's vector pairs, in one process.

``templates._eo_pairs`` makes the AVX2 tiles read 16 bf16 weights with one load, a shift and an
and (the even and the odd columns) where two widening loads take two shuffles and two shifts.
Separate-process A/Bs on the development VM move by 5-10 % between runs, so this builds each
config twice in one process, once as the engine does and once with the pairs off (a library of
its own: the source differs), and calls the two launchers alternately (the order reversed every
other round) on the least recently used of enough weight copies (``--copies``; default: 96 MiB
of them, so the weights stream from DRAM; 1 keeps one copy warm in the caches). Both outputs
must match the float64 reference. Prints each median and minimum, GFLOP/s, and the ratio of the
medians (on / off: < 1 is faster with the pairs).

Run: ``torchport bench gemm_eo_ab --m 8 --d 4096 --h 11008 --cfgs 4:24:8:64,4:24:8:0 --reps 21``
(``cfgs``: ``mr:nr:mc[:pf:kc:ks:nt]`` of ``kernels.Config``, comma-separated; on a machine
whose ISA is not AVX2 both builds are the same code).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from torchport import native
from torchport.benchmarks import (
    MAX_COPY_BYTES,
    MAX_GEMM_DIM,
    arg_parser,
    comma_list,
    gemm_config,
    gemm_dim,
)
from torchport.cli import int_at_least
from torchport.gemm import kernels, templates
from torchport.gemm.kernels import NO_EPILOGUE, Config
from torchport.gemm.pack import pack_b


def launchers(cfgs: list[Config], isa: str, pairs: bool) -> dict[Config, Callable]:
    """Each config's launcher with the even/odd pairs on (as shipped) or off."""
    shipped = templates._eo_pairs
    if not pairs:
        templates._eo_pairs = lambda nv, vw, btag: 0
    try:
        for cached in (kernels.library, kernels._function, kernels.launcher):
            cached.cache_clear()
        return {
            c: kernels.launcher(NO_EPILOGUE, c, torch.bfloat16, torch.bfloat16, isa) for c in cfgs
        }
    finally:
        templates._eo_pairs = shipped
        for cached in (kernels.library, kernels._function, kernels.launcher):
            cached.cache_clear()


def main() -> None:
    p = arg_parser(__doc__ or "", writes_json=False)  # --reps (rounds), --quick (3 rounds)
    dim = f"1 to {MAX_GEMM_DIM}"
    p.add_argument("--m", type=gemm_dim, default=8, help=f"M ({dim})")
    p.add_argument("--d", type=gemm_dim, default=4096, help=f"K ({dim})")
    p.add_argument("--h", type=gemm_dim, default=11008, help=f"N ({dim})")
    p.add_argument(
        "--cfgs",
        type=comma_list(gemm_config),
        default="4:24:8:64,4:24:8:0",
        help="mr:nr:mc[:pf:kc:ks:nt],... of kernels.Config, tiles this CPU builds",
    )
    p.add_argument(
        "--copies",
        type=int_at_least(0),
        default=0,
        help=f"weight copies (0: 96 MiB of them; at most {MAX_COPY_BYTES >> 30} GiB in all)",
    )
    args = p.parse_args()
    if args.quick:
        args.reps = 3
    m, k, n = args.m, args.d, args.h
    if args.copies * 2 * n * k > MAX_COPY_BYTES:  # (checked before anything is allocated)
        p.error(
            f"argument --copies: copies of a {n}x{k} bf16 weight must fit in "
            f"{MAX_COPY_BYTES >> 30} GiB (at most {MAX_COPY_BYTES // (2 * n * k)}), "
            f"got {args.copies}"
        )
    cfgs: list[Config] = args.cfgs
    isa = native.cpu_info().isa
    built = {"off": launchers(cfgs, isa, False), "on": launchers(cfgs, isa, True)}
    g = torch.Generator().manual_seed(0)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    copies = args.copies or max(2, -(-(96 << 20) // max(1, 2 * n * k)))
    ws = [torch.randn(n, k, generator=g).to(torch.bfloat16) for _ in range(copies)]
    packs = {(c.nr, i): pack_b(w.t(), c.nr) for c in cfgs for i, w in enumerate(ws)}
    ref = x.double() @ ws[0].t().double()
    tol = 2e-2 * float(ref.abs().max()) + 1e-3
    calls: dict[str, Callable[[int], torch.Tensor]] = {}
    for c in cfgs:
        for tag, launch in built.items():

            def call(i: int, launch=launch[c], c: Config = c) -> torch.Tensor:
                return launch(x, ws[i].t(), [], packed=packs[(c.nr, i)])

            torch.testing.assert_close(call(0).double(), ref, rtol=2e-2, atol=tol)
            calls[f"{c.name}:{tag}"] = call
    samples: dict[str, list[float]] = {name: [] for name in calls}
    step = 0
    for r in range(args.reps):
        for name in list(calls) if r % 2 == 0 else list(calls)[::-1]:
            i, step = step % copies, step + 1
            t0 = time.perf_counter()
            calls[name](i)
            samples[name].append(time.perf_counter() - t0)
    flop = 2.0 * m * n * k
    print(f"bf16 M={m} {k}->{n}, {copies} weight copies, {args.reps} rounds, isa {isa}")
    for name, ts in samples.items():
        med = statistics.median(ts)
        print(
            f"{name:34s} {med * 1e3:8.3f} ms (min {min(ts) * 1e3:8.3f})  {flop / med / 1e9:6.1f} GFLOP/s"
        )
    for c in cfgs:
        on, off = (statistics.median(samples[f"{c.name}:{t}"]) for t in ("on", "off"))
        print(f"{c.name}: on/off {on / off:.3f}")


if __name__ == "__main__":
    main()
