"""The gradient noise scale's cost: a training step on 2 ranks with the measurement on (the default) against
off (``HVD_NOTEBOOK_NOISE_SCALE=0``), Keras ``fit`` and PyTorch's DistributedOptimizer, alternating rounds
in one run. Target: at most 3 % slower."""

from __future__ import annotations

import sys
from pathlib import Path

from common import Context, Report, Row, run_worker

HERE = Path(__file__).resolve().parent
TARGET = 1.03


def run(ctx: Context) -> Report:
    sys.path.insert(0, str(HERE.parent))
    from hvd_notebook.cluster.launching.launch import rank_environment
    from hvd_notebook.cluster.launching.placements import find_mpiexec

    figures = run_worker(HERE / "mpi_noise_scale_worker.py", 2, ctx, mpiexec=find_mpiexec(None),
                         env=rank_environment())
    rows = [Row(f"{name}: time per step, noise scale on vs off", "ms", 1e3 * figures[key]["on"],
                1e3 * figures[key]["off"], TARGET)
            for key, name in (("keras", "Keras fit"), ("torch", "PyTorch DistributedOptimizer"))]
    notes = [f"small CNN on synthetic 28x28 images, 2 ranks, per-rank batch {figures['batch']}, "
             f"{figures['steps_per_round']} steps a round (PyTorch: 3x), median of {figures['keras']['rounds']} "
             "alternated rounds",
             "steps measured (on, off): Keras {}, PyTorch {}; the noise scale itself: {} (random labels: the "
             "gradient is lost in its noise, as it should be)".format(
                 tuple(figures["keras"]["steps_measured"]), tuple(figures["torch"]["steps_measured"]),
                 ", ".join(f"{figures[k]['noise_scale']}" for k in ("keras", "torch")))]
    if ctx.quick:
        notes.append("--quick: one round, figures are rough")
    return Report(name="noise_scale", title="the gradient noise scale's cost on a training step",
                  ours_label="on", baseline_label="off", rows=rows, notes=notes, data=figures)
