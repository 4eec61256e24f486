"""GPU leases between the notebooks of one node.

Every GPU has a lock file in a directory shared by all users of the host
(``$TMPDIR/hvd_notebook-gpu-leases``, sticky like /tmp). A cluster holds an
exclusive ``flock`` on the file of each GPU it uses for as long as it runs; the
kernel process holds the lock, so the operating system releases it the moment
the cluster stops or the kernel dies, however it dies. The file's text says
who holds it, for the error the next notebook sees.
"""

from __future__ import annotations

import fcntl
import getpass
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .. import config


class LeaseError(RuntimeError):
    """The GPUs asked for are held by other clusters."""


def lease_dir() -> Path:
    """The folder of the lease files, shared by every user of the host."""
    path = Path(config.LEASE_DIR.text() or Path(tempfile.gettempdir()) / "hvd_notebook-gpu-leases")
    if not path.exists():
        path.mkdir(parents=True, exist_ok=True)
        try:
            path.chmod(0o1777)  # every user may create lock files; only their owners may remove them
        except PermissionError:
            pass
    return path


@dataclass
class Lease:
    """The GPUs a cluster holds; ``release`` (or the process's death) frees them."""

    gpus: list[str]
    fds: list[int] = field(default_factory=list)

    def drop(self, gpus: list[str]) -> None:
        """Free these of the lease's GPUs (gone from the host), keep the others."""
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


def _open(gpu: str) -> int:
    path = lease_dir() / f"gpu{gpu}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        if os.fstat(fd).st_uid == os.getuid():
            os.fchmod(fd, 0o666)  # the umask may have narrowed it: other users must be able to lock it too
    except OSError:
        pass
    return fd


def _holder(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        return os.read(fd, 512).decode(errors="replace").strip() or "another process"
    except OSError:
        return "another process"


def acquire(gpus: list[str], n: int | None, owner: str, at_most: int | None = None) -> Lease:
    """Lease ``n`` of ``gpus`` (all free ones, up to ``at_most``, when ``n`` is None), in order.

    Raises ``LeaseError`` naming who holds the busy ones when fewer than ``n``
    (or none at all) are free; nothing stays held then."""
    lease = Lease(gpus=[])
    busy: dict[str, str] = {}
    for gpu in gpus:
        if len(lease.gpus) == (n if n is not None else at_most):
            break
        fd = _open(gpu)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            busy[gpu] = _holder(fd)
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{getpass.getuser()} ({owner}, since {time.strftime('%H:%M:%S')})".encode(), 0)
        lease.fds.append(fd)
        lease.gpus.append(gpu)
    wanted = n if n is not None else max(1, len(lease.gpus))
    if len(lease.gpus) < wanted:
        lease.release()
        held = "; ".join(f"GPU {g} by {who}" for g, who in busy.items())
        free = [g for g in gpus if g not in busy]
        asked = f"-n {n}" if n is not None else "one rank per free GPU"
        advice = (f"Start fewer ranks (-n {len(free)}), or wait" if free else "Wait") + (
            " until they are released (when those clusters stop or their kernels exit), "
            "or use --gpus none to run on CPUs.")
        raise LeaseError(f"{asked} needs {wanted} GPU(s), but only {len(free)} of this host's {len(gpus)} "
                         f"({','.join(free) or 'none'}) are free. Held: {held}. {advice}")
    return lease


def holders() -> dict[str, tuple[int, str]]:
    """This host's GPUs whose lease is held now: GPU id -> (pid of the holder, the lease file's text).
    Read from the kernel's table of locks (/proc/locks), so it takes no lock itself."""
    files = {}
    for path in lease_dir().glob("gpu*.lock"):
        try:
            files[path.stat().st_ino] = path
        except OSError:
            continue
    held = {}
    try:
        lines = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return {}
    for line in lines:
        parts = line.split()  # 1: FLOCK  ADVISORY  WRITE 4242 fd:01:1234567 0 EOF
        if len(parts) < 6 or parts[1] != "FLOCK" or parts[3] != "WRITE":
            continue
        try:
            pid, inode = int(parts[4]), int(parts[5].rsplit(":", 1)[1])
        except (ValueError, IndexError):
            continue
        if inode in files:
            path = files[inode]
            text = path.read_text(errors="replace").strip() if path.exists() else ""
            held[path.name[len("gpu"):-len(".lock")]] = (pid, text)
    return held
