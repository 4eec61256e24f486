"""``hvd-notebook run`` (also ``horovodrun``): one MPI world of a script's ranks.

The ranks start as ``%hvd start`` starts engines (the same placement, launcher,
loopback rules and rank environment), the job's exit code is the world's, a rank
that fails is named, and a signal to the command stops every rank. The job keeps a
cluster directory while it runs, as a kernel's cluster does (``hvd-notebook list``
and ``stacks``, the JupyterLab panel), with a reaper that ends its ranks should
this process be killed.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, cast

import psutil

from ...config import ELASTIC_COMMIT_SUMMARY as COMMIT_SUMMARY
from ...config import ELASTIC_DIR, PREFIX, ClusterOptions
from ..errors import ClusterError
from ..node import shm
from ..processes.pids import PidRegistry, alive, kill_all
from ..processes.reaper import start_reaper
from ..processes.workdir import WorkDir, clusters_dir, new_cluster_id
from . import diagnosis
from .launch import world_environment
from .placements import Placement, choose_placement, is_report_line
from .resets import ResetsUsedUp, run_with_resets

STOP_GRACE_S = 3.0  # the launcher ends its ranks (on other hosts too) before those here are killed
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
TRACK_S = 1.0  # how often the job's PID file takes in the processes its launcher started since
# what a launcher does to the other ranks once one has failed: a consequence, not a cause
# (gforker sends SIGINT, then SIGQUIT; a Python rank under SCRIPT_MAIN ends on SIGINT with 130)
ENDED_BY_LAUNCHER = frozenset({"signal Quit", "signal Terminated", "signal Interrupt", "exit code 130"})
SCRIPT_MAIN = "hvd_notebook.engine.script_main"  # run in the ranks, not imported here
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")
_PYTHON_OPTIONS_WITH_VALUE = frozenset({"-W", "-X"})
# how launchers name signals: gforker prints strsignal's words ("Killed"), srun and others the short name ("Kill")
_SIGNALS = {**{signal.strsignal(s) or s.name: int(s) for s in signal.Signals},
            **{s.name.removeprefix("SIG").capitalize(): int(s) for s in signal.Signals}}


@dataclass(frozen=True)
class Job:
    """What ``hvd-notebook run`` was asked for: the command, where its ranks go
    (``options.n`` ranks; ``options.env`` holds the Horovod settings for every rank;
    ``options.host_check_timeout`` bounds the checks before launch) and how much to say."""

    command: tuple[str, ...]
    options: ClusterOptions
    verbose: bool = False


# ------------------------------------------------------------------ the command line of the ranks
def split_python(command: tuple[str, ...]) -> tuple[list[str], list[str]] | None:
    """``python -u train.py a`` as the interpreter with its own options (``python -u``) and what
    it runs (``train.py a``, or ``-m mod ...``, ``-c code ...``); None for any other command, or
    for a Python line this cannot read (options such as ``-uc`` that take what follows).

    Args:
        command: the job's command line.
    """
    if not command or not _PYTHON.fullmatch(Path(command[0]).name):
        return None
    i = 1
    while i < len(command):
        arg = command[i]
        if arg in ("-m", "-c", "-") or not arg.startswith("-"):
            return list(command[:i]), list(command[i:])
        if arg == "--" or (not arg.startswith("--") and arg[-1] in "cm" and len(arg) > 2):
            return None
        i += 2 if arg in _PYTHON_OPTIONS_WITH_VALUE else 1
    return None


def same_environment(program: str) -> bool:
    """Is ``program`` an interpreter of this environment (where hvd_notebook imports)?

    Args:
        program: the command's first word.
    """
    found = shutil.which(program)
    return found is not None and Path(found).absolute().parent == Path(sys.executable).absolute().parent


def fail_fast(command: tuple[str, ...]) -> list[str]:
    """The ranks' command line: a Python script of this environment runs under ``SCRIPT_MAIN``
    (``python -m hvd_notebook.engine.script_main train.py``), so that a rank that raises or exits
    non-zero ends at once with its code instead of waiting in MPI_Finalize for ranks that wait
    for it; the launcher then names it and ends the others.

    Args:
        command: the job's command line.
    """
    split = split_python(command)
    if split is None or not same_environment(command[0]):
        return list(command)
    interpreter, program = split
    if program[0] == "-" or program[:2] in (["-m", "mpi4py"], ["-m", SCRIPT_MAIN]):
        return list(command)  # stdin, or a runner the user chose
    return [*interpreter, "-m", SCRIPT_MAIN, *program]


def check_command(command: tuple[str, ...]) -> None:
    """A clear error, before anything starts, for a command the ranks could not run.

    Args:
        command: the job's command line.
    """
    if not command:
        raise ClusterError("give the command to run after the options, e.g. hvd-notebook run -np 2 python train.py")
    if shutil.which(command[0]) is None:
        raise ClusterError(f"{command[0]}: command not found. Give its full path, or put it on PATH.")
    split = split_python(command)
    if split is not None and split[1][0] not in ("-m", "-c", "-") and not Path(split[1][0]).is_file():
        raise ClusterError(f"{split[1][0]}: no such file (the ranks start in {os.getcwd()}). Check the script's path.")


# ------------------------------------------------------------------ how the job ended
def failed_ranks(reports: dict[int, str]) -> dict[int, str]:
    """The ranks that ended the job: those that failed by themselves, not those the launcher
    stopped because another one failed (all that failed, where the launcher said no more).

    Args:
        reports: rank -> how it ended (``exit_reports``).
    """
    failed = {rank: how for rank, how in reports.items() if how != "exit code 0"}
    causes = {rank: how for rank, how in failed.items() if how not in ENDED_BY_LAUNCHER}
    return causes or failed


def rank_status(how: str) -> int | None:
    """The exit status a shell would report for a rank that ended ``how`` ("exit code 3": 3,
    "signal Killed": 137, "MPI_Abort with code 5": 5); None where that cannot be read.

    Args:
        how: an ``exit_reports`` entry.
    """
    m = re.fullmatch(r"(?:exit code|MPI_Abort with code) (-?\d+)", how)
    if m:
        return int(m.group(1)) & 0xFF
    number = _SIGNALS.get(diagnosis.signal_name(how) or "")
    return 128 + number if number else None


def exit_status(code: int, failed: dict[int, str]) -> int:
    """The job's exit code: that of the first rank that failed, where the launcher said how it
    ended; else the launcher's (1 where it said 0 although a rank failed; 128+N where the
    launcher itself was killed by signal N).

    Args:
        code: the launcher's exit code.
        failed: rank -> how it ended, for the ranks that failed.
    """
    for rank in sorted(failed):
        status = rank_status(failed[rank])
        if status:
            return status
    if code < 0:
        return 128 - code
    return 1 if code == 0 and failed else code


def ending_message(launcher: str, code: int, reports: dict[int, str], causes: list[str]) -> str | None:
    """What the job's end says to the user (None for a job whose every rank succeeded).

    Args:
        launcher: the launcher's name.
        code: its exit code.
        reports: rank -> how it ended.
        causes: ``diagnose``'s sentences.
    """
    failed = failed_ranks(reports)
    status = exit_status(code, failed)
    if status == 0:
        return None
    if failed:
        named = ", ".join(f"rank {rank} ({how})" for rank, how in sorted(failed.items()))
        return f"{PREFIX} {named} failed; every rank was stopped. Exit code {status}."
    listed = "".join(f"\n  - {c}" for c in causes)
    return f"{PREFIX} {launcher} exited with code {status}.{listed}"


# ------------------------------------------------------------------ the running job
TAIL_CHARS = 64 * 1024  # how much of the launcher's output ``diagnosis`` reads afterwards


class StderrPump(threading.Thread):
    """Copies the launcher's stderr (or stdout) to ours as it comes (a partial line too: progress bars),
    keeping back its reports for ``Placement.rank_exits`` where ``hold_back`` (gforker's exit lines), and
    remembers what ``diagnosis`` and the placement read afterwards.

    Args:
        stream: the launcher's stderr (or stdout).
        sink: where it is copied to.
        hold_back: keep the launcher's report lines from ``sink``.
    """

    def __init__(self, stream: IO[bytes], sink: IO[bytes], hold_back: bool = True) -> None:
        super().__init__(daemon=True)
        self._stream, self._sink, self._hold_back = stream, sink, hold_back
        self._exit_lines: list[str] = []
        self._tail: deque[str] = deque()  # what was shown, in pieces as they came (a line may come in many)
        self._tail_chars = 0

    def run(self) -> None:
        try:
            self._pump()
        except BrokenPipeError:  # (our reader left, e.g. ``| head``: the launcher's next write fails, as unpumped)
            self._stream.close()

    def _pump(self) -> None:
        pending, line_start = b"", True
        while chunk := os.read(self._stream.fileno(), 65536):
            *lines, pending = (pending + chunk).split(b"\n")
            shown = b"".join(self._keep(line + b"\n", line_start or i > 0) for i, line in enumerate(lines))
            line_start = line_start or bool(lines)
            if pending and not (self._hold_back and line_start and pending.startswith(b"[")):  # no report: show it
                shown += self._keep(pending, False)
                pending, line_start = b"", False
            self._write(shown)
        self._write(self._keep(pending, line_start) if pending else b"")

    def _keep(self, piece: bytes, line_start: bool) -> bytes:
        """Remember ``piece``; what of it to show (nothing for an exit line)."""
        text = piece.decode(errors="replace")
        if self._hold_back and line_start and is_report_line(text):
            self._exit_lines.append(text)
            return b""
        self._tail.append(text)
        self._tail_chars += len(text)
        while self._tail_chars > TAIL_CHARS and len(self._tail) > 1:
            self._tail_chars -= len(self._tail.popleft())
        return piece

    def _write(self, data: bytes) -> None:
        if data:
            self._sink.write(data)
            self._sink.flush()

    def output(self) -> str:
        """The exit lines, then the last of what was shown."""
        return "".join(self._exit_lines) + "".join(self._tail)


class Stopped(Exception):
    """A signal asked the job to stop.

    Args:
        signum: the signal's number.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP raise ``Stopped`` in the main thread while this is open."""

    def handler(signum: int, _frame: object) -> None:
        raise Stopped(signum)

    previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@contextmanager
def job_directory(job: Job) -> Iterator[WorkDir]:
    """The job's cluster directory, owned by this process, with its command line; and its reaper, which
    ends every process the directory lists should this process be killed. Both gone at the end.

    Args:
        job: the job.
    """
    workdir = WorkDir.create(new_cluster_id(), job=shlex.join(job.command))
    reaper = start_reaper(workdir)
    try:
        yield workdir
    finally:
        reaper.kill()
        reaper.wait()
        workdir.remove()


class RunningJob:
    """The launcher of one world, in a session of its own so that its process group holds
    every rank started here: nothing is left of it when it ends or is stopped. The job's
    directory lists the launcher and its descendants, at most ``TRACK_S`` late.

    Args:
        argv: the launcher's command line.
        env: its environment.
        workdir: the job's cluster directory.
    """

    def __init__(self, argv: list[str], env: dict[str, str], workdir: WorkDir) -> None:
        self.process = subprocess.Popen(argv, env={**os.environ, **env}, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
        self.pump = StderrPump(self.process.stderr, sys.stderr.buffer)  # type: ignore[arg-type]
        self.pump.start()
        # (shown as it comes: hydra says how each rank ended on its stdout, ``Placement.rank_exits`` reads it)
        self.stdout_pump = StderrPump(self.process.stdout, sys.stdout.buffer, hold_back=False)  # type: ignore[arg-type]
        self.stdout_pump.start()
        self.shm_watch = shm.StartWatch.for_launch(self.process.pid, argv, self._refuse)
        self._pids = PidRegistry()
        self._pids.workdir = workdir
        self._pids.add(self.process.pid)
        self._ended = threading.Event()
        self._tracker = threading.Thread(target=self._track, daemon=True)
        self._tracker.start()

    def _track(self) -> None:
        try:
            while not self._ended.wait(TRACK_S):
                self._pids.remember_descendants()
        except OSError:
            pass  # the job's directory is gone: the job is ending

    def _refuse(self, message: str) -> None:
        """A rank has another user's shared memory (``shm.StartWatch``): say so, and end the world."""
        print(f"{PREFIX} {message}", file=sys.stderr, flush=True)
        self._kill_group()

    def wait(self) -> int:
        """Wait for the launcher to exit; end whatever it left behind; its exit code."""
        # exited but not reaped: its process group id cannot be reused while the sweep runs
        os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOWAIT)
        return self._finish()

    def stop(self) -> int:
        """Stop the world: the launcher first (it ends ranks on other hosts too), then every
        process of it still here. Further signals are ignored until it is done."""
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        try:
            ranks = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            ranks = []
        self.process.send_signal(signal.SIGTERM)
        if not self._exited_within(STOP_GRACE_S):
            self._kill_group()
        kill_all([r for r in ranks if alive(r)], grace=0.5)  # any that left the launcher's group
        return self._finish()

    def _exited_within(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        try:
            while os.waitid(os.P_PID, self.process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
        except ChildProcessError:
            pass  # already reaped
        return True

    def _kill_group(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the group is empty: nothing was left

    def _finish(self) -> int:
        self._ended.set()
        self._tracker.join()
        self._kill_group()
        self.shm_watch.stop()
        code = self.process.wait()
        self.pump.join(timeout=5)
        self.stdout_pump.join(timeout=5)
        self.shm_watch.remove_world()
        shm.remove_orphaned()  # (what ranks ended without MPI_Finalize left in /dev/shm)
        return code


def prepare(job: Job) -> tuple[Placement, list[str], dict[str, str]]:
    """The placement, the launcher's command line and the ranks' environment; a ClusterError
    saying what to change where any of them cannot work.

    Args:
        job: the job.
    """
    check_command(job.command)
    placement = choose_placement(job.options)
    n = placement.ranks([])  # a script pins its own GPU by hvd.local_rank(), as under horovodrun
    placement.check_room(n)
    placement.preflight(job.options.host_check_timeout)
    env = world_environment(placement)
    return placement, placement.command_line(n, list(env), list(fail_fast(job.command))), env


class _FailedAfterCommit(Exception):
    """A launch of the job that failed after rank 0's ``hvd.elastic`` commit: a new launch resumes from it."""

    def __init__(self, code: int, output: str) -> None:
        super().__init__(f"exit code {code}")
        self.code, self.output = code, output


def _launch_once_more_after_mpi_init(argv: list[str], env: dict[str, str], workdir: WorkDir) -> tuple[int, str]:
    """``_launch``, started again where MPI_Init failed before the script ran: the runner initialises MPI
    before the script (``SCRIPT_MAIN``), so none of its code has run yet."""
    def init_failed(ended: tuple[int, str]) -> bool:
        code, output = ended
        return bool(code) and diagnosis.mpi_init_failed(output) and SCRIPT_MAIN in argv

    return diagnosis.tries_where_mpi_init_fails(lambda: _launch(argv, env, workdir), init_failed, "the script started")


def _launch(argv: list[str], env: dict[str, str], workdir: WorkDir) -> tuple[int, str]:
    """Run the launcher to its end: its exit code and output; ``Stopped`` once every rank is ended."""
    running = None
    with stop_on_signals():
        try:
            running = RunningJob(argv, env, workdir)
            return running.wait(), running.pump.output() + running.stdout_pump.output()
        except Stopped:
            if running is not None:
                running.stop()
            raise


def run_job(job: Job) -> int:
    """Run ``job`` to its end (or until a signal stops it); its exit code. Call from the main thread.
    A job that fails after ``hvd.elastic`` committed is launched again, up to ``options.max_resets``
    times: its ``hvd.elastic.run`` resumes from rank 0's last commit (kept in a folder of the job's).

    Args:
        job: the job.
    """
    with ExitStack() as held:
        elastic = held.enter_context(tempfile.TemporaryDirectory(prefix=f"elastic-{os.getpid()}-", dir=clusters_dir()))
        job = replace(job, options=replace(job.options, env=(*job.options.env, (ELASTIC_DIR.name, elastic))))
        placement, argv, env = prepare(job)
        workdir = held.enter_context(job_directory(job))  # (once the job is known to be launchable)
        if job.verbose:
            added = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
            print(f"{PREFIX} {placement.launcher_name} ({placement.command})\n  environment: {added}\n"
                  f"  command: {shlex.join(argv)}", file=sys.stderr, flush=True)
        commit = Path(elastic) / COMMIT_SUMMARY

        def attempt() -> tuple[int, str]:
            code, output = _launch_once_more_after_mpi_init(argv, env, workdir)
            if code and commit.exists():  # (a failure that a new launch resumes from the commit)
                raise _FailedAfterCommit(code, output)
            return code, output

        def reset(failure: BaseException, number: int) -> str:
            ended = cast(_FailedAfterCommit, failure)  # (the only failure ``resumable`` lets through)
            failed = failed_ranks(placement.exit_reports(ended.output))
            why = "; ".join(f"rank {rank}: {how}" for rank, how in sorted(failed.items())) or f"exit code {ended.code}"
            print(f"{PREFIX} the job failed ({why}); launching it again from rank 0's last hvd.elastic "
                  f"commit ({commit.read_text().strip()}): reset {number} of {job.options.max_resets}.",
                  file=sys.stderr, flush=True)
            return why

        try:  # a job that failed after an hvd.elastic commit is launched again (the session's loop)
            code, output = run_with_resets(attempt, lambda failure: isinstance(failure, _FailedAfterCommit), reset,
                                           job.options.max_resets)
        except (_FailedAfterCommit, ResetsUsedUp) as failed:
            last = cast(_FailedAfterCommit, failed.failure if isinstance(failed, ResetsUsedUp) else failed)
            code, output = last.code, last.output
        except Stopped as stop:
            print(f"{PREFIX} stopped by {stop}; every rank was ended.", file=sys.stderr, flush=True)
            return 128 + stop.signum
    reports = placement.exit_reports(output)
    causes = placement.diagnose(output) if code and not failed_ranks(reports) else []
    message = ending_message(placement.launcher_name, code, reports, causes)
    if message:
        print(message, file=sys.stderr, flush=True)
    return exit_status(code, failed_ranks(reports))
