"""Run MPICH's ``mpiexec.gforker`` only where no other user holds its world's shared-memory names.

MPICH's ranks on one host meet in ``/dev/shm/mpich_shm_<world>_<node>`` (and
``mpich_vci_<world>_<node>``), where ``<world>`` is the 32-bit FNV-1a hash of the PMI kvsname
(``%x``) and gforker's kvsname is ``kvs_<its pid>_0``: anyone can compute the names of a world
from the launcher's pid. A rank opens the name with ``O_CREAT | O_EXCL`` and, where it exists
already, attaches to it *whoever owns it* (``MPL_initshm_open``); a file another user made
first is then read and written by the ranks (mode 0666), makes ``MPI_Init`` fail with "Out of
memory" (0600), or leaves every rank waiting in ``MPI_Init`` for ever (an empty file). MPICH
offers no setting that moves or randomises the names, and the names cannot be made ours in
advance: a rank that finds the file made ``O_EXCL`` by anyone waits for a "root" that never
comes. So this wrapper, exec'd in the launcher's place, runs with the launcher's pid (exec keeps
it), refuses at once where a name of its world is another user's (naming the file and its
owner; exit code ``REFUSED_EXIT``), removes the user's own stale file of that name (left by a
killed world whose launcher had the same pid), and then becomes the launcher. A name planted in
the second between this check and ``MPI_Init`` is caught while the world starts
(``cluster.shm.check_world``).

Run by path with the standard library only (``python -I -S shmguard.py LAUNCHER ARGS...``), so
that it costs a bare interpreter's start (about 15 ms) and imports nothing of the environment.
"""

from __future__ import annotations

import os
import pwd
import stat
import sys

SHM_DIR = "/dev/shm"
REFUSED_EXIT = 97  # the launcher's exit code where a world's segment name is another user's
REFUSED_PREFIX = "hvd_notebook: no rank was started: "  # how its message starts
AGAIN = ("Start again (a new launcher gets new names); if it happens again, show this message to the node's "
         "administrator.")
_FNV_OFFSET, _FNV_PRIME = 0x811C9DC5, 0x01000193


def fnv1a_32(data: bytes) -> int:
    """The 32-bit FNV-1a hash of ``data`` (MPICH's ``HASH_FNV``, which names a world's segments).

    Args:
        data: the bytes to hash.
    """
    h = _FNV_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV_PRIME) & 0xFFFFFFFF
    return h


def gforker_kvsname(launcher_pid: int) -> str:
    """The PMI kvsname that ``mpiexec.gforker`` with pid ``launcher_pid`` gives its (first) world.

    Args:
        launcher_pid: the launcher's PID.
    """
    return f"kvs_{launcher_pid}_0"


def world_segment_names(launcher_pid: int, nodes: int = 1) -> list[str]:
    """The names in ``/dev/shm`` that the ranks of gforker ``launcher_pid``'s world open, for MPICH's node
    ids below ``nodes`` (a gforker world is on one host, node 0, unless ``MPIR_CVAR_NUM_CLIQUES`` splits it).

    >>> world_segment_names(6126)
    ['mpich_shm_f22c3768_0', 'mpich_vci_f22c3768_0']

    Args:
        launcher_pid: the launcher's PID.
        nodes: MPICH's node count.
    """
    world = fnv1a_32(gforker_kvsname(launcher_pid).encode())
    return [f"mpich_{kind}_{world:x}_{node}" for node in range(max(1, nodes)) for kind in ("shm", "vci")]


def ranks_of(argv: list[str]) -> int:
    """The number of ranks a launcher's command line asks for (``-n N`` or ``-np N``; 1 where it does not say).

    Args:
        argv: the launcher's command line.
    """
    for flag, value in zip(argv, argv[1:]):
        if flag in ("-n", "-np") and value.isdigit():
            return int(value)
    return 1


def _owner(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def foreign(path: str, uid: int) -> str | None:
    """Why ``path`` may not be a segment of ``uid``'s world (another user's, open to others, not a
    regular file), in a sentence; None where it does not exist or is ``uid``'s own private file.

    Args:
        path: a segment's path.
        uid: the world's owner.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    mode = stat.S_IMODE(st.st_mode)
    if st.st_uid == uid and stat.S_ISREG(st.st_mode) and not mode & 0o077:
        return None
    kind = "a regular file" if stat.S_ISREG(st.st_mode) else "a symbolic link" if stat.S_ISLNK(st.st_mode) \
        else "not a regular file"
    whose = "by another user" if st.st_uid != uid else "open to others"
    return (f"{path} ({kind} owned by {_owner(st.st_uid)}, mode {mode:04o}) was made {whose} before this "
            "world's ranks made it: it is the shared-memory segment they would attach to (MPICH names it after "
            "the launcher's pid, so any local user can make it first).")


def prepare(launcher_pid: int, uid: int, nodes: int = 1) -> str | None:
    """Make ``launcher_pid``'s world's segment names (``world_segment_names``) free for ``uid``'s ranks: None
    where they are (a stale file of ``uid``'s own is removed: its world's launcher had this pid and is
    gone), else the sentence that ``foreign`` says of the first one that is not.

    Args:
        launcher_pid: the launcher's PID.
        uid: the world's owner.
        nodes: MPICH's node count.
    """
    for name in world_segment_names(launcher_pid, nodes):
        path = os.path.join(SHM_DIR, name)
        why = foreign(path, uid)
        if why is not None:
            return why
        try:
            os.unlink(path)  # (our own regular file: checked just above, in a sticky folder)
        except FileNotFoundError:
            pass
    return None


def main(argv: list[str]) -> int:
    """Check this process's world names, then exec ``argv`` (the launcher and its arguments).

    Args:
        argv: the launcher and its arguments.
    """
    if not argv:
        print("usage: python -I -S shmguard.py LAUNCHER [ARGS...]", file=sys.stderr)
        return 2
    why = prepare(os.getpid(), os.geteuid(), ranks_of(argv))  # (at most a node id per rank)
    if why is not None:
        print(f"{REFUSED_PREFIX}{why} {AGAIN}", file=sys.stderr, flush=True)
        return REFUSED_EXIT
    os.execv(argv[0], argv)
    return 127  # (execv returns only by raising)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
