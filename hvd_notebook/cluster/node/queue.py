"""The node's queue for GPUs: a start that needs more GPUs than are free waits its turn instead of failing.

A waiting start puts an entry, ``wait-UID-PID-TOKEN.json``, in the sticky ``queue/`` of the node's lease folder
(``nodedir.sticky_dir``; ``setup-node`` makes it) and removes it when it is served, interrupted or fails; the
entry says which process waits (its pid and start time) and how many GPUs it wants, nothing else is taken from
it. The rule (``ranked`` and ``Turns.head``):

- first come, first served, by the time the entry was made: its file's ``st_ctime``, which the kernel sets and
  no user can set back (``utime`` changes the other two times);
- except that a user who holds GPUs now (read from the lease locks, ``leases.held_pids``, never from an
  entry) queues behind every user who holds none;
- strict at the head: the first entry is served when enough GPUs are free, and nobody behind it before it, so a
  stream of small requests cannot starve a big one;
- a served entry whose process does not take its GPUs within ``TURN_S`` loses its place, in the view of every
  other waiter (each one watches the head), and so do its user's other entries made until then (a flood of
  entries that never take their turn costs the others one ``TURN_S``); their next start queues at the back.

An entry counts only where it is a regular file (opened with ``O_NOFOLLOW | O_NONBLOCK``: a link is not
followed, a FIFO does not hang the reader) of at most ``MAX_ENTRY_BYTES``, owned by the uid its name claims,
whose process is alive (``liveness.alive``), runs as that uid and started when the entry says: entries of
dead processes are ignored. At most ``MAX_PER_UID`` entries of a uid count (its oldest), and a reading looks
at no more than ``MAX_EXAMINED`` names, a few of each uid in turn: a flood of entries jams nobody.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from ... import private
from ...liveness import alive
from . import leases, nodedir
from .nodedir import LeaseError

log = logging.getLogger(__name__)

ENTRY_PREFIX = "wait-"
MAX_ENTRY_BYTES = 4096  # an entry is a few dozen bytes
MAX_PER_UID = 4  # entries of one user that count: a user waits in a few notebooks at most
MAX_EXAMINED = 4096  # names looked at (an lstat each) per reading
MAX_OPENED_PER_UID = 16  # entries of one uid opened and checked per reading (its dead ones are skipped)
POLL_S = 1.0  # a waiter looks at the queue this often
TURN_S = 15.0  # a served waiter takes its GPUs within this, or loses its place (an honest one: within a poll)
_ENTRY_NAME = re.compile(r"wait-(\d{1,10})-(\d{1,10})-([0-9a-f]{16})\.json")


@dataclass(frozen=True)
class Entry:
    """One start waiting in the queue, as the node's files say (the owner from the file, the time from its
    ``st_ctime``)."""

    uid: int
    pid: int
    gpus: int  # GPUs wanted
    since: float  # when the entry was made: the file's st_ctime
    path: str

    @property
    def user(self) -> str:
        return private.user_name(self.uid)

    @property
    def key(self) -> str:
        """The entry, told apart from a later one of the same name."""
        return f"{self.path}@{self.since}"


class BadEntry(ValueError):
    """A file in the queue that is not an entry to count; says why."""


def parse_entry(data: object, uid: int, since: float, path: str) -> tuple[Entry, float]:
    """The entry that JSON ``data`` of ``uid``'s file (made at ``since``) describes, with its process's start
    time; ``BadEntry`` where a field is missing, of the wrong type or out of range.

    Args:
        data: the parsed JSON.
        uid: the file's owner.
        since: the file's ``st_ctime``.
        path: the file.
    """
    if not isinstance(data, dict):
        raise BadEntry("it is not a JSON object")
    pid, started, gpus = data.get("pid"), data.get("pid_started"), data.get("gpus")
    if not _whole(pid, 1, 2**31 - 1) or not _whole(gpus, 1, 4096):
        raise BadEntry(f"its pid {str(pid)[:20]!r} or gpus {str(gpus)[:20]!r} is not a whole number in range")
    if not isinstance(started, (int, float)) or isinstance(started, bool) or not 0 <= started < 2**34:
        raise BadEntry(f"its pid_started {str(started)[:20]!r} is not a time")
    return Entry(uid=uid, pid=pid, gpus=gpus, since=since, path=path), float(started)


def _whole(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _runs(pid: int, started: float, uid: int) -> bool:
    """The process ``pid`` that started at ``started`` still runs, as ``uid`` (a reused pid is not it)."""
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - started) < 1.0 and proc.uids().real == uid and alive(proc)
    except (psutil.Error, ValueError):
        return False


# ------------------------------------------------------------------ reading
def read_entries(folder: Path | None = None) -> list[Entry]:
    """The entries that count: good files of live processes, at most ``MAX_PER_UID`` per owner (their
    oldest); none where there is no queue folder yet.

    Args:
        folder: the queue's folder; None for the node's (checked: ``nodedir.sticky_dir``).
    """
    if folder is None:
        folder = nodedir.sticky_dir(nodedir.QUEUE, create=False)
    entries: list[Entry] = []
    for uid, found in _candidates(folder).items():
        kept: list[Entry] = []
        for st, name in sorted(found, key=lambda c: c[0].st_ctime)[:MAX_OPENED_PER_UID]:
            entry = _checked(folder, name, uid, st)
            if entry is not None:
                kept.append(entry)
            if len(kept) == MAX_PER_UID:
                break
        entries += kept
    return entries


def _candidates(folder: Path) -> dict[int, list[tuple[os.stat_result, str]]]:
    """uid -> (lstat, name) of the regular files of at most ``MAX_ENTRY_BYTES`` whose name claims that uid and
    whose owner it is; at most ``MAX_EXAMINED`` names looked at, each claimed uid's in turn (a flood under one
    uid hides no other's)."""
    by_claim: dict[int, list[str]] = {}
    try:
        with os.scandir(folder) as listing:
            for item in listing:
                match = _ENTRY_NAME.fullmatch(item.name)
                if match:
                    by_claim.setdefault(int(match.group(1)), []).append(item.name)
    except FileNotFoundError:
        return {}
    found: dict[int, list[tuple[os.stat_result, str]]] = {}
    queues = [sorted(names) for _, names in sorted(by_claim.items())]
    examined = 0
    while examined < MAX_EXAMINED and any(queues):
        for claimed, names in zip(sorted(by_claim), queues):
            if names and examined < MAX_EXAMINED:
                examined += 1
                _add_candidate(folder, names.pop(0), claimed, found)
    return found


