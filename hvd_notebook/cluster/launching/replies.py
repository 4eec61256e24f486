"""What the ranks answer a cell with, in hvd_notebook's own types.

``RankChannel.execute`` returns a ``CellRequest``: the cell as a whole (wait for a rank to finish, for the
last of the output) and, per rank, a ``RankReply`` read from ipyparallel's record of its part (its output
streams, rich displays, the display data the dashboard reads, its value and its error). The notebook side
(``kernel/``) reads these and nothing of ipyparallel.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class RankFailure:
    """How a rank's part of a request failed: what it raised, or that its engine died.

    Args:
        ename: the exception's class name ("ValueError"; "EngineError" where the rank's process died).
        evalue: its message.
        traceback: the rank's traceback, one text (ANSI colours kept).
        engine_died: the rank's process died (a signal, ``os._exit``, out of memory), nothing was raised.
    """

    ename: str
    evalue: str
    traceback: str = ""
    engine_died: bool = False

    def __str__(self) -> str:
        return f"{self.ename}: {self.evalue}"


@dataclass(frozen=True)
class RankReply:
    """One rank's part of a cell, as far as it came: read again for more.

    Args:
        rank: the MPI rank.
        stdout: everything it printed so far.
        stderr: everything it wrote to stderr so far.
        outputs: its rich displays so far (``display_data`` messages: ``data`` and ``metadata``), in order.
        data: the display data keys it published (progress updates and events, which the dashboard reads): a
            read-only view that grows while the cell runs.
        result: its ``execute_result`` (the last expression's ``data`` and ``metadata``), None where none.
        done: it finished (a value, or an error).
        error: how it failed, None where it did not (or is not done).
    """

    rank: int
    stdout: str
    stderr: str
    outputs: tuple[dict[str, Any], ...]
    data: Mapping[str, Any]
    result: dict[str, Any] | None
    done: bool
    error: RankFailure | None

    def printed(self) -> str:
        """Its stdout and its stderr, one after the other (the last lines of a rank that died)."""
        return self.stdout + self.stderr


def failure_of(error: BaseException | None) -> RankFailure | None:
    """``error`` (ipyparallel's RemoteError, or EngineError where the engine died) as a ``RankFailure``.

    Args:
        error: ipyparallel's error, or None.
    """
    if error is None:
        return None
    from ipyparallel.error import EngineError

    ename = getattr(error, "ename", None) or type(error).__name__
    tb = getattr(error, "traceback", None) or ""
    return RankFailure(ename, str(getattr(error, "evalue", error)), tb if isinstance(tb, str) else "\n".join(tb),
                       engine_died=isinstance(error, EngineError) or ename == "EngineError")


def reply_of(rank: int, metadata: Mapping[str, Any], done: bool, error: BaseException | None) -> RankReply:
    """A ``RankReply`` from ipyparallel's record of one engine's request (``AsyncResult.metadata``).

    Args:
        rank: the rank.
        metadata: ipyparallel's record of its request.
        done: whether it finished.
        error: its error, or None.
    """
    return RankReply(rank, metadata.get("stdout") or "", metadata.get("stderr") or "",
                     tuple(metadata.get("outputs") or ()), MappingProxyType(metadata.get("data") or {}),
                     metadata.get("execute_result") or None, done, failure_of(error) if done else None)


class CellRequest:
    """A cell sent to some ranks, without waiting: what each has answered so far, and waits on them.

    ipyparallel drops its client-side records of a request once its output is complete; a ``CellRequest``
    keeps each rank's record for as long as the cell needs it.

    Args:
        whole: ipyparallel's AsyncResult of the request to every rank.
        parts: each rank's AsyncResult, in the order of ``ranks``.
        ranks: the MPI ranks the cell runs on.
    """

    def __init__(self, whole: Any, parts: list[Any], ranks: list[int]) -> None:
        self._whole = whole
        self._parts = dict(zip(ranks, parts))
        self._records = {rank: part.metadata for rank, part in self._parts.items()}
        self.ranks = list(ranks)

    def reply(self, rank: int) -> RankReply:
        """What ``rank`` has answered so far.

        Args:
            rank: the rank.
        """
        part = self._parts[rank]
        done = part.done()
        return reply_of(rank, self._records[rank], done, part.exception() if done else None)

    def replies(self) -> list[RankReply]:
        """``reply`` of every rank, in the order of ``ranks``."""
        return [self.reply(rank) for rank in self.ranks]

    def done(self, rank: int) -> bool:
        """Has ``rank`` finished (a value, or an error)?

        Args:
            rank: the rank.
        """
        return self._parts[rank].done()

    def wait_any(self, timeout: float) -> None:
        """Wait until a rank still running finishes, at most ``timeout`` seconds.

        Args:
            timeout: seconds to wait at most.
        """
        pending = [part for part in self._parts.values() if not part.done()]
        if pending:
            futures_wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def await_output(self, timeout: float) -> None:
        """Wait at most ``timeout`` seconds for output that is still on its way (results can overtake the last
        lines of output).

        Args:
            timeout: seconds to wait at most.
        """
        self._whole.wait_for_output(timeout)
