"""Flight Recorder dumps in torch's own format, for torch's analyzer (``torchfrtrace``).

torch reads per-rank dumps of ProcessGroupNCCL's recorder: one pickle per rank, named
``<prefix><rank>`` (``nccl_trace_rank_<r>`` by default), holding ``version`` ("2.10" in torch
2.13), ``pg_config`` (per group: name, description, ranks as the string ``"[0, 1]"``),
``pg_status``, ``comm_lib_version`` and ``entries``. :func:`to_torch` turns one of our JSON
snapshots into that dict, :func:`export` writes a folder of them from our ``rank_<r>.json`` dumps
(``torchport fr export SRC... --to DIR``), and ``FlightRecorder.dump(format="torch")`` writes this
rank's directly. Then ``python -m torch.distributed.flight_recorder.fr_trace DIR`` analyses them.

How our entries map onto torch's:

* ``profiling_name`` is ``"<backend>:<op>"`` with torch's op name (``all_gather_into_tensor`` is
  ``_all_gather_base``, ``reduce_scatter_tensor`` ``_reduce_scatter_base``, ``all_to_all_single``
  ``all_to_all``, ``all_reduce_coalesced`` ``allreduce_coalesced``, ``monitored_barrier``
  ``barrier``, the fault-tolerance manager's ``allreduce`` ``all_reduce``); a send or receive is
  ``"send <me>-><peer>"`` / ``"recv <me><-<peer>"`` in group ranks, as torch writes them. An op
  torch has no name for, a receive from any source (its sender is not recorded) and an op of a
  group whose members were not recorded are left out, with one warning per reason: torch's
  analyzer refuses such an entry.
* ``collective_seq_id`` / ``p2p_seq_id`` count from 1 as torch's do (ours count from 0); the other
  kind's counter of an entry is the group's count at that point of the dump (of a dump whose
  buffer wrapped, taken from the next entry of that kind). ``op_id`` counts the group's ops.
* ``input_sizes`` / ``output_sizes`` split the recorded tensors as torch's recorder does: an
  ``all_gather`` list is one ``[world, *shape]`` output (``reduce_scatter``'s one input); a
  ``gather`` has no outputs and a ``scatter`` no inputs (the root's list is not recorded);
  ``barrier`` has neither; the ``*_coalesced`` all-gather and reduce-scatter list their outputs,
  then their inputs. Dtypes are c10's names (``Float``, ``BFloat16``).
* The ops of a ``batch_isend_irecv`` (which share a ``p2p_seq_id``) are followed by torch's
  ``"<backend>:coalesced"`` entry, as torch's recorder ends a coalesced batch. They keep our
  numbering (ProcessGroupNCCL gives a batch the next collective id instead), on which torch
  2.13's analyzer fails when a batch's ``p2p_seq_id`` equals a neighbouring collective's id;
  a rank's one-op part of a batch looks like a lone send / recv (no ``coalesced`` end): see
  the README's account.
* ``record_id`` is ours less the entries left out before it (torch's analyzer lines the ranks
  up from the highest first record id: left out ops at the start of one rank would hide the
  others' first ops).
* ``state``: ``scheduled`` / ``started`` / ``completed`` as ours; an ``errored`` op is
  ``completed`` (torch retires a work that ended in an exception; the error is in our JSON only)
  and an ``unknown`` one (a gloo p2p work dropped without ``wait()``) ``started``.
  ``duration_ms`` is present for completed ops only.
* Not recorded by us, left as torch's recorder would without them: ``timeout_ms`` is torch's
  default group timeout, ``thread_name`` / ``thread_id`` are empty, ``comm_lib_version`` is empty,
  ``frames`` is empty unless stacks were recorded (``TORCHPORT_FR_STACK=1``; innermost first,
  as torch lists them).
* Groups: ``default`` is torch's ``("0", "default_pg")``, any other keeps its name with the
  description ``"undefined"``. Of a group re-created under the same name, the newest
  incarnation with ops in the dump keeps the name (a restarted rank knows only that one; a
  rank that destroyed the group but has no op of the next one yet keeps it for its last ops,
  as a peer that did not destroy it does) and the ops of an older one ``n`` are on the group
  ``"<name>.<n>"`` (with its own members, which the recorder keeps for its newest 256
  destroyed groups; else with the newest one's).

Our JSON stays the default dump format; this module writes pickle and never reads it.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import pickle
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torchport.distributed.flight_recorder import P2P_OPS, write_atomic
from torchport.distributed.fr_analyze import (
    DumpError,
    check_same_job,
    newest_incarnations,
    read_dump_files,
)

TORCH_FORMAT_VERSION = "2.10"  # torch 2.13's FlightRecorder.hpp version_val
DEFAULT_PREFIX = "nccl_trace_rank_"
# the backends torch's analyzer accepts before the ':' of a profiling name
TORCH_BACKENDS = ("nccl", "ncclx", "xccl", "gloo", "rccl", "rcclx", "mccl", "hccl")
_TIMEOUT_MS = 30 * 60 * 1000  # torch's default_pg_timeout (the group's timeout is not recorded)
_log = logging.getLogger(__name__)


class ExportError(DumpError):
    """Dumps that cannot be exported together (another job's), or a destination holding other
    ranks' dumps. (A destination that cannot be written raises the OSError, as
    ``FlightRecorder.dump`` does.)"""


# our op name -> torch's (the names torch's analyzer knows; types.COLLECTIVES and send / recv)
_TORCH_OPS = {
    "all_reduce": "all_reduce",
    "allreduce": "all_reduce",
    "broadcast": "broadcast",
    "reduce": "reduce",
    "all_gather": "all_gather",
    "allgather": "all_gather",
    "all_gather_into_tensor": "_all_gather_base",
    "all_gather_single": "_all_gather_base",
    "all_gather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_tensor": "_reduce_scatter_base",
    "reduce_scatter_single": "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced",
    "all_reduce_coalesced": "allreduce_coalesced",
    "all_to_all": "all_to_all",
    "all_to_all_single": "all_to_all",
    "gather": "gather",
    "scatter": "scatter",
    "barrier": "barrier",
    "monitored_barrier": "barrier",
    "send": "send",
    "recv": "recv",
}

# our dtype name (str(torch dtype) without "torch.") -> c10::toString of its ScalarType
_C10_DTYPES = {
    "uint8": "Byte",
    "int8": "Char",
    "int16": "Short",
    "int32": "Int",
    "int64": "Long",
    "float16": "Half",
    "float32": "Float",
    "float64": "Double",
    "complex32": "ComplexHalf",
    "complex64": "ComplexFloat",
    "complex128": "ComplexDouble",
    "bool": "Bool",
    "qint8": "QInt8",
    "quint8": "QUInt8",
    "qint32": "QInt32",
    "bfloat16": "BFloat16",
    "quint4x2": "QUInt4x2",
    "quint2x4": "QUInt2x4",
    "float8_e5m2": "Float8_e5m2",
    "float8_e4m3fn": "Float8_e4m3fn",
    "float8_e5m2fnuz": "Float8_e5m2fnuz",
    "float8_e4m3fnuz": "Float8_e4m3fnuz",
    "uint16": "UInt16",
    "uint32": "UInt32",
    "uint64": "UInt64",
    "float8_e8m0fnu": "Float8_e8m0fnu",
    "float4_e2m1fn_x2": "Float4_e2m1fn_x2",
}

_FRAME = re.compile(r'\s*File "(?P<file>[^"]*)", line (?P<line>\d+), in (?P<name>[^\n]*)')


_Side = tuple[list[Any], list[Any]]  # (sizes, dtypes) of an op's inputs or outputs
# torch ops recorded as their outputs, then as many inputs
_OUTS_THEN_INS = (
    "all_to_all",
    "all_gather_into_tensor_coalesced",
    "reduce_scatter_tensor_coalesced",
)


def _split(op: str, sizes: list[list[int]], dtypes: list[str]) -> tuple[_Side, _Side]:
    """(input sizes, input dtypes), (output sizes, output dtypes) of torch op ``op`` from the
    sizes and dtypes we recorded (the op's tensors in argument order)."""
    n = len(sizes)
    ins: _Side = (sizes, dtypes)
    outs: _Side = (sizes, dtypes)
    if op == "barrier":
        ins = outs = ([], [])
    elif op == "gather":  # this rank's own tensor (the root's list is not recorded)
        outs = ([], [])
    elif op == "scatter":
        ins = ([], [])
    elif op in ("all_gather", "reduce_scatter") and n >= 2:
        # (list, tensor) / (tensor, list): the list is one [world, *shape] buffer, as torch
        # flattens it, when its tensors agree (an uneven list stays a list)
        one, many = (n - 1, slice(0, n - 1)) if op == "all_gather" else (0, slice(1, n))
        listed, dts = sizes[many], dtypes[many]
        if all(s == listed[0] for s in listed) and len(set(dts)) == 1:
            flat: _Side = ([[len(listed), *listed[0]]], [dts[0]])
        else:
            flat = (listed, dts)
        single = ([sizes[one]], [dtypes[one]])
        ins, outs = (single, flat) if op == "all_gather" else (flat, single)
    elif op in ("_all_gather_base", "_reduce_scatter_base") and n == 2:
        # (output, input): the larger is the gathered / scattered buffer, whatever the spelling
        big = 0 if math.prod(sizes[0]) >= math.prod(sizes[1]) else 1
        pair = ([sizes[big]], [dtypes[big]]), ([sizes[1 - big]], [dtypes[1 - big]])
        outs, ins = pair if op == "_all_gather_base" else pair[::-1]
    elif op in _OUTS_THEN_INS and n >= 2:  # (output(s), input(s))
        h = n // 2
        outs, ins = (sizes[:h], dtypes[:h]), (sizes[h:], dtypes[h:])
    return (list(ins[0]), list(ins[1])), (list(outs[0]), list(outs[1]))


def _frames(stack: Any) -> list[dict[str, Any]]:
    """torch's ``frames`` (name, filename, line as an int, as torch's captured tracebacks
    give it; innermost first, as torch captures them) from our recorded stack
    (``traceback.format_stack`` lines, outermost first)."""
    out: list[dict[str, Any]] = []
    for line in reversed(stack or ()):
        m = _FRAME.match(line) if isinstance(line, str) else None
        if m:
            out.append({"name": m["name"], "filename": m["file"], "line": int(m["line"])})
    return out


def _pg_name(group: str, inc: int, current: int) -> str:
    """torch's group name of incarnation ``inc`` of our group ``group`` whose newest
    incarnation is ``current``: the newest keeps the name (a restarted rank knows only that
    one, as its incarnation 0), older ones are ``<name>.<inc>``."""
    base = "0" if group == "default" else group
    return base if inc == current else f"{base}.{inc}"


def _pg_id(pg: str, ids: dict[str, int]) -> int:
    """torch's integer ``pg_id`` of group ``pg``: its name when that is a number (torch's
    groups are named by their uid), else the next id above every one given so far."""
    hit = ids.get(pg)
    if hit is None:
        # ASCII digits that fit an int64 (a dump's name "²" or of 5000 digits: int() raised)
        uid = pg.isascii() and pg.isdigit() and len(pg) < 19
        hit = ids[pg] = int(pg) if uid else max([999, *ids.values()]) + 1
    return hit


def _left_out(e: dict[str, Any], name: str | None, rank: int, members: list[int]) -> str:
    """Why entry ``e`` cannot be in torch's dump ("" if it can): torch's analyzer refuses an
    op it has no name for, and needs the group's members and a point-to-point op's peer."""
    if name is None:
        return f"torch has no op {e['op']!r}"
    if rank not in members:
        return f"the members of its group {e['group']!r} are not recorded"
    if e["op"] in P2P_OPS and e.get("peer") not in members:
        if e.get("peer") == -1:
            return "its peer is not recorded (a receive from any source)"
        return f"its peer {e.get('peer')} is not in its group {e['group']!r}"
    return ""


def _pg_config(pg: str, group: str, members: list[int]) -> dict[str, str]:
    """torch's ``pg_config`` item of group ``pg`` (our ``group``) with sorted ``members``."""
    desc = "default_pg" if group == "default" else "undefined"
    return {"name": pg, "desc": desc, "ranks": f"[{', '.join(map(str, members))}]"}


def _note_status(st: dict[str, int], seq: int, state: str) -> None:
    """Update torch's ``pg_status`` item ``st`` with collective ``seq`` in ``state``."""
    for key in ("enqueued", "started", "completed"):
        st.setdefault(f"last_{key}_collective", -1)
    st["last_enqueued_collective"] = seq
    if state != "scheduled":
        st["last_started_collective"] = seq
    if state == "completed":
        st["last_completed_collective"] = seq


def _check_backend(backend: str) -> None:
    if backend not in TORCH_BACKENDS:
        raise ValueError(
            f"backend must be one of {TORCH_BACKENDS} (torch's analyzer), got {backend!r}"
        )


def to_torch(dump: dict[str, Any], *, backend: str = "nccl") -> dict[str, Any]:
    """torch's Flight Recorder dump dict for one of our snapshots (a checked ``rank_<r>.json``
    or :meth:`FlightRecorder.snapshot`); ``backend`` is the profiling names' prefix."""
    _check_backend(backend)
    rank, world = int(dump["rank"]), int(dump["world_size"])
    groups: dict[str, list[int]] = {k: list(v) for k, v in (dump.get("groups") or {}).items()}
    groups.setdefault("default", list(range(world)))
    # the members of destroyed groups, by (name, incarnation)
    old_groups = {(g, int(i)): list(r) for g, i, r in dump.get("retired_groups") or ()}
    entries = dump["entries"]
    # each group's newest incarnation among the entries: it keeps torch's name. Not the dump's
    # count: a rank that destroyed the group (which counts the next one) before any op of a
    # new one named its last ops "<name>.<n>" while a peer that had not destroyed it yet kept
    # the plain name, and torch's analyzer reported every one of them as missing a rank
    # (per dump, not across the ranks: a restarted rank numbers its incarnations from 0, so one
    # rank's count says nothing about another's. The cost: when every rank destroyed and
    # re-created the group and one hangs in the new group's first op while a peer never got
    # there, the peer's last ops keep the plain name and torch's analyzer misreports them)
    current = newest_incarnations(entries)

    # the group's count of each kind (collective, p2p) before each entry: the last seq id of
    # that kind seen; before the dump's first one, that entry's own seq id (the buffer wrapped)
    first: dict[tuple[str, int, bool], int] = {}
    for e in entries:
        first.setdefault((e["group"], e.get("incarnation") or 0, e["op"] in P2P_OPS), e["seq_id"])
    count: dict[tuple[str, int, bool], int] = {}
    op_ids: dict[tuple[str, int], int] = {}
    status: dict[str, dict[str, int]] = {}
    pg_ids: dict[str, int] = {}
    config: dict[str, dict[str, str]] = {}
    out: list[dict[str, Any]] = []
    skipped: dict[str, list[Any]] = {}  # why -> the record ids left out for it
    n_skipped = 0
    for e in entries:
        group, inc, state = e["group"], e.get("incarnation") or 0, e["state"]
        p2p = e["op"] in P2P_OPS
        name = _TORCH_OPS.get(e["op"])
        members = sorted(old_groups.get((group, inc)) or groups.get(group, []))
        why = _left_out(e, name, rank, members)
        if why:
            skipped.setdefault(why, []).append(e.get("record_id"))
            n_skipped += 1
            continue
        assert name is not None  # (_left_out said why otherwise)
        # torch's ids count from 1; our seq ids from 0
        own = e["seq_id"] + 1
        other = count.get((group, inc, not p2p))
        if other is None:
            other = first.get((group, inc, not p2p), 0)  # none of that kind yet, or wrapped
        count[(group, inc, p2p)] = own
        coll_seq, p2p_seq = (other, own) if p2p else (own, other)
        op_id = op_ids.get((group, inc), coll_seq + p2p_seq - 1) + 1
        op_ids[(group, inc)] = op_id
        pg = _pg_name(group, inc, current.get(group, 0))
        pg_id = _pg_id(pg, pg_ids)
        config[pg] = _pg_config(pg, group, members)
        desc = config[pg]["desc"]
        if p2p:
            me, peer = members.index(rank), members.index(e["peer"])
            name = f"send {me}->{peer}" if e["op"] == "send" else f"recv {me}<-{peer}"
        sizes = [list(s) for s in e.get("sizes", [])]
        dtypes = [_C10_DTYPES.get(d, d) for d in e.get("dtypes", [])]
        (in_s, in_d), (out_s, out_d) = _split(name, sizes, dtypes)
        t_end = e.get("time_completed_ns")
        rid = e.get("record_id")
        torch_state = {"errored": "completed", "unknown": "started"}.get(state, state)
        done = torch_state == "completed"
        t_start = e.get("time_started_ns") or (e.get("time_scheduled_ns") if done else None)
        if torch_state == "scheduled":
            t_start = None
        entry: dict[str, Any] = {
            "frames": _frames(e.get("stack")),
            # less the entries left out before it: torch's analyzer starts every rank at the
            # highest first record id of any rank, so a gap at the start of one rank's dump
            # dropped the other ranks' first ops (a false "missing ranks"); a wrapped
            # buffer's offset stays. Entries left out and already evicted from a wrapped
            # buffer cannot be subtracted (the recorder does not count them): there the
            # analyzer may still report ranks missing from the first ops
            "record_id": len(out) if rid is None else rid - n_skipped,
            "pg_id": pg_id,
            "process_group": (pg, desc),
            "thread_name": "",
            "thread_id": "",
            "collective_seq_id": coll_seq,
            "p2p_seq_id": p2p_seq,
            "op_id": op_id,
            "profiling_name": f"{backend}:{name}",
            "time_created_ns": e.get("time_scheduled_ns") or 0,
        }
        if done and e.get("duration_ms") is not None:
            entry["duration_ms"] = float(e["duration_ms"])
        entry.update(
            input_sizes=in_s,
            input_dtypes=in_d,
            output_sizes=out_s,
            output_dtypes=out_d,
            state=torch_state,
            time_discovered_started_ns=t_start,
            time_discovered_completed_ns=(t_end or t_start) if done else None,
            retired=done,
            timeout_ms=_TIMEOUT_MS,
            is_p2p=p2p,
        )
        out.append(entry)
        if not p2p:
            _note_status(status.setdefault(str(pg_id), {}), coll_seq, torch_state)
    for why, ids in skipped.items():  # (one line per reason: a dump holds thousands of ops)
        _log.warning(
            "rank %d: %d entr%s left out of the torch dump (record ids %s): %s",
            rank,
            len(ids),
            "y" if len(ids) == 1 else "ies",
            ", ".join(map(str, ids[:5])) + (", ..." if len(ids) > 5 else ""),
            why,
        )
    # every group of this rank, also one without entries in the window (torch lists each group
    # the rank is a member of)
    for group, members in groups.items():
        if rank in members:
            pg = _pg_name(group, 0, 0)
            config.setdefault(pg, _pg_config(pg, group, sorted(members)))
    return {
        "version": TORCH_FORMAT_VERSION,
        "comm_lib_version": "",
        "pg_config": config,
        "pg_status": status,
        "entries": _end_batches(out, backend),
    }


_STATE_ORDER = {"scheduled": 0, "started": 1, "completed": 2}


def _end_batches(entries: list[dict[str, Any]], backend: str) -> list[dict[str, Any]]:
    """``entries`` with torch's ``coalesced`` entry after each ``batch_isend_irecv`` (a run of
    two or more point-to-point ops of one group sharing a ``p2p_seq_id``), as torch's recorder
    ends a coalesced batch; its analyzer matches the batch's ops up to it. It takes the record
    id of the batch's last op (ours are numbered already) and the state of its least advanced."""
    out: list[dict[str, Any]] = []
    run: list[dict[str, Any]] = []

    def close() -> None:
        if len(run) > 1:
            end = dict(run[-1], frames=[], profiling_name=f"{backend}:coalesced")
            end.pop("duration_ms", None)
            end.update(input_sizes=[], input_dtypes=[], output_sizes=[], output_dtypes=[])
            least = min(run, key=lambda e: _STATE_ORDER.get(e["state"], 0))
            for k in ("state", "time_discovered_started_ns", "time_discovered_completed_ns"):
                end[k] = least[k]
            end["retired"] = least["state"] == "completed"
            out.append(end)
        run.clear()

    for e in entries:
        key = (e["process_group"], e["p2p_seq_id"])
        if run and (not e["is_p2p"] or (run[-1]["process_group"], run[-1]["p2p_seq_id"]) != key):
            close()
        out.append(e)
        if e["is_p2p"]:
            run.append(e)
    close()
    return out


def write_torch_dump(dump: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write torch's dump dict ``dump`` (see :func:`to_torch`) to ``path`` atomically;
    OSError (naming the file) if it cannot be written, as our JSON dump does."""
    p = Path(path)
    write_atomic(p, pickle.dumps(dump, protocol=2))
    return p


def _read(sources: Sequence[str | os.PathLike[str]]) -> dict[int, tuple[Path, dict[str, Any]]]:
    """Our JSON dumps in ``sources`` (files, or folders of ``*.json``), checked, by rank."""
    files: list[Path] = []
    for s in sources:
        p = Path(s)
        if p.is_dir():
            files.extend(sorted(p.glob("*.json")))
        elif p.is_file():
            files.append(p)
        else:
            raise DumpError(f"a dump source must be an existing file or folder, got {str(p)!r}")
    dumps = read_dump_files(files)
    if not dumps:
        raise DumpError("no Flight Recorder dumps (*.json) in " + ", ".join(map(str, sources)))
    return dumps


def _same_job(dumps: dict[int, tuple[Path, dict[str, Any]]]) -> None:
    """ExportError unless the dumps can be one job's (the check ``fr analyze`` makes)."""
    check_same_job(dumps, ExportError)


def export(
    sources: Sequence[str | os.PathLike[str]] | str | os.PathLike[str],
    to: str | os.PathLike[str],
    *,
    backend: str = "nccl",
    prefix: str = DEFAULT_PREFIX,
    overwrite: bool = False,
) -> list[Path]:
    """Write torch's dump of every rank in ``sources`` (our ``rank_<r>.json`` files, or folders
    of them) as ``<to>/<prefix><rank>``; returns the paths written, by rank.

    torch's analyzer reads every ``<prefix><r>`` file of the folder: one of a rank not
    exported (an earlier, bigger job's) would be analysed with these. Such files are removed
    with ``overwrite=True``; without it the folder is refused (ExportError) before anything is
    written. A folder or file that cannot be written raises the OSError."""
    if not re.fullmatch(r"[\w\-]*[A-Za-z_\-]", prefix):
        # torch finds the rank as the digits at the end of the name
        raise ValueError(
            f"prefix must be letters, digits, '_' or '-' not ending in a digit, got {prefix!r}"
        )
    _check_backend(backend)
    srcs = [sources] if isinstance(sources, str | os.PathLike) else list(sources)
    dumps = _read(srcs)
    _same_job(dumps)
    dest = Path(to)
    if dest.exists() and not dest.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "export destination must be a folder", str(dest))
    mine = {dest / f"{prefix}{rank}" for rank in dumps}
    # torch's loader reads every file under the folder (sub-folders too) whose name contains
    # the prefix, keyed by file name: any such file not written here is another job's
    found = sorted(p for p in (dest.rglob(f"*{prefix}*") if dest.is_dir() else ()) if p not in mine)
    stale = [
        p for p in found if p.parent == dest and re.fullmatch(re.escape(prefix) + r"\d+", p.name)
    ]
    other = [p for p in found if p not in stale and not p.is_dir()]
    if other:
        raise ExportError(
            f"export destination {str(dest)!r} holds {str(other[0])!r}"
            f"{' and more' if len(other) > 1 else ''}, which torch's analyzer would read with "
            f"these dumps (every file under the folder whose name contains {prefix!r}): "
            "choose another folder"
        )
    if stale and not overwrite:
        raise ExportError(
            f"export destination {str(dest)!r} holds dumps of other ranks ({stale[0].name}"
            f"{', ...' if len(stale) > 1 else ''}), which torch's analyzer would read with "
            "these: choose an empty folder, or overwrite them (--overwrite)"
        )
    for p in stale:
        p.unlink()
    return [
        write_torch_dump(to_torch(obj, backend=backend), dest / f"{prefix}{rank}")
        for rank, (_, obj) in sorted(dumps.items())
    ]