def _add_candidate(folder: Path, name: str, claimed: int, found: dict) -> None:
    try:
        st = os.lstat(folder / name)
    except OSError:
        return
    if stat.S_ISREG(st.st_mode) and st.st_uid == claimed and st.st_size <= MAX_ENTRY_BYTES:
        found.setdefault(claimed, []).append((st, name))


def _checked(folder: Path, name: str, uid: int, st: os.stat_result) -> Entry | None:
    """The entry in ``name`` (listed as ``st``), where it still is that file, parses, and its process runs."""
    path = folder / name
    try:
        fd = private.open_regular(path, uid=uid, max_bytes=MAX_ENTRY_BYTES)
        with os.fdopen(fd, "rb") as f:
            now = os.fstat(f.fileno())
            if (now.st_ino, now.st_dev) != (st.st_ino, st.st_dev):
                return None  # (replaced since it was listed)
            entry, started = parse_entry(json.loads(f.read(MAX_ENTRY_BYTES)), uid, now.st_ctime, str(path))
    except (OSError, ValueError, RecursionError) as exc:  # (a bad file: nobody's turn, no one is told)
        log.debug("hvd_notebook: %s is not a queue entry: %s", path, exc)
        return None
    pid_match = _ENTRY_NAME.fullmatch(name)
    if pid_match is None or int(pid_match.group(2)) != entry.pid or not _runs(entry.pid, started, uid):
        return None
    return entry


# ------------------------------------------------------------------ the rule
def ranked(entries: list[Entry], holding: set[int]) -> list[Entry]:
    """``entries`` in the order they are served: first come, first served, except that the users of
    ``holding`` (who hold GPUs now) come after every user who holds none.

    Args:
        entries: the entries that count.
        holding: the uids whose processes hold a GPU's lease now.
    """
    return sorted(entries, key=lambda e: (e.uid in holding, e.since, e.uid, e.pid, e.path))


@dataclass
class Turns:
    """When each entry's turn came (first in line, with enough GPUs free), in this process's view: one that did
    not take its GPUs within ``TURN_S`` has lost its place, with every entry its user made until then
    (``lost_until``), and is passed over from then on."""

    came: dict[str, float] = field(default_factory=dict)
    lost_until: dict[int, float] = field(default_factory=dict)  # uid -> its entries made until then lost their place

    def lost(self, entry: Entry) -> bool:
        """Has ``entry`` lost its place?

        Args:
            entry: an entry.
        """
        return entry.since <= self.lost_until.get(entry.uid, float("-inf"))

    def head(self, line: list[Entry], free: int, total: int, now: float, me: str | None = None) -> Entry | None:
        """The first entry of ``line`` (``ranked``) still in it: served now where ``free`` GPUs are enough for
        it. Strict: no entry behind it is served before it. One that wants more than the ``total`` GPUs is
        passed over (it can never be served); this process's own (``me``) never loses its place here.

        Args:
            line: the entries, ranked.
            free: the GPUs free now.
            total: the GPUs there are.
            now: the time, as ``time.time()``.
            me: this process's entry's key.
        """
        for entry in line:
            if (entry.key != me and self.lost(entry)) or entry.gpus > total:
                continue
            if free < entry.gpus:
                self.came.pop(entry.key, None)
                return entry
            came = self.came.setdefault(entry.key, now)
            if entry.key != me and now - came > TURN_S:
                self.lost_until[entry.uid] = max(now, entry.since)
                log.info("hvd_notebook: %s's queue entry %s lost its place: its GPUs were free for %.0f s",
                         entry.user, entry.path, now - came)
                continue
            return entry
        return None


