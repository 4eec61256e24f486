"""Every rank on this host, started by MPICH's gforker where it is there (``mpiexec`` otherwise): nothing of the
cluster listens beyond loopback, GPUs are leased between the node's notebooks, and a warm standby is kept where
memory allows."""

from __future__ import annotations

import os
import re
from pathlib import Path

import psutil

from ....config import DEFAULT_RANKS_WITHOUT_GPU, ClusterOptions
from ...errors import ClusterError
from ...node import leases, queue, shm
from ...node.policy import Policy
from .base import AUTO, GFORKER, STANDBY_BYTES_PER_RANK, Placement, at_least_one, register

# MPI between ranks of one host over shared memory only: UCX (MPICH's default netmod in the wheel) otherwise
# opens a TCP listener on the host's network interface. Not UCX's "sm" alias: it includes the SysV transport,
# whose segments are mode 0660 (readable by the user's group). The user's own --env or environment wins.
LOOPBACK_ENV = {"UCX_TLS": "self,posix,cma"}
# gforker's -exitinfo: "[0]1:Return code = 0, signaled with Kill" (world rank after the colon)
GFORKER_EXIT = re.compile(r"\s*\[\d+\](\d+):Return code = (-?\d+)(?:, signaled with (\w+))?")


@register
class OneHost(Placement):
    """Every rank on this host; nothing of the cluster listens beyond loopback."""

    name = "one-host"
    precedence = 1000  # where nothing else is asked for

    def __init__(self, options: ClusterOptions) -> None:
        super().__init__(options)
        if options.mpiexec is None:
            self.command = self._single_host_launcher(self.command)

    @classmethod
    def selected(cls, options: ClusterOptions, launcher: str) -> bool:
        return launcher in (AUTO, cls.launcher_name) and not (options.hosts or options.hostfile)

    @staticmethod
    def _single_host_launcher(mpiexec: str) -> str:
        """MPICH's gforker beside its ``mpiexec``, where there is one: hydra, the default launcher, listens for
        its proxies on a TCP port on every interface with no option to keep it on loopback; gforker forks the
        ranks itself and listens on no port."""
        gforker = Path(mpiexec).parent / GFORKER
        return str(gforker) if gforker.is_file() and os.access(gforker, os.X_OK) else mpiexec

    def ranks(self, host_gpus: list[str]) -> int | None:
        requested = self.options.n
        n = at_least_one(requested if requested is not None else (len(host_gpus) or DEFAULT_RANKS_WITHOUT_GPU))
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

    def launcher_prefix(self) -> list[str]:
        """For gforker, ``shmguard``, which refuses a world whose shared-memory names another user holds, then
        becomes the launcher."""
        return shm.guard_command() if self.gforker else []

    def placement_args(self) -> list[str]:
        return ["-exitinfo"] if self.gforker else []  # gforker reports each rank's exit code or signal

    def rank_env(self, environ: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in LOOPBACK_ENV.items() if k not in environ}

    def take_gpus(self, host_gpus: list[str], n: int | None, owner: str,
                  rules: Policy | None = None) -> tuple[list[str], leases.Lease | None]:
        """GPUs held by other notebooks' clusters are skipped, or waited for in the node's queue (``--no-wait``:
        not); the node's ``rules`` cap what one user's clusters hold together (GPUs, or CPU ranks where the ranks
        have none)."""
        room = rules.room(bool(host_gpus), n) if rules is not None else None
        if not host_gpus:
            return [], None
        lease = queue.acquire(host_gpus, n, owner, at_most=room, wait=self.options.wait)
        if rules is not None:
            try:
                rules.room(True, len(lease.gpus))  # (again: the user's other clusters may have started while it waited)
            except BaseException:
                lease.release()
                raise
        return lease.gpus, lease

    def rank_exits(self, output: str) -> dict[int, str]:
        """gforker's ``-exitinfo`` lines: "exit code 7", or "signal Kill" for a rank a signal ended."""
        reports = {}
        for m in filter(None, map(GFORKER_EXIT.match, output.splitlines())):
            reports[int(m.group(1))] = f"signal {m.group(3)}" if m.group(3) else f"exit code {m.group(2)}"
        return reports

    @classmethod
    def report_line(cls, line: str) -> bool:
        return GFORKER_EXIT.match(line) is not None

    def standby_by_default(self, n: int) -> bool:
        """Where this host's free memory holds the standby's ranks twice over."""
        return psutil.virtual_memory().available >= 2 * n * STANDBY_BYTES_PER_RANK
