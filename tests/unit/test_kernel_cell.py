"""A running cell against stand-in ranks (no engines): how it ends, and how it
stops ranks that are still running; its output streams; the failure messages."""

from __future__ import annotations

import signal
import time
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
from conftest import FakeController

from hvd_notebook.cluster import ClusterError
from hvd_notebook.cluster.launching import channel
from hvd_notebook.cluster.launching.channel import ControllerSilent, RankChannel, is_busy
from hvd_notebook.cluster.launching.replies import failure_of
from hvd_notebook.config import DashboardMode
from hvd_notebook.kernel import cell, failures
from hvd_notebook.kernel.cell import RankValue, RunningCell
from hvd_notebook.kernel.forwarding import OutputStream
from hvd_notebook.messages import RankEvent


class RemoteError(Exception):
    def __init__(self, ename: str, evalue: str) -> None:
        super().__init__(ename)
        self.ename, self.evalue, self.traceback = ename, evalue, f"Traceback\n{ename}: {evalue}"


def part(stdout: str = "") -> Future:
    future: Future = Future()
    future.metadata = {"data": {}, "stdout": stdout, "stderr": "", "outputs": [], "execute_result": None}
    return future


class FakeAsyncResult:
    def __init__(self, parts: list[Future]) -> None:
        self.parts = parts

    def split(self) -> tuple[Future, ...]:
        return tuple(self.parts)

    def wait_for_output(self, timeout: float) -> bool:
        return True


class FakeClient(FakeController):
    control_silent = False  # (signals are lost: the whole controller is stopped, not only its hub)

    def __init__(self, parts: list[Future], busy: bool) -> None:
        self.parts, self.busy = parts, busy
        self.signals: list[tuple[int, list[int]]] = []

    def __getitem__(self, targets):
        client = self

        class View:
            def execute(self, code, silent, block):
                return FakeAsyncResult(client.parts)

        return View()

    def send_signal(self, sig, targets, block):
        assert not block  # (a controller that does not answer must not hang the kernel)
        answered: Future = Future()
        if self.control_silent:
            return answered
        self.signals.append((sig, targets))
        if not self.busy:  # the ranks stop when interrupted
            for future in self.parts:
                if not future.done():
                    future.set_exception(RemoteError("KeyboardInterrupt", ""))
        answered.set_result(None)
        return answered

    def queues(self, targets):
        return {t: {"tasks": int(self.busy), "queue": 0} for t in targets or []}


class FakeCluster:
    def __init__(self, parts: list[Future], busy: bool = False, restart_fails: bool = False,
                 ranks: list[SimpleNamespace] | None = None) -> None:
        self.client = FakeClient(parts, busy)
        self.channel = Channel(self.client, self)  # the real channel, over a stand-in client
        self.channel.bind({0: 10, 1: 11})
        self.restarts = 0
        self.restart_fails = restart_fails
        self.ranks = ranks or []  # (none: no processes here to ask for their stacks)
        self.routes, self.ended = True, False  # (the controller's schedulers run; the world was not ended)

    def alive(self):
        return {0: True, 1: True}

    def end_world(self):
        self.ended = True

    def restart(self):
        self.restarts += 1
        if self.restart_fails:
            raise ClusterError("no MPI")


class Channel(RankChannel):
    """The rank channel, its controller's schedulers running while ``cluster.routes`` says so."""

    def __init__(self, client: FakeClient, cluster: FakeCluster) -> None:
        super().__init__(client)
        self.cluster = cluster

    def routes(self) -> bool:
        return self.cluster.routes


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(cell, "POLL_S", 0.001)
    monkeypatch.setattr(cell, "INTERRUPT_GRACE_S", 0.05)
    monkeypatch.setattr(cell, "SIMULTANEOUS_FAILURE_S", 0.0)


def start(cluster: FakeCluster, timeout: float | None = None) -> RunningCell:
    return RunningCell(cluster, "code", [0, 1], show={0}, timeout=timeout, mode=DashboardMode.NONE)


def test_a_cell_that_finishes_returns_rank_0s_value_and_its_output(capsys):
    parts = [part("hello\n"), part("not shown\n")]
    parts[0].metadata["execute_result"] = {"data": {"text/plain": "42"}}
    for future in parts:
        future.set_result(None)
    value = start(FakeCluster(parts)).wait()
    assert isinstance(value, RankValue) and repr(value) == "42"
    assert capsys.readouterr().out == "[0] hello\n"


