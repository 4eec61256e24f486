"""Runs tests/parallel/ inside a real 2-rank MPI world and requires every rank to pass."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hvd_notebook.cluster.launching.placements import find_mpiexec

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(p.name for p in (ROOT / "tests" / "parallel").glob("test_*.py"))
# Files that share one world (one mpiexec and one TensorFlow import for all of them); a file not named here
# gets a world of its own. Alone on purpose: test_tf1_graph.py (graph mode), test_training_extras.py and
# test_elastic.py (they leave the TF world in a state the others' tests do not expect), test_horovod_imports.py
# (it checks what importing the alias does in a fresh process)
SHARED_WORLDS = {
    "tensorflow": ["test_collectives.py", "test_coordination.py", "test_horovod_arguments.py",
                   "test_horovod_semantics.py", "test_keras.py", "test_nccl.py", "test_process_sets.py",
                   "test_progress_callback.py", "test_timeline_and_stall.py"],
    "torch": ["test_torch.py", "test_torch_gpu.py"],
    # PyTorch's CPU tensors through torch.distributed's gloo: the data path CUDA tensors take through NCCL
    "torch-dist": ["test_torch.py", "test_torch_dist.py"],
}
WORLD_ENV = {"torch-dist": {"HVD_NOTEBOOK_TORCH_TRANSPORT": "dist"}}  # a world's own environment
# a world whose ranks must run every line of a module (the data path CUDA tensors take, here on gloo)
COVERED = {"torch-dist": ROOT / "hvd_notebook" / "runtime" / "torch" / "dist_backend.py"}
_SHARED = {f for files in SHARED_WORLDS.values() for f in files}
WORLDS = {**SHARED_WORLDS, **{f: [f] for f in FILES if f not in _SHARED}}


def run_under_mpiexec(record_property: Any, args: list[str], ranks: int = 2, **env_extra: str) -> None:
    """``args`` run by pytest on every rank of a ``ranks``-rank world: each rank must pass, and only tests
    marked ``gpu`` may skip (``HVD_PARALLEL_ONLY_GPU_SKIPS``); each rank's counts go to the run's summary."""
    env = {
        **os.environ,
        "HVD_PARALLEL": "1",
        "HVD_PARALLEL_ONLY_GPU_SKIPS": "1",
        # a rank whose test fails early must not leave the other waiting forever
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        **env_extra,
    }
    # -rs: each rank's output says why a test skipped (the gpu tests, where no GPU is visible)
    cmd = [find_mpiexec(None), "-n", str(ranks), sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
           "-o", "addopts=", "-o", "timeout=240", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-4000:]
    assert proc.stdout.count(" passed") == ranks, proc.stdout[-4000:]  # one summary line per rank
    # (the ranks share one pipe: a line may come cut by another rank's, so the counts are shown as found)
    summaries = re.findall(r"(\d+ passed[^\n]*?) in [\d.]+s", proc.stdout)
    record_property("inner", f"{' '.join(args)}: " + " | ".join(summaries))


def test_every_file_runs_in_a_world():
    assert set(FILES) >= _SHARED, sorted(_SHARED - set(FILES))  # (a renamed file is not left out silently)


@pytest.mark.parametrize("world", sorted(WORLDS))
def test_under_mpiexec(record_property, tmp_path, world):
    files, env = [f"tests/parallel/{f}" for f in WORLDS[world]], WORLD_ENV.get(world, {})
    covered = COVERED.get(world)
    if covered is None or os.environ.get("COVERAGE_PROCESS_CONFIG"):  # (make coverage measures every rank itself)
        run_under_mpiexec(record_property, files, **env)
        return
    data = tmp_path / ".coverage"
    run_under_mpiexec(record_property, ["-p", "tests.integration.line_coverage", *files],
                      HVD_LINE_COVERAGE=f"{covered}{os.pathsep}{data}", **env)
    report = [sys.executable, "-m", "coverage"]
    rc = tmp_path / "coveragerc"  # (none of pyproject.toml's [tool.coverage] settings)
    rc.write_text("")
    subprocess.run([*report, "combine", "-q", f"--rcfile={rc}", f"--data-file={data}"], check=True, cwd=ROOT)
    shown = subprocess.run([*report, "report", f"--rcfile={rc}", f"--data-file={data}", "--show-missing",
                            "--fail-under=100"], capture_output=True, text=True, cwd=ROOT)
    assert shown.returncode == 0, f"{covered.name}: lines its ranks never ran (Missing):\n{shown.stdout}{shown.stderr}"


def test_agreement_through_a_collective(record_property):
    # ranks of one host agree through shared memory; ranks spread over hosts through a 16-byte
    # allreduce: its mismatch errors, join, barrier and stall handling, forced here on one host
    run_under_mpiexec(record_property, ["tests/parallel/test_collectives.py",
                                        "tests/parallel/test_timeline_and_stall.py",
                       "-k", "agreement_road or mismatch or join or barrier or stall or bad_root"],
                      HVD_NOTEBOOK_SHM_AGREEMENT="0")


def test_the_noise_scale_on_four_ranks(record_property):
    # the known answer holds for any number of ranks (two cores: oversubscribed)
    run_under_mpiexec(record_property, ["tests/parallel/test_noise_scale.py", "-k", "keras_fit_measures_the_known"],
                      ranks=4)
