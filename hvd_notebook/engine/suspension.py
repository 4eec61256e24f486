"""A rank's ``%%hvd`` namespace saved to disk at a suspend, and restored into a rank of a new world.

>>> report = suspension.save(shell.user_ns, folder)        # in each rank, before the world ends
>>> suspension.restore(shell.user_ns, folder)              # in each rank of the new world
>>> # ... the caller replays the cells that made report["unsaved"] ...
>>> suspension.reconcile(shell.user_ns)

The namespace's values go into one pickle per rank (``state.pkl``), written by one cloudpickle call, so that
objects shared between names stay shared; framework objects go through their own formats and the RNGs are
kept (``suspension_formats``). Modules are kept by name and imported again. What cannot be pickled (a
``DistributedDataParallel``, a ``tf.data`` iterator, an open file, a generator) is found name by name and
reported with a short reason; where such an object has a state (a ``state_dict``, a Keras model's weights), the
state is kept, and ``reconcile`` loads it into the object that replaying its cell made. ``report.json`` beside
the pickle holds the report (JSON: read without unpickling anything).

The folder must be this user's own with no access for others, and the pickle a regular file of this user's:
both are checked (``private``) before a byte is unpickled, since unpickling runs code.

The API as first agreed, with two additions: ``restore``'s report also has ``lost`` (what of a restored object
could not be given back: a custom loop's Keras optimizer whose model is not in the namespace), and
``reconcile``'s ``not_loaded`` (unsaved names whose kept state could not be loaded into what the replay made).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import time
import types
from pathlib import Path
from typing import Any

from .. import private
from . import suspension_formats as formats

STATE_FILE = "state.pkl"
REPORT_FILE = "report.json"
# what the engine and IPython put in a namespace: never the user's state
ENGINE_NAMES = frozenset({"hvd", "In", "Out", "_", "__", "___", "_i", "_ii", "_iii", "_ih", "_oh", "_dh", "exit",
                          "quit", "get_ipython", "_exit_code"})
_HISTORY_NAME = re.compile(r"_i?\d+$")  # IPython's _5, _i5
# ipyparallel's names for the call being applied (the save itself): _<session>_<pid>_<n>_f, ..._args, ..._result
_APPLY_NAME = re.compile(r"_[0-9a-f]{8}_[0-9a-f]{24}_\d+_\d+_(?:f|args|kwargs|result)$")
_restored: dict[str, Any] = {}  # name: the object restore() put there, for reconcile()
_kept_states: dict[str, tuple[str, Any]] = {}  # name: the state of an object that is made again by replay
_process: list[dict[str, Any]] = []  # the RNGs restored: set again after the replay, which may have drawn from them


class RankMismatchError(RuntimeError):
    """The state in a folder was saved by another rank than the one restoring it."""


def _shell_names(namespace: dict[str, Any]) -> dict[str, Any]:
    """What IPython itself put in ``namespace`` (``open``, ``exit``...), where it is the running shell's."""
    try:
        from IPython import get_ipython
    except ImportError:
        return {}
    shell = get_ipython()
    return shell.user_ns_hidden if shell is not None and shell.user_ns is namespace else {}


def _user_names(namespace: dict[str, Any]) -> dict[str, Any]:
    hidden = _shell_names(namespace)
    return {name: value for name, value in namespace.items()
            if name not in ENGINE_NAMES and not name.startswith("__") and not _HISTORY_NAME.match(name)
            and not _APPLY_NAME.match(name) and not (name in hidden and hidden[name] is value)}


def _rank(namespace: dict[str, Any]) -> int:
    """This rank: from ``hvd`` where it is initialised, else from the MPI launcher's environment."""
    hvd = namespace.get("hvd")
    try:
        return int(hvd.rank())
    except Exception:  # no hvd, or not initialised
        for variable in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
            if variable in os.environ:
                return int(os.environ[variable])
        return 0