def test_a_timeout_interrupts_the_running_ranks_once():
    cluster = FakeCluster([part(), part()])
    with pytest.raises(failures.CellTimeout, match=r"within --timeout 0.01 s; rank\(s\) \[0, 1\] were still "
                                                   r"running. They were interrupted; their variables are kept"):
        start(cluster, timeout=0.01).wait()
    assert cluster.client.signals == [(signal.SIGINT, [10, 11])] and cluster.restarts == 0


BARRIER_DUMP = """Current thread 0x00007f0000000001 (most recent call first):
  File "/venv/lib/python3.11/site-packages/hvd_notebook/runtime/core/world.py", line 120 in _wait
  File "/venv/lib/python3.11/site-packages/hvd_notebook/runtime/core/ops.py", line 88 in barrier
  File "/tmp/ipykernel_4242/123.py", line 3 in <module>
"""
SLEEP_DUMP = """Current thread 0x00007f0000000002 (most recent call first):
  File "/tmp/ipykernel_4243/123.py", line 5 in <module>
"""


@pytest.fixture
def stacks_asked(monkeypatch) -> list[tuple[list[int], bool]]:
    """Stand-in stacks of pids 100 (rank 0, in hvd.barrier) and 101 (rank 1, at line 5): each time
    they are asked for, the pids asked and whether the ranks had been interrupted before."""
    asked: list[tuple[list[int], bool]] = []
    dumps = {100: ("rank 0 of 2", BARRIER_DUMP), 101: ("rank 1 of 2", SLEEP_DUMP)}

    def collect(pids, timeout=2.0):
        asked.append((sorted(pids), bool(CLUSTERS and CLUSTERS[-1].client.signals)))
        return {pid: dumps[pid] for pid in pids}

    monkeypatch.setattr(cell.stacks, "collect", collect)
    yield asked
    CLUSTERS.clear()


CLUSTERS: list[FakeCluster] = []


def on_two_ranks(parts: list[Future], busy: bool = False) -> FakeCluster:
    ranks = [SimpleNamespace(rank=r, pid=100 + r, here=True) for r in (0, 1)]
    CLUSTERS.append(FakeCluster(parts, busy=busy, ranks=ranks))
    return CLUSTERS[-1]


def test_a_timeout_says_where_each_running_rank_was_before_the_interrupt(stacks_asked):
    with pytest.raises(failures.CellTimeout) as raised:
        start(on_two_ranks([part(), part()]), timeout=0.01).wait()
    assert str(raised.value) == (
        "The cell did not finish within --timeout 0.01 s; rank(s) [0, 1] were still running (rank 0 was in "
        "hvd.barrier(), called from a cell, line 3; rank 1 was at a cell, line 5). They were interrupted; "
        "their variables are kept and the cluster is ready.")
    assert stacks_asked == [([100, 101], False)]  # once, before the SIGINT


def test_ranks_that_ignore_the_interrupt_are_named_with_where_they_were(stacks_asked):
    parts = [part(), part()]
    parts[0].set_result(None)  # rank 0 finished: only rank 1 is asked for its stack, and named
    with pytest.raises(failures.CellTimeout, match=r"rank\(s\) \[1\] were still running \(rank 1 was at a cell, "
                                                   r"line 5\)\. Rank\(s\) \[1\] did not respond to an interrupt"):
        start(on_two_ranks(parts, busy=True), timeout=0.01).wait()
    assert stacks_asked == [([101], False)]


def test_a_rank_error_says_where_the_ranks_still_running_were(stacks_asked):
    parts = [part(), part()]
    parts[1].set_exception(RemoteError("ValueError", "bad shard"))
    with pytest.raises(failures.RankError) as raised:
        start(on_two_ranks(parts)).wait()
    assert raised.value.outcomes == ["rank 0: was still running (in hvd.barrier(), called from a cell, line 3); "
                                     "interrupted", "rank 1: raised ValueError: bad shard"]


def test_ranks_that_ignore_the_interrupt_get_the_world_restarted():
    cluster = FakeCluster([part(), part()], busy=True)
    with pytest.raises(failures.CellTimeout, match="did not respond to an interrupt .* so the MPI world was "
                                                   "restarted"):
        start(cluster, timeout=0.01).wait()
    assert cluster.restarts == 1


