"""The package's layer rules, read from its source with ``ast`` (nothing is imported):

- no module-level import cycle anywhere in ``hvd_notebook``;
- only ``runtime/`` imports mpi4py or cupy;
- only ``cluster/`` starts or kills processes;
- only ``dashboard/`` imports a drawing library.

Each checker also runs on a small synthetic package, so that each rule is shown able to fail.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "hvd_notebook"

MPI_MODULES = frozenset({"mpi4py", "cupy"})
DRAWING_MODULES = frozenset({"ipywidgets", "bqplot", "matplotlib"})
# module functions that start, replace or signal a process, by their dotted name
PROCESS_FUNCTIONS = frozenset(
    {f"subprocess.{n}" for n in ("Popen", "run", "call", "check_call", "check_output", "getoutput",
                                 "getstatusoutput")}
    | {f"os.{n}" for n in ("kill", "killpg", "system", "popen", "fork", "forkpty", "posix_spawn", "posix_spawnp",
                           "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe",
                           "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe")}
    | {"signal.pthread_kill", "asyncio.create_subprocess_exec", "asyncio.create_subprocess_shell",
       "multiprocessing.Process"}
)
# methods that signal a process (psutil.Process, subprocess.Popen, ipyparallel launchers and its client)
PROCESS_METHODS = frozenset({"kill", "terminate", "send_signal"})
# what only the rank channel (cluster/channel.py) may touch: ipyparallel's client, and the private calls the
# channel makes on it (its queue question with a deadline, control requests of any type)
CHANNEL_MODULE = "hvd_notebook.cluster.launching.channel"
CLIENT_NAMES = frozenset({"client", "_client", "ipp_client"})
IPP_PRIVATE = frozenset({"_send", "_send_control_request", "_build_targets", "_query_stream", "_unwrap_exception"})


# ------------------------------------------------------------------ reading a package
@dataclass(frozen=True)
class Module:
    name: str  # dotted, e.g. hvd_notebook.runtime.core.basics
    path: Path
    is_package: bool  # an __init__.py
    tree: ast.Module

    @property
    def package(self) -> str:
        """The package a relative import of this module starts from."""
        return self.name if self.is_package else self.name.rpartition(".")[0]


def read_package(package_dir: Path) -> dict[str, Module]:
    """Every module under ``package_dir`` by dotted name, parsed."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts.pop()
        modules[".".join(parts)] = Module(".".join(parts), path, is_package, ast.parse(path.read_text(), str(path)))
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_time_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """The statements that run when the module is imported: everything but function bodies
    (and ``if TYPE_CHECKING:`` blocks); class bodies run, so they are included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue  # its decorators and defaults run, but hold no import statement
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield child
                yield from import_time_nodes(child)
            continue
        yield node
        yield from import_time_nodes(node)


def absolute_name(module: Module, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` names, with a relative one resolved."""
    if not node.level:
        return node.module or ""
    base = module.package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imported_modules(module: Module, node: ast.Import | ast.ImportFrom, known: set[str]) -> Iterator[str]:
    """The modules of ``known`` (or their dotted names, for outside ones) that one import statement
    runs: each package on the way (its ``__init__`` runs), and a name imported from a package that
    is one of its submodules."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = absolute_name(module, node)
        targets = [base]
        targets += [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            yield ".".join(parts[:i])


# ------------------------------------------------------------------ rule 1: no cycles
def all_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every statement, function bodies and ``if TYPE_CHECKING:`` blocks included: a lazy import or one
    for type checking couples two modules as much as one at the top."""
    return ast.walk(tree)


