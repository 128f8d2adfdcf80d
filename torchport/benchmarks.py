"""Benchmark harness used by the scripts in ``bench/``.

Every benchmark times its anchor (ATen, gloo, LAPACK, a memory read) and ours in the same process,
interleaved rep by rep so that drift on a shared machine hits both alike, and reports medians, the
ratio and the achieved GB/s or GFLOP/s. Results go to the console as a table and to JSON (with the
machine and versions) under ``bench/results/`` or ``--json``.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import platform
import runpy
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from torchport import native
from torchport.autotune.timing import measure, median
from torchport.cli import int_at_least
from torchport.native.cpu import cpu_info
from torchport.version import __version__

if TYPE_CHECKING:
    from torchport.gemm.kernels import Config


def bench_dir() -> Path | None:
    """The repository's ``bench/`` folder (next to the package), or ``./bench``."""
    for cand in (Path(__file__).resolve().parent.parent / "bench", Path.cwd() / "bench"):
        if cand.is_dir():
            return cand
    return None


# Single-cell and A/B tools, run by name (they take required arguments, need particular
# hardware, or measure one kernel variant against another), not by ``torchport bench all``:
# ``make bench`` ran them with no arguments and failed on gemv_kern's required --variants and
# on the AMX A/B off AMX machines
TOOLS = frozenset(
    {
        "collectives_cell",
        "gemm_activation",
        "gemm_amx_ab",
        "gemm_cold",
        "gemm_eo_ab",
        "gemm_epilogue_ab",
        "gemv_bound",
        "gemv_decode",
        "gemv_kern",
        "gemv_sched",
    }
)


def list_benchmarks() -> list[str]:
    """Names of ``bench/bench_<name>.py`` scripts."""
    d = bench_dir()
    if d is None:
        return []
    return sorted(p.stem.removeprefix("bench_") for p in d.glob("bench_*.py"))


def run_benchmark(name: str, argv: Sequence[str] = ()) -> int:
    """Run ``bench/bench_<name>.py`` as ``__main__`` with ``argv``; return its exit status."""
    d = bench_dir()
    assert d is not None
    path = d / f"bench_{name}.py"
    old_argv, old_path = sys.argv, list(sys.path)
    # every benchmark of ``bench all`` runs in this process: one that set the thread count
    # (bench_graphs: 1) left it for the next ones, which then ran on one thread
    threads = torch.get_num_threads()
    sys.argv = [str(path), *argv]
    sys.path.insert(0, str(d.parent))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, str):  # SystemExit("why"): the reason was swallowed, no output
            print(e.code, file=sys.stderr)
            return 1
        return int(e.code or 0)
    finally:
        sys.argv, sys.path[:] = old_argv, old_path
        torch.set_num_threads(threads)
    return 0


# for counts that must be >= 1 (reps, calls, samples, rounds)
positive_int = int_at_least(1)

# The GEMM tools' bounds (``bench gemm --grid``, the A/B tools): each of M, N and K, and the bytes
# of weight copies a tool rotates over. Unbounded, a typo (110080 for 11008) allocated until the
# machine ran out of memory; 32768 covers the widest MLPs in use (28672).
MAX_GEMM_DIM = 1 << 15
MAX_COPY_BYTES = 8 << 30
gemm_dim = int_at_least(1, at_most=MAX_GEMM_DIM)

# a GEMM config's fields in ``--cfg`` text, in the order of ``kernels.Config``, with their bounds
# (ks workspaces of M x N floats: ks is the one that allocates)
_CONFIG_FIELDS = (
    ("mr", int_at_least(1, at_most=64)),
    ("nr", int_at_least(1, at_most=256)),
    ("mc", int_at_least(1, at_most=1 << 16)),
    ("pf", int_at_least(0, at_most=1 << 16)),
    ("kc", int_at_least(0, at_most=1 << 16)),
    ("ks", int_at_least(1, at_most=64)),
    ("nt", int_at_least(0, at_most=1024)),
    ("dp", int_at_least(0, at_most=2)),
)


