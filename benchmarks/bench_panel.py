"""The JupyterLab panel's cost on the ranks: the same 2-rank Keras fit (bench_progress's) while the panel's
server side reads the cluster every 1.5 s, as it does while the panel is open (``Readings.snapshot``: the
node's register, the user's cluster directories, each rank's /proc), and while nothing reads it, in alternating
rounds on one cluster. The reader is its own process, as Jupyter's server is. Target: within 3 %, the noise of
the runs themselves.
"""

from __future__ import annotations

import statistics
import subprocess
import sys

from bench_progress import TIMED, _check, fitting_cluster
from common import Context, Report, Row

TARGET = 1.03
PERIOD_S = 1.5  # the panel's refresh while it is open (labextension/src/model.ts)

READER = f"""
import time
from hvd_notebook.lab.readings import Readings
readings = Readings()
readings.snapshot({{}})
print("ready", flush=True)
count = 0
while True:  # (until the benchmark kills it)
    started = time.perf_counter()
    snapshot = readings.snapshot({{}})
    count += 1
    print(count, len(snapshot["clusters"]), f"{{time.perf_counter() - started:.4f}}", flush=True)
    time.sleep({PERIOD_S})
"""


def run(ctx: Context) -> Report:
    # (rounds of several seconds, so that each holds a few of the panel's reads)
    rounds, samples, epochs = (1, 512, 1) if ctx.smoke else (2, 512, 1) if ctx.quick else (6, 8192, 4)
    closed, opened, reads = [], [], []
    with fitting_cluster(samples) as (ip, session):
        timed = "%%hvd --no-progress" + f"\nEPOCHS = {epochs}" + TIMED
        for _ in range(rounds):  # alternate, so drift hits both alike
            _check(ip.run_cell(timed))
            closed.append(float(session.pull("rate")))
            reader = subprocess.Popen([sys.executable, "-c", READER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      text=True)
            first = ""
            try:
                assert reader.stdout.readline().strip() == "ready"
                _check(ip.run_cell(timed))
                opened.append(float(session.pull("rate")))
                first = reader.stdout.readline()  # (a fit shorter than one read: wait for the reader's first)
            finally:
                reader.kill()
                lines = [first, *reader.communicate()[0].split("\n")]
            reads += [line.split() for line in lines if line.strip()]
    rate_open, rate_closed = statistics.median(opened), statistics.median(closed)
    assert reads and all(int(clusters) >= 1 for _, clusters, _ in reads), reads  # (it saw the cluster each time)
    read_s = statistics.median(float(seconds) for _, _, seconds in reads)
    rows = [Row("2-rank fit, time per sample: the panel reading every 1.5 s vs nothing reading", "us",
                1e6 / rate_open, 1e6 / rate_closed, TARGET)]
    notes = [f"samples/s over 2 ranks: {rate_open:,.0f} with the panel's reads, {rate_closed:,.0f} without "
             f"(medians of {rounds} alternating rounds; bench_progress's CNN, batch 64 per rank, no dashboard)",
             f"{len(reads)} reads during the timed rounds, {read_s * 1e3:.1f} ms each (median)"]
    if ctx.quick:
        notes.append("--quick: few samples, figures are rough")
    return Report(name="panel", title="the JupyterLab panel's refresh and the ranks' training, 2 CPU ranks",
                  ours_label="panel open", baseline_label="panel closed", rows=rows, notes=notes,
                  data={"rate_open": opened, "rate_closed": closed, "read_s": read_s, "reads": len(reads),
                        "epochs": epochs, "samples_per_rank": samples})
