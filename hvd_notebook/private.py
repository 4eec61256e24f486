"""Folders and files that belong to one user, on a node shared with strangers.

Every other local user is an attacker: they may create a user's folder in ``/tmp`` before the
user does, put symbolic links or FIFOs where the package writes, or plant files it would read
(a pickled commit runs code when loaded). So nothing here takes a path on trust:

- a folder is used only if it is a real directory (not a symbolic link), owned by the user,
  with no access for group or others; else ``UnsafePathError`` names the path, its owner and
  what to do;
- files are opened with ``O_NOFOLLOW | O_NONBLOCK`` (a symbolic link or a FIFO cannot redirect
  or hang a reader) and checked with ``fstat`` (a regular file, of the owner expected, of a
  sane size) before a byte of them is used;
- files are written whole through a fresh temporary name (``O_EXCL``) and a rename.

The user's base folder (``base_dir``) is ``$XDG_RUNTIME_DIR/hvd_notebook`` where the system
gives one (systemd's per-user ``/run/user/UID``, which no one else can create), else
``$TMPDIR/hvd_notebook-USER``; where that one was made by someone else, a folder in the user's
home (``~/.cache/hvd_notebook/run-HOST``) instead, with a warning, so that another user can
neither steer nor block the user's clusters.
"""

from __future__ import annotations

import logging
import os
import pwd
import socket
import stat
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

MAX_READ = 1 << 20  # bytes: more than any small file of this package holds, less than a planted sparse file
UNLIMITED = 1 << 62  # for the files that hold a model (an elastic commit)
OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a symbolic link or a FIFO can neither redirect nor hang
_warned: set[str] = set()


class UnsafePathError(PermissionError):
    """A folder or file is not safe to use: someone else owns it, others may write it, or it is not
    what it should be (a symbolic link, a FIFO)."""


def user_name(uid: int | None = None) -> str:
    """The login name of ``uid`` (this process's real uid by default), from the password database,
    not from ``$USER`` or ``$LOGNAME``.

    Args:
        uid: the uid; None for this process's real uid.
    """
    uid = os.getuid() if uid is None else uid
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid{uid}"


def _owner(st: os.stat_result) -> str:
    return f"{user_name(st.st_uid)} (uid {st.st_uid})"


def describe(st: os.stat_result) -> str:
    """What a stat says of a file, for an error: its kind, owner and mode.

    Args:
        st: the file's stat.
    """
    kind = ("a symbolic link" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode)
            else "a regular file" if stat.S_ISREG(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
            else "a socket" if stat.S_ISSOCK(st.st_mode) else "a special file")
    return f"{kind} owned by {_owner(st)}, mode {stat.S_IMODE(st.st_mode):04o}"


def check_dir(path: Path, narrow: bool = False) -> os.stat_result:
    """``path``'s stat, where it is a directory (reached without following a symbolic link at its
    end) that this process's effective uid owns and that no one else may enter; else
    ``UnsafePathError``. ``FileNotFoundError`` where it does not exist. With ``narrow``, a folder of
    this user's that others could read but never write (as earlier versions made them) is made owner-only
    first: nobody else can have put anything in it.

    Args:
        path: the directory.
        narrow: remove others' read access where that is all they have.
    """
    uid = os.geteuid()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | OPEN_FLAGS)
    except OSError as exc:
        if isinstance(exc, FileNotFoundError):
            raise
        st = os.lstat(path)
        raise UnsafePathError(f"{path} is {describe(st)}, not a directory of {user_name(uid)}'s: "
                              f"{_advice(path)}") from None
    try:
        st = os.fstat(fd)
        if narrow and st.st_uid == uid and st.st_mode & 0o077 and not st.st_mode & 0o022:
            os.fchmod(fd, 0o700)
            log.info("made %s owner-only (it was %04o)", path, stat.S_IMODE(st.st_mode))
            st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != uid or st.st_mode & 0o077:
        raise UnsafePathError(f"{path} is {describe(st)}; it must be {user_name(uid)}'s with no access for "
                              f"others: {_advice(path)}")
    return st


def is_private_dir(path: Path) -> bool:
    """Does ``check_dir`` pass ``path`` (this user's own folder, with no access for others)?

    Args:
        path: the directory.
    """
    try:
        check_dir(path)
    except OSError:
        return False
    return True


def _advice(path: Path) -> str:
    return (f"another user may have made it to read or steer your clusters, so nothing in it was used. "
            f"Ask the node's admin to remove {path}, or set TMPDIR (or XDG_RUNTIME_DIR) to a folder only you "
            "can write, and start again.")