_TURNS = Turns()  # this process's view of whose turn came when


# ------------------------------------------------------------------ the node now
@dataclass
class View:
    """The queue and the GPUs as one look at the node saw them."""

    line: list[Entry]  # ranked
    gpus: list[str]  # the GPUs asked about
    held: dict[str, int]  # GPU -> the holder's pid (any GPU of the node)
    holding: set[int]  # uids holding a GPU

    @property
    def free(self) -> list[str]:
        return [g for g in self.gpus if g not in self.held]


def look(gpus: list[str] | None = None, folder: Path | None = None) -> View:
    """The queue and the leases now, for ``gpus`` (None: every GPU with a lock file).

    Args:
        gpus: the GPUs a waiter may take.
        folder: the queue's folder; None for the node's.
    """
    files, held = leases.held_pids()
    holding = set()
    for pid in set(held.values()):
        try:
            holding.add(psutil.Process(pid).uids().real)
        except (psutil.Error, ValueError):
            continue
    entries = read_entries(folder)
    return View(line=ranked(entries, holding), gpus=list(files if gpus is None else gpus), held=held,
                holding=holding)


def someone_waits() -> bool:
    """Does another process's start wait in the node's queue for GPUs (and has not lost its place)? The idle
    watcher of a cluster asks, to give its GPUs back early (the node's ``preempt_idle_after``)."""
    try:
        view = look()
    except (OSError, LeaseError):
        return False
    head = _TURNS.head(view.line, len(view.free), len(view.gpus), time.time())  # (updates who lost their place)
    return head is not None and any(e.pid != os.getpid() and not _TURNS.lost(e) for e in view.line)


# ------------------------------------------------------------------ an entry of this process
def enqueue(gpus: int, folder: Path | None = None) -> Path:
    """This process's entry, wanting ``gpus``, made now; this user's entries of dead processes are removed
    first. ``LeaseError`` where the user has ``MAX_PER_UID`` starts waiting already.

    Args:
        gpus: the GPUs wanted.
        folder: the queue's folder; None for the node's (made where this user owns the lease folder).
    """
    folder = folder or nodedir.sticky_dir(nodedir.QUEUE, create=True)
    mine = _clear_dead(folder)
    if len(mine) >= MAX_PER_UID:
        raise LeaseError(f"You have {len(mine)} starts waiting for GPUs already (kernels "
                         f"{', '.join(str(e.pid) for e in mine)}), the most one user may: stop one (interrupt its "
                         "cell), or start with --no-wait.")
    me = psutil.Process()
    path = folder / f"{ENTRY_PREFIX}{os.geteuid()}-{me.pid}-{os.urandom(8).hex()}.json"
    private.write_text(path, json.dumps({"pid": me.pid, "pid_started": me.create_time(), "gpus": gpus}), 0o644)
    return path


def _clear_dead(folder: Path) -> list[Entry]:
    """This user's entries that count (their process runs); the others of theirs removed."""
    uid = os.geteuid()
    mine = []
    for _, name in _candidates(folder).get(uid, []):
        found = _checked(folder, name, uid, os.lstat(folder / name))
        if found is None:
            leave(folder / name)
        else:
            mine.append(found)
    return mine


def leave(path: Path) -> None:
    """Remove this user's entry ``path`` (gone already is fine).

    Args:
        path: the entry's file.
    """
    try:
        path.unlink()
    except OSError:
        pass


# ------------------------------------------------------------------ waiting
class Shown:
    """Where a waiting start shows its place: text lines on stderr, one each time the text changes. The kernel
    puts a line that updates in the cell in its place (``set_display``)."""

    def update(self, text: str) -> None:
        """Show ``text`` now.

        Args:
            text: the place, who holds the GPUs and since when.
        """
        if text != getattr(self, "_last", None):
            self._last = text
            print(text, file=sys.stderr, flush=True)

    def close(self, text: str) -> None:
        """The wait ended: ``text`` says how.

        Args:
            text: served, or left the queue.
        """
        print(text, file=sys.stderr, flush=True)


_display: Callable[[], Shown] = Shown


