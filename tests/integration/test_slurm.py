"""%hvd start inside a Slurm allocation: a single-node Slurm (Debian's
slurm-wlm: slurmctld, slurmd and munged started by tests/slurm/setup.sh with a
generated configuration), an allocation from salloc, and in it an IPython
shell with the extension, as a notebook kernel started inside the allocation
would be. The ranks are placed by srun (PMI-2), -n defaults to the
allocation's tasks, and nothing is left of the job afterwards."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import figure

ROOT = Path(__file__).resolve().parents[2]
SLURM = Path(__file__).resolve().parent / "slurm"

KERNEL = r"""
import sys, time
from IPython.testing.globalipapp import start_ipython
from hvd_notebook.kernel.session import Session

shell = start_ipython()
shell.run_line_magic("load_ext", "hvd_notebook")
for line in ("start -n 3", "start"):
    t0 = time.monotonic()
    try:
        shell.run_line_magic("hvd", line)
    except Exception as exc:
        print("ERROR", type(exc).__name__, exc)
    print("TOOK", line, round(time.monotonic() - t0, 1))
cluster = Session.get().cluster
print("LAUNCHER", cluster.mpiexec if cluster else None)
shell.run_cell("%%hvd --all-output\nimport os\n"
               "print('rank', hvd.rank(), 'of', hvd.size(), 'step', os.environ.get('SLURM_STEP_ID'), "
               "'sum', hvd.allreduce(hvd.rank() + 1, op=hvd.Sum))\n")
pids = sorted(cluster.pids())
result = shell.run_cell("%%hvd\nimport os\nif hvd.rank() == 1:\n    os._exit(7)\nhvd.barrier()\n")
print("DIED", result.error_in_exec)
shell.run_line_magic("hvd", "stop")
print("PIDS", " ".join(map(str, pids)))
sys.stdout.flush()
"""


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root to run slurmctld, slurmd and munged"
    if shutil.which("apt-get") is None and shutil.which("slurmctld") is None:
        return "Slurm is not installed and there is no apt-get to install Debian's slurm-wlm"
    return None


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    reason = _why_not()
    if reason:
        pytest.skip(reason)
    state = tmp_path_factory.mktemp("slurm")
    # ports of their own, away from Slurm's defaults (6817/6818) and any Slurm already on the machine
    env = {**os.environ, "SP_DIR": str(state), "SP_CTLD_PORT": "16917", "SP_SLURMD_PORT": "16918"}
    t0 = time.monotonic()
    made = subprocess.run([SLURM / "setup.sh"], env=env, capture_output=True, text=True, timeout=600)
    assert made.returncode == 0, made.stdout + made.stderr
    figure(f"slurm: single-node slurmctld+slurmd up (install if missing included) in {time.monotonic() - t0:.1f} s")
    env["SLURM_CONF"] = str(state / "slurm.conf")
    try:
        yield env
    finally:
        subprocess.run([SLURM / "teardown.sh"], env=env, capture_output=True, timeout=120)


def test_start_inside_a_salloc_allocation(slurm, tmp_path):
    script = tmp_path / "kernel.py"
    script.write_text(KERNEL)
    t0 = time.monotonic()
    proc = subprocess.run(["salloc", "-n", "2", "--time=10", sys.executable, str(script)], cwd=ROOT, env=slurm,
                          capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    figure(f"slurm: salloc -n 2 + %hvd start + a cell + stop in {time.monotonic() - t0:.1f} s")
    assert "-n 3 ranks but the Slurm allocation has 2 task(s)" in out, out[-6000:]
    assert "Started 2 MPI ranks" in out, out[-6000:]  # -n from the allocation
    assert "LAUNCHER" in out and out.split("LAUNCHER", 1)[1].split()[0].endswith("srun"), out[-6000:]
    for rank in (0, 1):
        assert f"rank {rank} of 2 step 0 sum 3" in out, out[-6000:]
    died = proc.stdout.split("DIED", 1)[1].splitlines()[0]
    assert "rank(s) [1] died" in died and "rank 1: exit code 7" in died, died
    # nothing of the job is left: no step, no job, no process (Slurm ends a job after salloc returns: it may
    # show as completing, CG, for a moment; a bounded wait)
    deadline = time.monotonic() + 30
    while (queue := subprocess.run(["squeue", "-h"], env=slurm, capture_output=True, text=True).stdout).strip() \
            and time.monotonic() < deadline:
        time.sleep(0.5)
    assert queue.strip() == "", queue
    pids = [int(p) for p in proc.stdout.split("PIDS", 1)[1].splitlines()[0].split()]
    assert pids
    deadline = time.monotonic() + 15
    while any(Path(f"/proc/{p}").exists() for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [p for p in pids if Path(f"/proc/{p}").exists()]
    assert not left, left
