"""``%hvd`` and ``%%hvd``: parse what the user typed and hand it to the session."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class

from ..cluster.launching.world import RankInfo
from ..cluster.processes import stacks
from ..commands import MAGIC, add_commands
from ..config import ClusterOptions, DashboardMode, choices, non_negative_int, positive_int, rank_list, seconds
from ..dashboard.formatting import text_table
from ..messages import RankStatus
from . import auto, debugging, failures, sweep
from .auto import AutoCells
from .failures import HvdError
from .session import Session
from .suspending import keep_record


class _HelpShown(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports bad input as IPython's UsageError instead of exiting."""

    commands: dict[str, argparse.ArgumentParser]  # %hvd's subcommands, on the %hvd parser

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{self.prog}: {message}. See {self.prog.split()[0]} --help.")

    def exit(self, status: int = 0, message: str | None = None) -> None:  # type: ignore[override]
        if message:
            raise UsageError(message)
        raise _HelpShown()


def _split(prog: str, line: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError as exc:
        raise UsageError(f"{prog}: cannot parse {line!r}: {exc}.") from None


def _join_option_values(argv: list[str], option: str) -> list[str]:
    """``--mpi-args "-bind-to core"``: argparse would read the quoted value, which
    starts with a dash, as an option of its own; bind it to its option instead."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] == option and i + 1 < len(argv):
            out.append(f"{option}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _start_arguments(parser: argparse.ArgumentParser) -> None:
    ClusterOptions.add_arguments(parser)
    parser.add_argument("--restart", action="store_true", help="stop a running cluster first")


def _restart_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replay", action="store_true", help="then run again, in order, the %%%%hvd cells that "
                        "completed since the last %%hvd start (not those marked --no-replay)")


def _auto_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("state", nargs="?", choices=["on", "off"], help="on or off (default: the other one)")


def _debug_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rank", type=non_negative_int, default=None, help="the rank to debug")


def _resume_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", metavar="ID", nargs="?", help="the suspended cluster (default: this notebook's, else "
                        "your only one; hvd-notebook list names them)")


def _pull_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="variable name on the rank")
    parser.add_argument("--rank", type=non_negative_int, default=0, help="rank to copy from (default 0)")


def _push_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="variable name in this notebook")


_OWN_ARGUMENTS = {"start": _start_arguments, "restart": _restart_arguments, "resume": _resume_arguments,
                  "auto": _auto_arguments,
                  "debug": _debug_arguments, "pull": _pull_arguments, "push": _push_arguments}


def _build_line_parser() -> _Parser:
    parser = _Parser(
        prog="%hvd",
        description="Run data-parallel TensorFlow or PyTorch on MPI ranks from this notebook.",
        epilog="A cell that starts with %%hvd runs on every rank; see `%hvd cell --help`.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    add_commands(sub, MAGIC, own=_OWN_ARGUMENTS,
                 parser_kwargs={"cell": {"parents": [_build_cell_parser(add_help=False)]}})
    parser.commands = sub.choices
    return parser


def _build_cell_parser(add_help: bool = True) -> _Parser:
    cell = _Parser(prog="%%hvd", add_help=add_help,
                   description="Run the cell on every rank at once; state is kept between cells.")
    cell.add_argument("--ranks", type=rank_list, default=None, metavar="LIST",
                      help="run on these ranks only, e.g. 0,1")
    cell.add_argument("--timeout", type=seconds, default=None, metavar="S",
                      help="fail the cell after S seconds, naming the ranks still running")
    cell.add_argument("--no-replay", action="store_true", help="leave this cell out of %%hvd restart --replay "
                      "(a long training run, say)")
    cell.add_argument(auto.AUTO_OPTION, action="store_true", help=argparse.SUPPRESS)  # a cell of %hvd auto on
    out = cell.add_mutually_exclusive_group()
    out.add_argument("--all-output", action="store_true", help="show every rank's output")
    out.add_argument("--output-ranks", type=rank_list, default=None, metavar="LIST",
                     help="show these ranks' output (default: rank 0 only)")
    prog = cell.add_mutually_exclusive_group()
    prog.add_argument("--no-progress", action="store_const", const=DashboardMode.NONE.value, dest="progress",
                      help="no dashboard, and no progress callback on the ranks")
    prog.add_argument("--progress", choices=choices(DashboardMode), default=DashboardMode.AUTO.value,
                      help="the dashboard of fit/evaluate/predict: widgets (live, in JupyterLab), text (a line "
                           "per epoch), none; auto picks widgets under a Jupyter server, else text "
                           "(env HVD_NOTEBOOK_PROGRESS sets the default)")
    return cell


def _positive_list(text: str) -> tuple[int, ...]:
    return tuple(positive_int(part) for part in text.split(","))


def _word_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _non_negative_list(text: str) -> tuple[int, ...]:
    return tuple(non_negative_int(part) for part in text.split(","))


def _build_sweep_parser() -> _Parser:
    sweep = _Parser(prog="%%hvd sweep", description=(
        "Run the cell's training code once per point of a grid (ranks x per-rank batch x learning-rate rule x "
        "warm-up), each on a fresh world of its ranks with the set-up cells replayed; the code reads the "
        "point's settings from `point` (point.batch, point.lr(base_lr), point.callbacks(base_lr), ...). A "
        "table and plots update as points end; each point's results are appended to a JSON-lines file, so "
        "the sweep run again goes on from the first unfinished point. See docs/large-batch.md."))
    sweep.add_argument("-n", "--np", type=_positive_list, required=True, metavar="LIST",
                       help="numbers of ranks, e.g. 1,2,4 (include 1: scaling efficiency is measured against it)")
    sweep.add_argument("--batch", type=_positive_list, required=True, metavar="LIST",
                       help="per-rank batch sizes, e.g. 32,128")
    sweep.add_argument("--lr", type=_word_list, default=("none",), metavar="RULES",
                       help="how the learning rate grows with the global batch: none, linear, sqrt (default none)")
    sweep.add_argument("--warmup", type=_non_negative_list, default=(0,), metavar="LIST",
                       help="warm-up epochs, e.g. 0,3 (default 0)")
    sweep.add_argument("--base-batch", type=positive_int, default=None, metavar="N",
                       help="the global batch the base rate is tuned for (default: the smallest of the grid)")
    sweep.add_argument("--target", default=None, metavar="METRIC>=VALUE",
                       help="time and steps to reach it, e.g. val_accuracy>=0.95 (<=, >, < too)")
    sweep.add_argument("--results", default="sweep.jsonl", metavar="FILE",
                       help="JSON-lines file the points' results are appended to (default sweep.jsonl)")
    sweep.add_argument("--retry-failed", action="store_true", help="run again the points that failed")
    sweep.add_argument("--timeout", type=seconds, default=None, metavar="S",
                       help="fail a point after S seconds (and go on with the next)")
    return sweep


def usage() -> str:
    """Help for ``%hvd`` and every subcommand, as ``%hvd --help`` prints it."""
    parser = _build_line_parser()
    parts = [parser.format_help()]
    for name, p in parser.commands.items():
        if name in ("help", "cell"):
            continue
        parts.append(p.format_help())
    parts.append(_build_cell_parser().format_help())
    parts.append(_build_sweep_parser().format_help())
    return "\n".join(parts)


def describe_hvd(rank: RankInfo) -> str:
    """``hvd: builtin; torch 2.13.0+cpu, torch.distributed gloo``: which runtime and framework cells get.

    Args:
        rank: a rank's bootstrap report.
    """
    return f"hvd: {rank.backend}" + (f"; {rank.framework}" if rank.framework else "")


def format_rank_table(ranks: Sequence[RankInfo]) -> str:
    """One line per rank; with ranks on other hosts, each rank's address too.

    Args:
        ranks: the cluster's ranks.
    """
    spread = any(not r.here for r in ranks)
    rows = [("rank", "host") + (("address",) if spread else ()) + ("pid", "device", "threads (intra/inter)")]
    rows += [(str(r.rank), r.host) + ((r.ip,) if spread else ())
             + (str(r.pid), r.device, f"{r.intra_op_threads}/{r.inter_op_threads}") for r in ranks]
    return text_table(rows)


def format_status(rows: list[RankStatus]) -> str:
    """The ``%hvd status`` table: one line per rank, what it runs and how busy it is.

    Args:
        rows: one status per rank.
    """
    gpus = any(r.gpu_memory is not None or r.device.startswith("GPU") for r in rows)
    table = [("rank", "state", "host", "pid", "device", "memory") + (("GPU memory",) if gpus else ()) + ("running",)]
    for r in rows:
        row = (str(r.rank), r.state, r.host, str(r.pid), r.device, _mib(r.rss))
        row += (_mib(r.gpu_memory),) if gpus else ()
        table.append(row + (str(r.running),))
    return text_table(table)


def format_standby(state: str, n: int) -> str:
    """The line of ``%hvd status`` on the warm standby (``MPICluster.standby_state``).

    Args:
        state: the standby's state.
        n: its number of ranks.
    """
    what = {"off": "off (a restart starts the ranks cold; %hvd start --standby on keeps a warm world)",
            "starting": f"starting {n} rank(s) in the background (a restart now waits for them)",
            "ready": f"ready: {n} rank(s) with the framework imported, which the next restart promotes"}
    return f"standby: {what.get(state, f'{state} (a restart starts the ranks cold)')}"


def _mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.0f} MiB"


@magics_class
class HvdMagics(Magics):
    """``%hvd COMMAND`` manages the cluster; ``%%hvd`` runs a cell on its ranks (and, after ``%hvd auto on``,
    every cell that does not start with ``%``).

    Args:
        shell: the IPython shell.
        auto: the shell's ``AutoCells``, which ``%hvd auto`` turns on and off (installed by
            ``load_ipython_extension``; None: ``%hvd auto`` says it needs a shell).
        **kwargs: passed to IPython's ``Magics``.
    """

    def __init__(self, shell: Any = None, auto: AutoCells | None = None, **kwargs: Any) -> None:
        super().__init__(shell=shell, **kwargs)
        self.auto = auto

    @line_cell_magic
    def hvd(self, line: str, cell: str | None = None) -> Any:
        """``%hvd COMMAND [options]`` (a line) or ``%%hvd [options]`` (a cell), under the session's lock.

        Args:
            line: the command and its options (``%hvd --help`` lists them; ``commands.COMMANDS`` declares them),
                or a cell's options (``--ranks``, ``--timeout``, ``--output-ranks``, ``--progress``, ...), or
                ``sweep`` and its grid.
            cell: the code to run on the ranks; None for a line magic.

        Returns:
            For a cell, rank 0's value of its last expression (shown as a normal cell's); else None.

        Raises:
            UsageError: a line or options that do not parse (IPython shows the message alone).
            HvdError: the command or cell failed: no cluster, a start that did not start, a rank that raised
                (``RankError``), died (``RankDied``) or ran past ``--timeout`` (``CellTimeout``).
            KeyboardInterrupt: the notebook's stop button, once the ranks were interrupted.
        """
        try:
            with Session.get().in_use():  # (the node's release watch waits for the command)
                if cell is None:
                    return self._line(line)
                return self._cell(line, cell)
        except _HelpShown:
            return None

    def _line(self, line: str) -> Any:
        argv = _split("%hvd", line)
        if not argv or argv[0] in ("help", "--help", "-h"):
            print(usage())
            return None
        args = _build_line_parser().parse_args(_join_option_values(argv, "--mpi-args"))
        return self._handlers()[args.command](args, Session.get())

    def _handlers(self) -> dict[str, Callable[[argparse.Namespace, Session], None]]:
        """The handler of each ``%hvd`` command (``commands.COMMANDS``), by name."""
        return {"start": self._start, "stop": self._stop, "restart": self._restart, "replay": self._replay,
                "suspend": lambda args, session: print(session.suspension.suspend()),
                "resume": lambda args, session: print(session.suspension.resume(args.id)),
                "delete": lambda args, session: print(session.suspension.delete(args.id)),
                "status": self._status, "stacks": self._stacks, "auto": lambda args, _: self._auto(args.state),
                "debug": self._debug, "pull": self._pull, "push": self._push, "cell": self._cell_help,
                "help": lambda args, session: print(usage())}

    def _start(self, args: argparse.Namespace, session: Session) -> None:
        kept = session.suspension.own if session.cluster is None else None
        if kept is not None:  # (a fresh start: the next cell no longer resumes it, but it is kept)
            session.suspension.own = None
            print(f"This notebook's suspended cluster {kept.id} is kept: %hvd resume {kept.id} takes it back once "
                  f"this one is suspended or stopped; %hvd delete {kept.id} throws it away.")
        ranks = session.start(ClusterOptions.from_arguments(args), restart=args.restart)
        keep_record(session.require(), session.options, session.history)  # (--keep: what the reaper suspends)
        print(f"Started {len(ranks)} MPI ranks ({describe_hvd(ranks[0])}).\n{format_rank_table(ranks)}")
        rules = session.require().rules.describe()
        if rules:
            print(f"This node's rules: {rules}.")

    def _stop(self, args: argparse.Namespace, session: Session) -> None:
        print("Cluster stopped." if session.stop() else "No cluster was running.")
        if session.suspension.own is not None:
            print(f"This notebook's cluster is suspended ({session.suspension.own.id}): %hvd resume brings it back, "
                  f"%hvd delete {session.suspension.own.id} throws its state away.")
        if self.auto is not None and self.auto.on:
            self.auto.on = False
            print(auto.state(False))

    def _restart(self, args: argparse.Namespace, session: Session) -> None:
        ranks = session.restart()
        print(f"Restarted {len(ranks)} MPI ranks ({describe_hvd(ranks[0])}).\n{format_rank_table(ranks)}")
        if args.replay:
            print(f"Replayed {session.replay()} cell(s).")

    def _replay(self, args: argparse.Namespace, session: Session) -> None:
        print(f"Replayed {session.replay()} cell(s).")

    def _status(self, args: argparse.Namespace, session: Session) -> None:
        rows = session.status()
        cluster = session.require()
        print(f"{describe_hvd(cluster.ranks[0])}\n{format_status(rows)}\n"
              f"{format_standby(cluster.standby_state, cluster.n)}")
        if self.auto is not None and self.auto.on:
            print(auto.state(True))

    def _stacks(self, args: argparse.Namespace, session: Session) -> None:
        ranks = [r for r in session.require().ranks if r.here]
        print(stacks.format_stacks(stacks.collect([r.pid for r in ranks]), args.all_threads))

    def _debug(self, args: argparse.Namespace, session: Session) -> None:
        cluster = session.require()
        debugging.post_mortem(cluster, debugging.rank_to_debug(cluster, session.failed_ranks, args.rank))

    def _pull(self, args: argparse.Namespace, session: Session) -> None:
        self.shell.user_ns[args.name] = session.pull(args.name, args.rank)
        print(f"Pulled {args.name!r} from rank {args.rank}.")

    def _push(self, args: argparse.Namespace, session: Session) -> None:
        session.require()
        if args.name not in self.shell.user_ns:
            raise HvdError(f"This notebook has no variable named {args.name!r} to push.")
        session.push(args.name, self.shell.user_ns[args.name])
        print(f"Pushed {args.name!r} to {session.require().n} ranks.")

    def _cell_help(self, args: argparse.Namespace, session: Session) -> None:
        print(_build_cell_parser().format_help())

    def _auto(self, state: str | None) -> None:
        """``%hvd auto [on|off]``: switch it (on needs a running cluster)."""
        if self.auto is None:
            raise HvdError("%hvd auto needs an IPython shell to run the cells of.")
        on = not self.auto.on if state is None else state == "on"
        if on:
            Session.get().require()
        self.auto.on = on
        print(auto.state(on))

    def _cell(self, line: str, cell: str) -> Any:
        argv = _split("%%hvd", line)
        if argv[:1] == ["sweep"]:
            return self._sweep(argv[1:], cell)
        args = _build_cell_parser().parse_args(argv)
        session = Session.get()
        session.suspension.resume_pending(say=print)  # (this notebook's suspended cluster comes back first)
        if args.auto:
            if session.cluster is None:  # stopped or lost since %hvd auto on
                if self.auto is not None:
                    self.auto.on = False
                raise failures.auto_without_cluster(session.released)
            print(auto.ran_on(session.cluster.n), flush=True)
        output_ranks = args.output_ranks
        if args.all_output:
            output_ranks = [r.rank for r in session.require().ranks]
        return session.run_cell(cell, ranks=args.ranks, output_ranks=output_ranks, timeout=args.timeout,
                                progress=args.progress, record=not args.no_replay)

    def _sweep(self, argv: list[str], cell: str) -> None:
        args = _build_sweep_parser().parse_args(argv)
        try:
            target = sweep.Target.parse(args.target) if args.target is not None else None
            grid = sweep.Grid(args.np, args.batch, args.lr, args.warmup, args.base_batch)
            grid.points()
        except ValueError as exc:
            raise UsageError(f"%%hvd sweep: {exc}") from None
        session = Session.get()
        with session.busy():
            sweep.run_sweep(session, cell, grid, target, Path(args.results), args.timeout, args.retry_failed)
