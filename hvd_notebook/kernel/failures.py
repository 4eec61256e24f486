"""How a ``%%hvd`` cell or ``%hvd`` command fails: the error classes the user
sees (each shown as its message alone) and every message they carry."""

from __future__ import annotations

from ..cluster.launching.replies import RankFailure

DIED = "the rank's process died"  # what a dead rank's bar says on the dashboard
CONTROLLER_GONE = "ended: the cluster's controller was gone"  # (its bar, and how it ended in a reset's line)
CONTROLLER_ENDED = ("the cluster's controller has ended (its processes are gone; the ranks shut down without it "
                    "within half a minute): %hvd restart starts the cluster again")
INTERRUPTED = "They were interrupted; their variables are kept and the cluster is ready."
RENEWED = ("They were interrupted, and every rank's collectives were renewed (one was left half-way); their "
           "variables are kept and the cluster is ready.")


class HvdError(Exception):
    """An error to show the user as its message alone, without a kernel-side traceback."""

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self}"]


class NoClusterError(HvdError):
    """A command that needs a cluster ran without one."""


class RankError(HvdError):
    """A ``%%hvd`` cell failed on one or more ranks; carries the first failure's traceback.

    Args:
        message: what the user reads.
        remote_traceback: the first failed rank's traceback lines.
        outcomes: a line per rank of the cell.
        ranks: the ranks that raised.
    """

    def __init__(self, message: str, remote_traceback: list[str], outcomes: list[str], ranks: list[int] | None = None):
        super().__init__(message)
        self.remote_traceback = remote_traceback
        self.outcomes = outcomes
        self.ranks = ranks or []  # the ranks that raised, the first first (what %hvd debug opens)

    def _render_traceback_(self) -> list[str]:
        return (
            [f"\x1b[0;31mRankError\x1b[0m: {self.args[0]}"]
            + self.remote_traceback
            + ["", "Outcome on each rank:"]
            + [f"  {line}" for line in self.outcomes]
        )


class CellTimeout(HvdError):
    """A ``%%hvd --timeout`` cell ran too long."""