def gemm_config(text: str) -> Config:
    """An argparse ``type=`` (or :func:`comma_list` entry): a native GEMM
    :class:`~torchport.gemm.kernels.Config` as ``mr:nr:mc[:pf:kc:ks:nt:dp]`` (its fields in
    order, within :data:`_CONFIG_FIELDS`' bounds) that this CPU's ISA level builds
    (:func:`~torchport.gemm.kernels.check_config`). A bad one was a ValueError, TypeError or
    InvalidCandidate traceback, after the weights were made."""
    from torchport.autotune import InvalidCandidate
    from torchport.gemm import kernels

    parts = text.split(":")
    if not 3 <= len(parts) <= len(_CONFIG_FIELDS):
        raise argparse.ArgumentTypeError(f"expected mr:nr:mc[:pf:kc:ks:nt:dp], got {text!r}")
    values = []
    for (name, field_type), part in zip(_CONFIG_FIELDS, parts):
        try:
            values.append(field_type(part))
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{name}: {e} in {text!r}") from None
    cfg = kernels.Config(*values)
    try:
        kernels.check_config(cfg, cpu_info().isa)
    except InvalidCandidate as e:
        raise argparse.ArgumentTypeError(f"{e} (in {text!r})") from None
    return cfg


T = TypeVar("T")


