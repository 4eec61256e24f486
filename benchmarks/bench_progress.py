"""The live dashboard's cost: the same 2-rank Keras fit with progress on (the
callback on every rank, the widgets updated in the notebook kernel) and with
``%%hvd --no-progress``, in alternating rounds on one cluster. Target: at most
3 % slower. The kernel shares this machine's 2 cores with the ranks, so its
widget updates are part of the cost, as on a user's node.
"""

from __future__ import annotations

import contextlib
import io
import os
import statistics
from collections.abc import Iterator
from typing import Any

from common import Context, Report, Row, ipython_shell

TARGET = 1.03

SETUP = """
import time
import numpy as np, keras
keras.utils.set_random_seed(hvd.rank())
x = np.random.default_rng(hvd.rank()).random((N, 28, 28, 1), dtype=np.float32)
y = np.random.default_rng(hvd.rank() + 7).integers(0, 10, N)
model = keras.Sequential([
    keras.Input((28, 28, 1)),
    keras.layers.Conv2D(16, 3, activation="relu"), keras.layers.MaxPooling2D(),
    keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.MaxPooling2D(),
    keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10, activation="softmax")])
model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="sparse_categorical_crossentropy",
              metrics=["accuracy"])
model.fit(x, y, batch_size=64, epochs=1, verbose=0)  # trace and warm up
"""

TIMED = """
hvd.barrier()
t0 = time.perf_counter()
model.fit(x, y, batch_size=64, epochs=EPOCHS, verbose=0)
hvd.barrier()
rate = len(x) * EPOCHS * hvd.size() / (time.perf_counter() - t0)
"""


def _check(result: Any) -> None:
    if not result.success:
        result.raise_error()


_kept: list[int] = []  # the samples per rank of the set-up cluster that --smoke kept running for the next benchmark


@contextlib.contextmanager
def fitting_cluster(samples: int, keep: bool = False) -> Iterator[tuple[Any, Any]]:
    """A 2-rank cluster of this process's session with this benchmark's model set up on ``samples`` per rank
    (``SETUP``), all it prints swallowed; stopped at the end, unless ``keep`` (then the next call for as many
    samples takes it as it is, and ``release`` stops it). Yields the IPython shell and the session."""
    os.environ["HVD_NOTEBOOK_GPUS"] = ""
    from hvd_notebook.kernel.session import Session

    ip, session = ipython_shell(), Session.get()
    kept = _kept == [samples] and session.cluster is not None
    _kept.clear()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            if not kept:
                ip.run_line_magic("hvd", "start -n 2 --restart" if session.cluster else "start -n 2")
                _check(ip.run_cell(f"%%hvd\nN = {samples}" + SETUP))
            yield ip, session
    except BaseException:
        keep = False
        raise
    finally:
        if keep:
            _kept.append(samples)
        else:
            release()


def release(kept_only: bool = False) -> None:
    """Stop this process's cluster, which ``fitting_cluster`` started (with ``kept_only``: only one it kept)."""
    if kept_only and not _kept:
        return
    from hvd_notebook.kernel.session import Session

    _kept.clear()
    if Session.get().cluster is not None:
        with contextlib.redirect_stdout(io.StringIO()):
            ipython_shell().run_line_magic("hvd", "stop")


def run(ctx: Context) -> Report:
    rounds, samples, epochs = (1, 512, 1) if ctx.smoke else (2, 512, 1) if ctx.quick else (6, 2048, 2)
    on, off = [], []
    with fitting_cluster(samples, keep=ctx.smoke) as (ip, session):  # (--smoke: the panel's benchmark takes it)
        timed = f"\nEPOCHS = {epochs}" + TIMED
        for _ in range(rounds):  # alternate, so drift hits both alike
            _check(ip.run_cell("%%hvd --no-progress" + timed))
            off.append(float(session.pull("rate")))
            _check(ip.run_cell("%%hvd --progress widgets" + timed))
            on.append(float(session.pull("rate")))
    rate_on, rate_off = statistics.median(on), statistics.median(off)
    rows = [Row("2-rank fit, time per sample: dashboard on (widgets) vs --no-progress", "us",
                1e6 / rate_on, 1e6 / rate_off, TARGET)]
    notes = [f"samples/s over 2 ranks: {rate_on:,.0f} with the dashboard, {rate_off:,.0f} without "
             f"(medians of {rounds} alternating rounds; a small CNN, batch 64 per rank)"]
    if ctx.quick:
        notes.append("--quick: few samples, figures are rough")
    return Report(name="progress", title="the live dashboard's cost on training, 2 CPU ranks",
                  ours_label="progress on", baseline_label="--no-progress", rows=rows, notes=notes,
                  data={"rate_on": on, "rate_off": off, "epochs": epochs, "samples_per_rank": samples})
