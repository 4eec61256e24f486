"""The coordination core: collectives issued by any thread, in any order, run
in one order that every rank agrees on.

A thread that calls a collective enqueues a request (its name and signature)
and waits for its turn on the communicator. One waiting thread at a time is
the runner: it holds the communicator and runs agreement rounds. In a round
every rank posts one hash of its waiting requests (``Negotiator.exchange``);
equal hashes mean equal lists, which then run in their order. Otherwise the
ranks gather each other's lists and ``matching.decide`` says which run, in
which order, and which fail; a request that matches nothing waits for the next
round. Each request that runs gets the communicator in turn (its own thread
moves its data), so the ranks' MPI calls pair up; allreduces agreed together
share one call where every rank can fuse them (``run_fused``).

This is Horovod's design (requests, a coordinator that agrees on what is
ready everywhere, one agreed order) with the calling thread as the
coordinator instead of a background one: a lone eager call on every rank,
the common case, runs in its own thread after one round with a single hash
exchange, as cheap as before there were names.
"""

from __future__ import annotations

import threading
import time
import zlib
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from .exceptions import MismatchError, RefusedError, StallError
from .fusion import cycle_time_s, fusion_threshold
from .matching import Decision, Entry, decide
from .signatures import JOIN, Signature

_PENDING, _TURN, _FAILED, _DONE = range(4)

# how long every rank must wait, unchanged, in one unmatched request before it fails:
# long against the jitter of threads issuing independent collectives, short for a person
_UNMATCHED_GRACE_S = 3.0
# marks a lone call whose data goes along with its hash: it agrees only with calls whose data does too
_WITH_DATA = 0x2545F4914F6CDD1D
_FUSABLE = 0x1B873593  # marks a request whose data may share a call with others


class Work(Protocol):
    """A request's data movement, where several requests may share one call (fusion)."""

    fusion_key: Any  # requests whose keys are equal (and whose bytes fit the fusion threshold) may share a call
    nbytes: int
    solo: bool  # False once every rank has agreed that it may share a call (set by the coordinator)
    done: bool  # set where a request ahead of this one in the agreed order moved its data

    def run(self, followers: list[Work]) -> None:
        """Move this request's data and the followers' in one call, and mark the followers done."""


class _ThreadState(threading.local):
    unordered = False  # (a class default: a per-thread miss is a plain lookup, not getattr's caught error)


_thread = _ThreadState()


def calls_here_are_unordered() -> None:
    """Mark the calling thread as one that runs a binding's asynchronous calls (its worker). Several such
    threads reach the agreement in any order, differently on each rank: their calls are paired by name only,
    never by call order, however they were named (as Horovod pairs every call)."""
    _thread.unordered = True


def _by_order(key: str) -> bool:
    """A call without a name of its own (an automatic ``kind.noname.N``), made in program order (not in an
    asynchronous call's worker): paired by call order when alone."""
    return (not key or ".noname." in key) and not _thread.unordered


def _round_hash(h: int, key: str, by_order: bool) -> int:
    """A call's part of a round's hash: the name counts, except for a lone call paired by
    call order (``by_order``: so that drifted automatic names still pair)."""
    if by_order:
        return h
    return h ^ (zlib.crc32(key.encode()) << 31)


class Request:
    """One collective call waiting for its turn."""

    __slots__ = ("signature", "hash", "key", "by_order", "allow_joined", "state", "error", "work")

    def __init__(self, signature: Signature, name: str | None, h: int, allow_joined: bool,
                 work: Work | None = None) -> None:
        self.signature, self.hash, self.allow_joined, self.work = signature, h, allow_joined, work
        self.key = signature.name if name is None else name
        self.by_order = _by_order(self.key)
        self.state = _PENDING
        self.error: BaseException | None = None

    def round_hash(self, alone: bool) -> int:
        # (whether it is fusable counts: every rank must fuse alike)
        return _round_hash(self.hash, self.key, alone and self.by_order) ^ (_FUSABLE if self.work is not None else 0)

    def labelled(self) -> Signature:
        """The signature labelled with the request's name (for messages)."""
        return self.signature.named(self.key)

    def entry(self) -> Entry:
        return Entry(self.key, self.by_order, self.allow_joined, self.labelled(), self.work is not None)


