"""Shared memory between one host's ranks: whose it is, whether there is room, and what is left of it.

The ranks of one host exchange messages through segments MPICH (and UCX) make in ``/dev/shm``.
Three things can go wrong on a shared node, and each has its function here:

- **Another user's segment.** MPICH names a world's main segment after the launcher's pid, and
  attaches to a file of that name whoever made it (``shmguard`` explains, and refuses such a
  start before the launcher runs). ``check_world`` looks at what every process of a starting
  world has open or mapped in ``/dev/shm`` (and its SysV segments): a file of another user, or
  one of the user's own that others may open by its name, fails the start at once with the file
  and its owner, for any MPI (MPICH's hydra, Open MPI: names this package cannot predict);
  the cluster calls it while it waits for the engines (a rank waiting in ``MPI_Init`` on a
  planted empty file never comes back by itself) and once more when they are set up.
- **A full /dev/shm.** A rank whose segment does not fit dies of SIGBUS when it first touches
  it. ``check_space`` refuses a start that would not fit, and ``space_note`` is the sentence a
  SIGBUS report gets.
- **What killed ranks leave.** MPICH unlinks its segments in ``MPI_Finalize``; a cluster's ranks
  are killed, not finalised, so every stopped world would leave its segments: on a shared node
  that is memory no one gets back. ``remove_world`` removes a stopped world's own names at once;
  ``remove_orphaned`` removes this user's segments that no process maps any more and that are older
  than a starting world could be, so a world that is starting now keeps its own.
"""

from __future__ import annotations

import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import psutil

from ...liveness import pid_alive
from ...private import describe, user_name
from ..errors import ClusterError
from . import shmguard

SHM_DIR = Path(shmguard.SHM_DIR)
_SHM_PREFIX = shmguard.SHM_DIR + "/"
PREFIX = "mpich_shm_"
MIN_AGE_S = 60.0  # a segment this old was mapped long ago by the ranks that made it, if they live
# What one rank needs in /dev/shm, measured with MPICH 5.0.2 (2 ranks on a tmpfs of a given size): its part
# of MPICH's segment (~1 MiB a rank: below that the ranks die of SIGBUS), with room to spare; UCX uses
# about 4.3 MiB a rank more where it has room, and does without where it has not.
BYTES_PER_RANK = 2 << 20
SYSV_TABLE = Path("/proc/sysvipc/shm")


class ShmError(ClusterError):
    """A rank of the world has another user's shared memory (or memory others may read) open or mapped."""


# ------------------------------------------------------------------ another user's segments
def guard_command() -> list[str]:
    """What goes before MPICH's gforker on its command line: ``shmguard``, run by path on a bare
    interpreter (it becomes the launcher, keeping the pid that names the world's segments)."""
    return [sys.executable, "-I", "-S", shmguard.__file__]


def world_segments(launcher_pid: int, nodes: int = 1) -> list[Path]:
    """Where gforker ``launcher_pid``'s world's ranks make (or find) their MPICH segments (node ids below
    ``nodes``: see ``shmguard.world_segment_names``).

    Args:
        launcher_pid: the gforker launcher's PID.
        nodes: MPICH's node count.
    """
    return [SHM_DIR / name for name in shmguard.world_segment_names(launcher_pid, nodes)]


def foreign_world_segments(launcher_pid: int, nodes: int = 1) -> list[str]:
    """A sentence for each of gforker ``launcher_pid``'s segment names that exists and is not this user's
    private file.

    Args:
        launcher_pid: the gforker launcher's PID.
        nodes: MPICH's node count.
    """
    found = (shmguard.foreign(str(path), os.geteuid()) for path in world_segments(launcher_pid, nodes))
    return [why for why in found if why is not None]


def _fds_in(pid: int) -> Iterator[tuple[str, os.stat_result]]:
    """(path as the process sees it, stat of the open file) for each file in /dev/shm that ``pid`` has open."""
    fd_dir = f"/proc/{pid}/fd"
    for fd in os.listdir(fd_dir):
        try:
            target = os.readlink(f"{fd_dir}/{fd}")
            if target.startswith(_SHM_PREFIX):
                yield target, os.stat(f"{fd_dir}/{fd}")  # (the open file itself, even where unlinked or replaced)
        except OSError:  # closed meanwhile
            continue


