"""One session per notebook kernel: owns the cluster, runs ``%%hvd`` cells on
the ranks, streams their output, and turns remote failures into clear errors."""

from __future__ import annotations

import atexit
import logging
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any

from ..cluster import ClusterError, ClusterOptions, MPICluster, RankInfo
from ..dashboard import Progress, resolve_mode

log = logging.getLogger(__name__)

POLL_S = 0.02  # how often a running cell's output is forwarded (results wake the loop at once)
LIVENESS_S = 0.5  # how often a running cell checks that its ranks' processes exist
INTERRUPT_GRACE_S = 3.0  # how long interrupted ranks get before the MPI world is restarted


_DIED = "the rank's process died"  # what a dead rank's bar says on the dashboard
_INTERRUPTED = "They were interrupted; their variables are kept and the cluster is ready."


class HvdError(Exception):
    """An error to show the user as its message alone, without a kernel-side traceback."""

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self}"]


class NoClusterError(HvdError):
    pass


class RankError(HvdError):
    """A ``%%hvd`` cell failed on one or more ranks; carries the first failure's traceback."""

    def __init__(self, message: str, remote_traceback: list[str], outcomes: list[str]):
        super().__init__(message)
        self.remote_traceback = remote_traceback
        self.outcomes = outcomes

    def _render_traceback_(self) -> list[str]:
        return (
            [f"\x1b[0;31mRankError\x1b[0m: {self.args[0]}"]
            + self.remote_traceback
            + ["", "Outcome on each rank:"]
            + [f"  {line}" for line in self.outcomes]
        )


class CellTimeout(HvdError):
    pass


class RankDied(HvdError):
    pass


@dataclass
class RankValue:
    """The value of a cell's last expression on rank 0, shown like a normal cell's."""

    data: dict[str, Any]
    metadata: dict[str, Any]

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> tuple[dict, dict]:
        return self.data, self.metadata

    def __repr__(self) -> str:
        return str(self.data.get("text/plain", ""))


RUNTIME_WARNING = "[hvd_notebook] WARNING"  # the runtime's warnings (stalls) are shown from every rank


class _Stream:
    """Forwards one rank's accumulated stdout or stderr, a complete line at a time,
    each line prefixed with the rank; with ``only``, just the lines containing it."""

    def __init__(self, rank: int, name: str, write: Callable[[str], Any], only: str | None = None):
        self.prefix = f"[{rank}] "
        self.name = name
        self.write = write
        self.only = only
        self.sent = 0

    def update(self, text: str, final: bool = False) -> None:
        if len(text) < self.sent:  # ipyparallel collapsed a '\r' line: resend from its start
            self.sent = text.rfind("\n", 0, len(text)) + 1
        end = len(text) if final else text.rfind("\n") + 1
        if end <= self.sent:
            return
        chunk = text[self.sent:end]
        self.sent = end
        lines = chunk.splitlines(keepends=True)
        if self.only is not None:
            lines = [line for line in lines if self.only in line]
            if not lines:
                return
        text = "".join(self.prefix + line for line in lines)
        self.write(text if text.endswith("\n") else text + "\n")


