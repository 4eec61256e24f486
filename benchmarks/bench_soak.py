"""Soak: repeated start, a short training cell, an interrupt of a cell blocked
in a collective, a restart by hand, and a rank SIGKILLed inside a cell under
``hvd.elastic.run``, on 2 ranks, in one IPython shell as a notebook would run
them; every cycle once without the warm standby world and once with it. Reports
the time to recover from each fault and whether any process or file descriptor
leaked across the cycles.
"""

from __future__ import annotations

import _thread
import contextlib
import io
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from common import Context, Report, Row, ipython_shell, still_running

RESTART_TARGET_S = 3.0  # with the standby: a usable cluster again within 3 s of the decision to restart
ELASTIC_TARGET_S = 5.0  # with the standby: from the rank's death until the training goes on

SETUP = """%%hvd
import numpy as np, keras
x = np.random.default_rng(hvd.rank()).random((256, 8), dtype=np.float32); y = (x[:, 0] > 0.5).astype('int64')
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation='relu'), keras.layers.Dense(2)])
model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
"""
TRAIN = "%%hvd --no-replay\nmodel.fit(x, y, batch_size=32, epochs=2, verbose=0)"  # (a resume replays SETUP only)
BLOCKED = """%%hvd --no-progress
from mpi4py import MPI
import time
if hvd.rank() == 0:
    MPI.COMM_WORLD.barrier()  # rank 1 never joins
else:
    time.sleep(600)
"""
CHECK = "%%hvd --no-progress\nimport numpy as np\nassert hvd.allreduce(np.ones(1), op=hvd.Sum)[0] == 2"


# rank 1 SIGKILLs itself after step 5 (last commit: step 4); the cell completes on a new world
ELASTIC = """%%hvd --no-progress
import os, signal, time, numpy as np, tensorflow as tf
w = tf.Variable(np.zeros(3, np.float32))
state = hvd.elastic.TensorFlowState([w], step=0)

@hvd.elastic.run
def train(state):
    if state.step and hvd.rank() == 0 and not os.path.exists({resumed!r}):
        open({resumed!r}, "w").write(repr(time.time()))
    while state.step < 8:
        w.assign_add(hvd.allreduce(np.ones(3, np.float32), op=hvd.Sum))
        state.step += 1
        if state.step % 2 == 0:
            state.commit()
        if state.step == 5 and hvd.rank() == 1 and not os.path.exists({killed!r}):
            open({killed!r}, "w").write(repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)

train(state)
assert w.numpy().tolist() == [16.0] * 3, w.numpy()
"""
MODES = ("off", "on")


def _check(result: Any) -> None:
    if not result.success:
        result.raise_error()


def _wait_for_standby(session: Any, timeout: float = 120.0) -> None:
    """As a user between cells: the standby (where there is one) is ready before the next fault."""
    deadline = time.monotonic() + timeout
    while session.cluster.standby_state == "starting" and time.monotonic() < deadline:
        time.sleep(0.1)
    if session.cluster.standby_state not in ("ready", "off"):
        raise RuntimeError(f"the standby did not come up: {session.cluster.standby_state}")


def _cycle(ip: Any, session: Any, mode: str, folder: Path, interrupt: bool = True) -> dict[str, float]:
    """One cycle; the seconds each recovery took (the interrupt's left out where ``interrupt`` is False)."""
    ip.run_line_magic("hvd", f"start -n 2 --standby {mode}")
    _check(ip.run_cell(SETUP))
    _check(ip.run_cell(TRAIN))
    _wait_for_standby(session)
    times = {"interrupt": _interrupt(ip, session)} if interrupt else {}
    t_restart = time.monotonic()
    ip.run_line_magic("hvd", "restart")
    _check(ip.run_cell(CHECK))
    restart = time.monotonic() - t_restart
    _wait_for_standby(session)
    killed, resumed = folder / f"killed-{mode}", folder / f"resumed-{mode}"
    _check(ip.run_cell(ELASTIC.format(killed=str(killed), resumed=str(resumed))))
    elastic = float(resumed.read_text()) - float(killed.read_text())
    killed.unlink()
    resumed.unlink()
    return {**times, "restart": restart, "elastic": elastic}