def test_ranks_behind_a_controller_that_does_not_answer_get_the_world_restarted_unless_their_answers_come(monkeypatch):
    monkeypatch.setattr(channel, "QUEUE_ANSWER_S", 0.05)
    cluster = FakeCluster([part(), part()])
    cluster.client.silent = cluster.client.control_silent = True  # (stopped: nothing it is sent is answered)
    with pytest.raises(failures.CellTimeout, match=r"Rank\(s\) \[0, 1\] could not be interrupted: the cluster's "
                                                   r"controller did not answer .* so the MPI world was restarted"):
        start(cluster, timeout=0.01).wait()
    assert cluster.restarts == 1
    cluster = FakeCluster([part(), part()])
    cluster.client.silent = True  # (its hub stopped alone: the signals arrive, the ranks stop, their answers come)
    with pytest.raises(failures.CellTimeout, match="They were interrupted; their variables are kept"):
        start(cluster, timeout=0.01).wait()
    assert cluster.restarts == 0


def test_a_controller_that_does_not_answer_is_given_up_after_the_timeout():
    client = LaggingController(lag=0)
    assert on_engines_0_and_1(client).busy([1, 0]) == {1: False, 0: False}  # (ipyparallel's int keys back)
    client.silent = True
    t0 = time.monotonic()
    with pytest.raises(ControllerSilent, match=r"did not answer within 0.2 s \(stopped or hung\?\): %hvd restart "
                                               "starts the cluster again"):
        on_engines_0_and_1(client).busy(timeout=0.2)
    assert 0.2 <= time.monotonic() - t0 < 2


class SlowResult:
    """An ipyparallel AsyncResult whose answer comes after ``late`` of the waits for it."""

    def __init__(self, late: int) -> None:
        self.late, self.waits = late, 0

    def get(self, timeout: float) -> str:
        self.waits += 1
        if self.waits <= self.late:
            raise TimeoutError("Result not ready.")  # (as ipyparallel's, a subclass)
        return "the value"


def test_a_long_answer_is_awaited_while_the_controller_answers_and_given_up_when_it_does_not(monkeypatch):
    monkeypatch.setattr(channel, "QUEUE_ANSWER_S", 0.05)
    controller = LaggingController(lag=0)
    result = SlowResult(late=3)  # (a big pull: the ranks take long, the controller answers meanwhile)
    controller.pulled = result
    assert on_engines_0_and_1(controller).pull("x", 1) == "the value"
    assert result.waits == 4 and controller.asked == 3
    controller.silent, controller.pulled = True, SlowResult(late=3)
    with pytest.raises(ControllerSilent, match="did not answer within 0.05 s"):
        on_engines_0_and_1(controller).pull("x", 1)


def test_a_controller_gone_while_the_cell_runs_ends_the_world_at_once_and_says_so(monkeypatch, capsys):
    monkeypatch.setattr(cell, "LIVENESS_S", 0.0)
    cluster = FakeCluster([part("half way\n"), part()])
    running = start(cluster, timeout=5.0)  # (unnoticed, the cell would end only by its timeout)
    assert not cluster.ended
    cluster.routes = False  # (its schedulers killed: the ranks' results can no longer come)
    with pytest.raises(failures.RankDied, match=r"The cluster's controller ended while the cell ran \(its processes "
                                                r"were killed.*rank\(s\) \[0, 1\] were ended: run %hvd restart") as e:
        running.wait()
    assert cluster.ended and e.value.died == {0: failures.CONTROLLER_GONE, 1: failures.CONTROLLER_GONE}
    assert cluster.client.signals == [] and cluster.restarts == 0  # (nothing to interrupt: the world is ended)
    assert capsys.readouterr().out == "[0] half way\n"  # (what came before is still shown)


def test_a_failed_restart_loses_the_cluster():
    cluster = FakeCluster([part(), part()], busy=True, restart_fails=True)
    running = start(cluster, timeout=0.01)
    with pytest.raises(failures.CellTimeout, match="restarting the engines failed: no MPI. Run %hvd restart"):
        running.wait()
    assert running.cluster_lost


def test_a_rank_that_raises_fails_the_cell_and_stops_the_others():
    parts = [part(), part()]
    parts[1].set_exception(RemoteError("ValueError", "bad shard"))
    cluster = FakeCluster(parts)
    with pytest.raises(failures.RankError, match=r"rank 1 raised ValueError: bad shard") as raised:
        start(cluster).wait()
    assert raised.value.outcomes == ["rank 0: was still running; interrupted", "rank 1: raised ValueError: bad shard"]
    assert raised.value.remote_traceback == ["Traceback", "ValueError: bad shard"]
    assert cluster.client.signals == [(signal.SIGINT, [10])]


