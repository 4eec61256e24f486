"""Before any data moves, every rank must be in the same collective with the
same arguments; otherwise MPI would hang or corrupt memory.

Horovod negotiates each tensor through a coordinator and caches the answers.
Here each rank hashes its call's signature (cached, so a repeated call costs a
dict lookup) and the ranks compare hashes: equal hashes on every rank means
agreement. Only when they differ are the full signatures gathered, to say
which ranks differ in what. Ranks that all share one host compare through an
MPI-3 shared-memory window (``shared_memory.SharedMemoryBoard``: a store and a
few loads instead of a collective; a small allreduce's data goes along);
otherwise they take the MAX of ``[h, -h]`` in one non-blocking 16-byte
allreduce.

Waiting for the others' hashes is where a stall shows: after
``HOROVOD_STALL_CHECK_TIME_SECONDS`` the waiting rank asks every other rank,
on a separate communicator, where it is; ranks that are waiting too answer, the
rest "have not arrived", and a warning names them. After
``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` (default off) the waiting ranks raise. A rank
stopped in a debugger (``breakpoint()`` in a cell) answers "in the debugger"
(``answer_from_debugger``): the waiting rank says so instead, and does not give up.

``Negotiator.check`` is what the backends call: agreement, its timeline phase,
and the verdict (a ``MismatchError``, or fine where the others have joined).
Every call from ``acquire`` to its ``release`` (or its failure) is counted by
``collective_time``, the seconds a step spends in collectives.
"""

from __future__ import annotations

import hashlib
import os
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import numpy as np

from ... import config
from ...messages import EventKind
from . import events
from .collective_time import enter as _enter_collective
from .collective_time import leave as _leave_collective
from .coordinator import Coordinator, Work
from .exceptions import HorovodInternalError, MismatchError, RefusedError, StallError
from .matching import Entry, waits_in_join
from .shared_memory import SharedMemoryBoard
from .signatures import Signature, describe_mismatch
from .timeline import Timeline

__all__ = ["MismatchError", "Negotiator", "Signature", "StallError", "describe_mismatch"]

_QUERY, _HERE, _LEAVING, _RESETTING, _DEBUGGER = "query", "here", "leaving", "resetting", "debugger"
_STALL_TAG = 7001
_yield_cpu = getattr(os, "sched_yield", lambda: None)  # (not on every platform)
_live: weakref.WeakSet[Negotiator] = weakref.WeakSet()  # this process's negotiators not freed yet


def answer_from_debugger(where: str) -> None:
    """While this rank is stopped in a debugger (``where``: at which line): answer the other ranks' stall
    queries, on every communicator of this rank, with "in the debugger", so that a rank waiting for this one
    says so and does not give up (called between the debugger's commands)."""
    for negotiator in list(_live):
        negotiator.stall.answer_from_debugger(negotiator.seq, where)


class _Turn:
    """The context manager of ``Negotiator.turn``."""

    __slots__ = ("negotiator", "args")

    def __init__(self, negotiator: Negotiator, sig: Signature, allow_joined: bool) -> None:
        self.negotiator, self.args = negotiator, (sig, allow_joined)

    def __enter__(self) -> None:
        self.negotiator.acquire(*self.args)

    def __exit__(self, *exc: object) -> None:
        self.negotiator.release()


