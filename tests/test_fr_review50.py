"""Flight Recorder review 50: functional collectives, and groups of a class defined later.

The functional collectives (``torch.distributed._functional_collectives``, the
``torch.ops._c10d_functional`` kernels FSDP2, tensor parallelism and torch.compile'd code issue)
call the group from C++: on gloo no entry was made (a torchport group, a Python subclass, was
called through its recorded methods). And an op called directly on a group whose
``ProcessGroup`` subclass was defined after ``install()`` was recorded only once a
``torch.distributed`` function had met one of its groups.
"""

from __future__ import annotations

import datetime
import subprocess
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_harness import run_world, stop_forkserver_after_module  # noqa: F401 (autouse fixture)

from torchport.distributed import flight_recorder as fr
from torchport.distributed.flight_recorder import COMPLETED, FlightRecorder
from torchport.distributed.fr_analyze import analyze, load_dumps
from torchport.distributed.fr_torch import export

TIMEOUT = datetime.timedelta(seconds=20)


def _funcol_job(rank: int, world: int, init: str, backend: str, d: str) -> Any:
    import torch.distributed._functional_collectives as funcol

    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=TIMEOUT)
    rec = fr.install(FlightRecorder(dump_dir=d), signal_dump=False)
    ops = torch.ops._c10d_functional
    try:
        g = dist.group.WORLD
        assert g is not None
        name = g.group_name  # (what a compiled graph passes: the group's name)
        x = torch.arange(4.0) + 10 * rank
        got: dict[str, Any] = {}
        got["all_reduce"] = funcol.wait_tensor(funcol.all_reduce(x, "sum", g)).tolist()
        pair = funcol.all_reduce_coalesced([x, torch.ones(2)], "sum", g)
        got["coalesced"] = [funcol.wait_tensor(t).tolist() for t in pair]
        got["gather"] = ops.wait_tensor(ops.all_gather_into_tensor(x, world, name)).tolist()
        got["scatter"] = ops.wait_tensor(ops.reduce_scatter_tensor(x, "sum", world, name)).tolist()
        got["to_all"] = funcol.wait_tensor(funcol.all_to_all_single(x, None, None, g)).tolist()
        got["bcast"] = funcol.wait_tensor(funcol.broadcast(x, 0, g)).tolist()
        y = x.clone()
        got["in_place"] = ops.wait_tensor(ops.all_reduce_(y, "max", name)).tolist()
        # (on a torchport group this op failed, recorder or not: c10d ran it on the group's
        # CPU Backend object, and the torchport group registers none; backend.py's kernel)
        out = torch.empty(4 * world)
        ops.wait_tensor(ops.all_gather_into_tensor_out(x, world, name, out=out))
        got["out"] = out.tolist()
        dist.all_reduce(x)  # the module function's op: numbered after the functional ones
        rec.dump("test: end")
        entries = [
            (e["op"], e["seq_id"], e["group"], e["state"], e["sizes"])
            for e in rec.snapshot()["entries"]
        ]
        return got, entries
    finally:
        fr.uninstall()
        rec.stop()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend", ["gloo", "torchport"])
def test_functional_collectives_are_recorded_with_names_sizes_and_sequence_ids(tmp_path, backend):
    """Each functional collective is one entry of the op its kernel issued to the group, on
    the group's own counter (the module function's all_reduce after them comes next),
    completed; results are torch's. On gloo none of them was recorded."""
    dumps = tmp_path / "dumps"
    r0, r1 = run_world(_funcol_job, 2, backend, str(dumps), timeout=75)
    (got0, e0), (got1, e1) = r0, r1
    x0, x1 = [0.0, 1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0]
    summed = [a + b for a, b in zip(x0, x1, strict=True)]
    want = {
        "all_reduce": summed,
        "coalesced": [summed, [2.0, 2.0]],
        "gather": x0 + x1,
        "bcast": x0,
        "in_place": x1,
        "out": x0 + x1,
    }
    assert {k: v for k, v in got0.items() if k in want} == want, got0
    assert {k: v for k, v in got1.items() if k in want} == want, got1
    assert got0["scatter"] == [x0[0] + x1[0], x0[1] + x1[1]], got0
    assert got1["scatter"] == [x0[2] + x1[2], x0[3] + x1[3]], got1
    assert got0["to_all"] == x0[:2] + x1[:2] and got1["to_all"] == x0[2:] + x1[2:]
    ops = [
        ("all_reduce", [[4]]),
        ("all_reduce_coalesced", [[4], [2]]),
        ("all_gather_into_tensor_coalesced", [[8], [4]]),  # (outputs, then inputs)
        ("reduce_scatter_tensor_coalesced", [[2], [4]]),
        ("all_to_all_single", [[4], [4]]),
        ("broadcast", [[4]]),
        ("all_reduce", [[4]]),
        ("all_gather_into_tensor", [[8], [4]]),
        ("all_reduce", [[4]]),
    ]
    expected = [(op, i, "default", COMPLETED, sizes) for i, (op, sizes) in enumerate(ops)]
    assert e0 == expected and e1 == expected, (e0, e1)
    text = analyze(load_dumps(dumps)).text()
    assert text.startswith("no problem found"), text
    assert len(export(dumps, tmp_path / "torch")) == 2  # (torch's format, for its analyzer)