def import_graph(modules: dict[str, Module], nodes: Any = None) -> dict[str, dict[str, int]]:
    """module -> {module it imports at import time (or, with ``nodes=all_nodes``, anywhere): line of the import}.

    A module's own enclosing packages are left out: Python has them in ``sys.modules`` (initialised
    up to the import) before the module runs, so ``from .. import config`` depends on ``config``
    only. A name taken from an enclosing package that is not a submodule (``from . import x``
    where ``x`` is defined in ``__init__``) does depend on that package, and keeps its edge.
    """
    known = set(modules)
    graph: dict[str, dict[str, int]] = {name: {} for name in modules}
    for module in modules.values():
        ancestors = {module.name.rsplit(".", i)[0] for i in range(1, module.name.count(".") + 1)}
        ancestors.add(module.name)
        for node in (nodes or import_time_nodes)(module.tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = set(imported_modules(module, node, known)) & known
            if isinstance(node, ast.ImportFrom):
                base = absolute_name(module, node)
                takes_a_name = any(f"{base}.{a.name}" not in known for a in node.names)
                targets -= ancestors - ({base} if takes_a_name and base != module.name else set())
            else:
                targets -= ancestors
            for target in targets:
                graph[module.name].setdefault(target, node.lineno)
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (first module repeated at the end) per strongly connected component that has one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return [_cycle_in(graph, set(c), c[0]) for c in components]


def _cycle_in(graph: dict[str, dict[str, int]], component: set[str], start: str) -> list[str]:
    """A shortest path from ``start`` back to itself inside ``component`` (breadth first)."""
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in component:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in parents:
                    parents[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no cycle through {start}")


def describe_cycle(graph: dict[str, dict[str, int]], modules: dict[str, Module], cycle: list[str]) -> str:
    steps = [f"{a} (line {graph[a][b]} of {modules[a].path.name}) -> {b}" for a, b in zip(cycle, cycle[1:])]
    return "import cycle:\n    " + "\n    ".join(steps)


def cycle_violations(package_dir: Path, nodes: Any = None) -> list[str]:
    modules = read_package(package_dir)
    graph = import_graph(modules, nodes)
    return [describe_cycle(graph, modules, c) for c in find_cycles(graph)]


# ------------------------------------------------------------------ rules 2-4: who may do what
def _outside(modules: dict[str, Module], allowed: str | tuple[str, ...]) -> Iterator[Module]:
    owners = (allowed,) if isinstance(allowed, str) else allowed
    for module in modules.values():
        if not any(module.name == a or module.name.startswith(a + ".") for a in owners):
            yield module


def _where(module: Module, node: ast.AST) -> str:
    return f"{module.name} (line {node.lineno})"


def _in_order(found: list[tuple[str, int, str]]) -> list[str]:
    """Violations sorted by module and line (``ast.walk`` goes breadth first)."""
    return [text for _, _, text in sorted(found)]


def import_violations(package_dir: Path, forbidden: frozenset[str], allowed: str) -> list[str]:
    """Imports of ``forbidden`` top-level modules, at any level (in functions too), outside package
    ``allowed``; ``importlib.import_module`` and ``__import__`` of a constant name count."""
    found = []
    for module in _outside(read_package(package_dir), allowed):
        for node in ast.walk(module.tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif (isinstance(node, ast.Call) and _call_name(node.func) in ("import_module", "__import__")
                  and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                names = [node.args[0].value]
            for name in names:
                if name.split(".")[0] in forbidden:
                    found.append((module.name, node.lineno, f"{_where(module, node)} imports {name}"))
    return _in_order(found)


def _call_name(func: ast.expr) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _aliases(tree: ast.Module) -> dict[str, str]:
    """Local name -> the dotted name it stands for, from every import in the module."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.asname:
                    names[a.asname] = a.name
                else:
                    names[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for a in node.names:
                names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """``a.b.c`` with its first name replaced by what the module imported under it; None if not
    a plain dotted name."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([aliases.get(node.id, node.id), *reversed(attrs)])


def _receiver_name(node: ast.expr) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def process_violations(package_dir: Path, allowed: str | tuple[str, ...]) -> list[str]:
    """Calls or references that start, replace or signal a process, outside the packages ``allowed``."""
    found = []
    for module in _outside(read_package(package_dir), allowed):
        aliases = _aliases(module.tree)
        for node in ast.walk(module.tree):
            if isinstance(node, (ast.Attribute, ast.Name)):
                name = _dotted(node, aliases)
                if name in PROCESS_FUNCTIONS:
                    found.append((module.name, node.lineno, f"{_where(module, node)} uses {name}"))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                method, receiver = node.func.attr, _receiver_name(node.func.value)
                # (os.kill and its kind: reported above)
                if method in PROCESS_METHODS and _dotted(node.func, aliases) not in PROCESS_FUNCTIONS:
                    found.append((module.name, node.lineno,
                                  f"{_where(module, node)} calls {receiver or '<expression>'}.{method}()"))
    return _in_order(found)


def channel_violations(package_dir: Path, kernel: str, channel: str) -> list[str]:
    """Outside the rank channel (module ``channel``): ipyparallel's private client calls anywhere; and in
    package ``kernel``, an import of ipyparallel or any name of its client."""
    found = []
    for module in _outside(read_package(package_dir), channel):
        in_kernel = module.name == kernel or module.name.startswith(kernel + ".")
        for node in ast.walk(module.tree):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else (
                node.arg if isinstance(node, ast.arg) else None)
            if name in IPP_PRIVATE:
                found.append((module.name, node.lineno, f"{_where(module, node)} calls ipyparallel's {name}"))
            elif in_kernel and name in CLIENT_NAMES:
                found.append((module.name, node.lineno, f"{_where(module, node)} names the client ({name})"))
            elif in_kernel and isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                found += [(module.name, node.lineno, f"{_where(module, node)} imports {n}")
                          for n in names if n.split(".")[0] == "ipyparallel" and not getattr(node, "level", 0)]
    return _in_order(found)


# which layers each layer may import (at any level: a lazy import couples as much), so that data flows
# one way: kernel -> cluster / engine -> runtime, and progress engine -> (IOPub) -> dashboard
MAY_IMPORT = {
    "config": set(),
    "commands": set(),  # the commands of %hvd and hvd-notebook, declared once for both front ends
    "messages": set(),  # what crosses layers (progress, rank events, a bootstrap's report, status rows), typed
    "private": set(),  # the user's private folder and the checked reads and writes: used by every layer
    "liveness": set(),  # the one check of whether a process is alive: the node, processes, engines and panel ask
    "keras_flavour": set(),  # which Keras (3, or 2's tf_keras) the process trains with: one choice for all
    "keras_patches": {"keras_flavour"},  # every global change to Keras, with undo; imported by the layers that patch
    "rankwatch": {"config", "private"},  # the watcher hvd.init() starts beside a rank of a plain mpiexec run
    "runtime": {"runtime", "config", "private", "rankwatch", "keras_flavour", "keras_patches", "messages"},
    "cluster": {"cluster", "engine", "config", "private", "liveness", "messages"},  # engine: the bootstrap it runs
    "dashboard": {"dashboard", "config", "messages"},
    "engine": {"engine", "runtime", "config", "private", "liveness", "keras_flavour", "keras_patches", "messages"},
    "kernel": {"kernel", "cluster", "engine", "dashboard", "config", "private", "messages", "commands"},
    "lab": {"lab", "cluster", "config", "private", "liveness", "messages"},  # JupyterLab's panel: the server side
}


FRONT_ENDS = ("cli", "scaling", "progress", "__main__")  # with the package's __init__: what a user calls


def layer_of(name: str) -> str | None:
    """``runtime`` for hvd_notebook.runtime.core.basics; None for the package's front ends (``__init__``, ``cli``
    and the commands behind it, ``progress``), which may import any layer and which no layer may import: domain
    code in a front end would be out of every rule's reach."""
    parts = name.split(".")[1:]
    if not parts or parts[0] in FRONT_ENDS:
        return None
    return parts[0]


def named_modules(module: Module, node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    """The modules an import statement names (not the packages on the way to them): ``import a.b``
    names a.b; ``from a import b`` names a.b where that is a module, else a."""
    if isinstance(node, ast.Import):
        return {alias.name for alias in node.names}
    base = absolute_name(module, node)
    names = {f"{base}.{alias.name}" for alias in node.names}
    return (names & known) | ({base} if names - known else set())


def direction_violations(package_dir: Path) -> list[str]:
    """Imports, at any level, from a layer into one it may not import."""
    modules = read_package(package_dir)
    found = []
    for module in modules.values():
        layer = layer_of(module.name)
        if layer is None:
            continue
        allowed = MAY_IMPORT.get(layer, {layer})
        for node in ast.walk(module.tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in sorted(named_modules(module, node, set(modules)) & set(modules)):
                if layer_of(target) is None:
                    found.append((module.name, node.lineno, f"{_where(module, node)}: {layer} imports {target}, a "
                                  "front end (move what it needs into a layer)"))
                elif layer_of(target) not in allowed:
                    found.append((module.name, node.lineno, f"{_where(module, node)}: {layer} imports {target}"))
    return _in_order(found)


# ------------------------------------------------------------------ the rules, on hvd_notebook
def _report(violations: list[str]) -> str:
    return f"{len(violations)} violation(s):\n" + "\n".join(violations)


def test_no_import_cycle():
    violations = cycle_violations(PACKAGE)
    assert not violations, _report(violations)


def test_no_import_cycle_through_lazy_or_type_checking_imports():
    violations = cycle_violations(PACKAGE, nodes=all_nodes)
    assert not violations, _report(violations)


def unit_of(name: str, split: set[str]) -> str:
    """The part of the package a module belongs to: its sub-package in a layer cut into sub-packages (``split``:
    cluster.node, runtime.core), a module directly in such a layer on its own (cluster.finding), else its layer or
    top-level module (kernel, config)."""
    parts = name.split(".")[1:]
    return ".".join(parts[:2] if parts and parts[0] in split else parts[:1])


def unit_cycle_violations(package_dir: Path) -> list[str]:
    """Import cycles between the package's parts (``unit_of``), through imports at any level: two sub-packages
    that import each other are one concern, or hide one that belongs below both."""
    modules = read_package(package_dir)
    split = {m.name.split(".")[1] for m in modules.values() if m.is_package and m.name.count(".") == 2}
    graph: dict[str, dict[str, int]] = {}
    where: dict[tuple[str, str], str] = {}
    for source, targets in import_graph(modules, all_nodes).items():
        a = unit_of(source, split)
        graph.setdefault(a, {})
        for target, line in sorted(targets.items(), key=lambda t: (-len(t[0]), t[0])):  # (the module, not its package)
            b = unit_of(target, split)
            if a != b and b not in graph[a]:
                graph[a][b] = line
                where[a, b] = f"{source} (line {line}) imports {target}"
            graph.setdefault(b, {})
    return ["import cycle between parts:\n    " + "\n    ".join(where[a, b] for a, b in zip(c, c[1:]))
            for c in find_cycles(graph)]


def test_no_import_cycle_between_sub_packages():
    violations = unit_cycle_violations(PACKAGE)
    assert not violations, _report(violations)


def test_a_cycle_between_sub_packages_is_found(tmp_path):
    # no module imports itself back, but cluster.node and cluster.processes import each other
    pkg = write_package(tmp_path, {
        "cluster/node/shm.py": "from ..processes.pids import alive\n",
        "cluster/processes/pids.py": "",
        "cluster/processes/reaper.py": "def f():\n    from ..node import shm\n",
        "cluster/finding.py": "from .node import shm\nfrom .processes import reaper\n",
        "kernel/a.py": "from ..cluster import finding\n",
    })
    assert cycle_violations(pkg, nodes=all_nodes) == []
    (violation,) = unit_cycle_violations(pkg)
    assert "pkg.cluster.node.shm (line 1) imports pkg.cluster.processes.pids" in violation
    assert "pkg.cluster.processes.reaper (line 2) imports pkg.cluster.node.shm" in violation


def test_only_the_runtime_imports_mpi4py_and_cupy():
    violations = import_violations(PACKAGE, MPI_MODULES, "hvd_notebook.runtime")
    assert not violations, _report(violations)


# the cluster layer, and the watcher that hvd.init() starts beside a rank of a plain mpiexec run: a module below
# the runtime (it imports config and private only), so that the runtime imports no layer above it
PROCESS_OWNERS = ("hvd_notebook.cluster", "hvd_notebook.rankwatch")


def test_only_the_cluster_starts_or_kills_processes():
    violations = process_violations(PACKAGE, PROCESS_OWNERS)
    assert not violations, _report(violations)


def test_only_the_rank_channel_touches_ipyparallels_client():
    violations = channel_violations(PACKAGE, "hvd_notebook.kernel", CHANNEL_MODULE)
    assert not violations, _report(violations)


def test_only_the_dashboard_draws():
    violations = import_violations(PACKAGE, DRAWING_MODULES, "hvd_notebook.dashboard")
    assert not violations, _report(violations)


def test_layers_import_only_the_layers_below():
    violations = direction_violations(PACKAGE)
    assert not violations, _report(violations)


def test_every_module_is_in_a_layer():
    strays = [name for name in read_package(PACKAGE) if layer_of(name) not in (None, *MAY_IMPORT)]
    assert not strays, f"modules outside the layers of MAY_IMPORT (move them into one, or add a layer): {strays}"


def test_the_package_is_read_whole():
    modules = read_package(PACKAGE)
    for name in ("hvd_notebook", "hvd_notebook.config", "hvd_notebook.runtime",
                 "hvd_notebook.cluster.launching.cluster", "hvd_notebook.kernel.magics", "hvd_notebook.dashboard"):
        assert name in modules
    graph = import_graph(modules)
    # the extension's entry points import the kernel side lazily, in functions: no edge
    assert "hvd_notebook.kernel.magics" not in graph["hvd_notebook"]


# ------------------------------------------------------------------ the checkers can fail
def write_package(root: Path, files: dict[str, str]) -> Path:
    """A package ``pkg`` under ``root`` from {relative path: source}."""
    for rel, source in files.items():
        path = root / "pkg" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    for folder in {p.parent for p in (root / "pkg").rglob("*.py")}:
        (folder / "__init__.py").touch()
    return root / "pkg"


def test_a_cycle_is_found_and_printed(tmp_path):
    pkg = write_package(tmp_path, {
        "low/a.py": "from . import b\n",
        "low/b.py": "import os\nfrom ..high import c\n",
        "high/c.py": "from ..low.a import thing\n",
    })
    (violation,) = cycle_violations(pkg)
    assert "pkg.high.c (line 1 of c.py) -> pkg.low.a" in violation
    assert "pkg.low.a (line 1 of a.py) -> pkg.low.b" in violation
    assert "pkg.low.b (line 2 of b.py) -> pkg.high.c" in violation


def test_a_cycle_through_a_package_init(tmp_path):
    # importing pkg.sub.m runs pkg/sub/__init__.py, which imports pkg.a back
    pkg = write_package(tmp_path, {"a.py": "import pkg.sub.m\n", "sub/__init__.py": "from .. import a\n",
                                   "sub/m.py": ""})
    (violation,) = cycle_violations(pkg)
    assert "pkg.a" in violation and "-> pkg.sub\n" in violation + "\n"


def test_a_name_from_the_own_package_init_is_a_cycle(tmp_path):
    pkg = write_package(tmp_path, {"__init__.py": "from .m import f\nVALUE = 1\n", "m.py": "from . import VALUE\n"})
    assert cycle_violations(pkg)


def test_what_is_not_a_cycle(tmp_path):
    pkg = write_package(tmp_path, {
        "__init__.py": "from .m import f\n",
        "m.py": "from . import n\n",  # a submodule, not the package's __init__
        "sub/x.py": "from .. import m\nfrom ..n import g\n",
        "n.py": textwrap.dedent("""\
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from .m import f
            def g():
                from .m import f
                return f
        """),
    })
    assert cycle_violations(pkg) == []


def test_a_self_import_is_a_cycle(tmp_path):
    graph = {"a": {"a": 1}, "b": {}}
    assert find_cycles(graph) == [["a", "a"]]


def test_mpi_outside_the_runtime_is_found_even_in_a_function(tmp_path):
    pkg = write_package(tmp_path, {
        "runtime/ok.py": "from mpi4py import MPI\nimport cupy\n",
        "engine/bad.py": "def f():\n    from mpi4py import MPI\n    return MPI\n",
        "engine/worse.py": "import importlib\ncp = importlib.import_module('cupy.cuda')\n",
    })
    found = import_violations(pkg, MPI_MODULES, "pkg.runtime")
    assert found == ["pkg.engine.bad (line 2) imports mpi4py", "pkg.engine.worse (line 2) imports cupy.cuda"]


def test_drawing_outside_the_dashboard_is_found(tmp_path):
    pkg = write_package(tmp_path, {"dashboard/view.py": "import ipywidgets\n",
                                   "kernel/s.py": "import matplotlib.pyplot as plt\n"})
    assert import_violations(pkg, DRAWING_MODULES, "pkg.dashboard") == ["pkg.kernel.s (line 1) imports "
                                                                        "matplotlib.pyplot"]


def test_processes_outside_the_cluster_are_found(tmp_path):
    pkg = write_package(tmp_path, {
        "cluster/ok.py": "import subprocess, os\nsubprocess.run(['x'])\nos.kill(1, 9)\n",
        "kernel/bad.py": textwrap.dedent("""\
            import os
            import subprocess as sp
            from os import killpg as kp
            import psutil
            sp.Popen(['x'])
            kp(1, 9)
            os.execv('/bin/true', [])
            psutil.Process(1).terminate()
            handle.kill()
            client.send_signal(2)  # ipyparallel: a request to the engines
            self.client.send_signal(2)
            proc.send_signal(2)
            os.getpid()
        """),
    })
    found = process_violations(pkg, "pkg.cluster")
    assert found == [
        "pkg.kernel.bad (line 5) uses subprocess.Popen",
        "pkg.kernel.bad (line 6) uses os.killpg",
        "pkg.kernel.bad (line 7) uses os.execv",
        "pkg.kernel.bad (line 8) calls <expression>.terminate()",
        "pkg.kernel.bad (line 9) calls handle.kill()",
        "pkg.kernel.bad (line 10) calls client.send_signal()",
        "pkg.kernel.bad (line 11) calls client.send_signal()",
        "pkg.kernel.bad (line 12) calls proc.send_signal()",
    ], found


def test_the_client_outside_the_rank_channel_is_found(tmp_path):
    pkg = write_package(tmp_path, {
        "cluster/channel.py": "import ipyparallel\nself._client._send(s, 'queue_request')\n",
        "cluster/world.py": "self.channel = RankChannel(ipp_cluster.connect_client_sync())\nc._build_targets([1])\n",
        "kernel/cell.py": textwrap.dedent("""\
            from ipyparallel import util
            import ipyparallel as ipp
            from .channel import client
            cluster.client[0].execute(code)
            def ask(client): pass
            cluster.channel.execute(code, [0])
        """),
    })
    found = channel_violations(pkg, "pkg.kernel", "pkg.cluster.channel")
    assert found == [
        "pkg.cluster.world (line 2) calls ipyparallel's _build_targets",
        "pkg.kernel.cell (line 1) imports ipyparallel",
        "pkg.kernel.cell (line 2) imports ipyparallel",
        "pkg.kernel.cell (line 4) names the client (client)",
        "pkg.kernel.cell (line 5) names the client (client)",
    ], found


@pytest.mark.parametrize("source", ["from subprocess import run\nrun(['x'])\n",
                                    "import subprocess\nf = subprocess.call\n",
                                    "import signal\nsignal.pthread_kill(1, 9)\n", "import os\nos.system('x')\n"])
def test_each_way_to_start_a_process_is_found(tmp_path, source):
    pkg = write_package(tmp_path, {"engine/m.py": source})
    assert process_violations(pkg, "pkg.cluster")


def test_an_import_against_the_flow_is_found(tmp_path):
    pkg = write_package(tmp_path, {
        "runtime/basics.py": "from ..config import X\n",
        "runtime/bad.py": "def f():\n    from ..kernel import session\n",
        "engine/ok.py": "from ..messages import Update\nfrom .. import runtime\n",
        "engine/bad.py": "from ..dashboard import view\n",
        "messages.py": "", "dashboard/view.py": "", "kernel/session.py": "", "config.py": "",
    })
    assert direction_violations(pkg) == [
        "pkg.engine.bad (line 1): engine imports pkg.dashboard.view",
        "pkg.runtime.bad (line 2): runtime imports pkg.kernel.session",
    ]


def test_the_runtime_importing_the_cluster_is_found(tmp_path):
    pkg = write_package(tmp_path, {
        "runtime/core/world.py": "from ...cluster.processes.rankwatch import RankWatch\n"
                                 "from ...rankwatch import RankWatch\n",
        "cluster/processes/rankwatch.py": "", "rankwatch.py": "from . import private\nfrom .cluster import errors\n",
        "private.py": "", "cluster/errors.py": "",
    })
    assert direction_violations(pkg) == [
        "pkg.rankwatch (line 2): rankwatch imports pkg.cluster.errors",
        "pkg.runtime.core.world (line 1): runtime imports pkg.cluster.processes.rankwatch",
    ]


def test_an_import_of_a_front_end_is_found(tmp_path):
    # a front end may import any layer, so no layer may import one: that is no way around the rules
    pkg = write_package(tmp_path, {
        "cli.py": "from .cluster.finding import find\n", "cluster/finding.py": "", "scaling.py": "",
        "lab/readings.py": "from ..cli import find\n",
        "kernel/magics.py": "def f():\n    from .. import scaling\n",
    })
    assert direction_violations(pkg) == [
        "pkg.kernel.magics (line 2): kernel imports pkg.scaling, a front end (move what it needs into a layer)",
        "pkg.lab.readings (line 1): lab imports pkg.cli, a front end (move what it needs into a layer)",
    ]


# ipyparallel's replies, which the rank channel turns into its own (``cluster/launching/replies.py``): names of
# its AsyncResult and errors, and the keys of its ``metadata`` record of a request's output
IPP_REPLY_NAMES = frozenset({"AsyncResult", "AsyncMapResult", "RemoteError", "EngineError", "CompositeError",
                             "wait_for_output", "apply_async", "get_dict", "engine_id", "msg_ids"})
IPP_REPLY_KEYS = frozenset({"stdout", "stderr", "outputs", "execute_result", "execute_input", "engine_uuid"})


def _reads_metadata(node: ast.AST) -> bool:
    """``x.metadata[...]`` or ``x.metadata.get(...)``: a read of ipyparallel's record of a request."""
    if isinstance(node, ast.Subscript):
        target = node.value
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        target = node.func.value
    else:
        return False
    return isinstance(target, ast.Attribute) and target.attr == "metadata"


def _reply_key(node: ast.AST) -> str | None:
    """The key where ``node`` reads one of ipyparallel's reply keys: ``r["stdout"]``, ``r.get("stdout")``."""
    if isinstance(node, ast.Subscript):
        key = node.slice
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args:
        key = node.args[0]
    else:
        return None
    return key.value if isinstance(key, ast.Constant) and key.value in IPP_REPLY_KEYS else None


def _imported_reply(node: ast.Import | ast.ImportFrom) -> str | None:
    """What of ipyparallel an import takes: ipyparallel itself, or a name of its replies from anywhere."""
    if isinstance(node, ast.Import):
        return next((a.name for a in node.names if a.name.split(".")[0] == "ipyparallel"), None)
    if not node.level and (node.module or "").split(".")[0] == "ipyparallel":
        return node.module
    return next((f"{node.module}.{a.name}" for a in node.names if a.name in IPP_REPLY_NAMES), None)


def reply_violations(package_dir: Path, kernel: str) -> list[str]:
    """In package ``kernel``: an import of ipyparallel, a name of its replies (``IPP_REPLY_NAMES``), a read of
    a request's ``metadata`` or of one of its keys: the notebook side reads the rank channel's own replies."""
    found = []
    for module in read_package(package_dir).values():
        if module.name != kernel and not module.name.startswith(kernel + "."):
            continue
        for node in ast.walk(module.tree):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if isinstance(node, ast.Import | ast.ImportFrom):
                what = _imported_reply(node)
                if what is not None:
                    found.append((module.name, node.lineno, f"{_where(module, node)} imports {what}"))
            elif name in IPP_REPLY_NAMES:
                found.append((module.name, node.lineno, f"{_where(module, node)} names ipyparallel's {name}"))
            elif _reads_metadata(node):
                found.append((module.name, node.lineno, f"{_where(module, node)} reads ipyparallel's metadata"))
            elif _reply_key(node) is not None:
                found.append((module.name, node.lineno, f"{_where(module, node)} reads ipyparallel's key "
                              f"{_reply_key(node)!r}"))
    return _in_order(found)


def test_the_kernel_reads_no_ipyparallel_reply():
    violations = reply_violations(PACKAGE, "hvd_notebook.kernel")
    assert not violations, _report(violations)


def test_an_ipyparallel_reply_read_in_the_kernel_is_found(tmp_path):
    pkg = write_package(tmp_path, {
        "cluster/channel.py": "from ipyparallel import AsyncResult\nr.metadata['stdout']\n",
        "kernel/cell.py": textwrap.dedent("""\
            import ipyparallel
            from ipyparallel.error import RemoteError
            from ..cluster.channel import AsyncResult
            part.metadata["stdout"]
            part.metadata.get("data")
            whole.wait_for_output(5.0)
            record["execute_result"]
            record.get("outputs", [])
            isinstance(error, EngineError)
            reply.stdout + reply.stderr
            value.metadata
            bundle["data"]
            from .forwarding import CellOutput
        """),
    })
    found = reply_violations(pkg, "pkg.kernel")
    assert found == [
        "pkg.kernel.cell (line 1) imports ipyparallel",
        "pkg.kernel.cell (line 2) imports ipyparallel.error",
        "pkg.kernel.cell (line 3) imports cluster.channel.AsyncResult",
        "pkg.kernel.cell (line 4) reads ipyparallel's metadata",
        "pkg.kernel.cell (line 5) reads ipyparallel's metadata",
        "pkg.kernel.cell (line 6) names ipyparallel's wait_for_output",
        "pkg.kernel.cell (line 7) reads ipyparallel's key 'execute_result'",
        "pkg.kernel.cell (line 8) reads ipyparallel's key 'outputs'",
        "pkg.kernel.cell (line 9) names ipyparallel's EngineError",
    ], found


# ------------------------------------------------------------------ one liveness check
LIVENESS_MODULE = "hvd_notebook.liveness"  # the one check: a zombie is not alive
LIVENESS_CALLS = frozenset({"pid_exists", "is_running"})  # psutil's, which call a zombie alive
EXISTS_CALLS = frozenset({"exists", "lexists", "isdir", "is_dir"})


def _proc_of_a_pid(node: ast.AST) -> bool:
    """``f"/proc/{pid}"`` and nothing after it: a process's folder, whose existence says the PID exists."""
    return (isinstance(node, ast.JoinedStr) and len(node.values) == 2 and isinstance(node.values[0], ast.Constant)
            and node.values[0].value == "/proc/" and isinstance(node.values[1], ast.FormattedValue))


def liveness_violations(package_dir: Path, home: str = LIVENESS_MODULE) -> list[str]:
    """Questions of liveness asked outside module ``home``: ``os.kill(pid, 0)``, psutil's ``pid_exists`` and
    ``is_running``, a test that ``/proc/PID`` exists."""
    found = []
    for module in _outside(read_package(package_dir), home):
        aliases = _aliases(module.tree)
        for node in ast.walk(module.tree):
            if not isinstance(node, ast.Call):
                continue
            name, what = _call_name(node.func), None
            if name in LIVENESS_CALLS:
                what = f"{name}()"
            elif (_dotted(node.func, aliases) == "os.kill" and len(node.args) == 2
                  and isinstance(node.args[1], ast.Constant) and node.args[1].value == 0):
                what = "os.kill(pid, 0)"
            elif name in EXISTS_CALLS and any(_proc_of_a_pid(n) for n in ast.walk(node)):
                what = f"/proc/PID {name}()"
            if what:
                found.append((module.name, node.lineno, f"{_where(module, node)} asks {what}: use liveness.alive"))
    return _in_order(found)


def test_one_liveness_check():
    violations = liveness_violations(PACKAGE)
    assert not violations, _report(violations)


def test_a_liveness_check_of_its_own_is_found(tmp_path):
    pkg = write_package(tmp_path, {
        "liveness.py": "import psutil\ndef alive(p):\n    return p.is_running()\n",
        "engine/stores.py": textwrap.dedent("""\
            import os
            import psutil
            from pathlib import Path
            psutil.pid_exists(pid)
            os.kill(pid, 0)
            proc.is_running()
            Path(f"/proc/{pid}").exists()
            os.path.isdir(f"/proc/{pid}")
            os.kill(pid, 9)
            open(f"/proc/{pid}/stat")
            Path(f"/proc/{pid}/fd").exists()
        """),
    })
    assert liveness_violations(pkg, "pkg.liveness") == [
        "pkg.engine.stores (line 4) asks pid_exists(): use liveness.alive",
        "pkg.engine.stores (line 5) asks os.kill(pid, 0): use liveness.alive",
        "pkg.engine.stores (line 6) asks is_running(): use liveness.alive",
        "pkg.engine.stores (line 7) asks /proc/PID exists(): use liveness.alive",
        "pkg.engine.stores (line 8) asks /proc/PID isdir(): use liveness.alive",
    ]


# ------------------------------------------------------------------ size
MAX_CLASS_LINES = 250  # a class longer than this holds more than one concern: split it


def long_classes(package_dir: Path, limit: int = MAX_CLASS_LINES) -> list[str]:
    """Classes of more than ``limit`` lines (decorators to the last line of the body)."""
    found = []
    for module in read_package(package_dir).values():
        for node in ast.walk(module.tree):
            if isinstance(node, ast.ClassDef):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                lines = node.end_lineno - first + 1  # type: ignore[operator]
                if lines > limit:
                    found.append((module.name, node.lineno, f"{_where(module, node)}: class {node.name} has {lines} "
                                  f"lines (at most {limit})"))
    return _in_order(found)


def test_no_class_is_longer_than_250_lines():
    violations = long_classes(PACKAGE)
    assert not violations, _report(violations)


def test_a_long_class_is_found(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(5))
    source = f"import dataclasses\n\n@dataclasses.dataclass\nclass Big:\n{body}"
    pkg = write_package(tmp_path, {"kernel/big.py": source})
    assert long_classes(pkg, limit=7) == []  # (7 lines with its decorator)
    assert long_classes(pkg, limit=6) == ["pkg.kernel.big (line 4): class Big has 7 lines (at most 6)"]


def test_no_class_is_longer_than_200_lines():
    """The ceiling the style sets (DESIGN.md): no class is exempt from it."""
    violations = long_classes(PACKAGE, limit=200)
    assert not violations, _report(violations)


# ------------------------------------------------------------------ what a user reads
OTHER_PREFIXES = ("[hvd]", "hvd-notebook run:")  # what lines once started with, beside config.PREFIX


def prefix_violations(package_dir: Path) -> list[str]:
    """String literals (f-strings' first parts too) that start a line the user reads with another prefix than
    ``config.PREFIX``."""
    found = []
    for module in read_package(package_dir).values():
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                for line in node.value.splitlines():
                    if line.lstrip().startswith(OTHER_PREFIXES):
                        found.append((module.name, node.lineno, f"{_where(module, node)}: {line.strip()[:60]!r}"))
    return _in_order(found)


def test_one_prefix_starts_what_the_user_reads():
    violations = prefix_violations(PACKAGE)
    assert not violations, _report(violations)


PREFIX_TEXT = "[hvd_notebook]"  # config.PREFIX, as text: read here, not imported


def written_prefix_violations(package_dir: Path, home: str = "config") -> list[str]:
    """String literals (f-strings' parts too) that write the prefix out, in any module but ``home``: the prefix
    is one constant, and a second copy drifts."""
    found = []
    for module in read_package(package_dir).values():
        if module.name.rpartition(".")[2] == home:
            continue
        for node in ast.walk(module.tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and PREFIX_TEXT in node.value:
                found.append((module.name, node.lineno, f"{_where(module, node)} writes {PREFIX_TEXT} out: "
                              "use config.PREFIX"))
    return _in_order(found)


def test_the_prefix_is_written_out_only_in_config():
    assert PREFIX_TEXT in (PACKAGE / "config.py").read_text()
    violations = written_prefix_violations(PACKAGE)
    assert not violations, _report(violations)


def test_a_written_out_prefix_is_found(tmp_path):
    pkg = write_package(tmp_path, {"config.py": 'PREFIX = "[hvd_notebook]"\n',
                                   "kernel/say.py": 'from ..config import PREFIX\nprint(f"{PREFIX} ok")\n'
                                   'print(f"[hvd_notebook] rank {r} failed")\n'})
    assert written_prefix_violations(pkg) == ["pkg.kernel.say (line 3) writes [hvd_notebook] out: use config.PREFIX"]


def test_another_prefix_is_found(tmp_path):
    pkg = write_package(tmp_path, {"kernel/say.py": 'print(f"[hvd] sweep: {n} points")\nx = "ok\\n[hvd] late"\n'
                                   'y = "[hvd_notebook] fine"\n'})
    assert prefix_violations(pkg) == ["pkg.kernel.say (line 1): '[hvd] sweep:'", "pkg.kernel.say (line 2): "
                                      "'[hvd] late'"]


# ------------------------------------------------------------------ one device module in the PyTorch binding
TORCH_BINDING = PACKAGE / "runtime" / "torch"
# what only the binding's device module says: CUDA's calls, cupy, and a host wait on a stream or an event
# (``self.synchronize(`` and ``optimizer.synchronize(`` are DistributedOptimizer's own method, Horovod's API)
DEVICE_ONLY = (r"torch\.cuda", r"cupy", r"(?<!self)(?<!optimizer)\.synchronize\(")


def device_violations(binding_dir: Path, home: str = "device.py") -> list[str]:
    """The lines of ``binding_dir``'s modules other than ``home`` that say one of ``DEVICE_ONLY``."""
    import re

    pattern = re.compile("|".join(DEVICE_ONLY))
    found = []
    for path in sorted(binding_dir.glob("*.py")):
        if path.name == home:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            match = pattern.search(line)
            if match:
                found.append(f"{path.name} (line {number}) says {match.group(0)}")
    return found


def test_every_cuda_call_of_the_torch_binding_is_in_its_device_module():
    violations = device_violations(TORCH_BINDING)
    assert not violations, "\n".join(violations) + "\n(move them into hvd_notebook/runtime/torch/device.py)"


def test_a_cuda_call_outside_the_device_module_is_found(tmp_path):
    for name, text in {"device.py": "torch.cuda.synchronize()\nimport cupy\n",
                       "ops.py": "def f(t):\n    return t.cuda()\nsynchronize(handle)\nself.synchronize()\n",
                       "bad.py": "s = torch.cuda.current_stream()\nevent.synchronize()\n# cupy\n"}.items():
        (tmp_path / name).write_text(text)
    assert device_violations(tmp_path) == ["bad.py (line 1) says torch.cuda", "bad.py (line 2) says .synchronize(",
                                           "bad.py (line 3) says cupy"]


# ------------------------------------------------------------------ one cupy module in the core and TensorFlow
CUPY_HOME = PACKAGE / "runtime" / "core" / "nccl_backend.py"  # the GPU's array module, NCCL and DLPack
CUPY_SCOPE = (PACKAGE / "runtime" / "core", PACKAGE / "runtime" / "tensorflow")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of ``tree`` (what a user reads may name cupy: it takes cupy arrays)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def _says_cupy(node: ast.AST, docstrings: set[int]) -> str | None:
    """What ``node`` says of cupy in code: an import, a name, an attribute, an argument, or a string naming
    the module (``type(x).__module__.startswith("cupy")``); None where it says nothing of it."""
    import re

    if isinstance(node, ast.Import):
        texts = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom):
        texts = [node.module or "", *(a.name for a in node.names)]
    elif isinstance(node, ast.Name):
        texts = [node.id]
    elif isinstance(node, ast.Attribute):
        texts = [node.attr]
    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        texts = [node.name]
    elif isinstance(node, ast.arg):
        texts = [node.arg]
    elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
        return node.value if re.fullmatch(r"cupy(\.[\w.]*)?", node.value) else None
    else:
        return None
    return next((t for t in texts if "cupy" in t.lower()), None)


def cupy_violations(folders: tuple[Path, ...], home: Path) -> list[str]:
    """The lines of the modules in ``folders`` other than ``home`` whose code says cupy."""
    found = []
    for folder in folders:
        for path in sorted(folder.glob("*.py")):
            if path == home:
                continue
            tree = ast.parse(path.read_text())
            docstrings = _docstrings(tree)
            for node in ast.walk(tree):
                said = _says_cupy(node, docstrings)
                if said is not None:
                    found.append(f"{folder.name}/{path.name} (line {node.lineno}) says {said}")
    return sorted(set(found), key=lambda v: (v.split(" (")[0], int(v.split("line ")[1].split(")")[0])))


def test_every_cupy_call_of_the_core_and_tensorflow_is_in_one_module():
    violations = cupy_violations(CUPY_SCOPE, CUPY_HOME)
    assert not violations, "\n".join(violations) + "\n(move them into hvd_notebook/runtime/core/nccl_backend.py)"


def test_cupy_outside_its_module_is_found(tmp_path):
    (tmp_path / "core").mkdir()
    home = tmp_path / "core" / "nccl_backend.py"
    home.write_text("import cupy\n")
    (tmp_path / "core" / "fine.py").write_text('"""Takes cupy arrays."""\n# cupy, in a comment\ndef f(x):\n'
                                               '    """A cupy array."""\n    raise ValueError("pass cupy arrays")\n')
    (tmp_path / "core" / "bad.py").write_text('import cupy.cuda\ndef to_cupy(x):\n    from cupy import asarray\n'
                                              '    return x.cupy_view\nok = type(1).__module__.startswith("cupy")\n'
                                              'def g(cupy_array):\n    pass\n')
    assert cupy_violations((tmp_path / "core",), home) == [
        "core/bad.py (line 1) says cupy.cuda", "core/bad.py (line 2) says to_cupy", "core/bad.py (line 3) says cupy",
        "core/bad.py (line 4) says cupy_view", "core/bad.py (line 5) says cupy", "core/bad.py (line 6) says cupy_array"]
