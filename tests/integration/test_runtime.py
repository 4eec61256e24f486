"""The runtime's process queries in a plain script under a real mpiexec, as a
batch job would run them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hvd_notebook.cluster.launching.placements import find_mpiexec

SCRIPT = r"""
import json, sys
import hvd_notebook.runtime as hvd
try:
    hvd.rank()
    before = "no error"
except ValueError as exc:
    before = str(exc)
try:
    hvd.init(comm="world")
    wrong_type = "no error"
except TypeError as exc:
    wrong_type = str(exc)
hvd.init()
hvd.init()  # idempotent
out = dict(before=before, wrong_type=wrong_type, rank=hvd.rank(), size=hvd.size(), local_rank=hvd.local_rank(),
           local_size=hvd.local_size(), cross_rank=hvd.cross_rank(), cross_size=hvd.cross_size(),
           homogeneous=hvd.is_homogeneous(), initialized=hvd.is_initialized())
from mpi4py import MPI
out["mpi_rank"] = MPI.COMM_WORLD.Get_rank()
hvd.shutdown()
out["after_shutdown"] = hvd.is_initialized()
open(sys.argv[1] + f"/rank{MPI.COMM_WORLD.Get_rank()}.json", "w").write(json.dumps(out))
"""


def run_mpi(tmp_path: Path, script: str, n: int = 2) -> list[dict]:
    path = tmp_path / "job.py"
    path.write_text(script)
    proc = subprocess.run(
        [find_mpiexec(None), "-n", str(n), sys.executable, str(path), str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # one file per rank: mpiexec may interleave the ranks' stdout within a line
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]


def test_process_queries_under_mpiexec(tmp_path):
    rows = run_mpi(tmp_path, SCRIPT)
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert "hvd.init()" in r["before"]
        assert "mpi4py communicator or a list of ranks" in r["wrong_type"]
        assert r["rank"] == r["mpi_rank"]
        assert r["size"] == 2 and r["local_size"] == 2 and r["local_rank"] == r["rank"]
        assert r["cross_size"] == 1 and r["cross_rank"] == 0
        assert r["homogeneous"] and r["initialized"] and not r["after_shutdown"]


def test_init_with_a_list_of_ranks(tmp_path):
    script = r"""
import json
import hvd_notebook.runtime as hvd
from mpi4py import MPI
hvd.init(comm=[1])  if MPI.COMM_WORLD.Get_rank() == 1 else None
out = {"rank": MPI.COMM_WORLD.Get_rank(), "init": hvd.is_initialized()}
if hvd.is_initialized():
    out.update(hvd_rank=hvd.rank(), hvd_size=hvd.size())
import sys
open(sys.argv[1] + f"/rank{MPI.COMM_WORLD.Get_rank()}.json", "w").write(json.dumps(out))
"""
    rows = run_mpi(tmp_path, script)
    assert rows[0] == {"rank": 0, "init": False}
    assert rows[1] == {"rank": 1, "init": True, "hvd_rank": 0, "hvd_size": 1}
