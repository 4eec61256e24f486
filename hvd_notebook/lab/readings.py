"""What JupyterLab's panel shows, read afresh for each request of the server extension (``handlers``):
this user's clusters on this node, each rank's process and GPU, the node's GPUs and who leases them.

Everything comes from what the package keeps already: the user's own cluster directories (owner only:
``workdir``, with the activity their kernels write), the node's register of cards (read once per reading,
at most ``registry.MAX_CARDS_PER_USER`` per user) and its GPU leases (readable by all), the OS (psutil)
and the driver (NVML, through ``nvidia-ml-py``, where it loads). Of another user the panel says one line:
their name, their clusters' rank count as their cards say it, and the GPUs that a lease lock of theirs holds
(never the GPUs a card claims). A rank's process is read only where it is the process the cluster recorded
(its pid and start time) and runs as this user."""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import psutil

from .. import private
from ..cluster.finding import ClusterDir, find_clusters, own_cluster_dirs, own_suspended
from ..cluster.launching.suspension import SuspendError
from ..cluster.node import leases, policy, queue, registry
from ..cluster.processes import stacks
from ..cluster.processes.pids import same_process
from ..cluster.processes.workdir import Activity
from ..liveness import alive

log = logging.getLogger(__name__)

KERNEL_ACTIONS = ("interrupt", "restart", "stop")  # answered by the owning kernel (``kernel.panel``)
SERVER_ACTIONS = ("stacks",)  # answered here, for any cluster (what ``hvd-notebook stacks`` prints)
SCRIPT_ACTIONS = ("stacks", "stop")  # a job of hvd-notebook run: its launcher ends the ranks on SIGTERM
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")  # how MPICH's and Open MPI's launchers say it
MAX_WARNINGS = 64  # distinct warnings a server logs (a poll every 1.5 s would repeat each for ever)
MAX_QUEUE_SHOWN = 32  # entries of the node's queue for GPUs in a reading (each user has at most 4 that count)
MAX_SUSPENDED_SHOWN = 32  # this user's suspended clusters in a reading (each one's size is read from its files)
_warned: set[str] = set()


@dataclass(frozen=True)
class Kernel:
    """A kernel of this Jupyter server, by its process id: its id and the notebook it serves."""

    id: str
    notebook: str | None


class Nvml:
    """This host's GPUs as the driver reports them; ``available`` False (and no GPU read) without a driver."""

    def __init__(self) -> None:
        self.available = False
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml, self.available = pynvml, True
        except Exception as exc:  # (no package, no driver, no GPU: the panel shows no GPU columns)
            log.debug("NVML is not available: %s", exc)

    def devices(self) -> list[dict[str, Any]] | None:
        """Each GPU's index, name, utilisation (%) and memory, with the memory each process holds on it
        (``processes``: pid -> bytes); None without a driver."""
        if not self.available:
            return None
        nvml, found = self._nvml, []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
            except nvml.NVMLError:
                util = None
            try:
                processes = {p.pid: p.usedGpuMemory for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)}
            except nvml.NVMLError:
                processes = {}
            name = nvml.nvmlDeviceGetName(handle)
            found.append({"index": index, "name": name.decode() if isinstance(name, bytes) else name, "util": util,
                          "memory_used": memory.used, "memory_total": memory.total, "processes": processes})
        return found


