"""Across hosts the engines' key reaches each other host in a 0600 file copied over the launcher's remote
shell (``cluster.keycopy``), never in the launcher's environment (which hydra sends to its proxies over an
unauthenticated TCP port). The remote shell here is a stand-in for ssh that runs the remote command on
this machine, as ssh would on the other host."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from hvd_notebook import private
from hvd_notebook.cluster.errors import ClusterError
from hvd_notebook.cluster.launching import keycopy
from hvd_notebook.cluster.launching.launch import make_ipp_cluster
from hvd_notebook.cluster.launching.placements.host_list import HostList
from hvd_notebook.cluster.launching.placements.one_host import OneHost
from hvd_notebook.config import ClusterOptions

REMOTE = "hvd-remote.invalid"  # (resolves nowhere: never this host)
SECRET = {"key": "", "curve_serverkey": "the-server-key-that-alone-lets-a-client-in", "interface": "tcp://10.0.0.1",
          "registration": 4242, "location": "10.0.0.1", "signature_scheme": "hmac-sha256", "pack": "json"}


@pytest.fixture
def fake_ssh(tmp_path, monkeypatch):
    """An ssh look-alike, ``FAKE [options] HOST COMMAND``: logs its arguments, then runs COMMAND with sh,
    here; the private folders are then under this test's TMPDIR."""
    log = tmp_path / "ssh.log"
    script = tmp_path / "fake-ssh"
    script.write_text(f"#!/bin/sh\nwhile [ \"${{1#-}}\" != \"$1\" ]; do shift; done\n"
                      f"echo \"$@\" >> {log}\nhost=$1; shift\n"
                      "[ \"$host\" = unreachable ] && {\n"
                      "  echo \"ssh: connect to host $host port 22: No route to host\" >&2; exit 255; }\n"
                      "[ \"$host\" = bare ] && {  # (a host without this environment)\n"
                      "  echo \"bash: line 1: ${1%% *}: No such file or directory\" >&2; exit 127; }\n"
                      "exec /bin/sh -c \"$*\"\n")
    script.chmod(0o755)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", None)  # (read TMPDIR again)
    return script, log


def _connection_file(base: Path, cluster_id: str = "hvd-1-1") -> Path:
    security = base
    for part in (cluster_id, "profile", "security"):
        security = private.ensure_dir(security / part)
    path = security / f"ipcontroller-{cluster_id}-engine.json"
    private.write_text(path, json.dumps(SECRET))
    return path


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_remote_shell_is_the_launchers():
    assert keycopy.remote_shell([], {}, open_mpi=False) == ["ssh"]
    assert keycopy.remote_shell(["-launcher", "ssh", "-launcher-exec", "/x/nsexec", "-iface", "br0"], {}, False) == \
        ["/x/nsexec"]
    assert keycopy.remote_shell(["-bootstrap-exec=/x/myssh"], {}, False) == ["/x/myssh"]
    assert keycopy.remote_shell([], {"HYDRA_LAUNCHER_EXEC": "/x/env-ssh"}, False) == ["/x/env-ssh"]
    assert keycopy.remote_shell(["-launcher", "rsh"], {}, False) == ["rsh"]
    assert keycopy.remote_shell(["--mca", "plm_rsh_agent", "ssh -p 2222 : rsh"], {}, True) == ["ssh", "-p", "2222"]
    assert keycopy.remote_shell([], {"OMPI_MCA_plm_rsh_agent": "/x/agent"}, True) == ["/x/agent"]


def test_the_file_lands_at_the_same_path_on_the_other_host_owner_only(fake_ssh, tmp_path):
    script, log = fake_ssh
    base = private.base_dir()
    assert base.parent == tmp_path / "tmp"
    path = _connection_file(base)
    keycopy.copy_to_hosts(path, [REMOTE], [str(script)])
    (line,) = log.read_text().splitlines()
    assert line.startswith(f"{REMOTE} {sys.executable} -m hvd_notebook.cluster.launching.keycopy {base} "
                           "hvd-1-1/profile/"), line
    assert json.loads(path.read_text()) == SECRET and _mode(path) == 0o600


