"""hvd.elastic's cost on 2 CPU ranks: a commit of a Keras model of 25 M float32 parameters with Adam
(target under 0.2 s, issue 17), and what the commit moves to the next training step (its first write
to each variable copies the buffer the commit shares), against a step without a commit before it.
"""

from __future__ import annotations

from pathlib import Path

from common import Context, Report, Row, run_worker

HERE = Path(__file__).resolve().parent
COMMIT_BUDGET_S = 0.2


def run(ctx: Context) -> Report:
    from hvd_notebook.cluster.launching.launch import rank_environment
    from hvd_notebook.cluster.launching.placements import find_mpiexec

    r = run_worker(HERE / "mpi_elastic_worker.py", 2, ctx, mpiexec=find_mpiexec(None), env=rank_environment())
    ms = 1e3
    millions = r["parameters"] / 1e6
    rows = [
        Row(f"commit of {millions:.1f} M parameters + Adam's slots vs the 0.2 s budget", "ms", r["commit_s"] * ms,
            COMMIT_BUDGET_S * ms, 1.0),
        Row("training step right after a commit vs a step without one", "ms", r["step_after_commit_s"] * ms,
            r["step_s"] * ms),
        Row("restore of that commit vs a training step", "ms", r["restore_s"] * ms, r["step_s"] * ms),
    ]
    notes = [f"{r['committed_values'] / 1e6:.0f} M values committed (weights, Adam's two slots, its step count); "
             f"medians of {r['reps']} commits, each after a barrier",
             "a commit keeps tf.identity copies, which share each variable's buffer until the next write copies it: "
             "the step after a commit pays that copy"]
    if ctx.quick:
        notes.append("--quick: few samples, figures are rough")
    return Report(name="elastic", title="hvd.elastic commits, 2 CPU ranks", ours_label="hvd",
                  baseline_label="baseline", rows=rows, notes=notes, data=r)
