"""Debugging ranks from the notebook, through a real kernel as JupyterLab drives it: ``%hvd debug`` after a
cell failed on rank 1 opens pdb on that rank's traceback; the test types pdb's commands into the kernel's stdin
channel (the notebook's input box) and reads the rank's frames and locals; ``q`` ends it and both ranks are
usable after."""

from __future__ import annotations

import queue
import re
import time

from conftest import ProcessWatch, assert_gone, execute, started_kernel

FAILING = """%%hvd
def scaled(x):
    secret = x * 7
    if hvd.rank() == 1:
        raise ValueError("rank 1 gives up")
    return secret

scaled(6)
"""


def _debug(kc, commands: list[str], line: str = "%hvd debug") -> tuple[dict, str, list[str]]:
    """Run ``line`` with stdin allowed, answering each prompt with the next command: the reply, the text
    output and the prompts asked."""
    msg_id = kc.execute(line, allow_stdin=True)
    prompts, out = [], []
    answers = iter(commands)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            request = kc.get_stdin_msg(timeout=0.05)
            prompts.append(request["content"]["prompt"])
            kc.input(next(answers))
            continue
        except queue.Empty:
            pass
        try:
            msg = kc.get_iopub_msg(timeout=0.05)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append("\n".join(msg["content"]["traceback"]))
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    else:
        raise AssertionError(f"{line} did not end: {''.join(out)}")
    reply = kc.get_shell_msg(timeout=60)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=60)
    return reply, re.sub(r"\x1b\[[0-9;]*m", "", "".join(out)), prompts


def test_post_mortem_on_the_rank_that_failed(tmp_path):
    with ProcessWatch() as watch, started_kernel() as (_, kc):
        execute(kc, "%load_ext hvd_notebook")
        reply, out = execute(kc, "%hvd start -n 2 --standby off")
        assert reply["content"]["status"] == "ok", out

        reply, out, _ = _debug(kc, [])
        assert "No %%hvd cell has raised on a rank" in out, out
        reply, out, _ = _debug(kc, [], "%hvd debug --rank 0")
        assert "Rank 0 has no failed cell to debug" in out, out

        reply, out = execute(kc, FAILING)
        assert reply["content"]["status"] == "error" and "rank 1 raised ValueError" in out, out

        reply, out, prompts = _debug(kc, ["p secret", "p x * 2", "where", "interact", "up", "q"])
        assert reply["content"]["status"] == "ok", out
        assert prompts == ["(Pdb rank 1) "] * 6, prompts
        assert "[hvd] pdb on rank 1, where its cell failed" in out and "rank 1 gives up" in out, out
        assert "\n42\n" in out and "\n12\n" in out, out  # rank 1's locals in the frame that raised
        assert "scaled(6)" in out and "*** interact is not available in %hvd debug" in out, out
        assert "[hvd] pdb on rank 1 ended." in out, out

        _, out = execute(kc, "%%hvd --all-output\nprint('sum', int(hvd.allreduce(1, op=hvd.Sum)))")
        assert "[0] sum 2" in out and "[1] sum 2" in out, out  # both ranks usable after

        execute(kc, "%hvd stop")
    assert_gone(watch.seen)