def _interrupt(ip: Any, session: Any) -> float:
    """An interrupt of a cell blocked in a barrier, until a cell runs again (s); then the next standby."""
    # the interrupt arrives as in a kernel: KeyboardInterrupt in the running cell
    threading.Timer(1.5, _thread.interrupt_main).start()
    t_interrupt = time.monotonic() + 1.5
    ip.run_cell(BLOCKED)  # fails with KeyboardInterrupt after the session has restarted the world
    _check(ip.run_cell(CHECK))
    interrupt = time.monotonic() - t_interrupt
    _wait_for_standby(session)
    return interrupt


def run(ctx: Context) -> Report:
    os.environ["HVD_NOTEBOOK_GPUS"] = ""
    from hvd_notebook.kernel.session import Session

    cycles = 1 if ctx.quick else 8
    modes = ("on",) if ctx.quick else MODES  # (--quick: the standby's cycle, whose times have targets)
    ip = ipython_shell()
    session = Session.get()
    me = psutil.Process()
    times: dict[str, dict[str, list[float]]] = {m: {"interrupt": [], "restart": [], "elastic": []} for m in modes}
    leaked_procs, fds = [], []
    with (contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()),
          tempfile.TemporaryDirectory() as folder):
        for _ in range(cycles):
            for mode in modes:  # alternating, so that both see the same machine
                # (--smoke leaves out the interrupt, which no row of a one-mode run reads: an interrupt promoting
                # the standby is tests/integration/test_standby.py's)
                for name, seconds in _cycle(ip, session, mode, Path(folder), interrupt=not ctx.smoke).items():
                    times[mode][name].append(seconds)
                pids = {}
                for pid in session.cluster.pids():
                    with contextlib.suppress(psutil.Error):
                        pids[pid] = " ".join(psutil.Process(pid).cmdline())[:120]
                ip.run_line_magic("hvd", "stop")
                leaked_procs.append(len(still_running(pids, 5.0)))
                fds.append(me.num_fds())
    median = {m: {k: statistics.median(v) for k, v in kinds.items() if v} for m, kinds in times.items()}
    rows = [
        Row("%hvd restart with the standby vs the target (median)", "s", median["on"]["restart"], RESTART_TARGET_S,
            target=1.0),
        Row("hvd.elastic recovery with the standby vs the target (median)", "s", median["on"]["elastic"],
            ELASTIC_TARGET_S, target=1.0),
    ]
    if "off" in median:
        rows += [Row(f"{what}: standby on vs off (median)", "s", median["on"][kind], median["off"][kind])
                 for what, kind in (("%hvd restart until a cell runs again", "restart"),
                                    ("interrupt of a blocked collective until a cell runs again", "interrupt"),
                                    ("hvd.elastic cell, rank SIGKILLed until training goes on", "elastic"))]
    worst = {m: {k: max(v) for k, v in kinds.items() if v} for m, kinds in times.items()}
    notes = [f"{cycles} cycle(s) per mode, standby {' and '.join(modes)}: start, training cell, "
             + ("" if ctx.smoke else "interrupt of a cell blocked in a barrier, ") + "%hvd restart, a rank "
             "SIGKILLed in an hvd.elastic cell (its resume replays a Keras set-up cell), stop",
             f"worst case, standby {' / '.join(modes)}: " + ", ".join(
                 f"{k} {' / '.join(f'{worst[m][k]:.1f}' for m in modes)} s"
                 for k in ("restart", "interrupt", "elastic") if k in worst[modes[0]]),
             f"processes left after a stop: {sum(leaked_procs)} in all",
             f"this process's open file descriptors after each cycle: first {fds[0]}, last {fds[-1]}"
             + (f" (+{fds[-1] - fds[0]})" if fds[-1] != fds[0] else " (no growth)"),
             "the interrupt's recovery includes the 3 s grace the ranks get to take it; the elastic recovery "
             "runs from the rank's death until rank 0 is back in the training function (new world, set-up "
             "replayed, commit restored)",
             "with the standby, the test waits for it to be ready between faults, as a user's pause would"]
    if ctx.quick:
        notes.append("--quick: 1 cycle, with the standby only (its times against the targets)"
                     + ("; --smoke: no interrupt" if ctx.smoke else ""))
    return Report(name="soak", title="faults, restarts and clean-up, over and over, 2 CPU ranks, warm standby on "
                  "and off", ours_label="standby on", baseline_label="standby off", rows=rows, notes=notes,
                  data={"seconds": times, "leaked_processes": leaked_procs, "fds": fds})
