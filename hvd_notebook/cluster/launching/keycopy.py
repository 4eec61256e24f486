"""Across hosts, the engines' connection file (which holds the cluster's key) is copied to each other
host over ssh, into the user's private folder there, and the engines read it from that file.

It never rides in the launcher's environment: ipyparallel would put it in ``$IPP_CONNECTION_INFO``,
and MPICH's hydra sends the whole environment to its proxies over a TCP port that anyone who reaches
the host can connect to; with CurveZMQ, the file's server key alone lets a client in.

The copy goes over the same remote shell the launcher reaches the hosts with (hydra's
``-launcher-exec``, Open MPI's ``plm_rsh_agent``; ssh by default), to this module run on the other
host: ``python -m hvd_notebook.cluster.launching.keycopy BASE RELATIVE`` with the file on its stdin. There it
lands at the same path as here (the engines' ``--file`` is one path for every host), written 0600
inside folders that are the user's own with no access for others, or it is refused.
"""

from __future__ import annotations

import functools
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ... import private
from ..errors import ClusterError
from . import hosts as hostlib
from .diagnosis import diagnose_launch, telling_line

COPY_TIMEOUT_S = 60.0
FILE_WAIT_S = 30.0  # for the controller to write the engines' connection file
MAX_BYTES = 64 << 10  # a connection file is well under 1 KiB

HYDRA_LAUNCHER = ("-launcher", "-bootstrap")
HYDRA_EXEC = ("-launcher-exec", "-bootstrap-exec")
OPEN_MPI_MCA = ("--mca", "-mca", "--prtemca", "-prtemca")
OPEN_MPI_AGENT = ("plm_rsh_agent", "plm_ssh_agent")


def remote_shell(mpi_args: list[str] | tuple[str, ...], environ: dict[str, str], open_mpi: bool) -> list[str]:
    """The command that reaches another host the way the launcher does: hydra's ``-launcher-exec``
    (``HYDRA_LAUNCHER_EXEC``) or its ``-launcher rsh``; Open MPI's ``plm_rsh_agent``; else ssh.

    Args:
        mpi_args: the launcher's extra arguments (``--mpi-args``).
        environ: the launcher's environment.
        open_mpi: whether the launcher is Open MPI's.
    """
    args = list(mpi_args)
    if open_mpi:
        agent = _mca_value(args, OPEN_MPI_AGENT) or environ.get("OMPI_MCA_plm_rsh_agent") or environ.get(
            "PRTE_MCA_plm_ssh_agent") or "ssh"
        return shlex.split(agent.split(":")[0]) or ["ssh"]
    found = _option_value(args, HYDRA_EXEC) or environ.get("HYDRA_LAUNCHER_EXEC") or environ.get("HYDRA_BOOTSTRAP_EXEC")
    if found:
        return [found]
    launcher = _option_value(args, HYDRA_LAUNCHER) or environ.get("HYDRA_LAUNCHER") or environ.get("HYDRA_BOOTSTRAP")
    return ["rsh"] if launcher == "rsh" else ["ssh"]


def _option_value(args: list[str], names: tuple[str, ...]) -> str | None:
    """The value of the last ``-name VALUE`` or ``-name=VALUE`` among ``args``."""
    value = None
    for i, arg in enumerate(args):
        name, eq, glued = arg.partition("=")
        if name in names:
            value = glued if eq else (args[i + 1] if i + 1 < len(args) else None)
    return value


def _mca_value(args: list[str], params: tuple[str, ...]) -> str | None:
    value = None
    for i, arg in enumerate(args[:-2]):
        if arg in OPEN_MPI_MCA and args[i + 1] in params:
            value = args[i + 2]
    return value


def copy_command(shell: list[str], host: str, base: Path, relative: Path) -> list[str]:
    """The command that copies the file (on its stdin) to ``base/relative`` on ``host``.

    Args:
        shell: the remote shell's command (``remote_shell``).
        host: the host to copy to.
        base: the private folder there.
        relative: the file's path inside ``base``.
    """
    flags = ["-x"] if Path(shell[0]).name == "ssh" else []  # (no X11 forwarding, as hydra asks of ssh)
    remote = shlex.join([sys.executable, "-m", __name__, str(base), str(relative)])
    return [*shell, *flags, host, remote]


