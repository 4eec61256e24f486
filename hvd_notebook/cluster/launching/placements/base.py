"""What every placement answers, the registry of placements by name, and the launcher's executable.

A placement says where a cluster's ranks run and how they start: how many ranks there are, the launcher and
its command line for ``n`` ranks, where the controller listens, which GPUs the ranks get, how each rank ended
and what a failed launch means (in its launcher's words), and what the callers would otherwise ask by type
(a warm standby, a smaller world after hosts failed, variables forwarded to other hosts, checks before a
launch). Each placement is one class in one module of this package, registered with ``@register``;
``choose_placement`` asks the registered classes in order of ``precedence`` which one the options select. A
placement outside the package registers the same way (or through the ``hvd_notebook.placements``
entry-point group).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from ....config import ClusterOptions
from ...errors import ClusterError
from ...node import leases
from ...node.policy import Policy
from ..diagnosis import diagnose_launch, exit_reports

# host memory a warm standby rank holds (TensorFlow and Keras imported: ~0.75 GiB RSS measured here), rounded up
STANDBY_BYTES_PER_RANK = 1 << 30
AUTO = "auto"  # ``--launcher auto``: the first placement, in order of precedence, that the options select
GFORKER = "mpiexec.gforker"

P = TypeVar("P", bound=type["Placement"])
_REGISTRY: dict[str, type[Placement]] = {}


def register(cls: P) -> P:
    """Class decorator: make ``cls`` a placement ``choose_placement`` may pick, under its ``name``.

    Raises:
        ValueError: another class is registered under the same name.
    """
    known = _REGISTRY.get(cls.name)
    if known is not None and known is not cls:
        raise ValueError(f"a placement named {cls.name!r} is registered already ({known.__qualname__})")
    _REGISTRY[cls.name] = cls
    return cls


def unregister(cls: type[Placement]) -> None:
    """Take ``cls`` out of the registry (a placement a test added)."""
    if _REGISTRY.get(cls.name) is cls:
        del _REGISTRY[cls.name]


def registered() -> list[type[Placement]]:
    """The registered placements, in the order ``choose_placement`` asks them."""
    return sorted(_REGISTRY.values(), key=lambda cls: (cls.precedence, cls.name))


def launcher_names() -> list[str]:
    """What ``--launcher`` accepts: ``auto``, then each registered placement's launcher once."""
    return [AUTO, *dict.fromkeys(cls.launcher_name for cls in registered())]


def is_report_line(line: str) -> bool:
    """Is ``line`` one a registered placement's launcher wrote for ``rank_exits`` alone (kept from the user)?

    Args:
        line: a line of the launcher's output.
    """
    return any(cls.report_line(line) for cls in registered())


def choose_placement(options: ClusterOptions) -> Placement:
    """The placement ``options`` ask for.

    Args:
        options: what ``%hvd start`` (or ``hvd-notebook run``) was asked for; its ``launcher`` names a
            registered placement's launcher, or ``auto``.

    Returns:
        A new instance of the first registered placement, in order of precedence, that the options select.

    Raises:
        ClusterError: ``launcher`` names no registered launcher, the options contradict each other, or the
            placement cannot run here (no mpiexec, no Slurm allocation, ...).
    """
    launcher = options.launcher or AUTO
    names = launcher_names()
    if launcher not in names:
        raise ClusterError(f"--launcher {launcher!r}: use {', '.join(names[:-1])} or {names[-1]}.")
    for cls in registered():
        if cls.selected(options, launcher):
            return cls(options)
    raise ClusterError(f"--launcher {launcher}: no placement takes these options; use --launcher auto.")