def test_a_rank_that_fails_while_the_output_is_forwarded_still_fails_the_cell(monkeypatch):
    # rank 0 has finished; rank 1 raises while the cell forwards output (a loaded machine): its error is not lost
    parts = [part(), part()]
    parts[0].set_result(None)
    running = start(FakeCluster(parts))
    forward = running.pump

    def pump(final: bool = False) -> None:
        if not parts[1].done():
            parts[1].set_exception(RemoteError("ValueError", "rank 1 gives up"))
        forward(final)

    monkeypatch.setattr(running, "pump", pump)
    with pytest.raises(failures.RankError, match=r"rank 1 raised ValueError: rank 1 gives up"):
        running.wait()


def test_interrupting_the_kernel_stops_the_ranks_and_says_where_they_were(capsys, stacks_asked):
    """A real SIGINT while the cell waits (as ipykernel's interrupt sends it), twice: the first is taken
    at the loop's next turn, the second changes nothing; the kernel's own handler is back afterwards."""
    import os
    import signal
    import threading

    running = start(on_two_ranks([part(), part()]))
    before = signal.getsignal(signal.SIGINT)
    def press_stop_twice():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Timer(0.2, press_stop_twice).start()
    with pytest.raises(KeyboardInterrupt):
        running.wait()
    assert ("Rank(s) [0, 1] were still running (rank 0 was in hvd.barrier(), called from a cell, line 3; rank 1 was "
            "at a cell, line 5). They were interrupted") in capsys.readouterr().err
    assert stacks_asked == [([100, 101], False)]
    assert signal.getsignal(signal.SIGINT) is before


def test_output_streams_forward_whole_lines_with_the_rank():
    written: list[str] = []
    stream = OutputStream(3, "stdout", written.append)
    stream.update("a\nb")
    stream.update("a\nb\nc")
    stream.update("a\nb\nc", final=True)
    assert written == ["[3] a\n", "[3] b\n", "[3] c\n"]


def test_output_streams_resend_a_collapsed_carriage_return_line():
    written: list[str] = []
    stream = OutputStream(0, "stdout", written.append)
    stream.update("x\n10%\n")
    stream.update("x\n1")  # ipyparallel replaced "10%\n" after a '\r'
    stream.update("x\n100%\n")
    assert written == ["[0] x\n[0] 10%\n", "[0] 100%\n"]


def test_the_events_of_every_rank_are_shown_once_as_its_warnings(capsys):
    """A rank's events (runtime/core/events.py, published beside its progress) are shown as its warning lines,
    an unshown rank's too, each once, in order; a stall's missing ranks are located (none here: no stacks)."""
    parts = [part(), part()]
    parts[1].metadata["stderr"] = "not shown: rank 1's own stderr\n"
    running = start(FakeCluster(parts))
    events = [RankEvent("warning", "first", rank=1, seq=0), RankEvent("stall", "stall: second", {"missing": [0]},
                                                                        rank=1, seq=1)]
    parts[1].metadata["data"] = {RankEvent.key(e.seq): e.to_dict() for e in events}
    for future in parts:
        future.set_result(None)
    running.wait()
    running.pump(final=True)
    err = capsys.readouterr().err
    assert err.count("[1] [hvd_notebook] WARNING: first\n[1] [hvd_notebook] WARNING: stall: second\n") == 1, err
    assert "not shown" not in err


def test_commit_events_are_taken_in_order_and_not_shown(capsys):
    """Rank 0's hvd.elastic commits (an empty text: its run returned, the commit removed) reach ``commits``,
    which the session's recovery loop reads; they are no warnings."""
    parts = [part(), part()]
    running = start(FakeCluster(parts))
    events = [RankEvent("commit", "step=2, committed at 12:00:00", seq=0), RankEvent("commit", "", seq=1),
              RankEvent("commit", "step=4, committed at 12:00:05", seq=2)]
    parts[0].metadata["data"] = {RankEvent.key(e.seq): e.to_dict() for e in events}
    for future in parts:
        future.set_result(None)
    running.wait()
    running.pump(final=True)
    assert running.commits == ["step=2, committed at 12:00:00", "", "step=4, committed at 12:00:05"]
    assert "commit" not in capsys.readouterr().err


