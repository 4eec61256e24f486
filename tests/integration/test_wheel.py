"""The wheel is the JupyterLab panel's whole install (docs/jupyterhub.md). Built from a fresh clone (no
node_modules, no built extension) by the package's own build backend, it holds the prebuilt extension and the
server extension's config; installed into a fresh environment, it gives JupyterLab the panel as plain files that
point into no checkout. A build that cannot run npm fails, saying what to install.

The clone is of HEAD with the working tree's changes copied in, so the wheel is of the code under test. It is
built with ``--no-build-isolation`` by .venv's pip: an isolated build would fetch setuptools and jupyter-builder
from the package index at every run, and runs the same setup.py. The checkout's node_modules, where it was
installed from the same package-lock.json, is hard-linked into the clone (npm ci would take a minute to
unpack the same 26,000 files from npm's cache); TypeScript and webpack then build the panel anew."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv" / "bin" / "python"
DATA = "hvd_notebook-0.1.0.data/data"
LAB = "share/jupyter/labextensions/hvd-notebook-lab"
SERVER_CONFIG = "etc/jupyter/jupyter_server_config.d/hvd_notebook.json"
NODE_TOOLS = {"npm", "npx", "node", "nodejs", "corepack"}

pytestmark = pytest.mark.skipif(shutil.which("npm") is None, reason="npm is missing (apt-get install nodejs npm): "
                                "the wheel's build runs it to build the JupyterLab panel")


def _clone(dest: Path) -> Path:
    """A clone of HEAD at ``dest``, with the working tree's changed and new files (not the ignored) copied in."""
    subprocess.run(["git", "clone", "--quiet", str(ROOT), str(dest)], check=True, capture_output=True)
    changed = subprocess.run(["git", "-C", str(ROOT), "ls-files", "--modified", "--others", "--exclude-standard", "-z"],
                             check=True, capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, changed):
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
        else:
            (dest / name).unlink(missing_ok=True)  # (deleted in the working tree)
    return dest


def _pip_wheel(source: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``pip wheel`` of ``source`` into ``source/dist``, as an admin builds it (docs/jupyterhub.md)."""
    return subprocess.run([str(PYTHON), "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                           str(source / "dist"), str(source)], capture_output=True, text=True, timeout=600,
                          env=env, cwd=source)


def _reuse_node_modules(dest: Path) -> None:
    """The checkout's node_modules hard-linked into ``dest`` where it is of the same package-lock.json, and made
    to look current to scripts/build-labextension.sh (else its npm ci installs it)."""
    ours = ROOT / "labextension"
    lock = (ours / "package-lock.json").read_bytes()
    if not (ours / "node_modules").is_dir() or lock != (dest / "package-lock.json").read_bytes():
        return
    if (ours / "package-lock.json").stat().st_mtime > (ours / "node_modules").stat().st_mtime:
        return  # (not installed since the lock changed)
    subprocess.run(["cp", "-al", str(ours / "node_modules"), str(dest / "node_modules")], check=True)
    os.utime(dest / "node_modules")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a fresh clone."""
    clone = _clone(tmp_path_factory.mktemp("wheel") / "clone")
    assert not (clone / "hvd_notebook" / "lab" / "labextension").exists()
    _reuse_node_modules(clone / "labextension")
    built = _pip_wheel(clone)
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    return next((clone / "dist").glob("hvd_notebook-*.whl"))


def test_the_wheel_holds_the_panel_and_its_server_config(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    assert f"{DATA}/{LAB}/package.json" in names, sorted(names)
    assert any(re.fullmatch(rf"{DATA}/{LAB}/static/remoteEntry\.\w+\.js", n) for n in names), sorted(names)
    assert f"{DATA}/{SERVER_CONFIG}" in names, sorted(names)


def _purelib(python: Path) -> str:
    """The site-packages folder of ``python``'s environment."""
    return subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()


def _fresh_env(where: Path, wheel: Path) -> Path:
    """A fresh ``python -m venv`` with the wheel installed (no dependencies) and .venv's packages after its own
    on sys.path (a plain path in a .pth file: .venv's editable install of the checkout is not loaded)."""
    subprocess.run([str(PYTHON), "-m", "venv", "--without-pip", str(where)], check=True)
    subprocess.run([str(PYTHON), "-m", "pip", "--python", str(where / "bin" / "python"), "install", "--quiet",
                    "--no-deps", str(wheel)], check=True, capture_output=True, timeout=300)
    Path(_purelib(where / "bin" / "python"), "suite-packages.pth").write_text(_purelib(PYTHON) + "\n")
    return where


def _jupyter(env: Path, module: str, *args: str) -> str:
    """A Jupyter command's main run by the fresh environment's Python (``jupyter X`` would run .venv's); its
    output without colours."""
    code = f"import sys; from {module} import main; sys.exit(main())"
    done = subprocess.run([str(env / "bin" / "python"), "-c", code, *args], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=120, cwd=env,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})  # (its two streams in their order)
    assert done.returncode == 0, done.stdout
    return re.sub(r"\x1b\[[0-9;]*m", "", done.stdout)


def test_the_installed_wheel_gives_jupyterlab_the_panel(wheel, tmp_path):
    env = _fresh_env(tmp_path / "env", wheel)
    lab, config = env / LAB, env / SERVER_CONFIG
    files = sorted(lab.rglob("*"))
    assert (lab / "package.json") in files and any(f.name.startswith("remoteEntry.") for f in files), files
    for path in [lab, *files, config]:
        assert not path.is_symlink() and (path.is_file() or path.is_dir()), f"{path} is not a plain file or folder"
        assert path.resolve().is_relative_to(env), f"{path} points out of the environment, to {path.resolve()}"
    imported = subprocess.run([str(env / "bin" / "python"), "-c", "import hvd_notebook.lab as m; print(m.__file__)"],
                              check=True, capture_output=True, text=True, cwd=env).stdout  # (not the checkout's)
    assert Path(imported.strip()).is_relative_to(env), imported

    listed = _jupyter(env, "jupyterlab.labextensions", "list")
    section = listed.split(f"{env / 'share/jupyter/labextensions'}\n", 1)
    assert len(section) == 2 and re.match(r"\s+hvd-notebook-lab v\S+ enabled OK", section[1]), listed
    servers = _jupyter(env, "jupyter_server.extension.serverextension", "list")
    section = servers.split(f"Config dir: {env / 'etc/jupyter'}\n", 1)
    assert len(section) == 2 and re.match(r"\s+hvd_notebook\.lab enabled\s+- Validating hvd_notebook\.lab\.\.\.\s+"
                                          r"hvd_notebook\.lab\s+OK", section[1]), servers


def test_a_build_without_npm_fails_saying_what_to_install(tmp_path):
    clone = _clone(tmp_path / "clone")
    bin_dir = tmp_path / "bin"  # PATH's tools without Node.js and npm
    bin_dir.mkdir()
    for folder in filter(None, os.environ["PATH"].split(os.pathsep)):
        for tool in Path(folder).glob("*") if Path(folder).is_dir() else []:
            if tool.name not in NODE_TOOLS and not (bin_dir / tool.name).exists():
                (bin_dir / tool.name).symlink_to(tool)
    built = _pip_wheel(clone, env={**os.environ, "PATH": str(bin_dir)})
    assert built.returncode != 0, built.stdout[-2000:]
    said = built.stdout + built.stderr
    assert "needs Node.js (18 or newer) and npm" in said and "apt-get install nodejs npm" in said, said[-4000:]
    assert not list(clone.glob("dist/*.whl"))
