"""What brings a notebook's training back after its ranks were lost: the record of the ``%%hvd``
cells that completed (replayed on a new world), and the folder of rank 0's ``hvd.elastic`` commits
that outlives the world (a cell resumes from it after a dead rank)."""

from __future__ import annotations

import ast
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .. import private
from ..cluster.processes.workdir import clusters_dir
from ..config import ELASTIC_COMMIT_SUMMARY, ELASTIC_DIR
from .failures import HvdError


@dataclass(frozen=True)
class RecordedCell:
    """A ``%%hvd`` cell that completed since the last ``%hvd start``, as a replay runs it again."""

    code: str
    ranks: list[int] | None
    timeout: float | None

    @property
    def label(self) -> str:
        """The cell's first line of code, shortened."""
        first = next((line.strip() for line in self.code.splitlines() if line.strip()), "(empty)")
        return first if len(first) <= 60 else first[:57] + "..."


UNKNOWN = "*"  # what a cell that cannot be read binds: anything


def bound_names(code: str) -> list[str]:
    """The top-level names a cell's code binds, sorted: assignments (``=``, ``+=``, ``:=``), imports, ``def`` and
    ``class``, ``for``, ``with ... as``, ``except ... as`` and ``match`` targets, ``del`` (also inside ``if``,
    ``try``, loops, ...; not inside functions, classes or comprehensions, whose names are their own).
    IPython's syntax (``%magic``, ``!cmd``) is read as IPython runs it; ``[UNKNOWN]`` where it does not parse.

    Args:
        code: the cell's code.

    >>> bound_names("import numpy as np\nf = open('log')\nfor i, x in enumerate(y): pass")
    ['f', 'i', 'np', 'x']
    """
    from IPython.core.inputtransformer2 import TransformerManager

    try:
        tree = ast.parse(TransformerManager().transform_cell(code))
    except (SyntaxError, ValueError):
        return [UNKNOWN]
    names: set[str] = set()
    _bind(tree, names)
    return sorted(names)


_OWN_SCOPE = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.ListComp, ast.SetComp,
              ast.DictComp, ast.GeneratorExp)


def _bind(node: ast.AST, names: set[str]) -> None:
    """Add to ``names`` what ``node`` binds at the top level (``bound_names``)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(child.name)  # (its decorators and defaults bind nothing worth a replay)
        elif isinstance(child, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in child.names if a.name != "*")
        elif isinstance(child, ast.Name) and isinstance(child.ctx, (ast.Store, ast.Del)):
            names.add(child.id)
        elif isinstance(child, ast.ExceptHandler) and child.name:
            names.add(child.name)
        elif isinstance(child, (ast.MatchAs, ast.MatchStar)) and child.name:
            names.add(child.name)
        elif isinstance(child, ast.NamedExpr):
            names.add(child.target.id)  # (a walrus binds in the enclosing scope, even in a comprehension)
        if isinstance(child, _OWN_SCOPE):
            _walrus_only(child, names)
        else:
            _bind(child, names)


def _walrus_only(node: ast.AST, names: set[str]) -> None:
    """Inside a comprehension, only ``:=`` binds at the top level (not inside a function or class)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
        return
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.NamedExpr):
            names.add(child.target.id)
        _walrus_only(child, names)


def to_replay(cells: list[RecordedCell], binds: list[list[str]], unsaved: set[str]) -> list[RecordedCell]:
    """The cells a resume replays, in order: those that bind a name that could not be saved (or may bind
    anything, ``UNKNOWN``).

    Args:
        cells: the recorded cells, in order.
        binds: what each binds (``bound_names``).
        unsaved: the names no rank could save.
    """
    if not unsaved:
        return []
    return [cell for cell, names in zip(cells, binds) if UNKNOWN in names or unsaved & set(names)]


def replay(history: list[RecordedCell], run: Callable[[RecordedCell], object], say: Callable[[str], None]) -> int:
    """Run each recorded cell again with ``run``, in order, a line each through ``say``; a cell that
    fails stops the replay with an error naming it. The number of cells replayed.

    Args:
        history: the recorded cells, in order.
        run: runs one cell.
        say: shows a line per cell.
    """
    for i, recorded in enumerate(history, 1):
        started = time.monotonic()
        try:
            run(recorded)
        except HvdError as exc:
            raise HvdError(f"The replay stopped at cell {i} of {len(history)} ({recorded.label!r}): "
                           f"{exc}\nThe cells after it were not replayed; fix the cause, then run them "
                           "yourself.") from None
        say(f"replayed {i}/{len(history)}: {recorded.label} ({time.monotonic() - started:.1f} s)")
    return len(history)


class ElasticCommits:
    """The session's folder for rank 0's ``hvd.elastic`` commits (``HVD_NOTEBOOK_ELASTIC_DIR`` of its
    ranks), made at the first start, named by the kernel's PID (``hvd-notebook clean`` removes it
    once the kernel is gone), kept across restarts."""

    def __init__(self) -> None:
        self.path: Path | None = None

    def environment(self) -> tuple[str, str]:
        """The variable that points the ranks at the folder (made now where it does not exist)."""
        if self.path is None:
            self.path = Path(tempfile.mkdtemp(prefix=f"elastic-{os.getpid()}-", dir=clusters_dir()))
        return ELASTIC_DIR.name, str(self.path)

    def summary(self) -> str | None:
        """The line rank 0 wrote beside its last commit, where there is one: what a new world resumes from."""
        if self.path is None:
            return None
        try:
            return private.read_text(self.path / ELASTIC_COMMIT_SUMMARY).strip() or None
        except FileNotFoundError:
            return None

    def forget(self) -> None:
        """Drop the last commit: its cell has ended, and no later cell may resume from it."""
        if self.path is not None:
            for path in self.path.iterdir():
                path.unlink(missing_ok=True)

    def remove(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