def test_the_receiver_makes_the_folders_owner_only_and_refuses_what_others_made(fake_ssh, tmp_path):
    base = tmp_path / "tmp" / f"hvd_notebook-{private.user_name()}"  # not made yet on the "other host"
    relative = Path("hvd-2-2/profile/security/ipcontroller-hvd-2-2-engine.json")
    landed = keycopy.receive(base, relative, b"{}")
    assert landed == base / relative and _mode(landed) == 0o600
    assert all(_mode(folder) == 0o700 for folder in (base, base / "hvd-2-2", landed.parent))
    base.chmod(0o777)  # a private folder others may write (or another user's): refused, nothing written
    with pytest.raises(private.UnsafePathError):
        keycopy.receive(base, relative.with_name("other.json"), b"{}")
    assert not (landed.parent / "other.json").exists()
    base.chmod(0o700)
    landed.parent.rename(landed.parent.with_name("moved"))
    landed.parent.symlink_to(landed.parent.with_name("moved"))  # a link where a folder should be: refused
    with pytest.raises(private.UnsafePathError):
        keycopy.receive(base, relative, b"{}")
    for bad_base, bad_relative in ((tmp_path / "elsewhere", relative), (base, Path("../escape.json")),
                                   (base, Path("/etc/passwd"))):
        with pytest.raises(private.UnsafePathError):
            keycopy.receive(bad_base, bad_relative, b"{}")
    assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "tmp" / "escape.json").exists()


def test_a_host_the_copy_cannot_reach_is_named(fake_ssh):
    script, _ = fake_ssh
    path = _connection_file(private.base_dir())
    with pytest.raises(ClusterError, match=r"^host unreachable is unreachable \(No route to host\)\. "):
        keycopy.copy_to_hosts(path, ["unreachable"], [str(script)])
    with pytest.raises(ClusterError, match="^host bare cannot start a rank of this environment: .*No such file"):
        keycopy.copy_to_hosts(path, ["bare"], [str(script)])


class _Controller:
    """Stands for a started controller: what ipyparallel would put in $IPP_CONNECTION_INFO."""

    state = "after"  # (so that ipyparallel writes no cluster file of it)

    async def get_connection_info(self):
        return {"engine": SECRET}


def test_the_launcher_of_a_host_list_gets_no_key_in_its_environment(fake_ssh, tmp_path, monkeypatch):
    from ipyparallel.cluster.launcher import LocalProcessLauncher

    script, log = fake_ssh
    placement = HostList(ClusterOptions(hosts=f"localhost:1,{REMOTE}:1",
                                        mpi_args=("-launcher", "ssh", "-launcher-exec", str(script))))
    base = private.base_dir()
    path = _connection_file(base, "hvd-3-3")
    cluster = make_ipp_cluster(placement, "hvd-3-3", base / "hvd-3-3" / "profile", 2, "10.0.0.1")
    cluster.controller = _Controller()
    launched = {}

    def start(self):
        launched.update(args=list(self.args), env=self.get_env())

    monkeypatch.setattr(LocalProcessLauncher, "start", start)
    asyncio.run(cluster.start_engines(2))
    assert "IPP_CONNECTION_INFO" not in launched["env"], launched["env"]
    assert not any(SECRET["curve_serverkey"] in value for value in launched["env"].values())
    assert f"--file={path}" in launched["args"] and SECRET["curve_serverkey"] not in " ".join(launched["args"])
    assert [line.split()[0] for line in log.read_text().splitlines()] == [REMOTE]  # (not localhost)
    assert _mode(path) == 0o600


def test_one_host_keeps_ipyparallels_own_launcher(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert OneHost(ClusterOptions()).engine_launcher == "mpi"
    assert os.environ.get("IPP_CONNECTION_INFO") is None
