"""Tab completion and inspection in ``%%hvd`` cells from rank 0's namespace, through a real kernel as JupyterLab
asks it (complete_request, inspect_request), with real ranks; and the kernel's own answer where rank 0 is busy."""

from __future__ import annotations

import re
import statistics
import time
from typing import Any

from conftest import assert_gone, cluster_pids, collect, execute, figure, started_kernel

SETUP = ('%%hvd\nclass Model:\n    """The model of rank {}."""\n    weights = 1\n'
         'Model.__doc__ = Model.__doc__.format(hvd.rank())\nrank_only_model = 1\nrank_only_obj = Model()')


def ask(kc, kind: str, code: str, cursor_pos: int | None = None) -> tuple[dict[str, Any], float]:
    """A complete_request or inspect_request at ``cursor_pos`` (the end by default): its reply's content, and
    the seconds until the reply came."""
    t0 = time.monotonic()
    msg_id = getattr(kc, kind)(code, len(code) if cursor_pos is None else cursor_pos)
    reply = kc.get_shell_msg(timeout=30)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=30)
    return reply["content"], time.monotonic() - t0


def plain(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def test_a_hvd_cell_completes_and_inspects_rank_0s_variables():
    with started_kernel() as (km, kc):
        reply, out = execute(kc, "%load_ext hvd_notebook\n%hvd start -n 2\n"
                                 "from hvd_notebook.kernel.session import Session")
        assert reply["content"]["status"] == "ok", out
        reply, out = execute(kc, SETUP)
        assert reply["content"]["status"] == "ok", out

        answers = [ask(kc, "complete", "%%hvd\nprint(1)\nx = rank_o") for _ in range(10)]
        from_rank = [(content, took) for content, took in answers if content["matches"]]
        for content, _ in from_rank:
            assert content["matches"] == ["rank_only_model", "rank_only_obj"], content
            assert content["cursor_start"] == len("%%hvd\nprint(1)\nx = "), content
        seconds = sorted(took for _, took in answers)
        figure(f"completion from rank 0 in a %%hvd cell (complete_request to reply, idle 2-rank cluster): median "
               f"{statistics.median(seconds) * 1000:.0f} ms, slowest {seconds[-1] * 1000:.0f} ms of 10")
        # (a rank late under the load of tests beside this one is answered by the kernel: at most 2 of 10)
        assert len(from_rank) >= 8 and statistics.median(seconds) < 0.2, answers

        content, _ = ask(kc, "complete", "%%hvd --ranks 0,1\nrank_only_obj.we")
        assert content["matches"] == [".weights"] and content["cursor_start"] == len("%%hvd --ranks 0,1\nrank_only_obj")

        content, _ = ask(kc, "complete", "x = rank_o")  # outside %%hvd: the kernel's names, as before
        assert not any(m.startswith("rank_only") for m in content["matches"]), content

        content, took = ask(kc, "inspect", "%%hvd\ny = rank_only_obj.weights", len("%%hvd\ny = rank_only"))
        assert content["found"] is True, content
        text = plain(content["data"]["text/plain"])
        assert "Model" in text and "The model of rank 0." in text, text
        content, _ = ask(kc, "inspect", "%%hvd\nnothing_on_the_ranks")
        assert content["found"] is False, content
        content, _ = ask(kc, "inspect", "rank_only_obj")  # outside %%hvd: the kernel's namespace
        assert content["found"] is False, content

        msg_id = kc.execute("%%hvd\nrank_only_obj?")  # on the ranks: rank 0's page as the cell's output
        reply, out = collect(kc, msg_id, displays=True)
        assert reply["content"]["status"] == "ok" and "The model of rank 0." in plain(out), out

        # rank 0 busy with work the kernel sent it outside a cell: the kernel answers at once itself, and sends
        # rank 0 nothing (asked, rank 0 would have run the completion after its work)
        execute(kc, "channel = Session.get().cluster.channel\nclient = channel.ipp_client\n"
                    "busy = client[channel.engine_ids([0])[0]]"
                    ".execute('import time; time.sleep(3)', block=False)\nsent = len(client.history)")
        content, took = ask(kc, "complete", "%%hvd\nrank_o")
        assert not any(m.startswith("rank_only") for m in content["matches"]) and took < 1.0, (content, took)
        reply, out = execute(kc, "print('sent to the ranks:', len(client.history) - sent)")
        assert "sent to the ranks: 0" in out, out
        reply, out = execute(kc, "busy.get(timeout=10)")
        assert reply["content"]["status"] == "ok", out
        content, _ = ask(kc, "complete", "%%hvd\nrank_o")
        assert content["matches"] == ["rank_only_model", "rank_only_obj"], content

        # a cell runs (the session is held): a completion on a kernel subshell, as a front end may send it
        # beside a running cell, gets the kernel's own answer at once
        subshell = kc.session.msg("create_subshell_request", {})
        kc.control_channel.send(subshell)
        subshell_id = kc.get_control_msg(timeout=30)["content"]["subshell_id"]
        cell = kc.execute("%%hvd\nimport time\ntime.sleep(3)")
        time.sleep(1)
        sent = _on_subshell(kc, subshell_id, "execute_request", {
            "code": "", "silent": False, "store_history": False, "allow_stdin": False,
            "user_expressions": {"sent": "len(client.history)"}})["user_expressions"]["sent"]
        t0 = time.monotonic()
        content = _on_subshell(kc, subshell_id, "complete_request", {"code": "%%hvd\nrank_o", "cursor_pos": 12})
        took = time.monotonic() - t0
        sent_after = _on_subshell(kc, subshell_id, "execute_request", {
            "code": "", "silent": False, "store_history": False, "allow_stdin": False,
            "user_expressions": {"sent": "len(client.history)"}})["user_expressions"]["sent"]
        assert not any(m.startswith("rank_only") for m in content["matches"]) and took < 1.0, (content, took)
        assert sent_after == sent, (sent, sent_after)  # (rank 0 was not asked: the cell holds the cluster)
        reply, out = collect(kc, cell)
        assert reply["content"]["status"] == "ok", out

        pids = cluster_pids(kc)
        km.shutdown_kernel(now=False)
        assert_gone(pids, timeout=30)


def _on_subshell(kc, subshell_id: str, msg_type: str, content: dict) -> dict:
    """A request on a kernel subshell (answered beside a running cell): its reply's content."""
    request = kc.session.msg(msg_type, content)
    request["header"]["subshell_id"] = subshell_id
    kc.shell_channel.send(request)
    reply = kc.get_shell_msg(timeout=30)
    assert reply["parent_header"]["msg_id"] == request["header"]["msg_id"], reply
    return reply["content"]
