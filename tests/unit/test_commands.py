"""One table of commands behind ``%hvd`` and ``hvd-notebook`` (``hvd_notebook/commands.py``): each front end
parses exactly its commands from it and has one handler per command; a command both offer takes the same
shared arguments in both."""

from __future__ import annotations

import argparse

import pytest

from hvd_notebook import cli, commands
from hvd_notebook.kernel import magics


def test_each_front_end_handles_exactly_its_commands_of_the_table():
    assert set(magics.HvdMagics(shell=None)._handlers()) == set(commands.names(commands.MAGIC))
    assert set(cli.HANDLERS) == set(commands.names(commands.CLI))
    assert list(magics._build_line_parser().commands) == commands.names(commands.MAGIC)
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert list(sub.choices) == commands.names(commands.CLI)


def test_a_command_of_both_front_ends_takes_the_shared_arguments_in_both():
    notebook = magics._build_line_parser().parse_args(["stacks", "--all-threads"])
    terminal = cli.build_parser().parse_args(["stacks", "--all-threads", "--timeout", "3"])
    assert notebook.all_threads and terminal.all_threads and terminal.timeout == 3.0
    assert "stacks" in commands.names(commands.MAGIC) and "stacks" in commands.names(commands.CLI)


def test_arguments_for_a_command_the_front_end_lacks_are_refused():
    sub = argparse.ArgumentParser().add_subparsers(dest="command")
    with pytest.raises(KeyError, match=r"%hvd has no command\(s\) \['run'\]"):
        commands.add_commands(sub, commands.MAGIC, own={"run": lambda parser: None})
