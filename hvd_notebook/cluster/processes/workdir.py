"""The on-disk format of a cluster's directory, read and written only here.

Each running cluster has a folder ``CLUSTER_ID/`` in the user's private folder
(``private.base_dir()``: owner only, verified before every use) holding:

- ``owner``: ``"pid create_time"`` of the kernel that started the cluster (or of ``hvd-notebook run``);
- ``job``: for a job of ``hvd-notebook run``, its command line (a kernel's cluster has none);
- ``pids``: one ``"pid create_time"`` line per process of the cluster, so that a
  PID reused by an unrelated process is never mistaken for one of ours;
- ``profile/``: ipyparallel's profile directory (connection files, logs);
- ``standby``: present while the cluster is another's warm standby (``standby``);
- ``activity.json``: what the cluster does (``Activity``), written by its kernel on each change of state;
- ``keep.json``: for a cluster started with ``--keep``, the manifest of its suspend as far as the kernel knows it
  (``launching.suspension``), so that the reaper suspends it where the kernel dies.

Beside the cluster directories, ``requests/`` holds the JupyterLab panel's requests to the kernels
(``Request``) and their answers, named after the cluster (a restart gives the cluster a new directory: the
answer to a restart outlives the old one).

The cluster writes it, the reaper, ``hvd-notebook list/clean`` and the JupyterLab panel read it.
"""

from __future__ import annotations

import enum
import json
import os
import secrets
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import psutil

from ... import private
from ...liveness import pid_alive

OWNER_FILE = "owner"
PID_FILE = "pids"
PROFILE_DIR = "profile"
STANDBY_FILE = "standby"
JOB_FILE = "job"
ACTIVITY_FILE = "activity.json"
KEEP_FILE = "keep.json"  # a --keep cluster's suspend, as its kernel last wrote it: what the reaper suspends
REQUESTS_DIR = "requests"
CELL_ENDS_S = 120.0  # how long a kernel asked to stop or restart waits for its interrupted cell to end

CLUSTER_PREFIX = "hvd-"  # every cluster directory's name starts so
Record = tuple[int, float]  # (pid, create_time): one process, whatever later reuses its PID


def clusters_dir() -> Path:
    """Per-user folder holding each running cluster's directory (owner only, checked)."""
    return private.base_dir()


def new_cluster_id() -> str:
    """A name for a new cluster, unique among this user's clusters."""
    return f"{CLUSTER_PREFIX}{os.getpid()}-{int(time.time() * 1000) % 10**8}"


def format_record(record: Record) -> str:
    """A record as a line of the owner or PID file.

    Args:
        record: the process's record.
    """
    return f"{record[0]} {record[1]}"


def parse_record(line: str) -> Record | None:
    """``"pid create_time"`` as a record; None for a line that is not one.

    Args:
        line: a line of the file.
    """
    try:
        pid, created = line.split()
        return int(pid), float(created)
    except ValueError:
        return None


class ActivityState(enum.StrEnum):
    """What a cluster does, as its kernel last said."""

    IDLE = "idle"
    RUNNING = "running"  # a %%hvd cell runs
    STALLED = "stalled"  # ... and a rank waits in a collective that the others have not issued
    BREAKPOINT = "breakpoint"  # ... and a rank is stopped in the debugger
    RESETTING = "resetting"  # ... and its world is being restarted after ranks died

    @classmethod
    def cell_states(cls) -> tuple[ActivityState, ...]:
        """The states in which a cell runs."""
        return (cls.RUNNING, cls.STALLED, cls.BREAKPOINT, cls.RESETTING)


