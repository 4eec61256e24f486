"""What JupyterLab's panel (``hvd_notebook.lab``) sees of this kernel's cluster, and what it may ask of it.

The kernel keeps the cluster's activity (``workdir.Activity``: its ranks, what it does and since when) in
the cluster's owner-only directory, written on each change of state, never per step: a cell starts or ends,
a rank stalls in a collective or stops at a breakpoint, a reset begins. The panel's actions come as request
files beside that directory, in the user's private folder (``workdir.Request``), which only this user can
write; a thread of the kernel
takes them and answers each as the magic would:

- ``interrupt``: the running ``%%hvd`` cell is interrupted as the notebook's stop button does (SIGINT to the
  kernel); nothing happens where no cell runs;
- ``stop``: the running cell interrupted first, then the cluster stopped; the notebook's next ``%%hvd`` (or
  ``%hvd`` command that needs the cluster) says it was stopped from the panel, and when;
- ``restart``: the same, then the cluster started again with the options of the last start; the next cell
  says so once (the ranks' variables are gone: ``%hvd replay``).

"Where is every rank" needs nothing of the kernel: the server asks the ranks themselves (``stacks``).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any, Protocol

from ..cluster.launching.cluster import MPICluster
from ..cluster.processes.pids import interrupt_this_process
from ..cluster.processes.workdir import CELL_ENDS_S, Activity, ActivityState, WorkDir
from ..config import PREFIX

log = logging.getLogger(__name__)

POLL_S = 0.25  # how often the request thread looks for the panel's requests
ACTIONS = ("interrupt", "restart", "stop")


class Host(Protocol):
    """What the link needs of the session that holds it (``session.Session``)."""

    cluster: MPICluster | None
    released: str | None  # why the cluster is gone, for the next command

    def in_use(self, wait: bool = True) -> AbstractContextManager[bool]: ...

    def stop(self) -> bool: ...

    def restart_held(self) -> Any: ...


class PanelLink:
    """This kernel's side of the panel: the activity file of its session's cluster, and the thread taking
    the panel's requests.

    Args:
        session: the kernel's session.
    """

    def __init__(self, session: Host) -> None:
        self.session = session
        self.notice: str | None = None  # what the next cell says first (a restart from the panel)
        self._workdir: WorkDir | None = None
        self._activity: Activity | None = None
        self._lock = threading.Lock()
        self._quit = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------- activity
    def begin(self, cluster: MPICluster) -> None:
        """A cluster started (or restarted): its ranks, idle; requests taken from now on.

        Args:
            cluster: the cluster started.
        """
        if cluster.workdir is None:  # (no directory: nothing the panel could read)
            return
        workdir, ranks = WorkDir(cluster.workdir), cluster.ranks
        activity = Activity(
            kernel=os.getpid(), notebook=os.environ.get("JPY_SESSION_NAME") or None,
            framework=ranks[0].framework if ranks else "", backend=ranks[0].backend if ranks else "",
            ranks=[{"rank": r.rank, "pid": r.pid, "host": r.host, "device": r.device, "here": r.here} for r in ranks],
            state=ActivityState.IDLE, since=time.time(), actions=list(ACTIONS))
        with self._lock:
            self._workdir, self._activity = workdir, None
            self._write(activity)
        if self._thread is None or not self._thread.is_alive():
            self._quit.clear()
            self._thread = threading.Thread(target=self._take_requests, name="hvd-panel-requests", daemon=True)
            self._thread.start()

    def now(self, state: ActivityState, detail: str = "") -> None:
        """The cluster's state changed (the same state again, with the same detail: nothing is written).

        Args:
            state: the cluster's new state.
            detail: a word on it, or "".
        """
        with self._lock:
            current = self._activity
            if current is None or (current.state, current.detail) == (state, detail):
                return
            self._write(current.changed(state, detail))

    def cell_starts(self) -> None:
        """A cell starts: what the panel did since the last one is said first."""
        if self.notice:
            print(f"{PREFIX} {self.notice}", file=sys.stderr, flush=True)
            self.notice = None
        self.now(ActivityState.RUNNING)

    def cell_ends(self) -> None:
        self.now(ActivityState.IDLE)

    @property
    def state(self) -> ActivityState | None:
        """What the cluster does, as last written; None where no cluster runs."""
        return self._activity.state if self._activity is not None else None

    def end(self) -> None:
        """The cluster stopped (its directory goes with it): no more activity."""
        with self._lock:
            self._workdir, self._activity = None, None

    def close(self) -> None:
        """The kernel goes away: the request thread ends."""
        self.end()
        self._quit.set()

    def _write(self, activity: Activity) -> None:
        if self._workdir is None:
            return
        try:
            self._workdir.write_activity(activity)
            self._activity = activity
        except OSError as exc:  # (the directory was removed under us): the panel then shows no cluster
            log.debug("the activity of %s was not written: %s", self._workdir.path, exc)
            self._activity = activity

    # -------------------------------------------------------------- requests
    def _take_requests(self) -> None:
        while not self._quit.wait(POLL_S):
            workdir = self._workdir
            if workdir is None:
                continue
            for request in workdir.pending_requests():
                try:
                    answer = self.answer(request.action)
                except Exception as exc:  # (said to the panel, and logged: the thread must go on)
                    log.exception("the panel's %s request failed", request.action)
                    answer = f"The {request.action} failed: {exc}"
                try:
                    request.reply(answer)
                except OSError as exc:  # (the user's folder went away: the panel's wait ends in its time-out)
                    log.warning("the answer to the panel's %s request was not written: %s", request.action, exc)

    def answer(self, action: str) -> str:
        """Carry out the panel's ``action``; what happened, in a sentence.

        Args:
            action: the panel's request ("stop", "restart", ...).
        """
        running = self.state in ActivityState.cell_states()
        if action == "interrupt":
            if not running:
                return "No %%hvd cell is running: there is nothing to interrupt."
            interrupt_this_process()  # (as the notebook's stop button: the cell ends as it does then)
            return "The running %%hvd cell was interrupted; the notebook shows how it ended."
        if action not in ("stop", "restart"):
            return f"{action!r} is not an action of the panel: use one of {', '.join(ACTIONS)}."
        if running:
            interrupt_this_process()
            deadline = time.monotonic() + CELL_ENDS_S
            while self.state in ActivityState.cell_states() and time.monotonic() < deadline:
                time.sleep(0.1)
        return _on_the_kernels_loop(lambda: self._stop_or_restart(action, running))

    def _stop_or_restart(self, action: str, running: bool) -> str:
        at = time.strftime("%H:%M:%S")
        first = " (its running cell interrupted first)" if running else ""
        with self.session.in_use():
            if self.session.cluster is None:
                return "No cluster is running in that notebook any more."
            if action == "stop":
                self.session.stop()
                self.session.released = (f"The cluster was stopped from the JupyterLab panel at {at}. Run %hvd restart "
                                         "to start it again with the same options, or %hvd start.")
                return f"The cluster was stopped at {at}{first}."
            self.session.restart_held()
            self.notice = (f"The cluster was restarted from the JupyterLab panel at {at}: the ranks' variables "
                                   "are gone (%hvd replay runs the recorded cells again).")
            return f"The cluster was restarted at {at}{first}; the ranks' variables are gone."



def _on_the_kernels_loop(job: Callable[[], str]) -> str:
    """``job``'s answer, run by the kernel's own event loop on its main thread, where the cluster was started
    and its cells run (the rank channel's client and launchers belong to that thread: a restart from another
    thread waits for engines that never register); run here where there is no kernel."""
    try:
        from ipykernel.kernelbase import Kernel

        loop = getattr(Kernel.instance(), "io_loop", None) if Kernel.initialized() else None
    except ImportError:
        loop = None
    if loop is None:
        return job()
    answer: Future[str] = Future()

    def run() -> None:
        try:
            answer.set_result(job())
        except BaseException as exc:  # (said to the panel by the request thread)
            answer.set_exception(exc)

    loop.add_callback(run)
    return answer.result()
