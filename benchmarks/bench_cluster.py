"""Cluster benchmark: what ``%hvd`` costs on top of plain ipyparallel.

What is measured, side by side in one process and one IPython shell:

1. Start to ready. ``%hvd start -n 2`` (controller + 2 MPI engines via mpiexec,
   each engine bootstrapped) and a cell that imports TensorFlow (CPU ranks import
   it with the first cell that uses it) against plain
   ipyparallel doing the same work: ``ipp.Cluster(engines="mpi", n=2)
   .start_and_connect_sync()`` then ``import tensorflow`` on every engine.
   Target: hvd within 1.2x.
2. Round trip of an empty cell (body ``pass``: IPython rejects a truly empty
   body for these magics). ``%%hvd`` against ``%%px`` (blocking view on
   all engines, as ``start_and_connect(activate=True)`` makes it), both run
   through ``shell.run_cell`` like a notebook does. Target: hvd median within
   1.5x; p90 is shown for information.

Why this way: the machine may have only 2 cores, so the two systems never run
at the same time. Each round starts one system, times its cells, stops it
fully (every process checked gone by PID), then does the same for the other;
rounds alternate hvd, ipp, hvd, ipp, ... so slow drift (thermal, other load)
hits both alike. Start figures are medians over rounds; cell samples are pooled
over rounds. TensorFlow's files are read once before timing so that the first
start does not pay a cold disk cache that later ones don't.

3. What CurveZMQ costs (every cluster encrypts since issue 27): ``%hvd start``
   and an empty round trip (``apply_sync`` of a no-op on all engines, median of
   ``APPLY_REPS``) with CurveZMQ, against the same cluster with it off
   (``launch.CONTROLLER_ARGS`` emptied, in rounds of their own). Target: within
   1.1x.

Diagnostic rows (no target) split the figures: how long until the engines had
registered versus how long the TensorFlow import/bootstrap took, the stop
time, and the empty-cell round trip without the IPython magic layer
(``Session.run_cell("pass")`` versus ``view.execute("pass", block=True)``).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import (
    Context,
    Report,
    Row,
    Samples,
    descendants,
    foreign_cluster_processes,
    ipython_shell,
    kill,
    still_running,
)

N_RANKS = 2
START_TARGET = 1.2
CELL_TARGET = 1.5
CURVE_TARGET = 1.1
APPLY_REPS = 50  # no-op apply_sync round trips per round, with and without CurveZMQ
# IPython refuses a cell magic whose body is empty ('' -> UsageError) when a line
# magic of the same name exists, as for both %hvd and %px; a `pass` body is the
# closest runnable "empty" cell, the same on both sides.
NOOP = "pass"
HVD_CELL = f"%%hvd\n{NOOP}\n"
TF_CELL = "%%hvd\nimport tensorflow\n"  # (what ready means: TensorFlow imported on every rank, as ipp's side)
PX_CELL = f"%%px\n{NOOP}\n"
STOP_CHECK_S = 15.0  # how long stopped processes get to exit before they count as leaked


def _noop() -> None:
    """The body of an empty round trip, sent as a notebook's function is (by its code)."""


_noop.__module__ = "__main__"  # ipyparallel re-imports a function's module on the engines, unless it is __main__


