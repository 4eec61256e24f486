"""binder/postBuild, as mybinder.org runs it, in a scratch virtual environment:
it installs the package and the kernel, and the kernel it installs has the magics."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_postbuild_installs_package_and_kernel(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(ROOT, repo, ignore=shutil.ignore_patterns(".venv", "build", "*.egg-info", "__pycache__", ".git",
                                                            ".pytest_cache", ".ruff_cache"))
    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=120)
    env = {**os.environ, "PATH": f"{env_dir / 'bin'}:{os.environ['PATH']}", "VIRTUAL_ENV": str(env_dir),
           "HOME": str(tmp_path / "home")}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", "binder/postBuild"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    spec_file = env_dir / "share" / "jupyter" / "kernels" / "hvd-tensorflow" / "kernel.json"
    spec = json.loads(spec_file.read_text())
    assert spec["argv"][0] == str(env_dir / "bin" / "python") and "--ext=hvd_notebook" in spec["argv"]
    check = subprocess.run([str(env_dir / "bin" / "python"), "-c",
                            "import hvd_notebook, tensorflow, ipyparallel, mpi4py, bqplot; "
                            "from hvd_notebook.cluster import find_mpiexec; print(find_mpiexec(None))"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    assert check.stdout.strip() == str(env_dir / "bin" / "mpiexec")
