"""Where the ranks run: on this host, on a list of hosts, or in a Slurm allocation.

Each placement settles how many ranks there are, which launcher starts them and
with which arguments, where the controller listens, which GPUs the ranks get,
and how a failed launch is explained. ``choose_placement`` picks one from the
``%hvd start`` options.
"""

from __future__ import annotations

import copy
import functools
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from .. import config
from ..config import DEFAULT_RANKS_WITHOUT_GPU, ClusterOptions, Launcher
from . import hosts as hostlib
from . import keycopy, leases, shm
from .diagnosis import diagnose_launch, names_a_host, telling_line
from .errors import ClusterError
from .policy import Policy

# MPI between ranks of one host over shared memory only: UCX (MPICH's default
# netmod in the wheel) otherwise opens a TCP listener on the host's network
# interface. Not UCX's "sm" alias: it includes the SysV transport, whose segments
# are mode 0660 (readable by the user's group). The user's own --env or environment wins.
LOOPBACK_ENV = {"UCX_TLS": "self,posix,cma"}

GFORKER = "mpiexec.gforker"


def find_mpiexec(requested: str | None) -> str:
    """The ``mpiexec`` to launch engines with: the one asked for, else the one
    beside this Python (the mpich wheel's), else the first on ``PATH``."""
    if requested:
        found = shutil.which(requested)
        if found is None:
            raise ClusterError(
                f"--mpiexec {requested!r} was not found or is not executable. Give the full "
                "path of the mpiexec that belongs to the MPI your mpi4py was built for "
                "(python -c 'import mpi4py; print(mpi4py.get_config())' tells which)."
            )
        return found
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise ClusterError(
            "No mpiexec found beside this Python or on PATH. Install an MPI runtime "
            "(`pip install mpich` in this environment, or your system's MPI with mpi4py "
            "built for it) or pass --mpiexec PATH."
        )
    return found


@functools.cache
def is_open_mpi(mpiexec: str) -> bool:
    """Open MPI's mpiexec takes --host; MPICH's hydra takes -hosts."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (subprocess.SubprocessError, OSError):
        return False
    return "Open MPI" in out or "OpenRTE" in out


def _at_least_one(n: int) -> int:
    if n < 1:
        raise ClusterError(f"-n {n}: a cluster needs at least one rank; try -n 2.")
    return n


class Placement:
    """Ranks started by ``mpiexec`` on this host; subclasses place them elsewhere."""

    launcher_name = "mpiexec"  # what messages call the launcher

    def __init__(self, options: ClusterOptions) -> None:
        self.options = options
        self.command = find_mpiexec(options.mpiexec)  # the launcher's executable

    def ranks(self, host_gpus: list[str]) -> int | None:
        """The number of ranks; None where ``take_gpus`` settles it at start."""
        raise NotImplementedError

    def controller_ip(self) -> str:
        """The address the controller listens on."""
        raise NotImplementedError

    @property
    def gforker(self) -> bool:
        """Is the launcher MPICH's gforker (whose worlds' shared-memory names follow from its pid)?"""
        return self.command.endswith(GFORKER)

    def launcher_prefix(self) -> list[str]:
        """What goes before the launcher on its command line: for gforker, ``shmguard``, which refuses
        a world whose shared-memory names another user holds, then becomes the launcher."""
        return shm.guard_command() if self.gforker else []

    def launcher_args(self) -> list[str]:
        """The launcher's own options: what puts the ranks in place, then the user's."""
        # gforker reports each rank's exit code or signal when the world ends
        exitinfo = ["-exitinfo"] if self.gforker else []
        return [*exitinfo, *self._placement_args(), *self.options.mpi_args]

    def check_room(self, n: int) -> None:
        """A ClusterError where this host cannot hold the shared memory of the ranks placed on it."""

    def _placement_args(self) -> list[str]:
        return []

    def rank_env(self, environ: dict[str, str]) -> dict[str, str]:
        """Defaults for every rank's environment, under what ``environ`` already sets."""
        return {}

    def take_gpus(self, host_gpus: list[str], n: int | None, owner: str,
                  rules: Policy | None = None) -> tuple[list[str], leases.Lease | None]:
        """The GPU ids the ranks pin by local rank, and the lease that holds them.
        Elsewhere than this host: the same ids on each host (leases, and the node's fair-sharing
        ``rules``, cover this host only; there the scheduler shares the nodes)."""
        return list(host_gpus), None

    def diagnose(self, output: str) -> list[str]:
        """Sentences saying why a launch that printed ``output`` failed."""
        return diagnose_launch(output)

    @property
    def engine_launcher(self) -> Any:
        """ipyparallel's engine launcher for this placement (its name, or the class)."""
        return "mpi"

    def configure_engines(self, cfg: Any) -> None:
        """Settle, in ipyparallel's ``cfg``, how the engines get the cluster's connection file."""