class _Stopped(BaseException):
    """A stop signal inside :func:`stop_signals`, raised so that every ``finally`` on the way out
    runs (workers killed, folders removed); the signal is delivered again once they have."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


# what ends a benchmark from outside besides Ctrl-C (already an exception): kill, timeout, a
# closed terminal. Their default action ended the process at once: no ``finally`` ran
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def stop_signals() -> Iterator[None]:
    """For the block's length, SIGTERM and SIGHUP (where they have their default action and this
    is the main thread) raise an exception instead of ending the process at once, so that every
    ``finally`` inside runs: workers are killed, folders removed. Once the block has unwound the
    exit handlers (``atexit``) run, as at a normal end, and the signal is raised again with its
    default action, so the process still ends by it. (The
    collectives benchmarks' workers and ``torchport demo``'s ft replicas ran on after a
    ``kill``.)"""

    owner = os.getpid()

    def stop(signum: int, frame: Any) -> None:
        if os.getpid() != owner:
            # a forked child inherited the handler: it ends by the signal, as it would have
            # without it (it raised _Stopped out of the child's code: a traceback, exit code 1)
            signal.signal(signum, signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        raise _Stopped(signum)

    mine: dict[int, Any] = {}
    stopped = 0
    try:
        if threading.current_thread() is threading.main_thread():
            for s in STOP_SIGNALS:
                if signal.getsignal(s) is signal.SIG_DFL:
                    mine[s] = signal.signal(s, stop)
        yield
    except _Stopped as e:
        if e.signum not in mine:  # (an outer stop_signals' signal: it re-raises it)
            raise
        stopped = e.signum
    finally:
        for signum, old in mine.items():
            signal.signal(signum, old)
    if stopped:
        # the interpreter's exit handlers first, as at a normal end (the default action skips
        # them: multiprocessing's pymp-* folder, the forkserver's socket in it, stayed in
        # $TMPDIR), and the output buffered so far
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # (closed, or a pipe whose reader is gone)
                stream.flush()
        signal.raise_signal(stopped)  # (the default action: the process ends here)
        raise AssertionError(f"signal {stopped} did not end the process")


@contextlib.contextmanager
def scratch_dir(prefix: str) -> Iterator[str]:
    """A temporary folder under ``$TMPDIR`` that is removed when the block ends, however it ends:
    normally, by an exception, by Ctrl-C, or by SIGTERM / SIGHUP (see :func:`stop_signals`; their
    default action left the collectives benchmarks' ``tp-bench-*`` and ``tp-cell-*`` folders in
    /tmp)."""
    with stop_signals(), tempfile.TemporaryDirectory(prefix=prefix) as d:
        yield d


def compiler() -> str:
    """The C compiler the native kernels are built with, or why there is none (then every
    native kernel falls back to ATen: "ours" times ATen)."""
    from torchport.native.toolchain import compiler_identity

    try:
        return compiler_identity(native.find_compiler())
    except native.NativeError as e:
        return f"unavailable: {e}"


def machine() -> dict[str, Any]:
    """Machine, versions and C compiler recorded with every result."""
    info = cpu_info()
    return {
        "cpu": info.model,
        "cores": info.cores,
        "isa": info.isa,
        "flags": sorted(info.flags),
        "threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchport": __version__,
        "compiler": compiler(),
    }


def compare(
    fns: dict[str, Callable[..., Any]],
    arg_sets: Sequence[tuple[Any, ...]],
    *,
    reps: int = 20,
    warmup: int = 3,
    max_time_s: float = 20.0,
    own_sets: Mapping[str, Sequence[tuple[Any, ...]]] | None = None,
) -> dict[str, float]:
    """Median seconds per call of each function, timed round-robin in one run.

    ``own_sets``: argument sets of their own for some functions (memory no other function
    reads); then every function steps through its sets (``own_sets[name]`` or ``arg_sets``)
    with a counter of its own. Where one function reads other memory than the arguments (a
    packed copy of the weights) a shared rotation lets the others keep the arguments warm in
    a large last-level cache: on a VM whose cache held much of 128 MiB, `bench gemm --quick`'s
    fp32 M=1 1024->4096 read 0.65-0.75x `F.linear` on shared sets and 0.94-0.98x with sets of
    their own (both at the DRAM's 26 GB/s)."""
    own = dict(own_sets or {})
    for k, fn in fns.items():
        measure(fn, own.get(k, arg_sets), reps=0, warmup=warmup, max_time_s=0.0)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    t_end = time.perf_counter() + max_time_s
    n = len(arg_sets)
    # without own sets, one rotation shared by all functions: every call gets the set least
    # recently touched (by anyone), so each side sees equally cold inputs. (A per-function offset such as hash(name)
    # varies per process and can hand one side the set the previous call just warmed.)
    # the order flips every round (A B, B A, A B, ...): a call timed right after another one can
    # run 5-40 % slower at ~10-1000 us sizes whatever it is (cache and predictor state left by
    # the previous call), so a fixed order would bias the second function's figures
    order = list(fns.items())
    call = 0
    turns = dict.fromkeys(fns, 0)
    for i in range(reps):
        for k, fn in order if i % 2 == 0 else reversed(order):
            if own:  # (each function through its own sequence: a shared counter would hand
                # a function only some of the sets, by the order's period)
                sets = own.get(k, arg_sets)
                args = sets[turns[k] % len(sets)]
                turns[k] += 1
            else:
                args = arg_sets[call % n]
                call += 1
            t0 = time.perf_counter()
            fn(*args)
            samples[k].append(time.perf_counter() - t0)
        if time.perf_counter() > t_end and i >= 2:
            break
    return {k: median(v) for k, v in samples.items()}


@dataclass
class Row:
    """One benchmark cell: anchor vs ours."""

    case: str
    anchor: str
    anchor_s: float
    ours_s: float
    work: float  # bytes (GB/s) or flops (GFLOP/s) per call
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """Speed-up of ours over the anchor (> 1 is faster)."""
        return self.anchor_s / self.ours_s if self.ours_s > 0 else float("inf")


@dataclass
class BenchTable:
    """A named table of rows with one throughput unit ("GB/s" or "GFLOP/s")."""

    name: str
    unit: str = "GB/s"
    rows: list[Row] = field(default_factory=list)
    notes: dict[str, dict[str, Any]] = field(default_factory=dict)
    # native.stats().fallbacks when the table started: calls since then that ran ATen in place
    # of a native kernel are saved with the machine (without a compiler every one did, and the
    # JSON recorded ATen's times as ours with no sign of it)
    fallbacks_before: int = 0

    def add(
        self, case: str, anchor: str, anchor_s: float, ours_s: float, work: float, **extra: Any
    ) -> Row:
        row = Row(case, anchor, anchor_s, ours_s, work, dict(extra))
        self.rows.append(row)
        print(self.format_row(row), flush=True)
        return row

    def note(self, key: str, **values: Any) -> None:
        """A result that is not a time per call (a memory ratio, a count): printed as a
        ``# key:`` line and saved under ``notes``, not as a row, whose columns are times (the
        graphs pool's reserved/peak ratios were printed as milliseconds)."""
        self.notes[key] = dict(values)
        print(f"# {key}: " + " ".join(f"{k}={v}" for k, v in values.items()), flush=True)

    def header(self) -> str:
        u = self.unit
        return (
            f"{'case':<34} {'anchor':<18} {'anchor ms':>10} {'ours ms':>10} {'ratio':>7} "
            f"{'anchor ' + u:>14} {'ours ' + u:>12}"
        )

    def format_row(self, r: Row) -> str:
        def throughput(seconds: float) -> str:  # ("-" for no work: 0.00 read as measured)
            return f"{r.work / seconds / 1e9:.2f}" if r.work > 0 and seconds > 0 else "-"

        extra = "  " + " ".join(f"{k}={v}" for k, v in r.extra.items()) if r.extra else ""
        return (
            f"{r.case:<34} {r.anchor:<18} {r.anchor_s * 1e3:>10.4f} {r.ours_s * 1e3:>10.4f} "
            f"{r.ratio:>6.2f}x {throughput(r.anchor_s):>14} {throughput(r.ours_s):>12}{extra}"
        )

    def start(self) -> None:
        self.fallbacks_before = native.stats().fallbacks
        m = machine()
        print(
            f"# {self.name} — {m['cpu']}, {m['cores']} cores, isa {m['isa']}, "
            f"torch {m['torch']}, torchport {m['torchport']}"
        )
        if m["compiler"].startswith("unavailable"):
            print(f"# WARNING: C compiler {m['compiler']}: native kernels fall back to ATen")
        print(self.header())

    def save(self, path: Path | None = None) -> Path:
        """Write JSON with machine, versions and every row (whole or not at all: a temporary
        file beside ``path`` renamed over it)."""
        if path is None:
            d = (bench_dir() or Path.cwd()) / "results"
            d.mkdir(parents=True, exist_ok=True)
            path = d / f"{self.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)  # (a --json in a new folder)
        m = machine()
        m["native_fallbacks"] = native.stats().fallbacks - self.fallbacks_before
        payload = {
            "name": self.name,
            "unit": self.unit,
            "machine": m,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "rows": [{**asdict(r), "ratio": r.ratio} for r in self.rows],
            "notes": self.notes,
        }
        if m["native_fallbacks"]:
            print(f"# WARNING: {m['native_fallbacks']} calls of ours ran ATen (native fallbacks)")
        from torchport.distributed.flight_recorder import write_atomic

        write_atomic(path, json.dumps(payload, indent=1).encode())
        print(f"# wrote {path}")
        return path


def json_path(text: str) -> Path:
    """An argparse ``type=`` for ``--json``: a file that can be written, checked before the run
    (a folder, or a parent that is a file or not writable, failed when the results were saved,
    after the whole run, and they were lost)."""
    path = Path(text)
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"must name a file, not a folder, got {text!r}")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:  # (save() makes missing folders)
        parent = parent.parent
    try:
        with tempfile.TemporaryFile(dir=parent):  # (os.access: yes for root, even in /proc)
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(
            f"cannot write into {str(parent)!r} (for {text!r}): {e.strerror}"
        ) from None
    return path


