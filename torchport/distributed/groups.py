"""Building communicators: the c10d creator, the shared mesh, arenas and sub-communicators.

The first group created in a process with an empty ``global_ranks_in_group`` (the default group
of ``init_process_group``) builds the root :class:`~torchport.distributed.transport_tcp.Mesh`:
a per-job secret through the store, then authenticated connections to every rank. Every later
group (``new_group``, :func:`split_group`) reuses that mesh: its frames carry a group id derived
from the group name (identical on every rank) and the name's incarnation (how many groups of
that name this process built on the mesh before: a group destroyed and re-created under the same
name, as ``use_local_synchronization`` names groups by their ranks, gets a new id, so a late
frame of the old one can never complete an op of the new one), and its ranks keep c10d's order
(``global_ranks_in_group``: sorted, unless ``new_group(..., sort_ranks=False)``), so the
communicator's rank q is c10d's group rank q. A group gets a shared-memory arena when all its
members run on this host (same hostname and boot id) and ``TORCHPORT_DIST_TRANSPORT`` allows
it. A group spanning hosts (transport ``auto``) is *hybrid*: the members on each host share an
arena among themselves and reach the other hosts by TCP, chosen per peer in every step
(:mod:`~torchport.distributed.exchange`). The root mesh leaves the job
(:meth:`~torchport.distributed.transport_tcp.Mesh.leave`: a goodbye on every connection, which
its peers tell from a crash) once the default group and every group on it have closed
(``destroy_process_group()``), or at the process's exit. A sub-group on the root mesh that
closes while the mesh stays (``destroy_process_group(subgroup)``) says goodbye for that group
alone (:meth:`~torchport.distributed.transport_tcp.Mesh.send_group_goodbye`): its members'
waits for this rank in it fail at once, their other groups go on.
"""

from __future__ import annotations

import atexit
import datetime
import functools
import os
import socket
import threading
import zlib
from collections.abc import Sequence
from typing import Any

from torchport import config
from torchport.distributed import auth
from torchport.distributed.engine import SLOT_EXTRA, Communicator
from torchport.distributed.errors import CollectiveArgumentError, CommError, CommTimeoutError
from torchport.distributed.transport_shm import ShmArena
from torchport.distributed.transport_tcp import Mesh

_lock = threading.Lock()
_root: Mesh | None = None
# name -> groups of that name built so far, on the root mesh or on their own (reset when a
# root mesh is built)
_incarnations: dict[str, int] = {}
# (parent group's communicator name, group id) -> split_group calls made on it so far (reset with
# _incarnations: a re-initialized job reuses names and ids, and the counts it carried over could
# differ between ranks)
_splits: dict[tuple[str, int], int] = {}
# The communicators on the root mesh not closed yet, and whether the default group (the mesh's
# builder) closed: the last of them to close after it makes the mesh leave (left open, its
# listener, a reader thread and a socket per peer stayed after destroy_process_group until the
# next init_process_group). torch shuts the groups down in the order of their names, so a
# subgroup may still flush on the mesh after the default group closed.
_on_root: set[Communicator] = set()
_root_done = False


def next_split(parent: tuple[str, int]) -> int:
    """The number of ``split_group`` calls on ``parent`` before this one (and count this one)."""
    with _lock:
        seq = _splits.get(parent, 0)
        _splits[parent] = seq + 1
        return seq


def host_id() -> str:
    """Identity of this host for transport selection: hostname, kernel boot id and the device
    of ``/dev/shm``.

    Two processes share memory only if they see one ``/dev/shm``: containers on one machine
    with the same hostname (and so the same boot id) but their own ``/dev/shm`` mount counted
    as one host, took the shared-memory transport and failed opening each other's files.
    Only equality of ids is ever compared; the tcp mesh counts ranks per machine without the
    ``/dev/shm`` part (CPUs)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "unknown"
    try:
        shm = f"/shm{os.stat('/dev/shm').st_dev}"
    except OSError:  # (no /dev/shm: no shared-memory transport to tell apart)
        shm = ""
    return f"{socket.gethostname()}/{boot}{shm}"


# c10d carries a group's timeout as int64 microseconds: a longer timedelta wraps around
C10D_MAX_TIMEOUT = datetime.timedelta(microseconds=2**63 - 1)


def positive_timeout_s(timeout: Any, where: str) -> float:
    """``timeout``, a positive ``datetime.timedelta``, in seconds; else
    :class:`CollectiveArgumentError`. A zero timeout is refused too: it timed out the first
    operation that waited for a peer at once and failed the group on every rank."""
    if isinstance(timeout, datetime.timedelta) and timeout.total_seconds() > 0:
        return timeout.total_seconds()
    got, hint = repr(timeout), ""
    if isinstance(timeout, datetime.timedelta):  # (the repr of -1 s reads days=-1, seconds=86399)
        got = f"{timeout.total_seconds():g} s"
        if timeout.total_seconds() < 0:
            hint = (
                f" (c10d hands the backend a group's timeout as int64 microseconds: one longer "
                f"than {C10D_MAX_TIMEOUT.days} days, as timedelta.max, may have wrapped around "
                f"to this; give a finite one instead)"
            )
    raise CollectiveArgumentError(
        f"{where}: the timeout must be a positive datetime.timedelta, got {got}{hint}"
    )


def root_mesh() -> Mesh | None:
    """The process's root mesh (None before ``init_process_group``)."""
    return _root


