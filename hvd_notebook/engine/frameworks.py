"""What an engine's bootstrap does differently for TensorFlow and for PyTorch ranks.

Each step takes the framework that ``resolve`` chose; a PyTorch rank never imports TensorFlow, and a
TensorFlow rank never imports PyTorch. PyTorch ranks also get ``torch.distributed``'s default process
group (``init_torch_distributed``), so that ``DistributedDataParallel`` and FSDP work in cells as
they are.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
from typing import Any

from ..config import Framework, choices


def installed(module: str) -> bool:
    """Is ``module`` importable here (asked without importing it)?"""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a broken half-installed package
        return False


def resolve(framework: str) -> Framework:
    """The framework an ``auto`` cluster uses (TensorFlow where installed, else PyTorch); a clear error
    for one that is not installed."""
    try:
        chosen = Framework(framework)
    except ValueError:
        raise ValueError(f"--framework {framework!r}: use one of {', '.join(choices(Framework))}.") from None
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
    """``torch 2.13.0+cpu``, ``tensorflow 2.21.0``: what the rank table's header says."""
    module = importlib.import_module("tensorflow" if framework is Framework.TENSORFLOW else "torch")
    return f"{framework} {module.__version__}"


def size_thread_pools(framework: Framework, intra: int, inter: int = 1) -> None:
    """Size the framework's thread pools before its first op."""
    # read by the frameworks when they create their pools; set for any library that looks there too
    os.environ.setdefault("OMP_NUM_THREADS", str(intra))
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
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(intra)
    tf.config.threading.set_inter_op_parallelism_threads(inter)


def thread_pools(framework: Framework) -> tuple[int, int]:
    """The framework's (intra-op, inter-op) thread counts."""
    if framework is Framework.TORCH:
        import torch

        return torch.get_num_threads(), torch.get_num_interop_threads()
    import tensorflow as tf

    return (tf.config.threading.get_intra_op_parallelism_threads(),
            tf.config.threading.get_inter_op_parallelism_threads())


def open_device(framework: Framework, device: str) -> str:
    """Make the pinned GPU ready for the framework (TensorFlow: memory taken as needed, not all of it;
    PyTorch: the current device); the device's label with the GPU's name where there is one."""
    if framework is Framework.TORCH:
        import torch

        if device.startswith("GPU") and torch.cuda.is_available():
            torch.cuda.set_device(0)  # the only one this rank sees (CUDA_VISIBLE_DEVICES)
            return f"{device} ({torch.cuda.get_device_name(0)})"
        return device
    import tensorflow as tf

    for gpu in tf.config.list_physical_devices("GPU"):
        # take GPU memory as needed, not all of it: other notebooks may share the card
        tf.config.experimental.set_memory_growth(gpu, True)
        details = tf.config.experimental.get_device_details(gpu)
        if details.get("device_name"):
            device = f"{device} ({details['device_name']})"
    return device


def init_torch_distributed(hvd: Any, address: str, timeout_s: float = 1800.0) -> str:
    """``torch.distributed``'s default process group over the MPI world's ranks: gloo on CPU ranks,
    NCCL on GPU ranks. Rank 0 serves the rendezvous store (on loopback where every rank is on its host,
    else on ``address``, its address on the route to the controller, which the other hosts reach) on a
    port the system picks, and tells the others through ``hvd.broadcast_object``. Sets ``MASTER_ADDR``,
    ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` as torchrun does.
    Returns the group's backend. A collective call: every rank makes it."""
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return "none"
    backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if dist.is_initialized():
        return dist.get_backend()
    one_host = hvd.local_size() == hvd.size()
    host = "127.0.0.1" if one_host else address
    if one_host:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = None
    if hvd.rank() == 0:
        store = dist.TCPStore(host, 0, hvd.size(), is_master=True, timeout=timeout, wait_for_workers=False)
    host, port = hvd.broadcast_object((host, store.port if store is not None else 0), root_rank=0,
                                      name="hvd_notebook.torch_distributed")
    if store is None:
        store = dist.TCPStore(host, port, hvd.size(), is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=hvd.rank(), world_size=hvd.size(), timeout=timeout)
    os.environ.update(MASTER_ADDR=host, MASTER_PORT=str(port), RANK=str(hvd.rank()), WORLD_SIZE=str(hvd.size()),
                      LOCAL_RANK=str(hvd.local_rank()), LOCAL_WORLD_SIZE=str(hvd.local_size()))
    return backend


__all__ = ["init_torch_distributed", "installed", "label", "open_device", "resolve", "size_thread_pools",
           "thread_pools"]