class _Serve:
    """A joined rank's part, with zeros, in the other ranks' allreduce ``signature``."""

    __slots__ = ("signature",)

    def __init__(self, signature: Signature) -> None:
        self.signature = signature


# (this rank's request, its error, what to serve, whether it may share a call with the next)
_Outcome = tuple[Request | None, BaseException | None, Any, bool]


def _outcomes(snapshot: list[Request], decision: Decision, rank: int) -> list[_Outcome]:
    """This rank's part of a decision, in the agreed order."""
    if decision.all_joined:
        return [(snapshot[0], None, None, False)]
    outcomes: list[_Outcome] = []
    for verdict in decision.verdicts:
        position = verdict.positions[rank]
        error: BaseException | None = None
        if verdict.error is not None:
            error = RefusedError(verdict.error, rank in verdict.refused_by) if verdict.refused_by \
                else MismatchError(verdict.error)
        outcomes.append((snapshot[position] if position is not None else None, error, verdict.serve,
                         verdict.fusable))
    return outcomes


def _snapshot_hash(snapshot: list[Request]) -> int:
    """What a round exchanges for the waiting requests ``snapshot``: a lone request's own hash, else their hashes
    mixed in their order."""
    if len(snapshot) == 1:
        return snapshot[0].round_hash(alone=True)
    h = 0
    for i, r in enumerate(snapshot):
        h ^= (r.round_hash(alone=False) * (2 * i + 1)) & 0x7FFFFFFFFFFFFFFF
    return h


def _take_followers(schedule: deque[Request | _Serve], work: Work) -> list[Request]:
    """(Holding the coordinator's ``cv``.) The requests right after ``work`` in the agreed order that can share its
    call, taken off ``schedule``: same fusion key, bytes within the fusion threshold."""
    followers: list[Request] = []
    room = fusion_threshold() - work.nbytes
    while schedule and not work.solo:
        nxt = schedule[0]
        if (not isinstance(nxt, Request) or nxt.work is None or nxt.work.solo
                or nxt.work.fusion_key != work.fusion_key or nxt.work.nbytes > room):
            break
        followers.append(schedule.popleft())  # type: ignore[arg-type]
        room -= nxt.work.nbytes
    return followers


