"""Every setting of hvd_notebook, declared once: its default, its help, and the
flag or environment variable that sets it.

Two kinds of settings:

- ``%hvd start`` options are the fields of ``ClusterOptions``; each field's
  metadata carries its command-line flag and help, and ``add_arguments``
  builds the ``argparse`` options from them (``%hvd restart`` reuses the
  options object).
- Environment variables are ``EnvSetting`` objects below, read where they
  act; ``EnvSetting.flag`` is the one parser of boolean flags.

This module imports nothing of the package, so every layer may use it.
"""

from __future__ import annotations

import argparse
import enum
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

PREFIX = "[hvd_notebook]"  # the start of every line hvd_notebook itself prints (a tool's usage errors: its name)
WARNING_PREFIX = f"{PREFIX} WARNING"  # rank-side warnings; the kernel shows them from every rank
KERNEL_NAME = "hvd-tensorflow"  # the kernelspec the package ships (kernels/) and install-kernel installs
START_TIMEOUT_S = 120.0  # %hvd start --timeout: how long the engines may take to connect and set up
HOST_CHECK_TIMEOUT_S = 30.0  # hvd-notebook run --start-timeout (horovodrun's default): the checks of the hosts
DEFAULT_RANKS_WITHOUT_GPU = 2

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")

_Member = TypeVar("_Member", bound=enum.Enum)


class Backend(enum.StrEnum):
    """Which module cells call ``hvd``."""

    AUTO = "auto"  # a real horovod.tensorflow where it imports, else BUILTIN
    BUILTIN = "builtin"  # hvd_notebook.runtime
    HOROVOD = "horovod"


class Framework(enum.StrEnum):
    """Which framework's ``hvd`` cells get (the other is never imported on the ranks)."""

    AUTO = "auto"  # TensorFlow where it is installed, else PyTorch
    TENSORFLOW = "tensorflow"  # horovod.tensorflow's API (hvd_notebook.runtime), Keras' fit on the dashboard
    TORCH = "torch"  # horovod.torch's API (hvd_notebook.runtime.torch), torch.distributed's default group


class Standby(enum.StrEnum):
    """Whether a cluster keeps a warm standby world for its restarts (``--standby``)."""

    AUTO = "auto"  # on for ranks on this host where its memory allows (cluster.launching.standby.wanted)
    ON = "on"
    OFF = "off"


class DashboardMode(enum.StrEnum):
    """What a ``%%hvd`` cell shows while fit/evaluate/predict run."""

    AUTO = "auto"  # widgets under a Jupyter server, else text
    WIDGETS = "widgets"
    TEXT = "text"
    NONE = "none"


def choices(kind: type[enum.Enum]) -> list[str]:
    """An enum's values, for argparse's ``choices`` and for error messages.

    Args:
        kind: the enum.
    """
    return [m.value for m in kind]


def parse_choice(kind: type[_Member], text: Any, complaint: str, error: type[Exception] = ValueError) -> _Member:
    """``kind``'s member named by ``text``, else ``error(complaint)``: the enum's own ValueError would only
    say that the text is not one of them, not which option it came from.

    Args:
        kind: the enum.
        text: the value given.
        complaint: the error's message.
        error: the error's type.
    """
    try:
        return kind(text)
    except ValueError:
        raise error(complaint) from None