def _maps_in(pid: int) -> Iterator[tuple[str, str, int]]:
    """(address range, path, inode) for each mapping of ``pid`` from a file in /dev/shm or of a SysV
    segment (``/SYSV<key>``; the inode is its shmid)."""
    with open(f"/proc/{pid}/maps", errors="replace") as maps:
        for line in maps:
            if _SHM_PREFIX not in line and "/SYSV" not in line:  # (most lines: a rank with TensorFlow maps ~2000)
                continue
            parts = line.split(None, 5)
            if len(parts) == 6 and parts[5].startswith((_SHM_PREFIX, "/SYSV")):
                yield parts[0], parts[5].rstrip("\n"), int(parts[4])


def _mapped_file_stat(pid: int, addresses: str, path: str, inode: int) -> os.stat_result | None:
    """The stat of the file ``pid`` maps at ``addresses`` (``path``, inode ``inode``); None where it cannot be
    read (unlinked, and ``map_files`` is root's only): the names MPICH predicts stay open and linked."""
    if path.endswith(" (deleted)"):
        try:
            return os.stat(f"/proc/{pid}/map_files/{addresses}")
        except OSError:
            return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st if st.st_ino == inode else None  # (the name now names another file: not the one mapped)


def _sysv_table() -> dict[int, dict[str, int]]:
    """The node's SysV shared-memory segments by shmid: their ``perms``, ``uid`` and ``cuid``."""
    try:
        lines = SYSV_TABLE.read_text().splitlines()
    except OSError:
        return {}
    if not lines:
        return {}
    header = lines[0].split()
    table = {}
    for line in lines[1:]:
        row = dict(zip(header, line.split()))
        try:
            table[int(row["shmid"])] = {"perms": int(row["perms"], 8), "uid": int(row["uid"]),
                                        "cuid": int(row["cuid"])}
        except (KeyError, ValueError):
            continue
    return table


def _unsafe(st: os.stat_result, uid: int) -> bool:
    """Another user's, not a regular file, or the user's own that others may open by its name."""
    return st.st_uid != uid or not stat.S_ISREG(st.st_mode) or bool(st.st_mode & 0o077 and st.st_nlink)


def foreign_mappings(pids: Iterable[int]) -> list[str]:
    """A sentence for each file in /dev/shm that one of ``pids`` has open or mapped and that is another
    user's, not a regular file, or this user's own but open to others under its name; and for each SysV
    segment one maps that another user owns or made (the user's own SysV segments cannot be made first by
    anyone; UCX's are open to the group, see ``placement.LOOPBACK_ENV``). Processes that are gone, or not
    this user's, are skipped.

    Args:
        pids: the world's processes.
    """
    uid = os.geteuid()
    found: dict[tuple[str, int], str] = {}
    sysv = None
    for pid in sorted(set(pids)):
        try:
            opened = list(_fds_in(pid))
            mapped = list(_maps_in(pid))
        except OSError:  # gone, or not ours to read
            continue
        seen = {st.st_ino for _, st in opened}
        for path, st in opened:
            if _unsafe(st, uid):
                found.setdefault((path, st.st_ino), f"process {pid} has {path} open: {describe(st)}")
        for addresses, path, inode in mapped:
            if path.startswith("/SYSV"):
                sysv = _sysv_table() if sysv is None else sysv
                seg = sysv.get(inode)
                if seg is not None and uid not in (seg["uid"], seg["cuid"]):
                    found.setdefault((path, inode), (
                        f"process {pid} maps SysV segment {inode}: owned by {user_name(seg['uid'])} (uid "
                        f"{seg['uid']}), made by uid {seg['cuid']}, mode {seg['perms'] & 0o777:04o}"))
                continue
            if inode in seen:
                continue
            st = _mapped_file_stat(pid, addresses, path, inode)
            if st is not None and _unsafe(st, uid):
                found.setdefault((path, inode), f"process {pid} maps {path}: {describe(st)}")
    return list(found.values())


