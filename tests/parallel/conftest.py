"""Tests in this folder run inside an MPI world: `HVD_PARALLEL=1 mpiexec -n 2 python -m pytest
tests/parallel` (tests/integration/test_parallel.py does that). Every rank runs the same
tests in the same order, so their collectives meet. HVD_PARALLEL_MIN_RANKS=1 allows a
one-rank world, for the `gpu` tests on a machine with one GPU (benchmarks/gpu_check.sh).
HVD_PARALLEL_ONLY_GPU_SKIPS=1 (test_parallel.py sets it) fails the run where a test that is not
marked `gpu` skips: a skip there would count as a pass unseen."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

import pytest

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "-1")
os.environ.setdefault("TF_NUM_INTRAOP_THREADS", "1")
os.environ.setdefault("TF_NUM_INTEROP_THREADS", "1")


_SKIPPED_WITHOUT_GPU: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and "gpu" not in report.keywords:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _SKIPPED_WITHOUT_GPU.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _SKIPPED_WITHOUT_GPU and os.environ.get("HVD_PARALLEL_ONLY_GPU_SKIPS") == "1":
        print(f"\nHVD_PARALLEL_ONLY_GPU_SKIPS: {len(_SKIPPED_WITHOUT_GPU)} test(s) not marked gpu skipped:\n  "
              + "\n  ".join(_SKIPPED_WITHOUT_GPU), flush=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def hvd():
    import hvd_notebook.runtime as hvd

    hvd.init()
    minimum = int(os.environ.get("HVD_PARALLEL_MIN_RANKS", "2"))
    assert hvd.size() >= minimum, f"run these tests with mpiexec -n {max(minimum, 2)}"
    yield hvd
    hvd.shutdown()


@pytest.fixture(scope="session")
def tf():
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    return tf


def _in_threads(work: Callable[[Any], object], items: Iterable[Any]) -> dict[Any, BaseException]:
    errors: dict[Any, BaseException] = {}

    def run(item: Any) -> None:
        try:
            work(item)
        except BaseException as exc:  # noqa: BLE001 (collected for the assertion)
            errors[item] = exc

    threads = [threading.Thread(target=run, args=(item,)) for item in items]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a collective never finished"
    return errors


@pytest.fixture
def in_threads() -> Callable[[Callable[[Any], object], Iterable[Any]], dict[Any, BaseException]]:
    """``in_threads(work, items)`` runs ``work(item)`` in one thread per item and returns the exceptions raised,
    by item; it fails the test if a thread has not ended within 60 s (a collective that never finished)."""
    return _in_threads
