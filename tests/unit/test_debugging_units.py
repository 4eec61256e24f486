"""The rank's side of ``%hvd debug`` in this process: pdb on the last failed cell's traceback, one command at a
time, its output handed back; commands that would read this process's own stdin are refused."""

from __future__ import annotations

import sys

import pytest

from hvd_notebook.engine import debugging


def _fail() -> None:
    def scaled(x: int) -> int:
        secret = x * 7  # noqa: F841 (read by the debugger)
        raise ValueError("gives up")

    try:
        scaled(6)
    except ValueError:
        sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()


def test_pdb_on_the_last_traceback_one_command_at_a_time(ip, monkeypatch):
    monkeypatch.delattr(sys, "last_traceback", raising=False)
    assert debugging.begin() is None  # no failed cell here
    _fail()
    where = debugging.begin()
    assert "secret = x * 7" in where or "raise ValueError" in where, where
    assert debugging.step("p secret") == ("42\n", False)
    assert debugging.step("p x + 1") == ("7\n", False)
    out, done = debugging.step("interact")
    assert "not available in %hvd debug" in out and not done
    assert debugging.step("q")[1] is True
    out, done = debugging.step("p secret")
    assert done and "no debugging session" in out


@pytest.mark.parametrize("command", ["c", "continue"])
def test_continuing_ends_the_session(ip, command):
    _fail()
    debugging.begin()
    assert debugging.step(command)[1] is True
    assert debugging._Session.debugger is None
