"""The rank channel's own replies, made from ipyparallel's records as its client fills them (``Metadata``, its
``RemoteError`` and ``EngineError``), and the one check of the ipyparallel version its private names need."""

from __future__ import annotations

import datetime
from concurrent.futures import Future

import ipyparallel
import pytest
from ipyparallel.client.client import Metadata
from ipyparallel.error import EngineError, RemoteError

from hvd_notebook.cluster.launching import ipp_version
from hvd_notebook.cluster.launching.replies import CellRequest, RankFailure, failure_of, reply_of

TRACEBACK = "\x1b[0;31mValueError\x1b[0m: bad shard"


def record(**fields: object) -> Metadata:
    """ipyparallel's record of one engine's request, as its client keeps it (the fields of a real one:
    ``print('hi')``, a line to stderr, ``1+1`` on engine 0 of a 9.2 cluster)."""
    metadata = Metadata()
    metadata.update(msg_id="4fb15720_1", engine_id=0, status="ok", submitted=datetime.datetime.now(),
                    execute_input="print('hi')\n1+1", stdout="hi\n", stderr="err\n",
                    execute_result={"data": {"text/plain": "2"}, "metadata": {}, "execution_count": 1})
    metadata.update(fields)
    return metadata


def test_a_finished_ranks_reply_holds_its_streams_and_value():
    reply = reply_of(3, record(), done=True, error=None)
    assert (reply.rank, reply.stdout, reply.stderr, reply.done, reply.error) == (3, "hi\n", "err\n", True, None)
    assert reply.result == {"data": {"text/plain": "2"}, "metadata": {}, "execution_count": 1}
    assert reply.outputs == () and dict(reply.data) == {} and reply.printed() == "hi\nerr\n"


def test_a_fresh_record_is_an_empty_reply():
    reply = reply_of(0, Metadata(), done=False, error=None)  # (as the client makes it when the request is sent)
    assert (reply.stdout, reply.stderr, reply.outputs, reply.result, reply.done) == ("", "", (), None, False)


def test_the_progress_data_is_a_read_only_view_that_grows_with_the_record():
    data = {"hvd_progress_0": {"step": 1}}
    metadata = record(data=data, outputs=[{"data": {"text/html": "<b>x</b>"}, "metadata": {}}])
    reply = reply_of(0, metadata, done=False, error=None)
    data["hvd_progress_1"] = {"step": 2}  # (the client adds what the rank publishes later)
    assert list(reply.data) == ["hvd_progress_0", "hvd_progress_1"]
    with pytest.raises(TypeError):
        reply.data["x"] = 1  # type: ignore[index]
    assert reply.outputs == ({"data": {"text/html": "<b>x</b>"}, "metadata": {}},)


def test_a_remote_error_becomes_a_rank_failure():
    failure = failure_of(RemoteError("ValueError", "bad shard", TRACEBACK))
    assert failure == RankFailure("ValueError", "bad shard", TRACEBACK, engine_died=False)
    assert str(failure) == "ValueError: bad shard"
    assert failure_of(RemoteError("ValueError", "x", ["line 1", "line 2"])).traceback == "line 1\nline 2"


def test_an_engine_that_died_is_told_from_a_raise():
    assert failure_of(EngineError("Engine 3 died while running task 'abc'")).engine_died
    assert failure_of(RemoteError("EngineError", "died", "")).engine_died  # (relayed by another engine)
    assert not failure_of(RemoteError("KeyboardInterrupt", "", "")).engine_died


def test_an_error_is_read_only_once_the_rank_is_done():
    assert reply_of(0, record(), done=False, error=RemoteError("ValueError", "x", "")).error is None
    assert reply_of(0, record(), done=True, error=RemoteError("ValueError", "x", "")).error.ename == "ValueError"


def part(metadata: Metadata) -> Future:
    future: Future = Future()
    future.metadata = metadata  # type: ignore[attr-defined]
    return future


class Whole:
    def __init__(self) -> None:
        self.waited: list[float] = []

    def wait_for_output(self, timeout: float) -> bool:
        self.waited.append(timeout)
        return True


def test_a_cell_request_answers_per_rank_and_keeps_each_record():
    parts = [part(record(stdout="a\n")), part(record(stdout="b\n"))]
    whole = Whole()
    request = CellRequest(whole, parts, [4, 7])
    parts[1].set_exception(RemoteError("ValueError", "bad shard", TRACEBACK))
    assert [r.rank for r in request.replies()] == [4, 7] and request.reply(4).stdout == "a\n"
    assert not request.done(4) and request.done(7) and request.reply(7).error.evalue == "bad shard"
    request.wait_any(0.01)  # (rank 4 still runs: returns after the timeout)
    parts[0].set_result(None)
    request.wait_any(60.0)  # (nothing runs: at once)
    request.await_output(1.5)
    assert whole.waited == [1.5] and request.reply(4).done and request.reply(4).error is None


def test_the_installed_ipyparallel_is_a_tested_one_and_has_the_private_names():
    ipp_version.check(ipyparallel.__version__)  # (the channel imported: it passed)
    for name in ipp_version.PRIVATE_NAMES:
        if name != "_query_stream":  # (a socket each client opens: an attribute of the instance)
            assert callable(getattr(ipyparallel.Client, name)), name


@pytest.mark.parametrize("version", ["9.3.0", "10.0.0", "8.8.0", "9.1.1", "9"])
def test_an_untested_ipyparallel_is_refused_with_what_to_install(version):
    with pytest.raises(ipp_version.UntestedIpyparallel) as refused:
        ipp_version.check(version)
    message = str(refused.value)
    assert f"ipyparallel {version} is installed" in message and "_send_control_request" in message
    assert "pip install 'ipyparallel==9.2.*'" in message


def test_a_tested_release_passes_whatever_its_patch_level():
    ipp_version.check("9.2.0")
    ipp_version.check("9.2.7")