class _Discard(io.RawIOBase):
    """A file that keeps nothing: a value pickled into it is only tried."""

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return len(memoryview(data))


def _try(value: Any, namespace: dict[str, Any]) -> None:
    formats.Pickler(_Discard(), pickle.HIGHEST_PROTOCOL, namespace).dump(value)


def _write_state(path: Path, header: dict[str, Any], state: dict[str, Any], namespace: dict[str, Any]) -> int:
    """``header`` (read first, to check the rank) and ``state`` pickled into ``path`` through a fresh file beside it
    (``O_EXCL``, never through a link) renamed over it; its size. Streamed: no copy of the state is kept in memory.

    Raises:
        Exception: what pickling ``state`` raised (nothing is left behind).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | private.OPEN_FLAGS, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            pickle.dump(header, f, protocol=pickle.HIGHEST_PROTOCOL)
            formats.Pickler(f, pickle.HIGHEST_PROTOCOL, namespace).dump(state)
            size = f.tell()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def _why(exc: BaseException) -> str:
    """A reason in a few words, from a pickling error."""
    text = str(exc).split("\n")[0]
    if isinstance(exc, formats.Unsaveable):
        return text
    match = re.search(r"cannot pickle '([^']+)' object", text)
    if match:
        return f"holds a {match.group(1)}, which cannot be saved"
    return f"{type(exc).__name__}: {text}"[:160]


def _split(values: dict[str, Any], namespace: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The values that pickle, and a reason for each that does not (each name tried alone)."""
    saved, unsaved = {}, {}
    for name, value in values.items():
        try:
            _try(value, namespace)
        except Exception as exc:  # anything a __reduce__ raises
            unsaved[name] = _why(exc)
        else:
            saved[name] = value
    return saved, unsaved


def _kept_state(value: Any, namespace: dict[str, Any]) -> tuple[str, Any] | None:
    try:
        state = formats.state_of(value)
        if state is not None:
            _try(state, namespace)
        return state
    except Exception:  # its state does not pickle either: nothing to load into what the replay makes
        return None


def save(namespace: dict[str, Any], folder: str) -> dict[str, Any]:
    """Write this rank's state into ``folder``; return the report.

    Args:
        namespace: the rank's ``%%hvd`` namespace (``get_ipython().user_ns``).
        folder: an existing folder of this user's with no access for others, one per rank (made by the caller).

    Returns:
        A JSON-able report: ``{"rank", "bytes", "seconds", "saved": [names], "unsaved": {name: why}}``.

    Raises:
        private.UnsafePathError: ``folder`` is not this user's own private folder.
    """
    start = time.perf_counter()
    path = Path(folder)
    private.check_dir(path)
    values = _user_names(namespace)
    modules = {n: v.__name__ for n, v in values.items() if isinstance(v, types.ModuleType)}
    values = {n: v for n, v in values.items() if n not in modules}
    process = formats.process_state()
    rank = _rank(namespace)
    header, target = {"rank": rank, "modules": modules}, path / STATE_FILE
    try:
        size, unsaved = _write_state(target, header, {"values": values, "process": process, "states": {}},
                                     namespace), {}
    except OSError:  # the disk's (full, gone): no name is to blame
        raise
    except Exception:  # (one object fails the one call: find which, and save the rest in one call)
        values, unsaved = _split(values, namespace)
        states = {n: s for n in unsaved if (s := _kept_state(namespace[n], namespace)) is not None}
        size = _write_state(target, header, {"values": values, "process": process, "states": states}, namespace)
    report = {"rank": rank, "bytes": size, "seconds": 0.0, "saved": sorted([*values, *modules]), "unsaved": unsaved}
    report["seconds"] = round(time.perf_counter() - start, 3)
    private.write_text(path / REPORT_FILE, json.dumps(report))
    return report


