"""``%hvd suspend`` and its resume: every rank's state saved into the user's private folder and the ranks ended
(their GPUs back to the node), then, at the next ``%%hvd`` cell or ``%hvd resume``, as many ranks started as
``%hvd start`` starts them, their state restored, the cells that made what could not be saved replayed, and the
restored state loaded into what they rebuilt. The suspended cluster is a folder on disk
(``cluster.launching.suspension``), so it outlives the kernel: ``%hvd resume ID`` in another notebook of the
same user takes it back, and only one can (``Claim``)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from .. import private
from ..cluster import ClusterError, ClusterOptions
from ..cluster.finding import delete_suspended
from ..cluster.launching.cluster import MPICluster
from ..cluster.launching.suspension import (
    Claim,
    Making,
    Manifest,
    SavedCell,
    Suspended,
    SuspendError,
    Timings,
    find_one,
    find_suspended,
    format_size,
    interrupt_running,
    on_each_rank,
    options_record,
    rank_dir,
    remove_expired,
    suspended_root,
    tree_size,
    write_keep,
)
from ..config import PREFIX
from ..engine import suspend_here
from .failures import HvdError, NoClusterError, no_cluster
from .recovery import RecordedCell, bound_names, to_replay

log = logging.getLogger(__name__)

SHOWN_NAMES = 20  # the saved names a suspend lists; more are counted


class Host(Protocol):
    """What a suspend and a resume need of the session (``session.Session``)."""

    cluster: MPICluster | None
    options: ClusterOptions | None
    history: list[RecordedCell]
    runner: Any  # runner.CellRunner: its replay
    tenancy: Any  # tenancy.Tenancy: whether the node's rules suspend

    def require(self) -> MPICluster: ...

    def start(self, options: ClusterOptions, restart: bool = False) -> Any: ...

    def stop(self) -> bool: ...


def _seconds(timings: Timings) -> str:
    return ", ".join(f"{step} {seconds:.1f} s" for step, seconds in timings.steps.items())


class Suspension:
    """This kernel's suspend and resume of its cluster, and its own suspended cluster (``own``) that the next
    ``%%hvd`` cell resumes.

    >>> print(session.suspension.suspend())      # %hvd suspend
    >>> print(session.suspension.resume())       # %hvd resume, or the next %%hvd cell

    Args:
        session: the session whose cluster it suspends.
    """

    def __init__(self, session: Host) -> None:
        self.session = session
        self.own: Suspended | None = None  # the cluster this kernel suspended, which its next %%hvd cell resumes
        self.note: str | None = None  # what the node's idle rule did, for the next cell

    # ---------------------------------------------------------------- suspend
    def suspend(self, why: str = "") -> str:
        """Save every rank's state, end the ranks, release the GPUs; what the cell says of it.

        Args:
            why: why (the node's rule), or "" where the user asked.

        Raises:
            HvdError: no cluster; a rank failed to save (the cluster then runs on, nothing lost).
        """
        session = self.session
        cluster = session.require()
        assert session.options is not None  # (a running cluster was started with options)
        ranks = [r.rank for r in cluster.ranks]
        away = [r.rank for r in cluster.ranks if not r.here]
        if away:  # (their state would go to their own host's folders, which a resume here cannot read)
            raise HvdError(f"Rank(s) {away} run on other hosts: a suspend keeps each rank's state in your private "
                           "folder on this host, so it needs every rank here. %hvd stop ends the cluster instead.")
        ident = cluster.workdir.name if cluster.workdir is not None else f"hvd-{os.getpid()}-{int(time.time())}"
        try:
            remove_expired(cluster.rules.suspended_ttl)  # (the node's rule; a suspend is when disk is used)
            making = Making(suspended_root(), ident, ranks)
        except (OSError, ClusterError) as exc:
            raise HvdError(f"The cluster was not suspended: {exc}. It runs on as it was.") from None
        timings = Timings()
        try:
            saves = on_each_rank(cluster, suspend_here.save, {r: (str(making.rank_dirs[r]),) for r in ranks},
                                 "saving its state")
        except (ClusterError, OSError) as exc:
            making.abandon()
            raise HvdError(f"The cluster was not suspended: {exc}. It runs on as it was (nothing was lost; the "
                           "ranks that did save threw it away).") from None
        timings.mark("save")
        manifest = replace(draft(cluster, session.options, session.history, ident), saves=[saves[r] for r in ranks],
                           suspended=time.time(), seconds=timings.total, bytes=tree_size(making.path), why=why)
        self.own = making.finish(manifest)
        session.stop()  # the ranks end, the GPUs' leases go back to the node, the card leaves the register
        timings.mark("stop")
        return describe_suspend(manifest, timings)

    def on_idle(self, why: str) -> bool:
        """Where the node's rules suspend an idle cluster (``Tenancy.suspends``), suspend it (from the watch's
        thread): whether it was suspended (else the caller stops it, a failed suspend logged).

        Args:
            why: what the rule says.
        """
        if not self.session.tenancy.suspends():
            return False
        try:
            said = self.suspend(why)
        except HvdError as exc:
            log.warning("hvd cluster: the idle suspend failed, so it is stopped: %s", exc)
            return False
        self.note = (f"This notebook's cluster was suspended at {time.strftime('%H:%M:%S')}: {why}.\n{said}")
        log.warning("hvd cluster suspended by the node's rules: %s", why)
        return True

    def on_kernel_end(self) -> bool:
        """At the kernel's end (atexit): where the cluster is to be kept (``%hvd start --keep``, or the node's
        ``keep_on_kernel_end``), suspend it, ranks still running a cell interrupted first; whether it was (else the
        caller stops it; a failed suspend is logged)."""
        cluster, options = self.session.cluster, self.session.options
        if cluster is None or options is None or not keeps(cluster, options):
            return False
        try:
            cut = interrupt_running(cluster)
            log.warning("%s", self.suspend("its kernel ended" + (" while a cell ran, which was interrupted" if cut
                                                                  else "")))
            return True
        except Exception:  # (at exit: never raise; the cluster is stopped instead)
            log.exception("hvd cluster: the suspend at the kernel's end failed, so it is stopped")
            return False

    # ----------------------------------------------------------------- resume
    @property
    def pending(self) -> bool:
        """This kernel's cluster is suspended, and no cluster runs: the next ``%%hvd`` cell resumes it."""
        return self.own is not None and self.session.cluster is None

    def no_cluster(self, released: str | None) -> NoClusterError:
        """The error of a command that needs the ranks where none run: why the rules stopped them (``released``),
        or that this kernel's cluster is suspended, or that none was started.

        Args:
            released: why the node's rules stopped the cluster, or None.
        """
        if released is None and self.pending and self.own is not None:
            return NoClusterError(f"This notebook's cluster is suspended ({self.own.id}): the next %%hvd cell, or "
                                  f"%hvd resume, brings it back; %hvd delete {self.own.id} throws its state away.")
        return NoClusterError(released) if released else no_cluster()

    def resume_pending(self, say: Callable[[str], None]) -> None:
        """Before a ``%%hvd`` cell: where this kernel's cluster is suspended, resume it, saying so.

        Args:
            say: shows a line.
        """
        if not self.pending:
            return
        if self.note:
            say(f"{PREFIX} {self.note}")
        say(f"{PREFIX} {self.resume(say=say)}")

    def resume(self, ident: str | None = None, say: Callable[[str], None] = print) -> str:
        """Take a suspended cluster back: ``ident``, else this kernel's own, else the user's only one. Its ranks
        started (through the GPUs' leases, as ``%hvd start``), restored, the cells that made what could not be
        saved replayed, and the restored state loaded into what they made; what the cell says of it.

        Args:
            ident: the suspended cluster's name, or None.
            say: shows a line per replayed cell.

        Raises:
            HvdError: a cluster runs already; none (or no such one) is suspended; another notebook takes it now;
                its start or a rank's restore failed (it stays suspended then); a replayed cell failed.
        """
        session = self.session
        if session.cluster is not None:
            raise HvdError(f"A cluster of {session.cluster.n} ranks runs in this notebook: %hvd suspend (or %hvd "
                           "stop) it first, then %hvd resume.")
        target = _choose(ident, self.own)
        try:
            claim = Claim(target)
            manifest = target.manifest()
        except SuspendError as exc:
            if self.own is not None and self.own.id == target.id:
                self.own = None
            raise HvdError(str(exc)) from None
        if manifest.user != private.user_name():
            claim.release()
            raise HvdError(f"{target.id} was suspended by {manifest.user}, not you: it was not touched.")
        timings = Timings()
        self._restore(target, manifest, claim, timings)
        self.own, self.note = None, None
        replayed = _replay(session, manifest, timings, say)
        keep_record(session.require(), session.options, session.history)
        return describe_resume(manifest, timings, replayed)

    def _restore(self, target: Suspended, manifest: Manifest, claim: Claim, timings: Timings) -> None:
        """Start the ranks and restore each one's state; the suspended folder removed once all restored. Where
        that fails, nothing runs and the cluster stays suspended."""
        session = self.session
        try:
            session.start(manifest.start_options())  # (the GPUs' leases as %hvd start takes them)
            timings.mark("start")
            cluster = session.require()
            on_each_rank(cluster, suspend_here.restore,
                         {r.rank: (str(rank_dir(target.path, r.rank)),) for r in cluster.ranks}, "restoring its state")
            timings.mark("restore")
        except BaseException as exc:
            claim.release()
            if session.cluster is not None:
                session.stop()
            if isinstance(exc, (ClusterError, HvdError, OSError)):
                raise HvdError(f"{target.id} was not resumed: {exc}. It stays suspended: %hvd resume {target.id} "
                               "tries again.") from None
            raise
        claim.done()

    # ----------------------------------------------------------------- delete
    def delete(self, ident: str) -> str:
        """Throw a suspended cluster's state away (not one that a notebook takes back right now); what it says.

        Args:
            ident: its name.

        Raises:
            HvdError: no such suspended cluster, or a notebook takes it back right now.
        """
        try:
            said = delete_suspended(ident)
        except (SuspendError, OSError) as exc:
            raise HvdError(str(exc)) from None
        if self.own is not None and self.own.id == ident:
            self.own, self.note = None, None
        return said


