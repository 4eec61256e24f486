"""The timeline file and the stall inspector, in a 2-rank world."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from hvd_notebook.runtime.core import world


def test_timeline_records_phases_of_every_rank(hvd, tmp_path_factory):
    # every rank must write to the same path: rank 0 broadcasts its temporary folder
    path = hvd.broadcast_object(str(tmp_path_factory.mktemp("timeline") / "trace.json"), root_rank=0)
    hvd.start_timeline(path)
    hvd.allreduce(np.ones(1000, np.float32), name="dense/kernel")
    hvd.grouped_allreduce([np.ones(10), np.ones(20)], name="grads")
    hvd.allgather(np.ones((hvd.rank() + 1, 2)), name="rows")
    hvd.broadcast(np.ones(3), root_rank=0, name="weights")
    hvd.stop_timeline()
    hvd.barrier()
    if hvd.rank() != 0:
        return
    trace = json.loads(open(path).read())
    events = trace["traceEvents"]
    # a small allreduce of ranks on one host is summed in shared memory (runtime/core/shared_memory.py)
    data_phase = "SHM_ALLREDUCE" if world.current().negotiator.board is not None else "MPI_ALLREDUCE"
    tracks = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert tracks == {f"rank {r}" for r in range(hvd.size())}
    for r in range(hvd.size()):
        names = [(e["name"], e["args"]["tensors"]) for e in events if e.get("pid") == r and e["ph"] == "X"]
        assert ("NEGOTIATE_ALLREDUCE", "dense/kernel") in names
        assert (data_phase, "dense/kernel") in names
        assert ("MEMCPY_IN_FUSION_BUFFER", "grads.0 +1 fused") in names
        assert ("MEMCPY_OUT_FUSION_BUFFER", "grads.0 +1 fused") in names
        assert ("MPI_ALLGATHER", "rows") in names and ("MPI_BROADCAST", "weights") in names
    sizes = [e["args"]["bytes"] for e in events
             if e["name"] == data_phase and e["args"]["tensors"] == "dense/kernel"]
    assert sizes == [4000] * hvd.size()
    assert all(e["dur"] >= 0 and e["ts"] > 0 for e in events if e["ph"] == "X")


def test_timeline_marks_cycles_when_asked(hvd, tmp_path_factory):
    for mark_cycles in (False, True):
        path = hvd.broadcast_object(str(tmp_path_factory.mktemp("cycles") / "trace.json"), root_rank=0)
        hvd.start_timeline(path, mark_cycles=mark_cycles)
        hvd.allreduce(np.ones(4), name="a")
        hvd.barrier()
        hvd.stop_timeline()
        hvd.barrier()
        if hvd.rank() != 0:
            continue
        events = json.loads(open(path).read())["traceEvents"]
        cycles = [e for e in events if e["name"] == "CYCLE_START"]
        if not mark_cycles:
            assert cycles == []
            continue
        for r in range(hvd.size()):
            mine = [e for e in cycles if e["pid"] == r]
            assert len(mine) == 2 and all(e["ph"] == "i" for e in mine)  # the allreduce's round and the barrier's
            assert mine[1]["args"]["collective"] == mine[0]["args"]["collective"] + 1


def test_stall_warning_names_the_missing_rank(hvd, capfd, monkeypatch):
    from hvd_notebook.runtime.core import world
    negotiator = world.current().negotiator
    monkeypatch.setattr(negotiator.stall, "check_s", 1.0)
    if hvd.rank() == 1:
        time.sleep(3.0)  # rank 1 is late: rank 0 waits alone
    hvd.allreduce(np.ones(2), name="late/tensor")
    hvd.barrier()
    err = capfd.readouterr().err
    if hvd.rank() == 0:
        assert "stall: rank 0 has waited" in err and "allreduce('late/tensor')" in err
        assert "rank(s) [1] have not arrived" in err
    else:
        assert "stall" not in err


def test_stall_of_a_rank_in_the_debugger_is_waited_for(hvd, capfd, monkeypatch):
    """Rank 1 sits in a debugger (between its commands it answers stall queries): rank 0, waiting for it in an
    allreduce, says where it is once and does not give up past the shutdown time."""
    from hvd_notebook.runtime.core import negotiation
    stall = hvd_negotiator().stall
    monkeypatch.setattr(stall, "check_s", 1.0)
    monkeypatch.setattr(stall, "shutdown_s", 1.5)
    if hvd.rank() == 1:
        until = time.monotonic() + 3.5
        while time.monotonic() < until:
            negotiation.answer_from_debugger("a cell, line 4")
            time.sleep(0.05)
    total = hvd.allreduce(np.ones(2), name="debugged", op=hvd.Sum)
    assert list(total) == [2.0, 2.0]
    err = capfd.readouterr().err
    if hvd.rank() == 0:
        stalls = [line for line in err.splitlines() if "stall" in line]
        assert len(stalls) == 1 and "rank 1 is in the debugger (a cell, line 4)" in stalls[0], err
        assert "have not arrived" not in err


def test_stall_shutdown_raises_on_the_waiting_rank(hvd, monkeypatch):
    negotiator = hvd_negotiator()
    monkeypatch.setattr(negotiator.stall, "shutdown_s", 1.5)
    monkeypatch.setattr(negotiator.stall, "check_s", 100.0)
    raised = None
    if hvd.rank() == 0:
        try:
            hvd.barrier()
        except hvd.StallError as exc:
            raised = str(exc)
        assert raised and "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS" in raised and "barrier" in raised
        # rank 0 left a collective pending: it refuses further ones instead of mispairing them
        with pytest.raises(hvd.StallError, match="can no longer agree on collectives"):
            hvd.allreduce(np.ones(2))
    if hvd.rank() == 1:
        time.sleep(2.0)
        hvd.barrier()  # completes rank 0's abandoned barrier


def hvd_negotiator():
    from hvd_notebook.runtime.core import world
    return world.current().negotiator



def test_stall_left_a_collective_half_way_then_renewed(hvd, monkeypatch):
    """What a debugged rank's quit leaves (rank 0 left a collective that rank 1 never reached; here also the
    test before's): renewed on every rank, the next collectives work."""
    from hvd_notebook.runtime.core import debugger
    monkeypatch.setattr(hvd_negotiator().stall, "shutdown_s", 1.0)
    monkeypatch.setattr(hvd_negotiator().stall, "check_s", 100.0)
    if hvd.rank() == 0:
        with pytest.raises(hvd.StallError):
            hvd.allreduce(np.ones(2), name="never")
    else:
        time.sleep(2.0)  # (until rank 0 gave up: as in a cell, no rank renews while another waits)
    assert debugger.broken() == (hvd.rank() == 0)
    debugger.renew()
    assert not debugger.broken()
    assert list(hvd.allreduce(np.ones(2), name="after", op=hvd.Sum)) == [2.0, 2.0]