@dataclass(frozen=True)
class Activity:
    """What a cluster's kernel says of it: who it is, its ranks, and what it does since when."""

    kernel: int  # the kernel's pid
    notebook: str | None  # the notebook's path as its server named it at the kernel's start
    framework: str
    backend: str
    ranks: list[dict]  # {"rank", "pid", "host", "device", "here"} each
    state: ActivityState
    since: float  # when the state began
    detail: str = ""  # a sentence on a stall, a breakpoint or a reset
    actions: list[str] = field(default_factory=list)  # what the kernel answers (``Request``)

    def changed(self, state: ActivityState, detail: str = "") -> Activity:
        """This activity in ``state`` from now on.

        Args:
            state: the new state.
            detail: a word on it, or "".
        """
        return replace(self, state=state, detail=detail, since=time.time())

    @classmethod
    def from_dict(cls, data: dict) -> Activity:
        """The activity that the activity file's JSON ``data`` describes.

        Args:
            data: the file's parsed JSON.
        """
        return cls(kernel=int(data["kernel"]), notebook=data.get("notebook"), framework=str(data["framework"]),
                   backend=str(data["backend"]), ranks=list(data["ranks"]), state=ActivityState(data["state"]),
                   since=float(data["since"]), detail=str(data.get("detail", "")),
                   actions=[str(a) for a in data.get("actions", ())])


@dataclass(frozen=True)
class Request:
    """One request of the panel to a cluster's kernel, in the ``requests/`` folder beside the cluster's
    directory: ``CLUSTER.TOKEN.json`` holds its action, ``CLUSTER.TOKEN.answer`` the kernel's answer (a
    sentence)."""

    path: Path  # its CLUSTER.TOKEN.json
    action: str

    def reply(self, answer: str) -> None:
        """Answer the request (the asking side reads and removes both files).

        Args:
            answer: what happened, in a sentence.
        """
        private.write_text(self.path.with_suffix(".answer"), answer)
        self.path.unlink(missing_ok=True)


@dataclass(frozen=True)
class WorkDir:
    """One cluster's directory."""

    path: Path

    @classmethod
    def create(cls, cluster_id: str, job: str | None = None) -> WorkDir:
        """Make the directory (owner only) and record this process as the owning kernel (or, with ``job``, its
        command line, as the launcher of a job of ``hvd-notebook run``). It gets its name with its owner
        recorded already: ``hvd-notebook clean`` stops a cluster whose directory names no live owner, and must
        never find one that is only starting.

        Args:
            cluster_id: the directory's name.
            job: the job's command line, or None for a kernel's cluster.
        """
        path = clusters_dir() / cluster_id
        making = path.with_name(f".{cluster_id}.making")  # (not a cluster's name: no one looks here)
        making.mkdir(mode=0o700)
        private.check_dir(making)
        me = psutil.Process()
        cls(making)._write(OWNER_FILE, format_record((me.pid, me.create_time())))
        if job is not None:
            cls(making)._write(JOB_FILE, job)
        making.rename(path)
        return cls(path)

    def job(self) -> str | None:
        """The command line of the ``hvd-notebook run`` job this directory is of; None for a kernel's cluster."""
        try:
            return private.read_text(self.path / JOB_FILE)
        except OSError:
            return None

    @property
    def profile(self) -> Path:
        """ipyparallel's profile directory of this cluster."""
        return self.path / PROFILE_DIR

    def owner(self) -> Record | None:
        """The kernel that started the cluster, as recorded."""
        try:
            return parse_record(private.read_text(self.path / OWNER_FILE))
        except OSError:
            return None

    def write_pids(self, records: list[Record]) -> None:
        """Replace the PID file at once (the reaper may read it at any moment).

        Args:
            records: the cluster's processes.
        """
        self._write(PID_FILE, "\n".join(format_record(r) for r in records))

    def read_pids(self) -> list[Record]:
        """The processes the PID file lists (whether or not they still run)."""
        try:
            lines = private.read_text(self.path / PID_FILE).split("\n")
        except OSError:
            return []
        return [r for r in map(parse_record, lines) if r is not None]

    def mark_standby(self, standby: bool = True) -> None:
        """Say (or no longer say) that this cluster is another's warm standby.

        Args:
            standby: True to say so, False to stop saying so.
        """
        if standby:
            self._write(STANDBY_FILE, "")
        else:
            (self.path / STANDBY_FILE).unlink(missing_ok=True)

    @property
    def kept(self) -> bool:
        """Its kernel asked that it be suspended, not stopped, when the kernel ends (``KEEP_FILE``)."""
        return (self.path / KEEP_FILE).is_file()

    @property
    def is_standby(self) -> bool:
        """A warm standby, not yet promoted."""
        return (self.path / STANDBY_FILE).exists()

    def write_activity(self, activity: Activity) -> None:
        """Replace the activity file at once (the panel may read it at any moment).

        Args:
            activity: the cluster's activity.
        """
        self._write(ACTIVITY_FILE, json.dumps(asdict(activity)))

    def read_activity(self) -> Activity | None:
        """What the cluster's kernel last said it does; None where it said nothing (a script's job, a
        cluster starting) or the file is not one."""
        try:
            return Activity.from_dict(json.loads(private.read_text(self.path / ACTIVITY_FILE)))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def ask(self, action: str) -> Path:
        """Put a request for ``action`` to the kernel; the path of the answer to wait for.

        Args:
            action: the panel's request ("stop", ...).
        """
        folder = self.path.parent / REQUESTS_DIR
        folder.mkdir(mode=0o700, exist_ok=True)
        private.check_dir(folder)
        name = f"{self.path.name}.{secrets.token_hex(8)}"
        private.write_text(folder / f"{name}.json", json.dumps({"action": action}))
        return folder / f"{name}.answer"

    def pending_requests(self) -> list[Request]:
        """The requests not answered yet, oldest first (an unreadable one is dropped)."""
        folder = self.path.parent / REQUESTS_DIR
        try:
            paths = sorted(folder.glob(f"{self.path.name}.*.json"), key=lambda p: p.stat().st_mtime)
        except OSError:
            return []
        requests = []
        for path in paths:
            try:
                requests.append(Request(path, str(json.loads(private.read_text(path, max_bytes=4096))["action"])))
            except (OSError, ValueError, KeyError, TypeError):
                path.unlink(missing_ok=True)
        return requests

    def make_private(self) -> None:
        """The profile (its connection files hold the key that signs every message): owner only."""
        for path in self.profile.rglob("*"):
            if not path.is_symlink():
                path.chmod(0o700 if path.is_dir() else 0o600)

    def remove(self) -> None:
        """Remove the directory and everything in it."""
        shutil.rmtree(self.path, ignore_errors=True)

    def _write(self, name: str, text: str) -> None:
        private.write_text(self.path / name, text)


