"""Where is every rank? Each registered rank's Python stack now (``hvd-notebook stacks``,
``%hvd stacks``): the asking side of ``engine.stacks``, which each rank registers at start."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from ... import private
from ...engine.breakpoints import code_line
from ...engine.stacks import SIGNAL, remove_files, stacks_dir
from .pids import same_process


def _who(folder: Path, pid: int) -> str | None:
    """"rank R of N" of a registered process of this user that still runs; None (its files removed)
    where it ended."""
    try:
        who, created = private.read_text(folder / f"{pid}.who", max_bytes=256).split("\n")
        if same_process((pid, float(created))) is not None:
            return who
    except (OSError, ValueError):
        pass
    remove_files(folder, pid)  # ended without its atexit (killed): what it left
    return None


def registered_pids() -> list[int]:
    """Every live process of this user on this host that answers with its stacks."""
    folder = stacks_dir()
    return sorted(pid for pid in (int(w.stem) for w in folder.glob("*.who") if w.stem.isdigit())
                  if _who(folder, pid) is not None)


def ranks_of(pids: list[int]) -> dict[int, int]:
    """The rank that each process of ``pids`` registered as (those that registered and still run).

    Args:
        pids: the processes.
    """
    folder, found = stacks_dir(), {}
    for pid in pids:
        who = _who(folder, pid) if (folder / f"{pid}.who").exists() else None
        match = re.match(r"rank (\d+)", who or "")
        if match:
            found[pid] = int(match.group(1))
    return found


def collect(pids: list[int], timeout: float = 2.0) -> dict[int, tuple[str, str]]:
    """Each registered process of ``pids``: (who, its stacks); "" where it did not answer in time.

    Args:
        pids: the processes.
        timeout: seconds to wait for their dumps.
    """
    folder = stacks_dir()
    asked: dict[int, Path] = {}
    whos: dict[int, str] = {}
    for pid in pids:
        path, who = folder / f"{pid}.txt", _who(folder, pid)
        if who is None:
            continue
        whos[pid] = who
        try:
            _empty(path)
            os.kill(pid, SIGNAL)
        except OSError:
            continue
        asked[pid] = path
    deadline = time.monotonic() + timeout
    sizes = {pid: -1 for pid in asked}
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = {}
        for pid, path in list(asked.items()):
            try:
                now[pid] = path.stat().st_size
            except OSError:  # it ended since it was asked (its files removed at its exit): no stacks to give
                del asked[pid]
        if all(n > 0 and n == sizes[pid] for pid, n in now.items()):  # every answer written, and done
            break
        sizes = now
    return {pid: (whos[pid], _read(path)) for pid, path in asked.items()}


def _read(path: Path) -> str:
    try:
        return private.read_text(path)
    except OSError:
        return ""


def _empty(path: Path) -> None:
    """Empty a rank's stack file in place (the rank holds it open), never through a link."""
    fd = private.open_regular(path, mode=os.O_WRONLY)
    try:
        os.ftruncate(fd, 0)
    finally:
        os.close(fd)


_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+", re.MULTILINE)
# frames that say where the user's code is: a notebook cell, a script, the runtime's collectives
_TELLING = ("<ipython-input", "/ipykernel_", "hvd_notebook/runtime/", "<string>")


def threads(dump: str) -> list[str]:
    """One faulthandler dump split into its threads' stacks.

    Args:
        dump: a faulthandler dump.
    """
    starts = [m.start() for m in _THREAD.finditer(dump)] + [len(dump)]
    return [dump[a:b].rstrip() for a, b in zip(starts, starts[1:])]


def format_stacks(collected: dict[int, tuple[str, str]], all_threads: bool = False) -> str:
    """What ``collect`` found, rank by rank. Without ``all_threads``, each rank's threads that run a
    cell, a script or a collective (the engine's own threads, which wait on sockets, left out).

    Args:
        collected: what ``collect`` returned.
        all_threads: show every thread.
    """
    def rank_of(item: tuple[int, tuple[str, str]]) -> tuple[int, int]:
        m = re.match(r"rank (\d+)", item[1][0])
        return (int(m.group(1)) if m else 1 << 30, item[0])

    blocks = []
    for pid, (who, dump) in sorted(collected.items(), key=rank_of):
        if not dump.strip():
            blocks.append(f"== {who} (pid {pid}): no answer within the time (stopped, or its Python is gone)")
            continue
        shown = threads(dump)
        if not all_threads:
            telling = [t for t in shown if any(mark in t for mark in _TELLING)]
            shown = telling or [t for t in shown if t.startswith("Current thread")] or shown[:1]
        blocks.append(f"== {who} (pid {pid}): {where(dump)}\n" + "\n\n".join(shown))
    return "\n\n".join(blocks)


_FRAME = re.compile(r'File "([^"]+)", line (\d+) in (\S+)')
_NOT_USER = ("/site-packages/", "/hvd_notebook/", "/lib/python3", "<frozen ")


def where(dump: str) -> str:
    """Where one rank is, in a line: the ``hvd`` call it waits in and the cell or script line that
    made it ("in hvd.barrier(), called from a cell, line 2"), else the innermost line of the user's
    code, else the innermost frame.

    Args:
        dump: the rank's faulthandler dump.
    """
    best = ""
    for thread in threads(dump):
        frames = _FRAME.findall(thread)  # the most recent call first
        user = next((i for i, (path, _, _) in enumerate(frames) if not any(m in path for m in _NOT_USER)), None)
        if user is None:
            best = best or (f"in {frames[0][2]} ({frames[0][0]}, line {frames[0][1]})" if frames else "")
            continue
        path, line, function = frames[user]
        caller = code_line(path, line, function)
        if user > 0 and "/hvd_notebook/runtime/" in frames[user - 1][0]:
            return f"in hvd.{frames[user - 1][2]}(), called from {caller}"
        best = f"at {caller}"
    return best or "somewhere without Python frames"
