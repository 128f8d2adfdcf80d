"""``torchport fr analyze DIR``: read every rank's Flight Recorder dump and say what went wrong.

The analyzer lines up each group's collectives by sequence id across ranks (only the window every
rank's ring buffer still holds) and reports, in plain words:

* ranks with no dump at all (crashed or killed before they could dump);
* the first collective a rank never entered while its peers did (the classic hang);
* a point-to-point op a rank waits in whose peer never issued its side (a ``recv`` from a rank
  that never sent it), and matched sends and receives whose sizes or dtypes differ;
* collectives whose op name, sizes or dtypes differ between ranks (a mismatch);
* ops that errored, or were still running when the dump was taken (stuck);
* the last completed op of every rank.

A group destroyed and re-created under the same name is lined up in its current incarnation on
every rank (the dump's ``incarnations``; the entries' ``incarnation`` says which one each op ran
on): a restarted rank knows only the new one, and a rank with no op on the new group yet has
not entered its first one. Dumps without ``incarnations`` line up each rank's newest entries.

It accepts dumps from any backend: entries whose state never left ``scheduled`` are reported as
such rather than crashing the analysis. A dump that is not one (malformed JSON, a field of the
wrong type, a ``world_size`` above :data:`MAX_WORLD_SIZE`), or a file that is not a regular
file of this user's (or root's) of at most :data:`MAX_DUMP_BYTES` (a symbolic link, a FIFO), or
with more than :data:`MAX_JSON_CONTAINERS` lists and objects or :data:`MAX_JSON_STRINGS`
strings, is refused with a :class:`DumpError` naming it (exit code 2 from ``torchport fr``),
and so are dumps of two jobs (:func:`check_same_job`).

The ring buffer is one per process, shared by all its groups and point-to-point ops: a rank
whose buffer wrapped and holds no collective of a group is not blamed for that group ("cannot
tell" is reported instead); its newest op of a group it does hold is its newest there.
All-to-alls are compared as torch's analyzer compares them: each rank's sizes differ by design,
so dtypes per rank and, with every member's entry present, the elements all ranks send against
those they receive.
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import stat
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from torchport.distributed.flight_recorder import P2P_OPS


class DumpError(ValueError):
    """A dump file is missing, unreadable or not a Flight Recorder dump."""


# The largest dump file read (a 2000-entry dump with 12-frame stacks is 1.3 MB, so this holds
# ~100,000 such entries): every *.json of the folder was read whole, so a link to /dev/zero
# (or a huge file) exhausted the memory. json.loads makes a Python object of every value, up
# to ~20 times the bytes (a 64 MiB file of empty lists took 3.5 GB): lists and objects, and
# strings, are bounded too, by counting their opening brackets and quotes before parsing (a
# dump has ~6 and ~30 of them an entry, stacks included)
MAX_DUMP_BYTES = 64 << 20
MAX_JSON_CONTAINERS = 1 << 21  # lists and objects ([ and { characters)
MAX_JSON_STRINGS = 1 << 22  # strings (half the " characters, escaped ones included)
# The largest world_size taken: the ranks without a dump are listed, and 10**15 of them ended
# in a MemoryError (torch's largest jobs are ~10**5 ranks)
MAX_WORLD_SIZE = 1 << 20


@dataclass
class Verdict:
    """The analysis: findings in plain words plus the structured facts behind them."""

    findings: list[str] = field(default_factory=list)
    missing_ranks: list[int] = field(default_factory=list)
    never_entered: list[tuple[int, str, int, str]] = field(
        default_factory=list
    )  # rank, group, seq, op
    mismatches: list[tuple[str, int, str]] = field(default_factory=list)  # group, seq, what
    # rank, group, seq, op, peer: a point-to-point op waiting for a side its peer never issued
    unmatched_p2p: list[tuple[int, str, int, str, int]] = field(default_factory=list)
    stuck: list[tuple[int, str, int, str]] = field(default_factory=list)
    errored: list[tuple[int, str, int, str]] = field(default_factory=list)
    last_completed: dict[int, str] = field(default_factory=dict)
    # rank, group: whether the rank entered the group's collectives cannot be told (its ring
    # buffer, one per process, wrapped and holds none of the group's ops)
    cannot_tell: list[tuple[int, str]] = field(default_factory=list)

    def text(self) -> str:
        return "\n".join(self.findings)


_REQUIRED = ("rank", "world_size", "entries")
_ENTRY_REQUIRED = ("seq_id", "op", "group", "state")


def _check_dump(p: Path, obj: Any) -> int:
    """The rank of dump ``obj`` (read from ``p``); DumpError if it lacks what analyze reads."""
    if not isinstance(obj, dict) or any(k not in obj for k in _REQUIRED):
        raise DumpError(f"{p} is not a Flight Recorder dump (needs keys {_REQUIRED})")
    # integral floats (7.0, as JSON writers other than ours may write 7) are taken as ints in
    # every integer field: seq_id took them while world_size, ranks and sizes were refused
    rank = _int_of(obj["rank"])
    if rank is None or rank < 0:
        raise DumpError(f"{p}: rank must be an int >= 0, got {obj['rank']!r:.200}")
    obj["rank"] = rank
    # the other fields analyze reads, when present (of another type, a foreign or damaged
    # dump ended the analysis in a TypeError / ValueError / AttributeError traceback)
    world = _int_of(obj["world_size"])
    if world is None or world < 1:
        raise DumpError(f"{p}: world_size must be an int >= 1, got {obj['world_size']!r:.200}")
    if world > MAX_WORLD_SIZE:
        raise DumpError(
            f"{p}: world_size must be at most {MAX_WORLD_SIZE} (fr_analyze.MAX_WORLD_SIZE), "
            f"got {world!r:.200}"
        )
    obj["world_size"] = world
    groups = obj.get("groups")
    if groups is not None:
        members = _int_lists(groups.values()) if isinstance(groups, dict) else None
        if members is None:
            raise DumpError(
                f"{p}: groups must map group names to lists of ranks, got {groups!r:.200}"
            )
        obj["groups"] = dict(zip(groups, members, strict=True))
    incs = obj.get("incarnations")
    if incs is not None:
        counts = [_int_of(n) for n in incs.values()] if isinstance(incs, dict) else [None]
        if any(n is None or n < 0 for n in counts):
            raise DumpError(
                f"{p}: incarnations must map group names to ints >= 0, got {incs!r:.200}"
            )
        obj["incarnations"] = dict(zip(incs, counts, strict=True))
    old = obj.get("retired_groups")
    if old is not None:
        ok = isinstance(old, list) and all(
            isinstance(t, list) and len(t) == 3 and isinstance(t[0], str) for t in old
        )
        incs_old = [_int_of(t[1]) for t in old] if ok else []
        ranks_old = _int_lists([t[2] for t in old]) if ok else None
        if ranks_old is None or any(n is None or n < 0 for n in incs_old):
            raise DumpError(
                f"{p}: retired_groups must be [name, incarnation, ranks] lists, got {old!r:.200}"
            )
        obj["retired_groups"] = [
            [t[0], n, r] for t, n, r in zip(old, incs_old, ranks_old, strict=True)
        ]
    entries = obj["entries"]
    if not isinstance(entries, list):
        raise DumpError(f"{p}: entries must be a list, got {type(entries).__name__}")
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or any(k not in e for k in _ENTRY_REQUIRED):
            raise DumpError(f"{p}: entry {i} needs keys {_ENTRY_REQUIRED}, got {e!r:.200}")
        # the fields analyze computes with (a string or null seq_id ended in a traceback)
        seq = _int_of(e["seq_id"])
        if seq is None or seq < 0:
            raise DumpError(
                f"{p}: entry {i}: seq_id must be an int >= 0 (an integral float is taken), "
                f"got {e['seq_id']!r:.200}"
            )
        e["seq_id"] = seq
        for k in ("op", "group", "state"):
            if not isinstance(e[k], str):
                raise DumpError(f"{p}: entry {i}: {k} must be a string, got {e[k]!r:.200}")
        sizes, dtypes = e.get("sizes", []), e.get("dtypes", [])
        shapes = _int_lists(sizes) if isinstance(sizes, list) else None
        if shapes is None:
            raise DumpError(
                f"{p}: entry {i}: sizes must be a list of lists of ints, got {sizes!r:.200}"
            )
        if "sizes" in e:
            e["sizes"] = shapes
        if not isinstance(dtypes, list) or not all(isinstance(x, str) for x in dtypes):
            raise DumpError(
                f"{p}: entry {i}: dtypes must be a list of strings, got {dtypes!r:.200}"
            )
        for k, low in _ENTRY_INTS:
            x = e.get(k)
            if x is not None:
                v = _int_of(x)
                if v is None or (low is not None and v < low):
                    bound = "" if low is None else f" >= {low}"
                    raise DumpError(f"{p}: entry {i}: {k} must be an int{bound}, got {x!r:.200}")
                e[k] = v
        took = e.get("duration_ms")
        if took is not None:
            # finite: 10**400 (an int) passed and the report's format raised OverflowError
            ms = _float_of(took)
            if ms is None:
                raise DumpError(
                    f"{p}: entry {i}: duration_ms must be a number (finite), got {took!r:.200}"
                )
            e["duration_ms"] = ms
        # the export copies these into torch's dump (a stack of another type ended in a
        # TypeError there); a non-string error, in a garbled report line
        stack, err = e.get("stack"), e.get("error")
        if stack is not None and not (
            isinstance(stack, list) and all(isinstance(x, str) for x in stack)
        ):
            raise DumpError(f"{p}: entry {i}: stack must be a list of strings, got {stack!r:.200}")
        if err is not None and not isinstance(err, str):
            raise DumpError(f"{p}: entry {i}: error must be a string, got {err!r:.200}")
    return rank


# the integer fields of an entry read when present (null: absent), and their lowest value
# (record_id and the times: the export computes with them and copies them into torch's dump)
_ENTRY_INTS = (
    ("incarnation", 0),
    ("peer", -1),
    ("tag", None),
    ("record_id", 0),
    ("time_scheduled_ns", 0),
    ("time_started_ns", 0),
    ("time_completed_ns", 0),
)


def _int_of(x: Any) -> int | None:
    """``x`` as an int if it is one (not a bool) or an integral float, else None."""
    if isinstance(x, float) and x.is_integer():
        return int(x)
    return x if isinstance(x, int) and not isinstance(x, bool) else None


def _float_of(x: Any) -> float | None:
    """``x`` as a finite float if it is a number (not a bool) that is one, else None."""
    if not isinstance(x, int | float) or isinstance(x, bool):
        return None
    try:
        f = float(x)
    except OverflowError:  # an int beyond the float range
        return None
    return f if math.isfinite(f) else None


def _int_lists(lists: Any) -> list[list[int]] | None:
    """Each of ``lists`` (an iterable of lists) as a list of ints (see :func:`_int_of`), or
    None if any is no list or holds a non-integer."""
    out: list[list[int]] = []
    for x in lists:
        if not isinstance(x, list):
            return None
        ints = [_int_of(d) for d in x]
        if any(d is None for d in ints):
            return None
        out.append(cast(list[int], ints))
    return out


def newest_incarnations(entries: list[dict[str, Any]]) -> dict[str, int]:
    """Each group's newest incarnation among ``entries`` (a dump's)."""
    newest: dict[str, int] = {}
    for e in entries:
        newest[e["group"]] = max(newest.get(e["group"], 0), e.get("incarnation") or 0)
    return newest


def read_dump_files(files: Iterable[Path]) -> dict[int, tuple[Path, dict[str, Any]]]:
    """Our JSON dumps ``files``, checked, by rank with their paths (two dumps of one rank are an
    error: keeping either one silently analysed a stale copy, a stuck rank read as healthy)."""
    dumps: dict[int, tuple[Path, dict[str, Any]]] = {}
    for p in files:
        try:
            obj = json.loads(_read_file(p))
            rank = _check_dump(p, obj)
        except DumpError:
            raise
        except (OSError, ValueError) as e:
            # ValueError: not JSON, not UTF-8, or an int of more digits than Python converts
            # (sys.int_info; it was a traceback)
            raise DumpError(f"cannot read Flight Recorder dump {p}: {e}") from None
        except RecursionError:  # JSON nested deeper than the parser (or a repr) goes
            raise DumpError(
                f"cannot read Flight Recorder dump {p}: its JSON is nested too deeply"
            ) from None
        if rank in dumps:
            raise DumpError(
                f"two dumps of rank {rank}: {dumps[rank][0]} and {p}; keep one dump per rank"
            )
        dumps[rank] = (p, obj)
    return dumps


def _read_file(p: Path) -> bytes:
    """The bytes of dump file ``p``: a regular file of this user's (or root's), not a link,
    of at most :data:`MAX_DUMP_BYTES`; DumpError otherwise. (Read whole, a FIFO named
    ``rank_1.json`` hung the analysis and a link to ``/dev/zero`` exhausted the memory; a
    file planted by another user, in a shared folder, was analysed as one of the job's.)"""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(p, flags)  # (O_NONBLOCK: opening a FIFO waited for a writer)
    except OSError as e:
        if e.errno == errno.ELOOP:  # (O_NOFOLLOW on a symbolic link)
            raise DumpError(
                f"{p} is a symbolic link: refused, dumps are not read through links"
            ) from None
        raise
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DumpError(f"{p} is not a regular file: refused")
        if st.st_uid not in (os.geteuid(), 0):
            raise DumpError(
                f"{p} is owned by another user (uid {st.st_uid}): refused; copy the dumps "
                "you trust into a folder of your own"
            )
        too_big = DumpError(
            f"{p} is larger than the {MAX_DUMP_BYTES} bytes a dump may have "
            "(fr_analyze.MAX_DUMP_BYTES): refused"
        )
        if st.st_size > MAX_DUMP_BYTES:
            raise too_big
        data = f.read(MAX_DUMP_BYTES + 1)  # (the file may have grown since the fstat)
    if len(data) > MAX_DUMP_BYTES:
        raise too_big
    containers, strings = data.count(b"[") + data.count(b"{"), data.count(b'"') // 2
    if containers > MAX_JSON_CONTAINERS or strings > MAX_JSON_STRINGS:
        raise DumpError(
            f"{p} holds more than the {MAX_JSON_CONTAINERS} lists and objects "
            f"(fr_analyze.MAX_JSON_CONTAINERS) or {MAX_JSON_STRINGS} strings "
            f"(fr_analyze.MAX_JSON_STRINGS) a dump may have, counting its [ and {{ and its "
            f"quotes (got {containers} and {strings}): refused"
        )
    return data


def load_dumps(folder: str | Path) -> dict[int, dict[str, Any]]:
    """All ``*.json`` dumps in ``folder``, by rank (two dumps of one rank, or dumps of two jobs,
    are an error: see :func:`check_same_job`)."""
    d = Path(folder)
    if not d.is_dir():
        raise DumpError(f"dump folder must be an existing directory, got {str(d)!r}")
    found = read_dump_files(sorted(d.glob("*.json")))
    if not found:
        raise DumpError(f"no Flight Recorder dumps (*.json) in {str(d)!r}")
    check_same_job(found)
    return {r: obj for r, (_, obj) in found.items()}


def check_same_job(
    dumps: dict[int, tuple[Path, dict[str, Any]]], error: type[DumpError] = DumpError
) -> None:
    """``error`` unless ``dumps`` (rank -> path, dump) can be one job's: one world size holding
    every rank, and each group name with the same members in every dump that lists it. (A
    folder reused across runs kept an earlier, bigger job's ``rank_2.json``: analysed with
    today's dumps, its later ops blamed today's healthy ranks for never entering them.)"""
    worlds = {obj["world_size"]: p for p, obj in dumps.values()}
    if len(worlds) > 1:
        (w1, p1), (w2, p2) = list(worlds.items())[:2]
        raise error(
            f"dumps from different jobs: world_size {w1} in {p1} but {w2} in {p2}; "
            "use one job's dumps together"
        )
    world = next(iter(worlds))
    members: dict[str, tuple[list[int], Path]] = {}
    for rank, (p, obj) in sorted(dumps.items()):
        if rank >= world:
            raise error(f"{p}: rank {rank} is outside its world_size {world}")
        for g, ranks in (obj.get("groups") or {}).items():
            seen = members.setdefault(g, (sorted(ranks), p))
            if seen[0] != sorted(ranks):
                raise error(
                    f"dumps from different jobs: group {g!r} has ranks {seen[0]} in {seen[1]} "
                    f"but {sorted(ranks)} in {p}; use one job's dumps together"
                )


def _sig(e: dict[str, Any]) -> str:
    sizes = ",".join("x".join(map(str, s)) or "scalar" for s in e.get("sizes", []))
    dtypes = ",".join(e.get("dtypes", []))
    return f"{e['op']}[{sizes}]({dtypes})" if sizes else f"{e['op']}"


def _describe_diff(a: dict[str, Any], b: dict[str, Any], *, op: bool = True) -> str:
    """What differs between two entries, as "op/size/dtype" ("" if nothing); ``op=False``: a
    send and its receive, whose ops differ by nature."""
    what = []
    if op and a["op"] != b["op"]:
        what.append("op")
    if a.get("sizes") != b.get("sizes"):
        what.append("size")
    if a.get("dtypes") != b.get("dtypes"):
        what.append("dtype")
    return "/".join(what)


def analyze(dumps: dict[int, dict[str, Any]]) -> Verdict:
    """Compare the ranks' dumps; see the module docstring for what is reported."""
    v = Verdict()
    world = max(int(d.get("world_size", 1)) for d in dumps.values())
    v.missing_ranks = [r for r in range(world) if r not in dumps]
    for r in v.missing_ranks:
        v.findings.append(
            f"rank {r}: no dump — the process probably crashed or was killed before it could dump"
        )
    # per group: rank -> seq -> entry
    groups: dict[str, dict[int, dict[int, dict[str, Any]]]] = {}
    members: dict[str, set[int]] = {}
    # (group, sender, receiver, tag) -> the sender's sends / the receiver's receives, in issue
    # order (torch pairs them per peer and tag)
    sends: dict[tuple[str, int, int, Any], list[dict[str, Any]]] = {}
    recvs: dict[tuple[str, int, int, Any], list[dict[str, Any]]] = {}
    wrapped: set[int] = set()  # ranks whose ring buffer dropped entries: counts are incomplete
    # (group, receiver, tag) that received from any source: the sends it took are unknown, so
    # its later receives of that tag are not paired (dropping the any-source one alone paired
    # every later receive with the send before its own: a false size mismatch)
    anysource: set[tuple[str, int, Any]] = set()
    for rank, d in dumps.items():
        for g, ranks in (d.get("groups") or {}).items():
            members.setdefault(g, set()).update(int(x) for x in ranks)
        # the incarnation of each group to line up: the rank's current one (dumped since a
        # rank that had not yet recorded an op on a re-created group showed only the old one,
        # compared with its peers' new one), else (older dumps) the newest it has entries of
        newest = newest_incarnations(d["entries"])
        newest.update(d.get("incarnations") or {})
        if d["entries"] and d["entries"][0].get("record_id", 0) != 0:
            wrapped.add(rank)
        for e in d["entries"]:
            if (e.get("incarnation") or 0) != newest[e["group"]]:
                continue  # an earlier group of that name: a restarted rank has none of it
            if e["op"] in P2P_OPS:  # numbered on their own counter: not lined up as collectives
                peer, tag = e.get("peer"), e.get("tag") or 0
                if e["op"] == "recv" and peer == -1:
                    anysource.add((e["group"], rank, tag))
                elif isinstance(peer, int) and peer >= 0:
                    if e["op"] == "send":
                        sends.setdefault((e["group"], rank, peer, tag), []).append(e)
                    elif (e["group"], rank, tag) not in anysource:
                        recvs.setdefault((e["group"], peer, rank, tag), []).append(e)
                continue
            groups.setdefault(e["group"], {}).setdefault(rank, {})[e["seq_id"]] = e
    for g in sorted(groups):
        per_rank = groups[g]
        expected = (members.get(g) or set(per_rank)) & set(dumps)
        expected |= set(per_rank)
        lo = max(min(s) for s in per_rank.values() if s)
        hi = max(max(s) for s in per_rank.values() if s)
        for r in sorted(expected):
            seqs = per_rank.get(r, {})
            if not seqs and r in wrapped:
                # the ring is the process's, shared by every group and point-to-point op: a
                # rank that wrapped it may have entered all of this group's collectives (its
                # newest op of a group still held is its newest there: the ring drops the
                # oldest first, so only a group with no op held cannot be told)
                v.cannot_tell.append((r, g))
                v.findings.append(
                    f"rank {r}: cannot tell which collectives of group {g!r} it entered: its "
                    "ring buffer (one per process, TORCHPORT_FR_BUFFER_SIZE entries) wrapped "
                    "and holds none of them"
                )
                continue
            top = max(seqs) if seqs else lo - 1
            if top < hi:
                nxt = top + 1
                entered = [q for q in sorted(per_rank) if nxt in per_rank[q]]
                op = per_rank[entered[0]][nxt]["op"] if entered else "?"
                last = seqs.get(top)
                was = (
                    f"; its last op there was #{top} {last['op']} ({last['state']})" if last else ""
                )
                v.never_entered.append((r, g, nxt, op))
                v.findings.append(
                    f"rank {r} never entered collective #{nxt} ({op}) on group {g!r}, "
                    f"which rank(s) {entered} entered{was}"
                )
        # the ids some rank holds in the window, not every id from lo to hi (a dump with ids
        # 0 and 10**15 hung the analysis)
        for seq in sorted({q for s in per_rank.values() for q in s if lo <= q <= hi}):
            have = {r: per_rank[r][seq] for r in sorted(per_rank) if seq in per_rank[r]}
            if len(have) < 2:
                continue
            ranks = list(have)
            ref = have[ranks[0]]
            # (all the group's members, those without a dump too; unknown: the world's)
            everyone = members.get(g) or set(range(world))
            if ref["op"] in _ALL_TO_ALL and _check_all_to_all(v, g, seq, have, everyone):
                continue
            for r in ranks[1:]:
                diff = _describe_diff(ref, have[r])
                if diff:
                    v.mismatches.append((g, seq, diff))
                    v.findings.append(
                        f"collective #{seq} on group {g!r} does not match ({diff} mismatch): "
                        f"rank {ranks[0]} called {_sig(ref)} but rank {r} called {_sig(have[r])}"
                    )
                    break
    delivered = _match_p2p(v, dumps, sends, recvs, wrapped, anysource)
    for rank in sorted(dumps):
        entries = dumps[rank]["entries"]
        done = [e for e in entries if e["state"] == "completed"]
        if done:
            e = done[-1]
            v.last_completed[rank] = f"#{e['seq_id']} {_sig(e)} on group {e['group']!r}"
        else:
            v.last_completed[rank] = "none recorded"
        failed_groups: dict[str, int] = {}
        for e in entries:
            if e["state"] == "errored":
                v.errored.append((rank, e["group"], e["seq_id"], e["op"]))
                failed_groups[e["group"]] = failed_groups.get(e["group"], 0) + 1
                if failed_groups[e["group"]] > 1:
                    continue  # the first failure per group explains the rest
                # (an errored entry without error text has no first line: it was an IndexError)
                lines = (e.get("error") or "").splitlines()
                err = lines[0] if lines else "(no error text recorded)"
                v.findings.append(
                    f"rank {rank}: {e['op']} #{e['seq_id']} on group {e['group']!r} failed: "
                    f"{err[:160]}{'…' if len(err) > 160 else ''}"
                )
            elif e["state"] in ("started", "scheduled") and id(e) not in delivered:
                # (a send whose receive completed was delivered: its Work was just never
                # waited on, and a gloo send completes only inside wait())
                v.stuck.append((rank, e["group"], e["seq_id"], e["op"]))
                v.findings.append(
                    f"rank {rank}: {e['op']} #{e['seq_id']} on group {e['group']!r} was still "
                    f"{e['state']} after {e.get('duration_ms') or 0:.0f} ms when the dump was taken "
                    f"(reason: {dumps[rank].get('reason')})"
                )
    for rank in sorted(dumps):
        more = [x for x in v.errored if x[0] == rank]
        if len(more) > 1:
            v.findings.append(f"rank {rank}: {len(more)} ops failed in total")
    for rank in sorted(v.last_completed):
        v.findings.append(f"rank {rank}: last completed op {v.last_completed[rank]}")
    if not (
        v.missing_ranks
        or v.never_entered
        or v.mismatches
        or v.unmatched_p2p
        or v.stuck
        or v.errored
    ):
        v.findings.insert(
            0,
            "no problem found in the ops the dumps hold (some ranks' buffers wrapped)"
            if v.cannot_tell
            else "no problem found: every rank entered and completed the same ops",
        )
    return v


# ops whose ranks' sizes differ by design (uneven splits, MoE's token routing): recorded as
# the outputs, then as many inputs
_ALL_TO_ALL = ("all_to_all", "all_to_all_single")


def _numel(sizes: list[list[int]]) -> int:
    return sum(math.prod(s) for s in sizes)


def _check_all_to_all(
    v: Verdict, g: str, seq: int, have: dict[int, dict[str, Any]], everyone: set[int]
) -> bool:
    """Compare an all-to-all's entries ``have`` (rank -> entry, two or more) as torch's
    analyzer does: op and dtypes per rank (each rank's own sizes differ by design), and, when
    member's entry (``everyone``'s) is here, the elements all ranks send with those they receive (a
    size mismatch otherwise). True if the entries were all-to-alls of the same op (checked
    here); False: another op on some rank, left to the generic comparison."""
    ranks = list(have)
    ref = have[ranks[0]]
    if any(have[r]["op"] != ref["op"] for r in ranks[1:]):
        return False
    for r in ranks[1:]:
        if have[r].get("dtypes") != ref.get("dtypes"):
            v.mismatches.append((g, seq, "dtype"))
            v.findings.append(
                f"collective #{seq} on group {g!r} does not match (dtype mismatch): "
                f"rank {ranks[0]} called {_sig(ref)} but rank {r} called {_sig(have[r])}"
            )
            return True
    sizes = [have[r].get("sizes", []) for r in ranks]
    if not everyone <= set(have) or any(len(s) % 2 for s in sizes):
        return True  # (a member's entry is not here: its part of the totals is unknown)
    sent = sum(_numel(s[len(s) // 2 :]) for s in sizes)
    got = sum(_numel(s[: len(s) // 2]) for s in sizes)
    if sent != got:
        v.mismatches.append((g, seq, "size"))
        v.findings.append(
            f"collective #{seq} on group {g!r} does not match (size mismatch): the {ref['op']} "
            f"inputs of ranks {ranks} hold {sent} elements in all but their outputs {got} ("
            + ", ".join(f"rank {r} called {_sig(have[r])}" for r in ranks)
            + ")"
        )
    return True


def _match_p2p(
    v: Verdict,
    dumps: dict[int, dict[str, Any]],
    sends: dict[tuple[str, int, int, Any], list[dict[str, Any]]],
    recvs: dict[tuple[str, int, int, Any], list[dict[str, Any]]],
    wrapped: set[int],
    anysource: set[tuple[str, int, Any]],
) -> set[int]:
    """Pair the k-th send from one rank to another with the k-th receive there (torch matches
    them in that order per pair, group and tag): name an op still waiting whose other side was never
    issued, and a pair whose sizes or dtypes differ. After a receive from any source (in
    ``anysource``) only the receives issued before it are paired, and counts are not compared.
    Returns the ids of the sends paired with a completed receive (delivered)."""
    delivered: set[int] = set()
    for key in sorted(set(sends) | set(recvs)):
        g, src, dst, tag = key
        if src not in dumps or dst not in dumps or src in wrapped or dst in wrapped:
            continue  # a missing dump is reported as such; a wrapped buffer has no full count
        s, r = sends.get(key, []), recvs.get(key, [])
        for k in range(min(len(s), len(r))):
            a, b = s[k], r[k]
            if b["state"] == "completed":
                delivered.add(id(a))
            diff = _describe_diff(a, b, op=False)
            if diff:
                v.mismatches.append((g, a["seq_id"], diff))
                v.findings.append(
                    f"send #{a['seq_id']} from rank {src} to rank {dst} on group {g!r} does not "
                    f"match its receive #{b['seq_id']} ({diff} mismatch): rank {src} sent "
                    f"{_sig(a)} but rank {dst} received into {_sig(b)}"
                )
                break
        if len(s) == len(r) or (g, dst, tag) in anysource:
            continue
        # the first op past the other side's count: its peer never issued the matching side
        longer, rank, peer, other = (
            (r, dst, src, "sent") if len(r) > len(s) else (s, src, dst, "received")
        )
        e = longer[min(len(s), len(r))]
        if e["state"] not in ("started", "scheduled"):
            continue  # (a send may complete before its receive is posted)
        n = min(len(s), len(r))
        v.unmatched_p2p.append((rank, g, e["seq_id"], e["op"], peer))
        v.findings.append(
            f"rank {rank} is waiting in {e['op']} #{e['seq_id']} "
            f"{'from' if e['op'] == 'recv' else 'to'} rank {peer} on group {g!r}, which rank "
            f"{peer} never {'sent' if e['op'] == 'recv' else 'received'} (rank {peer} "
            f"{other} {n} message(s) {'to' if other == 'sent' else 'from'} rank {rank} there)"
        )
    return delivered


def cmd_fr(args: argparse.Namespace) -> int:
    """Flight Recorder tools."""
    if args.fr_command == "export":
        from torchport.distributed.fr_torch import export

        try:
            paths = export(args.src, args.to, backend=args.backend, overwrite=args.overwrite)
        except (ValueError, OSError) as e:  # (DumpError among them; OSError: the writing)
            print(f"torchport fr: error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {len(paths)} torch Flight Recorder dump(s) to {args.to}")
        return 0
    try:
        verdict = analyze(load_dumps(args.dir))
    except DumpError as e:  # (on stderr: with --json, stdout is for the verdict only)
        print(f"torchport fr: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(verdict.__dict__, indent=1, default=list))
    else:
        print(verdict.text())
    return 0


def register_cli(sub: argparse._SubParsersAction) -> None:
    """Add ``torchport fr analyze DIR`` and ``torchport fr export SRC... --to DIR``."""
    p = sub.add_parser("fr", help="Flight Recorder tools")
    fr_sub = p.add_subparsers(dest="fr_command", required=True)
    a = fr_sub.add_parser("analyze", help="analyze all ranks' Flight Recorder dumps in DIR")
    a.add_argument("dir", help="folder holding rank_<r>.json dumps")
    a.add_argument("--json", action="store_true", help="machine-readable output")
    a.set_defaults(func=cmd_fr)
    x = fr_sub.add_parser(
        "export",
        help="write the dumps in SRC (rank_<r>.json files or folders) in torch's format, for "
        "python -m torch.distributed.flight_recorder.fr_trace DIR",
    )
    x.add_argument("src", nargs="+", help="rank_<r>.json dumps, or folders holding them")
    x.add_argument("--to", required=True, help="folder for nccl_trace_rank_<r> files")
    x.add_argument(
        "--backend", default="nccl", help="prefix of torch's profiling names (nccl, gloo, ...)"
    )
    x.add_argument(
        "--overwrite",
        action="store_true",
        help="remove other ranks' dumps (of an earlier, bigger job) from the --to folder; "
        "without it such a folder is refused",
    )
    x.set_defaults(func=cmd_fr)