@dataclass(frozen=True)
class EnvSetting:
    """An environment variable the package reads, with its default and what it does."""

    name: str
    default: Any
    help: str

    def text(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The variable's value, else the default.

        Args:
            environ: the environment; None for this process's.
        """
        return (os.environ if environ is None else environ).get(self.name, self.default)

    def flag(self, environ: Mapping[str, str] | None = None) -> bool:
        """1/true/yes/on or 0/false/no/off (any case; empty means false); unset, or a value that is
        neither, gives the default.

        Args:
            environ: the environment; None for this process's.
        """
        value = (os.environ if environ is None else environ).get(self.name)
        value = value.strip().lower() if value is not None else None
        return True if value in _TRUE else False if value in _FALSE else self.default

    def number(self, environ: Mapping[str, str] | None = None) -> Any:
        """The value as a number of the default's type; unset or unreadable gives the default.

        Args:
            environ: the environment; None for this process's.
        """
        try:
            return type(self.default)(self.text(environ))
        except ValueError:
            return self.default


# ----------------------------------------------------------------- kernel side
GPUS = EnvSetting("HVD_NOTEBOOK_GPUS", None, "GPU ids to use on this host, comma-separated (empty: none); "
                  "unset: what nvidia-smi lists")
LEASE_DIR = EnvSetting("HVD_NOTEBOOK_LEASE_DIR", None, "folder of the GPU lease files shared by every user "
                       "of the node (default: $TMPDIR/hvd_notebook-gpu-leases)")
PROGRESS = EnvSetting("HVD_NOTEBOOK_PROGRESS", DashboardMode.AUTO.value, "default dashboard mode of %%hvd cells")
HUGEPAGES = EnvSetting("HVD_NOTEBOOK_HUGEPAGES", True, "ranks ask glibc's malloc for transparent huge pages")
POLICY_FILE = EnvSetting("HVD_NOTEBOOK_POLICY_FILE", None, "a fair-sharing policy file read besides "
                         "/etc/hvd_notebook/policy.toml; the tightest of each rule wins (docs/sharing.md)")
MAX_GPUS_PER_USER = EnvSetting("HVD_NOTEBOOK_MAX_GPUS_PER_USER", None, "GPUs one user's clusters on this node may "
                               "hold together (a policy rule: the tightest source wins)")
MAX_CPU_RANKS_PER_USER = EnvSetting("HVD_NOTEBOOK_MAX_CPU_RANKS_PER_USER", None, "CPU ranks one user's clusters "
                                    "on this node may run together (a policy rule)")
MAX_LEASE_TIME = EnvSetting("HVD_NOTEBOOK_MAX_LEASE_TIME", None, "how long a cluster may run, e.g. 8h; it stops "
                            "then, after the cell running at that moment (a policy rule)")
IDLE_TIMEOUT = EnvSetting("HVD_NOTEBOOK_IDLE_TIMEOUT", None, "a cluster that ran no %%hvd cell for this long, "
                          "e.g. 30m, stops and releases its GPUs (a policy rule)")
IDLE_ACTION = EnvSetting("HVD_NOTEBOOK_IDLE_ACTION", "suspend", "what idle_timeout does to an idle cluster: "
                         "suspend (its ranks' state saved, restored by the next %%hvd cell) or stop (the state is "
                         "lost); a policy rule: stop is the tighter")
SUSPENDED_TTL = EnvSetting("HVD_NOTEBOOK_SUSPENDED_TTL", None, "a suspended cluster's saved state is removed this "
                           "long after its suspend, e.g. 7d, by hvd-notebook clean and the kernel's next suspend "
                           "(a policy rule)")
KEEP_ON_KERNEL_END = EnvSetting("HVD_NOTEBOOK_KEEP_ON_KERNEL_END", None, "a cluster whose kernel shuts down or "
                                "restarts is suspended instead of stopped, as %hvd start --keep asks (a policy rule: "
                                "any source that says true)")
PREEMPT_IDLE_AFTER = EnvSetting("HVD_NOTEBOOK_PREEMPT_IDLE_AFTER", None, "a cluster that ran no %%hvd cell for "
                                "this long, e.g. 5m, releases its GPUs early when another start waits in the "
                                "node's queue for them (a policy rule)")
SRUN_MPI = EnvSetting("HVD_NOTEBOOK_SRUN_MPI", "pmi2", "srun's --mpi= plugin for ranks in a Slurm allocation")

# ----------------------------------------------------------------- rank side
NCCL = EnvSetting("HVD_NOTEBOOK_NCCL", True, "GPU tensors reduce with NCCL where every rank has a GPU; "
                  "off: through the host and MPI")
NOISE_SCALE = EnvSetting("HVD_NOTEBOOK_NOISE_SCALE", True, "distributed optimizers measure the gradient "
                         "noise scale (hvd.noise_scale()) where 2 or more ranks average the gradients")
NOISE_SCALE_DECAY = EnvSetting("HVD_NOTEBOOK_NOISE_SCALE_DECAY", 0.99, "per optimizer step, the decay of the "
                               "noise scale's moving averages (0.99: about the last 100 steps)")
REDUCE_ALONE = EnvSetting("HVD_NOTEBOOK_REDUCE_ALONE", False, "for measuring on one GPU: PyTorch's "
                          "DistributedOptimizer reduces its gradients on one rank too, as it does on more (an "
                          "allreduce of one rank is a copy), so that its cost compares with DDP's")
TORCH_TRANSPORT = EnvSetting("HVD_NOTEBOOK_TORCH_TRANSPORT", "mpi", "how PyTorch's CPU tensors travel: mpi "
                             "(the MPI library) or dist (torch.distributed's gloo); CUDA tensors always take "
                             "torch.distributed (NCCL)")
SHM_AGREEMENT = EnvSetting("HVD_NOTEBOOK_SHM_AGREEMENT", True, "ranks of one host agree on each collective "
                           "in shared memory; off: through a small MPI allreduce")
RANK_WATCH = EnvSetting("HVD_NOTEBOOK_RANK_WATCH", True, "each rank of a plain mpiexec run has a watcher that "
                        "names it if it ends without a word (os._exit, a signal); off: none")
STANDBY = EnvSetting("HVD_NOTEBOOK_STANDBY", Standby.AUTO.value, "default of %hvd start --standby "
                     "(auto, on, off)")
ELASTIC_DIR = EnvSetting("HVD_NOTEBOOK_ELASTIC_DIR", None, "where rank 0 keeps its last hvd.elastic commit, so "
                         "that a relaunched job resumes from it (hvd-notebook run sets it for each job)")
ELASTIC_COMMIT_SUMMARY = "commit.txt"  # beside the commit in ELASTIC_DIR: a line on it, for the launcher's message
FUSION_THRESHOLD = EnvSetting("HOROVOD_FUSION_THRESHOLD", 128 * 1024 * 1024,
                              "bytes per fusion buffer (0: one tensor per MPI call)")
CYCLE_TIME = EnvSetting("HOROVOD_CYCLE_TIME", 0.0, "milliseconds an agreement round waits for more requests "
                        "before the ranks agree on what is waiting (Horovod's cycle; 0: at once)")
TIMELINE = EnvSetting("HOROVOD_TIMELINE", None, "record a Chrome-trace timeline of every collective to this file")
TIMELINE_MARK_CYCLES = EnvSetting("HOROVOD_TIMELINE_MARK_CYCLES", False,
                                  "mark each agreement round (Horovod's cycles) on the timeline")
STALL_CHECK_TIME = EnvSetting("HOROVOD_STALL_CHECK_TIME_SECONDS", 60.0,
                              "seconds a collective waits before a warning names the missing ranks")
STALL_SHUTDOWN_TIME = EnvSetting("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", 0.0,
                                 "seconds a collective waits before it raises (0: never)")
STALL_CHECK_DISABLE = EnvSetting("HOROVOD_STALL_CHECK_DISABLE", False, "no stall warnings")
DYNAMIC_PROCESS_SETS = EnvSetting("HOROVOD_DYNAMIC_PROCESS_SETS", False, "allow hvd.add_process_set and "
                                  "hvd.remove_process_set after hvd.init()")
HOROVOD_ALIAS = EnvSetting("HVD_NOTEBOOK_HOROVOD_ALIAS", True, "import horovod.tensorflow (and its Keras "
                           "flavours) gives hvd_notebook's runtime where no real Horovod is installed; off: "
                           "ModuleNotFoundError as without hvd_notebook")

ENV_SETTINGS = (GPUS, LEASE_DIR, POLICY_FILE, MAX_GPUS_PER_USER, MAX_CPU_RANKS_PER_USER, MAX_LEASE_TIME,
                IDLE_TIMEOUT, IDLE_ACTION, SUSPENDED_TTL, KEEP_ON_KERNEL_END, PREEMPT_IDLE_AFTER, PROGRESS,
                HUGEPAGES, SRUN_MPI, NCCL, SHM_AGREEMENT, RANK_WATCH, FUSION_THRESHOLD, CYCLE_TIME, TIMELINE,
                TIMELINE_MARK_CYCLES, STALL_CHECK_TIME, STALL_CHECK_DISABLE, STALL_SHUTDOWN_TIME, HOROVOD_ALIAS,
                DYNAMIC_PROCESS_SETS, ELASTIC_DIR, STANDBY, NOISE_SCALE, NOISE_SCALE_DECAY, REDUCE_ALONE,
                TORCH_TRANSPORT)


# ------------------------------------------------------------ option parsers
def at_least(minimum: int, complaint: str, kind: type = int) -> Any:
    """An argparse type: a whole number (or another ``kind``, e.g. float) of at least ``minimum``,
    else ``complaint``.

    Args:
        minimum: the smallest value taken.
        complaint: the error's message.
        kind: the number's type.
    """

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole ' if kind is int else ''}number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(complaint.format(value=value))
        return value

    return parse


positive_int = at_least(1, "{value} must be at least 1")
non_negative_int = at_least(0, "{value} is negative; ranks start at 0")


def seconds(text: str) -> float:
    """An argparse type: a positive number of seconds.

    Args:
        text: the option's value.
    """
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be more than 0 seconds")
    return value


def rank_list(text: str) -> list[int]:
    """An argparse type: distinct ranks, comma-separated.

    Args:
        text: the option's value.
    """
    try:
        ranks = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ranks such as 0,1") from None
    if not ranks or min(ranks) < 0 or len(set(ranks)) != len(ranks):
        raise argparse.ArgumentTypeError(f"{text!r} must list distinct ranks such as 0,1")
    return ranks


def env_pair(text: str) -> tuple[str, str]:
    """An argparse type: KEY=VALUE.

    Args:
        text: the option's value.
    """
    key, sep, value = text.partition("=")
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, value


@dataclass(frozen=True)
class RunSpelling:
    """How ``hvd-notebook run`` (``horovodrun``) spells a ``ClusterOptions`` field, where it takes it: horovodrun's
    flags, and what differs from ``%hvd start``'s option (None: the same)."""

    flags: tuple[str, ...]
    help: str | None = None
    default: Any = None
    type: Any = None
    launcher: bool = False  # listed with hvd-notebook's own launcher options, not horovodrun's common ones


def _option(flags: tuple[str, ...], help: str, default: Any = None, run: RunSpelling | None = None,
            **argparse_kwargs: Any) -> Any:
    """A ``ClusterOptions`` field: its default, how ``%hvd start`` spells and explains it, and how ``hvd-notebook
    run`` does (``run``; None: it does not take it)."""
    return field(default=default, metadata={"flags": flags, "help": help, "argparse": argparse_kwargs, "run": run})


@dataclass(frozen=True)
class ClusterOptions:
    """What ``%hvd start`` was asked for; ``%hvd restart`` reuses it."""

    n: int | None = _option(("-n",), "number of ranks (default: one per GPU, else 2)", type=positive_int,
                            run=RunSpelling(("-np", "--num-proc"), "number of ranks (required)", type=at_least(
                                1, "{value}: a job needs at least one rank, e.g. -np 2")))
    mpiexec: str | None = _option(("--mpiexec",), "mpiexec to launch with (default: the one beside this Python, "
                                  "else PATH)", metavar="PATH", run=RunSpelling(("--mpiexec",), launcher=True))
    mpi_args: tuple[str, ...] = _option(("--mpi-args",), 'extra mpiexec arguments, quoted, e.g. --mpi-args '
                                        '"-bind-to core"', default=(), metavar='"ARGS"', convert=shlex.split,
                                        run=RunSpelling(("--mpi-args",), "extra launcher arguments, quoted",
                                                        launcher=True))
    env: tuple[tuple[str, str], ...] = _option(("--env",), "environment variable for every rank (repeatable)",
                                               default=(), metavar="K=V", type=env_pair, action="append")
    start_timeout: float = _option(("--timeout",), f"seconds to wait for all engines to connect and set up "
                                   f"(default {START_TIMEOUT_S:g})", default=START_TIMEOUT_S, metavar="S",
                                   type=seconds)
    host_check_timeout: float = _option((), "seconds the checks of the hosts before launch may take (default "
                                        f"{HOST_CHECK_TIMEOUT_S:g}; on one host there is nothing to check)",
                                        default=HOST_CHECK_TIMEOUT_S, metavar="S", type=seconds,
                                        run=RunSpelling(("--start-timeout",)))
    gpus: str = _option(("--gpus",), "GPUs to pin ranks to by local rank (default auto: all visible)",
                        default="auto", metavar="auto|none|LIST")
    backend: str = _option(("--backend",), "the hvd runtime: a real horovod where it imports (auto) or "
                           "hvd_notebook's own", default=Backend.AUTO.value, choices=choices(Backend))
    framework: str = _option(("--framework",), "which framework's hvd the cells get: horovod.tensorflow's or "
                             "horovod.torch's (auto: TensorFlow where it is installed, else PyTorch); a torch "
                             "cluster never imports TensorFlow", default=Framework.AUTO.value,
                             choices=choices(Framework))
    secure: bool = _option(("--secure",), "accepted for compatibility: every cluster encrypts its traffic with "
                           "CurveZMQ (ipyparallel's enable_curve) now, on one host too",
                           default=False, action="store_true")
    hosts: str | None = _option(("-H", "--hosts"), "run the ranks on these hosts through mpiexec, e.g. "
                                "-H node1:4,node2:4 (-n defaults to the slots)", metavar="HOST:SLOTS,...",
                                run=RunSpelling(("-H", "--hosts"), "run the ranks on these hosts, e.g. -H "
                                                "node1:4,node2:4"))
    hostfile: str | None = _option(("--hostfile",), "hosts from a file, one 'HOST:SLOTS' or 'HOST slots=SLOTS' "
                                   "per line", metavar="FILE", run=RunSpelling(("-hostfile", "--hostfile")))
    ip: str | None = _option(("--ip",), "address the controller listens on for engines on other hosts "
                             "(default: this machine's address on the route to the first other host)",
                             metavar="ADDRESS")
    min_np: int | None = _option(("--min-np",), "fewest ranks a restart may go on with where GPUs or hosts are "
                                 "gone (default: the cluster's size)", metavar="N", type=positive_int)
    max_resets: int = _option(("--max-resets",), "times a %%%%hvd cell under hvd.elastic.run is resumed after a "
                              "dead rank (default 3; 0: never)", default=3, metavar="K", type=non_negative_int,
                              run=RunSpelling(("--max-resets", "--reset-limit"), "launch a failed job again from its "
                                              "last hvd.elastic commit, at most K times (default 3; 0: never); "
                                              "--reset-limit is horovodrun's name"))
    standby: str | None = _option(("--standby",), "keep a second, idle world of ranks launched with TensorFlow "
                                  "imported, which a restart promotes in about a second (default: "
                                  "$HVD_NOTEBOOK_STANDBY, else auto: on for ranks on this host where its free "
                                  "memory allows)", choices=choices(Standby))
    keep: bool = _option(("--keep",), "when this notebook's kernel shuts down or restarts, suspend the cluster "
                         "instead of stopping it (a running cell is interrupted first): %%hvd resume in a new kernel "
                         "takes it back (default: the node's keep_on_kernel_end)", default=False, action="store_true")
    wait: bool = _option(("--no-wait",), "fail at once, saying who holds them, where the GPUs asked for are "
                         "taken (default: wait in the node's queue for them, showing the place; interrupting "
                         "the cell leaves the queue)", default=True, action="store_false")
    launcher: str = _option(("--launcher",), "how ranks start: mpiexec, or srun inside a Slurm allocation, or "
                            "another registered placement's launcher (auto: srun where SLURM_JOB_ID is set; -n "
                            "then defaults to the allocation's tasks)", default="auto", metavar="NAME",
                            run=RunSpelling(("--launcher",), launcher=True))

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, run: bool = False,
                      launcher_group: Any = None) -> None:
        """Add one option per field to ``parser``, from the fields' metadata.

        Args:
            parser: the parser (or argument group) of ``%hvd start``, or of ``hvd-notebook run``.
            run: add the options ``hvd-notebook run`` takes, as it spells them (``RunSpelling``), instead of
                every option as ``%hvd start`` spells it.
            launcher_group: where ``run``'s launcher options go (default: ``parser``).
        """
        for f in fields(cls):
            kwargs = {k: v for k, v in f.metadata["argparse"].items() if k != "convert"}
            flags, help, default, target = f.metadata["flags"], f.metadata["help"], f.default, parser
            spelling: RunSpelling | None = f.metadata["run"]
            if run:
                if spelling is None:
                    continue
                flags, help = spelling.flags, spelling.help or help
                default = spelling.default if spelling.default is not None else default
                kwargs["type"] = spelling.type or kwargs.get("type")
                kwargs = {k: v for k, v in kwargs.items() if v is not None}
                target = launcher_group if spelling.launcher and launcher_group is not None else parser
            elif not flags:  # (a field that only ``hvd-notebook run`` takes)
                continue
            if kwargs.get("action") == "append":
                default = []
            elif isinstance(default, tuple):
                default = ""
            target.add_argument(*flags, dest=f.name, default=default, help=help, **kwargs)

    @classmethod
    def from_arguments(cls, args: argparse.Namespace) -> ClusterOptions:
        """The options of a parsed ``%hvd start`` (or ``hvd-notebook run``) line; a field its parser did not
        take keeps its default.

        Args:
            args: the parsed line.
        """
        values = {}
        for f in fields(cls):
            if not hasattr(args, f.name):
                continue
            value = getattr(args, f.name)
            convert = f.metadata["argparse"].get("convert")
            if convert is not None:
                value = convert(value)
            values[f.name] = tuple(value) if isinstance(f.default, tuple) else value
        return cls(**values)