class Session:
    """The notebook kernel's view of its cluster. Get it with ``Session.get()``."""

    _instance: Session | None = None

    def __init__(self) -> None:
        self.cluster: MPICluster | None = None
        self.options: ClusterOptions | None = None
        self._engine_progress: tuple[int, bool] | None = None  # (id of the client, progress on)
        self.last_progress: Progress | None = None  # the dashboard of the last cell, for tests
        atexit.register(self.shutdown)

    @classmethod
    def get(cls) -> Session:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    # ------------------------------------------------------------- lifecycle
    def start(self, options: ClusterOptions, restart: bool = False) -> list[RankInfo]:
        if self.cluster is not None:
            if not restart:
                raise HvdError(
                    f"A cluster of {self.cluster.n} ranks is already running. Run %hvd stop "
                    "first, or %hvd start --restart ... to replace it."
                )
            self.stop()
        try:
            cluster = MPICluster(options)
            cluster.start()
        except ClusterError as exc:
            raise HvdError(f"The cluster did not start: {exc}") from None
        self.cluster, self.options = cluster, options
        return cluster.ranks

    def restart(self) -> list[RankInfo]:
        if self.options is None:
            raise HvdError("Nothing to restart: no cluster was started in this kernel. Run %hvd start.")
        return self.start(self.options, restart=True)

    def stop(self) -> bool:
        """Stop the cluster; False when none was running."""
        cluster, self.cluster = self.cluster, None
        if cluster is None:
            return False
        cluster.stop()
        return True

    def shutdown(self) -> None:
        """atexit: the kernel is going away; leave nothing behind."""
        try:
            self.stop()
        except Exception:  # never let clean-up raise at interpreter exit
            log.exception("stopping the hvd cluster at exit failed")

    def require(self) -> MPICluster:
        if self.cluster is None:
            raise NoClusterError("No cluster is running. Start one with %hvd start (e.g. %hvd start -n 2).")
        return self.cluster

    # ----------------------------------------------------------------- cells
    def run_cell(
        self,
        code: str,
        ranks: list[int] | None = None,
        output_ranks: list[int] | None = None,
        timeout: float | None = None,
        progress: str | None = "auto",
    ) -> RankValue | None:
        """Run ``code`` on the ranks (all by default) at once; stream output; fail
        on the first rank that raises; return rank 0's value of the last expression.
        ``progress`` is the dashboard's mode (``dashboard.MODES``)."""
        try:
            mode = resolve_mode(progress)
        except ValueError as exc:
            raise HvdError(str(exc)) from None
        cluster = self.require()
        all_ranks = [r.rank for r in cluster.ranks]
        ranks = all_ranks if ranks is None else ranks
        unknown = sorted(set(ranks) - set(all_ranks)) + sorted(set(output_ranks or []) - set(all_ranks))
        if unknown:
            raise HvdError(
                f"Rank(s) {unknown} do not exist: this cluster has ranks 0..{len(all_ranks) - 1}."
            )
        dead = [r for r, ok in cluster.alive().items() if not ok]
        if dead:
            raise RankDied(f"Rank(s) {dead} of this cluster are dead. Run %hvd restart for a fresh cluster "
                           "of the same shape (every rank's variables are lost).")
        show = set(ranks[:1] if 0 not in ranks else [0]) if output_ranks is None else set(output_ranks)
        client = cluster.client
        self._set_engine_progress(cluster, mode != "none")
        ar = client[cluster.engine_ids(ranks)].execute(code, silent=False, block=False)
        # ipyparallel drops its client-side records of a request once its output is
        # complete; the AsyncResult keeps its own references to them.
        requests = [_Request(rank, future, md) for rank, future, md in zip(ranks, ar._children, ar._metadata)]
        streams = [
            (req, _Stream(req.rank, name, getattr(sys, name).write))
            for req in requests if req.rank in show for name in ("stdout", "stderr")
        ] + [
            (req, _Stream(req.rank, "stderr", sys.stderr.write, only=RUNTIME_WARNING))
            for req in requests if req.rank not in show
        ]
        deadline = None if timeout is None else time.monotonic() + timeout
        next_liveness_check = time.monotonic() + LIVENESS_S
        board = self.last_progress = Progress(mode, ranks) if mode != "none" else None

        def pump(final: bool = False) -> None:
            if board is not None:
                board.poll({req.rank: req.md["data"] for req in requests}, force=final)
            for req, stream in streams:
                stream.update(req.md[stream.name] or "", final)
            for req in requests:
                if req.rank in show:
                    outputs = req.md["outputs"]
                    for out in outputs[req.displayed:]:
                        _publish(out)
                    req.displayed = len(outputs)

        try:
            return self._wait_cell(ar, requests, ranks, pump, board, deadline, next_liveness_check, timeout)
        finally:
            if board is not None:
                board.finish()

    def _wait_cell(self, ar: Any, requests: list[_Request], ranks: list[int], pump: Callable[..., None],
                   board: Progress | None, deadline: float | None, next_liveness_check: float,
                   timeout: float | None) -> RankValue | None:
        cluster = self.require()
        try:
            while True:
                pending = [req.future for req in requests if not req.done]
                if pending:  # wakes as soon as a rank finishes, else after POLL_S to stream output
                    futures_wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
                now = time.monotonic()
                for req in requests:
                    if req.finished_at is None and req.done:
                        req.finished_at = now
                failed = sorted((req for req in requests if req.error is not None), key=lambda r: r.finished_at)
                pump()
                if failed or all(req.done for req in requests):
                    break
                if time.monotonic() > next_liveness_check:
                    next_liveness_check = time.monotonic() + LIVENESS_S
                    dead = [r for r, ok in cluster.alive().items() if not ok and r in ranks]
                    if dead:
                        pump(final=True)
                        if board is not None:
                            for rank in dead:
                                board.fail(rank, _DIED)
                        raise self._ranks_died(dead, requests)
                if deadline is not None and time.monotonic() > deadline:
                    running = [req.rank for req in requests if not req.done]
                    note = self._stop_ranks(running)
                    pump(final=True)
                    raise CellTimeout(
                        f"The cell did not finish within --timeout {timeout:g} s; rank(s) "
                        f"{running} were still running. {note or _INTERRUPTED}"
                    )
        except KeyboardInterrupt:
            running = [req.rank for req in requests if not req.done]
            note = self._stop_ranks(running)
            pump(final=True)
            print(f"Rank(s) {running} were still running. {note or _INTERRUPTED}", file=sys.stderr)
            raise

        died = [req for req in failed if _is_engine_death(req.error)]
        if board is not None:
            for req in failed:
                board.fail(req.rank, _DIED if _is_engine_death(req.error) else
                           f"{getattr(req.error, 'ename', type(req.error).__name__)}: "
                           f"{getattr(req.error, 'evalue', req.error)}")
        if died:
            pump(final=True)
            # MPI ends the other ranks when one dies: name the one(s) that died first
            raise self._ranks_died([req.rank for req in died if req.finished_at == died[0].finished_at],
                                   requests)
        if failed:
            first = failed[0]
            time.sleep(0.2)  # let near-simultaneous failures on other ranks arrive
            running = [req.rank for req in requests if not req.done]
            note = self._stop_ranks(running)
            ar.wait_for_output(1.0)
            pump(final=True)
            raise _rank_error(requests, first, running, note)

        ar.wait_for_output(5.0)  # results can overtake the last lines of output
        pump(final=True)
        if 0 in ranks:
            result = requests[ranks.index(0)].md["execute_result"]
            if result:
                return RankValue(result["data"], result.get("metadata", {}))
        return None

    def _set_engine_progress(self, cluster: MPICluster, enabled: bool) -> None:
        """Turn the ranks' progress callback on or off (``%%hvd --no-progress``) when
        it changes; queued ahead of the cell on each engine, so no round trip."""
        client_id = id(cluster.client)
        known = self._engine_progress
        current = known[1] if known and known[0] == client_id else True  # fresh engines start with it on
        if enabled != current:
            from ..engine import progress

            cluster.client[cluster.engine_ids()].apply_async(progress.set_enabled, enabled)
        self._engine_progress = (client_id, enabled)

    def _ranks_died(self, dead: list[int], requests: list[_Request]) -> RankDied:
        """A rank's process is gone (os._exit, a signal, out of memory); MPI cannot
        go on without it, so the user is told to restart."""
        cluster = self.require()
        # An MPI world cannot go on without a rank: end the others too, so that none
        # stays blocked in a collective, and let mpiexec report how each one ended.
        cluster.end_world()
        deadline = time.monotonic() + 3.0
        while not all(r in (ended := cluster.exit_reports()) for r in dead) and time.monotonic() < deadline:
            time.sleep(0.1)  # mpiexec's last words reach its log a moment after it exits
        mpiexec_tail = cluster.mpiexec_output_tail()
        others = [req.rank for req in requests if req.rank not in dead]
        how = "; ".join(f"rank {r}: {ended[r]}" for r in dead if r in ended)
        last_lines = []
        for req in requests:
            if req.rank in dead:
                printed = ((req.md["stdout"] or "") + (req.md["stderr"] or "")).strip().splitlines()[-5:]
                last_lines += [f"  [{req.rank}] {line}" for line in printed] or [f"  [{req.rank}] (nothing)"]
        return RankDied(
            f"rank(s) {dead} died while running the cell ({how or 'the process exited or was killed'}; "
            "out of memory is a common cause). An MPI world cannot go on without a rank"
            + (f", so rank(s) {others} were ended too" if others else "") + ": run "
            "%hvd restart for a fresh cluster of the same shape, then re-run your set-up cells. "
            "%hvd status shows which ranks are dead.\nLast lines the rank(s) printed:\n" + "\n".join(last_lines)
            + "\nLast lines of mpiexec's output:\n" + mpiexec_tail
        )

    def _stop_ranks(self, ranks: list[int]) -> str:
        """Interrupt ranks still running; a rank stuck in an MPI collective ignores
        SIGINT, so after a grace period restart the whole MPI world. Returns a note."""
        if not ranks:
            return ""
        cluster = self.require()
        client = cluster.client
        targets = cluster.engine_ids(ranks)
        try:
            client.send_signal(signal.SIGINT, targets=targets, block=True)
        except Exception:
            log.debug("send_signal failed", exc_info=True)
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        while time.monotonic() < deadline:
            busy = [eid for eid, q in client.queue_status(targets=targets).items()
                    if isinstance(q, dict) and q.get("tasks", 0) + q.get("queue", 0) > 0]
            if not busy:
                return ""
            time.sleep(0.1)
        try:
            cluster.restart()
        except ClusterError as exc:
            self.cluster = None
            return (f"Rank(s) {ranks} did not respond to an interrupt (blocked in a collective?) "
                    f"and restarting the engines failed: {exc}. Run %hvd restart.")
        return (f"Rank(s) {ranks} did not respond to an interrupt (blocked in a collective?), so "
                "the MPI world was restarted: every rank's variables are lost; re-run your "
                "set-up cells.")

    # ------------------------------------------------------------- transfers
    def pull(self, name: str, rank: int = 0) -> Any:
        cluster = self.require()
        if rank not in [r.rank for r in cluster.ranks]:
            raise HvdError(f"--rank {rank} does not exist: this cluster has ranks 0..{cluster.n - 1}.")
        try:
            return cluster.client[cluster.engine_ids([rank])[0]].pull(name, block=True)
        except Exception as exc:
            ename = getattr(exc, "ename", type(exc).__name__)
            if ename == "NameError":
                raise HvdError(f"Rank {rank} has no variable named {name!r}.") from None
            raise HvdError(f"Pulling {name!r} from rank {rank} failed: {ename}: "
                           f"{getattr(exc, 'evalue', exc)}") from None

    def push(self, name: str, value: Any) -> None:
        cluster = self.require()
        try:
            cluster.client[cluster.engine_ids()].push({name: value}, block=True)
        except Exception as exc:
            raise HvdError(f"Pushing {name!r} to the ranks failed: {type(exc).__name__}: {exc}. "
                           "The object must be picklable.") from None

    def status(self) -> list[dict[str, Any]]:
        """One row per rank: alive or dead, host, pid, device, memory (host, and GPU
        where the ranks have GPUs), what it runs."""
        import psutil

        cluster = self.require()
        alive = cluster.alive()
        try:
            queues = cluster.client.queue_status()
        except Exception:
            queues = {}
        from ..cluster.cluster import gpu_memory_by_pid

        gpu_memory = gpu_memory_by_pid() if cluster.gpus else {}
        rows = []
        for r in cluster.ranks:
            rss = None
            if alive[r.rank] and r.here:
                try:
                    rss = psutil.Process(r.pid).memory_info().rss
                except psutil.NoSuchProcess:
                    alive[r.rank] = False
            q = queues.get(r.engine_id, {})
            busy = isinstance(q, dict) and q.get("tasks", 0) + q.get("queue", 0) > 0
            rows.append({
                "rank": r.rank, "state": "alive" if alive[r.rank] else "dead", "host": r.host,
                "pid": r.pid, "device": r.device, "rss": rss,
                "gpu_memory": gpu_memory.get(r.pid) if r.here else None,  # another host's pid is not ours
                "running": ("dead" if not alive[r.rank] else "busy" if busy else "idle"),
            })
        return rows