def find_workdirs(base: Path | None = None) -> list[WorkDir]:
    """Every cluster directory of this user in ``base`` (the private folder by default), by name: real
    directories this user owns with no access for others (nothing reached through a link).

    Args:
        base: the folder; None for the private folder.
    """
    base = base or clusters_dir()
    # (beside them: the ranks' stack files, and the hvd.elastic commits of sessions and jobs)
    return [WorkDir(base / name) for name in _private_subdirs(base, CLUSTER_PREFIX)]


def _private_subdirs(base: Path, prefix: str) -> list[str]:
    return [entry.name for entry in sorted(os.scandir(base), key=lambda e: e.name) if entry.name.startswith(prefix)
            and entry.is_dir(follow_symlinks=False) and private.is_private_dir(Path(entry.path))]


def remove_leftovers(base: Path | None = None) -> list[Path]:
    """What killed processes left, removed: the ``elastic-PID-*`` folders (hvd.elastic commits of a session
    or a job) whose process is gone, and the ``.ID.making`` folders of cluster directories whose making (a
    matter of milliseconds) began over a minute ago; those removed.

    Args:
        base: the folder; None for the private folder.
    """
    removed = []
    base = base or clusters_dir()
    for path in (base / name for name in _private_subdirs(base, "elastic-")):
        pid = path.name.split("-")[1]
        if pid.isdigit() and not pid_alive(int(pid)):
            removed.append(path)
    for path in (base / name for name in _private_subdirs(base, f".{CLUSTER_PREFIX}")):
        if path.name.endswith(".making") and time.time() - path.stat().st_mtime > 60:
            removed.append(path)
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