def comma_list(item: Callable[[str], T]) -> Callable[[str], list[T]]:
    """An argparse ``type=`` for a comma-separated list whose entries ``item`` parses (an
    argparse type such as :data:`positive_int`, :func:`one_of` or :func:`dtype_of`). A bad entry
    is a usage error (exit 2) naming the option and the value; they were tracebacks or empty
    tables."""

    def parse(text: str) -> list[T]:
        entries = [e.strip() for e in text.split(",")]
        if not all(entries):
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
        values = []
        for e in entries:
            try:
                values.append(item(e))
            except (argparse.ArgumentTypeError, ValueError) as err:
                where = f" (in {text!r})" if len(entries) > 1 else ""
                raise argparse.ArgumentTypeError(f"{err}{where}") from None
        return values

    return parse


def one_of(*names: str) -> Callable[[str], str]:
    """An argparse ``type=`` (or :func:`comma_list` entry) that must be one of ``names``."""

    def parse(text: str) -> str:
        if text not in names:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(names)}, got {text!r}")
        return text

    return parse


def dtype_of(*names: str) -> Callable[[str], torch.dtype]:
    """An argparse ``type=`` (or :func:`comma_list` entry): a ``torch`` dtype among ``names``."""
    name = one_of(*names)

    def parse(text: str) -> torch.dtype:
        dtype = getattr(torch, name(text))
        assert isinstance(dtype, torch.dtype), dtype
        return dtype

    return parse


def arg_parser(description: str, *, writes_json: bool = True) -> argparse.ArgumentParser:
    """Common benchmark options: --quick, --reps, and --json where the script saves a
    :class:`BenchTable` (``writes_json=False``: an A/B tool that prints its own lines; it took
    --json and wrote nothing)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="small grid, few reps (smoke run)")
    p.add_argument("--reps", type=positive_int, default=20)
    if writes_json:
        p.add_argument("--json", type=json_path, default=None, help="file to write results to")
    return p