def test_uninstall_removes_the_functional_collective_kernels():
    """install() registers a CPU kernel for each functional collective; uninstall() removes
    them (torch's own serve again) and drops the relays."""

    def cpu_kernel() -> bool:
        return "\nCPU:" in torch._C._dispatch_dump("_c10d_functional::all_reduce")

    assert not cpu_kernel()
    rec = FlightRecorder(buffer_size=4, rank=0, world_size=1)
    try:
        fr.install(rec, signal_dump=False)
        fr.install(rec, signal_dump=False)  # (idempotent: one registration)
        assert cpu_kernel()
    finally:
        fr.uninstall()
        rec.stop()
    assert not cpu_kernel() and not fr._relays


# -- 4: a ProcessGroup subclass defined after install() ---------------------------------------
def _done() -> Any:
    fut: torch.futures.Future[Any] = torch.futures.Future()
    fut.set_result(None)
    return torch._C._distributed_c10d._create_work_from_future(fut)


def test_ops_called_directly_on_a_group_of_a_class_defined_after_install_are_recorded():
    """``LatePG(0, 1).allreduce([t])`` recorded nothing until a torch.distributed function had
    met a LatePG group; the class is wrapped at its definition now (its subclasses too), and
    a class defined after uninstall() is not."""
    rec = FlightRecorder(buffer_size=8, rank=0, world_size=1)
    try:
        fr.install(rec, signal_dump=False)

        class LatePG(dist.ProcessGroup):
            def allreduce(self, tensors: Any, opts: Any = None) -> Any:
                return _done()

        class Later(LatePG):
            def broadcast(self, tensors: Any, opts: Any = None) -> Any:
                return _done()

        class Plain:  # a work of a group's own, without get_future: its call no longer fails
            def wait(self, timeout: Any = None) -> bool:
                return True

        class OwnWork(dist.ProcessGroup):
            def barrier(self, opts: Any = None) -> Plain:
                return Plain()

        LatePG(0, 1).allreduce([torch.ones(3)]).wait()
        Later(0, 1).broadcast([torch.ones(2)]).wait()
        assert isinstance(OwnWork(0, 1).barrier(), Plain)
        got = [(e["op"], e["seq_id"], e["state"], e["sizes"]) for e in rec.snapshot()["entries"]]
        assert got[:2] == [("all_reduce", 0, COMPLETED, [[3]]), ("broadcast", 0, COMPLETED, [[2]])]
        assert [op for op, *_ in got[2:]] == ["barrier"], got
        mine = vars(LatePG)["allreduce"]
    finally:
        fr.uninstall()
        rec.stop()
    assert vars(LatePG)["allreduce"] is not mine  # (restored to the class's own)
    assert "__init_subclass__" not in vars(dist.ProcessGroup)

    class AfterPG(dist.ProcessGroup):
        def allreduce(self, tensors: Any, opts: Any = None) -> Any:
            return _done()

    own = vars(AfterPG)["allreduce"]
    AfterPG(0, 1).allreduce([torch.ones(1)]).wait()
    assert vars(AfterPG)["allreduce"] is own


# -- review of the fixes: install() under -W error, and a failed install undone ----------------
def test_install_under_warnings_as_errors():
    """Registering the functional-collective kernels over torch's made c10d warn, an error under
    ``-W error`` (pytest's ``filterwarnings = error`` too): install() raised part-way; importing
    torchport.distributed (its own kernel) must not raise either."""
    code = (
        "import torchport.distributed\n"
        "from torchport.distributed import flight_recorder as fr\n"
        "rec = fr.install(fr.FlightRecorder(buffer_size=4, rank=0, world_size=1), "
        "signal_dump=False)\n"
        "assert fr._funcol_lib is not None\n"
        "fr.uninstall(); rec.stop(); print('ok')\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_failed_install_leaves_nothing_patched(monkeypatch):
    def boom() -> None:
        raise RuntimeError("no kernels")

    monkeypatch.setattr(fr, "_hook_functional", boom)
    before, method = dist.all_reduce, vars(dist.ProcessGroup)["allreduce"]
    rec = FlightRecorder(buffer_size=4, rank=0, world_size=1)
    try:
        with pytest.raises(RuntimeError, match="no kernels"):
            fr.install(rec, signal_dump=False)
        assert not fr._originals and dist.all_reduce is before
        assert "__init_subclass__" not in vars(dist.ProcessGroup)
        assert vars(dist.ProcessGroup)["allreduce"] is method
    finally:
        fr.uninstall()
        rec.stop()
