"""The commands of ``%hvd`` and of ``hvd-notebook``, in one table.

Each command is declared once: its name, what it does, which front end offers it, and the arguments every
front end that offers it takes. ``kernel/magics.py`` and ``cli.py`` build their subcommand parsers from the
table (adding the arguments only they take) and dispatch a parsed command to their handler of that name; a
unit test checks that each front end has a handler for each of its commands and none besides.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAGIC = "%hvd"
CLI = "hvd-notebook"

AddArguments = Callable[[argparse.ArgumentParser], None]


@dataclass(frozen=True)
class Command:
    """One subcommand: ``name``, its ``help`` (argparse's: ``%`` doubled), the front ends that offer it, and
    the arguments all of them take (None: none shared)."""

    name: str
    help: str
    fronts: frozenset[str]
    arguments: AddArguments | None = None


def _stacks_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--all-threads", action="store_true", help="every thread of each rank, not only those "
                        "running a cell, a script or a collective")


def _delete_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", metavar="ID", help="the suspended cluster (hvd-notebook list names them)")


_BOTH, _NOTEBOOK, _TERMINAL = frozenset({MAGIC, CLI}), frozenset({MAGIC}), frozenset({CLI})

COMMANDS: tuple[Command, ...] = (
    Command("start", "start a controller and N MPI engines", _NOTEBOOK),
    Command("stop", "stop the cluster; nothing of it is left running", _NOTEBOOK),
    Command("restart", "stop and start again with the options of the last start", _NOTEBOOK),
    Command("replay", "run again, in order, the %%%%hvd cells that completed since the last %%hvd start (after a "
            "restart lost the ranks' variables)", _NOTEBOOK),
    Command("suspend", "save every rank's state into your private folder, end the ranks and give the GPUs back; "
            "the next %%%%hvd cell (or %%hvd resume) brings it back as it was", _NOTEBOOK),
    Command("resume", "take a suspended cluster back: this notebook's, or ID, one suspended in another notebook of "
            "yours (its ranks started, their state restored, the cells that made what could not be saved "
            "replayed)", _NOTEBOOK),
    Command("delete", "throw a suspended cluster's saved state away", _BOTH, _delete_arguments),
    Command("status", "each rank: alive or dead, host, pid, device, memory, activity", _NOTEBOOK),
    Command("stacks", "each rank's Python stack now, even inside an MPI call (the notebook waits while a cell "
            "runs; a terminal's hvd-notebook stacks answers then)", _BOTH, _stacks_arguments),
    Command("auto", "on: run every cell on the ranks as a %%%%hvd cell, except cells that start with %% (%%hvd "
            "..., %%time ...), which run in this kernel; off: back to this kernel; no argument: switch; off by "
            "itself when the cluster stops", _NOTEBOOK),
    Command("debug", "pdb on a rank's failed cell, its commands typed in this notebook (default: the first rank "
            "that raised in the last failed cell)", _NOTEBOOK),
    Command("pull", "copy a variable from a rank into this notebook", _NOTEBOOK),
    Command("push", "copy a notebook variable to every rank", _NOTEBOOK),
    Command("cell", "options of %%%%hvd cells", _NOTEBOOK),
    Command("help", "show this help", _NOTEBOOK),
    Command("list", "list this user's clusters and the kernels that own them, and the suspended ones", _TERMINAL),
    Command("clean", "stop this user's clusters whose kernel is gone (and remove suspended ones past the node's "
            "suspended_ttl)", _TERMINAL),
    Command("install-kernel", "install the Jupyter kernel with the extension preloaded", _TERMINAL),
    Command("setup-node", "(root, at install) make the node's GPU lease folder: root's, a lock file per GPU and "
            "the register; one made by someone else is moved aside", _TERMINAL),
    Command("scaling", "measure how training scales on this node's GPUs (or CPUs), hvd.DistributedOptimizer "
            "beside DDP, and project it to 8, 64 and 256 GPUs", _TERMINAL),
    Command("run", "launch a command on N ranks, as horovodrun does", _TERMINAL),
)


def names(front: str) -> list[str]:
    """The commands ``front`` (``MAGIC`` or ``CLI``) offers, in the table's order.

    Args:
        front: ``MAGIC`` or ``CLI``.
    """
    return [c.name for c in COMMANDS if front in c.fronts]


def add_commands(sub: Any, front: str, own: dict[str, AddArguments] | None = None,
                 parser_kwargs: dict[str, dict[str, Any]] | None = None) -> dict[str, argparse.ArgumentParser]:
    """One subparser per command of ``front`` on ``sub`` (an argparse subparsers action).

    Args:
        sub: what ``add_subparsers`` returned.
        front: ``MAGIC`` or ``CLI``.
        own: per command, the arguments only this front end takes (after the shared ones).
        parser_kwargs: per command, more keyword arguments of its ``add_parser`` (a description, parents).

    Returns:
        The subparsers by command name.

    Raises:
        KeyError: ``own`` or ``parser_kwargs`` names a command ``front`` does not offer.
    """
    own, parser_kwargs = own or {}, parser_kwargs or {}
    unknown = sorted((set(own) | set(parser_kwargs)) - set(names(front)))
    if unknown:
        raise KeyError(f"{front} has no command(s) {unknown}")
    parsers = {}
    for command in COMMANDS:
        if front not in command.fronts:
            continue
        parser = sub.add_parser(command.name, help=command.help, **parser_kwargs.get(command.name, {}))
        for add in (command.arguments, own.get(command.name)):
            if add is not None:
                add(parser)
        parsers[command.name] = parser
    return parsers