class Turns:
    """The hand-over of one communicator between the threads whose calls wait for it: the requests waiting
    (``pending``), the agreed order (``schedule``), who holds it (``busy``), and the failure that ends them all.
    ``Coordinator`` adds the rounds that fill ``schedule``.

    Args:
        negotiator: a ``negotiation.Negotiator``: the rounds' hash exchange and stall reports, and its rank.
    """

    def __init__(self, negotiator: Any) -> None:
        self.negotiator = negotiator  # a negotiation.Negotiator: the rounds' hash exchange and stall reports
        self.mutex = threading.Lock()  # taken directly on the fast path (a Condition's `with` costs more)
        self.cv = threading.Condition(self.mutex)
        self.pending: list[Request] = []
        self.schedule: deque[Request | _Serve] = deque()
        self.busy = False  # a thread holds the communicator (runner, or a request in its turn)
        self.changed = time.monotonic()  # when ``pending`` last changed
        self.serve: Callable[[Signature], None] | None = None  # set by the thread in join()
        self.warned = False

    def release(self) -> None:
        """Hand the communicator to the next request of the agreed order, or free it."""
        mutex = self.mutex
        mutex.acquire()
        if not self.schedule and not self.pending:  # nobody waits: just free it
            self.busy = False
            mutex.release()
            return
        mutex.release()
        with self.cv:
            self._hand_on()

    def _hand_on(self) -> None:
        if self.schedule:
            nxt = self.schedule[0]
            if isinstance(nxt, Request):
                self.schedule.popleft()
                nxt.state = _TURN
                self.cv.notify_all()
                return
        self.busy = False
        if self.pending:
            self.cv.notify_all()

    def _wait_for_turn(self, req: Request) -> bool:
        """(Holding ``cv``.) Wait until ``req`` has its turn (True) or the communicator
        is free for this thread to run rounds (False, ``busy`` still False)."""
        while True:
            if req.state == _TURN or req.state == _DONE:
                return True
            if req.state == _FAILED:
                raise req.error  # type: ignore[misc]
            if not self.busy:
                return False
            try:
                self.cv.wait()
            except BaseException as exc:  # an interrupt: other ranks may have matched req already
                self._break(f"rank {self.negotiator.rank} left {req.labelled().describe()} while it waited "
                            f"for its turn ({type(exc).__name__})")
                raise

    def run_fused(self, work: Work) -> None:
        """(In ``work``'s turn.) Run it together with the requests right after it in the
        agreed order that can share its call: same fusion key, bytes within the fusion
        threshold. Every rank takes the same ones, since they follow from the agreed
        order and signatures alone."""
        with self.cv:
            followers = _take_followers(self.schedule, work)
        error: BaseException | None = None
        try:
            work.run([f.work for f in followers])  # type: ignore[misc]
        except BaseException as exc:
            error = exc
            raise
        finally:
            if followers:
                with self.cv:
                    for f in followers:
                        f.state, f.error = (_DONE, None) if error is None else (_FAILED, error)
                        f.work.done = error is None  # type: ignore[union-attr]
                    self.cv.notify_all()

    def _fail_all(self, exc: BaseException) -> None:
        """The runner's round failed (an interrupt, a stall past its limit): every waiting
        request fails, since the ranks can no longer agree."""
        with self.cv:
            self._break(str(exc))

    def _break(self, why: str) -> None:
        """(Holding ``cv``.) Refuse every waiting and later request: the ranks would pair
        this rank's next collectives with the wrong calls."""
        negotiator = self.negotiator
        if not negotiator.broken:
            negotiator.broken = (f"{why}, so the ranks can no longer agree on collectives. Restart the ranks "
                                 "(%hvd restart in a notebook); their variables are lost.")
        for req in self.pending:
            req.state, req.error = _FAILED, StallError(negotiator.broken)
        self.pending.clear()
        self.schedule.clear()
        self.busy = False
        self.cv.notify_all()