@dataclass
class _Request:
    """One rank's part of a cell: its reply future and ipyparallel's record of its output."""

    rank: int
    future: Any
    md: dict[str, Any]
    displayed: int = 0  # how many of its rich outputs were shown
    finished_at: float | None = None  # when the session first saw it finished

    @property
    def done(self) -> bool:
        return self.future.done()

    @property
    def error(self) -> Any:
        """The RemoteError this rank's request ended with, or None."""
        if not self.future.done():
            return None
        # ipyparallel resolves a failed execute with the error as its result
        result = self.future.exception() or self.future.result()
        return result if isinstance(result, BaseException) else None


def _is_engine_death(error: Any) -> bool:
    from ipyparallel.error import EngineError

    # raised in this process when the nanny reports a death, or relayed as a RemoteError
    return isinstance(error, EngineError) or getattr(error, "ename", None) == "EngineError"


def _rank_error(requests: list[_Request], first: _Request, running: list[int], note: str) -> RankError:
    outcomes = []
    for req in requests:
        if req.rank in running:
            outcomes.append(f"rank {req.rank}: was still running; interrupted")
        elif req.error is not None:
            outcomes.append(f"rank {req.rank}: raised {req.error.ename}: {req.error.evalue}")
        else:
            outcomes.append(f"rank {req.rank}: finished")
    if note:
        outcomes.append(note)
    tb = getattr(first.error, "traceback", None) or []
    return RankError(
        f"rank {first.rank} raised {first.error.ename}: {first.error.evalue}",
        tb.splitlines() if isinstance(tb, str) else list(tb),
        outcomes,
    )


def _publish(output: dict) -> None:
    from IPython.display import publish_display_data

    publish_display_data(output.get("data", {}), output.get("metadata", {}))