def draft(cluster: MPICluster, options: ClusterOptions, history: list[RecordedCell], ident: str) -> Manifest:
    """The manifest of a suspend of ``cluster`` as ``ident``, before its ranks saved: who, its shape and start
    options, the recorded cells with the names each binds.

    Args:
        cluster: the running cluster.
        options: its start options.
        history: the recorded cells.
        ident: the suspended cluster's name.
    """
    return Manifest(id=ident, user=private.user_name(), kernel=os.getpid(), ranks=len(cluster.ranks),
                    gpus=list(cluster.gpus), options=options_record(options),
                    cells=[SavedCell(c.code, c.ranks, c.timeout, bound_names(c.code)) for c in history],
                    saves=[], suspended=0.0, seconds=0.0, bytes=0)


def keeps(cluster: MPICluster, options: ClusterOptions) -> bool:
    """Whether the cluster is suspended, not stopped, when its kernel ends (``--keep``, ``keep_on_kernel_end``).

    Args:
        cluster: the running cluster.
        options: its start options.
    """
    return options.keep or cluster.rules.keep_on_kernel_end


def keep_record(cluster: MPICluster, options: ClusterOptions | None, history: list[RecordedCell]) -> None:
    """Where the cluster is to be kept, what the reaper needs to suspend it if the kernel dies outright
    (``suspension.write_keep``): after its start and each recorded cell.

    Args:
        cluster: the running cluster.
        options: its start options.
        history: the recorded cells.
    """
    if options is None or cluster.workdir is None or not keeps(cluster, options):
        return
    write_keep(cluster, draft(cluster, options, history, cluster.workdir.name))


