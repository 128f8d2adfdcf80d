"""The GEMM epilogue's vector activations alone: ns per element of ``tp_vgelu``,
``tp_vgelu_tanh``, ``tp_vsilu`` (and ReLU as the floor: a load, a max and a store) on one thread.

Each activation runs over ``--n`` float32 values (default 32768: 128 KiB in, 128 KiB out, in L2)
``--inner`` times inside one native call, so the Python and ctypes overhead is under 0.1 %; the
activations are timed round robin, ``--reps`` rounds, in thread CPU time. The anchor is torch's
own float32 op on the same values (``torch.nn.functional.gelu``/``silu``, one thread), timed in the
same rounds. Values are uniform in [-8, 8].

Run: ``torchport bench gemm_activation`` (``--isa avx2`` builds that level; one the CPU does not
have is a usage error). ``--against path/to/templates.py`` also builds the activations of another
copy of :mod:`torchport.gemm.templates` (e.g. the main branch's) and times them in the same rounds
(A/B).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.machinery
import importlib.util
import statistics
import time
from typing import Any

import torch

from torchport import native
from torchport.benchmarks import arg_parser, one_of, positive_int
from torchport.cli import int_at_least
from torchport.gemm import templates
from torchport.native.cpu import ISA_LEVELS

ACTS = ("relu", "gelu", "gelu_tanh", "silu")

_BODY = r"""
#define TP_ACT_LOOP(name, f) \
TP_EXPORT void name(const float *x, float *y, int64_t n, int64_t inner) { \
    for (int64_t r = 0; r < inner; ++r) \
        for (int64_t j = 0; j + VWIDTH <= n; j += VWIDTH) \
            VSTORE_f32(y + j, f(VLOAD_f32(x + j))); \
}
#define tp_vrelu(v) VMAX(VZERO(), v)
TP_ACT_LOOP(tp_bench_relu, tp_vrelu)
TP_ACT_LOOP(tp_bench_gelu, tp_vgelu)
TP_ACT_LOOP(tp_bench_gelu_tanh, tp_vgelu_tanh)
TP_ACT_LOOP(tp_bench_silu, tp_vsilu)
"""


def library(isa: str, tpl: Any = templates) -> ctypes.CDLL:
    """The activation loops of :mod:`torchport.gemm.templates` (or the module ``tpl``) for
    ``isa``."""
    body = tpl.vocabulary(isa) + f"#define VWIDTH {tpl.VW[isa]}\n" + _BODY
    src = native.render(body.replace("$", "$$"))
    return native.build(src, name=f"gemm_act_bench_{isa}", isa=isa, extra_flags=["-O2"])


def _functions(lib: ctypes.CDLL) -> dict[str, Any]:
    fns = {}
    for act in ACTS:
        fn = getattr(lib, f"tp_bench_{act}")
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]
        fn.restype = None
        fns[act] = fn
    return fns


# the largest --n: x and y are float32 (2 GiB); the loops' length is an int64
MAX_N = 1 << 28


def templates_file(path: str) -> Any:
    """``--against``: another copy of :mod:`torchport.gemm.templates`, loaded while the options
    are parsed (a missing file was a FileNotFoundError traceback, and a name not ending in
    ``.py`` an AssertionError, after our side's library was built)."""
    name = "torchport_gemm_templates_b"
    try:
        # (a loader of its own: spec_from_file_location finds none for a name without .py)
        loader = importlib.machinery.SourceFileLoader(name, path)
        spec = importlib.util.spec_from_loader(name, loader)
        assert spec is not None, path
        mod = importlib.util.module_from_spec(spec)
        loader.exec_module(mod)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {path!r}: {e.strerror}") from None
    except (SyntaxError, ImportError) as e:
        raise argparse.ArgumentTypeError(f"cannot load {path!r}: {e}") from None
    if not (
        callable(getattr(mod, "vocabulary", None)) and isinstance(getattr(mod, "VW", None), dict)
    ):
        raise argparse.ArgumentTypeError(
            f"{path!r} is not a copy of torchport/gemm/templates.py (no vocabulary() and VW)"
        )
    return mod


def main() -> None:
    p = arg_parser(__doc__ or "", writes_json=False)  # (its lines are the result)
    p.add_argument("--n", type=int_at_least(1, at_most=MAX_N), default=32768, help="elements")
    p.add_argument(
        "--inner", type=positive_int, default=200, help="calls per sample (torch's: inner // 10)"
    )
    levels = ISA_LEVELS[: ISA_LEVELS.index(native.cpu_info().max_isa) + 1]
    p.add_argument(
        "--isa",
        type=one_of(*levels),
        default=None,
        help=f"an ISA level this CPU runs: {', '.join(levels)} (default: torchport's)",
    )
    p.add_argument(
        "--against", type=templates_file, default=None, help="another templates.py to time (A/B)"
    )
    args = p.parse_args()
    isa = args.isa or native.cpu_info().isa
    sides = {"ours": _functions(library(isa))}
    if args.against:
        sides["B"] = _functions(library(isa, args.against))
    torch.manual_seed(0)
    x = torch.rand(args.n) * 16 - 8
    y = torch.empty_like(x)
    torch_ops = {
        "relu": torch.relu,
        "gelu": torch.nn.functional.gelu,
        "gelu_tanh": lambda t: torch.nn.functional.gelu(t, approximate="tanh"),
        "silu": torch.nn.functional.silu,
    }
    if args.quick:
        args.reps = 3
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times: dict[str, dict[str, list[float]]] = {k: {a: [] for a in ACTS} for k in sides}
    aten: dict[str, list[float]] = {a: [] for a in ACTS}
    try:
        for rep in range(args.reps):
            for act in ACTS:
                for k in list(sides)[:: 1 if rep % 2 == 0 else -1]:  # A B, B A, ...
                    t0 = time.thread_time()
                    sides[k][act](x.data_ptr(), y.data_ptr(), args.n, args.inner)
                    times[k][act].append((time.thread_time() - t0) / (args.inner * args.n))
                op = torch_ops[act]
                t0 = time.thread_time()
                for _ in range(max(1, args.inner // 10)):
                    op(x)
                aten[act].append((time.thread_time() - t0) / (max(1, args.inner // 10) * args.n))
    finally:
        torch.set_num_threads(threads)
    print(f"# {isa}, n={args.n}, one thread, thread CPU time, median of {args.reps} rounds")
    for act in ACTS:
        o = statistics.median(times["ours"][act]) * 1e9
        a = statistics.median(aten[act]) * 1e9
        line = (
            f"{act:10s} ours {o:6.3f} ns/elem   torch {a:6.3f} ns/elem   torch/ours {a / o:5.2f}x"
        )
        if "B" in times:
            b = statistics.median(times["B"][act]) * 1e9
            line += f"   B {b:6.3f} ns/elem   B/ours {b / o:5.2f}x"
        print(line)


if __name__ == "__main__":
    main()
