"""benchmarks/horovod_suite.py's pure parts: how a world's per-rank records become one outcome, the
first error line its plugin keeps, and the report (no MPI, no Horovod checkout)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import horovod_suite as suite  # noqa: E402
import horovod_suite_plugin as plugin  # noqa: E402

ID = "test_tensorflow.py::TensorFlowTests::test_horovod_allreduce_cpu"


def phases(*outcomes, nodeid=ID, message="", longrepr=""):
    """Records of setup, call and teardown with the given outcomes (None: the phase never came)."""
    recs = []
    for when, outcome in zip(("setup", "call", "teardown"), outcomes):
        if outcome is not None:
            rec = {"nodeid": nodeid, "when": when, "outcome": outcome}
            if outcome != "passed":
                rec.update(message=message, longrepr=longrepr)
            recs.append(rec)
    return recs


def test_every_rank_passed_is_passed():
    r = suite.classify(ID, {"0": phases("passed", "passed", "passed"), "1": phases("passed", "passed", "passed")},
                       False, 3.0)
    assert r.outcome == "passed" and r.message == ""


def test_one_rank_failed_is_failed_with_its_message_and_mode():
    failed = phases("passed", "failed", "passed", message="FailedPreconditionError: x",
                    longrepr='  File "test_util.py", line 1, in decorated\n')
    r = suite.classify(ID, {"0": phases("passed", "passed", "passed"), "1": failed}, False, 3.0)
    assert (r.outcome, r.message, r.mode) == ("failed", "FailedPreconditionError: x", "graph")


def test_a_failure_in_the_eager_pass_says_eager():
    assert suite.failed_mode('in decorated\n    run_eagerly(self, **kwargs)\n') == "eager"
    assert suite.failed_mode("a plain test") == ""


def test_a_failed_rank_while_the_other_hung_says_so():
    r = suite.classify(ID, {"0": phases("passed", "failed", "passed", message="boom"), "1": phases("passed")},
                       True, 120.0)
    assert r.outcome == "failed" and r.message.startswith("boom") and "hung" in r.message


def test_timeout_or_a_missing_teardown_is_a_hang():
    both_started = {"0": phases("passed"), "1": phases("passed")}
    assert suite.classify(ID, both_started, True, 120.0).outcome == "hang"
    lost = suite.classify(ID, {"0": phases("passed", "passed", "passed"), "1": []}, False, 5.0)
    assert lost.outcome == "hang" and "lost world" in lost.message


def test_skipped_only_when_every_rank_skipped():
    skipped = phases("skipped", None, "passed", message="No GPUs available")
    assert suite.classify(ID, {"0": skipped, "1": skipped}, False, 2.0).outcome == "skipped"
    assert suite.classify(ID, {"0": skipped, "1": phases("passed", "passed", "passed")}, False, 2.0).outcome == \
        "passed"


def test_the_first_error_line_of_a_graph_error_carries_the_inner_error():
    crash = SimpleNamespace(message="tensorflow...InvalidArgumentError: Graph execution error:\n\nDetected at node\n"
                                    "  ValueError: bad split\n")
    report = SimpleNamespace(longrepr=SimpleNamespace(reprcrash=crash))
    assert plugin.first_error_line(report) == "tensorflow...InvalidArgumentError: Graph execution error: " \
                                              "ValueError: bad split"
    assert plugin.first_error_line(SimpleNamespace(longrepr=("f.py", 3, "Skipped: no GPU"))) == "Skipped: no GPU"


def test_the_helpers_horovods_tests_import_behave_as_horovods(monkeypatch):
    assert plugin.is_version_greater_equal_than("2.21.0", "2.9.0")
    assert not plugin.is_version_greater_equal_than("2.9.0", "2.21.0")
    with pytest.raises(ValueError):
        plugin.is_version_greater_equal_than(2, "1")
    for var in ("HOROVOD_RANK", "HOROVOD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PMI_RANK", "1")
    with pytest.raises(RuntimeError, match="only one of"):
        plugin.get_env_rank_and_size()
    monkeypatch.setenv("PMI_SIZE", "2")
    assert plugin.get_env_rank_and_size() == (1, 2)
    assert plugin.in_thread(lambda: None).daemon


def test_the_report_counts_per_file_and_lists_what_did_not_pass():
    results = {"test_tensorflow.py": [
        suite.Result(ID, "passed", 1.0),
        suite.Result(ID.replace("cpu", "gpu"), "skipped", 1.0),
        suite.Result(ID + "_fused", "failed", 1.0, message="a | b", mode="graph"),
    ]}
    meta = {"date": "d", "horovod": "v0.28.1", "np": 2, "timeout": 120, "machine": "m", "command": "c"}
    text = suite.markdown(results, meta)
    assert "| test_tensorflow.py | 3 | 1 | 2 | 1 | 1 | 0 |" in text
    assert "| `test_horovod_allreduce_cpu_fused` | failed | graph | a \\| b |" in text


def test_the_test_folder_is_found_from_a_checkout(tmp_path):
    parallel = tmp_path / "test" / "parallel"
    parallel.mkdir(parents=True)
    (parallel / "test_tensorflow.py").write_text("")
    assert suite.test_dir(tmp_path) == parallel.resolve()
    assert suite.test_dir(tmp_path / "test") == parallel.resolve()
    with pytest.raises(SystemExit):
        suite.test_dir(tmp_path / "nothing")


def test_skips_of_an_earlier_report_are_found_per_file(tmp_path):
    report = tmp_path / "before.json"
    report.write_text('{"results": {"test_tensorflow.py": [{"nodeid": "a", "outcome": "skipped", "message": "no GPU"},'
                      ' {"nodeid": "b", "outcome": "failed", "message": "x"}]}}')
    assert suite.earlier_skips(report, "test_tensorflow.py") == {"a": "no GPU"}
    assert suite.earlier_skips(report, "test_other.py") == {}
    assert suite.earlier_skips(None, "test_tensorflow.py") == {}
