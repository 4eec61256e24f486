"""Horovod's elastic API on the runtime: state that survives a reset, and the loop that resets.

    state = hvd.elastic.KerasState(model, optimizer, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        model.fit(x, y, initial_epoch=state.epoch, epochs=5, callbacks=[
            hvd.elastic.CommitStateCallback(state, batches_per_commit=10),
            hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state)])

    train(state)

``commit()`` keeps a copy of the state in this process's memory; ``restore()`` goes back to it;
``sync()`` gives every rank rank 0's state. ``run`` syncs, calls the function, and on
``HorovodInternalError`` restores the last commit on every rank, builds a new world (``shutdown`` and
``init`` on the same communicator), runs the reset callbacks and calls the function again; on
``HostsUpdatedInterrupt`` it does the same without the restore. A rank that leaves a collective for a
reset tells the others, whose waiting collectives then raise ``HorovodInternalError`` too, so that
every rank resets together. The names and semantics are Horovod's (``horovod.common.elastic``); the
states of TensorFlow variables and Keras models are in ``tensorflow/elastic.py``, ``KerasState`` and the
Keras callbacks in ``keras/elastic.py``.
"""

from __future__ import annotations

import enum
import functools
import os
import pickle
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ... import config, private
from ...messages import EventKind
from . import basics, events
from . import world as _world
from .exceptions import HorovodInternalError, HostsUpdatedInterrupt
from .objects import broadcast_object


class HostUpdateResult(enum.IntFlag):
    """What changed in a host update (as Horovod's)."""

    no_update = 0
    removed = 1
    added = 2
    mixed = removed | added