def check_world(launcher_pid: int | None, pids: Iterable[int] = (), gforker: bool = False, n: int = 1) -> None:
    """``ShmError`` where a process of the world (the launcher ``launcher_pid``, its descendants, and
    ``pids``) has another user's shared memory (or memory others may read) open or mapped, or, for a
    ``gforker`` world of ``n`` ranks, where its predicted segment names are another user's. Cheap enough
    to call every fraction of a second while a world starts.

    Args:
        launcher_pid: the launcher's PID, or None.
        pids: other processes of the world.
        gforker: whether the launcher is gforker.
        n: the world's number of ranks.
    """
    tree = set(pids)
    findings = []
    if launcher_pid is not None:
        if gforker:
            findings += foreign_world_segments(launcher_pid, nodes=n)
        try:
            tree |= {launcher_pid, *(c.pid for c in psutil.Process(launcher_pid).children(recursive=True))}
        except psutil.NoSuchProcess:
            pass
    findings += foreign_mappings(tree)
    if findings:
        listed = "".join(f"\n  - {f}" for f in findings)
        raise ShmError("The MPI world was stopped: its ranks would share memory that another user made, or that "
                       f"others may read:{listed}\n{shmguard.AGAIN}")


class StartWatch(threading.Thread):
    """Looks at the shared memory of a launcher's world (``check_world``) while the launcher runs, four
    times a second for the first minute and every 2 seconds after, and calls
    ``on_foreign(message)`` once where it finds another user's: for a launch that nothing else watches
    while its ranks start (``hvd-notebook run``), where a rank on a planted segment would wait for ever.

    Args:
        launcher_pid: the launcher's PID.
        gforker: whether the launcher is gforker.
        n: the world's number of ranks.
        on_foreign: called with the message, once.
    """

    def __init__(self, launcher_pid: int, gforker: bool, n: int, on_foreign: Callable[[str], None]) -> None:
        super().__init__(daemon=True)
        self.launcher_pid, self.gforker, self.n, self._on_foreign = launcher_pid, gforker, n, on_foreign
        self._stopped = threading.Event()

    @classmethod
    def for_launch(cls, launcher_pid: int, argv: list[str], on_foreign: Callable[[str], None]) -> StartWatch:
        """The watch of the launch of ``argv`` (through ``shmguard`` or not), started.

        Args:
            launcher_pid: the launcher's PID.
            argv: its command line.
            on_foreign: called with the message, once.
        """
        guard = guard_command()
        watch = cls(launcher_pid, argv[:len(guard)] == guard, shmguard.ranks_of(argv), on_foreign)
        watch.start()
        return watch

    def remove_world(self) -> None:
        """Once the world has ended: remove its own segments (``remove_world``), where its names are known."""
        if self.gforker:
            remove_world(self.launcher_pid, self.n)

    def run(self) -> None:
        started = time.monotonic()
        # (a first look a moment after the start: ``shmguard`` has its say first, and exits where it refuses)
        while not self._stopped.wait(0.25 if time.monotonic() - started < 60.0 else 2.0):
            try:
                if not pid_alive(self.launcher_pid):
                    return
                check_world(self.launcher_pid, gforker=self.gforker, n=self.n)
            except psutil.NoSuchProcess:
                return
            except ShmError as exc:
                self._on_foreign(str(exc))
                return

    def stop(self) -> None:
        """Stop looking (and wait for a look under way to end)."""
        self._stopped.set()
        if self.is_alive() and self is not threading.current_thread():
            self.join(timeout=5)


def refused_by_guard(output: str) -> str | None:
    """What ``shmguard`` said where it refused to start the launcher (in the launcher's ``output``).

    Args:
        output: the launcher's output.
    """
    for line in output.splitlines():
        if line.startswith(shmguard.REFUSED_PREFIX):
            return line[len(shmguard.REFUSED_PREFIX):].strip()
    return None


