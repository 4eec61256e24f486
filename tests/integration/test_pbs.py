"""``hvd-notebook run`` inside a PBS job: the hosts of ``$PBS_NODEFILE`` (one line per slot, as PBS writes it)
are this machine's network-namespace hosts (tests/integration/netns, as in test_multihost.py), reached by MPICH's
hydra through the ssh look-alike ``nsexec``. The ranks start on those hosts, and a rank that exits non-zero is
named with its rank from hydra's own report, read by the PBS placement (``PbsJob.rank_exits``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import figure
from test_multihost import HOSTS, NETNS, _ns_pids, two_hosts  # noqa: F401  (two_hosts: the fixture, shared)

BIN = Path(sys.executable).parent
VIA_NETNS = ["--mpi-args", f"-launcher ssh -launcher-exec {NETNS / 'nsexec'} -iface hvdbr0"]
# each rank says where it runs; rank 1 then fails (a plain program: nothing of MPI waits for it)
RANKS = 'echo "rank $PMI_RANK on $(hostname)"; [ "$PMI_RANK" != 1 ] || exit 3'


def _run_in_pbs_job(node_file: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PBS_JOBID": "7.pbs-test", "PBS_NODEFILE": str(node_file), "UCX_TLS": "tcp,self",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run([str(BIN / "hvd-notebook"), "run", *args], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.usefixtures("two_hosts")
def test_a_pbs_job_runs_ranks_on_its_nodes_and_names_the_rank_that_failed(tmp_path):
    node_file = tmp_path / "nodes"
    node_file.write_text("".join(f"{host}\n" for host in HOSTS))  # one slot on each namespace host
    done = _run_in_pbs_job(node_file, "-np", "2", *VIA_NETNS, "sh", "-c", RANKS)
    out = done.stdout + done.stderr
    assert "rank 0 on hvdh1" in done.stdout and "rank 1 on hvdh2" in done.stdout, out
    assert done.returncode == 3, out
    assert "[hvd_notebook] rank 1 (exit code 3) failed" in done.stderr and "rank 0 (" not in done.stderr, out
    assert _ns_pids() == []
    figure("pbs: hvd-notebook run under a node file of 2 namespace hosts, rank 1 named from hydra's report")


@pytest.mark.usefixtures("two_hosts")
def test_a_pbs_job_with_two_slots_on_a_node_runs_a_real_mpi_world(tmp_path):
    node_file = tmp_path / "nodes"
    node_file.write_text(f"{HOSTS[0]}\n{HOSTS[1]}\n{HOSTS[1]}\n")  # hvdh2 has two slots
    script = tmp_path / "where.py"
    script.write_text("import socket\nfrom mpi4py import MPI\nw = MPI.COMM_WORLD\n"
                      "total = w.allreduce(w.rank + 1)\n"
                      "print('rank', w.rank, 'of', w.size, 'on', socket.gethostname(), 'sum', total, flush=True)\n")
    done = _run_in_pbs_job(node_file, "-np", "3", *VIA_NETNS, sys.executable, str(script))
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    for line in ("rank 0 of 3 on hvdh1 sum 6", "rank 1 of 3 on hvdh2 sum 6", "rank 2 of 3 on hvdh2 sum 6"):
        assert line in done.stdout, out
    assert _ns_pids() == []
