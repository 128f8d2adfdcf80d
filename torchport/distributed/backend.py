# mypy: disable-error-code="override,assignment"
# (the c10d stubs declare overloaded Python-convenience signatures; the backend implements the
#  C++ virtual signatures that ProcessGroup dispatches to, as torchft does)
"""The ``torchport`` c10d backend: a ``torch.distributed.ProcessGroup`` over our communicators.

Every collective validates its arguments on the caller's thread (typed
:class:`CollectiveArgumentError` naming the requirement and the value), then hands a closure to
the communicator's progress engine and returns a :class:`TorchportWork` at once. Non-contiguous
tensors and conjugate / negative views are staged through plain contiguous copies, taken and
written back on the engine thread as the op runs (after the group's earlier ops). Reduce ops:
SUM, PRODUCT, MIN, MAX, BAND, BOR, BXOR natively; AVG = SUM then divide (floating/complex only;
float16 premultiplies by 1 / world_size, as NCCL: its sum overflowed where the mean fits);
PREMUL_SUM = scale a copy by its factor, then SUM.
"""

from __future__ import annotations

import datetime
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from torchport.distributed import algorithms as alg
from torchport.distributed.backend_args import (
    _NATIVE_RED,
    _apart_from,
    _avg_premul,
    _check_alltoall,
    _check_blocks,
    _check_no_self_overlap,
    _check_red,
    _check_self_block,
    _cpu,
    _one,
    _outputs_meet,
    _positional,
    _ptr,
    _red_for,
    _red_name,
    _spans_overlap,
    _Staged,
    _timed,
    _writable,
)
from torchport.distributed.engine import (
    Communicator,
    _timeout_s,
    dtype_code,
    plain_contiguous,
)
from torchport.distributed.errors import CollectiveArgumentError
from torchport.distributed.funcol_kernels import (
    CPU_KEYSET,
    NAMESPACE,
    bind,
    funcol_group,
    override_cpu_kernel,
    p2p_batch_refused,
    p2p_issue,
)
from torchport.distributed.groups import positive_timeout_s
from torchport.distributed.progress import TorchportWork

# Each collective takes torch's list + options form (c10d's calls) and torch's positional forms
# (a bare tensor; a root rank, a ReduceOp, a timeout in the options' place), as ProcessGroup's
# bindings do. The list form is told by its options' exact type: one check on the hot path.
_AllreduceOptions = dist.AllreduceOptions
_BroadcastOptions = dist.BroadcastOptions
_ReduceOptions = dist.ReduceOptions
_GatherOptions = dist.GatherOptions
_ScatterOptions = dist.ScatterOptions
_ReduceScatterOptions = dist.ReduceScatterOptions
_AllgatherOptions = torch._C._distributed_c10d.AllgatherOptions
_CPU = torch.device("cpu")


def _slots_to_avoid(
    src: torch.Tensor, slots: Sequence[torch.Tensor], rank: int
) -> list[torch.Tensor]:
    """The output slots of a gather that an input ``src`` must not overlap, or it is copied first
    (:func:`_apart_from`): the TCP algorithms receive peers' blocks into their slots while the
    input is still to be sent, and copy the input into this rank's own slot before sending it.
    An input that IS its own slot (the same bytes: the in-place form FSDP uses) is read before
    its slot is written, so then only the others count; one that overlaps its own slot partly
    was overwritten by that first copy before it went out (peers got shifted blocks)."""
    own = slots[rank]
    if _ptr(src) == _ptr(own) and src.nbytes == own.nbytes:
        return [t for i, t in enumerate(slots) if i != rank]
    return list(slots)