class Negotiator:
    """Agreement on each collective for one communicator (with its stall inspector)."""

    def __init__(self, comm: Any, timeline: Timeline) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm, self.timeline = comm, timeline
        self.stall = StallInspector(comm, MPI)
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.seq = 0
        self._hashes: dict[Signature, int] = {}
        self._buf = np.zeros(2, dtype=np.int64)
        self._abandoned: list[tuple[Any, np.ndarray]] = []
        self.broken = ""  # why collectives are refused after one was abandoned
        self.joined_before: set[int] = set()  # ranks a round saw joined while others were not (``join``)
        # (not freed at shutdown: freeing is collective and would hang beside a broken rank; MPI_Finalize frees it)
        self.board = SharedMemoryBoard.for_comm(comm, MPI)
        self.coordinator = Coordinator(self)
        _live.add(self)

    def free(self) -> None:
        _live.discard(self)
        self.stall.comm.Free()

    def hash_of(self, sig: Signature) -> int:
        """The 63-bit hash every rank computes alike for a signature (cached)."""
        h = self._hashes.get(sig)
        if h is None:
            digest = hashlib.blake2b(repr((sig.kind, sig.fields)).encode(), digest_size=8).digest()
            h = self._hashes[sig] = int.from_bytes(digest, "little", signed=True) >> 1
        return h

    # ------------------------------------------------------------ requests
    def check(self, sig: Signature) -> None:
        """Agree on ``sig`` with every rank and return (a collective with no data: a barrier)."""
        self.acquire(sig)
        self.release()

    def turn(self, sig: Signature, allow_joined: bool = False) -> _Turn:
        """``with negotiator.turn(sig):`` the block moves this call's data once every rank
        has agreed on it and its turn has come (raises ``MismatchError`` where the ranks
        disagree; ``allow_joined``: ranks that have joined take part with zeros)."""
        return _Turn(self, sig, allow_joined)

    def run(self, sig: Signature, work: Work, allow_joined: bool = False) -> None:
        """Agree on ``sig`` and run ``work`` in its turn, fused with the requests right
        after it in the agreed order that can share its call (``Coordinator.run_fused``);
        return once its data has moved, by this call or by one ahead of it."""
        if self.size == 1:
            self.seq += 1
            work.run([])
            return
        self.acquire(sig, allow_joined, work=work)
        if work.done:  # (moved by a call ahead of it: no turn to release)
            _leave_collective()
            return
        try:
            self.coordinator.run_fused(work)
        finally:
            self.release()

    def acquire(self, sig: Signature, allow_joined: bool = False, h: int | None = None,
                name: str | None = None, data: np.ndarray | None = None, work: Work | None = None,
                lone: bool = False) -> bool | None:
        """``turn`` without the context manager (for the hot path): ``release()`` after.
        ``data`` (an array that fits the board, ``board`` not None): True where it
        travelled with the agreement, to be summed with ``add_shared``, instead of being
        moved by the caller. ``lone``: None, without a turn, where other calls wait (see
        ``Coordinator.acquire``)."""
        if h is None:
            h = self.hash_of(sig)
        if self.size == 1:
            self.seq += 1
            return False
        _enter_collective()  # (left by release, or here where no turn follows)
        try:
            timeline = self.timeline
            if timeline.path is None:  # (a phase's context manager is measurable on the hot path)
                turn = self.coordinator.acquire(sig, name, h, allow_joined, data, work, lone)
            else:
                with timeline.phase(f"NEGOTIATE_{sig.kind.upper()}", sig.name if name is None else name, 0):
                    turn = self.coordinator.acquire(sig, name, h, allow_joined, data, work, lone)
        except BaseException:
            _leave_collective()
            raise
        if turn is None:  # lone, other calls waiting: the caller retries on the general path
            _leave_collective()
        return turn

    def add_shared(self, dtype: np.dtype, count: int, out: np.ndarray) -> np.ndarray:
        """After ``acquire`` returned True: every rank's data summed, in rank order, into ``out``."""
        return self.board.add(self.seq, dtype, count, out)  # type: ignore[union-attr]

    def release(self) -> None:
        if self.size > 1:
            try:
                self.coordinator.release()
            finally:
                _leave_collective()

    def refuse(self, sig: Signature, message: str) -> NoReturn:
        """Raise ``ValueError(message)`` for a call this rank cannot make, after telling
        every rank (which then raise too, naming this one) instead of leaving them waiting."""
        if self.size > 1:
            try:
                self.check(sig.refused(message))
            except RefusedError as exc:
                raise ValueError(message if exc.refused_here else str(exc)) from None
        raise ValueError(message)

    def join(self, serve: Callable[[Signature], None]) -> list[int]:
        """Wait until every rank has joined, serving the others' allreduces with zeros (``serve``); return the
        ranks that joined last: those no earlier round saw joined (the same on every rank)."""
        if self.size > 1:
            _enter_collective()
            try:
                self.coordinator.join(serve)
            finally:
                _leave_collective()
        last = [r for r in range(self.size) if r not in self.joined_before]
        self.joined_before = set()
        return last

    def saw_lists(self, lists: list[list[Entry]]) -> None:
        """Note the ranks a round that gathered every rank's requests (``lists``) found joined while others were
        not: they joined before whoever joins later (Horovod's ``join`` returns the last)."""
        joined = [r for r, entries in enumerate(lists) if waits_in_join(entries)]
        if len(joined) < self.size:
            self.joined_before.update(joined)

    def exchange(self, h: int, sig: Signature, name: str, data: np.ndarray | None = None) -> bool:
        """One agreement round: post ``h`` (with ``data`` on the board) and wait for every
        rank's; True where all are equal. ``sig`` and ``name`` say what this rank waits
        in, for the stall inspector."""
        self.seq += 1
        if self.timeline.path is not None:
            self.timeline.mark_cycle(self.seq)
        if self.broken:
            raise StallError(self.broken)
        board = self.board
        if board is not None:
            seq = self.seq
            board.post(seq, h, data)
            if not board.arrived(seq):
                try:
                    self._wait_or_break(lambda: board.arrived(seq), sig, name)
                except BaseException:
                    if data is not None:  # (a hash alone stays: a late rank completes the call, as over MPI)
                        board.retract(seq)
                    raise
            return board.same(seq, h)
        buf = self._buf
        buf[0], buf[1] = h, -h
        request = self.comm.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.MAX)
        if not request.Test():
            try:
                self._wait_or_break(request.Test, sig, name)
            except BaseException:
                # MPI cannot cancel a collective: keep the request and its buffer alive
                self._abandoned.append((request, self._buf))
                self._buf = np.zeros(2, dtype=np.int64)
                raise
        return bool(buf[0] == -buf[1])

    def _wait_or_break(self, done: Callable[[], bool], sig: Signature, name: str | None) -> None:
        """Wait until ``done()``; if the wait ends otherwise, refuse every later collective."""
        try:
            self.stall.wait(done, sig, name, self.seq)
        except BaseException as exc:  # KeyboardInterrupt from a cell's interrupt, or StallError
            # the other ranks would pair this rank's next collectives with the wrong calls
            sig = sig.named(name)
            self.broken = (
                f"rank {self.rank} left {sig.describe()} (collective #{self.seq}) before every rank "
                f"arrived ({type(exc).__name__}), so the ranks can no longer agree on collectives. "
                "Restart the ranks (%hvd restart in a notebook); their variables are lost."
            )
            raise


