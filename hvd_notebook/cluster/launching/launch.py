"""The ipyparallel side of a cluster: the controller and engine launchers, how
they are configured, and what every rank's environment gets.

Only ipyparallel's public launcher API is used: ``poll()`` for the exit of the
engine launcher and ``get_output()`` once it has exited. (``on_stop`` callbacks
run on the event loop that started the launcher, which ipyparallel's ``*_sync``
methods close again outside a running loop, so they cannot be waited on.)
"""

from __future__ import annotations

import logging
import os
import shlex
import time
from pathlib import Path
from typing import Any

from ... import config
from ..node import shm
from .placements import Placement

# an idle engine whose controller is gone exits by itself after this many missed
# heartbeats (the controller pings every 3 s, the engine checks every 3.5 s)
ENGINE_HEARTBEAT_MISSES = 7

HUGEPAGES_TUNABLE = "glibc.malloc.hugetlb=1"

# Every controller encrypts with CurveZMQ: on one host too, where any local user may connect to its
# loopback ports and its IOPub and notification sockets publish every cell's source and output to
# any subscriber (``--secure`` asks for nothing more). Only the benchmark's baseline empties it.
CURVE_ARG = "--IPController.enable_curve=True"
CONTROLLER_ARGS = [CURVE_ARG]


def rank_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """What every rank gets on top of the launching environment: glibc's malloc asks
    for transparent huge pages (added to any ``GLIBC_TUNABLES`` already set), so that
    TensorFlow's tensors and MPI's buffers sit on 2 MiB pages as numpy's large arrays
    do. ``HVD_NOTEBOOK_HUGEPAGES=0`` leaves malloc alone; a ``glibc.malloc.hugetlb``
    already set wins.

    Args:
        environ: the launching environment; None for this process's.
    """
    environ = dict(os.environ) if environ is None else environ
    tunables = environ.get("GLIBC_TUNABLES", "")
    if not config.HUGEPAGES.flag(environ) or "glibc.malloc.hugetlb" in tunables:
        return {}
    return {"GLIBC_TUNABLES": f"{tunables}:{HUGEPAGES_TUNABLE}" if tunables else HUGEPAGES_TUNABLE}


def world_environment(placement: Placement) -> dict[str, str]:
    """What the launcher of the ranks gets on top of this process's environment: the
    placement's defaults and ``rank_environment``, under the user's own ``--env``.

    Args:
        placement: the world's placement.
    """
    user_env = dict(placement.options.env)
    environ = {**os.environ, **user_env}
    # (the launcher reports how each rank ended: no rank watcher needed)
    return {**placement.rank_env(environ), **rank_environment(environ), config.RANK_WATCH.name: "0", **user_env}


def make_ipp_cluster(placement: Placement, cluster_id: str, profile_dir: Path, n: int, controller_ip: str) -> Any:
    """An ipyparallel ``Cluster`` (not started) whose engines are one world of the placement's launcher.

    Args:
        placement: the world's placement.
        cluster_id: the cluster directory's name.
        profile_dir: ipyparallel's profile folder.
        n: the number of ranks.
        controller_ip: the address the controller listens on.
    """
    import ipyparallel as ipp
    from traitlets.config import Config

    cfg = Config()
    cfg.MPILauncher.mpi_cmd = [*placement.launcher_prefix(), placement.command]
    cfg.MPILauncher.mpi_args = placement.launcher_args()
    cfg.MPIEngineSetLauncher.environment = world_environment(placement)
    cfg.MPIEngineSetLauncher.engine_args = [f"--IPEngine.max_heartbeat_misses={ENGINE_HEARTBEAT_MISSES}"]
    placement.configure_engines(cfg)  # (across hosts: the key in a 0600 file on each host, not in the environment)
    return ipp.Cluster(
        engines=placement.engine_launcher,
        n=n,
        cluster_id=cluster_id,
        profile_dir=str(profile_dir),
        shutdown_atexit=False,  # the session's own atexit stops it, leftovers included
        log_level=logging.ERROR,
        controller_ip=controller_ip,  # one host: nothing of the controller listens beyond loopback
        controller_args=list(CONTROLLER_ARGS),
        config=cfg,
    )


class EngineWorld:
    """The launcher process (``mpiexec`` or ``srun``) of one world of engines.

    Args:
        launcher: ipyparallel's engine-set launcher.
    """

    def __init__(self, launcher: Any) -> None:
        self._launcher = launcher

    @property
    def pid(self) -> int:
        """The launcher's own process."""
        return self._launcher.pid

    @property
    def command(self) -> str:
        """The launcher's command line, as a shell would read it (without ``shmguard`` before it)."""
        args, guard = list(self._launcher.args), shm.guard_command()
        return shlex.join(args[len(guard):] if args[:len(guard)] == guard else args)

    def exit_code(self) -> Any:
        """None while the launcher runs, else its exit code (ipyparallel says "unknown"
        where it could not be read)."""
        return self._launcher.poll()

    def output(self) -> str:
        """What the launcher and the engines have written so far."""
        if not self._launcher.running:  # ipyparallel has read the log and removed it
            return self._launcher.get_output()
        try:
            return Path(self._launcher.output_file).read_text(errors="replace")
        except OSError:
            return ""

    def wait(self, timeout: float) -> None:
        """Give the launcher up to ``timeout`` seconds to exit.

        Args:
            timeout: seconds to wait.
        """
        deadline = time.monotonic() + timeout
        while self.exit_code() is None and time.monotonic() < deadline:
            time.sleep(0.05)
