"""The rank channel: every message between the kernel and one world's ranks.

A ``RankChannel`` wraps the ipyparallel ``Client`` of one world and is the only code that touches it: the
world registers and bootstraps its engines through it, the notebook side (``kernel/``) executes cells, applies
functions, pulls and pushes variables, interrupts ranks, asks what their queues hold and sends control
requests through it, addressing ranks by their MPI rank. Every question to the controller has a deadline:
ipyparallel's own ``queue_status`` waits for the answer without one, so a stopped or hung controller would
hang the kernel. Those questions, and control requests, take five private names of ipyparallel's ``Client``:
``ipp_version`` refuses, on import, an ipyparallel release they were not tested with.

``execute`` answers with hvd_notebook's own types (``replies``): the notebook side reads no ipyparallel reply.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from collections.abc import Iterator
from typing import Any

import psutil
from ipyparallel import util as ipp_util

from ..errors import ClusterError
from ..processes.pids import alive
from . import ipp_version  # noqa: F401  (its import refuses an ipyparallel whose private names were not tested)
from .replies import CellRequest

QUEUE_SETTLE_S = 1.0  # how long the controller's queues may lag behind the results the client has
QUEUE_ANSWER_S = 5.0  # how long the controller gets to say what its queues hold (it answers in milliseconds)
SETTLE_POLL_S = 0.02  # between two questions while the queues settle


class ControllerSilent(ClusterError):
    """The cluster's controller did not answer a question about its queues (stopped, hung, or gone)."""


def is_busy(queue: Any) -> bool:
    """Whether one engine's entry of the controller's queue report shows work running or queued.

    Args:
        queue: one engine's entry of ``queue_status``.
    """
    return isinstance(queue, dict) and queue.get("tasks", 0) + queue.get("queue", 0) > 0


SIGNING_WARNING = "Message signing is disabled"  # jupyter_client's Session, where its key is empty