# ------------------------------------------------------------------ room in /dev/shm
def free_bytes() -> tuple[int, int]:
    """(free bytes an unprivileged user may still use, size) of /dev/shm."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def biggest_holders() -> list[str]:
    """The (at most three) users whose files take most of /dev/shm, biggest first: "alice (1.2 GiB)"."""
    held: dict[int, int] = {}
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return []
    for entry in entries:
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        held[st.st_uid] = held.get(st.st_uid, 0) + st.st_blocks * 512
    ranked = sorted(held.items(), key=lambda item: -item[1])[:3]
    return [f"{user_name(uid)} ({_mib(size)})" for uid, size in ranked if size]


def space_note() -> str:
    """The sentence a rank killed by SIGBUS gets: a full /dev/shm is a likely cause, with its free space."""
    try:
        free, size = free_bytes()
    except OSError:
        return f"a full {SHM_DIR} is a likely cause"
    return f"a full {SHM_DIR} is a likely cause ({_mib(free)} free of {_mib(size)})"


def check_space(n: int) -> None:
    """``ClusterError`` where /dev/shm has less room than ``n`` ranks on this host need (``BYTES_PER_RANK``
    each): they would die of SIGBUS in ``MPI_Init`` or at their first message.

    Args:
        n: the ranks on this host.
    """
    try:
        free, size = free_bytes()
    except OSError:
        return  # (no /dev/shm: MPI finds its own way, or says why)
    need = n * BYTES_PER_RANK
    if n > 1 and free < need:
        holders = biggest_holders()
        held = f" Most of it is held by {', '.join(holders)}." if holders else ""
        raise ClusterError(
            f"{SHM_DIR} has {_mib(free)} free of {_mib(size)}, and {n} ranks need about {_mib(need)} there for "
            f"MPI's shared memory (with less, ranks die of SIGBUS).{held} Free some: `hvd-notebook clean` "
            "removes what your stopped clusters left, and other users' files are the node's administrator's "
            "to remove; or start fewer ranks.")


# ------------------------------------------------------------------ what killed ranks leave
def remove_world(launcher_pid: int, nodes: int = 1, uid: int | None = None) -> list[Path]:
    """Remove gforker ``launcher_pid``'s world's segments (once its ranks are gone), where they are
    ``uid``'s (this process's effective uid) own regular files; those removed.

    Args:
        launcher_pid: the gforker launcher's PID.
        nodes: MPICH's node count.
        uid: the segments' owner; None for this process's.
    """
    uid = os.geteuid() if uid is None else uid
    removed = []
    for path in world_segments(launcher_pid, nodes):
        try:
            st = os.lstat(path)
            if st.st_uid == uid and stat.S_ISREG(st.st_mode):
                path.unlink()
                removed.append(path)
        except OSError:
            continue
    return removed


def _mapped(paths: set[str]) -> set[str]:
    """Those of ``paths`` (in /dev/shm) that some process (of this user; all, for root) maps now."""
    found: set[str] = set()
    for proc in psutil.process_iter():
        try:
            found.update(path for _, path, _ in _maps_in(proc.pid) if path in paths)
        except OSError:  # gone, or another user's
            continue
    return found


def remove_orphaned(min_age: float = MIN_AGE_S, uid: int | None = None) -> list[Path]:
    """Remove this user's (or, for root, user ``uid``'s) ``mpich_shm_*`` segments in /dev/shm that no
    process maps and that are older than ``min_age`` seconds; those removed.

    Args:
        min_age: seconds a segment must be old.
        uid: the segments' owner; None for this process's.
    """
    now, uid = time.time(), os.getuid() if uid is None else uid
    candidates = {}
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        try:
            st = path.lstat()
        except OSError:
            continue
        if st.st_uid == uid and stat.S_ISREG(st.st_mode) and now - st.st_mtime >= min_age:
            candidates[str(path)] = path
    if not candidates:
        return []
    removed = []
    for name in set(candidates) - _mapped(set(candidates)):
        try:
            candidates[name].unlink()
            removed.append(candidates[name])
        except OSError:
            pass
    return sorted(removed)