def _replay(session: Host, manifest: Manifest, timings: Timings, say: Callable[[str], None]) -> list[RecordedCell]:
    """Replay, in order, the cells that bind what could not be saved, then load the restored state into what
    they made; the cells replayed. The recorded cells become this session's (``%hvd replay``)."""
    session.history = [RecordedCell(c.code, c.ranks, c.timeout) for c in manifest.cells]
    cells = to_replay(session.history, [c.binds for c in manifest.cells], set(manifest.unsaved()))
    try:
        if cells:
            session.runner.replay(lambda line: say(f"{PREFIX} {line}"), cells)
        timings.mark("replay")
        cluster = session.require()
        on_each_rank(cluster, suspend_here.reconcile, {r.rank: () for r in cluster.ranks},
                     "loading the restored state into what the replay made")
        timings.mark("reconcile")
    except (HvdError, ClusterError) as exc:
        raise HvdError(f"{manifest.id} was resumed (every rank's saved state restored), but: {exc}") from None
    return cells


def _choose(ident: str | None, own: Suspended | None) -> Suspended:
    """The suspended cluster a resume takes: ``ident``, else this kernel's ``own``, else the user's only one."""
    try:
        if ident is not None:
            return find_one(ident)
        if own is not None:
            return own
        found = find_suspended()
    except (SuspendError, OSError) as exc:
        raise HvdError(str(exc)) from None
    if len(found) == 1:
        return found[0]
    if not found:
        raise HvdError("Nothing to resume: you have no suspended cluster on this host (hvd-notebook list shows "
                       "your clusters). %hvd start starts a new one.")
    raise HvdError(f"You have {len(found)} suspended clusters: {', '.join(s.id for s in found)}. Name the one "
                   "to resume: %hvd resume ID.")