class StallInspector:
    """Where the ranks are when one waits too long: queries on a communicator of its own,
    a warning naming the ranks that have not arrived, and the shutdown time."""

    def __init__(self, comm: Any, MPI: Any) -> None:
        self.MPI = MPI
        self.comm = comm.Dup()
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.check_s = float(config.STALL_CHECK_TIME.number())
        self.shutdown_s = float(config.STALL_SHUTDOWN_TIME.number())
        self.enabled = not config.STALL_CHECK_DISABLE.flag()
        self._queries = 0  # this rank's stall queries so far: answers name the one they answer
        self._held: list[tuple[int, tuple]] = []  # notes that came while this rank was in a debugger

    def report_unmatched(self, lists: list[list[Entry]], waited: float) -> bool:
        """Past the stall check time with no name matched: say which ranks lack which names;
        True where it said so (the coordinator says it once per change)."""
        if not self.enabled or waited < self.check_s:
            return False
        if self.rank != min(r for r, entries in enumerate(lists) if entries):
            return True
        keys = {e.key: e.signature for entries in lists for e in entries}
        missing, absent = [], set()
        for key, sig in keys.items():
            lacking = [r for r, entries in enumerate(lists) if key not in {e.key for e in entries}]
            missing.append(f"{sig.describe()} missing on rank(s) {lacking}")
            absent.update(lacking)
        events.emit(EventKind.STALL, f"stall: for {waited:.0f} s no collective has been issued under the same "
                    f"name on every rank: {'; '.join(missing)}. Collectives are matched by name: check that "
                    "every rank issues each of them (named alike).", missing=sorted(absent))
        if self.shutdown_s > 0 and waited >= self.shutdown_s:
            raise StallError(f"rank {self.rank}: no collective matched for {waited:.0f} s, past "
                             f"HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={self.shutdown_s:g}.")
        return True

    def wait(self, done: Callable[[], bool], sig: Signature, name: str | None, seq: int) -> None:
        """Wait until ``done()``, in collective number ``seq`` (``sig`` labelled ``name``): answer the
        others' queries, warn of a stall, raise past the shutdown time."""
        start = counted = time.monotonic()  # (counted: since when the wait counts towards the shutdown time)
        spin_until = start + 2e-3  # spin first: a sleep wakes far later than a partner usually arrives
        pause = 10e-6
        warned = False
        next_probe = start + 1.0
        while not done():
            now = time.monotonic()
            if now < spin_until:
                # give the CPU up while spinning, as MPI's own progress loop does: a partner that shares this
                # CPU (ranks of an oversubscribed host) runs now, not after this rank's time slice
                _yield_cpu()
                continue
            time.sleep(pause)
            pause = min(pause * 2, 5e-4)
            if now >= next_probe:
                next_probe = now + 0.05
                sig = sig.named(name)  # (labelled only here: a wait that ends sooner never needs it)
                name = None
                self._answer_queries(sig, seq)
                if self.enabled and not warned and now - start >= self.check_s:
                    warned = True
                    self._report_stall(done, sig, seq, now - start)
                if self.shutdown_s > 0 and now - counted >= self.shutdown_s:
                    if done() or self._ask(done, sig, seq)[1]:
                        counted = time.monotonic()  # a rank in the debugger: its time there does not count
                        continue
                    raise StallError(
                        f"rank {self.rank} waited {now - start:.0f} s in {sig.describe()} (collective "
                        f"#{seq}) past HOROVOD_STALL_SHUTDOWN_TIME_SECONDS={self.shutdown_s:g}; "
                        "the runtime cannot continue: restart the ranks (%hvd restart)."
                    )

    def leave(self, seq: int, world_rank: int, resetting: bool = False) -> None:
        """Tell every other rank that this one is done (its program ended, or ``hvd.shutdown()``)
        after ``seq`` collectives, so that a rank waiting for it fails, naming it, instead of waiting;
        ``resetting``: it left for an ``hvd.elastic`` reset, which the waiting rank then joins."""
        kind = _RESETTING if resetting else _LEAVING
        notes = [self.comm.isend((kind, seq, f"rank {world_rank}", 0), dest=r, tag=_STALL_TAG)
                 for r in range(self.size) if r != self.rank]
        deadline = time.monotonic() + 1.0  # (a note this small leaves at once; never hold up the exit)
        while notes and not self.MPI.Request.Testall(notes) and time.monotonic() < deadline:
            time.sleep(1e-3)

    def answer_from_debugger(self, seq: int, where: str) -> None:
        """This rank is in a debugger after ``seq`` collectives: answer each query with ``where``; notes of
        ranks that left are kept for the next wait in a collective, which acts on them."""
        status = self.MPI.Status()
        while self.comm.iprobe(source=self.MPI.ANY_SOURCE, tag=_STALL_TAG, status=status):
            source = status.Get_source()
            note = self.comm.recv(source=source, tag=_STALL_TAG)
            if note[0] == _QUERY and note[1] >= seq:
                self.comm.isend((_DEBUGGER, seq, where, note[3]), dest=source, tag=_STALL_TAG)
            elif note[0] in (_LEAVING, _RESETTING):
                self._held.append((source, note))

    def _notes(self) -> Iterator[tuple[int, tuple]]:
        """The notes of the other ranks: those kept while in a debugger, then those that wait now."""
        while self._held:
            yield self._held.pop(0)
        status = self.MPI.Status()
        while self.comm.iprobe(source=self.MPI.ANY_SOURCE, tag=_STALL_TAG, status=status):
            source = status.Get_source()
            yield source, self.comm.recv(source=source, tag=_STALL_TAG)

    def _answer_queries(self, sig: Signature, seq: int, collected: dict[int, tuple] | None = None) -> None:
        for source, note in self._notes():
            # (kind, their collective number, what they wait in or who they are, the query answered)
            kind, theirs, where, query = note
            if (kind in (_HERE, _DEBUGGER) and query != self._queries) or (kind in (_QUERY, _HERE) and theirs < seq):
                # an answer to an earlier query, or a query or answer from a collective every rank has
                # left since (the ranks go through collective numbers together): says nothing of now
                continue
            if kind == _QUERY:
                self.comm.isend((_HERE, seq, sig.describe(), query), dest=source, tag=_STALL_TAG)
            elif kind == _LEAVING:
                raise StallError(
                    f"{where} has shut down (its program ended, or it called hvd.shutdown()) after "
                    f"{theirs} collective(s), while this rank waits for it in {sig.describe()} (collective "
                    f"#{seq}): {where} never issued this collective. Every rank must issue the same "
                    "collectives before it ends.")
            elif kind == _RESETTING:
                raise HorovodInternalError(
                    f"{where} left {sig.describe()} (collective #{seq}) to reset the world (hvd.elastic): "
                    "this rank restores the last commit and joins the new world.")
            if collected is not None:
                collected[source] = (theirs, where, kind == _DEBUGGER)

    def _ask(self, done: Callable[[], bool], sig: Signature, seq: int) -> tuple[list[int], dict[int, str], str]:
        """Ask every other rank where it is (up to a second): the ranks that have not arrived, those of them
        in a debugger (rank -> at which line), and where the others are, as a clause ("" where all are here)."""
        self._queries += 1
        for r in range(self.size):
            if r != self.rank:
                self.comm.isend((_QUERY, seq, sig.describe(), self._queries), dest=r, tag=_STALL_TAG)
        collected: dict[int, tuple] = {}
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and len(collected) < self.size - 1 and not done():
            self._answer_queries(sig, seq, collected)
            time.sleep(0.01)
        debugged = {r: where for r, (_, where, in_debugger) in sorted(collected.items()) if in_debugger}
        missing = [r for r in range(self.size)
                   if r != self.rank and r not in debugged and collected.get(r, (None,))[0] != seq]
        elsewhere = [f"rank {r} waits in collective #{theirs} {where}"
                     for r, (theirs, where, debugging) in sorted(collected.items()) if theirs != seq and not debugging]
        return missing, debugged, "; ".join(elsewhere)

    def _report_stall(self, done: Callable[[], bool], sig: Signature, seq: int, waited: float) -> None:
        missing, debugged, elsewhere = self._ask(done, sig, seq)
        if done():
            return
        parts = [f"rank {r} is in the debugger ({where})" for r, where in debugged.items()]
        if missing or not debugged:
            parts.append(f"rank(s) {missing} have not arrived" + (f" ({elsewhere})" if elsewhere else ""))
        events.emit(
            EventKind.STALL,
            f"stall: rank {self.rank} has waited {waited:.0f} s in {sig.describe()} (collective #{seq}); "
            + "; ".join(parts) + (". One or more ranks skipped this collective or are still busy; check that every "
                                  "rank calls the same collectives in the same order." if missing or not debugged
                                  else ": this rank goes on when the debugger continues."),
            missing=missing, debugging=sorted(debugged),
        )
