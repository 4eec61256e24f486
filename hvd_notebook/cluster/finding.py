"""This user's clusters found, and the orphaned ones stopped: what ``hvd-notebook list`` and ``clean`` and the
JupyterLab panel show and do.

A cluster is a directory of the user's private folder (``processes.workdir``) that records the kernel (or
``hvd-notebook run`` job) that started it and every process of it; it is orphaned once that kernel is gone. A
suspended cluster is a folder of ``suspended/`` there (``launching.suspension``): no process, only its state,
kept until it is resumed, deleted, or older than the node's ``suspended_ttl``.
Above ``node`` and ``processes``: it reads the node's register to find the folders where a user's clusters
may be, and stops a cluster with the reaper.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from .. import private
from ..liveness import pid_alive
from .errors import ClusterError
from .launching import suspension
from .launching.suspension import Suspended, SuspendError
from .node import policy, registry, shm
from .processes import stacks
from .processes.pids import is_alive, live_processes
from .processes.reaper import reap, suspend_kept
from .processes.workdir import WorkDir, find_workdirs, remove_leftovers


@dataclass
class ClusterDir:
    """A cluster directory as ``list``, ``clean`` and the panel see it.

    Args:
        workdir: the cluster's directory.
        kernel_pid: the PID of the kernel (or job) that started it; None where its directory does not say.
        orphaned: the kernel that started the cluster is gone.
        live_pids: the cluster's processes that are still the ones its directory records.
    """

    workdir: WorkDir
    kernel_pid: int | None
    orphaned: bool
    live_pids: list[int]

    @property
    def path(self) -> Path:
        """The cluster's directory."""
        return self.workdir.path

    @property
    def started_by(self) -> str:
        """Who started the cluster: "kernel PID", or a job of ``hvd-notebook run`` with its command."""
        job, pid = self.workdir.job(), self.kernel_pid or "?"
        return f"hvd-notebook run {pid} ({job})" if job is not None else f"kernel {pid}"

    def describe(self) -> str:
        """One line: its name, who started it, whether that one runs, its role and live processes."""
        state = "gone" if self.orphaned else "running"
        role = ", the warm standby of its other cluster" if self.workdir.is_standby else ""
        return f"{self.path.name}: {self.started_by} ({state}){role}, {len(self.live_pids)} live process(es)"


def find_clusters(base: Path | None = None) -> list[ClusterDir]:
    """This user's clusters, with their kernel and the processes still theirs.

    Args:
        base: the folder to look in; None: the user's private folder (``processes.workdir.clusters_dir``).
    """
    found = []
    for workdir in find_workdirs(base):
        owner = workdir.owner()
        found.append(ClusterDir(workdir, owner[0] if owner else None, owner is None or not is_alive(owner),
                                [p.pid for p in live_processes(workdir.read_pids())]))
    return found


def own_cluster_dirs(cards: list[registry.Card] | None = None) -> list[Path]:
    """Where this user's cluster directories may be: each place ``private.base_dir`` may have chosen,
    and the folders that this user's cards name where they are such a place too (a server started with
    another TMPDIR); only private folders of this user's (``private.check_dir``).

    Args:
        cards: the node's register as already read (the panel reads it once per poll); None: read it.
    """
    candidates = private.candidate_bases()
    names = {p.name for p in candidates}
    found = set(candidates) | {Path(c.workdir).parent for c in (registry.read_all() if cards is None else cards)
                               if c.user == private.user_name() and c.workdir}
    return [path for path in sorted(found) if path.name in names and private.is_private_dir(path)]


def own_suspended(cards: list[registry.Card] | None = None) -> list[Suspended]:
    """This user's suspended clusters in every folder of theirs (``own_cluster_dirs``) that has a ``suspended/``
    folder already (none is made: the panel only reads), oldest name first within each.

    Args:
        cards: the node's register as already read; None: read it.
    """
    found: dict[str, Suspended] = {}
    for base in own_cluster_dirs(cards):
        if (base / suspension.SUSPENDED_DIR).is_dir():
            for suspended in suspension.find_suspended(base):
                found.setdefault(suspended.id, suspended)
    return list(found.values())


