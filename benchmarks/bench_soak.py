"""Soak: repeated start, a short training cell, an interrupt of a cell blocked
in a collective, and restart, on 2 ranks, in one IPython shell as a notebook
would run them. Reports the time to recover from the interrupt (from the
interrupt until a cell runs again on a fresh world) and whether any process or
file descriptor leaked across the cycles.
"""

from __future__ import annotations

import _thread
import contextlib
import io
import os
import statistics
import threading
import time
from typing import Any

import psutil
from common import Context, Report, Row, ipython_shell, still_running

TRAIN = """%%hvd
import numpy as np, keras
x = np.random.default_rng(hvd.rank()).random((256, 8), dtype=np.float32); y = (x[:, 0] > 0.5).astype('int64')
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(8, activation='relu'), keras.layers.Dense(2)])
model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=32, epochs=2, verbose=0)
"""
BLOCKED = """%%hvd --no-progress
from mpi4py import MPI
import time
if hvd.rank() == 0:
    MPI.COMM_WORLD.barrier()  # rank 1 never joins
else:
    time.sleep(600)
"""
CHECK = "%%hvd --no-progress\nimport numpy as np\nassert hvd.allreduce(np.ones(1), op=hvd.Sum)[0] == 2"


def _check(result: Any) -> None:
    if not result.success:
        result.raise_error()


def run(ctx: Context) -> Report:
    os.environ["HVD_NOTEBOOK_GPUS"] = ""
    from hvd_notebook.kernel.session import Session

    cycles = 1 if ctx.quick else 20
    ip = ipython_shell()
    session = Session.get()
    me = psutil.Process()
    recover, leaked_procs, fds = [], [], []
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        for _ in range(cycles):
            ip.run_line_magic("hvd", "start -n 2")
            _check(ip.run_cell(TRAIN))
            # the interrupt arrives as in a kernel: KeyboardInterrupt in the running cell
            timer = threading.Timer(1.5, _thread.interrupt_main)
            timer.start()
            t_interrupt = time.monotonic() + 1.5
            ip.run_cell(BLOCKED)  # fails with KeyboardInterrupt after the session has restarted the world
            _check(ip.run_cell(CHECK))
            recover.append(time.monotonic() - t_interrupt)
            ip.run_line_magic("hvd", "restart")
            _check(ip.run_cell(CHECK))
            pids = {}
            for pid in session.cluster.pids():
                with contextlib.suppress(psutil.Error):
                    pids[pid] = " ".join(psutil.Process(pid).cmdline())[:120]
            ip.run_line_magic("hvd", "stop")
            leaked_procs.append(len(still_running(pids, 5.0)))
            fds.append(me.num_fds())
    rows = [Row("time to recover from an interrupt of a blocked collective: median vs worst", "s",
                statistics.median(recover), max(recover))]
    notes = [f"{cycles} cycles of start, training cell, interrupt of a cell blocked in a barrier, restart, stop",
             f"processes left after a stop: {sum(leaked_procs)} in all",
             f"this process's open file descriptors after each cycle: first {fds[0]}, last {fds[-1]}"
             + (f" (+{fds[-1] - fds[0]})" if fds[-1] != fds[0] else " (no growth)"),
             "recovery = from the interrupt until a cell runs again on the fresh MPI world "
             "(3 s grace for the ranks, then a new world is started)"]
    if ctx.quick:
        notes.append("--quick: 1 cycle only")
    return Report(name="soak", title="interrupt, restart and clean-up, over and over, 2 CPU ranks",
                  ours_label="median", baseline_label="worst", rows=rows, notes=notes,
                  data={"recover_s": recover, "leaked_processes": leaked_procs, "fds": fds})