class Readings:
    """The panel's figures. Keeps each rank's process between requests: its CPU share is measured over the
    time since the last request (psutil's ``cpu_percent``), so the first reading of a rank has none. One
    reading at a time (a lock): concurrent requests share the processes kept."""

    def __init__(self) -> None:
        self._processes: dict[tuple[int, float], psutil.Process] = {}
        self._lock = threading.Lock()
        self.nvml = Nvml()

    def snapshot(self, kernels: dict[int, Kernel]) -> dict[str, Any]:
        """What the panel shows now (its fields: docs/jupyterlab.md, "The server's answers").

        Args:
            kernels: this server's kernels by process id.
        """
        with self._lock:
            return self._read(kernels)

    def _read(self, kernels: dict[int, Kernel]) -> dict[str, Any]:
        now, me = time.time(), private.user_name()
        gpus = self.nvml.devices()
        rules = _rules()
        cards = registry.read_all()  # (once per reading: the clusters, the leases and the others use it)
        mine = {c.cluster: c for c in cards if c.user == me and c.kernel_alive}
        clusters = [self._cluster(c, kernels, mine.get(c.path.name), rules, gpus) for c in self._own_clusters(cards)]
        holders = _holders(cards)
        self._forget_ended()
        return {
            "time": now, "user": me, "clusters": clusters,
            "gpus": None if gpus is None else [
                {k: d[k] for k in ("index", "name", "util", "memory_used", "memory_total")}
                | {"holder": holders.get(str(d["index"])), "mine": holders.get(str(d["index"])) == me} for d in gpus],
            "caps": {"max_gpus_per_user": rules.max_gpus_per_user, "max_ranks_per_user": rules.max_cpu_ranks_per_user,
                     "my_gpus": sum(len(c.gpus) for c in mine.values()),
                     "my_cpu_ranks": sum(c.ranks for c in mine.values() if not c.gpus)},
            "others": _others(cards, holders, me),
            "queue": _queue(me),
            "suspended": _suspended(cards),
        }

    def _own_clusters(self, cards: list[registry.Card]) -> list[ClusterDir]:
        found = [c for base in own_cluster_dirs(cards) for c in find_clusters(base)]
        return [c for c in found if not c.orphaned and not c.workdir.is_standby]

    def _cluster(self, found: ClusterDir, kernels: dict[int, Kernel], card: registry.Card | None,
                 rules: policy.Policy, gpus: list[dict[str, Any]] | None) -> dict[str, Any]:
        activity = found.workdir.read_activity()
        kernel = kernels.get(found.kernel_pid or -1)
        described = _describe(found, activity)
        recorded = dict(found.workdir.read_pids())  # pid -> start time: a rank's process is that one, or none
        lease_ends = idle_release_at = None
        if card is not None:
            lease_ends = card.started + rules.max_lease_time if rules.max_lease_time is not None else None
            if rules.idle_timeout is not None and not card.busy:
                idle_release_at = card.last_cell + rules.idle_timeout
        return {
            "id": found.path.name, "kind": described["kind"],
            "notebook": kernel.notebook if kernel is not None and kernel.notebook else described["notebook"],
            "kernel_id": kernel.id if kernel is not None else None, "command": described["command"],
            "framework": activity.framework if activity else None, "backend": activity.backend if activity else None,
            "hosts": sorted({r["host"] for r in described["ranks"]}), "n": len(described["ranks"]),
            "state": described["state"], "since": described["since"], "detail": described["detail"],
            "lease_ends": lease_ends, "idle_release_at": idle_release_at, "actions": described["actions"],
            "ranks": [self._rank(r, gpus, recorded.get(r["pid"])) for r in described["ranks"]],
        }

    def _rank(self, rank: dict[str, Any], gpus: list[dict[str, Any]] | None, started: float | None) -> dict[str, Any]:
        here = rank.get("here", True)
        process, first = self._process(rank["pid"], started) if here else (None, True)
        cpu = rss = None
        alive = process is not None or not here  # (a rank on another host: its kernel would know)
        if process is not None:
            try:
                with process.oneshot():
                    share, rss = process.cpu_percent(), process.memory_info().rss
                cpu = None if first else share
            except psutil.Error:
                alive = False
        device, gpu = str(rank["device"]), None
        if not device and here:  # a script's rank: the GPU it holds memory on, else its CPU
            device = next((f"GPU {d['index']}" for d in gpus or () if rank["pid"] in d["processes"]), "CPU")
        match = re.fullmatch(r"GPU (\d+)", device)
        if gpus is not None and match and int(match.group(1)) < len(gpus):
            d = gpus[int(match.group(1))]
            gpu = {k: d[k] for k in ("index", "util", "memory_used", "memory_total")} | {
                "process_memory": d["processes"].get(rank["pid"]) if here else None}
        return {"rank": rank["rank"], "pid": rank["pid"], "host": rank["host"], "device": device, "alive": alive,
                "cpu_percent": cpu, "rss": rss, "gpu": gpu}

    def _process(self, pid: int, started: float | None) -> tuple[psutil.Process | None, bool]:
        """The process the cluster recorded as ``pid`` started at ``started``, where it still runs as this user
        (``same_process``: a reused pid is no one's rank), the same object as at the last reading (its CPU share
        counts from then), and whether this is its first reading; None where it ended or was never recorded."""
        key = (pid, started)
        kept = self._processes.get(key) if started is not None else None
        if kept is not None and alive(kept):
            return kept, False
        process = same_process(key) if started is not None else None
        if process is not None:
            self._processes[key] = process
        return process, True

    def _forget_ended(self) -> None:
        for key, process in list(self._processes.items()):
            if not alive(process):
                del self._processes[key]


def _describe(found: ClusterDir, activity: Activity | None) -> dict[str, Any]:
    """Kind, notebook, command, state and ranks of a cluster: from its kernel's activity where it wrote one;
    a job of ``hvd-notebook run`` (or a kernel's cluster still starting) from its directory and processes."""
    if activity is not None:
        return {"kind": "notebook", "notebook": activity.notebook, "command": None, "state": str(activity.state),
                "since": activity.since, "detail": activity.detail, "ranks": activity.ranks,
                "actions": [a for a in activity.actions if a in KERNEL_ACTIONS] + list(SERVER_ACTIONS)}
    owner, job = found.workdir.owner(), found.workdir.job()
    since = owner[1] if owner else time.time()
    ranks = [{"rank": rank, "pid": pid, "host": os.uname().nodename, "device": "", "here": True}
             for pid, rank in sorted(_ranks_of(found.live_pids).items(), key=lambda item: item[1])]
    if job is None:  # a kernel's cluster that has not written its activity yet
        return {"kind": "notebook", "notebook": None, "command": None, "state": "starting", "since": since,
                "detail": "", "ranks": ranks, "actions": []}
    return {"kind": "script", "notebook": None, "command": job, "state": "running", "since": since, "detail": "",
            "ranks": ranks, "actions": list(SCRIPT_ACTIONS)}