def stop_orphans(clusters: list[ClusterDir], dry_run: bool) -> None:
    """Stop the orphaned ones of ``clusters``, saying what was stopped and what was left alone; one whose kernel
    asked that it be kept (``%hvd start --keep``) is suspended first, as its reaper would have.

    Args:
        clusters: this user's clusters (``find_clusters``).
        dry_run: only say what would be stopped.
    """
    orphans = [c for c in clusters if c.orphaned]
    if not orphans:
        kept = len(clusters)
        print("No orphaned clusters." + (f" {kept} cluster(s) belong to running kernels or jobs." if kept else ""))
        return
    for c in orphans:
        if dry_run:
            print(f"would stop {c.describe()}")
            continue
        pids = sorted(c.live_pids)
        if c.workdir.kept:  # (its reaper was killed with its kernel: what it would have suspended, suspended here)
            suspend_kept(c.workdir)
            where = suspension.suspended_root(c.path.parent) / c.path.name
            print(f"suspended {c.path.name} first, as its kernel asked (--keep)" if where.is_dir() else
                  f"could not suspend {c.path.name} (--keep): its ranks did not save their state")
        killed = reap(c.workdir)
        print(f"stopped {c.path.name} ({c.started_by} is gone): killed {killed} process(es)"
              + (f" {pids}" if pids else "") + f", removed {c.path}")
    for c in clusters:
        if not c.orphaned:
            print(f"left alone: {c.describe()}")


def describe_suspended(suspended: Suspended) -> str:
    """One line of ``hvd-notebook list`` on a suspended cluster: since when, its ranks, its size on disk, and how
    to take it back.

    Args:
        suspended: the suspended cluster.
    """
    try:
        manifest = suspended.manifest()
    except SuspendError as exc:
        return f"{suspended.id}: suspended, unreadable ({exc})"
    since = time.strftime("%m-%d %H:%M", time.localtime(manifest.suspended))
    kernel = f"kernel {manifest.kernel} ({'running' if pid_alive(manifest.kernel) else 'gone'})"
    return (f"{suspended.id}: suspended since {since} by {kernel}, {manifest.ranks} rank(s), "
            f"{suspension.format_size(suspended.size())} on disk; %hvd resume {suspended.id} takes it back, "
            f"hvd-notebook delete {suspended.id} throws it away")


def delete_suspended(ident: str) -> str:
    """``hvd-notebook delete ID`` (and ``%hvd delete ID``): the suspended cluster removed, unless a notebook
    takes it back right now (a SuspendError says so, or that there is no such one); what was freed.

    Args:
        ident: its name.
    """
    target = suspension.find_one(ident)
    size = target.size()
    suspension.Claim(target).done()
    return f"Deleted the suspended cluster {ident} ({suspension.format_size(size)} freed)."


def clean_suspended(dry_run: bool, base: Path) -> None:
    """What ``clean`` does to suspended clusters: those older than the node's ``suspended_ttl`` removed (said),
    what killed kernels left half-made removed, the others left alone (said).

    Args:
        dry_run: only say what would be removed.
        base: the user's private folder.
    """
    try:
        ttl = policy.load().suspended_ttl
    except ClusterError as exc:  # (the policy cannot be read: nothing counts as expired)
        print(f"hvd-notebook clean: {exc}")
        ttl = None
    if not dry_run:
        suspension.remove_leftovers(base)
        for ident in suspension.remove_expired(ttl, base):
            print(f"removed the suspended cluster {ident}: suspended longer than the node's suspended_ttl")
    for suspended in suspension.find_suspended(base):
        print(f"left alone: {describe_suspended(suspended)}")


def clean_own(dry_run: bool, bases: list[Path]) -> int:
    """This user's orphaned clusters in ``bases`` stopped, and what killed ranks and kernels left (stack
    files, elastic commits, cards, shared-memory segments) removed; 0 (``hvd-notebook clean``'s status).

    Args:
        dry_run: only say what would be stopped.
        bases: the folders to look in (``own_cluster_dirs``, or the private folder).
    """
    stacks.registered_pids()  # (drops the stack files of ranks that were killed)
    for base in bases:
        remove_leftovers(base)  # (the hvd.elastic commits and half-made folders of killed kernels and jobs)
    stop_orphans([c for base in bases for c in find_clusters(base)], dry_run)
    for base in bases:
        clean_suspended(dry_run, base)
    if dry_run:
        return 0
    for card in registry.read_all():
        if card.user == private.user_name() and not card.kernel_alive:
            registry.remove(path=card.path)
    removed = shm.remove_orphaned()
    if removed:
        print(f"removed {len(removed)} shared-memory segment(s) that killed ranks left in {removed[0].parent}")
    return 0
