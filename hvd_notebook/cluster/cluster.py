"""Start, watch, stop and restart one ipyparallel cluster of MPI engines.

This is the only module that starts or kills processes. The controller and the
``mpiexec`` world come from ipyparallel's launchers; on top of them it adds what
a shared notebook server needs: a private profile directory per cluster, a start
that fails fast with ``mpiexec``'s own output, and a stop that proves, by PID,
that nothing of the cluster is left.
"""

from __future__ import annotations

import functools
import getpass
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from ..config import DEFAULT_RANKS_WITHOUT_GPU, ClusterOptions
from . import hosts as hostlib
from . import leases
from .reaper import PID_FILE

log = logging.getLogger(__name__)

STOP_GRACE_S = 0.5  # between SIGTERM and SIGKILL when stopping: nothing of a stopped cluster is kept


class ClusterError(RuntimeError):
    """The cluster could not be started, or broke; the message says what to do.
    ``mpi_init_failed``: MPI_Init itself failed before any engine connected."""

    def __init__(self, message: str, mpi_init_failed: bool = False) -> None:
        super().__init__(message)
        self.mpi_init_failed = mpi_init_failed


# MPICH's words when MPI_Init fails on a rank (MPI_Init_thread is what mpi4py calls)
_MPI_INIT_FAILED = re.compile(r"Fatal error in (internal_Init_thread|P?MPI_Init)")


@dataclass
class RankInfo:
    """One engine as its bootstrap described it."""

    rank: int
    engine_id: int
    host: str
    pid: int
    device: str
    local_rank: int
    local_size: int
    intra_op_threads: int
    inter_op_threads: int
    backend: str
    ip: str = ""  # the rank's address on its route to the controller
    here: bool = True  # on the kernel's host (its pid means something here)


def detect_gpus() -> list[str]:
    """GPU ids on this host: ``$HVD_NOTEBOOK_GPUS`` if set, else ``nvidia-smi``'s list.

    The notebook kernel never creates a CUDA context, so detection asks the
    driver's command-line tool rather than TensorFlow.
    """
    listed = os.environ.get("HVD_NOTEBOOK_GPUS")
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    out = _nvidia_smi("--query-gpu=index", "--format=csv,noheader")
    return [line.strip() for line in out.splitlines() if line.strip()]


