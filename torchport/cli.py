"""The ``torchport`` command: ``info``, ``bench NAME|all``, ``demo``."""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable, Sequence

Command = Callable[[argparse.Namespace], int]


def cmd_info(args: argparse.Namespace) -> int:
    """Versions, CPU features, compiler, cache location and size, settings."""
    import torch

    from torchport import config, native
    from torchport.autotune import choice_cache
    from torchport.version import __version__

    info = native.cpu_info()
    print(f"torchport {__version__}  torch {torch.__version__}  python {platform.python_version()}")
    print(f"cpu        {info.model} ({info.arch}), {info.cores} cores usable")
    print(f"threads    torch.get_num_threads() = {torch.get_num_threads()}")
    print(f"isa        {info.isa} (hardware max {info.max_isa}; config.isa={config.get('isa')})")
    feats = [
        ("AVX2", "avx2"),
        ("FMA", "fma"),
        ("F16C", "f16c"),
        ("AVX-512F", "avx512f"),
        ("AVX-512BW", "avx512bw"),
        ("AVX-512VL", "avx512vl"),
        ("AVX-512DQ", "avx512dq"),
        ("AVX512-BF16", "avx512_bf16"),
        ("AVX512-VNNI", "avx512_vnni"),
        ("AVX512-VBMI", "avx512vbmi"),
        ("AVX-VNNI", "avx_vnni"),
        ("AMX-TILE", "amx_tile"),
        ("AMX-BF16", "amx_bf16"),
    ]
    print("features   " + "  ".join(f"{n}:{'yes' if info.has(f) else 'no'}" for n, f in feats))
    try:
        cc = native.find_compiler()
        from torchport.native.toolchain import compiler_identity

        print(f"compiler   {compiler_identity(cc)}")
    except native.NativeError as e:
        print(f"compiler   unavailable: {e}")
    try:
        n, size = native.cache_size()
        print(f"cache      {config.get('cache_dir')}  ({n} kernels, {size / 1e6:.2f} MB)")
        print(f"autotune   {len(choice_cache.entries())} cached choices in {choice_cache.path}")
    except OSError as e:  # what `info` is run to diagnose: report it, go on
        print(f"cache      {config.get('cache_dir')}  unusable: {e}")
    print("settings:")
    for name, env, value, _doc in config.describe():
        print(f"  {name:<28} {value!r:<24} ({env})")
    return 0


def int_at_least(lo: int, *, at_most: int | None = None) -> Callable[[str], int]:
    """An argparse ``type=`` for an integer option that must be >= ``lo`` (and <= ``at_most``):
    a usage error, exit 2, names the option and the value."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        if at_most is not None and v > at_most:
            raise argparse.ArgumentTypeError(f"must be <= {at_most}, got {v}")
        return v

    return parse


def positive_float(text: str) -> float:
    """An argparse ``type=`` for a positive finite number."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {v}")
    return v


def cmd_bench(args: argparse.Namespace) -> int:
    """Run benchmarks from bench/."""
    from torchport.benchmarks import TOOLS, list_benchmarks, run_benchmark

    names = list_benchmarks()
    if not names:
        print("no benchmarks found (bench/ must be next to the torchport package)", file=sys.stderr)
        return 2
    if args.name == "list":
        print(
            "\n".join(
                f"{n}  (tool: by name only, not in 'all')" if n in TOOLS else n for n in names
            )
        )
        return 0
    wanted = [n for n in names if n not in TOOLS] if args.name == "all" else [args.name]
    unknown = [w for w in wanted if w not in names]
    if unknown:
        print(f"unknown benchmark {unknown[0]!r}; available: {', '.join(names)}", file=sys.stderr)
        return 2
    per_name = None
    if args.name == "all":
        try:
            per_name = _json_per_benchmark(args.bench_args)
        except ValueError as e:
            print(f"torchport bench: error: {e}", file=sys.stderr)
            return 2
    rc = 0
    for name in wanted:
        rc |= run_benchmark(name, per_name(name) if per_name else args.bench_args)
    return rc


