"""Debugging ranks from the notebook, through a real kernel as JupyterLab drives it (one kernel and cluster
for the module): ``%hvd debug`` after a cell failed on rank 1 opens pdb on that rank's traceback; the test
types pdb's commands into the kernel's stdin channel (the notebook's input box) and reads the rank's frames and
locals; ``q`` ends it and both ranks are usable after. ``breakpoint()`` on rank 1 before an allreduce stops it
in pdb driven the same way while rank 0 waits: continued, the cell completes; quit, it ends on both ranks,
which are usable after."""

from __future__ import annotations

import queue
import re
import time

import pytest
from conftest import ProcessWatch, assert_gone, execute, iopub_text, is_idle, shell_reply, started_kernel

FAILING = """%%hvd
def scaled(x):
    secret = x * 7
    if hvd.rank() == 1:
        raise ValueError("rank 1 gives up")
    return secret

scaled(6)
"""


def _debug(kc, commands: list[str | float], line: str = "%hvd debug") -> tuple[dict, str, list[str]]:
    """Run ``line`` with stdin allowed, answering each prompt with the next command (a number: seconds to
    wait first): the reply, the text output and the prompts asked."""
    msg_id = kc.execute(line, allow_stdin=True)
    prompts, out = [], []
    answers = iter(commands)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            request = kc.get_stdin_msg(timeout=0.05)
            prompts.append(request["content"]["prompt"])
            answer = next(answers)
            if not isinstance(answer, str):
                time.sleep(answer)
                answer = next(answers)
            kc.input(answer)
            continue
        except queue.Empty:
            pass
        try:
            msg = kc.get_iopub_msg(timeout=0.05)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if is_idle(msg):
            break
        out.append(iopub_text(msg) or "")
    else:
        raise AssertionError(f"{line} did not end: {''.join(out)}")
    return shell_reply(kc, msg_id, 60), re.sub(r"\x1b\[[0-9;]*m", "", "".join(out)), prompts


@pytest.fixture(scope="module")
def kc():
    """A kernel with a 2-rank cluster, for the module; every process gone at the end."""
    with ProcessWatch() as watch, started_kernel() as (_, client):
        execute(client, "%load_ext hvd_notebook")
        reply, out = execute(client, "%hvd start -n 2 --standby off")
        assert reply["content"]["status"] == "ok", out
        yield client
        execute(client, "%hvd stop")
    assert_gone(watch.seen)


def test_post_mortem_on_the_rank_that_failed(kc):
    reply, out, _ = _debug(kc, [])
    assert "No %%hvd cell has raised on a rank" in out, out
    reply, out, _ = _debug(kc, [], "%hvd debug --rank 0")
    assert "Rank 0 has no failed cell to debug" in out, out

    reply, out = execute(kc, FAILING)
    assert reply["content"]["status"] == "error" and "rank 1 raised ValueError" in out, out

    reply, out, prompts = _debug(kc, ["p secret", "p x * 2", "where", "interact", "up", "q"])
    assert reply["content"]["status"] == "ok", out
    assert prompts == ["(Pdb rank 1) "] * 6, prompts
    assert "[hvd_notebook] pdb on rank 1, where its cell failed" in out and "rank 1 gives up" in out, out
    assert "\n42\n" in out and "\n12\n" in out, out  # rank 1's locals in the frame that raised
    assert "scaled(6)" in out and "*** interact is not available in %hvd debug" in out, out
    assert "[hvd_notebook] pdb on rank 1 ended." in out, out

    _, out = execute(kc, "%%hvd --all-output\nprint('sum', int(hvd.allreduce(1, op=hvd.Sum)))")
    assert "[0] sum 2" in out and "[1] sum 2" in out, out  # both ranks usable after


# rank 0 would warn of a stall after 1 s and give up after 1.5 s, and the cell would time out after 4 s, but for
# the debugger: rank 1 stays there 4.5 s
STOPPING = """%%hvd --all-output --timeout 4
import numpy as np
from hvd_notebook.runtime.core import world
stall = world.current().negotiator.stall
stall.check_s, stall.shutdown_s = 1.0, 1.5
local = 10 + hvd.rank()
if hvd.rank() == 1:
    breakpoint()
total = hvd.allreduce(np.array([local]), op=hvd.Sum)
stall.check_s, stall.shutdown_s = 60.0, 0.0
print("total", int(total[0]))
"""

QUITTING = """%%hvd --all-output
import numpy as np
hvd.breakpoint(rank=1)
print("after", int(hvd.allreduce(np.array([1]), op=hvd.Sum)[0]))
"""


def test_breakpoint_on_rank_1_continued_then_quit(kc):
    reply, out, prompts = _debug(kc, ["p local", "where", 4.5, "c"], STOPPING)
    assert reply["content"]["status"] == "ok", out
    assert prompts == ["(Pdb rank 1) "] * 3, prompts
    assert "[hvd_notebook] rank 1 stopped at a cell, line 8; pdb on it" in out, out
    assert "\n11\n" in out and "[hvd_notebook] rank 1 goes on." in out, out  # rank 1's local, read in its debugger
    assert "[0] total 21" in out and "[1] total 21" in out, out
    stalls = [line for line in out.splitlines() if "WARNING: stall" in line]
    assert stalls and all("rank 1 is in the debugger (a cell, line 8)" in line and "have not arrived" not in line
               for line in stalls), stalls

    t0 = time.monotonic()
    reply, out, prompts = _debug(kc, ["p 6 * 7", "q"], QUITTING)
    assert reply["content"]["status"] == "error", out
    assert prompts == ["(Pdb rank 1) "] * 2 and "\n42\n" in out, (prompts, out)
    assert "rank 1 quit its debugger (q), which ends the cell on every rank; rank(s) [0] were still running" \
        in out, out
    assert "collectives were renewed" in out and "[0] after" not in out, out
    assert time.monotonic() - t0 < 30, "quitting took too long"

    _, out = execute(kc, "%%hvd --all-output\nprint('sum', int(hvd.allreduce(1, op=hvd.Sum)))")
    assert "[0] sum 2" in out and "[1] sum 2" in out, out  # both ranks usable after, without a restart

    # both ranks stop: taken one after the other, each named
    reply, out, prompts = _debug(kc, ["p hvd.rank()", "c", "p hvd.rank()", "c"],
                                 "%%hvd --all-output\nbreakpoint()\nprint('both', int(hvd.allreduce(1, op=hvd.Sum)))")
    assert reply["content"]["status"] == "ok", out
    assert sorted(prompts) == ["(Pdb rank 0) "] * 2 + ["(Pdb rank 1) "] * 2, prompts
    assert out.count("goes on.") == 2 and "[0] both 2" in out and "[1] both 2" in out, out
