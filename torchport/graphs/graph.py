"""``Graph``: capture a sequence of CPU ops once, replay it with one call (``torch.accelerator.Graph``).

Capture runs the user's code for real under a recorder (see :mod:`torchport.graphs.capture`) and
compiles what ran into one C function (:mod:`torchport.graphs.native`, when every op is supported)
or else one TorchScript function run by its C++ interpreter: no Python-level dispatch per op, and
``switch`` / ``while_loop`` inside the capture are branches and loops of the program, so trip
counts and branch choices follow the data.

Buffers follow CUDA graph rules: tensors created before the capture (weights, static inputs,
caches) are read and written in place at replay, so new inputs are written into them with
``copy_``; tensors created during the capture and still referenced when it ends are the static
outputs, rewritten by every replay (they are placed in the graph's :class:`MemPool` when they own
their storage). Shapes, Python scalars and Python control flow are frozen at capture time.
"""

from __future__ import annotations

import threading
from typing import Any, Literal

import torch

from torchport.graphs.capture import (
    GraphError,
    Program,
    Recorder,
    active_stack,
    current_recorder,
    global_ban,
    tolist_guard,
)
from torchport.graphs.pool import MemPool

__all__ = ["Graph", "GraphError"]


class Graph:
    """A captured, replayable CPU program.

    Args:
        keep_graph: if ``True``, compile lazily (``instantiate()`` or first ``replay()``); the
            static outputs then stay in the memory the capture gave them rather than the pool
            (by then the caller may hold views or NumPy arrays of them, which a move would
            leave on the old memory).
        pool: a :class:`MemPool` (e.g. another graph's ``pool()``) to place static outputs in;
            a new pool by default.
        capture_error_mode: what happens to "potentially unsafe" calls during the capture: ops
            that hand a tensor's value to Python (``Tensor.item()``, ``bool(tensor)``,
            ``torch.equal``), which a replay cannot repeat. ``"global"``: prohibited on every
            thread while this graph captures (:class:`CaptureError`); ``"thread_local"``:
            prohibited on the capturing thread only; ``"relaxed"``: allowed on the capturing
            thread, the value read at capture time is frozen into the program; ``"default"``:
            ``"global"``, the default of torch's CUDA backend. Ops that inherently conflict with
            capture (explicit ``torch.Generator``, non-ATen ops other than torchport's decode
            GEMVs, which quantized linears call, and ``torch.profiler.record_function``'s
            enter/exit, which run at capture time only) raise in every mode.

    Example::

        x = torch.zeros(8, 64)
        g = Graph()
        with g:
            y = torch.relu(x) * 2
        x.copy_(torch.randn(8, 64))
        g.replay()  # y now holds relu(x) * 2 for the new x
    """

    def __init__(
        self,
        keep_graph: bool = False,
        *,
        pool: MemPool | None = None,
        capture_error_mode: Literal["default", "global", "thread_local", "relaxed"] = "default",
    ) -> None:
        if pool is not None and not isinstance(pool, MemPool):
            raise GraphError(f"Graph: pool must be a torchport.graphs.MemPool, got {pool!r}")
        if capture_error_mode not in ("default", "global", "thread_local", "relaxed"):
            raise GraphError(
                "Graph: capture_error_mode must be 'default', 'global', 'thread_local' or "
                f"'relaxed', got {capture_error_mode!r}"
            )
        self.keep_graph = keep_graph
        self.graph_pool = pool if pool is not None else MemPool()
        self.capture_error_mode = capture_error_mode
        self._rec: Recorder | None = None
        self._program: Program | None = None
        self._pending: Recorder | None = None
        self._compile_lock = threading.Lock()  # one compile of _pending, however many replays
        self._debug = False

    # -- capture --------------------------------------------------------------------------------
    def capture_begin(self) -> None:
        """Start recording the ops run by this thread."""
        if self._rec is not None:
            raise GraphError("Graph.capture_begin: a capture is already in progress")
        if self._program is not None or self._pending is not None:
            raise GraphError("Graph.capture_begin: graph already captured; call reset() first")
        if active_stack():
            raise GraphError("Graph.capture_begin: another graph is capturing on this thread")
        rec = Recorder(self.capture_error_mode)
        if self.capture_error_mode in ("default", "global"):
            global_ban.acquire()
        tolist_guard.acquire()
        try:
            rec.__enter__()
        except BaseException:
            self._release(rec)
            raise
        active_stack().append(rec)
        self._rec = rec

    def capture_end(self) -> None:
        """Stop recording; compile the program now unless ``keep_graph`` (then on first use)."""
        rec = self._rec
        if rec is None:
            raise GraphError("Graph.capture_end: no capture in progress")
        stack = active_stack()  # this thread's: the capture must end where it began
        if rec not in stack:  # (from another thread it raised ValueError half-way and left
            # the capturing thread capturing for good)
            raise GraphError("Graph.capture_end: call it on the thread that called capture_begin")
        self._rec = None
        stack.remove(rec)
        rec.__exit__(None, None, None)
        self._release(rec)
        rec.freeze()  # replays are checked against the layouts of now (keep_graph: see freeze)
        self._pending = rec
        if not self.keep_graph:
            self.instantiate()
            assert self._program is not None
            if self._program.tier == "torchscript":
                self._place_outputs(self._program)

    def _abort(self) -> None:
        rec = self._rec
        if rec is not None:
            self._rec = None
            if rec in active_stack():
                active_stack().remove(rec)
            rec.__exit__(None, None, None)
            self._release(rec)

    @staticmethod
    def _release(rec: Recorder) -> None:
        if rec.error_mode in ("default", "global"):
            global_ban.release()
        tolist_guard.release()

    def _place_outputs(self, prog: Program) -> None:
        """Move static outputs that own their storage into the pool (values unchanged).

        Only at ``capture_end``, before the caller can take views or NumPy arrays of them that
        the move would leave behind on the old memory (a lazy ``instantiate`` at the first
        replay did it too: ``y.view(2, 2)`` taken before it kept reading zeros).
        An output on a static input's storage (a whole view of it made in the capture) or on
        another output's stays where it is: moving it would break the aliasing eager has.
        """
        ext = {t.untyped_storage().data_ptr() for t in prog.ext}
        shared: dict[int, int] = {}
        for t in prog.outs:
            key = t.untyped_storage().data_ptr()
            shared[key] = shared.get(key, 0) + 1
        inference = any(t.is_inference() for t in prog.outs)  # set_ on them needs the mode
        with torch.no_grad(), torch.inference_mode(inference):
            for t in prog.outs:
                st = t.untyped_storage()
                owns = (
                    st.data_ptr() not in ext
                    and shared[st.data_ptr()] == 1
                    and t.is_contiguous()
                    and t.storage_offset() == 0
                    and st.nbytes() == t.numel() * t.element_size()
                    and not t.requires_grad
                    and t.device.type == "cpu"
                )
                if owns and t.numel() > 0:
                    p = self.graph_pool.empty(tuple(t.shape), t.dtype)
                    p.copy_(t)
                    t.set_(p.untyped_storage(), 0, t.shape, t.stride())

    def instantiate(self) -> None:
        """Compile the captured program (``capture_end`` does this unless ``keep_graph``)."""
        self._compiled("Graph.instantiate: nothing captured")

    def _compiled(self, nothing: str) -> Program:
        """The program, compiled from the pending capture by the first caller; raises
        ``GraphError(nothing)`` if there is neither.

        Under a lock, with ``_pending`` cleared only once ``_program`` is set: the first
        replays of a ``keep_graph`` graph from two threads raised a spurious "nothing captured"
        in the one that found ``_pending`` cleared while the other was still compiling. A
        failed compile clears ``_pending`` too (``finish`` consumes the recording).
        """
        with self._compile_lock:
            if self._program is not None:
                return self._program
            rec = self._pending
            if rec is None:
                raise GraphError(nothing)
            try:
                self._program = rec.finish()
            finally:
                self._pending = None
            return self._program

    def replay(self) -> None:
        """Run the captured program once (reads inputs, rewrites outputs and mutated buffers)."""
        prog = self._program
        if prog is None:
            prog = self._compiled("Graph.replay: nothing captured; call capture_begin/capture_end")
        if prog.tier == "native" and current_recorder() is not None:
            # One C call: the capture on this thread would not see it, and its replays would
            # skip it (reading this graph's outputs as they were at capture time).
            raise GraphError(
                "Graph.replay: a native-tier graph cannot be replayed inside another graph's "
                "capture (its C program is invisible to the recorder, so the outer graph would "
                "not rerun it); run its ops in the outer capture directly, or capture this "
                "graph with torchport.config native=False (TorchScript tier, recorded op by op)"
            )
        prog.run()

    def reset(self) -> None:
        """Drop the captured program so the graph can capture again."""
        self._abort()
        with self._compile_lock:
            self._program = None
            self._pending = None

    def pool(self) -> MemPool:
        """The memory pool of this graph; pass it as ``pool=`` to share it with another graph."""
        return self.graph_pool

    # -- introspection --------------------------------------------------------------------------
    @property
    def num_ops(self) -> int:
        """ATen ops recorded (each branch and loop body counted once)."""
        return self._program.ops if self._program is not None else 0

    @property
    def tier(self) -> str:
        """How replay runs: ``"native"`` (one C function) or ``"torchscript"``."""
        if self._program is None:
            raise GraphError("Graph.tier: nothing captured")
        return self._program.tier

    @property
    def source(self) -> str:
        """The source of the captured program (C for the native tier, else TorchScript)."""
        if self._program is None:
            raise GraphError("Graph.source: nothing captured")
        return self._program.source

    def enable_debug_mode(self) -> None:
        """Allow :meth:`debug_dump`."""
        self._debug = True

    def debug_dump(self, path: str) -> None:
        """Write the program's TorchScript source to ``path`` (needs ``enable_debug_mode()``)."""
        if not self._debug:
            raise GraphError("Graph.debug_dump: call enable_debug_mode() before capturing")
        with open(path, "w") as f:
            f.write(self.source)

    def __enter__(self) -> Graph:
        self.capture_begin()
        return self

    def __exit__(self, exc_type: Any, *rest: Any) -> None:
        if exc_type is not None:
            self._abort()
            return
        self.capture_end()