class _Phases:
    """Times ``LaunchedWorld._bootstrap`` (the engines' bootstrap) inside ``%hvd start`` by wrapping it;
    restores the method on exit."""

    def __init__(self) -> None:
        self.bootstrap_s = math.nan

    def __enter__(self) -> _Phases:
        from hvd_notebook.cluster.launching.world import LaunchedWorld

        self._cls = LaunchedWorld
        self._orig = LaunchedWorld._bootstrap
        phases = self

        def timed(cluster: Any, *args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return phases._orig(cluster, *args, **kwargs)
            finally:
                phases.bootstrap_s = time.perf_counter() - t0

        LaunchedWorld._bootstrap = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        self._cls._bootstrap = self._orig  # type: ignore[method-assign]


@contextlib.contextmanager
def _without_curve() -> Any:
    """Clusters started inside start their controller without CurveZMQ (the baseline of what it costs)."""
    from hvd_notebook.cluster.launching import launch

    saved, launch.CONTROLLER_ARGS = launch.CONTROLLER_ARGS, []
    try:
        yield
    finally:
        launch.CONTROLLER_ARGS = saved


def _quiet() -> contextlib.ExitStack:
    """Swallow what a start/stop prints (the rank table) so the report stays readable."""
    stack = contextlib.ExitStack()
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    return stack


def _check(result: Any) -> None:
    """Fail the benchmark if an IPython cell raised (a timing of an error is no timing)."""
    if not result.success:
        result.raise_error()


def _time_loop(fn: Callable[[], Any], warmup: int, reps: int, into: Samples) -> None:
    for _ in range(warmup):
        fn()
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        into.add(time.perf_counter() - t0)


class _Leaks:
    """Processes that outlived a stop: recorded, then killed, so the run leaves nothing."""

    def __init__(self) -> None:
        self.found: list[dict[str, Any]] = []

    def check(self, label: str, pids: dict[int, str]) -> None:
        alive = still_running(pids, STOP_CHECK_S)
        if alive:
            self.found.append({"after": label, "processes": {str(k): v for k, v in alive.items()}})
            kill(alive)


def run(ctx: Context) -> Report:
    os.environ["HVD_NOTEBOOK_GPUS"] = ""  # CPU ranks: no GPU on either side

    rounds = 1 if ctx.quick else 3
    cell_reps = 10 if ctx.smoke else 30 if ctx.quick else 200
    cell_warmup = 2 if ctx.smoke else 5 if ctx.quick else 20
    reps_per_round = math.ceil(cell_reps / rounds)
    warmup_per_round = cell_warmup  # every fresh cluster gets its own warm-up
    diag_reps = max(10, reps_per_round // 2)

    # Import everything both sides use before timing, so neither pays it in a start.
    import ipyparallel as ipp
    from traitlets.config import Config

    from hvd_notebook.cluster.launching.placements import find_mpiexec
    from hvd_notebook.kernel.session import Session

    mpiexec = find_mpiexec(None)
    expected = str(Path(sys.executable).parent / "mpiexec")
    if mpiexec != expected:
        print(f"   note: using {mpiexec} (none beside {sys.executable})", flush=True)

    foreign = foreign_cluster_processes()
    load_before = os.getloadavg()
    if foreign:
        print(f"   warning: {len(foreign)} ipyparallel/MPI processes not started by this run are "
              "on the machine; they compete for the CPUs", flush=True)

    if not ctx.smoke:  # (--smoke: whichever side goes first pays the disk's reads; its figures mean nothing)
        print("   warming the disk cache: importing tensorflow once in a subprocess", flush=True)
        subprocess.run([sys.executable, "-c", "import tensorflow"], capture_output=True, check=True)

    ip = ipython_shell()
    session = Session.get()

    hvd = {k: Samples() for k in ("start", "ready", "registered", "bootstrap", "stop", "cell", "cell_direct", "apply")}
    plain = {k: Samples() for k in ("start", "apply")}  # hvd_notebook without CurveZMQ
    ipp_s = {k: Samples() for k in ("start", "registered", "import_tf", "stop", "cell", "cell_direct")}
    leaks = _Leaks()
    ipp_cluster: Any = None
    ipp_client: Any = None
    ipp_workdir: Path | None = None

    def hvd_round(i: int) -> None:
        with _Phases() as phases, _quiet():
            t0 = time.perf_counter()
            ip.run_line_magic("hvd", f"start -n {N_RANKS}")
            total = time.perf_counter() - t0
            # CPU ranks import TensorFlow with the first cell that uses it: ready is when it is imported
            t1 = time.perf_counter()
            _check(ip.run_cell(TF_CELL))
            ready = total + time.perf_counter() - t1
        hvd["start"].add(total)
        hvd["ready"].add(ready)
        hvd["bootstrap"].add(ready - (total - phases.bootstrap_s))
        hvd["registered"].add(total - phases.bootstrap_s)
        pids = descendants()

        _time_loop(lambda: _check(ip.run_cell(HVD_CELL)), warmup_per_round, reps_per_round, hvd["cell"])
        _time_loop(lambda: session.run_cell(NOOP), 5, diag_reps, hvd["cell_direct"])
        assert session.cluster.channel.ipp_client.curve_serverkey, "a cluster without CurveZMQ"
        view = session.cluster.channel.ipp_client[:]
        _time_loop(lambda: view.apply_sync(_noop), 5, APPLY_REPS, hvd["apply"])

        pids.update(descendants())
        with _quiet():
            t0 = time.perf_counter()
            ip.run_line_magic("hvd", "stop")
            hvd["stop"].add(time.perf_counter() - t0)
        leaks.check(f"%hvd stop, round {i + 1}", pids)
        print(f"   round {i + 1}: hvd start {total:.2f} s, TensorFlow ready {ready:.2f} s, %%hvd median so far "
              f"{hvd['cell'].median * 1e3:.1f} ms", flush=True)

    def plain_round(i: int) -> None:
        """%hvd start and no-op round trips with CurveZMQ off: what encryption costs, against hvd_round."""
        with _without_curve(), _quiet():
            t0 = time.perf_counter()
            ip.run_line_magic("hvd", f"start -n {N_RANKS}")
            plain["start"].add(time.perf_counter() - t0)
        assert not session.cluster.channel.ipp_client.curve_serverkey, "CurveZMQ still on in the baseline"
        pids = descendants()
        view = session.cluster.channel.ipp_client[:]
        _time_loop(lambda: view.apply_sync(_noop), 5, APPLY_REPS, plain["apply"])
        pids.update(descendants())
        with _quiet():
            ip.run_line_magic("hvd", "stop")
        leaks.check(f"%hvd stop without CurveZMQ, round {i + 1}", pids)
        print(f"   round {i + 1}: hvd start without CurveZMQ {plain['start'].values[-1]:.2f} s, apply median so "
              f"far {plain['apply'].median * 1e3:.2f} ms (with: {hvd['apply'].median * 1e3:.2f} ms)", flush=True)

    def ipp_round(i: int) -> None:
        nonlocal ipp_cluster, ipp_client, ipp_workdir
        ipp_workdir = Path(tempfile.mkdtemp(prefix="hvd-bench-ipp-"))
        cfg = Config()
        cfg.MPILauncher.mpi_cmd = [mpiexec]
        try:
            # Quiet: ipyparallel logs its progress to stderr (its logger binds the
            # stderr of the moment the Cluster is made, so its stop is quiet too).
            with _quiet():
                t0 = time.perf_counter()
                # A private profile dir (as %hvd uses) so no other cluster's files are touched.
                ipp_cluster = ipp.Cluster(
                    engines="mpi", n=N_RANKS, profile_dir=str(ipp_workdir / "profile"), config=cfg
                )
                ipp_client = ipp_cluster.start_and_connect_sync()
                t1 = time.perf_counter()
                ipp_client[:].execute("import tensorflow", block=True)
                t2 = time.perf_counter()
            ipp_s["start"].add(t2 - t0)
            ipp_s["registered"].add(t1 - t0)
            ipp_s["import_tf"].add(t2 - t1)
            pids = descendants()

            view = ipp_client[:]
            view.block = True
            view.activate()  # registers %px / %%px on the shell, bound to this view
            _time_loop(lambda: _check(ip.run_cell(PX_CELL)), warmup_per_round, reps_per_round, ipp_s["cell"])
            _time_loop(lambda: view.execute(NOOP, block=True), 5, diag_reps, ipp_s["cell_direct"])

            pids.update(descendants())
            t0 = time.perf_counter()
            stop_ipp()
            ipp_s["stop"].add(time.perf_counter() - t0)
            leaks.check(f"ipyparallel stop_cluster, round {i + 1}", pids)
        finally:
            stop_ipp()
        print(f"   round {i + 1}: ipp start {ipp_s['start'].values[-1]:.2f} s, "
              f"%%px median so far {ipp_s['cell'].median * 1e3:.1f} ms", flush=True)

    def stop_ipp() -> None:
        nonlocal ipp_cluster, ipp_client, ipp_workdir
        if ipp_client is not None:
            with contextlib.suppress(Exception):
                ipp_client.close()
            ipp_client = None
        if ipp_cluster is not None:
            with _quiet():
                ipp_cluster.stop_cluster_sync()
            ipp_cluster = None
        if ipp_workdir is not None:
            shutil.rmtree(ipp_workdir, ignore_errors=True)
            ipp_workdir = None

    t_begin = time.perf_counter()
    try:
        for i in range(rounds):
            hvd_round(i)
            ipp_round(i)
            if not ctx.quick:  # (the smoke run leaves out the price of CurveZMQ)
                plain_round(i)
    finally:
        with _quiet(), contextlib.suppress(Exception):
            session.stop()
        with contextlib.suppress(Exception):
            stop_ipp()
        leftover = descendants()
        if leftover:
            leaks.check("end of benchmark", leftover)

    ms = 1e3
    rows = [
        Row("start -n 2 to ready, median", "s", hvd["ready"].median, ipp_s["start"].median, START_TARGET),
        Row("  engines registered (diag.)", "s", hvd["registered"].median, ipp_s["registered"].median),
        Row("  TF import / bootstrap (diag.)", "s", hvd["bootstrap"].median, ipp_s["import_tf"].median),
        Row("  %hvd start alone: TF imported by the first cell (diag.)", "s", hvd["start"].median,
            ipp_s["start"].median),
        Row("stop (diag.)", "s", hvd["stop"].median, ipp_s["stop"].median),
        Row("empty cell %%hvd vs %%px, median", "ms", hvd["cell"].median * ms, ipp_s["cell"].median * ms, CELL_TARGET),
        Row("empty cell %%hvd vs %%px, p90", "ms", hvd["cell"].p90 * ms, ipp_s["cell"].p90 * ms),
        Row("  no magic: run_cell vs execute (diag.)", "ms",
            hvd["cell_direct"].median * ms, ipp_s["cell_direct"].median * ms),
    ]
    if not ctx.quick:
        rows += [
            Row("CurveZMQ: %hvd start to ready, with vs without, median", "s", hvd["start"].median,
                plain["start"].median, CURVE_TARGET),
            Row(f"CurveZMQ: apply_sync no-op on all engines, with vs without, median of {APPLY_REPS}/round", "ms",
                hvd["apply"].median * ms, plain["apply"].median * ms, CURVE_TARGET),
        ]
    notes = [
        f"{rounds} alternating rounds (hvd, ipp, hvd without CurveZMQ, ...); start = median of {rounds}; "
        f"cells: {hvd['cell'].summary()['n']} timed per side after {warmup_per_round} warm-up per round",
        f"hvd start min-max {hvd['start'].summary()['min']:.2f}-{hvd['start'].summary()['max']:.2f} s; "
        f"ipp start min-max {ipp_s['start'].summary()['min']:.2f}-{ipp_s['start'].summary()['max']:.2f} s",
        f"machine: {os.cpu_count()} CPUs, load average before {load_before[0]:.2f}",
    ]
    if foreign:
        notes.append(f"{len(foreign)} ipyparallel/MPI processes of someone else were running: figures may be skewed")
    if leaks.found:
        notes.append(f"LEAK: processes outlived a stop (killed afterwards): {leaks.found}")
    else:
        notes.append("every process started by this benchmark was gone after each stop")
    if ctx.quick:
        notes.append("--quick: few samples, figures are rough")

    return Report(
        name="cluster",
        title="%hvd on top of plain ipyparallel, 2 MPI ranks, CPU only",
        ours_label="hvd_notebook",
        baseline_label="plain ipyparallel",
        rows=rows,
        notes=notes,
        data={
            "config": {
                "ranks": N_RANKS, "rounds": rounds, "cell_reps": cell_reps,
                "cell_warmup_per_round": warmup_per_round, "diag_reps_per_round": diag_reps,
                "mpiexec": mpiexec,
            },
            "machine": {
                "cpus": os.cpu_count(),
                "usable_cpus": len(os.sched_getaffinity(0)),
                "loadavg_before": load_before,
                "loadavg_after": os.getloadavg(),
                "python": sys.version.split()[0],
                "ipyparallel": ipp.__version__,
                "foreign_cluster_processes": {str(k): v for k, v in foreign.items()},
            },
            "seconds": {
                "hvd_notebook": {k: v.summary() for k, v in hvd.items()},
                "ipyparallel": {k: v.summary() for k, v in ipp_s.items()},
                "hvd_notebook_without_curve": {k: v.summary() for k, v in plain.items()},
            },
            "leaks": leaks.found,
            "measure_s": round(time.perf_counter() - t_begin, 2),
        },
    )
