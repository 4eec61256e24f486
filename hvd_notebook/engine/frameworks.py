"""What an engine's bootstrap does differently for TensorFlow and for PyTorch ranks.

Each step takes the framework that ``resolve`` chose; a PyTorch rank never imports TensorFlow, and a
TensorFlow rank never imports PyTorch. PyTorch ranks also get ``torch.distributed``'s default process
group (``init_torch_distributed``), so that ``DistributedDataParallel`` and FSDP work in cells as
they are.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import keras_flavour, private
from ..config import Framework, choices, parse_choice
from ..liveness import pid_alive


def installed(module: str) -> bool:
    """Is ``module`` importable here (asked without importing it)?

    Args:
        module: a top-level module's name, e.g. ``tensorflow``.
    """
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a broken half-installed package
        return False


def resolve(framework: str) -> Framework:
    """The framework an ``auto`` cluster uses (TensorFlow where installed, else PyTorch); a clear error
    for one that is not installed, or for Keras 2 asked for (``TF_USE_LEGACY_KERAS``) without ``tf_keras``.

    Args:
        framework: ``auto``, ``tensorflow`` or ``torch`` (``--framework``).
    """
    chosen = _installed_framework(framework)
    if chosen is Framework.TENSORFLOW and keras_flavour.keras2() and not installed("tf_keras"):
        raise RuntimeError(keras_flavour.missing_tf_keras())
    return chosen


def _installed_framework(framework: str) -> Framework:
    chosen = parse_choice(
        Framework, framework, f"--framework {framework!r}: use one of {', '.join(choices(Framework))}.")
    if chosen is Framework.AUTO:
        if installed("tensorflow"):
            return Framework.TENSORFLOW
        if installed("torch"):
            return Framework.TORCH
        raise RuntimeError("neither TensorFlow nor PyTorch is installed in the ranks' Python; install one "
                           "(pip install 'hvd_notebook[cpu]' for TensorFlow, 'hvd_notebook[torch]' for PyTorch).")
    module = "tensorflow" if chosen is Framework.TENSORFLOW else "torch"
    if not installed(module):
        extra = "cpu" if chosen is Framework.TENSORFLOW else "torch"
        raise RuntimeError(f"--framework {chosen}: {module} is not installed in the ranks' Python; install it "
                           f"(pip install 'hvd_notebook[{extra}]') or pick the other framework.")
    return chosen


def label(framework: Framework) -> str:
    """``torch 2.13.0+cpu``, ``tensorflow 2.21.0, Keras 3.15.1``: what the rank table's header says (from the installed
    distribution's metadata: a CPU rank imports TensorFlow with the first cell that uses it).

    Args:
        framework: the cluster's framework.
    """
    module = "tensorflow" if framework is Framework.TENSORFLOW else "torch"
    keras = f", {keras_flavour.label()}" if framework is Framework.TENSORFLOW else ""
    for distribution in importlib.metadata.packages_distributions().get(module, []):
        return f"{framework} {importlib.metadata.version(distribution)}{keras}"
    return f"{framework} {importlib.import_module(module).__version__}{keras}"


def when_imported(module: str, hook: Callable[[Any], None]) -> None:
    """``hook(module)`` as soon as ``module`` has been imported: now where it is already, else right after
    its import, by whichever cell makes it (wrapt's post-import hooks; TensorFlow depends on wrapt).

    Args:
        module: the module's name, e.g. ``tensorflow``.
        hook: called with the imported module.
    """
    import wrapt

    wrapt.register_post_import_hook(hook, module)


class _QuietImport(importlib.abc.MetaPathFinder):
    """Finds ``module`` once (by the other finders) and has its loader run with the process's stderr on
    ``log`` (``quiet_import``)."""

    def __init__(self, module: str, log: int) -> None:
        self.module, self.log = module, log

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != self.module:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _LoaderOnLog(spec.loader, self.log)
        return spec


class _LoaderOnLog(importlib.abc.Loader):
    """``loader``, executing its module with the process's stderr on ``log``; then the module's own loader
    again."""

    def __init__(self, loader: Any, log: int) -> None:
        self.loader, self.log = loader, log

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        sys.stderr.flush()
        cell = os.dup(2)
        os.dup2(self.log, 2)
        try:
            module.__loader__ = module.__spec__.loader = self.loader
            self.loader.exec_module(module)
        finally:
            os.dup2(cell, 2)
            os.close(cell)

    def __getattr__(self, name: str) -> Any:  # (resource readers and the like)
        return getattr(self.loader, name)


def quiet_import(module: str) -> None:
    """Where a cell imports ``module``, what it writes to the process's stderr while it is being imported
    (TensorFlow's C++ start-up lines: absl's notice, the CPU feature guard, oneDNN's) goes to the engine's
    own log, as when the bootstrap imported it, instead of into the cell; what it writes later is the
    cell's. (ipykernel keeps the engine's own stderr open beside the pipe it forwards to cells.)

    Args:
        module: the module's name, e.g. ``tensorflow``.
    """
    log = getattr(sys.stderr, "_original_stdstream_copy", None)
    if module not in sys.modules and isinstance(log, int):
        sys.meta_path.insert(0, _QuietImport(module, log))


_sized: dict[Framework, tuple[int, int]] = {}  # the thread pools' sizes asked for, per framework


def size_thread_pools(framework: Framework, intra: int, inter: int = 1) -> None:
    """Size the framework's thread pools before its first op: PyTorch's now, TensorFlow's as soon as it
    is imported (before any op of the cell that imports it can run).

    Args:
        framework: the cluster's framework.
        intra: threads for one op (intra-op).
        inter: ops that run at once (inter-op).
    """
    # read by the frameworks when they create their pools; set for any library that looks there too
    os.environ.setdefault("OMP_NUM_THREADS", str(intra))
    _sized[framework] = (intra, inter)
    if framework is Framework.TORCH:
        import torch

        torch.set_num_threads(intra)
        try:
            torch.set_num_interop_threads(inter)
        except RuntimeError:  # already started (a second bootstrap of this process): it keeps its size
            pass
        return
    os.environ["TF_NUM_INTRAOP_THREADS"] = str(intra)
    os.environ["TF_NUM_INTEROP_THREADS"] = str(inter)

    def size(tf: Any) -> None:
        tf.config.threading.set_intra_op_parallelism_threads(intra)
        tf.config.threading.set_inter_op_parallelism_threads(inter)

    when_imported("tensorflow", size)
    quiet_import("tensorflow")


def thread_pools(framework: Framework) -> tuple[int, int]:
    """The framework's (intra-op, inter-op) thread counts (TensorFlow's as sized, where no cell has imported
    it yet).

    Args:
        framework: the cluster's framework.
    """
    if framework is Framework.TORCH:
        import torch

        return torch.get_num_threads(), torch.get_num_interop_threads()
    if "tensorflow" not in sys.modules:
        return _sized[framework]
    import tensorflow as tf

    return (tf.config.threading.get_intra_op_parallelism_threads(),
            tf.config.threading.get_inter_op_parallelism_threads())


def open_device(framework: Framework, device: str) -> str:
    """Make the pinned GPU ready for the framework (TensorFlow: memory taken as needed, not all of it;
    PyTorch: the current device); the device's label with the GPU's name where there is one.

    Args:
        framework: the cluster's framework.
        device: the pinned device, e.g. ``GPU:0`` or ``CPU``.
    """
    if framework is Framework.TORCH:
        import torch

        if device.startswith("GPU") and torch.cuda.is_available():
            torch.cuda.set_device(0)  # the only one this rank sees (CUDA_VISIBLE_DEVICES)
            return f"{device} ({torch.cuda.get_device_name(0)})"
        return device
    if not device.startswith("GPU"):
        return device  # (a CPU rank: nothing to open, and TensorFlow waits for the first cell that uses it)
    import tensorflow as tf

    for gpu in tf.config.list_physical_devices("GPU"):
        # take GPU memory as needed, not all of it: other notebooks may share the card
        tf.config.experimental.set_memory_growth(gpu, True)
        details = tf.config.experimental.get_device_details(gpu)
        if details.get("device_name"):
            device = f"{device} ({details['device_name']})"
    return device


def init_torch_distributed(hvd: Any, address: str, timeout_s: float = 1800.0) -> str:
    """``torch.distributed``'s default process group over the MPI world's ranks (the runtime's
    ``torch/group.init_default_group``: gloo on CPU ranks, NCCL on GPU ranks; a ``FileStore`` in the user's
    private folder on one host, a TCPStore bound to ``address`` alone across hosts), after rank 0 has removed
    the rendezvous files of worlds that ended. Returns the group's backend. A collective call: every rank
    makes it.

    Args:
        hvd: this rank's ``hvd`` module (its rank, size and local rank).
        address: this rank's address on the route to the controller; rank 0's serves the store across hosts.
        timeout_s: how long the rendezvous and each collective may wait.
    """
    from ..runtime.torch import group as torch_group  # (a TensorFlow rank never imports PyTorch)

    if hvd.rank() == 0:
        try:
            remove_stale_stores(private.subdir("torch"))
        except OSError:
            pass  # (the group's own rendezvous says what is wrong with the folder)
    return torch_group.init_default_group(hvd, address, timeout_s)


def remove_stale_stores(folder: Path) -> None:
    """Remove the rendezvous files of ``folder`` whose rank 0 has ended (killed ranks close no store).

    Args:
        folder: the user's private folder of rendezvous files.
    """
    from ..runtime.torch.group import STORE_PREFIX as prefix

    for entry in os.scandir(folder):
        pid = entry.name[len(prefix):].split("-", 1)[0]
        if entry.name.startswith(prefix) and pid.isdigit() and not pid_alive(int(pid)):
            try:
                os.unlink(entry.path)
            except OSError:
                pass


__all__ = ["init_torch_distributed", "installed", "label", "open_device", "resolve", "size_thread_pools",
           "quiet_import", "thread_pools", "when_imported"]
