"""A watcher that names a rank which ends without a word.

Under a plain ``mpiexec`` a rank that ends by ``os._exit``, by a signal (the
out-of-memory killer's SIGKILL) or by a crash in native code says nothing, and
mpiexec then ends the others: MPICH's message names a PID at best, and after
``os._exit`` there is no message at all. So ``hvd.init()`` starts this small
process beside each rank, reading a pipe that only the rank holds open. When
the pipe closes without the rank's goodbye (written by ``hvd.shutdown()`` and at
any normal interpreter exit), the watcher says which rank ended, and how where
the kernel still tells. Only the first rank of a job to end on a host is named,
not those mpiexec ended after it. Each watcher that finds its rank ended notes
when it woke (the host's monotonic clock, read first thing) in the user's
private folder, waits ``SETTLE_S`` for the job's other watchers to note theirs,
and the one that woke first reports: not the first to finish its work, which a
loaded host can reorder. The report is then claimed by a file made with
``O_EXCL`` in that folder, which no other user can make first to silence the
reports, as they could bind an abstract socket's name. Ranks
started by ``%hvd start`` or ``hvd-notebook run`` need none: their launcher
reports how each rank ended.

Run as ``python -m hvd_notebook.rankwatch JOB RANK SIZE PID``, the pipe on stdin. It sits below the layers, beside
``config`` and ``private`` (all it imports): the runtime starts it, and the runtime imports no layer above it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from . import private
from .config import PREFIX

GOODBYE = b"bye\n"
SETTLE_S = 1.0  # how long a watcher whose rank ended waits for the job's other watchers to note when they woke
CLAIM_HOLD_S = 3.0  # how long the reporting watcher of a job holds its claim: long enough for mpiexec to end the rest
CLAIM_STALE_S = 60.0  # a claim or note this old was left by a watcher that was killed while it held it


class RankWatch:
    """This rank's end of the pipe to its watcher.

    Args:
        job: the job's id.
        rank: this rank.
        size: the world's size.
    """

    def __init__(self, job: str, rank: int, size: int) -> None:
        read, self.pipe = os.pipe()  # (neither end is inherited by later child processes)
        self.process = subprocess.Popen(
            [sys.executable, "-m", __name__, job, str(rank), str(size), str(os.getpid())],
            stdin=read, stdout=subprocess.DEVNULL, start_new_session=True,  # (not ended with the rank's group)
        )
        os.close(read)

    def goodbye(self) -> None:
        """The rank ends normally: the watcher exits without a word."""
        if self.pipe < 0:
            return
        try:
            os.write(self.pipe, GOODBYE)
            os.close(self.pipe)
        except OSError:
            pass
        self.pipe = -1
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def how_it_ended(pid: int) -> str:
    """", killed by signal 9 (Killed)" or ", exit code 3" where the kernel still shows the
    ended process's status (before its parent collects it), else "".

    Args:
        pid: the ended process.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        status = int(fields[-1])  # field 52, exit_code, in waitpid's encoding
    except (OSError, ValueError, IndexError):
        return ""
    if status == 0:  # (also a process that has not ended)
        return ""
    if status & 0x7F:
        number = status & 0x7F
        return f", killed by signal {number} ({signal.strsignal(number) or number})"
    return f", exit code {status >> 8}"


def message(rank: int, size: int, pid: int, ended: str) -> str:
    """What the watcher prints when its rank ended without a goodbye.

    Args:
        rank: the rank that ended.
        size: the world's size.
        pid: its process.
        ended: ``how_it_ended``'s words.
    """
    return (f"{PREFIX} rank {rank} of {size} (pid {pid} on {socket.gethostname()}) ended without a word"
            f"{ended}: os._exit, a signal (the out-of-memory killer's SIGKILL?) or a crash in native code. "
            "mpiexec now ends the other ranks.")


def folder() -> Path | None:
    """The user's private ``rankwatch`` folder, or None where none can be had."""
    try:
        return private.subdir("rankwatch")
    except OSError:
        return None