class OneHost(Placement):
    """Every rank on this host; nothing of the cluster listens beyond loopback."""

    def __init__(self, options: ClusterOptions) -> None:
        super().__init__(options)
        if options.mpiexec is None:
            self.command = self._single_host_launcher(self.command)

    @staticmethod
    def _single_host_launcher(mpiexec: str) -> str:
        """MPICH's gforker beside its ``mpiexec``, where there is one: hydra, the default
        launcher, listens for its proxies on a TCP port on every interface with no option
        to keep it on loopback; gforker forks the ranks itself and listens on no port."""
        gforker = Path(mpiexec).parent / GFORKER
        return str(gforker) if gforker.is_file() and os.access(gforker, os.X_OK) else mpiexec

    def ranks(self, host_gpus: list[str]) -> int | None:
        requested = self.options.n
        n = _at_least_one(requested if requested is not None else (len(host_gpus) or DEFAULT_RANKS_WITHOUT_GPU))
        if host_gpus and n > len(host_gpus):
            raise ClusterError(
                f"-n {n} ranks but only {len(host_gpus)} GPU(s) ({','.join(host_gpus)}) on this "
                f"host: one rank per GPU. Use -n {len(host_gpus)}, or --gpus none to run on CPUs."
            )
        return None if host_gpus and requested is None else n  # with GPUs: one rank per GPU free at start

    def controller_ip(self) -> str:
        return self.options.ip or "127.0.0.1"

    def check_room(self, n: int) -> None:
        shm.check_space(n)

    def rank_env(self, environ: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in LOOPBACK_ENV.items() if k not in environ}

    def take_gpus(self, host_gpus: list[str], n: int | None, owner: str,
                  rules: Policy | None = None) -> tuple[list[str], leases.Lease | None]:
        """GPUs held by other notebooks' clusters are skipped; the node's ``rules`` cap what one user's
        clusters hold together (GPUs, or CPU ranks where the ranks have none)."""
        room = rules.room(bool(host_gpus), n) if rules is not None else None
        if not host_gpus:
            return [], None
        lease = leases.acquire(host_gpus, n, owner, at_most=room)
        return lease.gpus, lease


class HostList(Placement):
    """Ranks on the hosts of -H or --hostfile, through ``mpiexec``."""

    def __init__(self, options: ClusterOptions) -> None:
        super().__init__(options)
        self.hosts = hostlib.parse_hosts(options.hosts) if options.hosts else hostlib.read_hostfile(options.hostfile)

    def ranks(self, host_gpus: list[str]) -> int | None:
        return _at_least_one(hostlib.check_slots(self.hosts, self.options.n))

    def controller_ip(self) -> str:
        return hostlib.controller_address([h.name for h in self.hosts], self.options.ip)

    def without(self, hosts: list[str]) -> HostList:
        """The same placement on the other hosts only (``-n`` then their slots); none where every host is
        left out (its ``slots`` then 0)."""
        rest = copy.copy(self)
        rest.hosts = [h for h in self.hosts if h.name not in hosts]
        rest.options = replace(self.options, hosts=",".join(f"{h.name}:{h.slots}" for h in rest.hosts),
                               hostfile=None, n=None)
        return rest

    @property
    def slots(self) -> int:
        """The hosts' slots together."""
        return sum(h.slots for h in self.hosts)

    def _hosts_option(self) -> str:
        return "--host" if is_open_mpi(self.command) else "-hosts"

    def _placement_args(self) -> list[str]:
        return [self._hosts_option(), ",".join(f"{h.name}:{h.slots}" for h in self.hosts)]

    @property
    def engine_launcher(self) -> Any:
        return keycopy.engine_launcher_class()

    def configure_engines(self, cfg: Any) -> None:
        """The engines read the connection file (``--file``), copied first to each other host over the
        launcher's own remote shell into the user's private folder there (``keycopy``): never in the
        launcher's environment, which hydra sends to its proxies over a TCP port anyone may connect to."""
        cfg.Cluster.send_engines_connection_env = False
        cfg.KeyFileMPIEngineSetLauncher.remote_hosts = keycopy.other_hosts([h.name for h in self.hosts])
        cfg.KeyFileMPIEngineSetLauncher.remote_shell = keycopy.remote_shell(
            self.options.mpi_args, {**os.environ, **dict(self.options.env)}, is_open_mpi(self.command))

    def diagnose(self, output: str) -> list[str]:
        found = diagnose_launch(output)
        return found if names_a_host(found) else found + list(self.host_failures().values())

    def host_failures(self, timeout: float = 30.0) -> dict[str, str]:
        """One trivial rank on each host alone, all at once, to tell which hosts fail and why (a host
        without the environment makes hydra fail without naming it): each failing host's name -> why."""
        env = {**os.environ, **dict(self.options.env)}
        probes = {}
        for host in self.hosts:
            cmd = [self.command, "-n", "1", self._hosts_option(), f"{host.name}:1", *self.options.mpi_args,
                   sys.executable, "-c", "import ipyparallel, mpi4py.MPI"]
            probes[host.name] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                 stderr=subprocess.STDOUT, text=True, env=env,
                                                 start_new_session=True)
        deadline = time.monotonic() + timeout
        failed = {}
        for name, probe in probes.items():
            try:
                out, _ = probe.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(probe.pid, signal.SIGKILL)
                probe.communicate()
                failed[name] = f"host {name} did not answer a test launch within {timeout:g} s"
                continue
            if probe.returncode != 0:
                failed[name] = (f"host {name} cannot start a rank of this environment: "
                                + (diagnose_launch(out) or [telling_line(out)])[0])
        return failed


