"""A watcher that names a rank which ends without a word.

Under a plain ``mpiexec`` a rank that ends by ``os._exit``, by a signal (the
out-of-memory killer's SIGKILL) or by a crash in native code says nothing, and
mpiexec then ends the others: MPICH's message names a PID at best, and after
``os._exit`` there is no message at all. So ``hvd.init()`` starts this small
process beside each rank, reading a pipe that only the rank holds open. When
the pipe closes without the rank's goodbye (written by ``hvd.shutdown()`` and at
any normal interpreter exit), the watcher says which rank ended, and how where
the kernel still tells. Only the first rank of a job to end on a host is named:
the others were ended by mpiexec (their watchers find the claim taken: a file
made with ``O_EXCL`` in the user's private folder, which no other user can make
first to silence the reports, as they could bind an abstract socket's name). Ranks
started by ``%hvd start`` or ``hvd-notebook run`` need none: their launcher
reports how each rank ended.

Run as ``python -m hvd_notebook.cluster.rankwatch JOB RANK SIZE PID``, the pipe on stdin.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from .. import private

GOODBYE = b"bye\n"
CLAIM_HOLD_S = 3.0  # how long the first watcher of a job holds its claim: long enough for mpiexec to end the rest
CLAIM_STALE_S = 60.0  # a claim this old was left by a watcher that was killed while it held it


class RankWatch:
    """This rank's end of the pipe to its watcher."""

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
    ended process's status (before its parent collects it), else ""."""
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
    """What the watcher prints when its rank ended without a goodbye."""
    return (f"[hvd_notebook] rank {rank} of {size} (pid {pid} on {socket.gethostname()}) ended without a word"
            f"{ended}: os._exit, a signal (the out-of-memory killer's SIGKILL?) or a crash in native code. "
            "mpiexec now ends the other ranks.")


def claim(job: str, folder: Path | None = None) -> Path | None:
    """Claim the report of ``job``'s first ended rank on this host: the claim file made, or None where
    another watcher of the job holds it. The file is made with ``O_EXCL`` in the user's private
    ``rankwatch`` folder (``folder``), so only this user's watchers can take it; one left by a killed
    watcher goes stale after ``CLAIM_STALE_S``. Where no private folder can be had, every watcher
    reports (a report twice rather than none)."""
    try:
        path = (folder or private.subdir("rankwatch")) / f"ended-{job.replace('/', '_')}"
    except OSError:
        return Path(os.devnull)
    for _ in range(2):
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | private.OPEN_FLAGS, 0o600))
            return path
        except FileExistsError:
            if not _stale(path):
                return None
            path.unlink(missing_ok=True)
    return None


def _stale(path: Path) -> bool:
    try:
        return time.time() - os.lstat(path).st_mtime > CLAIM_STALE_S
    except FileNotFoundError:
        return True  # (its holder just removed it)


def release(path: Path) -> None:
    """Give the claim up (its holder, after ``CLAIM_HOLD_S``)."""
    if path != Path(os.devnull):
        path.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    job, (rank, size, pid) = argv[0], (int(a) for a in argv[1:])
    said = b""
    while True:
        chunk = sys.stdin.buffer.read1(64)
        if not chunk:
            break
        said += chunk
    if said.endswith(GOODBYE):
        return 0
    ended = how_it_ended(pid)
    held = claim(job)
    if held is None:
        return 0  # another rank of the job ended first here: that one is named
    try:
        print(message(rank, size, pid, ended), file=sys.stderr, flush=True)
        os.close(sys.stderr.fileno())  # (mpiexec may wait for every copy of its ranks' output pipes)
        time.sleep(CLAIM_HOLD_S)
    finally:
        release(held)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