def _closed_on_root(comm: Communicator, default: bool) -> None:
    """``comm``, a group on the root mesh (``default``: the default group), closed: the mesh
    leaves once the default group and every other group on it closed."""
    global _root_done
    with _lock:
        if comm.mesh is not _root:  # a later init_process_group replaced (and closed) it
            return
        _on_root.discard(comm)
        _root_done = _root_done or default
        leaving = _root if _root_done and not _on_root and not _root.closed else None
    if leaving is not None:  # (unlocked: it waits for the peers to end their side)
        leaving.leave()


@atexit.register
def _leave_at_exit() -> None:
    """At the process's exit the root mesh leaves as at ``destroy_process_group()``: its
    peers read a goodbye, not the end of a crashed process's connections."""
    mesh = _root
    if mesh is not None and not mesh.closed:
        mesh.leave()


def _build_mesh(store: Any, rank: int, size: int, timeout_s: float, again: str = "") -> Mesh:
    # again: suffix of the store keys of a re-created group's own mesh (its predecessor's
    # secret and addresses stay in the same store prefix)
    prefix = f"tp{again}/"
    if rank == 0:
        store.set(f"{prefix}secret", auth.new_secret())
    secret = bytes(store.get(f"{prefix}secret"))
    if len(secret) != auth.SECRET_BYTES:
        raise CommError(
            f"job secret in the store has {len(secret)} bytes, expected {auth.SECRET_BYTES}"
        )
    max_frame = int(config.get("dist_max_frame_bytes"))
    return Mesh(
        store,
        rank,
        size,
        secret=secret,
        addr=str(config.get("dist_addr")),
        timeout_s=timeout_s,
        max_frame=max(
            max_frame,
            max(int(config.get("dist_chunk_bytes")), int(config.get("dist_tcp_chunk_bytes")))
            + SLOT_EXTRA,
        ),
        host_id=host_id(),
        key_prefix=prefix,
        # large send/recv payloads to ranks of this host through shared memory, unless every
        # transfer is to go by TCP
        ring_bytes=(
            int(config.get("dist_p2p_ring_bytes"))
            if str(config.get("dist_transport")) != "tcp"
            else 0
        ),
    )


def _make_arena(
    store: Any, rank: int, size: int, slot: int, timeout_s: float, key: str = "tp/arena"
) -> ShmArena:
    """Rank 0 creates the arena, publishes its path, waits until all mapped it, unlinks it.

    The last rank to map it sets ``<key>_all``, on which rank 0 waits in the store (it polled
    the count every millisecond), for as long as the others wait for the path: the store's
    timeout when shorter than the group's (it waited the group's while they gave up after the
    store's)."""
    if rank == 0:
        arena = ShmArena(ShmArena.new_path(), size, rank, slot, create=True)
        limit = timeout_s
        store_timeout = getattr(store, "timeout", None)
        if isinstance(store_timeout, datetime.timedelta) and store_timeout.total_seconds() > 0:
            limit = min(limit, store_timeout.total_seconds())
        try:
            store.set(key, arena.path)
            if size > 1:
                try:
                    store.wait([f"{key}_all"], datetime.timedelta(seconds=limit))
                except RuntimeError as e:  # (the store's timeout: RuntimeError, DistStoreError)
                    raise CommTimeoutError(
                        f"ranks did not map the shared-memory arena within {limit:g} s: {e}"
                    ) from e
        finally:
            arena.unlink()
        return arena
    path = store.get(key).decode()
    arena = ShmArena(path, size, rank, slot, create=False)
    if int(store.add(f"{key}_mapped", 1)) == size - 1:
        store.set(f"{key}_all", "1")
    return arena