class _EncryptedNotUnsigned(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return SIGNING_WARNING not in record.getMessage()


@contextlib.contextmanager
def without_signing_warning(encrypted: bool) -> Iterator[None]:
    """Within, jupyter_client's "Message signing is disabled" is not logged where the cluster is ``encrypted``:
    under CurveZMQ ipyparallel leaves HMAC signing off on purpose (CurveZMQ authenticates every peer and
    protects against replays, which makes the digest redundant), so the warning each new session gives is not
    true of it (docs/sharing.md). An unencrypted cluster (the benchmark's baseline) keeps it.

    Args:
        encrypted: whether the cluster uses CurveZMQ.
    """
    from traitlets.log import get_logger

    logger, quiet = get_logger(), _EncryptedNotUnsigned()
    if encrypted:
        logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


class RankChannel:
    """Messages to the ranks of one world, through its ipyparallel client.

    Until ``bind`` the engines are addressed by engine id (registration and bootstrap); after it, every
    call of the notebook side names MPI ranks.

    >>> channel = world.channel
    >>> channel.call(0, os.getpid, timeout=10)
    4242
    >>> channel.busy([0, 1])
    {0: False, 1: False}

    Args:
        client: the world's ipyparallel client.

    The methods share these parameters, described here once:

    - ``ranks``: the MPI ranks addressed (None: every rank); ``rank``: one of them.
    - ``func`` and ``*args``: a function the ranks run, and its arguments.
    - ``timeout``: seconds to wait for the answer.
    """

    def __init__(self, client: Any) -> None:
        self._client = client
        self._engines: dict[int, int] = {}  # MPI rank -> engine id
        self._routers: list[psutil.Process] = []  # the controller's schedulers (``routes``)

    # ------------------------------------------------------------ the world's side
    @property
    def ipp_client(self) -> Any:
        """ipyparallel's client itself (for tests and benchmarks that compare with plain ipyparallel)."""
        return self._client

    def registered(self) -> set[int]:
        """The engine ids registered with the controller now."""
        return set(self._client.ids)

    def on_engines(self, engine_ids: list[int], func: Any, *args: Any) -> Any:
        """``func(*args)`` on each of ``engine_ids`` (before ``bind``: a bootstrap step); its AsyncResult.

        Args:
            engine_ids: the engines to call.
        """
        return self._client[engine_ids].apply_async(func, *args)

    def bind(self, engine_of_rank: dict[int, int]) -> None:
        """From now on, rank ``r`` is the engine ``engine_of_rank[r]``.

        Args:
            engine_of_rank: rank -> engine id.
        """
        self._engines = dict(engine_of_rank)

    def watch_routes(self, controller_pid: int) -> None:
        """Note the controller's schedulers (its children), which ``routes`` asks after; a ClusterError where
        the controller is gone.

        Args:
            controller_pid: the controller's process id.
        """
        try:
            self._routers = psutil.Process(controller_pid).children(recursive=True)
        except psutil.Error:
            raise ClusterError("the cluster's controller ended while the ranks started (killed? out of memory?): "
                               "start the cluster again") from None

    def routes(self) -> bool:
        """Does any of the controller's schedulers still run? They pass cells to the engines and the results
        back, each a process of its own: a cell still finishes where the controller's hub alone is gone (its
        queue questions go unanswered then), never without them. (Only all of them gone counts: one process
        seen ending is no proof that no cell can pass.)"""
        return any(alive(proc) for proc in self._routers) or not self._routers

    def close(self) -> None:
        """Close the client's sockets at once (its world is being stopped)."""
        self._client.close(linger=0)

    # ----------------------------------------------------------- the notebook's side
    def engine_ids(self, ranks: list[int] | None = None) -> list[int]:
        """Engine ids of ``ranks`` (every rank, in rank order, when None)."""
        return [self._engines[r] for r in (sorted(self._engines) if ranks is None else ranks)]

    def execute(self, code: str, ranks: list[int]) -> CellRequest:
        """Send ``code`` to ``ranks`` as a cell, without waiting: the request, which tells what each rank
        answered so far (``replies.CellRequest``).

        Args:
            code: the cell's code.
        """
        engine_ids = self.engine_ids(ranks)
        # one engine as an int: its AsyncResult is then a single result, as split() makes of several
        targets = engine_ids[0] if len(engine_ids) == 1 else engine_ids
        whole = self._client[targets].execute(code, silent=False, block=False)
        return CellRequest(whole, list(whole.split()) if len(engine_ids) > 1 else [whole], ranks)

    def apply(self, func: Any, *args: Any, ranks: list[int] | None = None) -> Any:
        """``func(*args)`` queued on ``ranks`` (all when None) without waiting; its AsyncResult."""
        return self._client[self.engine_ids(ranks)].apply_async(func, *args)

    def call_all(self, func: Any, *args: Any, ranks: list[int] | None = None, timeout: float) -> list[Any]:
        """``func(*args)`` on ``ranks`` (all when None), their values in the order of ``ranks``; ``TimeoutError``
        and the ranks' errors as ``call``."""
        return list(self.apply(func, *args, ranks=ranks).get(timeout=timeout))

    def call(self, rank: int, func: Any, *args: Any, timeout: float) -> Any:
        """``func(*args)`` on ``rank``, its value; ``TimeoutError`` where none came within ``timeout`` s (the
        request then runs when the rank gets to it), the rank's error (a RemoteError) where it raised."""
        return self._client[self.engine_ids([rank])[0]].apply_async(func, *args).get(timeout=timeout)

    def pull(self, name: str, rank: int) -> Any:
        """The value of ``name`` on ``rank``, however long the rank takes while the controller answers;
        ``ControllerSilent`` where it stops answering meanwhile.

        Args:
            name: a variable in the rank's namespace.
        """
        return self._answer(self._client[self.engine_ids([rank])[0]].pull(name, block=False))

    def push(self, namespace: dict[str, Any]) -> None:
        """Set each name of ``namespace`` to its value on every rank (waiting as ``pull`` does).

        Args:
            namespace: name -> value, set on every rank.
        """
        self._answer(self._client[self.engine_ids()].push(namespace, block=False))

    def interrupt(self, ranks: list[int]) -> None:
        """SIGINT to ``ranks`` through the controller; a ClusterError where it is not confirmed within
        ``QUEUE_ANSWER_S`` (the signal may still arrive)."""
        try:
            self._client.send_signal(signal.SIGINT, targets=self.engine_ids(ranks),
                                     block=False).result(timeout=QUEUE_ANSWER_S)
        except Exception as exc:
            raise ClusterError(f"the interrupt was not confirmed: {exc}") from None

    def control(self, rank: int, msg_type: str, content: dict[str, Any], timeout: float) -> dict[str, Any]:
        """A control message of type ``msg_type`` to ``rank``'s engine (answered beside a running cell); the
        content of its reply, or ``TimeoutError``.

        Args:
            msg_type: the control message's type (``complete_request``, ...).
            content: the message's content.
        """
        future = self._client._send_control_request(targets=[self.engine_ids([rank])[0]], msg_type=msg_type,
                                                    content=content, block=False)
        return dict(future.result(timeout=timeout)[0]["content"])

    def waiting(self) -> bool:
        """Does this kernel await replies to requests it sent?"""
        return bool(self._client.outstanding)

    def busy(self, ranks: list[int] | None = None, timeout: float | None = None) -> dict[int, bool]:
        """Per rank (all when None): does the controller's queue for it hold work running or waiting (this
        kernel's or another client's)? ``ControllerSilent`` after ``timeout`` s (``QUEUE_ANSWER_S``)."""
        ranks = sorted(self._engines) if ranks is None else ranks
        engines = self.engine_ids(ranks)
        queues = self._queues(engines, QUEUE_ANSWER_S if timeout is None else timeout)
        return {rank: is_busy(queues.get(engine)) for rank, engine in zip(ranks, engines)}

    def settled_busy(self, settle_s: float = QUEUE_SETTLE_S) -> dict[int, bool]:
        """``busy()`` of every rank, asked again for up to ``settle_s`` while it shows work although this kernel
        awaits no reply: the controller hears of a finished task a moment after the client has its result (right
        after a command, an idle rank read as busy). Work of another client still shows after ``settle_s``.

        Args:
            settle_s: seconds to ask again for.
        """
        deadline = time.monotonic() + settle_s
        while True:
            busy = self.busy()
            if self.waiting() or not any(busy.values()) or time.monotonic() >= deadline:
                return busy
            time.sleep(SETTLE_POLL_S)

    def _queues(self, engine_ids: list[int] | None, timeout: float) -> dict[Any, Any]:
        """What the controller's queues hold for ``engine_ids`` (None: every engine), as ipyparallel's
        ``queue_status`` asks it, but ``ControllerSilent`` after ``timeout`` seconds without an answer."""
        client = self._client
        content = {"targets": None if engine_ids is None else client._build_targets(engine_ids)[1], "verbose": False}
        future = client._send(client._query_stream, "queue_request", content=content)
        try:
            reply = future.result(timeout=timeout)["content"]
        except TimeoutError:
            raise ControllerSilent(f"the cluster's controller did not answer within {timeout:g} s (stopped or hung?): "
                                   "%hvd restart starts the cluster again") from None
        if reply.pop("status") != "ok":
            raise client._unwrap_exception(reply)
        return ipp_util.int_keys(reply)

    def _answer(self, result: Any) -> Any:
        """``result.get()`` of a request that may take the ranks long (a big pull), but ``ControllerSilent``
        where the controller stops answering meanwhile: it is asked for its queues after each
        ``QUEUE_ANSWER_S`` without the answer."""
        while True:
            try:
                return result.get(timeout=QUEUE_ANSWER_S)
            except TimeoutError:  # (ipyparallel's is one)
                self._queues(None, QUEUE_ANSWER_S)


def connect(connection_file: str, engine_of_rank: dict[int, int]) -> RankChannel:
    """A second client of a running world, from its controller's connection file (which its owner alone can read):
    the reaper's, suspending a ``--keep`` cluster whose kernel died.

    Args:
        connection_file: the controller's ``ipcontroller-*-client.json``.
        engine_of_rank: rank -> engine id, as the world bound them.
    """
    import ipyparallel

    channel = RankChannel(ipyparallel.Client(connection_file))
    channel.bind(engine_of_rank)
    return channel