def test_busy_engines():
    assert is_busy({"tasks": 1, "queue": 0}) and is_busy({"tasks": 0, "queue": 2})
    assert not is_busy({"tasks": 0, "queue": 0}) and not is_busy(None) and not is_busy("error")


class LaggingController(FakeController):
    """A controller that hears of a finished task ``lag`` answers late."""

    def __init__(self, lag: int, outstanding: set[str] | None = None) -> None:
        self.lag, self.outstanding, self.asked = lag, outstanding or set(), 0

    def queues(self, targets) -> dict:
        self.asked += 1
        return {0: {"tasks": int(self.asked <= self.lag), "queue": 0}, 1: {"tasks": 0, "queue": 0}, "unassigned": 0}

    def __getitem__(self, engine: int):
        assert engine == 1, engine  # (rank 1's engine)
        return self

    def pull(self, name: str, block: bool) -> SlowResult:
        assert (name, block) == ("x", False)
        return self.pulled


def on_engines_0_and_1(client: FakeController) -> RankChannel:
    """A channel whose ranks 0 and 1 are engines 0 and 1."""
    channel = RankChannel(client)
    channel.bind({0: 0, 1: 1})
    return channel


def test_the_controllers_queues_are_asked_again_while_they_lag_behind_the_clients_results():
    lagging = LaggingController(lag=3)
    assert not on_engines_0_and_1(lagging).settled_busy()[0] and lagging.asked == 4
    awaiting = LaggingController(lag=3, outstanding={"a cell"})  # the client awaits a reply: busy is believed
    assert on_engines_0_and_1(awaiting).settled_busy()[0] and awaiting.asked == 1
    other_client = LaggingController(lag=10**6)  # work of another client shows once the settling time is over
    assert on_engines_0_and_1(other_client).settled_busy(settle_s=0.1)[0]


def test_failure_texts():
    assert failures.describe(failure_of(RemoteError("EngineError", "died"))) == failures.DIED
    assert failures.describe(failure_of(RemoteError("KeyError", "'x'"))) == "KeyError: 'x'"
    assert str(failures.unknown_ranks([5], 2)) == "Rank(s) [5] do not exist: this cluster has ranks 0..1."
    died = failures.ranks_died({1: "exit code 7"}, [0], ["  [1] (nothing)"], "tail")
    assert died.died == {1: "exit code 7"}
    assert str(died).startswith("rank(s) [1] died while running the cell (rank 1: exit code 7; out of memory is "
                                "a common cause). An MPI world cannot go on without a rank, so rank(s) [0] were "
                                "ended too: run %hvd restart")


def test_in_widgets_mode_every_ranks_whole_output_reaches_its_tab(capsys):
    pytest.importorskip("ipywidgets")
    parts = [part("hello\n"), part("from rank 1\n")]
    parts[1].metadata["stderr"] = "\x1b[31mcareful\n"
    parts[1].set_exception(RemoteError("ValueError", "bad shard"))
    parts[1].exception().traceback = "\x1b[0;31mValueError\x1b[0m: bad shard"
    running = RunningCell(FakeCluster(parts), "code", [0, 1], show={0}, timeout=None, mode=DashboardMode.WIDGETS)
    with pytest.raises(failures.RankError):
        running.wait()
    outputs = running.dashboard.outputs
    assert outputs[0].chunks == [("stdout", "hello\n")]
    assert outputs[1].chunks == [("stdout", "from rank 1\n"), ("stderr", "careful\n")]  # (no colour codes)
    assert outputs[1].title == "rank 1 ✗" and outputs[1].details == "ValueError: bad shard"
    assert running.dashboard.tabs is not None and running.dashboard.frozen
    out = capsys.readouterr().out
    assert "[0] hello\n" in out and "[1]" not in out  # the cell's own output is as before: rank 0's lines


def test_outside_widgets_mode_no_output_is_kept_for_tabs():
    parts = [part("hello\n"), part("from rank 1\n")]
    for future in parts:
        future.set_result(None)
    running = RunningCell(FakeCluster(parts), "code", [0, 1], show={0}, timeout=None, mode=DashboardMode.TEXT)
    running.wait()
    assert running.output.copies == [] and running.dashboard.outputs is None
