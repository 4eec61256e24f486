"""One session per notebook kernel: owns the cluster, runs ``%%hvd`` cells on
the ranks (``cell.RunningCell``), and copies variables to and from them."""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from ..cluster import ClusterError, ClusterOptions
from ..cluster.cluster import MPICluster
from ..cluster.resets import run_with_resets
from ..cluster.world import RankInfo
from ..config import DashboardMode
from ..dashboard import Dashboard, resolve_mode
from ..private import UnsafePathError
from . import failures
from .cell import ControllerSilent, RankValue, RunningCell, answer, is_busy, queue_status, settled_queue_status
from .failures import CellTimeout, HvdError, NoClusterError, RankDied, RankError
from .recovery import ElasticCommits, RecordedCell, replay
from .tenancy import Tenancy, released_message

__all__ = ["CellTimeout", "HvdError", "NoClusterError", "RankDied", "RankError", "RankValue", "RecordedCell",
           "Session"]

log = logging.getLogger(__name__)


@dataclass
class _Runs:
    """What the runs of one cell share: the dashboard (a cell resumed after dead ranks goes on with it), and
    rank 0's last ``hvd.elastic`` commit in any of them (its summary; None: none, or its run returned)."""

    dashboard: Dashboard | None = None
    commit: str | None = None