def group_id_for(name: str, incarnation: int = 0) -> int:
    """Nonzero 32-bit id of a sub-group (0 is the root group); ``incarnation`` > 0 for the
    groups of a name built after its first."""
    key = name if not incarnation else f"{name}\x00{incarnation}"
    return (zlib.crc32(key.encode()) & 0x7FFFFFFF) | 1


def build_communicator(
    store: Any,
    rank: int,
    size: int,
    timeout: datetime.timedelta,
    global_ranks: Sequence[int],
    name: str,
) -> Communicator:
    """Create the communicator for one c10d group (collective over its members).

    A timeout that is not positive is refused (:func:`positive_timeout_s`), as gloo refuses a
    negative one, before anything is exchanged: every member refuses the same value."""
    global _root, _root_done
    # (a negative one, often timedelta.max wrapped around, timed out every op that waited for a
    # peer at once; on shm rank 0 gave up on the arena at once and the others found it gone)
    timeout_s = positive_timeout_s(timeout, f"group {name or 'default'!r}")
    transport = str(config.get("dist_transport"))
    with _lock:
        is_root = not global_ranks or _root is None or _root.closed
        if is_root:
            # a group on its own mesh (the default group is another backend's) re-created under
            # its name reuses the store prefix too: count it like a group on the root mesh
            seen = _incarnations.get(name, 0) if global_ranks else 0
            if global_ranks:
                _incarnations[name] = seen + 1
            mesh = _build_mesh(store, rank, size, timeout_s, again=f"#{seen}" if seen else "")
            if not global_ranks:
                if _root is not None and not _root.closed:
                    _root.close()
                _root = mesh
                _incarnations.clear()
                _splits.clear()
                _on_root.clear()
                _root_done = False
            ranks: list[int] = list(range(size))
            gid = 0 if not global_ranks else group_id_for(name, seen)
        else:
            assert _root is not None
            mesh = _root
            # c10d's order, in which it numbered the group ranks (``rank`` is one of them): sorted
            # here, a group of new_group(sort_ranks=False) had rank q talk to another member's
            # global rank (a send went astray; on tcp a rank dialled itself)
            ranks = list(global_ranks)
            # every member builds the same groups of a name in the same order, so the count
            # agrees across members; a member still on the old incarnation sends under the old
            # id, whose frames the mesh drops (it was unregistered here)
            seen = _incarnations.get(name, 0)
            _incarnations[name] = seen + 1
            gid = group_id_for(name, seen)
    local = all(mesh.hosts[g] == mesh.hosts[mesh.rank] for g in ranks)
    if transport == "shm" and not local:
        raise CommError("TORCHPORT_DIST_TRANSPORT=shm but the group spans several hosts")
    arena = local_arena = None
    chunk = int(config.get("dist_chunk_bytes"))
    local_ranks: list[int] = []
    # the group's store keeps the arena keys of earlier incarnations of its name (the path of an
    # unlinked arena, a full mapped count): a re-created group read them and failed to map
    again = f"#{seen}" if seen else ""
    if local and transport != "tcp" and size > 1:
        arena = _make_arena(
            store, rank, size, chunk + SLOT_EXTRA, timeout_s, key=f"tp/arena{again}"
        )
    else:
        chunk = int(config.get("dist_tcp_chunk_bytes"))
    if not local and transport == "auto":
        # hybrid: this host's members share an arena; the other hosts are reached by TCP
        mine = mesh.hosts[mesh.rank]
        local_ranks = [q for q, g in enumerate(ranks) if mesh.hosts[g] == mine]
        if len(local_ranks) > 1:
            local_arena = _make_arena(
                store,
                local_ranks.index(rank),
                len(local_ranks),
                chunk + SLOT_EXTRA,
                timeout_s,
                key=f"tp/arena_host{local_ranks[0]}{again}",
            )
    comm = Communicator(
        mesh,
        gid,
        ranks,
        rank,
        arena=arena,
        timeout_s=timeout_s,
        chunk=chunk,
        stream_bytes=int(config.get("dist_stream_bytes")),
        name=name or "default",
        local=local_arena,
        local_ranks=local_ranks if local_arena is not None else (),
    )
    comm.owns_mesh = is_root and bool(global_ranks)
    if not comm.owns_mesh:  # on the root mesh (the default group is the one that built it)
        with _lock:
            _on_root.add(comm)
        comm.on_closed = functools.partial(_closed_on_root, comm, not global_ranks)
        # a sub-group's destroy tells its peers (the default group's leaves with the mesh)
        comm.says_goodbye = bool(global_ranks)
    return comm