class Coordinator(Turns):
    """The requests of one communicator waiting for their turn (``Turns``), and the rounds that agree on their
    order: a call's way in (``acquire``), the rounds its thread runs while it holds the communicator, and
    ``join`` (built by ``Negotiator``).

    Args:
        negotiator: as for ``Turns``.
    """

    # ------------------------------------------------------------- turns
    def acquire(self, signature: Signature, name: str | None, h: int, allow_joined: bool = False,
                data: Any = None, work: Work | None = None, lone: bool = False) -> bool | None:
        """Return when this call may use the communicator (``release`` after it);
        raise the error every rank raises for it. ``name`` (where not None) replaces
        the signature's own label as the name it is matched by. True where ``data``
        went along with a lone call's agreement (see ``Negotiator.acquire``). Where
        ``work.done`` on return, another request moved its data: no turn, no release.
        ``lone``: None at once where other calls wait here (the caller then takes the
        path of a ``Work``, which may be fused with theirs)."""
        mutex = self.mutex
        mutex.acquire()
        alone = not self.busy and not self.pending
        if alone:
            self.busy = True
            mutex.release()
        elif lone:
            mutex.release()
            return None
        else:
            mutex.release()
            req = Request(signature, name, h, allow_joined, work)
            with self.cv:
                self.pending.append(req)
                self.changed = time.monotonic()
                if self.busy and self._wait_for_turn(req):
                    return False
                self.busy = True
            self._run_rounds(req)
            return False
        # the common case, no other call waiting here: one round for this call alone
        key = signature.name if name is None else name
        round_hash = _round_hash(h, key, _by_order(key)) ^ (_WITH_DATA if data is not None else 0)
        try:
            agreed = self.negotiator.exchange(round_hash, signature, key, data)
        except BaseException as exc:
            self._fail_all(exc)
            raise
        if agreed and signature.kind != JOIN.kind:
            return data is not None
        req = Request(signature, name, h, allow_joined, work)
        with self.cv:
            self.pending.insert(0, req)
            self.changed = time.monotonic()
        self._run_rounds(req, ([req], agreed))
        return False

    # ------------------------------------------------------------ rounds
    def _run_rounds(self, req: Request, exchanged: tuple[list[Request], bool] | None = None) -> None:
        """As the runner: rounds until ``req`` has its turn (or fails). ``exchanged``: a
        first round's snapshot whose hashes were exchanged already, and their verdict."""
        idle = 0
        while True:
            try:
                progressed = self._round(exchanged)
                exchanged = None
            except BaseException as exc:
                self._fail_all(exc)
                raise
            with self.cv:
                while self.schedule and isinstance(self.schedule[0], _Serve):  # (a joined rank serves them)
                    self.serve(self.schedule.popleft().signature)  # type: ignore[misc,union-attr]
                if req.state == _FAILED:
                    self._hand_on()
                    raise req.error  # type: ignore[misc]
                if self.schedule:
                    nxt = self.schedule.popleft()
                    if nxt is req:
                        return
                    nxt.state = _TURN  # type: ignore[union-attr]
                    self.cv.notify_all()
                    if self._wait_for_turn(req):
                        return
                    self.busy = True
                    continue
            idle = 0 if progressed else idle + 1
            if idle:
                time.sleep(min(1e-4 * 2 ** idle, 0.02))

    def _round(self, exchanged: tuple[list[Request], bool] | None = None) -> bool:
        """One agreement round over the waiting requests; whether any was decided."""
        cycle = cycle_time_s()  # Horovod's cycle: the calls made meanwhile join the round, and may share a call
        if exchanged is not None:
            snapshot, agreed = exchanged
            if not agreed and cycle:  # (a lone call's first exchange: the ranks gather what waits by then)
                time.sleep(cycle)
                with self.cv:
                    snapshot = list(self.pending)
        else:
            if cycle:
                time.sleep(cycle)
            with self.cv:
                snapshot = list(self.pending)
            agreed = self.negotiator.exchange(_snapshot_hash(snapshot), snapshot[0].signature, snapshot[0].key)
        if agreed:
            if snapshot[0].signature.kind == JOIN.kind:  # every rank has joined
                decision = Decision([], all_joined=True)
            else:
                self._apply(snapshot, [(r, None, None, r.work is not None) for r in snapshot])
                return True
        else:
            decision = self._gathered_decision(snapshot)
        outcomes = _outcomes(snapshot, decision, self.negotiator.rank)
        self._apply(snapshot, outcomes)
        return bool(outcomes)

    def _gathered_decision(self, snapshot: list[Request]) -> Decision:
        stuck = time.monotonic() - self.changed >= _UNMATCHED_GRACE_S
        gathered = self.negotiator.comm.allgather(([r.entry() for r in snapshot], stuck))
        lists = [entries for entries, _ in gathered]
        self.negotiator.saw_lists(lists)
        decision = decide(lists, [s for _, s in gathered])
        if not decision.verdicts and not decision.all_joined and not self.warned:
            self.warned = self.negotiator.stall.report_unmatched(lists, time.monotonic() - self.changed)
        return decision

    def _apply(self, snapshot: list[Request], outcomes: list[_Outcome]) -> None:
        """Schedule, fail or serve the decided requests (in the agreed order)."""
        with self.cv:
            decided = set()
            for req, error, serve, fusable in outcomes:
                if req is None:
                    if error is None and serve is not None:
                        self.schedule.append(_Serve(serve))
                    continue
                decided.add(id(req))
                if error is not None:
                    req.state, req.error = _FAILED, error
                else:
                    if req.work is not None:  # (a joined rank serves each call alone; a rank may not fuse it)
                        req.work.solo = serve is not None or not fusable
                    self.schedule.append(req)
            if decided:
                self.pending = [r for r in self.pending if id(r) not in decided]
                self.changed = time.monotonic()
                self.warned = False
                self.cv.notify_all()

    # -------------------------------------------------------------- join
    def join(self, serve: Callable[[Signature], None]) -> None:
        """Wait with the JOIN request, serving the other ranks' allreduces with zeros
        (``serve``), until every rank has joined."""
        self.serve = serve
        try:
            self.acquire(JOIN, None, self.negotiator.hash_of(JOIN))
            self.release()
        finally:
            self.serve = None