def find_mpiexec(requested: str | None) -> str:
    """The ``mpiexec`` to launch engines with: the one asked for, else the one beside this Python (the mpich
    wheel's), else the first on ``PATH``.

    Raises:
        ClusterError: the one asked for, or any, is not there.

    Args:
        requested: ``--mpiexec``, or None.
    """
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
    """Open MPI's mpiexec takes --host; MPICH's hydra takes -hosts.

    Args:
        mpiexec: the launcher's path.
    """
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (subprocess.SubprocessError, OSError):
        return False
    return "Open MPI" in out or "OpenRTE" in out


def at_least_one(n: int) -> int:
    """``n``, or a ClusterError where it is under one.

    Args:
        n: a number of ranks.
    """
    if n < 1:
        raise ClusterError(f"-n {n}: a cluster needs at least one rank; try -n 2.")
    return n


class Placement:
    """Ranks started by a launcher (``mpiexec`` unless a placement says otherwise); each subclass places them
    somewhere and registers itself. A new placement is one module of this package with one such class.

    The hooks fall into five groups, in this order below; a subclass overrides what its launcher does
    differently (``selected``, ``ranks`` and ``controller_ip`` always):

    - **choice**: ``name``, ``launcher_name``, ``precedence`` and ``selected``: whether the options ask for it.
    - **shape**: how many ranks (``ranks``), where the controller listens (``controller_ip``), which GPUs the
      ranks pin (``take_gpus``), whether this host has room for them (``check_room``).
    - **launch**: the launcher's command line (``launcher_prefix``, ``placement_args``, ``forwarded_variables``;
      put together by ``command_line`` and ``launcher_args``, which are not hooks), the ranks' environment
      (``rank_env``), how ipyparallel starts the engines (``engine_launcher``, ``configure_engines``), and the
      checks before a launch (``preflight``).
    - **failures and recovery**: how each rank ended, as the launcher reported it (``rank_exits``, and
      ``report_line`` for its lines kept from the user; read through ``exit_reports``, not a hook), why a
      launch failed (``diagnose``), and the placement on what still works after a failure
      (``without_failures``).
    - **standby**: whether a warm standby can be kept (``standby_refusal``) and is kept by default
      (``standby_by_default``).

    Args:
        options: what ``%hvd start`` (or ``hvd-notebook run``) was asked for.

    The hooks share these parameters, described here once:

    - ``launcher``: the ``--launcher`` asked for (``auto`` or a ``launcher_name``).
    - ``n``: the number of ranks; ``host_gpus``: the GPU ids this host has for the cluster.
    - ``output``: what the launcher and the ranks printed (the launcher's log; the job's stderr).
    - ``environ``: the environment the ranks would inherit; ``names``: environment variables' names.
    - ``timeout``: seconds a check may take; ``cfg``: ipyparallel's configuration for the cluster.
    - ``owner``: who a GPU lease is for; ``rules``: the node's policy (None: no rules).
    - ``variables``: the names of variables forwarded to every rank; ``command``: what each rank runs.
    - ``line``: one line of the launcher's output.
    """

    name: ClassVar[str] = ""  # the registry's key
    launcher_name: ClassVar[str] = "mpiexec"  # what ``--launcher`` selects it by, and what messages call it
    precedence: ClassVar[int] = 100  # lower: asked first by ``choose_placement``

    def __init__(self, options: ClusterOptions) -> None:
        self.options = options
        self.command = find_mpiexec(options.mpiexec)  # the launcher's executable

    # ------------------------------------------------------------------ choice
    @classmethod
    def selected(cls, options: ClusterOptions, launcher: str) -> bool:
        """Whether ``options`` (with ``--launcher launcher``) ask for this placement; a ClusterError where they
        ask for it in a way it cannot take."""
        raise NotImplementedError

    # ------------------------------------------------------------------ shape
    def ranks(self, host_gpus: list[str]) -> int | None:
        """The number of ranks; None where ``take_gpus`` settles it at start."""
        raise NotImplementedError

    def controller_ip(self) -> str:
        """The address the controller listens on."""
        raise NotImplementedError

    def take_gpus(self, host_gpus: list[str], n: int | None, owner: str,
                  rules: Policy | None = None) -> tuple[list[str], leases.Lease | None]:
        """The GPU ids the ranks pin by local rank, and the lease that holds them (for ``owner``). Elsewhere
        than this host: the same ids on each host (leases, and the node's fair-sharing ``rules``, cover this
        host only; there the scheduler shares the nodes)."""
        return list(host_gpus), None

    def check_room(self, n: int) -> None:
        """A ClusterError where this host cannot hold the shared memory of the ranks placed on it."""

    # ------------------------------------------------------------------ launch
    @property
    def gforker(self) -> bool:
        """Is the launcher MPICH's gforker (whose worlds' shared-memory names follow from its pid)?"""
        return self.command.endswith(GFORKER)

    def launcher_prefix(self) -> list[str]:
        """What goes before the launcher on its command line (a wrapper that then becomes the launcher)."""
        return []

    def placement_args(self) -> list[str]:
        """The launcher's options that put the ranks in place (before the user's ``--mpi-args``)."""
        return []

    def forwarded_variables(self, names: list[str]) -> list[str]:
        """Launcher options that pass the variables ``names`` to every rank (most launchers pass the whole
        environment: none)."""
        return []

    def launcher_args(self) -> list[str]:
        """The launcher's own options: what puts the ranks in place, then the user's."""
        return [*self.placement_args(), *self.options.mpi_args]

    def command_line(self, n: int, variables: list[str], command: list[str]) -> list[str]:
        """The launcher's whole command line for ``n`` ranks running ``command``, with the environment
        ``variables`` (names) forwarded to every rank; what ``launch`` hands to ipyparallel in parts."""
        return [*self.launcher_prefix(), self.command, "-n", str(n), *self.launcher_args(),
                *self.forwarded_variables(variables), *command]

    def rank_env(self, environ: dict[str, str]) -> dict[str, str]:
        """Defaults for every rank's environment, under what ``environ`` already sets."""
        return {}

    @property
    def engine_launcher(self) -> Any:
        """ipyparallel's engine launcher for this placement (its name, or the class)."""
        return "mpi"

    def configure_engines(self, cfg: Any) -> None:
        """Settle, in ipyparallel's ``cfg``, how the engines get the cluster's connection file."""

    def preflight(self, timeout: float) -> None:
        """Checks before a launch (``hvd-notebook run``), within ``timeout`` seconds; a ClusterError saying
        what to fix."""

    # ------------------------------------------------------------------ failures and recovery
    def rank_exits(self, output: str) -> dict[int, str]:
        """How each rank ended, where this placement's launcher said so in ``output``: rank -> "exit code 7",
        "signal Kill" (a signal's name as the launcher writes it)."""
        return {}

    @classmethod
    def report_line(cls, line: str) -> bool:
        """Is ``line`` one the launcher wrote for ``rank_exits`` alone, kept from the user's terminal?"""
        return False

    def exit_reports(self, output: str) -> dict[int, str]:
        """How each rank ended: ``rank_exits``, with what MPICH printed for ranks that called MPI_Abort and
        the likely cause of a SIGBUS (``diagnosis.exit_reports``)."""
        return exit_reports(output, self.rank_exits(output))

    def diagnose(self, output: str) -> list[str]:
        """Sentences saying why a launch that printed ``output`` failed."""
        return diagnose_launch(output, self.rank_exits(output))

    def without_failures(self) -> tuple[Placement, int, str] | None:
        """After a start failed: the placement on what still works, how many ranks it holds and why the rest
        was left out; None where nothing can be left out (the failure then stands)."""
        return None

    # ------------------------------------------------------------------ standby
    def standby_refusal(self) -> str | None:
        """Why this placement cannot keep a warm standby (``--standby on`` is then an error); None where it can."""
        return None

    def standby_by_default(self, n: int) -> bool:
        """Whether ``--standby auto`` keeps a warm standby of ``n`` ranks here."""
        return False
