"""What a launch's output says: why it failed, which host broke, how each rank ended.

Everything here reads text that ``mpiexec`` (MPICH's hydra or gforker, Open
MPI) or ``srun`` printed, and writes the sentences the notebook user sees (a rank
killed by SIGBUS also gets ``/dev/shm``'s free space, read then). How each rank
ended is in each launcher's own words: its placement reads them
(``Placement.rank_exits``); what MPICH itself prints (MPI_Abort) is read here.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from typing import TypeVar

from ...config import PREFIX
from ..node import shm

T = TypeVar("T")

# MPICH's words when MPI_Init fails on a rank (MPI_Init_thread is what mpi4py calls)
_MPI_INIT_FAILED = re.compile(r"Fatal error in (internal_Init_thread|P?MPI_Init)")

# (pattern, sentence): the groups name the host and the cause
_FAILURES = [
    (r"ssh: connect to host (\S+) port \d+: (.+)", "host {0} is unreachable ({1})"),
    (r"ssh: Could not resolve hostname (\S+?):? (.+)", "host {0} does not resolve ({1})"),
    (r"\[proxy:[^@\]]*@([^\]]+)\][^\n]*unable to connect from \"[^\"]+\" to \"([^\"]+)\"",
     "host {0} cannot reach the launcher on this machine at {1}: check firewalls, and --mpi-args \"-iface IF\""),
    (r"\[proxy:[^@\]]*@([^\]]+)\][^\n]*execvp error on file (\S+) \(([^)]+)\)",
     "host {0} cannot run {1} ({2}): every host needs the same Python environment at the same path"),
    (r"Host key verification failed|Permission denied \(publickey",
     "ssh to a host was refused: set up password-less ssh keys between the hosts"),
    (r"srun: error: (.+)", "srun: {0}"),
]

# MPICH on a rank that calls MPI_Abort: "Abort(3) on node 1 (rank 1 in comm 0): ..." (node: the world rank)
_MPI_ABORT = re.compile(r"Abort\((-?\d+)\) on node (\d+) \(rank \d+ in comm \d+\)")


def diagnose_launch(output: str, exits: Mapping[int, str] | None = None) -> list[str]:
    """Sentences naming the host and the cause, read from what ``mpiexec`` or
    ``srun`` printed when a launch failed (empty when nothing is recognised).

    Args:
        output: what the launcher printed.
        exits: how each rank ended, as its placement read it (``Placement.rank_exits``): a rank
            killed by SIGBUS adds a sentence on ``/dev/shm``.
    """
    found: list[str] = []
    refused = shm.refused_by_guard(output)
    if refused:
        found.append(refused)
    for pattern, message in _FAILURES:
        for m in re.finditer(pattern, output):
            text = message.format(*(g.strip().rstrip(".") for g in m.groups()))
            if text not in found:
                found.append(text)
    if any(_is_sigbus(how) for how in (exits or {}).values()):
        found.append(f"a rank died of SIGBUS: {shm.space_note()}")
    return found


def names_a_host(causes: list[str]) -> bool:
    """Does any of ``diagnose_launch``'s sentences say which host failed?

    Args:
        causes: ``diagnose_launch``'s sentences.
    """
    return any(c.startswith("host ") for c in causes)


def telling_line(output: str) -> str:
    """The line of a failed launch's output that says most: a missing file or
    module, else an error, else the last line.

    Args:
        output: the launch's output.
    """
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for needle in ("No such file or directory", "ModuleNotFoundError", "not found", "rror"):
        for line in lines:
            if needle in line:
                return line
    return lines[-1] if lines else "it printed nothing"


def mpi_init_failed(output: str) -> bool:
    """Did MPI_Init itself fail on a rank (as opposed to the launcher or our code)?

    Args:
        output: the launch's output.
    """
    return bool(_MPI_INIT_FAILED.search(output))


MPI_INIT_TRIES = 2  # starts of a world whose MPI_Init keeps failing (the messages say "two tries")


def tries_where_mpi_init_fails(start: Callable[[], T], init_failed: Callable[[T], bool], before: str) -> T:
    """``start()`` again, up to ``MPI_INIT_TRIES`` starts in all, where ``init_failed`` says of what it
    returned that MPI_Init failed on a rank before ``before`` (before any engine connected, before the
    script started): under MPICH's gforker UCX's address exchange fails that way about once in 150
    starts, and a start right after it rarely does. What the last start returned.

    Args:
        start: starts the world; may raise.
        init_failed: whether what ``start`` returned failed in MPI_Init.
        before: what MPI_Init failed before, for the log.
    """
    result = start()
    for _ in range(MPI_INIT_TRIES - 1):
        if not init_failed(result):
            break
        print(f"{PREFIX} MPI_Init failed on a rank before {before}; starting the ranks once more.",
              file=sys.stderr, flush=True)
        result = start()
    return result


def tail(text: str, lines: int = 20) -> str:
    """The last non-blank lines of a launcher's output, indented for a message.

    Args:
        text: the launcher's output.
        lines: how many lines.
    """
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return "\n".join("    " + line for line in kept) or "    (mpiexec printed nothing)"


def exit_reports(output: str, exits: Mapping[int, str]) -> dict[int, str]:
    """How each rank ended: rank -> "exit code 7", "signal Kill" or "MPI_Abort with code 3". A rank
    killed by SIGBUS gets the likely cause, a full ``/dev/shm``, and its free space now:
    "signal Bus; a full /dev/shm is a likely cause (0.4 MiB free of 64.0 MiB)".

    Args:
        output: what the launcher and the ranks printed (MPICH's MPI_Abort lines are read from it).
        exits: how each rank ended in the launcher's words, as its placement read them
            (``Placement.rank_exits``); they come first.
    """
    reports = dict(exits)
    for m in _MPI_ABORT.finditer(output):
        reports.setdefault(int(m.group(2)), f"MPI_Abort with code {m.group(1)}")
    if any(map(_is_sigbus, reports.values())):
        note = shm.space_note()
        reports = {rank: f"{how}; {note}" if _is_sigbus(how) else how for rank, how in reports.items()}
    return reports


def _is_sigbus(how: str) -> bool:
    return how == "signal Bus"


def signal_name(how: str) -> str | None:
    """The signal's name in an ``exit_reports`` entry ("signal Bus; a full ..." -> "Bus"); None for an exit.

    Args:
        how: an ``exit_reports`` entry.
    """
    return how.removeprefix("signal ").split(";")[0] if how.startswith("signal ") else None


def launcher_exited(launcher: str, code: object, n: int, connected: int, causes: list[str], command: str,
                    output: str) -> str:
    """The message for a launcher that exited before every engine connected.

    Args:
        launcher: the launcher's name.
        code: its exit code.
        n: the ranks asked for.
        connected: the engines that connected.
        causes: ``diagnose_launch``'s sentences.
        command: the launcher's command line.
        output: its output.
    """
    listed = "".join(f"\n  - {c}" for c in causes)
    return (f"{launcher} exited (code {code}) before all {n} engines connected ({connected} did).{listed}\n"
            f"Command: {command}\nLast lines of its output:\n{tail(output)}\n"
            "Check --mpiexec and --mpi-args, and that this environment's mpi4py was built for that MPI.")


def engines_late(n: int, connected: int, timeout: float, command: str, output: str) -> str:
    """The message for engines that did not all connect within ``--timeout``.

    Args:
        n: the ranks asked for.
        connected: the engines that connected.
        timeout: the start's timeout in seconds.
        command: the launcher's command line.
        output: its output.
    """
    return (f"Only {connected} of {n} engines connected within --timeout {timeout:g} s. Command: {command}\n"
            f"Last lines of mpiexec's output:\n{tail(output)}\n"
            "Raise --timeout on a slow or busy machine, or check the MPI set-up.")


def setup_late(timeout: float) -> str:
    """The message for engines that connected but did not finish their bootstrap in time.

    Args:
        timeout: the start's timeout in seconds.
    """
    return (f"The engines did not finish setting up (importing TensorFlow, initialising MPI) within "
            f"--timeout {timeout:g} s. Raise --timeout.")


def setup_failed(error: BaseException) -> str:
    """The message for a bootstrap that raised on an engine (ipyparallel's CompositeError
    has one entry per failed engine; the first is named).

    Args:
        error: what the bootstrap raised.
    """
    ename, evalue, _tb, info = getattr(error, "elist", [(type(error).__name__, error, "", {})])[0]
    return f"Setting up engine {info.get('engine_id', '?')} failed: {ename}: {evalue}"


def not_one_world(n: int, sizes: list[int], mpiexec: str) -> str:
    """The message for ranks that did not form one MPI world of ``n``.

    Args:
        n: the ranks asked for.
        sizes: the world size each rank saw.
        mpiexec: the launcher's path.
    """
    return (f"mpiexec started {n} processes but they did not form one MPI world of {n} ranks (they report "
            f"sizes {sizes}). This happens when mpiexec ({mpiexec}) belongs to a different MPI than the one "
            "mpi4py was built for; pass the matching --mpiexec.")
