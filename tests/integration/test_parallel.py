"""Runs tests/parallel/ inside a real 2-rank MPI world and requires every rank to pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_notebook.cluster import find_mpiexec

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(p.name for p in (ROOT / "tests" / "parallel").glob("test_*.py"))


def run_under_mpiexec(args: list[str], **env_extra: str) -> None:
    env = {
        **os.environ,
        "HVD_PARALLEL": "1",
        # a rank whose test fails early must not leave the other waiting forever
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        **env_extra,
    }
    # -rs: each rank's output says why a test skipped (the gpu tests, where no GPU is visible)
    cmd = [find_mpiexec(None), "-n", "2", sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
           "-o", "addopts=", "-o", "timeout=240", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    assert proc.stdout.count(" passed") == 2, proc.stdout[-4000:]  # one summary line per rank


@pytest.mark.parametrize("test_file", FILES)
def test_under_mpiexec(test_file):
    run_under_mpiexec([f"tests/parallel/{test_file}"])


def test_agreement_through_a_collective():
    # ranks of one host agree through shared memory; ranks spread over hosts through a 16-byte
    # allreduce: its mismatch errors, join, barrier and stall handling, forced here on one host
    run_under_mpiexec(["tests/parallel/test_collectives.py", "tests/parallel/test_timeline_and_stall.py",
                       "-k", "agreement_road or mismatch or join or barrier or stall or bad_root"],
                      HVD_NOTEBOOK_SHM_AGREEMENT="0")