class TorchportProcessGroup(dist.ProcessGroup):
    """A c10d ProcessGroup running on a torchport :class:`Communicator`.

    Beyond the c10d contract it offers ``get_error()``, ``abort()`` and ``comm`` (the internal
    communicator, whose ``mesh`` is the peer connection map).
    """

    def __init__(self, comm: Communicator) -> None:
        super().__init__(comm.rank, comm.world)  # type: ignore[call-arg]
        self.comm = comm
        self._closed = False
        # c10d lists a group's devices (``_device_types``) from the backends registered on it,
        # and this group, a Python ProcessGroup that is its own backend, registered none: the
        # empty list failed dcp.async_save ("A CPU backend must be enabled") and
        # set_model_state_dict(broadcast_from_rank0=True) (IndexError). The CPU is registered
        # without a C++ Backend object (there is none); _get_backend answers for it.
        self._register_backend(_CPU, dist.ProcessGroup.BackendType.CUSTOM, None)

    # -- identity and lifecycle ------------------------------------------------------------
    def getBackendName(self) -> str:
        return "torchport"

    def _get_backend(self, device: torch.device) -> Any:
        """The backend for ``device``: this group for the CPU (c10d has no Backend object for
        it to return: "Could not retrieve or create the backend"); other devices as c10d
        answers (an error: the group has no backend for them)."""
        if torch.device(device).type == "cpu":
            return self
        return super()._get_backend(device)

    # what c10d asks of a Backend (_get_backend's answer): no c10d-level splitting, coalescing,
    # time estimates or allocation (torchport splits with split_group)
    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False

    def supports_tensor_alloc(self, device: torch.device) -> bool:
        return False

    # c10d keeps group names/descriptions on backends; a Python group keeps its own
    # (DeviceMesh / FSDP2 look them up through ``group_name``).
    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return getattr(self, "_group_name", self.comm.name)

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return getattr(self, "_group_desc", "")

    @property
    def transport(self) -> str:
        """``"shm"`` or ``"tcp"``: how this group moves data."""
        return self.comm.transport

    def get_error(self) -> BaseException | None:
        """The first error of this communicator (typed), or None while healthy."""
        return self.comm.error

    def errored(self) -> BaseException | None:
        """Alias of :meth:`get_error` (torchft's name)."""
        return self.comm.error

    def abort(self) -> None:
        """Fail every in-flight and later op here and on every peer with a typed error."""
        self.comm.abort()

    def shutdown(self) -> None:
        """Stop the engine and release transport resources."""
        if self._closed:
            return
        self._closed = True
        self.comm.close()  # (closes the group's own mesh too, if it built one)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        """Per-group default timeout for later operations (a positive ``timedelta``)."""
        # a zero timeout timed out every later operation at once and failed the group on every
        # rank (a per-op zero timeout means "the group's default" instead)
        self.comm.timeout_s = positive_timeout_s(timeout, "set_timeout")

    # the name c10d's C++ backends give it (torch's _set_pg_timeout calls a backend's by it)
    _set_default_timeout = set_timeout

    def _submit(
        self, name: str, opts: Any, fn: Callable[[float], None], result: list[torch.Tensor]
    ) -> TorchportWork:
        timeout = _timeout_s(getattr(opts, "timeout", None), self.comm.timeout_s)
        comm = self.comm
        return comm.submit(name, lambda: fn(comm.deadline(timeout)), result)

    def _root(self, root: int, where: str) -> int:
        if not 0 <= root < self.comm.world:
            raise CollectiveArgumentError(
                f"{where}: root rank must be in [0, {self.comm.world}), got {root}"
            )
        return root

    # -- reductions ------------------------------------------------------------------------
    def allreduce(
        self, tensors: list[torch.Tensor], opts: Any = None, timeout: Any = None
    ) -> TorchportWork:
        """``allreduce([t], opts)``, ``allreduce(t | [t], op=SUM, timeout=None)``."""
        if type(opts) is not _AllreduceOptions and not hasattr(opts, "reduceOp"):
            opts = _positional(dist.AllreduceOptions(), "allreduce", timeout, reduceOp=opts)
        op = opts.reduceOp
        t = _one(tensors, "allreduce")
        name, factor, code = _red_for(op, t.dtype, "allreduce")
        comm, dc = self.comm, dtype_code(t.dtype)
        # in place: nothing to stage or scale (a conjugate / negative view's memory holds
        # the conjugate / negation of its values: it is staged)
        if name in _NATIVE_RED and t.is_contiguous() and not (t.is_conj() or t.is_neg()):
            return self._submit(
                "allreduce", opts, lambda deadline: alg.allreduce(comm, t, dc, code, deadline), [t]
            )
        name, factor = _avg_premul(name, factor, t.dtype, comm.world)
        s = _Staged(t)

        def run(deadline: float) -> None:
            if name == "PREMUL_SUM":
                s.t.mul_(factor)
            alg.allreduce(comm, s.t, dc, code, deadline)
            if name == "AVG":
                s.t.div_(comm.world)
            s.back()

        return self._submit("allreduce", opts, run, [t])

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> TorchportWork:
        opts = opts if opts is not None else dist.AllreduceCoalescedOptions()
        name, factor = _red_name(opts.reduceOp)
        given = [_cpu(t, "allreduce_coalesced") for t in tensors]
        # every one checked before any is written (_writable, as _Staged). Gloo refuses a leaf
        # that requires grad (its flatten's in-place copy raises on the caller); this writes it,
        # as all_reduce of one such leaf does on both backends.
        ts = [_writable(t) for t in given]
        codes = [_check_red(name, t.dtype, "allreduce_coalesced") for t in ts]
        comm = self.comm

        def run(deadline: float) -> None:
            by_dtype: dict[torch.dtype, list[int]] = {}
            for i, t in enumerate(ts):
                by_dtype.setdefault(t.dtype, []).append(i)
            for dt, idx in by_dtype.items():
                flat = (
                    torch.cat([ts[i].reshape(-1) for i in idx]) if idx else torch.empty(0, dtype=dt)
                )
                how, by = _avg_premul(name, factor, dt, comm.world)
                if how == "PREMUL_SUM":
                    flat.mul_(by)
                alg.allreduce(comm, flat, dtype_code(dt), codes[idx[0]], deadline)
                if how == "AVG":
                    flat.div_(comm.world)
                off = 0
                for i in idx:
                    n = ts[i].numel()
                    ts[i].copy_(flat[off : off + n].view(ts[i].shape))
                    off += n

        return self._submit("allreduce_coalesced", opts, run, given)

    def reduce(
        self, tensors: list[torch.Tensor], opts: Any = None, op: Any = None, timeout: Any = None
    ) -> TorchportWork:
        """``reduce([t], opts)``, ``reduce(t, root, op=SUM, timeout=None)``."""
        if type(opts) is not _ReduceOptions and not hasattr(opts, "rootRank"):
            opts = _positional(dist.ReduceOptions(), "reduce", timeout, rootRank=opts, reduceOp=op)
        t = _one(tensors, "reduce")
        root = self._root(opts.rootRank, "reduce")
        name, factor = _red_name(opts.reduceOp)
        code = _check_red(name, t.dtype, "reduce")
        s, comm, dc = _Staged(t), self.comm, dtype_code(t.dtype)
        name, factor = _avg_premul(name, factor, t.dtype, comm.world)
        mine = comm.rank == root

        def run(deadline: float) -> None:
            # (a non-root's own tensor is left alone: one staged is a copy already)
            buf = s.t if mine or s.t is not s.orig else s.t.clone()
            if name == "PREMUL_SUM":
                buf.mul_(factor)
            alg.reduce(comm, buf, root, dc, code, deadline)
            if mine:
                if name == "AVG":
                    buf.div_(comm.world)
                s.back()

        return self._submit("reduce", opts, run, [t])

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> TorchportWork:
        return self._reduce_scatter_base_op(output, input, opts)()

    reduce_scatter_single = _reduce_scatter_base

    def _reduce_scatter_base_op(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any
    ) -> Callable[[], TorchportWork]:
        """Every check of reduce_scatter_tensor(output, input), then a call that issues it."""
        opts = opts if opts is not None else dist.ReduceScatterOptions()
        out, inp, w = (
            _cpu(output, "reduce_scatter_tensor"),
            _cpu(input, "reduce_scatter_tensor"),
            self.comm.world,
        )
        if inp.numel() != out.numel() * w or inp.dtype != out.dtype:
            raise CollectiveArgumentError(
                f"reduce_scatter_tensor: input must have world_size ({w}) x output numel "
                f"({out.numel()}) elements of dtype {out.dtype}, got {inp.numel()} of {inp.dtype}"
            )
        _check_blocks(inp, out, w, "reduce_scatter_tensor", "input")
        return self._reduce_scatter(
            out, lambda c: [c[q * out.numel() : (q + 1) * out.numel()] for q in range(w)], inp, opts
        )

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
        timeout: Any = None,
    ) -> TorchportWork:
        """``reduce_scatter([out], [inputs], opts)``, ``reduce_scatter(out, inputs, op=SUM,
        timeout=None)``."""
        if type(output_tensors) is not list and isinstance(output_tensors, torch.Tensor):
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        if type(opts) is not _ReduceScatterOptions and not hasattr(opts, "reduceOp"):
            opts = _positional(
                dist.ReduceScatterOptions(), "reduce_scatter", timeout, reduceOp=opts
            )
        out = _one(output_tensors, "reduce_scatter")
        ins = self._check_list(input_tensors, out, "reduce_scatter", "input")
        return self._reduce_scatter(out, lambda _c: [t.reshape(-1) for t in ins], None, opts)()

    def _reduce_scatter(
        self,
        out: torch.Tensor,
        parts: Callable[[torch.Tensor], list[torch.Tensor]],
        inp: torch.Tensor | None,
        opts: Any,
    ) -> Callable[[], TorchportWork]:
        """Checks the reduce op and stages ``out``; the call returned issues the operation."""
        name, factor = _red_name(opts.reduceOp)
        code = _check_red(name, out.dtype, "reduce_scatter")
        s, comm, dc = _Staged(out), self.comm, dtype_code(out.dtype)
        name, factor = _avg_premul(name, factor, out.dtype, comm.world)

        def run(deadline: float) -> None:
            if inp is not None:  # one flat input: rank q's block starts q * block bytes in
                # (the factor after the contiguous copy: ``inp * factor`` kept a transposed
                # input's strides, and the blocks are cut from memory in storage order)
                src = plain_contiguous(inp)
                src = src if name != "PREMUL_SUM" else src * factor
                block, base, o = out.numel() * out.element_size(), _ptr(src), _ptr(s.t)
                # an output in the input other than as this rank's own block (the in-place
                # form): its chunks, written as they are folded, overwrote input bytes still
                # to be published (shared memory, an unaligned window: wrong sums)
                if o != base + comm.rank * block and _spans_overlap(o, block, base, src.nbytes):
                    src = src.clone()
                    base = _ptr(src)
                ptrs = [base + q * block if block else 0 for q in range(comm.world)]
                keep = [src]
            else:
                keep = [plain_contiguous(p) for p in parts(torch.empty(0, dtype=out.dtype))]
                if name == "PREMUL_SUM":
                    keep = [p * factor for p in keep]
                keep = _apart_from(keep, [s.t], own=comm.rank)  # (as above)
                ptrs = [_ptr(p) for p in keep]
            alg.reduce_scatter(
                comm,
                ptrs,
                _ptr(s.t),
                out.numel(),
                out.element_size(),
                dc,
                code,
                deadline,
            )
            if name == "AVG":
                s.t.div_(comm.world)
            s.back()

        return lambda: self._submit("reduce_scatter", opts, run, [out])

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> TorchportWork:
        self._same_count(outputs, inputs, "reduce_scatter_tensor_coalesced")
        # every pair checked before the first is issued: a bad pair k had been refused after
        # pairs < k were issued, leaving this rank ahead of its peers by a part of the batch
        issue = [self._reduce_scatter_base_op(o, i, opts) for o, i in zip(outputs, inputs)]
        works = [op() for op in issue]
        return self._chain("reduce_scatter_tensor_coalesced", works, outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    @staticmethod
    def _same_count(outputs: list[torch.Tensor], inputs: list[torch.Tensor], where: str) -> None:
        # zip() stopped at the shorter list: the outputs past it were silently left untouched
        if len(outputs) != len(inputs):
            raise CollectiveArgumentError(
                f"{where}: expects one output per input, got {len(outputs)} outputs for "
                f"{len(inputs)} inputs"
            )

    def _chain(
        self, name: str, works: list[TorchportWork], result: list[torch.Tensor]
    ) -> TorchportWork:
        """A Work that completes after ``works`` (all issued to the same in-order engine)."""

        def run(_deadline: float) -> None:
            for w in works:
                w.wait()

        return self._submit(name, None, run, result)

    # -- data movement ---------------------------------------------------------------------
    def broadcast(
        self, tensors: list[torch.Tensor], opts: Any = None, timeout: Any = None
    ) -> TorchportWork:
        """``broadcast([t], opts)``, ``broadcast(t, root, timeout=None)``."""
        if type(opts) is not _BroadcastOptions and not hasattr(opts, "rootRank"):
            opts = _positional(dist.BroadcastOptions(), "broadcast", timeout, rootRank=opts)
        t = _one(tensors, "broadcast")
        root = self._root(opts.rootRank, "broadcast")
        s, comm = _Staged(t), self.comm

        def run(deadline: float) -> None:
            alg.broadcast(comm, s.t, root, dtype_code(t.dtype), deadline)
            if comm.rank != root:
                s.back()

        return self._submit("broadcast", opts, run, [t])

    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> TorchportWork:
        return self._allgather_base_op(output, input, opts)()

    all_gather_single = _allgather_base

    def _allgather_base_op(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any
    ) -> Callable[[], TorchportWork]:
        """Every check of all_gather_into_tensor(output, input), then a call that issues it."""
        out, inp, w = (
            _cpu(output, "all_gather_into_tensor"),
            _cpu(input, "all_gather_into_tensor"),
            self.comm.world,
        )
        if out.numel() != inp.numel() * w or out.dtype != inp.dtype:
            raise CollectiveArgumentError(
                f"all_gather_into_tensor: output must have world_size ({w}) x input numel "
                f"({inp.numel()}) elements of dtype {inp.dtype}, got {out.numel()} of {out.dtype}"
            )
        _check_blocks(out, inp, w, "all_gather_into_tensor", "output")
        return self._gather_into("allgather", out, inp, opts)

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> TorchportWork:
        """``allgather([outputs], [t], opts)``, ``allgather(outputs, t, timeout=None)``."""
        if type(input_tensors) is not list and isinstance(input_tensors, torch.Tensor):
            output_tensors, input_tensors = [output_tensors], [input_tensors]
            opts = _positional(_AllgatherOptions(), "allgather", opts)
        inp = _one(input_tensors, "allgather")
        outs = self._check_list(output_tensors, inp, "allgather")
        return self._gather_list("allgather", outs, inp, -1, opts)

    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
        timeout: Any = None,
    ) -> TorchportWork:
        """``gather([outputs], [t], opts)``, ``gather(outputs, t, root, timeout=None)``."""
        if type(input_tensors) is not list and isinstance(input_tensors, torch.Tensor):
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        if type(opts) is not _GatherOptions and not hasattr(opts, "rootRank"):
            opts = _positional(dist.GatherOptions(), "gather", timeout, rootRank=opts)
        inp = _one(input_tensors, "gather")
        root = self._root(opts.rootRank, "gather")
        outs = self._check_list(output_tensors, inp, "gather") if self.comm.rank == root else None
        return self._gather_list("gather", outs, inp, root, opts)

    def _check_list(
        self, lists: list[list[torch.Tensor]], one: torch.Tensor, where: str, what: str = "output"
    ) -> list[torch.Tensor]:
        """The world_size tensors of ``lists`` (the ``what`` side), each of ``one``'s shape and
        dtype: gloo's condition (a list tensor of the right element count in another shape was
        accepted and filled in memory order)."""
        w = self.comm.world
        if len(lists) != 1 or len(lists[0]) != w:
            raise CollectiveArgumentError(
                f"{where}: expects one list of world_size ({w}) {what} tensors"
            )
        ts = [_cpu(t, where) for t in lists[0]]
        other = "input" if what == "output" else "output"
        for i, t in enumerate(ts):
            if t.shape != one.shape or t.dtype != one.dtype:
                raise CollectiveArgumentError(
                    f"{where}: every {what} must match the {other} (shape {tuple(one.shape)}, "
                    f"{one.dtype}), got shape {tuple(t.shape)}, {t.dtype} at index {i}"
                )
        return ts

    def _gather_list(
        self, name: str, outs: list[torch.Tensor] | None, inp: torch.Tensor, root: int, opts: Any
    ) -> TorchportWork:
        staged = [_Staged(o) for o in outs] if outs is not None else None
        comm = self.comm

        def run(deadline: float) -> None:
            src = plain_contiguous(inp)
            if staged is not None:  # (see _slots_to_avoid)
                if _outputs_meet([s.t for s in staged]):
                    for s in staged:
                        s.private()
                slots = [s.t for s in staged]
                src = _apart_from([src], _slots_to_avoid(src, slots, comm.rank))[0]
            ptrs = [_ptr(s.t) for s in staged] if staged is not None else None
            alg.allgather(
                comm,
                _ptr(src),
                src.numel() * src.element_size(),
                ptrs,
                dtype_code(inp.dtype),
                deadline,
                root=root,
            )
            for s in staged or []:
                s.back()

        return self._submit(name, opts, run, list(outs or []))

    def _gather_into(
        self, name: str, out: torch.Tensor, inp: torch.Tensor, opts: Any
    ) -> Callable[[], TorchportWork]:
        """Stages ``out``; the call returned issues the all-gather of ``inp`` into ``out``'s
        world_size consecutive blocks, addressed by pointer arithmetic rather than through a
        view per block (Python time that a 4 KB op notices)."""
        s, comm = _Staged(out), self.comm
        w, r, nb, dc = (
            comm.world,
            comm.rank,
            inp.numel() * inp.element_size(),
            dtype_code(inp.dtype),
        )

        def run(deadline: float) -> None:
            src = plain_contiguous(inp)
            base, sp = _ptr(s.t), _ptr(src)
            # an input overlapping the output, other than exactly its own block, is copied
            # first (see _slots_to_avoid)
            if sp != base + r * nb and _spans_overlap(sp, nb, base, w * nb):
                src = src.clone()
                sp = _ptr(src)
            alg.allgather(
                comm, sp, nb, [base + q * nb for q in range(w)] if nb else [0] * w, dc, deadline
            )
            s.back()

        return lambda: self._submit(name, opts, run, [out])

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> TorchportWork:
        self._same_count(outputs, inputs, "allgather_into_tensor_coalesced")
        # every pair checked before the first is issued (as reduce_scatter_tensor_coalesced)
        issue = [self._allgather_base_op(o, i, opts) for o, i in zip(outputs, inputs)]
        works = [op() for op in issue]
        return self._chain("allgather_into_tensor_coalesced", works, outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None
    ) -> TorchportWork:
        """``output_lists[q][i]`` receives rank q's ``inputs[i]``: one list per *rank*, as torch
        documents ``all_gather_coalesced`` (it was read as one list per input: with as many
        inputs as ranks every output got the transposed block, otherwise a typed error)."""
        w, n = self.comm.world, len(inputs)
        if not n:
            # as gloo refuses it (an empty chain completed with nothing gathered)
            raise CollectiveArgumentError(
                "allgather_coalesced: requires a non-empty list of input tensors, got []"
            )
        if len(output_lists) != w or any(len(outs) != n for outs in output_lists):
            raise CollectiveArgumentError(
                f"allgather_coalesced: expects world_size ({w}) output lists of len(inputs) "
                f"({n}) tensors each, got lists of {[len(outs) for outs in output_lists]}"
            )
        per_input = [[outs[i] for outs in output_lists] for i in range(n)]
        # every check before the first op is issued: a self-overlapping output refused by the
        # allgather of its input had let the earlier allgathers run (their outputs written) and
        # left this rank one op short of its peers
        for outs, t in zip(per_input, inputs):
            for o in self._check_list(
                [outs], _cpu(t, "allgather_coalesced"), "allgather_coalesced"
            ):
                _check_no_self_overlap(o)
        works = [self.allgather([outs], [t], opts) for outs, t in zip(per_input, inputs)]
        return self._chain("allgather_coalesced", works, [t for o in output_lists for t in o])

    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
        timeout: Any = None,
    ) -> TorchportWork:
        """``scatter([out], [inputs], opts)``, ``scatter(out, inputs, root, timeout=None)``."""
        if type(output_tensors) is not list and isinstance(output_tensors, torch.Tensor):
            output_tensors, input_tensors = [output_tensors], [input_tensors]
        if type(opts) is not _ScatterOptions and not hasattr(opts, "rootRank"):
            opts = _positional(dist.ScatterOptions(), "scatter", timeout, rootRank=opts)
        out = _one(output_tensors, "scatter")
        root = self._root(opts.rootRank, "scatter")
        ins = None
        if self.comm.rank == root:
            ins = self._check_list(input_tensors, out, "scatter", "input")
        s, comm = _Staged(out), self.comm

        def run(deadline: float) -> None:
            srcs = None
            if ins is not None:  # the root's: one that overlaps its output other than as
                # its own block (the in-place form) is read from a copy, as the output's
                # chunks, written as they are sent, overwrote input bytes still to be sent
                srcs = _apart_from([plain_contiguous(t) for t in ins], [s.t], own=root)
            nbytes = out.numel() * out.element_size()
            alg.scatter(
                comm,
                [_ptr(t) for t in srcs] if srcs is not None else None,
                _ptr(s.t),
                nbytes,
                root,
                dtype_code(out.dtype),
                deadline,
            )
            s.back()

        return self._submit("scatter", opts, run, [out])

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
        timeout: Any = None,
    ) -> TorchportWork:
        """``(output, input, output_splits, input_splits, opts | timeout=None)``."""
        opts = _timed(opts, timeout, dist.AllToAllOptions, "all_to_all_single")
        out, inp = _cpu(output, "all_to_all_single"), _cpu(input, "all_to_all_single")
        if out.dtype != inp.dtype:
            raise CollectiveArgumentError(
                f"all_to_all_single: dtypes differ: output {out.dtype}, input {inp.dtype}"
            )
        osz = self._splits(out, list(output_split_sizes), "output")
        isz = self._splits(inp, list(input_split_sizes), "input")
        ro, ri = self._row(out) * out.element_size(), self._row(inp) * out.element_size()
        return self._alltoall(
            "all_to_all_single", out, [n * ro for n in osz], inp, [n * ri for n in isz], opts
        )

    all_to_all_single = alltoall_base

    @staticmethod
    def _row(t: torch.Tensor) -> int:
        """Elements per dim-0 row; a 0-dim tensor is one row of one (as :meth:`_splits` counts
        it: it was a row of none, and world size 1 copied nothing and succeeded)."""
        if not t.dim():
            return 1
        return t.numel() // t.shape[0] if t.shape[0] else 0

    def _splits(self, t: torch.Tensor, sizes: list[int], which: str) -> list[int]:
        w = self.comm.world
        rows = t.shape[0] if t.dim() else 1
        if not sizes:
            if rows % w:
                raise CollectiveArgumentError(
                    f"all_to_all_single: {which} dim 0 ({rows}) must be divisible by world_size ({w}) without split sizes"
                )
            return [rows // w] * w
        if len(sizes) != w or sum(sizes) != rows or min(sizes) < 0:
            raise CollectiveArgumentError(
                f"all_to_all_single: {which} split sizes must be {w} non-negative ints summing to dim 0 ({rows}), got {sizes}"
            )
        return sizes

    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
        timeout: Any = None,
    ) -> TorchportWork:
        """``alltoall(outputs, inputs, opts | timeout=None)``."""
        opts = _timed(opts, timeout, dist.AllToAllOptions, "alltoall")
        w = self.comm.world
        if len(output_tensors) != w or len(input_tensors) != w:
            raise CollectiveArgumentError(
                f"alltoall: expects world_size ({w}) input and output tensors"
            )
        outs = [_cpu(t, "alltoall") for t in output_tensors]
        ins = [_cpu(t, "alltoall") for t in input_tensors]
        _check_alltoall(outs, ins)
        r = self.comm.rank
        _check_self_block("alltoall", r, ins[r].nbytes, outs[r].nbytes)
        staged = [_Staged(o) for o in outs]
        comm = self.comm

        def run(deadline: float) -> None:
            # in place (an output is an input): a block received over TCP overwrote an input
            # not yet sent (rank 0 of 3 got its own block back from rank 1); such inputs are
            # sent from copies
            if _outputs_meet([s.t for s in staged]):
                for s in staged:
                    s.private()
            srcs = _apart_from([plain_contiguous(t) for t in ins], [s.t for s in staged])
            alg.alltoall(
                comm,
                [_ptr(t) for t in srcs],
                [t.numel() * t.element_size() for t in srcs],
                [_ptr(s.t) for s in staged],
                [s.t.numel() * s.t.element_size() for s in staged],
                dtype_code(outs[0].dtype if outs else torch.uint8),
                deadline,
            )
            for s in staged:
                s.back()

        return self._submit("alltoall", opts, run, outs)

    def _alltoall(
        self,
        name: str,
        out: torch.Tensor,
        out_lens: list[int],
        inp: torch.Tensor,
        in_lens: list[int],
        opts: Any,
    ) -> TorchportWork:
        """all_to_all_single on byte lengths: pieces are consecutive in ``out`` / ``inp``."""
        r = self.comm.rank
        _check_self_block(name, r, in_lens[r], out_lens[r])
        s, comm = _Staged(out), self.comm

        def offsets(base: int, lens: list[int]) -> list[int]:
            ptrs, at = [], base
            for n in lens:
                ptrs.append(at if n else 0)
                at += n
            return ptrs

        def run(deadline: float) -> None:
            # in place (output = input): a block received over TCP overwrote input rows not yet
            # sent to their peer (rank 0 of 3 sent its own rows 2-5 back to itself); the splits
            # cover both tensors whole, so their byte ranges are the blocks' (_splits)
            src = _apart_from([plain_contiguous(inp)], [s.t])[0]
            alg.alltoall(
                comm,
                offsets(_ptr(src), in_lens),
                in_lens,
                offsets(_ptr(s.t), out_lens),
                out_lens,
                dtype_code(out.dtype),
                deadline,
            )
            s.back()

        return self._submit(name, opts, run, [out])

    def barrier(self, opts: Any = None, timeout: Any = None) -> TorchportWork:
        """``barrier(opts)``, ``barrier(timeout=None)``."""
        opts = _timed(opts, timeout, dist.BarrierOptions, "barrier")
        comm = self.comm
        return self._submit("barrier", opts, lambda deadline: alg.barrier(comm, deadline), [])

    # -- point to point --------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> TorchportWork:
        t = _one(tensors, "send")
        if not 0 <= dstRank < self.comm.world or dstRank == self.comm.rank:
            raise CollectiveArgumentError(
                f"send: destination must be another rank in [0, {self.comm.world}), got {dstRank}"
            )
        return self.comm.send_p2p(t, dstRank, tag)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> TorchportWork:
        t = _one(tensors, "recv")
        if not 0 <= srcRank < self.comm.world or srcRank == self.comm.rank:
            raise CollectiveArgumentError(
                f"recv: source must be another rank in [0, {self.comm.world}), got {srcRank}"
            )
        return self.comm.recv_p2p(t, srcRank, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> TorchportWork:
        """Receive from whichever rank sends first with ``tag`` (``dist.recv(src=None)``)."""
        t = _one(tensors, "recv_anysource")
        if self.comm.world < 2:
            raise CollectiveArgumentError(
                f"recv_anysource: needs another rank to receive from, group size is {self.comm.world}"
            )
        return self.comm.recv_p2p(t, None, tag)


# torch 2.13's ``_set_pg_timeout(timeout, group)`` sets the timeout only on the backends it knows
# by their C++ type (``ProcessGroupGloo``, ``ProcessGroupNCCL``) and only warns for any other
# ("Set timeout is now only supported for either nccl or gloo."): a torchport group kept its
# timeout, also under ``dist.breakpoint()``, which calls it on every group so that a debug
# session does not time the job out. No Python object can pass that type test (the classes are
# C++ bindings whose construction builds a gloo or NCCL context), so the function is wrapped: a
# torchport group takes the timeout (``set_timeout``; refused unless a positive timedelta),
# any other group goes on to the function this wrapped, unchanged. Callers that look it up on
# the module when they call (``dist.breakpoint``, ``dist.distributed_c10d._set_pg_timeout``)
# get the wrapper; a reference imported before ``torchport.distributed`` keeps torch's.
def _wrap_set_pg_timeout() -> None:
    c10d = dist.distributed_c10d
    inner = c10d._set_pg_timeout
    if getattr(inner, "_torchport", False):  # (a re-import: wrapped already)
        return

    @functools.wraps(inner)
    def _set_pg_timeout(timeout: datetime.timedelta, group: Any = None) -> None:
        pg = group if group is not None else c10d._get_default_group()
        if isinstance(pg, TorchportProcessGroup):
            pg.set_timeout(timeout)
            return
        inner(timeout, group)

    _set_pg_timeout._torchport = True  # type: ignore[attr-defined]
    c10d._set_pg_timeout = _set_pg_timeout


_wrap_set_pg_timeout()


# ``_c10d_functional.all_gather_into_tensor_out`` (functional collectives, torch.compile'd code
# that gathers into a given buffer) calls the group's ``_allgather_base`` from C++, which c10d
# sends to the group's C++ Backend for the device, not to a Python group's method: on a torchport
# group, which has none, it failed ("Could not retrieve or create the backend for device type
# cpu"). A CPU kernel registered on import runs it through the group's method for a torchport
# group, as torch's kernel does for its own (the op, the Work registered for ``wait_tensor``),
# and calls torch's kernel for any other group.
def _all_gather_out_kernel(
    kernel: Any, input: torch.Tensor, group_size: int, group_name: Any, *, out: Any
) -> Any:
    group = funcol_group(group_name)
    if not isinstance(group, TorchportProcessGroup):
        return kernel.call_boxed(CPU_KEYSET, input, group_size, group_name, out=out)
    work = group._allgather_base(out, input)
    torch._C._distributed_c10d._register_work(out, work)
    return out


# ``_c10d_functional.batch_p2p_ops`` (``torch.compile``'d ``batch_isend_irecv``) asks the group
# for its C++ Backend first, to learn whether it coalesces: on a torchport group it failed the same
# way. Run here as torch's kernel runs it on a group that does not coalesce: each op through the
# group's ``send`` / ``recv`` in order, a send's result an empty tensor, a receive's its tensor,
# each carrying its Work for ``wait_tensor``. A list torch refuses goes to torch's kernel.
def _batch_p2p_kernel(
    kernel: Any,
    op_list: list[str],
    peer_list: list[int],
    tag_list: list[int],
    tensors: list[torch.Tensor],
    group_name: Any,
) -> Any:
    group = funcol_group(group_name)
    if not isinstance(group, TorchportProcessGroup) or p2p_batch_refused(
        op_list, peer_list, tag_list, tensors
    ):
        return kernel.call_boxed(CPU_KEYSET, op_list, peer_list, tag_list, tensors, group_name)
    outs = []
    for op, peer, tag, t in zip(op_list, peer_list, tag_list, tensors):
        work, out = p2p_issue(group, op, peer, tag, t)
        torch._C._distributed_c10d._register_work(t, work)
        if out is not t:
            torch._C._distributed_c10d._register_work(out, work)
        outs.append(out)
    return outs


def _register_all_gather_out() -> Any:
    lib = torch.library.Library(NAMESPACE, "IMPL")
    override_cpu_kernel(lib, "all_gather_into_tensor_out", bind(_all_gather_out_kernel))
    override_cpu_kernel(lib, "batch_p2p_ops", bind(_batch_p2p_kernel))
    return lib


_ALL_GATHER_OUT_LIB = _register_all_gather_out()  # (held: the registration lives with it)
