"""Ranks on the nodes of the PBS (or Torque) job the kernel runs in: the hosts and their slots come from the
job's node file (``$PBS_NODEFILE``, one line per slot), and the ranks start as under ``-H`` (``HostList``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from .... import private
from ....config import ClusterOptions
from ...errors import ClusterError
from .. import hosts as hostlib
from .base import AUTO, is_open_mpi, register
from .host_list import HostList

_HOST_NAME = re.compile(r"[A-Za-z0-9_.:-]+")  # a name or address as PBS writes it, nothing else on the line


def in_pbs_job() -> bool:
    """Does this process run inside a PBS or Torque job (qsub, qsub -I)?"""
    return bool(os.environ.get("PBS_JOBID") and os.environ.get("PBS_NODEFILE"))


def read_node_file(path: str) -> list[hostlib.Host]:
    """The hosts of a PBS node file and their slots: one line per slot, a host's lines together or not.

    Args:
        path: the node file (``$PBS_NODEFILE``).

    Raises:
        ClusterError: the file cannot be read, lists no host, or has a line that is not one host name.
    """
    try:
        with os.fdopen(private.open_regular(Path(path), uid=-1), "rb") as f:  # (no FIFO, no link, no huge file)
            text = f.read().decode()
    except (OSError, UnicodeDecodeError) as exc:
        raise ClusterError(f"PBS_NODEFILE={path}: cannot read it ({getattr(exc, 'strerror', None) or exc}). "
                           "Start the notebook inside the PBS job (qsub -I), or give the hosts with -H.") from None
    slots: dict[str, int] = {}
    for number, line in enumerate(text.splitlines(), 1):
        name = line.strip()
        if name and not _HOST_NAME.fullmatch(name):
            raise ClusterError(f"PBS_NODEFILE={path}, line {number}: {line.strip()!r} is not a host name (PBS "
                               "writes one host name a line, once per slot). Fix the file, or give -H instead.")
        if name:
            slots[name] = slots.get(name, 0) + 1
    if not slots:
        raise ClusterError(f"PBS_NODEFILE={path} lists no host: ask qsub for nodes (-l select=... or -l nodes=...), "
                           "or give the hosts with -H.")
    return [hostlib.Host(name, n) for name, n in slots.items()]


@register
class PbsJob(HostList):
    """Ranks on the PBS job's nodes, as many as it has slots unless ``-n`` says fewer, through ``mpiexec``."""

    name = "pbs"
    precedence = 30  # inside a PBS job, ``auto`` (and ``mpiexec``) picks it where no hosts are given

    @classmethod
    def selected(cls, options: ClusterOptions, launcher: str) -> bool:
        return (launcher in (AUTO, cls.launcher_name) and in_pbs_job()
                and not (options.hosts or options.hostfile))

    @classmethod
    def hosts_given(cls, options: ClusterOptions) -> list[hostlib.Host]:
        """The hosts of the job's node file (``$PBS_NODEFILE``)."""
        return read_node_file(os.environ.get("PBS_NODEFILE", ""))

    def placement_args(self) -> list[str]:
        """Under MPICH's hydra, its report of how each rank ended (``rank_exits`` reads it)."""
        return [*super().placement_args(), *([] if is_open_mpi(self.command) else ["-print-all-exitcodes"])]