def _ranks_of(pids: list[int]) -> dict[int, int]:
    """The rank of each rank among ``pids`` (this user's processes): as it registered for its stacks (a Python
    script under ``hvd-notebook run``, an engine), else as its launcher told it (``RANK_VARIABLES``: any
    program, before it registers too). A rank's children inherit its variable: per rank, the process that
    registered, else the first started."""
    ranks = stacks.ranks_of(pids)
    told: dict[int, tuple[float, int]] = {}  # rank -> (start time, pid)
    for pid in set(pids) - set(ranks):
        try:
            process = psutil.Process(pid)
            environ, started = process.environ(), process.create_time()
        except psutil.Error:
            continue
        rank = next((environ[name] for name in RANK_VARIABLES if name in environ), "")
        if rank.isdigit() and int(rank) not in ranks.values():
            told[int(rank)] = min(told.get(int(rank), (started, pid)), (started, pid))
    return ranks | {pid: rank for rank, (_, pid) in told.items()}


def _rules() -> policy.Policy:
    try:
        return policy.load()
    except policy.PolicyError as exc:  # (the kernels refuse to start and say why; the panel goes on)
        _warn_once(f"hvd_notebook: the node's rules could not be read: {exc}")
        return policy.Policy()


def _holders(cards: list[registry.Card]) -> dict[str, str | None]:
    """GPU id -> the user whose process holds its lease lock now (``leases.holders``: the lock file's own
    device and inode in the kernel's table of locks)."""
    try:
        held = leases.holders(cards)
    except leases.LeaseError as exc:
        _warn_once(f"hvd_notebook: the GPU leases could not be read: {exc}")
        return {}
    return {gpu: _user_of(pid) for gpu, (pid, _) in held.items()}


def _others(cards: list[registry.Card], holders: dict[str, str | None], me: str) -> list[dict[str, Any]]:
    """One line per other user with a running cluster, whatever they planted: their clusters' ranks (as their
    cards say), the GPUs a lease lock of theirs holds, since their first cluster started."""
    lines: dict[str, dict[str, Any]] = {}
    for card in cards:
        if card.user != me and card.kernel_alive:
            line = lines.setdefault(card.user, {"user": card.user, "gpus": [], "ranks": 0, "since": card.started})
            line["ranks"] += card.ranks
            line["since"] = min(line["since"], card.started)
    for gpu in sorted(holders, key=lambda g: (len(g), g)):
        if holders[gpu] in lines:
            lines[holders[gpu]]["gpus"].append(gpu)
    return sorted(lines.values(), key=lambda line: line["user"])


def _queue(me: str) -> list[dict[str, Any]]:
    """The node's queue for GPUs in the order it serves (``queue.look``): each start's place, user, GPUs wanted
    and since when it waits, at most ``MAX_QUEUE_SHOWN``; none where the queue cannot be read."""
    try:
        line = queue.look().line
    except (OSError, leases.LeaseError) as exc:
        _warn_once(f"hvd_notebook: the node's queue for GPUs could not be read: {exc}")
        return []
    return [{"place": place, "user": entry.user, "gpus": entry.gpus, "since": entry.since, "mine": entry.user == me}
            for place, entry in enumerate(line[:MAX_QUEUE_SHOWN], start=1)]


def _suspended(cards: list[registry.Card]) -> list[dict[str, Any]]:
    """This user's own suspended clusters (``finding.own_suspended``: their private folders only, never
    another user's), at most ``MAX_SUSPENDED_SHOWN``: each one's id, ranks, GPUs, size on disk, since when, why,
    and the kernel that suspended it; one whose manifest cannot be read has ``error`` (and may be deleted)."""
    try:
        found = own_suspended(cards)[:MAX_SUSPENDED_SHOWN]
    except OSError as exc:
        _warn_once(f"hvd_notebook: the suspended clusters could not be read: {exc}")
        return []
    listed = []
    for suspended in found:
        entry: dict[str, Any] = {"id": suspended.id, "bytes": suspended.size(), "ranks": None, "gpus": [],
                                 "since": None, "why": "", "kernel": None, "error": None}
        try:
            manifest = suspended.manifest()
        except SuspendError as exc:
            entry["error"] = str(exc)
        else:
            entry |= {"ranks": manifest.ranks, "gpus": list(manifest.gpus), "since": manifest.suspended,
                      "why": manifest.why, "kernel": manifest.kernel}
        listed.append(entry)
    return listed


def _warn_once(text: str) -> None:
    if text not in _warned and len(_warned) < MAX_WARNINGS:
        _warned.add(text)
        log.warning("%s", text)


def _user_of(pid: int) -> str | None:
    try:
        return private.user_name(psutil.Process(pid).uids().real)
    except (psutil.Error, ValueError):
        return None
