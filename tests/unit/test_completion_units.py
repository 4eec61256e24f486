"""Completion and inspection in ``%%hvd`` cells against a stand-in rank 0 (no engines): which cells ask the
rank, how its answer replaces the kernel's, and that the kernel never waits on a busy or silent rank.
tests/integration/test_completion.py asks real ranks through a real kernel."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from conftest import FakeController
from IPython.core.completer import provisionalcompleter

from hvd_notebook.cluster.launching.channel import RankChannel
from hvd_notebook.engine import completion as on_rank
from hvd_notebook.kernel import completion
from hvd_notebook.kernel.session import Session


class Answer:
    def __init__(self, value: Any, delay: float) -> None:
        self.value, self.delay = value, delay

    def get(self, timeout: float) -> Any:
        if self.delay > timeout:
            time.sleep(timeout)
            raise TimeoutError("no answer")  # (as ipyparallel's own TimeoutError)
        return self.value


class Rank0(FakeController):
    """The cluster's client as ``ask_idle`` uses it: rank 0's queue, and its answer to each request."""

    def __init__(self, answers: dict[str, Any], queued: int = 0, delay: float = 0.0) -> None:
        self.answers, self.queued, self.delay = answers, queued, delay
        self.asked: list[tuple[str, tuple]] = []
        self.outstanding: set[str] = set()  # (the kernel's own requests not answered yet)

    def queues(self, targets: list[int]) -> dict:
        return {0: {"queue": self.queued, "tasks": 0, "completed": 3}, "unassigned": 0}

    def __getitem__(self, engine: int) -> Rank0:
        assert engine == 0
        return self

    def apply_async(self, func, *args) -> Answer:
        self.asked.append((func.__name__, args))
        return Answer(self.answers[func.__name__], self.delay)


class Cluster:
    def __init__(self, client: Rank0) -> None:
        self.channel = RankChannel(client)  # the real channel, over a stand-in client
        self.channel.bind({0: 0})


@pytest.fixture
def rank0(monkeypatch):
    """Rank 0 of a stand-in cluster that has ``rank_only_model`` and ``rank_only_obj`` (a ``Model``)."""
    client = Rank0({"complete": (0, [("rank_only_model", "instance"), ("rank_only_obj", "instance")]),
                    "inspect": {"text/plain": "Type: Model\nDocstring: rank 0's model", "text/html": "<p>"}})
    monkeypatch.setattr(Session.get(), "cluster", Cluster(client))
    return client


def complete(ip, code: str) -> list[str]:
    with provisionalcompleter():
        return [c.text for c in ip.Completer.completions(code, len(code))]


@pytest.mark.parametrize("code, cursor, body", [
    ("%%hvd\nx = rank_o", 16, ("x = rank_o", 10)),
    ("%%hvd --ranks 0,1\nprint(1)\nrank_o", 30, ("print(1)\nrank_o", 12)),
    ("%%hvd sweep -n 1 --batch 8\nfit(", 31, ("fit(", 4)),
    ("%%hvd --timeout 9", 17, None),  # on the magic's line: its options
    ("%%hvd --ranks 0\nx", 8, None),
    ("%%hvdx\nx", 8, None),
    ("%%time\nx", 8, None),
    ("x = 1\n%%hvd\nx", 13, None),
])
def test_which_cells_the_ranks_complete(code, cursor, body):
    assert completion.cell_body(code, cursor) == body


def test_a_hvd_cell_completes_from_rank_0_only(ip, rank0):
    ip.user_ns["rank_only_local"] = 1  # the kernel's, not the ranks'
    assert complete(ip, "%%hvd\nx = 1\nrank_o") == ["rank_only_model", "rank_only_obj"]
    assert rank0.asked == [("complete", ("x = 1\nrank_o", 12))]
    assert "rank_only_local" in complete(ip, "rank_o")  # elsewhere, the kernel's names as before
    assert "rank_only_model" not in complete(ip, "rank_o")
    assert len(rank0.asked) == 1


def test_attributes_replace_what_the_cell_typed(ip, rank0):
    rank0.answers["complete"] = (13, [(".weights", "attribute")])
    with provisionalcompleter():
        found = list(ip.Completer.completions("%%hvd\nrank_only_obj.we", 22))
    assert [(c.start, c.end, c.text) for c in found] == [(19, 22, ".weights")]


@pytest.mark.parametrize("why", ["lock", "queued", "pending", "slow", "no cluster"])
def test_the_kernel_completes_itself_when_rank_0_cannot_answer(ip, rank0, monkeypatch, why):
    ip.user_ns["rank_only_local"] = 1
    session = Session.get()
    held, release = threading.Event(), threading.Event()
    if why == "lock":  # a cell runs: another thread holds the cluster
        def hold() -> None:
            with session.in_use():
                held.set()
                release.wait(10)
        threading.Thread(target=hold, daemon=True).start()
        held.wait(5)
    rank0.queued = 1 if why == "queued" else 0
    rank0.delay = 5.0 if why == "slow" else 0.0
    rank0.outstanding = {"an earlier request"} if why == "pending" else set()
    if why == "no cluster":
        monkeypatch.setattr(session, "cluster", None)
    try:
        t0 = time.monotonic()
        assert complete(ip, "%%hvd\nrank_o") == ["rank_only_local"]
        assert time.monotonic() - t0 < 3.0  # the kernel answered without waiting for rank 0 (5 s when slow)
    finally:
        release.set()
    assert len(rank0.asked) == (1 if why == "slow" else 0)


def test_rank_0_with_no_completion_lets_the_kernel_answer(ip, rank0):
    rank0.answers["complete"] = (0, [])
    ip.user_ns["rank_only_local"] = 1
    assert complete(ip, "%%hvd\nrank_o") == ["rank_only_local"]


class Kernel:
    def do_inspect(self, code, cursor_pos, detail_level=0, omit_sections=()):
        return {"status": "ok", "found": True, "data": {"text/plain": "the kernel's"}, "metadata": {}}


def test_inspection_in_a_hvd_cell_shows_rank_0s_object(ip, rank0, monkeypatch):
    kernel = Kernel()
    monkeypatch.setattr(ip, "kernel", kernel, raising=False)
    completion.install(ip)
    completion.install(ip)  # (a second %load_ext)
    try:
        reply = kernel.do_inspect("%%hvd\nrank_only_obj.fit(1)", 12, 1)
        assert reply == {"status": "ok", "found": True, "metadata": {},
                         "data": {"text/plain": "Type: Model\nDocstring: rank 0's model"}}  # (no html pager)
        assert rank0.asked == [("inspect", ("rank_only_obj", 1, ()))]
        assert kernel.do_inspect("rank_only_obj", 3)["data"] == {"text/plain": "the kernel's"}
        rank0.answers["inspect"] = {}
        assert kernel.do_inspect("%%hvd\nnothing", 8)["found"] is False  # rank 0 has no such object
        rank0.queued = 1
        assert kernel.do_inspect("%%hvd\nnothing", 8)["data"] == {"text/plain": "the kernel's"}
    finally:
        completion.uninstall(ip)
    assert "do_inspect" not in vars(kernel)
    assert completion.rank_matcher not in ip.Completer.custom_matchers
    completion.install(ip)  # (the session's shell goes on with the extension loaded)


def test_the_rank_side_completes_and_inspects_its_own_namespace(ip):
    ip.run_cell("class Model:\n    'rank doc'\n    weights = 1\nrank_only_obj = Model()")
    assert on_rank.complete("x = rank_only_obj.we", 20) == (17, [(".weights", "attribute")])
    assert on_rank.complete("zzz_nothing", 11) == (11, [])
    assert "rank doc" in on_rank.inspect("rank_only_obj")["text/plain"]
    assert on_rank.inspect("zzz_nothing") == {}
