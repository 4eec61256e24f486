"""pytest plugin for ``horovod_suite.py``: what Horovod's test files need beyond ``horovod.tensorflow``,
and each rank's outcomes written where the harness reads them.

Loaded with ``-p horovod_suite_plugin`` in every rank (and in the collecting process):

- Horovod's test helpers import three small utilities from Horovod's own runner and common packages
  (``horovod.runner.util.threads.in_thread``, ``horovod.common.util.is_version_greater_equal_than``,
  ``horovod.runner.common.util.env.get_env_rank_and_size``). They are no part of the API a user meets,
  so the ``horovod`` alias does not serve them; this plugin registers equivalents for the test run only.
- With ``HVD_SUITE_REPORT_DIR`` set, each rank appends one JSON line per test phase to
  ``rank-<r>.jsonl`` there, as soon as the phase ends, so a hang still leaves what came before it.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import types
from pathlib import Path
from typing import Any

REPORT_DIR = "HVD_SUITE_REPORT_DIR"
EXCEPTION_LINE = re.compile(r"^\s*[\w.]*(Error|Exception|Exit): ")
RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "HOROVOD_RANK")


def in_thread(target: Any, args: tuple = (), name: str | None = None, daemon: bool = True,
              silent: bool = False) -> threading.Thread:
    """Run ``target(*args)`` in a started background thread (Horovod's ``in_thread``)."""
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple, not {type(args)}, for a single argument use (arg,)")

    def run(*a: Any) -> None:
        try:
            target(*a)
        except Exception:
            if not silent:
                raise

    thread = threading.Thread(target=run, args=args, name=name, daemon=daemon)
    thread.start()
    return thread


def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """``ver >= target`` as versions (Horovod's helper of the same name)."""
    from packaging import version

    if not (isinstance(ver, str) and isinstance(target, str)):
        raise ValueError(f"This function only accepts string arguments, got {ver!r} and {target!r}")
    return version.parse(ver) >= version.parse(target)


def get_env_rank_and_size() -> tuple[int, int]:
    """Rank and size from the launcher's environment; (0, 1) outside one (Horovod's helper)."""
    for rank_var, size_var in (("HOROVOD_RANK", "HOROVOD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                               ("PMI_RANK", "PMI_SIZE")):
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None:
            return int(rank), int(size)
        if rank is not None or size is not None:
            raise RuntimeError(f"Could not determine process rank and size: only one of {rank_var} and "
                               f"{size_var} found in environment")
    return 0, 1


HELPERS = {
    "horovod.runner.util.threads": {"in_thread": in_thread},
    "horovod.common.util": {"is_version_greater_equal_than": is_version_greater_equal_than},
    "horovod.runner.common.util.env": {"get_env_rank_and_size": get_env_rank_and_size},
}


def install_helpers() -> None:
    """Register the helper modules (and their parent packages) under the ``horovod`` alias."""
    import horovod  # the alias (or a real Horovod, whose own modules then win)

    if not hasattr(horovod, "__hvd_notebook_alias__"):
        return
    for name, attrs in HELPERS.items():
        parts = name.split(".")
        for i in range(2, len(parts) + 1):
            sub = ".".join(parts[:i])
            if sub not in sys.modules:
                module = types.ModuleType(sub, "Horovod test helper (horovod_suite_plugin)")
                if i < len(parts):
                    module.__path__ = []
                sys.modules[sub] = module
                setattr(sys.modules[".".join(parts[:i - 1])], parts[i - 1], module)
        vars(sys.modules[name]).update(attrs)


def rank() -> int:
    for var in RANK_VARIABLES:
        if var in os.environ:
            return int(os.environ[var])
    return 0


def first_error_line(report: Any) -> str:
    """The exception line of a failed phase, or the reason of a skip."""
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # a skip: (file, line, reason)
        return str(longrepr[2])
    crash = getattr(longrepr, "reprcrash", None)
    lines = (crash.message if crash is not None else str(longrepr)).strip().splitlines()
    if not lines:
        return ""
    if crash is None:
        return lines[-1]
    # TensorFlow's graph errors start "Graph execution error:"; the Python error they wrap comes last
    inner = [line.strip() for line in lines[1:] if EXCEPTION_LINE.match(line)]
    return f"{lines[0]} {inner[-1]}" if lines[0].endswith(":") and inner else lines[0]


def pytest_configure(config: Any) -> None:
    install_helpers()


def pytest_runtest_logreport(report: Any) -> None:
    directory = os.environ.get(REPORT_DIR)
    if not directory:
        return
    record = {"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
              "duration": round(report.duration, 3)}
    if report.outcome != "passed":
        record["message"] = first_error_line(report)
        if report.outcome == "failed":
            record["longrepr"] = str(report.longrepr)[-20000:]
    with open(Path(directory) / f"rank-{rank()}.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
