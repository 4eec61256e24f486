"""A suspended cluster on disk, and a world's suspend and resume through its rank channel.

``%hvd suspend`` (or the node's idle rule) saves every rank's state and ends the ranks; what it saved outlives
the kernel, in the user's private folder (``private.base_dir()``, owner only, checked before each use)::

    suspended/ID/manifest.json   who, the start options of its shape, the recorded cells (with the names each
                                 binds), each rank's save report, when, how long, how big (0600)
    suspended/ID/lock            flocked by the kernel that takes it back: two kernels cannot both resume it
    suspended/ID/rank-R/         what rank R saved (``engine.suspension.save``)

A suspend writes into ``.ID.making-PID`` and renames it to ``ID`` once every rank saved and the manifest is
written: a half-made one is never listed, and one left by a killed kernel is removed by ``hvd-notebook clean``.
A resume takes the lock (``Claim``) for as long as it restores, and removes the folder once every rank
restored (renamed to ``.ID.taken-PID`` first, so that no listing shows it any more).

The calls on the ranks (``on_each_rank``) go through the world's rank channel, one request per rank with its
own folder; a rank that raises or dies fails the call with an error that names it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ... import private
from ...config import ClusterOptions
from ...liveness import pid_alive
from ..errors import ClusterError
from ..processes.workdir import KEEP_FILE

if TYPE_CHECKING:
    from .channel import RankChannel
    from .cluster import MPICluster

SUSPENDED_DIR = "suspended"
MANIFEST_FILE = "manifest.json"
LOCK_FILE = "lock"
MAKING = ".making-"  # a suspend under way: .ID.making-PID
TAKEN = ".taken-"  # a resumed one being removed: .ID.taken-PID
MAX_MANIFEST_BYTES = 64 << 20  # the recorded cells' code: far more than a notebook holds
MANIFEST_VERSION = 1
CALL_POLL_S = 0.2  # how often a call on the ranks checks that they are alive


class SuspendError(ClusterError):
    """A suspended cluster that cannot be used: not found, being resumed, unreadable; says what to do."""


def rank_dir(folder: Path, rank: int) -> Path:
    """Where rank ``rank`` saves its state in the suspended cluster's ``folder``.

    Args:
        folder: the suspended cluster's folder.
        rank: the rank.
    """
    return folder / f"rank-{rank}"


# ------------------------------------------------------------------ the manifest
@dataclass(frozen=True)
class SavedCell:
    """A recorded ``%%hvd`` cell as a resume may replay it, with the top-level names it binds (``["*"]``: it
    could not be read, so it may bind anything)."""

    code: str
    ranks: list[int] | None
    timeout: float | None
    binds: list[str]


@dataclass(frozen=True)
class Manifest:
    """What a suspended cluster is: what started it, what its ranks saved and what a resume replays.

    Args:
        id: its name (the cluster's id when it was suspended).
        user: the user whose it is.
        kernel: the PID of the kernel that suspended it.
        ranks: its number of ranks (a resume starts as many).
        gpus: the GPUs it held (a resume takes as many, wherever free).
        options: the start options of its shape (``ClusterOptions``' fields).
        cells: the recorded cells, in order.
        saves: each rank's save report (``engine.suspension.save``), in rank order.
        suspended: when (``time.time()``).
        seconds: how long the ranks took to save.
        bytes: what it holds on disk.
        why: why it was suspended ("" where the user asked).
    """

    id: str
    user: str
    kernel: int
    ranks: int
    gpus: list[str]
    options: dict[str, Any]
    cells: list[SavedCell]
    saves: list[dict[str, Any]]
    suspended: float
    seconds: float
    bytes: int
    why: str = ""
    version: int = MANIFEST_VERSION

    def to_json(self) -> str:
        """The manifest file's text."""
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str, where: Path) -> Manifest:
        """The manifest a file's ``text`` holds; a SuspendError naming ``where`` where it is not one.

        Args:
            text: the file's text.
            where: the file, for the error.
        """
        try:
            data = json.loads(text)
            data["cells"] = [SavedCell(str(c["code"]), c["ranks"], c["timeout"], [str(b) for b in c["binds"]])
                             for c in data["cells"]]
            known = {f.name for f in fields(cls)}
            manifest = cls(**{k: v for k, v in data.items() if k in known})
            if not isinstance(manifest.ranks, int) or manifest.ranks < 1:
                raise ValueError(f"ranks {manifest.ranks!r}")
            return manifest
        except (ValueError, KeyError, TypeError) as exc:
            raise SuspendError(f"{where} is not a suspended cluster's manifest ({type(exc).__name__}: {exc}): "
                               f"hvd-notebook delete {where.parent.name} removes it.") from None

    def start_options(self) -> ClusterOptions:
        """The options that start the same shape again: as the cluster was started, with its number of ranks."""
        values: dict[str, Any] = {}
        for f in fields(ClusterOptions):
            if f.name in self.options:
                value = self.options[f.name]
                if isinstance(f.default, tuple):
                    value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
                values[f.name] = value
        values["n"] = self.ranks
        return ClusterOptions(**values)

    def unsaved(self) -> dict[str, dict[int, str]]:
        """The names some rank could not save: name -> {rank: why}."""
        found: dict[str, dict[int, str]] = {}
        for report in self.saves:
            for name, why in dict(report.get("unsaved", {})).items():
                found.setdefault(str(name), {})[int(report.get("rank", -1))] = str(why)
        return found


def options_record(options: ClusterOptions) -> dict[str, Any]:
    """``options`` as the manifest keeps them (JSON).

    Args:
        options: the options the cluster was started with.
    """
    return json.loads(json.dumps(asdict(options)))  # (tuples as the file gives them back: lists)


# ------------------------------------------------------------------ the store
def suspended_root(base: Path | None = None) -> Path:
    """The user's folder of suspended clusters (made owner-only where missing, checked either way).

    Args:
        base: the user's private folder; None: ``private.base_dir()``.
    """
    return private.subdir(SUSPENDED_DIR, base or private.base_dir())


@dataclass(frozen=True)
class Suspended:
    """One suspended cluster's folder."""

    path: Path

    @property
    def id(self) -> str:
        return self.path.name

    def manifest(self) -> Manifest:
        """Its manifest, read as the user's own file (not a link or a FIFO, of a sane size)."""
        where = self.path / MANIFEST_FILE
        try:
            text = private.read_text(where, max_bytes=MAX_MANIFEST_BYTES)
        except FileNotFoundError:
            raise SuspendError(f"{self.id} is no longer suspended (taken back by another notebook, or deleted): "
                               "hvd-notebook list shows what is.") from None
        except OSError as exc:
            raise SuspendError(f"{where} cannot be read ({exc}): hvd-notebook delete {self.id} removes it.") from None
        return Manifest.from_json(text, where)

    def size(self) -> int:
        """The bytes its files hold (links are not followed)."""
        return tree_size(self.path)

    def remove(self) -> None:
        """Remove it: renamed out of sight at once, then deleted."""
        gone = self.path.with_name(f".{self.id}{TAKEN}{os.getpid()}")
        try:
            os.rename(self.path, gone)
        except FileNotFoundError:
            return
        shutil.rmtree(gone, ignore_errors=True)


def format_size(nbytes: int) -> str:
    """``812 B``, ``23.4 KiB``, ``96.1 MiB``, ``1.2 GiB``.

    Args:
        nbytes: a size in bytes.
    """
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"


def tree_size(path: Path) -> int:
    """The bytes of the regular files under ``path``, no link followed.

    Args:
        path: a folder.
    """
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            total += st.st_size if not os.path.islink(os.path.join(root, name)) else 0
    return total


def find_suspended(base: Path | None = None) -> list[Suspended]:
    """This user's suspended clusters, oldest name first: the private folders of ``suspended/`` (a suspend
    under way and one being removed are not among them).

    Args:
        base: the user's private folder; None: ``private.base_dir()``.
    """
    root = suspended_root(base)
    found = []
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if not entry.name.startswith(".") and entry.is_dir(follow_symlinks=False) \
                and private.is_private_dir(Path(entry.path)):
            found.append(Suspended(Path(entry.path)))
    return found


def find_one(ident: str, base: Path | None = None) -> Suspended:
    """The suspended cluster named ``ident``; a SuspendError listing the user's where there is none.

    Args:
        ident: its id, as ``hvd-notebook list`` shows it.
        base: the user's private folder; None: ``private.base_dir()``.
    """
    found = find_suspended(base)
    for suspended in found:
        if suspended.id == ident:
            return suspended
    names = ", ".join(s.id for s in found)
    raise SuspendError(f"No suspended cluster is named {ident!r}. " + (
        f"Yours: {names}." if names else "You have none on this host (hvd-notebook list shows your clusters)."))


def remove_leftovers(base: Path | None = None) -> list[Path]:
    """What killed kernels left in ``suspended/``: suspends under way (``.ID.making-PID``) and removals
    (``.ID.taken-PID``) whose kernel is gone; those removed.

    Args:
        base: the user's private folder; None: ``private.base_dir()``.
    """
    root, removed = suspended_root(base), []
    for entry in os.scandir(root):
        for mark in (MAKING, TAKEN):
            pid = entry.name.rpartition(mark)[2] if entry.name.startswith(".") and mark in entry.name else ""
            if pid.isdigit() and not pid_alive(int(pid)) and entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(Path(entry.path))
    return removed


def remove_expired(ttl: float | None, base: Path | None = None, now: float | None = None) -> list[str]:
    """The suspended clusters suspended over ``ttl`` seconds ago (the node's ``suspended_ttl``) removed, but
    none that a notebook takes back right now; their names.

    Args:
        ttl: seconds a suspended cluster is kept; None: for ever.
        base: the user's private folder; None: ``private.base_dir()``.
        now: the time (``time.time()``); None: now.
    """
    if ttl is None:
        return []
    now, removed = time.time() if now is None else now, []
    for suspended in find_suspended(base):
        try:
            if now - suspended.manifest().suspended > ttl:
                Claim(suspended).done()
                removed.append(suspended.id)
        except SuspendError:  # (unreadable: hvd-notebook delete; being resumed: no longer expired)
            continue
    return removed


class Making:
    """A suspend under way: ``.ID.making-PID`` with an owner-only folder per rank; ``finish`` names it ``ID``.

    Args:
        root: the folder of suspended clusters.
        ident: the suspended cluster's name.
        ranks: its ranks.
    """

    def __init__(self, root: Path, ident: str, ranks: list[int]) -> None:
        self.final = root / ident
        if self.final.exists():
            raise SuspendError(f"{self.final} exists already: hvd-notebook delete {ident} removes it.")
        self.path = root / f".{ident}{MAKING}{os.getpid()}"
        shutil.rmtree(self.path, ignore_errors=True)  # (this very kernel's, of a suspend that failed)
        os.mkdir(self.path, 0o700)
        private.check_dir(self.path)
        self.rank_dirs = {rank: private.ensure_dir(rank_dir(self.path, rank)) for rank in ranks}

    def finish(self, manifest: Manifest) -> Suspended:
        """Write the manifest and the lock file, then give the folder its name: it is suspended.

        Args:
            manifest: what it is.
        """
        private.write_text(self.path / MANIFEST_FILE, manifest.to_json())
        private.write_text(self.path / LOCK_FILE, "")
        os.rename(self.path, self.final)
        return Suspended(self.final)

    def abandon(self) -> None:
        """The suspend failed: nothing of it is kept."""
        shutil.rmtree(self.path, ignore_errors=True)


class Claim:
    """A kernel's hold on a suspended cluster while it takes it back: an exclusive ``flock`` on its lock file,
    which the operating system drops if the kernel dies (the cluster then stays suspended for another try).

    >>> claim = Claim(suspended)      # SuspendError where another kernel holds it, or it is gone
    >>> ...                           # start the ranks, restore them
    >>> claim.done()                  # every rank restored: the suspended folder is removed

    Args:
        suspended: the suspended cluster to take.
    """

    def __init__(self, suspended: Suspended) -> None:
        self.suspended = suspended
        path = suspended.path / LOCK_FILE
        try:
            self._fd: int | None = private.open_regular(path, max_bytes=0)
        except FileNotFoundError:
            raise SuspendError(f"{suspended.id} is no longer suspended (taken back by another notebook, or "
                               "deleted): hvd-notebook list shows what is.") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.stat(path, follow_symlinks=False).st_ino != os.fstat(self._fd).st_ino:
                raise FileNotFoundError(path)  # (removed by the kernel that held it before us)
        except BlockingIOError:
            self.release()
            raise SuspendError(f"{suspended.id} is being taken back by another notebook right now; only one "
                               "can resume it.") from None
        except FileNotFoundError:
            self.release()
            raise SuspendError(f"{suspended.id} was taken back by another notebook just now.") from None

    def done(self) -> None:
        """Every rank restored: the suspended cluster is removed, then the lock dropped."""
        self.suspended.remove()
        self.release()

    def release(self) -> None:
        """Drop the hold (it stays suspended)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


# ------------------------------------------------------------------ calls on the ranks
def on_each_rank(cluster: MPICluster | Orphan, func: Callable[..., Any], args_of: dict[int, tuple], what: str,
                 timeout: float | None = None) -> dict[int, Any]:
    """``func(*args_of[rank])`` on each rank at once: rank -> its value. A ClusterError naming the rank where one
    raised, died, or (with ``timeout``) did not answer in time; the others' calls still run then.

    Args:
        cluster: the running cluster (or a dead kernel's, ``Orphan``).
        func: a function of the engine side.
        args_of: each rank's arguments.
        what: what the call does, for the error ("saving its state").
        timeout: seconds to wait, or None.
    """
    channel = cluster.channel
    pending = {rank: channel.apply(func, *args, ranks=[rank]) for rank, args in args_of.items()}
    deadline = None if timeout is None else time.monotonic() + timeout
    values: dict[int, Any] = {}
    while pending:
        for rank, result in list(pending.items()):
            if not result.ready():
                continue
            del pending[rank]
            try:
                values[rank] = result.get()[0]
            except Exception as exc:
                raise ClusterError(f"rank {rank} failed {what}: {getattr(exc, 'ename', type(exc).__name__)}: "
                                   f"{getattr(exc, 'evalue', exc)}") from None
        if not pending:
            break
        dead = sorted(r for r, ok in cluster.alive().items() if not ok and r in pending)
        if dead:
            raise ClusterError(f"rank(s) {dead} died {what} (out of memory is a common cause)")
        if deadline is not None and time.monotonic() > deadline:
            raise ClusterError(f"rank(s) {sorted(pending)} did not finish {what} within {timeout:g} s")
        next(iter(pending.values())).wait(CALL_POLL_S)
    return values


def interrupt_running(cluster: MPICluster | Orphan, grace: float = 10.0) -> bool:
    """Interrupt the ranks that run a cell now (a kernel that ends while one runs), and wait up to ``grace`` seconds
    until none does; whether any did. A ClusterError where some still run then (blocked in a collective: no save
    request would get through).

    Args:
        cluster: the running cluster.
        grace: seconds the interrupted ranks get.
    """
    channel = cluster.channel
    running = [rank for rank, busy in channel.busy().items() if busy]
    if not running:
        return False
    channel.interrupt(running)
    deadline = time.monotonic() + grace
    while any(channel.busy(running).values()):
        if time.monotonic() > deadline:
            raise ClusterError(f"rank(s) {running} did not stop their cell within {grace:g} s of an interrupt")
        time.sleep(CALL_POLL_S)
    return True


@dataclass
class Timings:
    """How long each step of a suspend or resume took, in seconds, in order."""

    steps: dict[str, float] = field(default_factory=dict)
    _began: float = field(default_factory=time.monotonic)

    def mark(self, step: str) -> None:
        """``step`` ended now (it began where the last one ended).

        Args:
            step: its name.
        """
        now = time.monotonic()
        self.steps[step] = now - self._began - sum(self.steps.values())

    @property
    def total(self) -> float:
        return sum(self.steps.values())


# ------------------------------------------------------------------ a --keep cluster whose kernel died
def write_keep(cluster: MPICluster, draft: Manifest) -> None:
    """What the reaper needs to suspend a ``--keep`` cluster whose kernel died: the manifest as far as the kernel
    knows it, and each rank's engine and process (``KEEP_FILE`` in the cluster's directory).

    Args:
        cluster: the running cluster.
        draft: the manifest, without the ranks' reports.
    """
    if cluster.workdir is not None:
        private.write_text(cluster.workdir / KEEP_FILE, json.dumps({
            "manifest": json.loads(draft.to_json()), "engines": {r.rank: r.engine_id for r in cluster.ranks},
            "pids": {r.rank: r.pid for r in cluster.ranks}}))


@dataclass
class Orphan:
    """A dead kernel's ``--keep`` cluster, as the reaper's suspend reaches it: a second client of its controller.

    Args:
        channel: the rank channel of the second client.
        pids: rank -> process id.
    """

    channel: RankChannel
    pids: dict[int, int]

    def alive(self) -> dict[int, bool]:
        return {rank: pid_alive(pid) for rank, pid in self.pids.items()}


def suspend_orphan(workdir: Path, timeout: float = 300.0) -> Suspended:
    """Suspend the cluster in ``workdir`` whose kernel died (``KEEP_FILE`` says it is to be kept): ranks still in a
    cell interrupted, each rank's state saved, the manifest written. The reaper then stops what is left.

    Args:
        workdir: the cluster's directory.
        timeout: seconds the ranks get to save.
    """
    from .channel import connect

    kept = json.loads(private.read_text(workdir / KEEP_FILE, max_bytes=MAX_MANIFEST_BYTES))
    draft = Manifest.from_json(json.dumps(kept["manifest"]), workdir / KEEP_FILE)
    engines = {int(r): int(e) for r, e in kept["engines"].items()}
    files = sorted((workdir / "profile" / "security").glob("ipcontroller-*-client.json"))
    if not files:
        raise SuspendError(f"{workdir} has no controller connection file")
    orphan = Orphan(connect(str(files[0]), engines), {int(r): int(p) for r, p in kept["pids"].items()})
    try:
        cut = interrupt_running(orphan)
        making = Making(suspended_root(workdir.parent), draft.id, sorted(engines))
        timings = Timings()
        try:
            saves = on_each_rank(orphan, _save_on_rank(), {r: (str(d),) for r, d in making.rank_dirs.items()},
                                 "saving its state", timeout)
        except BaseException:
            making.abandon()
            raise
        timings.mark("save")
        why = "its kernel died" + (" while a cell ran, which was interrupted" if cut else "")
        manifest = replace(draft, saves=[saves[r] for r in sorted(saves)], suspended=time.time(),
                           seconds=timings.total, bytes=tree_size(making.path), why=why)
        return making.finish(manifest)
    finally:
        orphan.channel.close()


def _save_on_rank() -> Callable[..., Any]:
    from ...engine import suspend_here

    return suspend_here.save


def main(argv: list[str]) -> int:
    """``python -m hvd_notebook.cluster.launching.suspension CLUSTER_DIR``: the reaper's suspend of a ``--keep``
    cluster whose kernel died; 0 where it was suspended.

    Args:
        argv: ``CLUSTER_DIR``.
    """
    if len(argv) != 2:
        print("usage: python -m hvd_notebook.cluster.launching.suspension CLUSTER_DIR", file=sys.stderr)
        return 2
    try:
        print(f"suspended {suspend_orphan(Path(argv[1])).id}")
    except Exception as exc:  # (the reaper stops it then, as it would without --keep)
        print(f"not suspended: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