class Session:
    """The notebook kernel's view of its cluster. Get it with ``Session.get()``."""

    _instance: Session | None = None

    def __init__(self) -> None:
        self.cluster: MPICluster | None = None
        self.options: ClusterOptions | None = None
        self.history: list[RecordedCell] = []  # what a replay runs on a new world (``replay``)
        self._engine_progress: tuple[int, bool] | None = None  # (id of the client, progress on)
        self.commits = ElasticCommits()  # rank 0's last hvd.elastic commit: a cell resumes from it
        self.tenancy = Tenancy(self._release)  # the node's card of the cluster; stops it when its time is up
        self.released: str | None = None  # why the node's rules stopped the cluster, for the next command
        self.failed_ranks: list[int] = []  # the ranks that raised in the last cell that failed (%hvd debug)
        self._lock = threading.RLock()  # held by every command that uses the cluster (``in_use``)
        atexit.register(self.shutdown)

    @classmethod
    def get(cls) -> Session:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    # ------------------------------------------------------------- lifecycle
    def start(self, options: ClusterOptions, restart: bool = False) -> list[RankInfo]:
        """Start a cluster (replacing a running one with ``restart``); its ranks."""
        if self.cluster is not None:
            if not restart:
                raise HvdError(
                    f"A cluster of {self.cluster.n} ranks is already running. Run %hvd stop "
                    "first, or %hvd start --restart ... to replace it."
                )
            self.stop()
        self.commits.forget()  # (a fresh start: nothing before it is resumed)
        try:
            cluster = MPICluster(replace(options, env=(*options.env, self.commits.environment())))
            cluster.start()
        except (ClusterError, UnsafePathError) as exc:  # (no private folder could be had)
            raise HvdError(f"The cluster did not start: {exc}") from None
        self.cluster, self.options, self.history, self.released = cluster, options, [], None
        self.failed_ranks = []
        self._announce(cluster)
        return cluster.ranks

    def _announce(self, cluster: MPICluster, restarted: bool = False) -> None:
        """The node's card of the cluster (a restart keeps the start time its lease counts from)."""
        self.tenancy.begin(cluster.workdir, cluster.n, cluster.gpus, cluster.rules, keep_start=restarted)

    @contextmanager
    def in_use(self) -> Iterator[None]:
        """Hold the cluster for a command: the release watch waits until it ends."""
        with self._lock:
            yield

    def _release(self, why: str) -> bool:
        """The node's rules stop the cluster (from the watch's thread): False where it is in use."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            cluster = self.cluster
            if cluster is None:
                return True
            gpus = list(cluster.gpus)
            self.stop()
            self.released = released_message(why, time.time(), gpus)
            log.warning("hvd cluster stopped by the node's rules: %s", why)
            return True
        finally:
            self._lock.release()

    def restart(self) -> list[RankInfo]:
        """Start again with the options of the last start (the recorded cells are kept for ``replay``)."""
        with self.in_use():
            return self._restart()

    def _restart(self) -> list[RankInfo]:
        if self.options is None:
            raise HvdError("Nothing to restart: no cluster was started in this kernel. Run %hvd start.")
        history = self.history
        if self.cluster is None:  # lost (a restart after an interrupt failed), or released: start afresh
            ranks = self.start(self.options)
        else:
            try:
                ranks = self.cluster.restart()  # promotes its warm standby where it has one
            except ClusterError as exc:
                self.cluster = None
                self.tenancy.end()
                raise HvdError(f"The cluster did not restart: {exc}") from None
            self._announce(self.cluster, restarted=True)
        self.history = history
        return ranks

    def replay(self, say: Callable[[str], None] = print) -> int:
        """Run the recorded cells again, in order, on the ranks of now (after a restart, which lost
        every rank's variables): without output or dashboard, a line each through ``say``. A cell
        that fails stops the replay with an error naming it. The number of cells replayed."""
        with self.in_use():
            self.require()
            try:
                return self._replay(say)
            except BaseException:
                self.commits.forget()
                raise

    def _replay(self, say: Callable[[str], None]) -> int:
        """``replay`` under the lock its caller holds: each cell once, as it was recorded (no resets, no
        change to the node's card: the cluster is in use until the command that replays ends)."""
        def run(recorded: RecordedCell) -> None:
            outcome = self._run_once(recorded.code, recorded.ranks, [], recorded.timeout, DashboardMode.NONE)
            if isinstance(outcome, RankDied):
                raise outcome

        return replay(list(self.history), run, say)

    def fresh_world(self, n: int, keep: bool = False) -> list[RankInfo]:
        """A fresh world of ``n`` ranks with the recorded set-up cells replayed on it, quietly (a point of a
        ``%%hvd sweep``): the running cluster restarted (its warm standby promoted) where it has ``n``
        ranks (``keep``: kept as it is, the set-up cells replayed on it: the end of a sweep), else a cluster
        of ``n`` started in its place; returns once its new standby, if any, has started. What the last
        ``%hvd start`` asked for and the recorded cells stay as they were."""
        with self.in_use():
            options, history = self.options, self.history
            if options is None:
                raise failures.no_cluster()
            if self.cluster is not None and self.cluster.n == n:
                ranks = self.cluster.ranks if keep else self._restart()
            else:
                self.stop()
                try:
                    ranks = self.start(replace(options, n=n))
                finally:
                    self.options, self.history = options, history
            self._replay(say=lambda line: None)
            self.require().settle(options.timeout)  # (a standby starting beside the point would slow its ranks)
            return ranks

    def stop(self) -> bool:
        """Stop the cluster; False when none was running."""
        cluster, self.cluster = self.cluster, None
        self.released = None
        if cluster is None:
            return False
        try:
            cluster.stop()
        finally:
            self.tenancy.end()
        return True

    def shutdown(self) -> None:
        """atexit: the kernel is going away; leave nothing behind."""
        try:
            self.stop()
        except Exception:  # never let clean-up raise at interpreter exit
            log.exception("stopping the hvd cluster at exit failed")
        self.commits.remove()

    def require(self) -> MPICluster:
        """The running cluster, or NoClusterError."""
        if self.cluster is None:
            raise NoClusterError(self.released) if self.released else failures.no_cluster()
        return self.cluster

    # ----------------------------------------------------------------- cells
    def run_cell(
        self,
        code: str,
        ranks: list[int] | None = None,
        output_ranks: list[int] | None = None,
        timeout: float | None = None,
        progress: str | None = DashboardMode.AUTO,
        record: bool = True,
    ) -> RankValue | None:
        """Run ``code`` on the ranks (all by default) at once; stream output; fail
        on the first rank that raises; return rank 0's value of the last expression.
        ``progress`` is the dashboard's mode (``config.DashboardMode``); ``record``: a cell that
        completes is replayed by ``replay`` (``%%hvd --no-replay`` turns it off). The node's card
        says the cluster is busy meanwhile; where its lease ran out during the cell, it stops after."""
        with self.busy():
            try:
                return self._run_cell(code, ranks, output_ranks, timeout, progress, record)
            except RankError as exc:
                self.failed_ranks = exc.ranks
                raise

    def debug_rank(self, rank: int | None) -> int:
        """The rank ``%hvd debug`` opens: ``rank``, or the first that raised in the last cell that failed."""
        cluster = self.require()
        if rank is None:
            if not self.failed_ranks:
                raise HvdError("No %%hvd cell has raised on a rank of this cluster: %hvd debug opens pdb where one "
                               "did (name a rank with --rank R).")
            rank = self.failed_ranks[0]
        if rank not in [r.rank for r in cluster.ranks]:
            raise failures.unknown_ranks([rank], cluster.n)
        return rank

    @contextmanager
    def busy(self) -> Iterator[MPICluster]:
        """Hold the running cluster for a cell (or a sweep): the node's card says it is busy meanwhile;
        where its lease ran out, it stops after."""
        with self.in_use():
            cluster = self.require()
            self.tenancy.cell(busy=True)
            try:
                yield cluster
            finally:
                self.tenancy.cell(busy=False)
                why = self.tenancy.due()
                if why is not None and self._release(why):
                    print(f"[hvd_notebook] {self.released}", file=sys.stderr, flush=True)

    def run_measured(self, code: str, dashboard: Dashboard, timeout: float | None = None) -> None:
        """Run ``code`` once on every rank with its progress into ``dashboard`` (a point of a ``%%hvd
        sweep``): no rank's output shown, not recorded for replay, not resumed; its failure raised."""
        with self.in_use():
            outcome = self._run_once(code, None, [], timeout, dashboard.mode, _Runs(dashboard))
        if isinstance(outcome, RankDied):
            raise outcome

    def _run_cell(self, code: str, ranks: list[int] | None, output_ranks: list[int] | None,
                  timeout: float | None, progress: str | None, record: bool) -> RankValue | None:
        """``run_cell`` under its lock: the cell, and where its ranks die in an ``hvd.elastic.run`` that
        committed since the cell began, the cell again on a new world (``_reset``), which resumes from the
        commit, up to ``--max-resets`` times (``resets.run_with_resets``, the loop ``hvd-notebook run``
        runs too). Every run of the cell draws on one dashboard."""
        try:
            mode = resolve_mode(progress)
        except ValueError as exc:
            raise HvdError(str(exc)) from None
        runs = _Runs()

        def resumable(outcome: RankValue | RankDied | None) -> bool:
            return isinstance(outcome, RankDied) and runs.commit is not None

        try:
            outcome, resets = run_with_resets(
                lambda: self._run_once(code, ranks, output_ranks, timeout, mode, runs, record), resumable,
                lambda died, number: self._reset(died, number, runs), self._max_resets())
        except BaseException:  # (a failed reset too)
            self._cell_ended(runs)
            raise
        if isinstance(outcome, RankDied):
            self._cell_ended(runs)
            if resets and resumable(outcome):
                raise RankDied(f"{outcome}\nThe cell was resumed {len(resets)} time(s) already, as many as "
                               f"--max-resets {self._max_resets()} allows:\n" + "\n".join(resets),
                               outcome.died) from None
            raise outcome
        return outcome

    def _cell_ended(self, runs: _Runs) -> None:
        """A cell failed: its dashboard's summary, and no later cell may resume from its commit."""
        if runs.dashboard is not None:
            runs.dashboard.finish()  # (a run's own failures finish it already; ranks that died do not)
        self.commits.forget()

    def _run_once(self, code: str, ranks: list[int] | None, output_ranks: list[int] | None,
                  timeout: float | None, mode: DashboardMode, runs: _Runs | None = None,
                  record: bool = False) -> RankValue | RankDied | None:
        """One run of a cell on the world of now: rank 0's value, or the ``RankDied`` of ranks that died
        (other failures raise). ``runs``: the dashboard earlier runs of the same cell drew on; ``record``:
        a run that completes is recorded for ``replay``."""
        cluster = self.require()
        all_ranks = [r.rank for r in cluster.ranks]
        ranks = all_ranks if ranks is None else ranks  # (a resumed cell may have fewer ranks: None is all)
        unknown = sorted(set(ranks) - set(all_ranks)) + sorted(set(output_ranks or []) - set(all_ranks))
        if unknown:
            raise failures.unknown_ranks(unknown, len(all_ranks))
        dead = [r for r, ok in cluster.alive().items() if not ok]
        if dead:
            raise failures.dead_before_cell(dead)
        show = set(ranks[:1] if 0 not in ranks else [0]) if output_ranks is None else set(output_ranks)
        self._set_engine_progress(cluster, mode != DashboardMode.NONE)
        running = RunningCell(cluster, code, ranks, show, timeout, mode, runs.dashboard if runs else None)
        if runs is not None:
            runs.dashboard = running.dashboard
        try:
            value = running.wait()
        except RankDied as died:
            return died
        finally:
            if runs is not None and running.commits:  # a commit in this cell; the events can be a step behind
                # the one on disk (rank 0 ended before its last event left), which is what a new world resumes from
                runs.commit = running.commits[-1] and (self.commits.summary() or running.commits[-1]) or None
            if running.cluster_lost:
                self.cluster = None
                self.tenancy.end()
        if record:
            self.history.append(RecordedCell(code, None if ranks == all_ranks else list(ranks), timeout))
        return value

    def _max_resets(self) -> int:
        """How often one cell under ``hvd.elastic.run`` is resumed after dead ranks (``--max-resets``)."""
        return self.options.max_resets if self.options is not None else 0

    def _reset(self, died: RankDied, reset: int, runs: _Runs) -> str:
        """After a dead rank, in a cell under ``hvd.elastic.run`` that committed: a new world, the
        set-up cells replayed, the event on the cell's dashboard; the loop then runs the cell again,
        whose ``hvd.elastic.run`` resumes from the commit. A line on this reset, for the history."""
        commit, dashboard = runs.commit, runs.dashboard
        first = str(died).splitlines()[0]
        print(f"[hvd_notebook] {first}\n[hvd_notebook] hvd.elastic: restarting the world, replaying the set-up "
              f"cells and resuming from the last commit ({commit}): reset {reset} of {self._max_resets()}.",
              file=sys.stderr, flush=True)
        try:
            self._restart()
            self._replay(say=lambda line: print(f"[hvd_notebook] {line}", file=sys.stderr, flush=True))
        except HvdError as exc:
            raise RankDied(f"{died}\nThe hvd.elastic resume failed: {exc}", died.died) from None
        if dashboard is not None:
            dashboard.reset(died.died, commit, [r.rank for r in self.require().ranks])
        how = "; ".join(f"rank {r}: {how or 'ended'}" for r, how in sorted(died.died.items()))
        return f"  reset {reset}: {how}; resumed from the last commit ({commit})"

    def _set_engine_progress(self, cluster: MPICluster, enabled: bool) -> None:
        """Turn the ranks' progress callback on or off (``%%hvd --no-progress``) when
        it changes; queued ahead of the cell on each engine, so no round trip."""
        client_id = id(cluster.client)
        known = self._engine_progress
        current = known[1] if known and known[0] == client_id else True  # fresh engines start with it on
        if enabled != current:
            from ..engine import reporter

            cluster.client[cluster.engine_ids()].apply_async(reporter.set_enabled, enabled)
        self._engine_progress = (client_id, enabled)

    def ask_idle(self, func: Callable[..., Any], *args: Any, timeout: float) -> Any:
        """``func(*args)`` on rank 0 (completion and inspection in ``%%hvd`` cells), only while nothing uses the
        cluster: None at once where a command holds it (a cell runs) or requests are pending, and None where
        no answer came within ``timeout`` seconds (the request then runs when rank 0 gets to it) or ``func``
        raised. ``func`` must not return None."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            cluster = self.cluster
            if cluster is None or cluster.client.outstanding:  # (the kernel's own requests not answered yet)
                return None
            engine = cluster.engine_ids([0])[0]
            if is_busy(queue_status(cluster.client, [engine], timeout).get(engine)):  # (other clients' too)
                return None
            return cluster.client[engine].apply_async(func, *args).get(timeout=timeout)
        except Exception as exc:  # (ipyparallel's TimeoutError, a RemoteError, a controller gone)
            log.debug("rank 0 did not answer %s: %s", getattr(func, "__name__", func), exc)
            return None
        finally:
            self._lock.release()

    # ------------------------------------------------------------- transfers
    def pull(self, name: str, rank: int = 0) -> Any:
        """The value of ``name`` on ``rank``."""
        cluster = self.require()
        if rank not in [r.rank for r in cluster.ranks]:
            raise HvdError(f"--rank {rank} does not exist: this cluster has ranks 0..{cluster.n - 1}.")
        try:
            return answer(cluster.client, cluster.client[cluster.engine_ids([rank])[0]].pull(name, block=False))
        except ControllerSilent as exc:
            raise HvdError(f"Pulling {name!r} from rank {rank} failed: {exc}.") from None
        except Exception as exc:
            ename = getattr(exc, "ename", type(exc).__name__)
            if ename == "NameError":
                raise HvdError(f"Rank {rank} has no variable named {name!r}.") from None
            raise HvdError(f"Pulling {name!r} from rank {rank} failed: {ename}: "
                           f"{getattr(exc, 'evalue', exc)}") from None

    def push(self, name: str, value: Any) -> None:
        """Set ``name`` to ``value`` on every rank."""
        cluster = self.require()
        try:
            answer(cluster.client, cluster.client[cluster.engine_ids()].push({name: value}, block=False))
        except ControllerSilent as exc:
            raise HvdError(f"Pushing {name!r} to the ranks failed: {exc}.") from None
        except Exception as exc:
            raise HvdError(f"Pushing {name!r} to the ranks failed: {type(exc).__name__}: {exc}. "
                           "The object must be picklable.") from None

    def status(self) -> list[dict[str, Any]]:
        """One row per rank: alive or dead, host, pid, device, memory (host, and GPU
        where the ranks have GPUs), what it runs."""
        import psutil

        cluster = self.require()
        alive = cluster.alive()
        queues: dict[Any, Any] | None
        try:
            if not cluster.controller_routes():
                raise ControllerSilent(failures.CONTROLLER_ENDED)
            queues = settled_queue_status(cluster.client)
        except ControllerSilent as exc:  # (what each rank runs is then unknown; the rest is asked of the OS)
            print(f"[hvd_notebook] {exc}", file=sys.stderr, flush=True)
            queues = None
        except Exception:
            queues = {}
        from ..cluster.gpus import gpu_memory_by_pid

        gpu_memory = gpu_memory_by_pid() if cluster.gpus else {}
        rows = []
        for r in cluster.ranks:
            rss = None
            if alive[r.rank] and r.here:
                try:
                    rss = psutil.Process(r.pid).memory_info().rss
                except psutil.NoSuchProcess:
                    alive[r.rank] = False
            rows.append({
                "rank": r.rank, "state": "alive" if alive[r.rank] else "dead", "host": r.host,
                "pid": r.pid, "device": r.device, "rss": rss,
                "gpu_memory": gpu_memory.get(r.pid) if r.here else None,  # another host's pid is not ours
                "running": "dead" if not alive[r.rank] else "unknown" if queues is None
                else "busy" if is_busy(queues.get(r.engine_id)) else "idle",
            })
        return rows