def note_woken(where: Path, job: str, rank: int, woke_ns: int) -> Path:
    """Note in ``where`` that ``rank``'s watcher found it ended at ``woke_ns`` (``time.monotonic_ns``).

    Args:
        where: the notes' folder.
        job: the job's id.
        rank: the rank.
        woke_ns: when its watcher found it ended.
    """
    path = where / f"woke-{_safe(job)}-{rank}"
    private.write_text(path, str(woke_ns))
    return path


def first_woken(where: Path, job: str) -> int | None:
    """The rank whose watcher found it ended first, by the notes of ``job`` in ``where`` (ties: the lower
    rank); None where there is none. Notes older than ``CLAIM_STALE_S`` were left by killed watchers.

    Args:
        where: the notes' folder.
        job: the job's id.
    """
    notes = []
    prefix = f"woke-{_safe(job)}-"
    for path in where.glob(prefix + "*"):
        try:
            if _stale(path):
                path.unlink(missing_ok=True)
                continue
            notes.append((int(private.read_text(path)), int(path.name[len(prefix):])))
        except (OSError, ValueError):
            continue  # (its watcher removed it meanwhile, or it is not a note)
    return min(notes)[1] if notes else None


def claim(job: str, where: Path | None = None) -> Path | None:
    """Claim the report of ``job``'s first ended rank on this host: the claim file made, or None where
    another watcher of the job holds it. The file is made with ``O_EXCL`` in the user's private
    ``rankwatch`` folder (``where``), so only this user's watchers can take it; one left by a killed
    watcher goes stale after ``CLAIM_STALE_S``. Where no private folder can be had, every watcher
    reports (a report twice rather than none).

    Args:
        job: the job's id.
        where: the claims' folder; None for the private one.
    """
    where = where or folder()
    if where is None:
        return Path(os.devnull)
    path = where / f"ended-{_safe(job)}"
    for _ in range(2):
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | private.OPEN_FLAGS, 0o600))
            return path
        except FileExistsError:
            if not _stale(path):
                return None
            path.unlink(missing_ok=True)
    return None


def _safe(job: str) -> str:
    return job.replace("/", "_")


def _stale(path: Path) -> bool:
    try:
        return time.time() - os.lstat(path).st_mtime > CLAIM_STALE_S
    except FileNotFoundError:
        return True  # (its holder just removed it)


def release(path: Path) -> None:
    """Remove a claim or a note (its holder's, after ``CLAIM_HOLD_S``).

    Args:
        path: the claim or note.
    """
    if path != Path(os.devnull):
        path.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    """The watcher: waits for its rank's pipe to close, and says so where the rank ended without a goodbye.

    Args:
        argv: ``JOB RANK SIZE PID``.
    """
    job, (rank, size, pid) = argv[0], (int(a) for a in argv[1:])
    said = b""
    while True:
        chunk = sys.stdin.buffer.read1(64)
        if not chunk:
            break
        said += chunk
    woke = time.monotonic_ns()  # (first: what the host runs next may delay this watcher behind the others)
    if said.endswith(GOODBYE):
        return 0
    ended = how_it_ended(pid)
    where, note = folder(), Path(os.devnull)
    if where is not None:
        try:
            note = note_woken(where, job, rank, woke)
        except OSError:
            pass  # (then the first to claim reports)
        else:
            time.sleep(SETTLE_S)
            if first_woken(where, job) not in (rank, None):
                release(note)
                return 0  # another rank of the job ended first here: that one is named
    held = claim(job, where)
    try:
        if held is not None:
            print(message(rank, size, pid, ended), file=sys.stderr, flush=True)
            os.close(sys.stderr.fileno())  # (mpiexec may wait for every copy of its ranks' output pipes)
            time.sleep(CLAIM_HOLD_S)  # (the note, kept meanwhile, silences the watchers that woke later)
    finally:
        release(note)
        if held is not None:
            release(held)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