def _nvidia_smi(*args: str) -> str:
    """What ``nvidia-smi ARGS`` prints; empty where there is no driver (or it fails)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ""
    try:
        return subprocess.run([smi, *args], capture_output=True, text=True, timeout=20, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return ""


def gpu_memory_by_pid() -> dict[int, int]:
    """Bytes of GPU memory each process holds on this host, from ``nvidia-smi``
    (empty where there is none). Asked of the driver, so busy ranks need not answer."""
    return parse_gpu_memory(_nvidia_smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"))


def parse_gpu_memory(csv_text: str) -> dict[int, int]:
    """``nvidia-smi --query-compute-apps=pid,used_memory`` output (MiB) as pid -> bytes."""
    used: dict[int, int] = {}
    for line in csv_text.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            used[int(pid)] = used.get(int(pid), 0) + int(mib) * 2**20
    return used


def resolve_gpus(spec: str) -> list[str]:
    """Turn ``--gpus auto|none|0,1`` into the list of GPU ids to pin ranks to."""
    spec = spec.strip()
    if spec == "auto":
        return detect_gpus()
    if spec == "none":
        return []
    ids = [g.strip() for g in spec.split(",")]
    if not ids or not all(g.isdigit() for g in ids) or len(set(ids)) != len(ids):
        raise ClusterError(
            f"--gpus {spec!r} is not valid: use auto, none, or distinct GPU ids such as 0,1."
        )
    return ids


def find_mpiexec(requested: str | None) -> str:
    """The ``mpiexec`` to launch engines with: the one asked for, else the one
    beside this Python (the mpich wheel's), else the first on ``PATH``."""
    if requested:
        found = shutil.which(requested)
        if found is None:
            raise ClusterError(
                f"--mpiexec {requested!r} was not found or is not executable. Give the full "
                "path of the mpiexec that belongs to the MPI your mpi4py was built for "
                "(python -c 'import mpi4py; print(mpi4py.get_config())' tells which)."
            )
        return found
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("mpiexec")
    if found is None:
        raise ClusterError(
            "No mpiexec found beside this Python or on PATH. Install an MPI runtime "
            "(`pip install mpich` in this environment, or your system's MPI with mpi4py "
            "built for it) or pass --mpiexec PATH."
        )
    return found


def _single_host_launcher(mpiexec: str) -> str:
    """MPICH's ``mpiexec.gforker`` beside its ``mpiexec``, where there is one.

    All ranks of a cluster run on this host. Hydra, MPICH's default launcher,
    listens for its proxies on a TCP port on every interface and has no option
    to keep it on loopback; gforker forks the ranks itself and listens on no
    port at all."""
    gforker = Path(mpiexec).parent / "mpiexec.gforker"
    return str(gforker) if gforker.is_file() and os.access(gforker, os.X_OK) else mpiexec


# MPI between ranks of one host over shared memory only: UCX (MPICH's default
# netmod in the wheel) otherwise opens a TCP listener on the host's network
# interface. The user's own --env or environment wins.
LOOPBACK_ENV = {"UCX_TLS": "self,sm"}

HUGEPAGES_TUNABLE = "glibc.malloc.hugetlb=1"


def rank_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """What every rank gets on top of the launching environment: glibc's malloc
    asks for transparent huge pages (``GLIBC_TUNABLES=glibc.malloc.hugetlb=1``,
    added to any tunables already set), so that TensorFlow's tensors and MPI's
    own buffers sit on 2 MiB pages as numpy's large arrays do. Measured here:
    a 64 MiB allreduce about 2x faster, a 16 MiB one no longer about 10 % slower
    from a TensorFlow tensor than from a numpy array. ``HVD_NOTEBOOK_HUGEPAGES=0``
    leaves malloc alone; a ``glibc.malloc.hugetlb`` already set wins."""
    environ = os.environ if environ is None else environ
    tunables = environ.get("GLIBC_TUNABLES", "")
    if environ.get("HVD_NOTEBOOK_HUGEPAGES", "1") == "0" or "glibc.malloc.hugetlb" in tunables:
        return {}
    return {"GLIBC_TUNABLES": f"{tunables}:{HUGEPAGES_TUNABLE}" if tunables else HUGEPAGES_TUNABLE}


ENGINE_HEARTBEAT_MISSES = 7  # the controller pings every 3 s; the engine checks every 3.5 s

OWNER_FILE = "owner"  # "pid create_time" of the kernel that started the cluster


def clusters_dir() -> Path:
    """Per-user folder holding each running cluster's private profile directory."""
    base = Path(tempfile.gettempdir()) / f"hvd_notebook-{getpass.getuser()}"
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    return base


def _placement(options: ClusterOptions) -> tuple[str, list[hostlib.Host]]:
    """Where the ranks go: "local" (this host), "hosts" (-H or --hostfile, through
    mpiexec) or "srun" (inside a Slurm allocation), and the hosts of -H."""
    if options.launcher not in ("auto", "mpiexec", "srun"):
        raise hostlib.HostError(f"--launcher {options.launcher!r}: use auto, mpiexec or srun.")
    if options.hosts and options.hostfile:
        raise hostlib.HostError("give the hosts with -H or with --hostfile, not both.")
    if options.hosts or options.hostfile:
        if options.launcher == "srun":
            raise hostlib.HostError("--launcher srun places the ranks on the allocation's nodes itself; "
                                    "drop -H/--hostfile, or use --launcher mpiexec.")
        hosts = hostlib.parse_hosts(options.hosts) if options.hosts else hostlib.read_hostfile(options.hostfile)
        return "hosts", hosts
    if options.launcher == "srun" or (options.launcher == "auto" and hostlib.in_slurm_allocation()
                                      and shutil.which("srun") and options.mpiexec is None):
        if not hostlib.in_slurm_allocation():
            raise hostlib.HostError("--launcher srun needs a Slurm allocation (SLURM_JOB_ID is not set): run the "
                                    "notebook server or kernel inside salloc/sbatch, or use --launcher mpiexec.")
        if shutil.which("srun") is None:
            raise hostlib.HostError("--launcher srun: srun is not on PATH; load Slurm's environment first.")
        return "srun", []
    return "local", []


def _srun_ranks(n: int | None) -> int:
    """-n inside an allocation: the allocation's tasks by default, and no more than those."""
    tasks = hostlib.slurm_tasks()
    if n is None:
        return tasks or DEFAULT_RANKS_WITHOUT_GPU
    if tasks is not None and n > tasks:
        raise ClusterError(f"-n {n} ranks but the Slurm allocation has {tasks} task(s) (SLURM_NTASKS). Ask "
                           f"salloc/sbatch for more (-n {n}) or start fewer ranks (-n {tasks}).")
    return n


@functools.cache
def _is_open_mpi(mpiexec: str) -> bool:
    """Open MPI's mpiexec takes --host; MPICH's hydra takes -hosts."""
    try:
        out = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (subprocess.SubprocessError, OSError):
        return False
    return "Open MPI" in out or "OpenRTE" in out


def _tail(text: str, lines: int = 20) -> str:
    kept = [line for line in text.strip().splitlines() if line.strip()][-lines:]
    return "\n".join("    " + line for line in kept) or "    (mpiexec printed nothing)"


class MPICluster:
    """An ipyparallel controller plus one ``mpiexec`` world of engines.

    >>> cluster = MPICluster(ClusterOptions(n=2))
    >>> ranks = cluster.start()          # blocks until every rank is bootstrapped
    >>> cluster.client[:].apply_sync(lambda: 1)
    [1, 1]
    >>> cluster.stop()                   # nothing of it is left running
    """

    def __init__(self, options: ClusterOptions) -> None:
        self.host_gpus = resolve_gpus(options.gpus)  # what may be used; start() leases the free ones
        self.gpus: list[str] = []
        self._lease: leases.Lease | None = None
        if options.timeout <= 0:
            raise ClusterError(f"--timeout {options.timeout}: give a positive number of seconds.")
        try:
            self.mode, self.hosts = _placement(options)
        except hostlib.HostError as exc:
            raise ClusterError(str(exc)) from None
        if self.mode == "local":
            n = options.n if options.n is not None else (len(self.host_gpus) or DEFAULT_RANKS_WITHOUT_GPU)
        elif self.mode == "hosts":
            n = hostlib.check_slots(self.hosts, options.n)
        else:
            n = _srun_ranks(options.n)
        if n < 1:
            raise ClusterError(f"-n {n}: a cluster needs at least one rank; try -n 2.")
        if self.mode == "local" and self.host_gpus and n > len(self.host_gpus):
            raise ClusterError(
                f"-n {n} ranks but only {len(self.host_gpus)} GPU(s) ({','.join(self.host_gpus)}) on this "
                f"host: one rank per GPU. Use -n {len(self.host_gpus)}, or --gpus none to run on CPUs."
            )
        # on this host with GPUs and no -n, start() settles n: one rank per GPU that is free then
        leasing = self.mode == "local" and self.host_gpus and options.n is None
        self.options = options if leasing else replace(options, n=n)
        if self.mode == "srun":
            self.mpiexec = shutil.which("srun") or "srun"
        else:
            self.mpiexec = find_mpiexec(options.mpiexec)
            if options.mpiexec is None and self.mode == "local":
                self.mpiexec = _single_host_launcher(self.mpiexec)
        self.ipp_cluster: Any = None
        self.client: Any = None
        self.ranks: list[RankInfo] = []
        self.workdir: Path | None = None
        self._pids: set[int] = set()
        self._reaper: subprocess.Popen | None = None

    @property
    def n(self) -> int:
        return self.options.n  # type: ignore[return-value]

    # ----------------------------------------------------------------- start
    def start(self) -> list[RankInfo]:
        """Start controller and engines, wait for all, bootstrap them; on any
        failure stop everything that was started and raise ``ClusterError``.
        Where MPI_Init itself failed before any engine connected, try once more:
        under MPICH's gforker, UCX's address exchange fails MPI_Init at random
        in about one start in 150 here."""
        try:
            return self._start_once()
        except ClusterError as exc:
            if not exc.mpi_init_failed:
                raise
        print("[hvd_notebook] MPI_Init failed on a rank before any engine connected; "
              "starting the ranks once more.", file=sys.stderr, flush=True)
        try:
            return self._start_once()
        except ClusterError as exc:
            if not exc.mpi_init_failed:
                raise
            raise ClusterError(f"MPI_Init failed on a rank in two tries in a row. The second: {exc}",
                               mpi_init_failed=True) from None

    def _start_once(self) -> list[RankInfo]:
        import ipyparallel as ipp
        from traitlets.config import Config

        deadline = time.monotonic() + self.options.timeout
        cluster_id = f"hvd-{os.getpid()}-{int(time.time() * 1000) % 10**8}"
        try:
            controller_ip = self._controller_ip()
        except hostlib.HostError as exc:
            raise ClusterError(str(exc)) from None
        beyond_loopback = controller_ip != "127.0.0.1"
        if self.host_gpus and self.mode == "local":  # GPUs held by other notebooks' clusters are skipped
            try:
                self._lease = leases.acquire(self.host_gpus, self.options.n, f"kernel {os.getpid()}, {cluster_id}")
            except leases.LeaseError as exc:
                raise ClusterError(str(exc)) from None
            self.gpus = self._lease.gpus
            self.options = replace(self.options, n=len(self.gpus))  # a restart of this cluster keeps its shape
        elif self.host_gpus:  # other hosts: the same GPU ids on each (leases cover this host's GPUs only)
            self.gpus = list(self.host_gpus)
        self.workdir = clusters_dir() / cluster_id
        self.workdir.mkdir(mode=0o700)
        # which kernel owns the cluster: `hvd-notebook clean` stops clusters whose kernel is gone
        (self.workdir / OWNER_FILE).write_text(f"{os.getpid()} {psutil.Process().create_time()}")
        cfg = Config()
        cfg.MPILauncher.mpi_cmd = [self.mpiexec]
        # gforker reports each rank's exit code or signal when the world ends
        exitinfo = ["-exitinfo"] if self.mpiexec.endswith("mpiexec.gforker") else []
        cfg.MPILauncher.mpi_args = exitinfo + self._placement_args() + list(self.options.mpi_args)
        defaults = {k: v for k, v in LOOPBACK_ENV.items() if k not in os.environ} if self.mode == "local" else {}
        user_env = dict(self.options.env)
        cfg.MPIEngineSetLauncher.environment = {**defaults, **rank_environment({**os.environ, **user_env}),
                                                **user_env}
        # an idle engine whose controller is gone exits by itself after 7 missed
        # heartbeats (about 25 s), even if the kernel and its watchdog were killed too
        cfg.MPIEngineSetLauncher.engine_args = [f"--IPEngine.max_heartbeat_misses={ENGINE_HEARTBEAT_MISSES}"]
        try:
            self.ipp_cluster = ipp.Cluster(
                engines="mpi",
                n=self.n,
                cluster_id=cluster_id,
                profile_dir=str(self.workdir / "profile"),
                shutdown_atexit=False,  # the session's own atexit stops it, leftovers included
                log_level=logging.ERROR,
                # one host: nothing of the controller listens beyond loopback; several: CurveZMQ always
                controller_ip=controller_ip,
                controller_args=(["--IPController.enable_curve=True"]
                                 if self.options.secure or beyond_loopback else []),
                config=cfg,
            )
            self._start_reaper()
            self.ipp_cluster.start_controller_sync()
            self._pids.add(self.ipp_cluster.controller.pid)
            self._remember_descendants()
            self._start_engines(deadline)
            self._make_files_private()
        except BaseException:
            self.stop()
            raise
        return self.ranks

    def _controller_ip(self) -> str:
        """Loopback on one host; else the address the other hosts reach this one by."""
        if self.mode == "hosts":
            return hostlib.controller_address([h.name for h in self.hosts], self.options.ip)
        if self.mode == "srun":
            return hostlib.controller_address(hostlib.slurm_nodes(), self.options.ip)
        return self.options.ip or "127.0.0.1"

    def _placement_args(self) -> list[str]:
        """The launcher's own options that put the ranks on the hosts."""
        if self.mode == "hosts":
            listed = ",".join(f"{h.name}:{h.slots}" for h in self.hosts)
            if _is_open_mpi(self.mpiexec):
                return ["--host", listed]
            return ["-hosts", listed]
        if self.mode == "srun":
            # MPICH's wheel speaks PMI-2 with Slurm; the ranks inherit the kernel's environment
            return [f"--mpi={os.environ.get('HVD_NOTEBOOK_SRUN_MPI', 'pmi2')}", "--kill-on-bad-exit=1"]
        return []

    def _probe_hosts(self, timeout: float = 30.0) -> list[str]:
        """After a failed launch on several hosts: one trivial rank on each host
        alone, all at once, to tell which hosts fail and why (a host without the
        environment makes hydra fail without naming it)."""
        placement = "--host" if _is_open_mpi(self.mpiexec) else "-hosts"
        env = {**os.environ, **dict(self.options.env)}
        probes = {}
        for host in self.hosts:
            cmd = [self.mpiexec, "-n", "1", placement, f"{host.name}:1", *self.options.mpi_args,
                   sys.executable, "-c", "import ipyparallel, mpi4py.MPI"]
            probes[host.name] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                                 stderr=subprocess.STDOUT, text=True, env=env,
                                                 start_new_session=True)
        deadline = time.monotonic() + timeout
        failed = []
        for name, probe in probes.items():
            try:
                out, _ = probe.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(probe.pid, signal.SIGKILL)
                probe.communicate()
                failed.append(f"host {name} did not answer a test launch within {timeout:g} s")
                continue
            if probe.returncode != 0:
                failed.append(f"host {name} cannot start a rank of this environment: "
                              + (hostlib.diagnose_launch(out) or [hostlib.telling_line(out)])[0])
        return failed

    def _make_files_private(self) -> None:
        """Connection files (they hold the key that signs every message) and the
        rest of the profile: readable by their owner only."""
        for path in (self.workdir / "profile").rglob("*"):
            path.chmod(0o700 if path.is_dir() else 0o600)

    def _start_engines(self, deadline: float) -> None:
        """Launch one mpiexec world, wait until every rank registers, bootstrap it."""
        self.client = self.ipp_cluster.connect_client_sync()
        self.ipp_cluster.start_engines_sync(self.n)
        launcher = self._engine_launcher()
        self._pids.add(launcher.pid)
        self._remember_descendants()
        while True:
            new = set(self.client.ids)
            if len(new) >= self.n:
                break
            code = launcher._popen_process.poll()  # the launcher's own Popen of mpiexec
            if code is not None:
                output = launcher.get_output()
                found = hostlib.diagnose_launch(output)
                if self.mode == "hosts" and not any(c.startswith("host ") for c in found):
                    found += self._probe_hosts()  # the launcher's words name no host: ask each one alone
                causes = "".join(f"\n  - {c}" for c in found)
                name = "srun" if self.mode == "srun" else "mpiexec"
                raise ClusterError(
                    f"{name} exited (code {code}) before all {self.n} engines connected "
                    f"({len(new)} did).{causes}\nCommand: {shlex.join(launcher.args)}\n"
                    f"Last lines of its output:\n{_tail(output)}\n"
                    "Check --mpiexec and --mpi-args, and that this environment's mpi4py "
                    "was built for that MPI.",
                    mpi_init_failed=not new and bool(_MPI_INIT_FAILED.search(output)),
                )
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"Only {len(new)} of {self.n} engines connected within "
                    f"--timeout {self.options.timeout:g} s. Command: {shlex.join(launcher.args)}\n"
                    f"Last lines of mpiexec's output:\n{self.mpiexec_output_tail()}\n"
                    "Raise --timeout on a slow or busy machine, or check the MPI set-up."
                )
            time.sleep(0.05)
        self._remember_descendants()
        self._bootstrap(sorted(new), deadline)

    def _engine_launcher(self) -> Any:
        (launcher,) = self.ipp_cluster.engines.values()
        return launcher

    @staticmethod
    def _read_output(launcher: Any) -> str:
        try:
            return Path(launcher.output_file).read_text(errors="replace")
        except OSError:
            return ""

    def _bootstrap(self, engine_ids: list[int], deadline: float) -> None:
        from ..engine.bootstrap import bootstrap

        view = self.client[engine_ids]
        ar = view.apply_async(bootstrap, self.gpus, self.options.backend, self.ipp_cluster.controller_ip)
        if not ar.wait(max(1.0, deadline - time.monotonic())):
            raise ClusterError(
                f"The engines did not finish setting up (importing TensorFlow, initialising "
                f"MPI) within --timeout {self.options.timeout:g} s. Raise --timeout."
            )
        try:
            results = ar.get()
        except Exception as exc:  # ipyparallel's CompositeError: one entry per failed engine
            ename, evalue, _tb, info = getattr(exc, "elist", [(type(exc).__name__, exc, "", {})])[0]
            raise ClusterError(
                f"Setting up engine {info.get('engine_id', '?')} failed: {ename}: {evalue}"
            ) from None
        infos = [{**res, "engine_id": eid} for eid, res in zip(engine_ids, results)]
        sizes = {i["size"] for i in infos}
        if sizes != {self.n} or sorted(i["rank"] for i in infos) != list(range(self.n)):
            raise ClusterError(
                f"mpiexec started {self.n} processes but they did not form one MPI world of "
                f"{self.n} ranks (they report sizes {sorted(sizes)}). This happens when mpiexec "
                f"({self.mpiexec}) belongs to a different MPI than the one mpi4py was built "
                "for; pass the matching --mpiexec."
            )
        self.ranks = sorted(
            (RankInfo(
                rank=i["rank"], engine_id=i["engine_id"], host=i["host"], pid=i["pid"],
                device=i["device"], local_rank=i["local_rank"], local_size=i["local_size"],
                intra_op_threads=i["intra_op_threads"], inter_op_threads=i["inter_op_threads"],
                backend=i["backend"], ip=i["ip"], here=i["host"] == socket.gethostname(),
            ) for i in infos),
            key=lambda r: r.rank,
        )
        self._pids.update(r.pid for r in self.ranks if r.here)  # a pid on another host is not ours to kill

    def _remember_descendants(self) -> None:
        """Add the children of every known process, and tell the reaper."""
        for pid in list(self._pids):
            try:
                self._pids.update(c.pid for c in psutil.Process(pid).children(recursive=True))
            except psutil.NoSuchProcess:
                pass
        if self.workdir is None:
            return
        lines = []
        for pid in sorted(self._pids):
            try:
                lines.append(f"{pid} {psutil.Process(pid).create_time()}")
            except psutil.NoSuchProcess:
                pass
        tmp = self.workdir / f"{PID_FILE}.tmp"
        tmp.write_text("\n".join(lines))
        tmp.replace(self.workdir / PID_FILE)

    def _start_reaper(self) -> None:
        """A watchdog in its own session that stops this cluster if the kernel is
        killed before its atexit clean-up can run (see ``hvd_notebook.cluster.reaper``)."""
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "hvd_notebook.cluster.reaper", str(os.getpid()), str(self.workdir)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )

    # ----------------------------------------------------------------- state
    @property
    def running(self) -> bool:
        return self.ipp_cluster is not None and self.client is not None and bool(self.ranks)

    def engine_ids(self, ranks: list[int] | None = None) -> list[int]:
        """Engine ids of the given MPI ranks (all ranks when None)."""
        by_rank = {r.rank: r.engine_id for r in self.ranks}
        if ranks is None:
            return [by_rank[r] for r in sorted(by_rank)]
        return [by_rank[r] for r in ranks]

    def pids(self) -> set[int]:
        """Every process of this cluster seen so far (controller, mpiexec, its
        helpers, engines and their nannies, the reaper)."""
        self._remember_descendants()
        return self._pids | ({self._reaper.pid} if self._reaper is not None else set())

    def mpiexec_output_tail(self, lines: int = 20) -> str:
        """The last lines mpiexec and the engines wrote to the launcher's log."""
        if self.ipp_cluster is None or not self.ipp_cluster.engines:
            return _tail("", lines)
        return _tail(self._read_output(self._engine_launcher()), lines)

    def alive(self) -> dict[int, bool]:
        """Per rank: is its engine process still there? (On another host: is its
        engine still registered, i.e. answering the controller's heartbeats?)"""
        out = {}
        registered = set(self.client.ids) if self.client is not None else set()
        for r in self.ranks:
            if not r.here:
                out[r.rank] = r.engine_id in registered
                continue
            try:
                p = psutil.Process(r.pid)
                out[r.rank] = p.is_running() and p.status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                out[r.rank] = False
        return out

    def end_world(self, timeout: float = 2.0) -> None:
        """Kill the ranks still alive (an MPI world cannot go on once one of its
        ranks died) and give mpiexec a moment to report how each one ended."""
        _kill_all({r.pid for r in self.ranks if r.here}, grace=0.0)  # mpiexec ends the ranks elsewhere
        try:
            launcher = self._engine_launcher()
            psutil.Process(launcher.pid).wait(timeout)
        except (psutil.Error, ValueError, AttributeError):
            pass

    def exit_reports(self) -> dict[int, str]:
        """How each rank ended, where the launcher said so (gforker's ``-exitinfo``,
        srun's task errors): rank -> "exit code 7" or "signal Kill"."""
        reports = {}
        for line in self.mpiexec_output_tail(200).splitlines():
            m = re.match(r"\s*\[\d+\](\d+):Return code = (-?\d+)(?:, signaled with (\w+))?", line)
            if m:
                rank, code, sig = int(m.group(1)), int(m.group(2)), m.group(3)
                reports[rank] = f"signal {sig}" if sig else f"exit code {code}"
            m = re.search(r"srun: error: \S+: task (\d+): (?:Exited with exit code (\d+)|(\w[\w ]*))", line)
            if m:
                reports.setdefault(int(m.group(1)), f"exit code {m.group(2)}" if m.group(2) else m.group(3).strip())
        return reports

    # ------------------------------------------------------------------ stop
    def restart(self) -> list[RankInfo]:
        """End everything and start a fresh controller and MPI world of the same
        shape (every rank's state is lost). A fresh controller means no stale
        registrations of the old engines can be mistaken for the new ones."""
        self.stop()
        return self.start()

    def stop(self) -> None:
        """Stop engines and controller, kill by PID whatever of them is still alive,
        and remove the profile directory.

        Every process of the cluster gets SIGTERM at once (ipyparallel's launchers
        would stop them one after the other, 2 s or more each), then SIGKILL after
        a short grace: a kernel being shut down by Jupyter has about 5 s before it
        is killed itself."""
        pids = self.pids()
        if self.client is not None:
            try:
                self.client.close(linger=0)
            except Exception:
                log.debug("closing the client failed", exc_info=True)
            self.client = None
        _kill_all(pids, grace=STOP_GRACE_S)
        if self.ipp_cluster is not None:
            try:  # its processes are gone: this only settles ipyparallel's bookkeeping
                self.ipp_cluster.stop_cluster_sync()
            except Exception:
                log.debug("ipyparallel's stop failed", exc_info=True)
            self.ipp_cluster = None
        self._pids.clear()
        self.ranks = []
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
        if self._reaper is not None:
            self._reaper.kill()
            self._reaper.wait()
            self._reaper = None
        if self._lease is not None:
            self._lease.release()
            self._lease = None


def _kill_all(pids: set[int], grace: float) -> None:
    """SIGTERM every process, SIGKILL those still there after ``grace`` seconds."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)
