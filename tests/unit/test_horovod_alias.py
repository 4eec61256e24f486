"""The ``horovod`` alias finder (``_hvd_notebook_horovod``): it answers only for Horovod's module names,
steps aside for a real ``horovod``, does nothing when switched off, and costs nothing at interpreter start.
No MPI: importing the runtime does not start it."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import _hvd_notebook_horovod as alias
from hvd_notebook.config import HOROVOD_ALIAS

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_horovod(monkeypatch):
    """No horovod module imported, and whatever a test imports forgotten afterwards."""
    saved = {n: m for n, m in sys.modules.items() if n == "horovod" or n.startswith("horovod.")}
    for name in saved:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delenv(HOROVOD_ALIAS.name, raising=False)
    yield
    for name in [n for n in sys.modules if n == "horovod" or n.startswith("horovod.")]:
        del sys.modules[name]
    sys.modules.update(saved)


@pytest.fixture
def finder(monkeypatch, clean_horovod):
    """A finder of its own, last on sys.meta_path (where install() puts it)."""
    own = alias.HorovodAliasFinder()
    others = [f for f in sys.meta_path if type(f).__name__ != "HorovodAliasFinder"]
    monkeypatch.setattr(sys, "meta_path", [*others, own])
    return own


# the Horovod modules that Horovod's own tests and users' code import (True: a package)
HOROVOD_MODULES = {
    "horovod": True, "horovod.common": True, "horovod.common.elastic": False, "horovod.common.exceptions": False,
    "horovod.tensorflow": True, "horovod.tensorflow.util": False, "horovod.tensorflow.compression": False,
    "horovod.tensorflow.mpi_ops": False, "horovod.tensorflow.elastic": False, "horovod.tensorflow.keras": True,
    "horovod.tensorflow.keras.callbacks": False, "horovod.tensorflow.keras.elastic": False, "horovod.keras": True,
    "horovod.keras.callbacks": False, "horovod.keras.elastic": False, "horovod.torch": True,
    "horovod.torch.mpi_ops": False, "horovod.torch.compression": False, "horovod.torch.functions": False,
    "horovod.torch.optimizer": False, "horovod.torch.sync_batch_norm": False,
}


@pytest.mark.parametrize("name", sorted(HOROVOD_MODULES))
def test_it_answers_for_each_horovod_name(finder, name):
    importlib.import_module("horovod")
    spec = finder.find_spec(name)
    assert spec is not None and spec.loader is finder
    assert (spec.submodule_search_locations is not None) == HOROVOD_MODULES[name]


def test_a_horovod_name_maps_by_its_longest_prefix():
    assert alias.target_of("horovod.torch.optimizer") == (True, "hvd_notebook.runtime.torch.optimizer")
    assert alias.target_of("horovod.tensorflow.keras.callbacks") == (True, "hvd_notebook.runtime.keras.callbacks")
    assert alias.target_of("horovod.common.exceptions") == (True, "hvd_notebook.runtime.core.exceptions")
    assert alias.target_of("horovod") == (True, None) and alias.target_of("horovod.runner") == (False, None)
    assert alias.target_of("horovodx") == (False, None) and alias.target_of("numpy") == (False, None)


@pytest.mark.parametrize("name", ["horovod.torch.elastic", "horovod.tensorflow.no_such_module", "horovod.runner",
                                  "numpy", "hvd_notebook.runtime", "horovodx", "tensorflow"])
def test_it_answers_for_nothing_else(finder, name):
    importlib.import_module("horovod")
    assert finder.find_spec(name) is None


def test_the_aliases_are_the_runtime(finder):
    import horovod.keras
    import horovod.tensorflow as hvd
    import horovod.tensorflow.keras as hvdk
    from horovod.tensorflow.util import _executing_eagerly

    import hvd_notebook.runtime as runtime
    import hvd_notebook.runtime.keras as runtime_keras

    assert hvd.allreduce is runtime.allreduce and hvd.broadcast_ is runtime.broadcast_
    assert hvd.Compression is runtime.Compression and hvd.size_op is runtime.size_op
    assert hvdk.allreduce is runtime_keras.allreduce and horovod.keras.init is runtime.init
    assert _executing_eagerly is runtime._executing_eagerly
    assert "allreduce" in dir(hvd) and hvd.__name__ == "horovod.tensorflow"
    with pytest.raises(AttributeError, match="horovod.tensorflow.*no_such_name"):
        hvd.no_such_name  # noqa: B018
    from horovod.tensorflow.mpi_ops import allreduce  # Horovod's module of the TensorFlow collectives

    assert allreduce is runtime.allreduce
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("horovod.tensorflow.functions")  # the runtime has no such module: none here


def test_a_public_name_is_kept_on_the_alias_and_a_private_one_is_forwarded_each_time(finder, monkeypatch):
    import horovod.tensorflow.mpi_ops as alias

    import hvd_notebook.runtime.tensorflow.mpi_ops as runtime_ops

    assert "allreduce" not in vars(alias) or vars(alias)["allreduce"] is runtime_ops.allreduce
    assert alias.allreduce is runtime_ops.allreduce and vars(alias)["allreduce"] is runtime_ops.allreduce
    monkeypatch.setattr(runtime_ops, "_last_collective", "state the runtime may rebind")
    assert alias._last_collective == "state the runtime may rebind" and "_last_collective" not in vars(alias)


def test_the_torch_aliases_are_the_torch_runtime(finder):
    import horovod.torch as hvd
    from horovod.torch.compression import Compression
    from horovod.torch.mpi_ops import allreduce_async_, synchronize
    from horovod.torch.optimizer import DistributedOptimizer

    import hvd_notebook.runtime.torch as runtime_torch

    assert hvd.allreduce is runtime_torch.allreduce and allreduce_async_ is runtime_torch.allreduce_async_
    assert synchronize is runtime_torch.synchronize and DistributedOptimizer is runtime_torch.DistributedOptimizer
    assert Compression is runtime_torch.Compression and hvd.__name__ == "horovod.torch"
    assert hvd.SyncBatchNorm is runtime_torch.SyncBatchNorm


def test_a_real_horovod_wins(finder, tmp_path, monkeypatch):
    (tmp_path / "horovod" / "tensorflow").mkdir(parents=True)
    (tmp_path / "horovod" / "__init__.py").write_text("REAL = True\n")
    (tmp_path / "horovod" / "tensorflow" / "__init__.py").write_text("REAL = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert finder.find_spec("horovod") is None
    import horovod.tensorflow as hvd

    assert hvd.REAL and not hasattr(sys.modules["horovod"], alias.MARKER)
    assert finder.find_spec("horovod.tensorflow.keras") is None  # below a real horovod: not ours


@pytest.mark.parametrize("value", ["0", "off", "false", "no"])
def test_switched_off_it_does_nothing(finder, monkeypatch, value):
    monkeypatch.setenv(HOROVOD_ALIAS.name, value)
    assert all(finder.find_spec(name) is None for name in HOROVOD_MODULES)
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("horovod.tensorflow")


def test_install_appends_one_finder(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if type(f).__name__ != "HorovodAliasFinder"])
    alias.install()
    alias.install()
    assert [type(f).__name__ for f in sys.meta_path].count("HorovodAliasFinder") == 1
    assert type(sys.meta_path[-1]).__name__ == "HorovodAliasFinder"


def test_the_pth_file_registers_the_finder_and_imports_nothing_else():
    """The installed environment (make install) registers the finder at start, without importing
    hvd_notebook or TensorFlow; the first horovod import brings the runtime."""
    code = ("import sys; names = [type(f).__name__ for f in sys.meta_path]; "
            "assert names.count('HorovodAliasFinder') == 1, names; "
            "early = sorted(m for m in sys.modules if m.split('.')[0] in ('hvd_notebook', 'tensorflow', 'numpy')); "
            "assert not early, early; "
            "import horovod.tensorflow as hvd, hvd_notebook.runtime as r; assert hvd.init is r.init; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    pth = [p for p in sys.path if p.endswith("site-packages") and (Path(p) / "hvd_notebook-horovod.pth").exists()]
    assert pth, "hvd_notebook-horovod.pth is not in site-packages: run make install"


def test_the_engine_does_not_take_the_alias_for_a_real_horovod(finder):
    import hvd_notebook.runtime as runtime
    from hvd_notebook.engine.bootstrap import load_backend

    assert load_backend("auto") == (runtime, "builtin")
    with pytest.raises(RuntimeError, match="--backend horovod: .*no real horovod is installed"):
        load_backend("horovod")