def describe_suspend(manifest: Manifest, timings: Timings) -> str:
    """What ``%hvd suspend`` says: how many ranks saved how much in how long, the GPUs released, each object that
    could not be saved (per rank where they differ) and whether a resume rebuilds it, and how to resume.

    Args:
        manifest: the suspended cluster's manifest.
        timings: the suspend's steps.
    """
    per_rank = ", ".join(f"rank {s.get('rank')}: {format_size(int(s.get('bytes', 0)))}" for s in manifest.saves)
    freed = f" and GPU(s) {','.join(manifest.gpus)} went back to the node" if manifest.gpus else ""
    lines = [f"Suspended {manifest.id}: {manifest.ranks} rank(s) saved {format_size(manifest.bytes)} ({per_rank}) in "
             f"{timings.total:.1f} s ({_seconds(timings)}); the ranks ended{freed}."]
    saved = sorted({str(name) for s in manifest.saves for name in s.get("saved", ())})
    if saved:
        lines.append(f"Saved: {', '.join(saved[:SHOWN_NAMES])}" + (f" and {len(saved) - SHOWN_NAMES} more" if
                                                                   len(saved) > SHOWN_NAMES else "") + ".")
    bound = {name for cell in manifest.cells for name in cell.binds}
    for name, whys in sorted(manifest.unsaved().items()):
        by_why: dict[str, list[int]] = {}
        for rank, why in sorted(whys.items()):
            by_why.setdefault(why, []).append(rank)
        said = "; ".join(f"{why} (rank {', '.join(map(str, ranks))})" for why, ranks in by_why.items())
        rebuilt = ("its cell is replayed on resume" if name in bound or "*" in bound else
                   "no recorded cell binds it (a --no-replay cell, %hvd push?): it will be missing after a resume")
        lines.append(f"Not saved: {name}: {said}; {rebuilt}.")
    lines.append(f"The next %%hvd cell (or %hvd resume) brings it back; from another notebook of yours: %hvd resume "
                 f"{manifest.id}.")
    return "\n".join(lines)


def describe_resume(manifest: Manifest, timings: Timings, replayed: list[RecordedCell]) -> str:
    """What a resume says: how long, each step, and the cells replayed.

    Args:
        manifest: the suspended cluster's manifest.
        timings: the resume's steps.
        replayed: the cells replayed.
    """
    cells = (f"; replayed {len(replayed)} cell(s): " + ", ".join(repr(c.label) for c in replayed)) if replayed else ""
    why = f": {manifest.why}" if manifest.why else ""
    return (f"Resumed {manifest.id} (suspended at {time.strftime('%H:%M:%S', time.localtime(manifest.suspended))}"
            f"{why}): "
            f"{manifest.ranks} rank(s) in {timings.total:.1f} s ({_seconds(timings)}){cells}.")
