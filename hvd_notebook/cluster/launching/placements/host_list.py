"""Ranks on the hosts of ``-H`` or ``--hostfile``, through ``mpiexec``: the engines read the cluster's key from
a private file copied to each host first; a host that cannot start a rank is named, and a restart goes on
without failing hosts where ``--min-np`` allows."""

from __future__ import annotations

import copy
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from typing import Any

from ....config import ClusterOptions
from ...errors import ClusterError
from .. import hosts as hostlib
from .. import keycopy
from ..diagnosis import diagnose_launch, names_a_host, telling_line
from .base import AUTO, Placement, at_least_one, is_open_mpi, register

# hydra's -print-all-exitcodes, on its stdout once every rank ended: "[mpiexec@node0] Exit codes: [node1] 0,1792",
# then one "[node2] 0,0" line for each other host (each rank's wait status, in the order of its ranks there)
HYDRA_EXIT_CODES = re.compile(r"^\[mpiexec@[^\]]*\] Exit codes: (.*(?:\n\[[^\]\s]+\] [-\d,]+)*)", re.MULTILINE)
HYDRA_HOST_CODES = re.compile(r"\[([^\]\s]+)\] (-?\d+(?:,-?\d+)*)")


@register
class HostList(Placement):
    """Ranks on the hosts of -H or --hostfile, through ``mpiexec``."""

    name = "host-list"
    precedence = 10  # hosts given: this placement, or an error

    def __init__(self, options: ClusterOptions) -> None:
        super().__init__(options)
        self.hosts = self.hosts_given(options)

    @classmethod
    def hosts_given(cls, options: ClusterOptions) -> list[hostlib.Host]:
        """The hosts and their slots, from ``-H`` or ``--hostfile``."""
        return hostlib.parse_hosts(options.hosts) if options.hosts else hostlib.read_hostfile(options.hostfile)

    @classmethod
    def selected(cls, options: ClusterOptions, launcher: str) -> bool:
        if options.hosts and options.hostfile:
            raise ClusterError("give the hosts with -H or with --hostfile, not both.")
        if not (options.hosts or options.hostfile):
            return False
        if launcher not in (AUTO, cls.launcher_name):
            raise ClusterError(f"--launcher {launcher} places the ranks on the allocation's nodes itself; "
                               "drop -H/--hostfile, or use --launcher mpiexec.")
        return True

    def ranks(self, host_gpus: list[str]) -> int | None:
        return at_least_one(hostlib.check_slots(self.hosts, self.options.n))

    def controller_ip(self) -> str:
        return hostlib.controller_address([h.name for h in self.hosts], self.options.ip)

    def without(self, hosts: list[str]) -> HostList:
        """The same placement on the other hosts only (``-n`` then their slots); none where every host is
        left out (its ``slots`` then 0).

        Args:
            hosts: the host names to leave out.
        """
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

    def placement_args(self) -> list[str]:
        return [self._hosts_option(), ",".join(f"{h.name}:{h.slots}" for h in self.hosts)]

    def forwarded_variables(self, names: list[str]) -> list[str]:
        """Open MPI passes a variable to ranks on other hosts only when named (``-x NAME``); MPICH's hydra
        passes the whole environment."""
        if not is_open_mpi(self.command):
            return []
        return [arg for name in sorted(names) for arg in ("-x", name)]

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

    def preflight(self, timeout: float) -> None:
        """One trivial rank on each other host proves it can start ranks of this environment (as ``horovodrun``
        checks ssh to each host)."""
        if all(hostlib.is_this_host(h.name) for h in self.hosts):
            return
        failed = self.host_failures(timeout).values()
        if failed:
            listed = "".join(f"\n  - {f}" for f in failed)
            raise ClusterError(f"not every host can start a rank:{listed}\nFix those hosts, or raise --start-timeout.")

    def rank_exits(self, output: str) -> dict[int, str]:
        """hydra's ``-print-all-exitcodes`` report (asked for in ``--mpi-args``, or by a placement built on
        this one), each host's wait statuses matched to the ranks hydra placed there."""
        found = HYDRA_EXIT_CODES.findall(output)
        if not found:
            return {}
        placed = self.ranks_by_host(sum(len(codes.split(",")) for _, codes in HYDRA_HOST_CODES.findall(found[-1])))
        reports = {}
        for host, codes in HYDRA_HOST_CODES.findall(found[-1]):
            for rank, status in zip(placed.get(host, []), map(int, codes.split(",")), strict=False):
                reports[rank] = wait_status(status)
        return reports

    def ranks_by_host(self, n: int) -> dict[str, list[int]]:
        """Which of ``n`` ranks hydra places on each host: each host's slots in turn, round and round."""
        placed: dict[str, list[int]] = {h.name: [] for h in self.hosts}
        rank = 0
        while rank < n and self.slots:
            for h in self.hosts:
                taken = min(h.slots, n - rank)
                placed[h.name] += range(rank, rank + taken)
                rank += taken
        return placed

    def diagnose(self, output: str) -> list[str]:
        found = diagnose_launch(output, self.rank_exits(output))
        return found if names_a_host(found) else found + list(self.host_failures().values())

    def without_failures(self) -> tuple[Placement, int, str] | None:
        """The hosts that still start ranks, where some do not."""
        gone = self.host_failures()
        if not gone:
            return None
        kept = self.without(list(gone))
        return kept, kept.slots if kept.hosts else 0, "; ".join(gone.values())

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


def wait_status(status: int) -> str:
    """A rank's wait status as ``exit_reports`` says it: "exit code 7", or "signal Kill" for a signal.

    Args:
        status: the wait status, as ``os.waitpid`` gives it.
    """
    if status & 0x7F == 0:
        return f"exit code {status >> 8}"
    number = status & 0x7F
    try:
        return f"signal {signal.Signals(number).name.removeprefix('SIG').capitalize()}"
    except ValueError:
        return f"signal {number}"