class State:
    """Training state that every rank keeps alike, and that ``hvd.elastic.run`` restores after a failure.

    Subclasses say how to ``save``, ``restore`` and ``sync`` the state. ``ObjectState`` keeps Python values;
    ``TensorFlowKerasState`` (``KerasState``) and ``TensorFlowState`` keep variables too.

    Args:
        bcast_object: the function that gives every rank rank 0's object. Defaults to ``hvd.broadcast_object``.
        get_rank: the function that returns this rank. Defaults to ``hvd.rank``.
    """

    def __init__(self, bcast_object: Callable[[Any], Any] = broadcast_object,
                 get_rank: Callable[[], int] = basics.rank) -> None:
        self._bcast_object = bcast_object
        self._rank = get_rank
        self._host_messages: queue.Queue = queue.Queue()
        self._last_updated_timestamp = 0
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        """Add functions to call after each reset, such as one that rescales the learning rate to the new size.

        Args:
            callbacks: a list of functions that take no argument. They run in order after every later reset.
        """
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run after a reset by ``hvd.elastic.run``: call ``reset()``, then the reset callbacks."""
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update: HostUpdateResult) -> None:
        """Note a change of hosts; the next ``commit()`` or ``check_host_updates()`` acts on it.

        Args:
            timestamp: when the change happened. Only rank 0's notes count, and only those newer than the last
                change acted on.
            update: what changed, as a ``HostUpdateResult``.
        """
        self._host_messages.put((timestamp, update))

    def commit(self) -> None:
        """Keep a copy of the state that ``restore()`` goes back to, then check for host updates.

        A collective call: every rank commits at the same point. Where ``HVD_NOTEBOOK_ELASTIC_DIR`` is set, as
        ``hvd-notebook run`` sets it, rank 0 also writes the copy there, in the background, for a relaunched job to
        resume from.

        Raises:
            HostsUpdatedInterrupt: rank 0 has noted a change of hosts since the last check. Every rank raises it,
                for ``hvd.elastic.run`` to reset.
            OSError: on rank 0, ``HVD_NOTEBOOK_ELASTIC_DIR`` is set but the folder is missing, or others may enter
                it (``PermissionError``).
        """
        self.save()
        if self._rank() == 0:
            spill.write(self._spilled())
        self.check_host_updates()

    def _spilled(self) -> dict[str, Any]:
        """What a relaunched job needs of the last commit (read by ``_resume``)."""
        return {}

    def _resume(self, spilled: dict[str, Any]) -> None:
        """Make ``spilled`` (rank 0's last commit in an earlier launch) this state's commit, and restore it."""
        self.restore()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank where rank 0 has noted a change of hosts.

        A collective call: rank 0's view is broadcast, so that every rank raises at the same point or none does.

        Raises:
            HostsUpdatedInterrupt: rank 0 has noted a change of hosts since the last check. Its ``skip_sync`` is
                True where hosts were only removed.
        """
        previous = newest = self._last_updated_timestamp
        update = HostUpdateResult.no_update
        while not self._host_messages.empty():
            timestamp, change = self._host_messages.get()
            if timestamp > newest:
                newest, update = timestamp, update | change
        # rank 0's view, so that every rank raises at the same commit or none does
        previous, self._last_updated_timestamp, update = self._bcast_object((previous, newest, int(update)))
        if self._last_updated_timestamp > previous:
            raise HostsUpdatedInterrupt(skip_sync=update == HostUpdateResult.removed)

    def save(self) -> None:
        """Keep a copy of the state in this process's memory.

        Raises:
            NotImplementedError: in ``State`` itself; subclasses implement it.
        """
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the copy that the last ``save()`` kept.

        Raises:
            NotImplementedError: in ``State`` itself; subclasses implement it.
        """
        raise NotImplementedError

    def sync(self) -> None:
        """Give every rank rank 0's state.

        A collective call: every rank makes it.

        Raises:
            NotImplementedError: in ``State`` itself; subclasses implement it.
        """
        raise NotImplementedError

    def reset(self) -> None:
        """Rebuild what depends on the world after a reset. It does nothing by default."""


class ObjectState(State):
    """Elastic state made of Python values, each given as a keyword argument and kept as an attribute.

    >>> state = hvd.elastic.ObjectState(epoch=0, batch=0)
    >>> state.epoch += 1
    >>> state.commit()

    ``sync()`` gives every rank rank 0's values, as pickled objects.

    Args:
        bcast_object: the function that gives every rank rank 0's object. Defaults to ``hvd.broadcast_object``.
        get_rank: the function that returns this rank. Defaults to ``hvd.rank``.
        **kwargs: the values, by name: each becomes an attribute, ``state.epoch``.
    """

    def __init__(self, bcast_object: Callable[[Any], Any] = broadcast_object,
                 get_rank: Callable[[], int] = basics.rank, **kwargs: Any) -> None:
        self._saved_state = dict(kwargs)
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def _spilled(self) -> dict[str, Any]:
        return {**super()._spilled(), "values": dict(self._saved_state)}

    def _resume(self, spilled: dict[str, Any]) -> None:
        self._saved_state.update(spilled.get("values", {}))
        super()._resume(spilled)

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run a training function until it returns, resetting the world after a failure, as Horovod's decorator.

    Before each call, every rank gets rank 0's state (``state.sync()``). Where the function raises
    ``HorovodInternalError``, such as a collective that failed because another rank reset, each rank restores the
    last commit. Where it raises ``HostsUpdatedInterrupt``, each rank keeps its state. Then the world is rebuilt on
    the same communicator, ``state.on_reset()`` runs the reset callbacks, and the function is called again. Issue no
    collective between calling the wrapper and the function's start: the ranks sync there.

    >>> @hvd.elastic.run
    ... def train(state):
    ...     model.fit(x, y, initial_epoch=state.epoch, epochs=5, callbacks=callbacks)
    >>> train(state)

    Args:
        func: the training function. It takes a ``State`` as its first argument, and any other arguments after it.

    Returns:
        A function ``wrapper(state, *args, **kwargs)`` that returns what ``func`` returned on the call that did not
        fail. Where ``HVD_NOTEBOOK_ELASTIC_DIR`` holds the commit of an earlier launch, the wrapper resumes from it
        first.

    Raises:
        Exception: the wrapper raises whatever ``func`` raises other than ``HorovodInternalError`` and
            ``HostsUpdatedInterrupt``, ending the loop.
        OSError: on rank 0, ``HVD_NOTEBOOK_ELASTIC_DIR`` is set but the folder is missing, or others may enter it
            (``PermissionError``).
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        skip_sync = False
        spilled = spill.take_for_resume() if state._rank() == 0 else None
        if spilled is not None:  # a relaunched job: rank 0 goes back to the last commit, sync shares it
            state._resume(spilled)
        while True:
            try:
                if not skip_sync:
                    state.sync()
                result = func(state, *args, **kwargs)
                if state._rank() == 0:
                    spill.clear()  # the training ended: a later failure has nothing of it to resume
                return result
            except HorovodInternalError:
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as interrupt:
                skip_sync = interrupt.skip_sync
            _reset()
            state.on_reset()

    return wrapper


class _Spill:
    """Rank 0's last commit on disk (``HVD_NOTEBOOK_ELASTIC_DIR``): written in a background thread
    (a commit waits only for the write before it), replaced whole (a write to a temporary file, then
    a rename), so that a killed rank leaves the previous commit intact."""

    FILE = "commit.pkl"

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.resumed = False

    def path(self) -> Path | None:
        """The commit file, in the folder ``HVD_NOTEBOOK_ELASTIC_DIR`` names, where that folder is this
        user's own with no access for others (``private.check_dir``; a commit is unpickled when resumed,
        so a folder someone else could write is refused)."""
        folder = config.ELASTIC_DIR.text()
        if not folder:
            return None
        private.check_dir(Path(folder))
        return Path(folder) / self.FILE

    def write(self, spilled: dict[str, Any]) -> None:
        path = self.path()
        if path is None:
            return
        if self.thread is not None:
            self.thread.join()
        spilled["time"] = time.time()

        def write() -> None:
            # tensors read in place (np.asarray: no copy); a commit's tensors never change
            data = {k: [np.asarray(x) for x in v] if k == "variables" else v for k, v in spilled.items()}
            partial = path.with_name(f".{self.FILE}.{os.getpid()}.partial")
            with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600), "wb") as f:
                pickle.dump(data, f, protocol=5)
            os.replace(partial, path)
            values = ", ".join(f"{k}={v!r}" for k, v in data.get("values", {}).items()
                               if isinstance(v, (int, float, str)) and len(repr(v)) <= 40)
            summary = f"{values + ', ' if values else ''}committed at {time.strftime('%H:%M:%S')}"
            private.write_text(path.parent / config.ELASTIC_COMMIT_SUMMARY, summary)
            events.emit(EventKind.COMMIT, summary)  # (on disk now: a world restarted after this resumes from it)

        self.thread = threading.Thread(target=write, name="hvd-elastic-commit", daemon=False)
        self.thread.start()

    def clear(self) -> None:
        """Forget the last commit (on disk too)."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        path = self.path()
        if path is not None:
            for name in (self.FILE, config.ELASTIC_COMMIT_SUMMARY):
                (path.parent / name).unlink(missing_ok=True)
            events.emit(EventKind.COMMIT, "")  # (no commit holds now: nothing to resume from)

    def take_for_resume(self) -> dict[str, Any] | None:
        """Once per process: the commit an earlier launch of this job left, if any."""
        path = self.path()
        if self.resumed or path is None or not path.exists():
            return None
        self.resumed = True
        # (a regular file of this user's, never through a link: what is unpickled runs as this user)
        with os.fdopen(private.open_regular(path, max_bytes=private.UNLIMITED), "rb") as f:
            return pickle.load(f)


spill = _Spill()


def _reset() -> None:
    """A new world on the communicator of the old one; a rank still in a collective of the old world
    is told, and resets too."""
    parent = _world.shutdown(resetting=True)
    basics.init(comm=parent)


__all__ = ["HorovodInternalError", "HostUpdateResult", "HostsUpdatedInterrupt", "ObjectState", "State", "run"]
