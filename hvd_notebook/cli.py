"""``hvd-notebook``: the command line beside the magics.

    hvd-notebook list             this user's clusters, with the kernel that owns each
    hvd-notebook list --all       every user's clusters and GPU leases on this node (from the
                                  node's register: who, which GPUs, since when, idle for how long)
    hvd-notebook list             ... and the suspended ones (since when, ranks, size on disk)
    hvd-notebook delete ID        throw a suspended cluster's saved state away
    hvd-notebook clean            stop this user's orphaned clusters (their kernel is gone), remove suspended
                                  ones older than the node's suspended_ttl
    hvd-notebook clean --dry-run  only say what would be stopped
    hvd-notebook clean --user U   (root) stop user U's orphaned clusters
    hvd-notebook install-kernel [--user | --sys-prefix | --prefix P] [--name N] [--env K=V ...]
                                  install the "Python 3 (hvd_notebook)" kernelspec
    hvd-notebook setup-node [--gpus 0,1,2]
                                  (root, at install) make the node's lease folder: root's, a
                                  lock file per GPU, and the register of clusters
    hvd-notebook stacks [CLUSTER] [--all-threads]
                                  every rank's Python stack now (this host's ranks of every
                                  cluster and hvd-notebook run job, or of CLUSTER), even in MPI
    hvd-notebook run -np 4 [-H host1:2,host2:2 | --hostfile F] python train.py
                                  launch a script on 4 ranks, as horovodrun does; installed
                                  under the name ``horovodrun`` (a link), it answers to that

A cluster lives in its own directory in the user's private folder
(``private.base_dir()``: owner only, checked), which records the kernel that
started it and every process of the cluster with its start time; ``clean``
kills only this user's processes that are still the ones recorded (a reused
PID is left alone). ``clean --user U`` runs as U (root forks and becomes U), so
nothing U wrote can make it act on what is not U's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pwd
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from . import scaling
from .cluster.errors import ClusterError
from .cluster.finding import clean_own, delete_suspended, describe_suspended, find_clusters, own_cluster_dirs
from .cluster.launching.run import Job, run_job
from .cluster.launching.suspension import find_suspended
from .cluster.node import leases, queue, registry
from .cluster.node.gpus import detect_gpus
from .cluster.node.privileges import as_user
from .cluster.processes import stacks
from .cluster.processes.workdir import clusters_dir
from .commands import CLI, add_commands
from .config import (
    CYCLE_TIME,
    FUSION_THRESHOLD,
    KERNEL_NAME,
    STALL_CHECK_DISABLE,
    STALL_CHECK_TIME,
    STALL_SHUTDOWN_TIME,
    TIMELINE,
    TIMELINE_MARK_CYCLES,
    ClusterOptions,
    at_least,
    env_pair,
    positive_int,
    seconds,
)
from .dashboard.formatting import text_table
from .engine import scaling_worker


def format_node(cards: list[registry.Card], held: dict[str, tuple[int, str]], now: float,
                waiting: list[queue.Entry] | None = None) -> str:
    """``list --all``: a row per cluster of the node's register, then its GPUs' leases (``held``:
    ``leases.holders()``, who holds each as the lock table and the holder's process say), then the starts
    waiting in the node's queue for GPUs.

    Args:
        cards: the register's cards.
        held: GPU -> (holder's PID, who it is), from ``leases.holders()``.
        now: the time, as ``time.time()``.
        waiting: the queue, in the order it serves (``queue.look().line``).
    """
    rows = [("user", "cluster", "kernel", "ranks", "GPUs", "since", "idle")]
    for c in cards:
        alive = c.kernel_alive
        idle = "busy (a cell runs)" if c.busy and alive else "-" if not alive else _ago(now - c.last_cell)
        rows.append((c.user, c.cluster, f"{c.kernel} ({'running' if alive else 'gone: hvd-notebook clean'})",
                     str(c.ranks), ",".join(c.gpus) or "-", time.strftime("%m-%d %H:%M", time.localtime(c.started)),
                     idle))
    table = text_table(rows)
    leased = "; ".join(f"GPU {gpu}: {who or f'pid {pid}'}" for gpu, (pid, who) in sorted(held.items()))
    line = "; ".join(f"{place}. {e.user} (kernel {e.pid}) wants {e.gpus} since "
                     f"{time.strftime('%H:%M:%S', time.localtime(e.since))}"
                     for place, e in enumerate(waiting or (), start=1))
    return ((table if cards else "No clusters on this node.") + f"\nGPU leases: {leased or 'none held'}"
            + (f"\nWaiting for GPUs: {line}" if line else ""))


def _ago(seconds: float) -> str:
    minutes = int(max(0.0, seconds) // 60)
    return f"{minutes // 60} h {minutes % 60} min" if minutes >= 60 else f"{minutes} min"


def kernel_source() -> Path:
    """The kernelspec shipped with the package: ``kernels/hvd-tensorflow`` of the
    source tree (editable installs), else the copy a wheel puts under the prefix."""
    for candidate in (Path(__file__).resolve().parent.parent / "kernels" / KERNEL_NAME,
                      Path(sys.prefix) / "share" / "jupyter" / "kernels" / KERNEL_NAME):
        if (candidate / "kernel.json").exists():
            return candidate
    raise SystemExit(f"hvd-notebook: the {KERNEL_NAME} kernelspec is not installed with this package.")


def install_kernel(name: str, display_name: str | None, env: list[tuple[str, str]], prefix: str | None) -> Path:
    """Install the kernelspec (this Python, the extension preloaded, ``env`` set) under ``prefix``, else the user's.

    Args:
        name: the kernelspec's name.
        display_name: the name Jupyter shows, or None.
        env: variables the kernel gets.
        prefix: the install prefix, or None for the user's.
    """
    from jupyter_client.kernelspec import KernelSpecManager

    with tempfile.TemporaryDirectory() as tmp:
        spec_dir = Path(tmp) / name
        shutil.copytree(kernel_source(), spec_dir)
        spec = json.loads((spec_dir / "kernel.json").read_text())
        spec["argv"][0] = sys.executable  # the environment that has hvd_notebook, not whatever "python" is
        if display_name:
            spec["display_name"] = display_name
        spec.setdefault("env", {}).update(env)
        (spec_dir / "kernel.json").write_text(json.dumps(spec, indent=2) + "\n")
        return Path(KernelSpecManager().install_kernel_spec(str(spec_dir), kernel_name=name, user=prefix is None,
                                                            prefix=prefix))


def print_stacks(cluster: str | None, all_threads: bool, timeout: float) -> int:
    """``stacks``: every registered rank's stack (of ``cluster`` only where named); 1 where none answered.

    Args:
        cluster: the cluster's id, or None for all.
        all_threads: show every thread.
        timeout: seconds to wait for each rank.
    """
    pids = stacks.registered_pids()
    if cluster is not None:
        found = [c for c in find_clusters() if c.path.name == cluster]
        if not found:
            names = ", ".join(c.path.name for c in find_clusters()) or "none"
            print(f"hvd-notebook stacks: no cluster {cluster!r} (this user's clusters: {names}).", file=sys.stderr)
            return 2
        pids = [p for p in pids if p in set(found[0].live_pids)]
    if not pids:
        print("hvd-notebook stacks: no rank of this user runs on this host (ranks on other hosts answer there).",
              file=sys.stderr)
        return 1
    print(stacks.format_stacks(stacks.collect(pids, timeout), all_threads))
    return 0


# ------------------------------------------------------------------ run (horovodrun)
HOROVODRUN = "horovodrun"
LOG_LEVELS = ("TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL")  # horovodrun's --log-level
LOG_LEVEL_VARIABLE = "HOROVOD_LOG_LEVEL"  # read by a real Horovod only: the built-in runtime logs warnings
UNSUPPORTED = ("Horovod's options for Gloo, autotuning, ssh, network interfaces, and elastic training's host "
               "discovery and sizes (--min-np, --max-np, --host-discovery-script) are not supported")
NEGATIVE = "{value} is negative; give 0 or more"


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """``horovodrun``'s common options (same spellings), then hvd-notebook's own launcher options: those of
    ``ClusterOptions`` that a job takes, as ``RunSpelling`` spells them, and the Horovod settings.

    Args:
        parser: the ``run`` subcommand's parser.
    """
    launcher = parser.add_argument_group("hvd-notebook's launcher options (as %hvd start's)")
    ClusterOptions.add_arguments(parser, run=True, launcher_group=launcher)
    parser.add_argument("--disable-cache", action="store_true",
                        help="accepted for horovodrun's sake: the host checks are never cached here, they run "
                        "every time")
    parser.add_argument("--verbose", action="store_true", help="print the launcher, its command line and the "
                        "environment the ranks get")
    tunables = parser.add_argument_group("Horovod settings, passed to every rank as HOROVOD_* variables")
    tunables.add_argument("--fusion-threshold-mb", type=at_least(0, NEGATIVE), metavar="MB",
                          help="fusion buffer size in MiB (0: no fusion); sets HOROVOD_FUSION_THRESHOLD in bytes")
    tunables.add_argument("--cycle-time-ms", type=at_least(0, NEGATIVE, float), metavar="MS",
                          help="how long an agreement round waits for more calls, to agree on and fuse them "
                          "together (sets HOROVOD_CYCLE_TIME; default 0: at once)")
    tunables.add_argument("--timeline-filename", metavar="FILE", help="record a timeline (sets HOROVOD_TIMELINE)")
    tunables.add_argument("--timeline-mark-cycles", action="store_true",
                          help="mark agreement rounds on the timeline (HOROVOD_TIMELINE_MARK_CYCLES)")
    tunables.add_argument("--no-stall-check", action="store_true",
                          help="no stall warnings (HOROVOD_STALL_CHECK_DISABLE)")
    tunables.add_argument("--stall-check-warning-time-seconds", type=at_least(0, NEGATIVE), metavar="S",
                          help="seconds before a stall warning (HOROVOD_STALL_CHECK_TIME_SECONDS)")
    tunables.add_argument("--stall-check-shutdown-time-seconds", type=at_least(0, NEGATIVE), metavar="S",
                          help="seconds before a stalled collective raises (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS)")
    tunables.add_argument("--log-level", choices=LOG_LEVELS, help="passed on as HOROVOD_LOG_LEVEL for a real "
                          "Horovod; the built-in runtime prints warnings only")
    parser.add_argument("program", metavar="command", nargs=argparse.REMAINDER,
                        help="the command every rank runs, e.g. python train.py")


def horovod_environment(args: argparse.Namespace) -> dict[str, str]:
    """The HOROVOD_* variables that ``args``' Horovod settings give every rank (as horovodrun sets them).

    Args:
        args: the parsed ``run`` line.
    """
    env = {}
    if args.fusion_threshold_mb is not None:
        env[FUSION_THRESHOLD.name] = str(args.fusion_threshold_mb * 1024 * 1024)
    if args.cycle_time_ms is not None:
        env[CYCLE_TIME.name] = f"{args.cycle_time_ms:g}"
    if args.timeline_filename:
        env[TIMELINE.name] = args.timeline_filename
        if args.timeline_mark_cycles:
            env[TIMELINE_MARK_CYCLES.name] = "1"
    if args.no_stall_check:
        env[STALL_CHECK_DISABLE.name] = "1"
    if args.stall_check_warning_time_seconds is not None:
        env[STALL_CHECK_TIME.name] = str(args.stall_check_warning_time_seconds)
    if args.stall_check_shutdown_time_seconds is not None:
        env[STALL_SHUTDOWN_TIME.name] = str(args.stall_check_shutdown_time_seconds)
    if args.log_level:
        env[LOG_LEVEL_VARIABLE] = args.log_level
    return env


def job_from_arguments(args: argparse.Namespace) -> Job:
    """The job a parsed ``run`` line asks for; a ClusterError where it cannot be run.

    Args:
        args: the parsed ``run`` line.
    """
    if args.n is None:
        raise ClusterError("give the number of ranks with -np, e.g. -np 2")
    if args.timeline_mark_cycles and not args.timeline_filename:
        raise ClusterError("--timeline-mark-cycles marks a timeline: give --timeline-filename FILE too")
    options = dataclasses.replace(ClusterOptions.from_arguments(args), env=tuple(horovod_environment(args).items()))
    return Job(tuple(args.program), options, verbose=args.verbose)


def run_command(args: argparse.Namespace, unknown: list[str], prog: str) -> int:
    """``run``: the job's exit code; 2 with a message for a line that cannot be run.

    Args:
        args: the parsed ``run`` line.
        unknown: the words the parser did not take.
        prog: the program's name, for messages.
    """
    try:
        if unknown:
            raise ClusterError(f"{unknown[0]}: not an option of {prog} (see {prog} --help). {UNSUPPORTED}.")
        return run_job(job_from_arguments(args))
    except ClusterError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2


def scaling_command(args: argparse.Namespace) -> int:
    """``scaling``: the points measured and projected (``scaling.run``); 2 with a message for bad input.

    Args:
        args: the parsed ``scaling`` line.
    """
    gpus = len(detect_gpus())
    try:
        ranks = scaling.ranks_list(args.ranks or str(gpus or 2))
        links = scaling.Links(**{f.name: getattr(args, f.name) for f in dataclasses.fields(scaling.Links)})
        model = args.model or ("resnet50" if gpus else "mlp")
        return scaling.run(ranks, model, args.batch or (64 if gpus else 32), args.steps, args.rounds, links,
                           ClusterOptions(), args.out)
    except (ValueError, ClusterError) as exc:
        print(f"hvd-notebook scaling: {exc}", file=sys.stderr)
        return 2


def build_parser() -> argparse.ArgumentParser:
    """The ``hvd-notebook`` command line, with one subcommand each."""
    parser = argparse.ArgumentParser(prog="hvd-notebook",
                                     description="Manage this user's hvd_notebook clusters; run scripts on N ranks.")
    sub = parser.add_subparsers(dest="command", required=True)
    add_commands(sub, CLI, own={"list": _list_arguments, "clean": _clean_arguments, "stacks": _stacks_arguments,
                                "install-kernel": _install_kernel_arguments, "setup-node": _setup_node_arguments,
                                "scaling": _scaling_arguments, "run": add_run_arguments},
                 parser_kwargs={"scaling": {"description": scaling.__doc__.split("\n\n")[0].replace("``", "")},
                                "run": {"allow_abbrev": False, "description": "Launch a command on N ranks, as "
                                        "horovodrun does, placed as %hvd start places engines."}})
    return parser


def _list_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--all", action="store_true", help="every user's clusters and GPU leases on this node "
                        "(from the node's register; nobody's files are read)")


def _clean_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="say what would be stopped, stop nothing")
    parser.add_argument("--user", metavar="U", help="(root only) stop user U's orphaned clusters")


def _stacks_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("cluster", nargs="?", help="only this cluster's ranks (a name that hvd-notebook list shows)")
    parser.add_argument("--timeout", type=seconds, default=2.0, metavar="S",
                        help="seconds to wait for the ranks' answers (default 2)")


def _install_kernel_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="for this user only (the default)")
    where.add_argument("--sys-prefix", action="store_true", help="into this environment (sys.prefix)")
    where.add_argument("--prefix", help="under this prefix (PREFIX/share/jupyter/kernels)")
    parser.add_argument("--name", default=KERNEL_NAME, help=f"kernelspec name (default {KERNEL_NAME})")
    parser.add_argument("--display-name", help="name shown in the launcher (default: Python 3 (hvd_notebook))")
    parser.add_argument("--env", action="append", default=[], metavar="K=V", type=env_pair,
                        help="environment variable for the kernel, e.g. HVD_NOTEBOOK_GPUS=0,1 (repeatable)")


def _setup_node_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", metavar="0,1,...", help="the node's GPU ids (default: HVD_NOTEBOOK_GPUS, else "
                        "those nvidia-smi lists)")


def _scaling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--ranks", default=None, metavar="N|1,2,...",
                        help="ranks to measure: N (1, 2, 4 .. N) or a list (default: one per GPU, else 2)")
    parser.add_argument("--model", default=None, choices=scaling_worker.MODELS,
                        help="the model (default: resnet50 on GPUs, needing torchvision; mlp on CPUs)")
    parser.add_argument("--batch", type=positive_int, default=None, help="images per rank (default 64; 32 on CPUs)")
    parser.add_argument("--steps", type=positive_int, default=20, help="timed steps per block (default 20)")
    parser.add_argument("--rounds", type=positive_int, default=3,
                        help="blocks of steps per method, alternating (default 3)")
    for link in dataclasses.fields(scaling.Links):
        parser.add_argument(f"--{link.name.replace('_', '-')}", type=type(link.default), default=link.default,
                            metavar="X", help=f"projection: {link.metadata['help']} (default {link.default:g})")
    parser.add_argument("--out", type=Path, metavar="FILE.json", help="also write every figure to this file")


def main(argv: list[str] | None = None) -> int:
    """The ``hvd-notebook`` command (``commands.COMMANDS`` lists its subcommands); under the name ``horovodrun``
    (a link to this command) it is ``hvd-notebook run``.

    Args:
        argv: the arguments after the program's name (None: ``sys.argv[1:]``).

    Returns:
        The exit status: 0 on success; 2 for input that cannot be run (with a message on stderr); a job's own
        exit status for ``run``.

    Raises:
        SystemExit: argparse's, for a line that does not parse (after printing its usage).
    """
    if argv is None and Path(sys.argv[0]).name == HOROVODRUN:
        parser = argparse.ArgumentParser(prog=HOROVODRUN, allow_abbrev=False,
                                         description="hvd-notebook run, under horovodrun's name: launch a command "
                                         "on N ranks.")
        add_run_arguments(parser)
        args, unknown = parser.parse_known_args(sys.argv[1:])
        return run_command(args, unknown, HOROVODRUN)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command == "run":  # (the command's own arguments follow it)
        return run_command(args, unknown, "hvd-notebook run")
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return HANDLERS[args.command](args)


def install_kernel_command(args: argparse.Namespace) -> int:
    """``install-kernel``: the kernelspec installed where ``args`` say.

    Args:
        args: the parsed ``install-kernel`` line.
    """
    prefix = sys.prefix if args.sys_prefix else args.prefix
    path = install_kernel(args.name, args.display_name, args.env, prefix)
    print(f"Installed kernelspec {args.name} in {path}")
    return 0


def list_command(args: argparse.Namespace) -> int:
    """``list``: this user's clusters (``--all``: the node's register, every user's).

    Args:
        args: the parsed ``list`` line.
    """
    if args.all:
        try:
            print(format_node(registry.read_all(strict=True), leases.holders(), time.time(), queue.look().line))
        except leases.LeaseError as exc:
            print(f"hvd-notebook list --all: {exc}", file=sys.stderr)
            return 2
        return 0
    clusters, suspended = find_clusters(), find_suspended()
    if not clusters and not suspended:
        print(f"No clusters in {clusters_dir()}.")
    for c in clusters:
        print(c.describe())
    for s in suspended:
        print(describe_suspended(s))
    return 0


def delete_command(args: argparse.Namespace) -> int:
    """``delete ID``: a suspended cluster's saved state thrown away; 2 with a message where it cannot be.

    Args:
        args: the parsed ``delete`` line.
    """
    try:
        print(delete_suspended(args.id))
    except (ClusterError, OSError) as exc:
        print(f"hvd-notebook delete: {exc}", file=sys.stderr)
        return 2
    return 0


def clean_command(args: argparse.Namespace) -> int:
    """``clean``: this user's orphaned clusters stopped (``--user U``, root only: U's, as U).

    Args:
        args: the parsed ``clean`` line.
    """
    if args.user:
        if os.geteuid() != 0:
            print(f"hvd-notebook clean --user {args.user}: only root may stop another user's clusters; as "
                  "yourself, run hvd-notebook clean.", file=sys.stderr)
            return 2
        try:
            pwd.getpwnam(args.user)
        except KeyError:
            print(f"hvd-notebook clean --user {args.user}: no such user on this node.", file=sys.stderr)
            return 2
        # as that user, not as root: nothing they wrote can make root kill or remove what is not theirs
        return as_user(args.user, lambda: clean_own(args.dry_run, own_cluster_dirs()))
    return clean_own(args.dry_run, [clusters_dir()])


HANDLERS: dict[str, Callable[[argparse.Namespace], int]] = {
    "list": list_command,
    "clean": clean_command,
    "delete": delete_command,
    "install-kernel": install_kernel_command,
    "stacks": lambda args: print_stacks(args.cluster, args.all_threads, args.timeout),
    "setup-node": lambda args: leases.setup_node_command(args.gpus),
    "scaling": lambda args: scaling_command(args),
    "run": lambda args: run_command(args, [], "hvd-notebook run"),
}  # the handler of each hvd-notebook command (``commands.COMMANDS``), by name


if __name__ == "__main__":
    sys.exit(main())
