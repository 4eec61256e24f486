"""Ranks as the tasks of the Slurm allocation the kernel runs in, through ``srun``."""

from __future__ import annotations

import re
import shutil

from .... import config
from ....config import DEFAULT_RANKS_WITHOUT_GPU, ClusterOptions
from ...errors import ClusterError
from .. import hosts as hostlib
from .base import AUTO, Placement, at_least_one, register

# "srun: error: node1: task 1: Exited with exit code 7" or "srun: error: node1: task 1: Killed"
SRUN_EXIT = re.compile(r"srun: error: \S+: task (\d+): (?:Exited with exit code (\d+)|(\w[\w ]*))")


@register
class SlurmAllocation(Placement):
    """Ranks as the tasks of the Slurm allocation this kernel runs in, through ``srun``."""

    name = "slurm"
    launcher_name = "srun"
    precedence = 20  # inside an allocation, ``auto`` picks it

    def __init__(self, options: ClusterOptions) -> None:
        self.options = options
        if not hostlib.in_slurm_allocation():
            raise ClusterError("--launcher srun needs a Slurm allocation (SLURM_JOB_ID is not set): run the "
                               "notebook server or kernel inside salloc/sbatch, or use --launcher mpiexec.")
        srun = shutil.which("srun")
        if srun is None:
            raise ClusterError("--launcher srun: srun is not on PATH; load Slurm's environment first.")
        self.command = srun

    @classmethod
    def selected(cls, options: ClusterOptions, launcher: str) -> bool:
        return launcher == cls.launcher_name or (launcher == AUTO and hostlib.in_slurm_allocation()
                                                 and bool(shutil.which("srun")) and options.mpiexec is None)

    def ranks(self, host_gpus: list[str]) -> int | None:
        """The allocation's tasks by default, and no more than those."""
        n, tasks = self.options.n, hostlib.slurm_tasks()
        if n is None:
            return at_least_one(tasks or DEFAULT_RANKS_WITHOUT_GPU)
        if tasks is not None and n > tasks:
            raise ClusterError(f"-n {n} ranks but the Slurm allocation has {tasks} task(s) (SLURM_NTASKS). Ask "
                               f"salloc/sbatch for more (-n {n}) or start fewer ranks (-n {tasks}).")
        return at_least_one(n)

    def controller_ip(self) -> str:
        return hostlib.controller_address(hostlib.slurm_nodes(), self.options.ip)

    def placement_args(self) -> list[str]:
        # MPICH's wheel speaks PMI-2 with Slurm; the ranks inherit the kernel's environment
        return [f"--mpi={config.SRUN_MPI.text()}", "--kill-on-bad-exit=1"]

    def rank_exits(self, output: str) -> dict[int, str]:
        """srun's task errors: "exit code 7", or srun's word for a signal ("Killed")."""
        reports: dict[int, str] = {}
        for m in SRUN_EXIT.finditer(output):
            reports.setdefault(int(m.group(1)), f"exit code {m.group(2)}" if m.group(2) else m.group(3).strip())
        return reports

    def standby_refusal(self) -> str | None:
        return ("--standby on: the cluster's ranks take the Slurm allocation's tasks, and a second job step "
                "would wait for them. Use --standby off (the default under srun).")
