"""``hvd-notebook setup-node`` refuses a hub environment that users other than root could change
(hvd_notebook/cluster/node/hubenv.py): real folders, made another user's (uid 65534) with chown, or writable by
group or others, in the environment, above it or behind a link; and the real command, run by a real
environment's Python, refuses one and makes nothing. Root only: as another user, every folder made is
that user's, and setup-node refuses to run at all."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_notebook.cluster.node import hubenv

ROOT = Path(__file__).resolve().parents[2]
NOBODY = 65534
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="makes root's folders and chowns them to another uid: needs "
                             "root (the suite's root run covers it)")


def _env(where: Path) -> Path:
    """An environment's folders as pip lays them out, with the panel and the server's config; mode 0755/0644."""
    lab = where / "share" / "jupyter" / "labextensions" / "hvd-notebook-lab" / "static"
    config = where / "etc" / "jupyter" / "jupyter_server_config.d"
    for folder in (where / "bin", where / "lib" / "python3" / "site-packages", lab, config):
        folder.mkdir(parents=True, exist_ok=True)
    (lab.parent / "package.json").write_text("{}")
    (lab / "remoteEntry.0.js").write_text("")
    (config / "hvd_notebook.json").write_text("{}")
    for path in [where, *where.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return where


@pytest.fixture
def above(tmp_path: Path) -> Path:
    """A root-only folder for the environments (tmp_path's own mode is pytest's business)."""
    folder = tmp_path / "opt"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    return folder


@as_root
def test_an_environment_only_root_can_write_is_accepted(above):
    assert hubenv.unsafe_paths(_env(above / "hub")) == []
    assert hubenv.refusal(above / "hub") is None


@as_root
def test_a_labextensions_folder_of_another_user_is_refused_with_the_fix(above):
    env = _env(above / "hub")
    labextensions = env / "share" / "jupyter" / "labextensions"
    os.chown(labextensions, NOBODY, NOBODY)
    assert hubenv.unsafe_paths(env) == [labextensions]
    said = hubenv.refusal(env)
    assert str(labextensions) in said and f"chown -R root: {env} && chmod -R go-w {env}" in said, said


@as_root
def test_a_group_writable_server_config_is_refused(above):
    config = _env(above / "hub") / "etc" / "jupyter" / "jupyter_server_config.d" / "hvd_notebook.json"
    config.chmod(0o664)
    assert hubenv.unsafe_paths(above / "hub") == [config]


@as_root
def test_a_link_into_a_checkout_another_user_can_write_is_refused(above):
    env = _env(above / "hub")
    checkout = above / "checkout" / "labextension"
    checkout.mkdir(parents=True, mode=0o755)
    os.chown(checkout.parent, NOBODY, NOBODY)  # an admin's own unprivileged account, say
    lab = env / "share" / "jupyter" / "labextensions" / "hvd-notebook-lab"
    (lab / "static" / "remoteEntry.0.js").unlink()
    (lab / "static").rmdir()
    (lab / "package.json").unlink()
    lab.rmdir()
    lab.symlink_to(checkout)
    assert hubenv.unsafe_paths(env) == [checkout.parent]
    assert f"chown root: {checkout.parent} && chmod go-w {checkout.parent}" in hubenv.refusal(env)


@as_root
def test_a_folder_above_others_may_write_is_refused_and_a_sticky_one_is_not(above):
    env = _env(above / "hub")
    above.chmod(0o777)
    assert hubenv.unsafe_paths(env) == [above]
    above.chmod(0o1777)  # as /tmp: others cannot rename or remove root's hub folder
    assert hubenv.unsafe_paths(env) == []


@as_root
def test_setup_node_refuses_an_environment_of_another_user_and_makes_nothing(tmp_path):
    """The real command, run as root by a real venv's Python (its sys.prefix the hub's environment), the venv
    another user's; it sees .venv's packages, and the package under test, through sys.path."""
    env = tmp_path / "hub"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    site = subprocess.run([str(env / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "suite.pth").write_text("\n".join(sys.path[1:]) + "\n")
    os.chown(env, NOBODY, NOBODY)
    leases = tmp_path / "leases"
    done = subprocess.run([str(env / "bin" / "python"), "-m", "hvd_notebook.cli", "setup-node", "--gpus", "0"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "HVD_NOTEBOOK_LEASE_DIR": str(leases)})
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"hub's Python environment {env}" in done.stderr and f"chown -R root: {env}" in done.stderr, done.stderr
    assert not leases.exists()