def restore(namespace: dict[str, Any], folder: str) -> dict[str, Any]:
    """Load what ``save`` wrote in ``folder`` into ``namespace`` (a fresh rank's), and keep the restored
    objects aside for ``reconcile``.

    Args:
        namespace: the new rank's ``%%hvd`` namespace.
        folder: the folder ``save`` wrote, for this rank.

    Returns:
        ``{"rank", "seconds", "restored": [names], "unsaved": [names], "lost": {name: what}}``: ``unsaved`` are the
        names to make again by replaying their cells; ``lost``, what of a restored object could not be restored
        (a custom loop's Keras optimizer whose model is not in the namespace: its variables).

    Raises:
        private.UnsafePathError: the folder or its file is not this user's alone (nothing was unpickled).
        RankMismatchError: the folder holds another rank's state.
        FileNotFoundError: the folder holds no saved state.
    """
    start = time.perf_counter()
    path = Path(folder)
    rank = _rank(namespace)
    private.check_dir(path)
    fd = private.open_regular(path / STATE_FILE, max_bytes=private.UNLIMITED)
    with os.fdopen(fd, "rb") as f:
        header = pickle.load(f)
        if header["rank"] != rank:
            raise RankMismatchError(f"rank {rank} cannot restore {path}: it holds the state of rank {header['rank']}. "
                                    "Give each rank the folder its own rank saved.")
        for name, module in header["modules"].items():
            namespace[name] = __import__(module, fromlist=["_"]) if "." in module else __import__(module)
        with formats.unpickling_into(namespace):
            state = pickle.load(f)
    lost = formats.finish_optimizers(state["values"])
    formats.set_process_state(state["process"])
    namespace.update(state["values"])
    _restored.clear()
    _restored.update(state["values"])
    _kept_states.clear()
    _kept_states.update(state["states"])
    _process[:] = [state["process"]]
    report = json.loads(private.read_text(path / REPORT_FILE)) if (path / REPORT_FILE).exists() else {}
    return {"rank": rank, "seconds": round(time.perf_counter() - start, 3),
            "restored": sorted([*state["values"], *header["modules"]]),
            "unsaved": sorted(report.get("unsaved", state["states"])), "lost": lost}


def reconcile(namespace: dict[str, Any]) -> dict[str, Any]:
    """After the caller replayed the cells that made what could not be saved: each restored name the replay
    bound to a new object gets the restored state loaded into the new object (``load_state_dict``,
    ``set_weights``, optimizer variables), and the new object stays (others may reference it); where that is
    impossible (a plain value, a list) the restored object is put back. Each unsaved name the replay made gets
    the state kept of its old object. The RNGs are set again as they were saved (the replay may have drawn
    from them).

    Args:
        namespace: the namespace ``restore`` filled, after the replay.

    Returns:
        ``{"loaded": [names], "kept_restored": [names], "not_loaded": {name: why}}``: ``not_loaded``, the unsaved
        names whose kept state could not be given to what the replay made (or that it did not make).
    """
    loaded, kept = [], []
    for name, restored in _restored.items():
        new = namespace.get(name, restored)
        if new is restored:
            continue
        try:
            done = formats.load_from(new, restored)
        except Exception:  # it does not fit the new object (another shape): the restored one stays
            done = False
        if done:
            loaded.append(name)
        else:
            namespace[name] = restored
            kept.append(name)
    not_loaded = {}
    for name, (kind, payload) in _kept_states.items():
        if name not in namespace:
            not_loaded[name] = "the replay did not make it again"
            continue
        try:
            formats.load_into(namespace[name], kind, payload)
        except Exception as exc:  # (what the replay made differs from what was saved)
            text = " ".join(str(exc).split())[:200]
            not_loaded[name] = f"its saved state does not fit what the replay made: {type(exc).__name__}: {text}"
        else:
            loaded.append(name)
    if _process:  # (a replayed cell may have drawn random numbers, or seeded)
        formats.set_process_state(_process.pop())
    _restored.clear()
    _kept_states.clear()
    return {"loaded": sorted(loaded), "kept_restored": sorted(kept), "not_loaded": not_loaded}