def ensure_dir(path: Path) -> Path:
    """``path``, made owner-only where it does not exist (its parent must), and checked
    (``check_dir``, narrowing a folder of this user's that others could only read) either way.

    Args:
        path: the directory.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    check_dir(path, narrow=True)
    return path


def guards_entries(st: os.stat_result) -> bool:
    """Does the folder of stat ``st`` keep everyone but root and this user from renaming or replacing what
    is in it: it is theirs, and writable by no one else unless sticky (as /tmp)?

    Args:
        st: the folder's stat.
    """
    return st.st_uid in (0, os.geteuid()) and (not st.st_mode & 0o022 or bool(st.st_mode & stat.S_ISVTX))


def check_parent(path: Path) -> None:
    """``UnsafePathError`` unless ``path``'s parent folder ``guards_entries``.

    Args:
        path: the file or folder whose parent is checked.
    """
    try:
        safe = guards_entries(os.stat(path.parent))
    except OSError:
        safe = False
    if not safe:
        raise UnsafePathError(f"{path.parent} can be written by others (and is not sticky)")


def candidate_bases() -> list[Path]:
    """Where this user's base folder may be, in the order ``base_dir`` tries them."""
    found = []
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        found.append(Path(runtime) / "hvd_notebook")
    found.append(Path(tempfile.gettempdir()) / f"hvd_notebook-{user_name()}")
    try:
        found.append(Path.home() / ".cache" / "hvd_notebook" / f"run-{socket.gethostname()}")
    except RuntimeError:
        pass
    return found


def base_dir() -> Path:
    """This user's private folder for everything the package keeps on this host (cluster
    directories, stack files, elastic commits), made where it does not exist."""
    tried = []
    for path in candidate_bases():
        try:
            if path.name.startswith("run-"):  # (in the home: its parents are the user's own)
                path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            check_parent(path)
            ensure_dir(path)
        except UnsafePathError as exc:
            tried.append(str(exc))
            if str(path) not in _warned:
                _warned.add(str(path))
                log.warning("not using %s: %s", path, exc)
            continue
        except OSError as exc:
            tried.append(f"{path}: {exc.strerror}")
            continue
        return path
    raise UnsafePathError("no private folder could be made for hvd_notebook: " + " | ".join(tried))


def subdir(name: str, base: Path | None = None) -> Path:
    """A private folder ``name`` inside the base folder (made, or checked where it exists).

    Args:
        name: the folder's name.
        base: the base folder; None for the user's private folder.
    """
    return ensure_dir((base or base_dir()) / name)


def open_regular(path: Path, uid: int | None = None, max_bytes: int = MAX_READ, mode: int = os.O_RDONLY) -> int:
    """A descriptor of ``path`` (read-only unless ``mode`` says otherwise), where it is a regular file
    (not a symbolic link, FIFO or device: neither redirects nor hangs the reader) owned by ``uid``
    (this process's effective uid; -1: anyone) and at most ``max_bytes`` long; else
    ``UnsafePathError``.

    Args:
        path: the file.
        uid: its owner; None for this process's effective uid, -1 for anyone.
        max_bytes: the largest size taken.
        mode: ``os.open``'s flags.
    """
    uid = os.geteuid() if uid is None else uid
    try:
        fd = os.open(path, mode | OPEN_FLAGS, 0o666)  # (with O_CREAT: a new file's mode, less the umask)
    except OSError as exc:
        if exc.errno == 40:  # ELOOP: the last component is a symbolic link
            raise UnsafePathError(f"{path} is a symbolic link; it was not followed") from None
        raise
    st = os.fstat(fd)
    problem = ("is not a regular file" if not stat.S_ISREG(st.st_mode)
               else f"belongs to {_owner(st)}" if uid != -1 and st.st_uid != uid
               else f"is {st.st_size} bytes long (at most {max_bytes} expected)" if st.st_size > max_bytes
               else "")
    if problem:
        os.close(fd)
        raise UnsafePathError(f"{path} {problem} ({describe(st)}); it was not read")
    return fd


def read_bytes(path: Path, uid: int | None = None, max_bytes: int = MAX_READ) -> bytes:
    """The whole of a regular file that ``uid`` owns (``open_regular``).

    Args:
        path: the file.
        uid: its owner; None for this process's effective uid, -1 for anyone.
        max_bytes: the largest size taken.
    """
    fd = open_regular(path, uid, max_bytes)
    with os.fdopen(fd, "rb") as f:
        return f.read(max_bytes + 1)[:max_bytes]


def read_text(path: Path, uid: int | None = None, max_bytes: int = MAX_READ) -> str:
    """``read_bytes`` as text.

    Args:
        path: the file.
        uid: its owner, as ``read_bytes`` takes it.
        max_bytes: the largest size taken.
    """
    return read_bytes(path, uid, max_bytes).decode(errors="replace")


def write_bytes(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` whole: written to a fresh name beside it (``O_EXCL``: never through a link
    or into a file someone made), then renamed over it, so a reader sees the old file or the new.

    Args:
        path: the file.
        data: its new content.
        mode: its mode.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | OPEN_FLAGS, mode)
    try:
        os.fchmod(fd, mode)  # whatever the umask
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_text(path: Path, text: str, mode: int = 0o600) -> None:
    """``write_bytes`` of text.

    Args:
        path: the file.
        text: its new content.
        mode: its mode.
    """
    write_bytes(path, text.encode(), mode)


def append_text(path: Path, text: str) -> None:
    """Append ``text`` to ``path`` (made where it is missing), where it is this user's own regular file (no
    symbolic link is followed); flushed to disk, so that a crash right after loses nothing of it.

    Args:
        path: the file.
        text: what to append.
    """
    fd = open_regular(path, max_bytes=UNLIMITED, mode=os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