class SlurmAllocation(Placement):
    """Ranks as the tasks of the Slurm allocation this kernel runs in, through ``srun``."""

    launcher_name = "srun"

    def __init__(self, options: ClusterOptions) -> None:
        self.options = options
        if not hostlib.in_slurm_allocation():
            raise ClusterError("--launcher srun needs a Slurm allocation (SLURM_JOB_ID is not set): run the "
                               "notebook server or kernel inside salloc/sbatch, or use --launcher mpiexec.")
        srun = shutil.which("srun")
        if srun is None:
            raise ClusterError("--launcher srun: srun is not on PATH; load Slurm's environment first.")
        self.command = srun

    def ranks(self, host_gpus: list[str]) -> int | None:
        """The allocation's tasks by default, and no more than those."""
        n, tasks = self.options.n, hostlib.slurm_tasks()
        if n is None:
            return _at_least_one(tasks or DEFAULT_RANKS_WITHOUT_GPU)
        if tasks is not None and n > tasks:
            raise ClusterError(f"-n {n} ranks but the Slurm allocation has {tasks} task(s) (SLURM_NTASKS). Ask "
                               f"salloc/sbatch for more (-n {n}) or start fewer ranks (-n {tasks}).")
        return _at_least_one(n)

    def controller_ip(self) -> str:
        return hostlib.controller_address(hostlib.slurm_nodes(), self.options.ip)

    def _placement_args(self) -> list[str]:
        # MPICH's wheel speaks PMI-2 with Slurm; the ranks inherit the kernel's environment
        return [f"--mpi={config.SRUN_MPI.text()}", "--kill-on-bad-exit=1"]


def choose_placement(options: ClusterOptions) -> Placement:
    """The placement ``options`` ask for: -H/--hostfile, else srun inside a Slurm
    allocation (``--launcher auto`` picks it where srun is there and no --mpiexec
    was given), else this host."""
    launcher = config.parse_choice(
        Launcher, options.launcher, f"--launcher {options.launcher!r}: use auto, mpiexec or srun.", ClusterError)
    if options.hosts and options.hostfile:
        raise ClusterError("give the hosts with -H or with --hostfile, not both.")
    if options.hosts or options.hostfile:
        if launcher is Launcher.SRUN:
            raise ClusterError("--launcher srun places the ranks on the allocation's nodes itself; "
                               "drop -H/--hostfile, or use --launcher mpiexec.")
        return HostList(options)
    if launcher is Launcher.SRUN or (launcher is Launcher.AUTO and hostlib.in_slurm_allocation()
                                     and shutil.which("srun") and options.mpiexec is None):
        return SlurmAllocation(options)
    return OneHost(options)