def copy_to_hosts(path: Path, hosts: list[str], shell: list[str], base: Path | None = None,
                  timeout: float = COPY_TIMEOUT_S) -> None:
    """Copy the file ``path`` (inside ``base``, the user's private folder here) to the same path on
    each of ``hosts``, all at once; a ClusterError naming the first host that failed, and why.

    Args:
        path: the file to copy.
        hosts: the hosts to copy to.
        shell: the remote shell's command (``remote_shell``).
        base: the private folder it lies in; None for the default.
        timeout: seconds the copies may take.
    """
    base = base or private.base_dir()
    try:
        relative = path.relative_to(base)
    except ValueError:
        raise ClusterError(f"the engines' connection file {path} is not in the private folder {base}; it was "
                           "not copied to the other hosts.") from None
    data = private.read_bytes(path, max_bytes=MAX_BYTES)
    copies = {host: subprocess.Popen(copy_command(shell, host, base, relative), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
              for host in hosts}
    failures = [why for host, copy in copies.items() if (why := _outcome(host, copy, data, shell, timeout))]
    if failures:
        said = "; ".join(f.rstrip(".") for f in failures)
        raise ClusterError(f"{said}. (Across hosts the engines' key is copied to each host with {shlex.join(shell)}, "
                           "the launcher's own way there, never put in their environment.)")


def _outcome(host: str, copy: subprocess.Popen, data: bytes, shell: list[str], timeout: float) -> str | None:
    """Why the copy to ``host`` failed (in the words the launcher's own failures get), or None."""
    try:
        out, _ = copy.communicate(data, timeout=timeout)
    except subprocess.TimeoutExpired:
        copy.kill()
        copy.communicate()
        return f"host {host} did not take the engines' connection file within {timeout:g} s"
    if copy.returncode == 0:
        return None
    said = out.decode(errors="replace")
    named = [cause for cause in diagnose_launch(said) if cause.startswith("host ")]
    if named:
        return named[0]
    if copy.returncode in (126, 127):  # the remote shell found no such Python (or could not run it)
        return f"host {host} cannot start a rank of this environment: {telling_line(said)}"
    return (f"the engines' connection file could not be copied to host {host} with {shlex.join(shell)}: "
            f"{telling_line(said)}")


def other_hosts(names: list[str]) -> list[str]:
    """The hosts of ``names`` that are not this one (those need a copy).

    Args:
        names: the cluster's host names.
    """
    return [name for name in names if not hostlib.is_this_host(name)]


def wait_for(path: Path, timeout: float = FILE_WAIT_S) -> None:
    """Wait until the controller has written ``path``; a ClusterError at the timeout.

    Args:
        path: the file to wait for.
        timeout: seconds to wait.
    """
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise ClusterError(f"the controller wrote no engine connection file ({path}) within {timeout:g} s.")
        time.sleep(0.05)


@functools.cache
def engine_launcher_class() -> Any:
    """ipyparallel's MPI engine launcher, with the engines reading their connection file (``--file``),
    copied first to the other hosts, instead of ``$IPP_CONNECTION_INFO`` in the launcher's environment
    (made on first use: ipyparallel is not imported before)."""
    from ipyparallel.cluster.launcher import MPIEngineSetLauncher
    from traitlets import List, Unicode

    class KeyFileMPIEngineSetLauncher(MPIEngineSetLauncher):
        """Engines started by mpiexec that read the cluster's key from a 0600 file on each host."""

        remote_hosts = List(Unicode(), config=True, help="the hosts that get a copy of the connection file")
        remote_shell = List(Unicode(), ["ssh"], config=True, help="how the launcher reaches those hosts")

        @property
        def program_args(self) -> list[str]:
            return [*super().program_args, f"--file={self.connection_files['engine']}"]

        def get_env(self) -> dict[str, str]:
            env = super().get_env()
            env.pop("IPP_CONNECTION_INFO", None)  # (the Cluster is told not to set it; never let it through)
            return env

        def start(self, n: int) -> Any:
            path = Path(self.connection_files["engine"])
            wait_for(path)
            if self.remote_hosts:
                copy_to_hosts(path, list(self.remote_hosts), list(self.remote_shell))
            return super().start(n)

    return KeyFileMPIEngineSetLauncher


# ------------------------------------------------------------ on the other host
def receive(base: Path, relative: Path, data: bytes) -> Path:
    """Write ``data`` to ``base/relative``, 0600: ``base`` must be one of this host's places for the
    user's private folder (made where it is missing, in a parent no one else can tamper with); it and the
    folders below it are made owner-only or checked (``private.ensure_dir``); else ``UnsafePathError``.

    Args:
        base: the private folder on this host.
        relative: the file's path inside ``base``.
        data: the file's content.
    """
    if relative.is_absolute() or ".." in relative.parts or not relative.parts:
        raise private.UnsafePathError(f"{relative}: not a path inside the private folder")
    if base not in private.candidate_bases():
        raise private.UnsafePathError(f"{base} is not where this host keeps {private.user_name()}'s private "
                                      "folder for hvd_notebook")
    if not os.path.lexists(base):
        private.check_parent(base)
    folder = private.ensure_dir(base)
    for part in relative.parent.parts:
        folder = private.ensure_dir(folder / part)
    private.write_bytes(folder / relative.name, data, 0o600)
    return folder / relative.name


def main(argv: list[str]) -> int:
    """``python -m hvd_notebook.cluster.launching.keycopy BASE RELATIVE``: ``receive`` the file on stdin; an exit code.

    Args:
        argv: the command line's arguments.
    """
    base, relative = (Path(a) for a in argv)
    data = sys.stdin.buffer.read(MAX_BYTES + 1)
    try:
        if len(data) > MAX_BYTES:
            raise private.UnsafePathError(f"more than {MAX_BYTES} bytes came for {relative}")
        receive(base, relative, data)
    except OSError as exc:
        print(f"hvd_notebook on {os.uname().nodename}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
