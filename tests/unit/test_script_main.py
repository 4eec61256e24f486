"""The runner of ``hvd-notebook run``'s Python ranks, in a plain subprocess (no MPI): a script runs
as under ``python``, and a failure ends the process at once with its code and a traceback of the
user's frames only."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from hvd_notebook.engine import script_main

RUNNER = [sys.executable, "-m", "hvd_notebook.engine.script_main"]


def runner(tmp_path, source: str, *args: str) -> subprocess.CompletedProcess:
    (tmp_path / "s.py").write_text(source)
    (tmp_path / "helper.py").write_text("VALUE = 42\n")
    return subprocess.run([*RUNNER, str(tmp_path / "s.py"), *args], capture_output=True, text=True, timeout=60,
                          cwd="/")


def test_a_script_runs_as_main_with_its_arguments_and_folder(tmp_path):
    done = runner(tmp_path, "import sys, helper\nprint(__name__, sys.argv[1:], helper.VALUE)\n", "a", "-b")
    assert done.returncode == 0 and done.stdout == "__main__ ['a', '-b'] 42\n"


@pytest.mark.parametrize("source, code, says", [
    ("import sys\nsys.exit(3)\n", 3, ""),
    ("import sys\nsys.exit('bad input')\n", 1, "bad input"),
    ("def f():\n    raise ValueError('boom')\nf()\n", 1, "ValueError: boom"),
])
def test_a_failure_ends_with_its_code(tmp_path, source, code, says):
    done = runner(tmp_path, "import atexit\natexit.register(print, 'atexit ran')\n" + source)
    assert done.returncode == code
    assert says in done.stderr
    assert "atexit ran" not in done.stdout  # ended at once: nothing that could wait for other ranks ran


def test_the_traceback_shows_the_users_frames_only(tmp_path):
    done = runner(tmp_path, "def f():\n    raise ValueError('boom')\nf()\n")
    assert 's.py", line 3' in done.stderr and 's.py", line 2, in f' in done.stderr
    assert "runpy" not in done.stderr and "script_main" not in done.stderr


def test_success_and_exit_zero_end_as_usual(tmp_path):
    done = runner(tmp_path, "import atexit, sys\natexit.register(print, 'atexit ran')\nsys.exit(0)\n")
    assert done.returncode == 0 and "atexit ran" in done.stdout


def test_modules_and_code():
    done = subprocess.run([*RUNNER, "-c", "import sys; print(sys.argv)", "x"], capture_output=True, text=True,
                          timeout=60)
    assert done.stdout == "['-c', 'x']\n"
    done = subprocess.run([*RUNNER, "-m", "json.tool", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "json.tool" in done.stdout
    assert script_main.exit_code(SystemExit(None)) == 0 and script_main.exit_code(SystemExit(256 + 3)) == 3


def test_an_interrupt_ends_as_usual_with_130(tmp_path):
    done = runner(tmp_path, "import atexit\natexit.register(print, 'atexit ran')\nraise KeyboardInterrupt\n")
    assert done.returncode == 130 and "KeyboardInterrupt" in done.stderr and "runpy" not in done.stderr
    assert "atexit ran" in done.stdout  # as usual: the launcher, not this rank, decides how the world ends


def test_unbuffered_output_leaves_in_whole_lines(tmp_path):
    """Two ranks' lines reach the launcher's one stream whole, even under PYTHONUNBUFFERED (CI's
    environment), where print writes text and newline apart (ranks' lines were seen glued).
    stdout is a packet socket here, so that each write is read back as one packet."""
    (tmp_path / "s.py").write_text("print('first line')\nprint('second', end='')\nprint()\n")
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, theirs:
        done = subprocess.run([*RUNNER, str(tmp_path / "s.py")], stdout=theirs, timeout=60,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
        theirs.close()
        writes = list(iter(lambda: ours.recv(4096), b""))
    assert done.returncode == 0
    assert writes == [b"first line\n", b"second\n"]