class RankDied(HvdError):
    """A rank's process is gone; the MPI world cannot go on without it.

    Args:
        message: what the user reads.
        died: rank -> how it ended ("signal Kill"; "" where the launcher did not say).
    """

    def __init__(self, message: str, died: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.died = died or {}


def describe(error: RankFailure) -> str:
    """``ValueError: message`` of a rank's error, for its dashboard bar.

    Args:
        error: the rank's failure.
    """
    return DIED if error.engine_died else str(error)


def already_running(n: int | None) -> HvdError:
    """``%hvd start`` where a cluster runs already.

    Args:
        n: the ranks asked for, or None.
    """
    return HvdError(f"A cluster of {n} ranks is already running. Run %hvd stop first, or %hvd start --restart ... "
                    "to replace it.")


def no_cluster() -> NoClusterError:
    return NoClusterError("No cluster is running. Start one with %hvd start (e.g. %hvd start -n 2).")


def auto_without_cluster(released: str | None) -> NoClusterError:
    """A cell of ``%hvd auto on`` found the cluster gone.

    Args:
        released: why the node's rules stopped the cluster, or None.
    """
    why = released or "The cluster is no longer running (stopped, or lost when a restart failed)."
    return NoClusterError(f"{why} So %hvd auto is now off, and this cell did not run: run it again to run it in "
                          "this kernel, or %hvd start and %hvd auto on to run cells on ranks again.")


def unknown_ranks(unknown: list[int], size: int) -> HvdError:
    """The error for ``--ranks`` naming ranks the cluster does not have.

    Args:
        unknown: the ranks asked for that do not exist.
        size: the cluster's number of ranks.
    """
    return HvdError(f"Rank(s) {unknown} do not exist: this cluster has ranks 0..{size - 1}.")


def dead_before_cell(dead: list[int]) -> RankDied:
    """The error for a cell asked of ranks that died before it.

    Args:
        dead: the ranks found dead.
    """
    return RankDied(f"Rank(s) {dead} of this cluster are dead. Run %hvd restart for a fresh cluster "
                    "of the same shape (every rank's variables are lost).")


def ranks_died(died: dict[int, str], others: list[int], last_lines: list[str], mpiexec_tail: str) -> RankDied:
    """Ranks died during a cell: how each ended (rank -> what mpiexec said, "" where nothing), which
    others were ended with them, and the last lines each dead rank printed.

    Args:
        died: rank -> what mpiexec said of its end.
        others: the ranks ended with them.
        last_lines: the last lines the dead ranks printed.
        mpiexec_tail: the end of the launcher's log.
    """
    dead = sorted(died)
    how = "; ".join(f"rank {r}: {died[r]}" for r in dead if died[r])
    return RankDied(
        f"rank(s) {dead} died while running the cell ({how or 'the process exited or was killed'}; "
        "out of memory is a common cause). An MPI world cannot go on without a rank"
        + (f", so rank(s) {others} were ended too" if others else "") + ": run "
        "%hvd restart for a fresh cluster of the same shape, then re-run your set-up cells. "
        "%hvd status shows which ranks are dead.\nLast lines the rank(s) printed:\n" + "\n".join(last_lines)
        + "\nLast lines of mpiexec's output:\n" + mpiexec_tail, died
    )


def controller_gone(ranks: list[int]) -> RankDied:
    """The controller's processes ended while a cell ran on ``ranks``, which were ended then.

    Args:
        ranks: the ranks of the cell.
    """
    return RankDied(
        f"The cluster's controller ended while the cell ran (its processes were killed; out of memory is a common "
        f"cause), so the ranks' results could no longer reach the notebook and rank(s) {ranks} were ended: run "
        "%hvd restart for a fresh cluster of the same shape, then re-run your set-up cells.",
        dict.fromkeys(ranks, CONTROLLER_GONE),
    )


def whereabouts(where: dict[int, str], verb: str = "was") -> str:
    """Where each rank was, as one clause:
    "rank 0 was in hvd.barrier(), called from a cell, line 3; rank 1 was at a cell, line 5".

    Args:
        where: rank -> a line of ``stacks.where``.
        verb: the verb between each rank and its place.
    """
    return "; ".join(f"rank {rank} {verb} {where[rank]}" for rank in sorted(where))


def _running(running: list[int], where: dict[int, str]) -> str:
    """"rank(s) [0, 1] were still running (rank 0 was in ...; rank 1 was at ...)"."""
    return f"rank(s) {running} were still running" + (f" ({whereabouts(where)})" if where else "")


def cell_timeout(timeout: float, running: list[int], where: dict[int, str], note: str) -> CellTimeout:
    """The error of a cell that ran out of time.

    Args:
        timeout: the cell's timeout in seconds.
        running: the ranks still running.
        where: rank -> where it was when time ran out (before it was interrupted).
        note: what stopping them did, or "".
    """
    return CellTimeout(f"The cell did not finish within --timeout {timeout:g} s; {_running(running, where)}. "
                       f"{note or INTERRUPTED}")


def interrupted(running: list[int], where: dict[int, str], note: str) -> str:
    """What the user reads after interrupting a cell (Ctrl-C or the stop button).

    Args:
        running: the ranks still running.
        where: rank -> where it was.
        note: what stopping them did, or "".
    """
    text = _running(running, where)
    return f"{text[0].upper()}{text[1:]}. {note or INTERRUPTED}"


def debugger_quit(rank: int, running: list[int], where: dict[int, str], note: str) -> HvdError:
    """A rank's debugger was quit (``q`` at a ``breakpoint()``), which ends the cell on every rank.

    Args:
        rank: the rank whose debugger was quit.
        running: the ranks still running.
        where: rank -> where it was.
        note: what stopping them did, or "".
    """
    return HvdError(f"rank {rank} quit its debugger (q), which ends the cell on every rank"
                    + (f"; {_running(running, where)}. {note or INTERRUPTED}" if running else "."))


def not_renewed(why: str) -> str:
    """The note when the ranks' collectives could not be renewed after a debugger was quit.

    Args:
        why: the renewal's error.
    """
    return (f"They were interrupted, but renewing their collectives failed ({why}): run %hvd restart before the "
            "next collective.")


IGNORED_INTERRUPT = "did not respond to an interrupt (blocked in a collective?)"
SILENT_CONTROLLER = "could not be interrupted: the cluster's controller did not answer (stopped or hung?)"


def unresponsive(ranks: list[int], restart_error: str | None = None, why: str = IGNORED_INTERRUPT) -> str:
    """The note when interrupted ranks did not stop (``why``) and the MPI world was restarted (or failed to).

    Args:
        ranks: the ranks that did not stop.
        restart_error: why the restart failed, or None.
        why: why they did not stop.
    """
    if restart_error is not None:
        return f"Rank(s) {ranks} {why} and restarting the engines failed: {restart_error}. Run %hvd restart."
    return (f"Rank(s) {ranks} {why}, so the MPI world was restarted: every rank's variables are lost; re-run "
            "your set-up cells.")


def rank_error(errors: dict[int, RankFailure | None], first: int, running: list[int], where: dict[int, str],
               note: str) -> RankError:
    """The error of a cell that raised on rank ``first``: its remote traceback, and
    the outcome on each rank (``errors``: every rank of the cell, None where it finished; ``where``:
    rank -> where each rank still running was).

    Args:
        errors: each rank's failure, None where it finished.
        first: the rank whose traceback is shown.
        running: the ranks still running.
        where: rank -> where it was.
        note: what stopping them did, or "".
    """
    outcomes = []
    for rank, error in errors.items():
        if rank in running:
            at = f" ({where[rank]})" if rank in where else ""
            outcomes.append(f"rank {rank}: was still running{at}; interrupted")
        elif error is not None:
            outcomes.append(f"rank {rank}: raised {error.ename}: {error.evalue}")
        else:
            outcomes.append(f"rank {rank}: finished")
    if note:
        outcomes.append(note)
    first_error = errors[first]
    assert first_error is not None  # (``first`` raised)
    raised = [first] + [r for r, e in errors.items() if e is not None and r != first and r not in running]
    return RankError(
        f"rank {first} raised {first_error.ename}: {first_error.evalue}",
        first_error.traceback.splitlines(),
        outcomes,
        raised,
    )
