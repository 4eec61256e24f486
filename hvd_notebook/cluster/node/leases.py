"""GPU leases between the notebooks of one node.

The node's lease folder (``nodedir``: where it is, and whose it must be) holds a lock file per GPU,
``gpuN.lock``. A cluster holds an exclusive ``flock`` on the file of each GPU it uses for as long as it
runs; the kernel process holds the lock, so the operating system releases it the moment the cluster stops
or the kernel dies, however it dies. Who holds a GPU is read from the kernel's table of locks
(``/proc/locks``: the holder's pid; that process's owner, and its card in the node's register, say who and
which cluster), never from a file's text. A lock counts only on the lock file itself (its device and inode
both match); the table, which any user can grow, is read in chunks and only the lines naming a lock file's
inode are parsed (at most ``MAX_LOCK_LINES``).

Root makes the folder at install (``hvd-notebook setup-node``: ``setup_node``). The lock files are the
folder owner's, mode 0644: a lease opens them read-only (``flock`` needs no write access) with
``O_NOFOLLOW | O_NONBLOCK`` and creates none it would not own, so neither a symbolic link, a FIFO nor
``fs.protected_regular`` can redirect, hang or block a lease. Beside them, the sticky ``register/`` holds
the node's register of clusters (``registry``), and the sticky ``queue/`` the starts that wait for GPUs
(``queue``).
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ... import config
from ...private import OPEN_FLAGS, describe, user_name
from . import hubenv, registry
from .nodedir import QUEUE, REGISTER, SETUP, LeaseError, check_parent, configured_dir, make_dir, open_dir, opened_folder
from .nodedir import LeaseDirError as LeaseDirError  # (for the callers of leases)

LOCK_MAX_BYTES = 4096  # a lock file is empty; more is not one
MAX_LOCK_LINES = 1024  # lines of /proc/locks kept, those naming a lock file's inode: a few per GPU are real
LOCKS_CHUNK = 1 << 20  # /proc/locks is read this many bytes at a time, never whole
_GPU_ID = re.compile(r"[0-9A-Za-z][0-9A-Za-z_-]{0,63}")  # a file name's part: no '/', no '..'


@dataclass
class Lease:
    """The GPUs a cluster holds; ``release`` (or the process's death) frees them."""

    gpus: list[str]
    fds: list[int] = field(default_factory=list)
    owner: str = ""  # what holds it, in this process's words (others read who from /proc/locks)

    def drop(self, gpus: list[str]) -> None:
        """Free these of the lease's GPUs (gone from the host), keep the others.

        Args:
            gpus: the GPUs to free.
        """
        kept = [(g, fd) for g, fd in zip(self.gpus, self.fds) if g not in gpus]
        for gpu, fd in zip(self.gpus, self.fds):
            if gpu in gpus:
                os.close(fd)
        self.gpus, self.fds = [g for g, _ in kept], [fd for _, fd in kept]

    def release(self) -> None:
        """Free the GPUs now (the process's exit would too)."""
        for fd in self.fds:
            try:
                os.close(fd)  # closing the file drops its flock
            except OSError:
                pass
        self.fds = []


def _lock_name(gpu: str) -> str:
    if not _GPU_ID.fullmatch(gpu):
        raise LeaseError(f"{gpu!r} is not a GPU id (give ids such as 0,1 in --gpus or HVD_NOTEBOOK_GPUS).")
    return f"gpu{gpu}.lock"


def _create_lock(name: str, dir_fd: int) -> int:
    """A new lock file ``name`` of this user's (0644) in the folder ``dir_fd``, opened read-only; one made
    meanwhile by another process of theirs is opened instead."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, 0o644, dir_fd=dir_fd)
    except FileExistsError:
        return os.open(name, os.O_RDONLY | OPEN_FLAGS, dir_fd=dir_fd)
    os.fchmod(fd, 0o644)
    return fd


def _open_lock(folder: Path, dir_fd: int, owner: int, gpu: str) -> int:
    """GPU ``gpu``'s lock file, opened read-only without following a link or waiting on a FIFO: a regular
    file of the folder's owner of at most ``LOCK_MAX_BYTES``; made where absent when this user owns the
    folder. ``LeaseError`` else, saying what the admin does."""
    name = _lock_name(gpu)
    try:
        fd = os.open(name, os.O_RDONLY | OPEN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        if owner != os.geteuid():
            raise LeaseError(f"GPU {gpu} has no lock file ({folder / name}) in the node's lease folder, which is "
                             f"{user_name(owner)}'s: the admin runs `{SETUP} --gpus ...` naming every GPU "
                             "of the node.") from None
        fd = _create_lock(name, dir_fd)
    except OSError as exc:
        try:
            what = describe(os.lstat(name, dir_fd=dir_fd))
        except OSError:
            what = exc.strerror
        raise LeaseError(f"{folder / name} is not a lock file ({what}; a symbolic link is not followed): "
                         f"the admin runs `{SETUP}`, which makes it anew.") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != owner or st.st_size > LOCK_MAX_BYTES:
        os.close(fd)
        raise LeaseError(f"{folder / name} is {describe(st)}, {st.st_size} bytes, not a lock file of "
                         f"{user_name(owner)}'s: it was not used. The admin runs `{SETUP}`, which makes it anew.")
    return fd


def acquire(gpus: list[str], n: int | None, owner: str, at_most: int | None = None) -> Lease:
    """Lease ``n`` of ``gpus`` (all free ones, up to ``at_most``, when ``n`` is None), in order; ``owner``
    names the lease in this process (``Lease.owner``).

    Raises ``LeaseError`` naming who holds the busy ones when fewer than ``n`` (or none at all) are free,
    or where the lease folder or a lock file is not to be trusted; nothing stays held then.

    Args:
        gpus: the GPUs to lease from.
        n: how many, or None for every free one.
        owner: names the lease in this process.
        at_most: a cap where ``n`` is None.
    """
    folder, dir_fd, folder_st = opened_folder(create=True)
    lease = Lease(gpus=[], owner=owner)
    busy: dict[str, tuple[int, int]] = {}  # GPU -> its lock file's device and inode
    try:
        for gpu in gpus:
            if len(lease.gpus) == (n if n is not None else at_most):
                break
            fd = _open_lock(folder, dir_fd, folder_st.st_uid, gpu)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                st = os.fstat(fd)
                busy[gpu] = (st.st_dev, st.st_ino)
                os.close(fd)
                continue
            lease.fds.append(fd)
            lease.gpus.append(gpu)
    except BaseException:
        lease.release()
        raise
    finally:
        os.close(dir_fd)
    wanted = n if n is not None else max(1, len(lease.gpus))
    if len(lease.gpus) < wanted:
        lease.release()
        raise LeaseError(_busy_message(gpus, n, wanted, busy))
    return lease


def _busy_message(gpus: list[str], n: int | None, wanted: int, busy: dict[str, tuple[int, int]]) -> str:
    pids = lock_holders(set(busy.values()))
    cards = _cards()
    held = "; ".join(f"GPU {g} by {_describe_holder(pids.get(key), cards)}" for g, key in busy.items())
    free = [g for g in gpus if g not in busy]
    asked = f"-n {n}" if n is not None else "one rank per free GPU"
    advice = (f"Start fewer ranks (-n {len(free)}), or wait" if free else "Wait") + (
        " until they are released (when those clusters stop or their kernels exit), "
        "or use --gpus none to run on CPUs.")
    return (f"{asked} needs {wanted} GPU(s), but only {len(free)} of this host's {len(gpus)} "
            f"({','.join(free) or 'none'}) are free. Held: {held}. {advice}")


def lock_holders(files: set[tuple[int, int]], path: str = "/proc/locks") -> dict[tuple[int, int], int]:
    """(device, inode) -> pid, of the ``flock`` held for writing on each of ``files`` (the kernel's table of
    locks, readable by all). Only the lines that name one of ``files`` (its device and inode, as the table
    writes them) are parsed, at most ``MAX_LOCK_LINES``: the table, which any user can grow, is read a chunk
    at a time and searched, not split.

    Args:
        files: the (``st_dev``, ``st_ino``) of each file asked about (the lock files').
        path: the table (a test gives a file of its own).
    """
    if not files:
        return {}
    lines = _lines_naming(path, [b" %02x:%02x:%d " % (os.major(dev), os.minor(dev), ino) for dev, ino in sorted(files)])
    found = {}
    for line in lines:
        parts = line.split()  # 1: FLOCK  ADVISORY  WRITE 4242 fe:01:1234567 0 EOF  (waiters: "1: -> FLOCK ...")
        if len(parts) < 6 or parts[1] != b"FLOCK" or parts[3] != b"WRITE":
            continue
        try:
            major, minor, inode = parts[5].split(b":")
            found[(os.makedev(int(major, 16), int(minor, 16)), int(inode))] = int(parts[4])
        except ValueError:
            continue
    return {key: pid for key, pid in found.items() if key in files}


def _lines_naming(path: str, needles: list[bytes]) -> list[bytes]:
    """The lines of ``path`` that hold one of ``needles``, at most ``MAX_LOCK_LINES``, reading it a chunk at a
    time (a line cut by a chunk's end is carried into the next)."""
    kept: list[bytes] = []
    try:
        with open(path, "rb") as f:
            rest = b""
            while len(kept) < MAX_LOCK_LINES and (chunk := f.read(LOCKS_CHUNK)):
                text, _, rest = (rest + chunk).rpartition(b"\n")
                kept += _matching_lines(text, needles)
            kept += _matching_lines(rest, needles)
    except OSError:
        return []
    return kept[:MAX_LOCK_LINES]


def _matching_lines(text: bytes, needles: list[bytes]) -> list[bytes]:
    """The whole lines of ``text`` around each place a needle is found (a search in C, not a split)."""
    found = []
    for needle in needles:
        at = text.find(needle)
        while at != -1 and len(found) < MAX_LOCK_LINES:
            start, end = text.rfind(b"\n", 0, at) + 1, text.find(b"\n", at)
            end = len(text) if end == -1 else end
            found.append(text[start:end])
            at = text.find(needle, end)
    return found


def _cards(cards: list | None = None) -> list:
    """The register's cards (the holders' clusters): ``cards`` where the caller read them already, else read
    now; none where the register cannot be read."""
    if cards is not None:
        return cards
    try:
        return registry.read_all()
    except (OSError, LeaseError):
        return []


def _describe_holder(pid: int | None, cards: list) -> str:
    """``alice (kernel 4242, hvd-4242-1234567, since 10:02:11)`` from the holder's process and its card
    (a card of that process's owner: one cannot claim another's lease); ``alice (pid 4242)`` without one."""
    try:
        who = user_name(psutil.Process(pid).uids().real) if pid else None
    except (psutil.Error, ValueError):
        who = None
    if who is None:
        return "another process" + (f" (pid {pid})" if pid else "")
    card = next((c for c in cards if c.kernel == pid and c.user == who), None)
    if card is None:
        return f"{who} (pid {pid})"
    return f"{who} (kernel {pid}, {card.cluster}, since {time.strftime('%H:%M:%S', time.localtime(card.started))})"


def _lock_files(dir_fd: int, owner: int) -> dict[str, tuple[int, int]]:
    """GPU id -> (device, inode) of its lock file in the lease folder ``dir_fd``: regular files of ``owner``."""
    files = {}
    for name in os.listdir(dir_fd):
        match = re.fullmatch(r"gpu(.+)\.lock", name)
        try:
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False) if match else None
        except FileNotFoundError:
            continue
        if match and st and stat.S_ISREG(st.st_mode) and st.st_uid == owner:
            files[match.group(1)] = (st.st_dev, st.st_ino)
    return files


def held_pids() -> tuple[list[str], dict[str, int]]:
    """The GPUs with a lock file in the lease folder, and of those held now, GPU id -> pid of the holder (the
    kernel's table of locks: ``holders``); nothing where the lease folder does not exist."""
    opened = opened_folder(create=False)
    if opened is None:
        return [], {}
    _, dir_fd, folder_st = opened
    try:
        files = _lock_files(dir_fd, folder_st.st_uid)
    finally:
        os.close(dir_fd)
    pids = lock_holders(set(files.values()))
    return sorted(files), {gpu: pids[key] for gpu, key in files.items() if key in pids}


def holders(cards: list | None = None) -> dict[str, tuple[int, str]]:
    """This host's GPUs whose lease is held now: GPU id -> (pid of the holder, who it is). Read from the
    kernel's table of locks (/proc/locks: a lock on the lock file's own device and inode), so it takes no
    lock itself; nothing where the lease folder does not exist.

    Args:
        cards: the node's register where the caller read it already (the panel reads it once per poll).
    """
    held = held_pids()[1]
    cards = _cards(cards) if held else []
    return {gpu: (pid, _describe_holder(pid, cards)) for gpu, pid in held.items()}


# ------------------------------------------------------------------ setup-node (root, at install)
def setup_node(gpus: list[str], path: Path | None = None) -> list[str]:
    """Make the node's lease folder (``path``, else the configured one) as leases need it: this user's
    (root's, at install) and 0755, a 0644 lock file of theirs per GPU of ``gpus``, and the sticky
    ``register/`` and ``queue/``. A folder that was not so (another user's, one others may write, a link) is moved
    aside, and a lock file that was not so replaced: lines saying what was done.

    Args:
        gpus: the node's GPU ids.
        path: the lease folder; None for the configured one.
    """
    path = path or configured_dir()
    check_parent(path)
    path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    said = _own_folder(path)
    fd, _ = open_dir(path, (os.geteuid(),))
    try:
        for gpu in gpus:
            said += _own_lock(path, fd, _lock_name(gpu))
        said += _own_sticky(path, fd, QUEUE, "the queue for GPUs")
        said += _own_sticky(path, fd, REGISTER, "the register of clusters")
    finally:
        os.close(fd)
    return said


def _aside(name: str) -> str:
    return f"{name}.moved-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def _lstat(name: str | Path, dir_fd: int | None = None) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _own_folder(path: Path) -> list[str]:
    st = _lstat(path)
    said = []
    if st is not None:
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022:
            if stat.S_IMODE(st.st_mode) != 0o755:
                os.chmod(path, 0o755)  # (a directory of ours, reached without a link)
                said.append(f"{path}: mode 0755 (was {stat.S_IMODE(st.st_mode):04o})")
            return said
        aside = path.with_name(_aside(path.name))
        os.rename(path, aside)  # (a link is renamed, not followed)
        said.append(f"moved {path} aside to {aside}: it was {describe(st)}, a folder no lease may trust "
                    "(remove it when no cluster of the old folder runs)")
    make_dir(path, 0o755)
    return said + [f"made {path} ({user_name()}'s, mode 0755)"]


def _own_lock(path: Path, dir_fd: int, name: str) -> list[str]:
    st = _lstat(name, dir_fd)
    said = []
    if st is not None:
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and st.st_size <= LOCK_MAX_BYTES:
            fd = os.open(name, os.O_RDONLY | OPEN_FLAGS, dir_fd=dir_fd)  # (kept: a cluster may hold it now)
            os.fchmod(fd, 0o644)
            os.close(fd)
            return [f"{path / name}: kept"]
        os.unlink(name, dir_fd=dir_fd)
        said.append(f"removed {path / name}: it was {describe(st)}, not a lock file of {user_name()}'s")
    os.close(_create_lock(name, dir_fd))
    return said + [f"made {path / name} (mode 0644)"]


def _own_sticky(path: Path, dir_fd: int, name: str, what: str) -> list[str]:
    """The sticky subfolder ``name`` (``what``, for the lines said) of this user's, mode 1777: kept where it is
    one of theirs, else moved aside and made anew."""
    st = _lstat(name, dir_fd)
    said = []
    if st is not None:
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            os.chmod(path / name, 0o1777)
            return [f"{path / name}: kept, mode 1777"]
        os.rename(name, _aside(name), src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        said.append(f"moved {path / name} aside: it was {describe(st)}")
    make_dir(name, 0o1777, dir_fd=dir_fd)
    return said + [f"made {path / name} ({what}, mode 1777)"]


def setup_node_command(gpus: str | None) -> int:
    """``hvd-notebook setup-node [--gpus 0,1]``: as root, make the node's lease folder for ``gpus`` (else
    the GPUs found: ``HVD_NOTEBOOK_GPUS``, else nvidia-smi's), saying what was done; the exit status. First
    refuses a hub environment (this Python's) that users other than root could change (``hubenv``).

    Args:
        gpus: the GPUs' ids, comma-separated; None: the GPUs found.
    """
    from .gpus import detect_gpus

    if os.geteuid() != 0:
        print(f"hvd-notebook setup-node: only root makes the node's lease folder ({configured_dir()}), which "
              f"decides who gets the GPUs: run `{SETUP}`. On a machine with one user nothing is needed: the "
              "first %hvd start makes it, yours.", file=sys.stderr)
        return 2
    refused = hubenv.refusal(Path(sys.prefix))  # (this Python's environment is the hub's: docs/jupyterhub.md)
    if refused:
        print(f"hvd-notebook setup-node: {refused}", file=sys.stderr)
        return 1
    ids = [g.strip() for g in gpus.split(",") if g.strip()] if gpus is not None else detect_gpus()
    try:
        said = setup_node(ids)
    except (OSError, LeaseError) as exc:
        print(f"hvd-notebook setup-node: {exc}", file=sys.stderr)
        return 1
    print("\n".join(said))
    folder = configured_dir()
    print(f"The node's lease folder {folder} is ready for GPU(s) {','.join(ids) or 'none'}"
          + ("" if ids else " (none found: give them with --gpus 0,1,...)")
          + (f". Give every kernel HVD_NOTEBOOK_LEASE_DIR={folder} (install-kernel --env)."
             if config.LEASE_DIR.text() else "."))
    return 0
