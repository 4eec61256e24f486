"""binder/postBuild, as mybinder.org runs it, in a scratch virtual environment:
it installs the package and the kernel, and the kernel it installs has the magics.

The scratch environment sees this one's packages (each linked into a folder on its path), except
hvd_notebook and MPICH's wheel: postBuild's pip installs those two, and finds every other requirement
already satisfied instead of downloading TensorFlow again (that the requirements resolve from nothing is
what ``make install`` in a fresh clone shows)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_postbuild_installs_package_and_kernel(tmp_path):
    repo = tmp_path / "repo"
    # (with the JupyterLab extension as make install built it here, newer than its sources, times kept: postBuild
    # finds it current and links it; the build itself runs in every fresh clone's make install)
    shutil.copytree(ROOT, repo, ignore=_not_in_a_clone)
    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=120)
    seed_installed_packages(tmp_path / "seed", env_dir)
    env = {**os.environ, "PATH": f"{env_dir / 'bin'}:{os.environ['PATH']}", "VIRTUAL_ENV": str(env_dir),
           "HOME": str(tmp_path / "home"), "npm_config_cache": str(Path.home() / ".npm")}  # (npm's own cache)
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", "binder/postBuild"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    spec_file = env_dir / "share" / "jupyter" / "kernels" / "hvd-tensorflow" / "kernel.json"
    spec = json.loads(spec_file.read_text())
    assert spec["argv"][0] == str(env_dir / "bin" / "python") and "--ext=hvd_notebook" in spec["argv"]
    check = subprocess.run([str(env_dir / "bin" / "python"), "-c",
                            "import hvd_notebook, tensorflow, ipyparallel, mpi4py, bqplot; "
                            "from hvd_notebook.cluster.launching.placements import find_mpiexec; "
                            "print(find_mpiexec(None))"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stderr[-3000:]
    assert check.stdout.strip() == str(env_dir / "bin" / "mpiexec")
    # the JupyterLab panel: found by the environment's JupyterLab, its server side enabled
    extensions = subprocess.run([str(env_dir / "bin" / "python"), "-m", "jupyterlab.labextensions", "list"], env=env,
                                capture_output=True, text=True, timeout=120)
    assert re.search(r"hvd-notebook-lab v[\d.]+ .*enabled.*OK", extensions.stdout + extensions.stderr), extensions
    servers = subprocess.run([str(env_dir / "bin" / "python"), "-m", "jupyter_server", "extension", "list"], env=env,
                             capture_output=True, text=True, timeout=120)
    assert re.search(r"hvd_notebook\.lab .*enabled", servers.stdout + servers.stderr), servers


def _not_in_a_clone(folder: str, names: list[str]) -> set[str]:
    """What a fresh clone does not have: the environment, builds, caches, npm's packages."""
    return {n for n in names if n in (".venv", "build", "__pycache__", ".git", ".pytest_cache", ".ruff_cache",
                                      "node_modules", "lib") or n.endswith(".egg-info")}


LEFT_TO_POSTBUILD = ("hvd_notebook", "__editable__", "_hvd_notebook", "mpich-")  # (and .pth files)


def seed_installed_packages(seed: Path, env_dir: Path) -> None:
    """Put this environment's packages, but for those postBuild must install itself, on ``env_dir``'s path."""
    seed.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(LEFT_TO_POSTBUILD) and entry.suffix != ".pth":
            (seed / entry.name).symlink_to(entry)
    (site_packages,) = (env_dir / "lib").glob("python*/site-packages")
    (site_packages / "hvd-test-seed.pth").write_text(f"{seed}\n")
