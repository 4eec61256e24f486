"""The node's folder for GPU leases and the register of clusters: where it is, and the checks before any
use (``leases`` keeps the lock files in it, ``registry`` the cards in its sticky ``register/``).

The folder is ``$HVD_NOTEBOOK_LEASE_DIR``, else ``$TMPDIR/hvd_notebook-gpu-leases``. Whoever owns it decides
who gets the GPUs, so it is used only where root owns it (made at install by ``hvd-notebook setup-node``)
or, on a machine with one user, this user (made at their first lease), and where no one else may write
it; any other folder is refused (``LeaseDirError``, naming it, its owner and the admin's command).
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from ... import config
from ...private import OPEN_FLAGS, UnsafePathError, describe, guards_entries
from ..errors import ClusterError

DEFAULT_NAME = "hvd_notebook-gpu-leases"
REGISTER = "register"  # the register's sticky subfolder (registry.py)
QUEUE = "queue"  # the queue's sticky subfolder (queue.py)
SETUP = "sudo hvd-notebook setup-node"


class LeaseError(ClusterError):
    """The GPUs asked for are held by other clusters, or cannot be leased here."""


class LeaseDirError(UnsafePathError, LeaseError):
    """The node's lease folder (or its register) is not one to trust: someone else owns it, others may
    write it, or it is not a directory."""


def configured_dir() -> Path:
    """Where the node's lease folder is: ``$HVD_NOTEBOOK_LEASE_DIR``, else ``$TMPDIR/hvd_notebook-gpu-leases``."""
    return Path(config.LEASE_DIR.text() or Path(tempfile.gettempdir()) / DEFAULT_NAME)


def _refusal(path: Path, what: str) -> str:
    return (f"The node's GPU lease folder {path} is {what}; it must be root's (or, on a machine with one user, "
            "yours) and writable by no one else, since whoever owns it decides who gets the GPUs, so nothing "
            f"in it was used. The admin runs `{SETUP}`, which makes it anew (or set HVD_NOTEBOOK_LEASE_DIR "
            "to the folder the admin made).")


def check_parent(path: Path) -> None:
    """No one but root and this user can rename or replace ``path``: its parent folder ``guards_entries``.

    Args:
        path: the folder to check.
    """
    try:
        st = os.stat(path.parent)
    except FileNotFoundError:
        return  # (made by setup_node, or a FileNotFoundError for the folder itself follows)
    if not guards_entries(st):
        raise LeaseDirError(_refusal(path, f"in {path.parent}, which is {describe(st)}, so others could "
                                     "replace it"))


def open_dir(path: Path, owners: tuple[int, ...], refuse=_refusal, sticky: bool = False) -> tuple[int, os.stat_result]:
    """A descriptor of the directory ``path`` (not a link) and its stat, where one of ``owners`` owns it
    and no one else may write it (or, with ``sticky``, only with the sticky bit: no one removes another's
    files); ``LeaseDirError`` (``refuse(path, what)``) else, ``FileNotFoundError`` where it does not exist.

    Args:
        path: the directory.
        owners: the uids that may own it.
        refuse: makes the error, from a sentence.
        sticky: allow others' writes under the sticky bit.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | OPEN_FLAGS)
    except FileNotFoundError:
        raise
    except OSError:  # ELOOP (a symbolic link) or ENOTDIR
        try:
            what = describe(os.lstat(path))
        except OSError:
            what = "gone"
        raise LeaseDirError(refuse(path, what)) from None
    st = os.fstat(fd)
    if st.st_uid not in owners or st.st_mode & 0o022 and not (sticky and st.st_mode & stat.S_ISVTX):
        os.close(fd)
        raise LeaseDirError(refuse(path, describe(st)))
    return fd, st


def make_dir(path: Path, mode: int, dir_fd: int | None = None) -> None:
    """``path`` made with ``mode`` whatever the umask (made already, by whoever, is fine: it is checked next).

    Args:
        path: the directory.
        mode: its mode.
        dir_fd: a directory ``path`` is relative to, or None.
    """
    try:
        os.mkdir(path, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        return
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | OPEN_FLAGS, dir_fd=dir_fd)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)


def opened_folder(create: bool) -> tuple[Path, int, os.stat_result] | None:
    """The lease folder, a descriptor of it and its stat, checked; made (this user's, 0755) where absent and
    ``create``, else None where absent.

    Args:
        create: make it where absent.
    """
    path = configured_dir()
    check_parent(path)
    try:
        fd, st = open_dir(path, (0, os.geteuid()))
    except FileNotFoundError:
        if not create:
            return None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            make_dir(path, 0o755)  # a machine with one user: theirs (root's is setup_node's)
        except OSError as exc:
            raise LeaseDirError(f"The node's GPU lease folder {path} does not exist and cannot be made "
                                f"({exc.strerror}): the admin runs `{SETUP}`, which makes it.") from None
        fd, st = open_dir(path, (0, os.geteuid()))
    return path, fd, st


def register_dir(create: bool = True) -> Path:
    """The register's folder inside the lease folder (``sticky_dir``).

    Args:
        create: make it where absent.
    """
    return sticky_dir(REGISTER, create)


def sticky_dir(name: str, create: bool = True) -> Path:
    """The sticky folder ``name`` inside the lease folder (every user writes their own files there: the
    register's cards, the queue's entries), checked: the folder owner's, and writable by others only with the
    sticky bit. Made where absent and ``create`` by the folder's owner; others get ``LeaseDirError`` then, as
    they do for a bad one.

    Args:
        name: ``REGISTER`` or ``QUEUE``.
        create: make it where absent.
    """
    opened = opened_folder(create)
    if opened is None:
        return configured_dir() / name
    path, fd, st = opened
    folder = path / name
    try:
        if create and st.st_uid == os.geteuid():
            make_dir(name, 0o1777, dir_fd=fd)
        os.close(open_dir(folder, (st.st_uid,), _sticky_refusal, sticky=True)[0])
    except FileNotFoundError:
        if create:  # (and the lease folder is another's, who has not made it)
            raise LeaseDirError(_sticky_refusal(folder, "missing")) from None
    finally:
        os.close(fd)
    return folder


def _sticky_refusal(path: Path, what: str) -> str:
    kind = "register" if path.name == REGISTER else "queue for GPUs"
    return (f"The node's {kind} {path} is {what}; it must be a sticky folder (1777) of the lease folder's "
            f"owner, so nothing in it was used. The admin runs `{SETUP}`, which makes it.")