def _json_per_benchmark(argv: Sequence[str]) -> Callable[[str], list[str]]:
    """For ``bench all``: ``--json DIR`` names a folder, each benchmark writing ``DIR/NAME.json``
    (every benchmark was handed the one file, each overwriting the last one's results). An empty
    DIR, or an option in its place (``--json --reps 3``), raises ValueError."""
    rest: list[str] = []
    folder: str | None = None  # (as given: Path drops the "./" of "./-x", an option again)
    i = 0
    while i < len(argv):
        opt, eq, value = argv[i].partition("=")
        # (argparse takes an abbreviation, "--js"; a last "--json" without a value is left to
        # the benchmark's parser to report)
        if len(opt) >= 3 and "--json".startswith(opt) and (eq or i + 1 < len(argv)):
            if not eq:
                i += 1
                value = argv[i]
            # (Path("") is ".": each NAME.json went to the current directory; "--json --reps 3"
            # took "--reps" for the folder; and the benchmark's parser reads "-x/NAME.json" as
            # an option)
            if not value or value.startswith("-"):
                raise ValueError(
                    f"with 'all', --json needs a folder, got {value!r}"
                    + (f" (a folder named so: --json ./{value})" if value else "")
                )
            folder = value
        else:
            rest.append(argv[i])
        i += 1
    if folder is None:
        return lambda name: list(argv)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(
            f"with 'all', --json names a folder (one NAME.json per benchmark), "
            f"and {folder!r} is a file"
        )
    return lambda name: [*rest, "--json", os.path.join(folder, f"{name}.json")]


def cmd_demo(args: argparse.Namespace) -> int:
    """The end-to-end showcase."""
    from torchport import demo
    from torchport.benchmarks import stop_signals
    from torchport.demo.data import CorpusError
    from torchport.demo.report import StageCheckError

    try:
        ctx, stages = demo.prepare(args)  # every option checked before anything runs
    except ValueError as e:
        print(f"torchport demo: error: {e}", file=sys.stderr)
        return 2
    try:
        ctx.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        print(f"torchport demo: error: cannot create --out {args.out!r}: {e}", file=sys.stderr)
        return 2
    try:
        # SIGTERM / SIGHUP unwind the stages: the ft stage's replicas are killed, its lighthouse
        # closed and the report of what ran is written (their default action left the replicas
        # training on, ~80 s, until their quorum timed out)
        with stop_signals():
            demo.execute(ctx, stages)
    except CorpusError as e:  # (e.g. --corpus-mb too small to split)
        print(f"torchport demo: error: {e}", file=sys.stderr)
        return 2
    except StageCheckError as e:  # a failed check (parity, a diverged run); report.json says where
        print(f"torchport demo: error: {e}", file=sys.stderr)
        return 1
    return 0


BENCH_HELP = """Run a benchmark from bench/ ('torchport bench NAME --help' lists its options),
every one but the single-cell tools ('all'), or list them ('list'). Results go to
bench/results/NAME.json, or to the file that --json FILE names; with 'all', --json DIR names a
folder, each benchmark writing DIR/NAME.json."""


def build_parser() -> argparse.ArgumentParser:
    from torchport import demo

    p = argparse.ArgumentParser(prog="torchport", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help=cmd_info.__doc__).set_defaults(func=cmd_info)
    b = sub.add_parser("bench", help=cmd_bench.__doc__, description=BENCH_HELP)
    b.add_argument("name", help="benchmark name, 'all' or 'list'")
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments for the benchmark")
    b.set_defaults(func=cmd_bench)
    d = sub.add_parser("demo", help=cmd_demo.__doc__)
    demo.add_arguments(d)
    d.set_defaults(func=cmd_demo)
    for register in EXTRA_COMMANDS:
        register(sub)
    return p


# Later capabilities append functions that add their own subcommands to the parser.
EXTRA_COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = []


def _register_fr(sub: argparse._SubParsersAction) -> None:
    from torchport.distributed.fr_analyze import register_cli

    register_cli(sub)


EXTRA_COMMANDS.append(_register_fr)


def main(argv: Sequence[str] | None = None) -> int:
    from torchport import config

    args = build_parser().parse_args(argv)
    func: Command = args.func
    try:
        # every setting resolved before the command runs: a bad value that only a worker read
        # (the demo's ft replicas, a benchmark's ranks) was a traceback per process and exit 1,
        # after every earlier stage of the demo had run
        config.describe()
        return func(args)
    except config.ConfigError as e:  # a bad TORCHPORT_* value: reported as argparse does usage
        print(f"torchport: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