def set_display(factory: Callable[[], Shown]) -> None:
    """How waits are shown from now on in this process (the kernel's line in the cell).

    Args:
        factory: makes one ``Shown`` per wait.
    """
    global _display
    _display = factory


def acquire(gpus: list[str], n: int | None, owner: str, at_most: int | None = None, wait: bool = True) -> leases.Lease:
    """``leases.acquire`` in the node's queue: at once where nobody waits before this start and enough of
    ``gpus`` are free; else, with ``wait``, in the queue until its turn (showing its place, ``set_display``),
    and without, ``LeaseError`` saying who holds them. A KeyboardInterrupt leaves the queue at once.

    Args:
        gpus: the GPUs to lease from.
        n: how many, or None for every free one (waiting for one at least).
        owner: names the lease in this process.
        at_most: a cap where ``n`` is None.
        wait: wait in the queue where the GPUs are taken.
    """
    wanted = n or 1
    if wanted > len(gpus):  # (never served: today's error)
        return leases.acquire(gpus, n, owner, at_most)
    view = look(gpus)
    me = Entry(uid=os.geteuid(), pid=os.getpid(), gpus=wanted, since=time.time(), path="")
    first = _TURNS.head(ranked([*view.line, me], view.holding), len(view.free), len(gpus), time.time(), me.key)
    _TURNS.came.pop(me.key, None)
    if first is me and (len(view.free) >= wanted or not wait):  # (taken, --no-wait: today's error)
        try:
            return leases.acquire(gpus, n, owner, at_most)
        except LeaseError:
            if not wait:
                raise
    elif not wait:
        ahead = ranked([*view.line, me], view.holding).index(me)
        raise LeaseError(f"{ahead} start(s) wait in the node's queue for GPUs before this one "
                         f"({_ahead_text(view.line[:ahead])}), and --no-wait asked not to wait: start without it "
                         "to wait in the queue.")
    return _wait(gpus, n, owner, at_most, wanted)


def _wait(gpus: list[str], n: int | None, owner: str, at_most: int | None, wanted: int) -> leases.Lease:
    path = enqueue(wanted)
    shown = _display()
    outcome = "left the node's queue for GPUs."
    try:
        while True:
            view = look(gpus)
            mine = next((e for e in view.line if e.path == str(path)), None)
            if mine is None:  # (removed by root, or it no longer counts): queue again, at the back
                leave(path)
                path = enqueue(wanted)
                time.sleep(POLL_S)
                continue
            head = _TURNS.head(view.line, len(view.free), len(gpus), time.time(), me=mine.key)
            if head is mine and len(view.free) >= wanted:
                try:
                    lease = leases.acquire(gpus, n, owner, _spare(view, mine, at_most) if n is None else at_most)
                except LeaseError:
                    pass  # (taken meanwhile by a start outside the queue)
                else:
                    outcome = f"Served by the node's queue for GPUs: GPU(s) {','.join(lease.gpus)}."
                    return lease
            shown.update(place_text(view, mine, wanted))
            time.sleep(POLL_S)
    finally:
        leave(path)
        shown.close(outcome)


def _spare(view: View, mine: Entry, at_most: int | None) -> int:
    """How many GPUs a served start that asked for one per free GPU (``-n`` omitted) takes: the free ones less
    those the starts behind it want, one at least, ``at_most`` at most."""
    behind = sum(e.gpus for e in view.line[view.line.index(mine) + 1:] if not _TURNS.lost(e))
    spare = max(1, len(view.free) - behind)
    return spare if at_most is None else min(spare, at_most)


def _ahead_text(entries: list[Entry]) -> str:
    return "; ".join(f"{e.user} wants {e.gpus} since {time.strftime('%H:%M:%S', time.localtime(e.since))}"
                     for e in entries[:8]) + ("; ..." if len(entries) > 8 else "")


def place_text(view: View, mine: Entry, wanted: int) -> str:
    """``Waiting for 1 GPU: place 2 of 3 in the node's queue (before you: ...). Held: ...``.

    Args:
        view: the queue and the leases now.
        mine: this start's entry.
        wanted: the GPUs it wants.
    """
    place = view.line.index(mine) + 1
    ahead = f" (before you: {_ahead_text(view.line[:place - 1])})" if place > 1 else ""
    described = leases.holders()
    held = "; ".join(f"GPU {g} by {described[g][1]}" for g in view.gpus if g in described) or "none"
    behind = " (you hold GPUs, so you queue behind those who hold none)" if mine.uid in view.holding else ""
    return (f"Waiting for {wanted} GPU(s): place {place} of {len(view.line)} in the node's queue{ahead}{behind}. "
            f"Free: {','.join(view.free) or 'none'}. Held: {held}. Interrupt the cell to leave the queue.")
