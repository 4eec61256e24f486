"""A pytest plugin for a rank of a world that must run every line of one module (``test_parallel.py``'s
``COVERED``): coverage.py measures that file alone, from the end of collection to the end of the run.

Started after collection, the tracer misses the imports of torch and the test files, most of what tracing
would cost, and nothing of the module: the module must not be imported before then (the plugin refuses the
run if it was), so its own import is measured too. ``HVD_LINE_COVERAGE``: the module's file, then the data
file (``os.pathsep`` between them); each rank writes the data file with its own suffix.
"""

from __future__ import annotations

import os
import sys

import pytest

_measuring: list = []


def _target() -> tuple[str, str]:
    module_file, data_file = os.environ["HVD_LINE_COVERAGE"].split(os.pathsep)
    return module_file, data_file


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    import coverage

    module_file, data_file = _target()
    early = [name for name, m in list(sys.modules.items()) if getattr(m, "__file__", None) == module_file]
    if early:
        raise pytest.UsageError(f"{early[0]} was imported before its lines were measured: import it in a fixture or "
                                "a test, not at a test file's top")
    measuring = coverage.Coverage(data_file=data_file, data_suffix=True, include=[module_file], config_file=False)
    measuring.start()
    _measuring.append(measuring)


def pytest_unconfigure(config: pytest.Config) -> None:
    while _measuring:
        measuring = _measuring.pop()
        measuring.stop()
        measuring.save()
