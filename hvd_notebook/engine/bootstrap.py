"""What runs once in every engine after it connects: pick the framework, pin the device, set the
framework's threads, initialise the runtime, and put ``hvd`` in the namespace.

The order matters: ``CUDA_VISIBLE_DEVICES`` must be set before TensorFlow or PyTorch is
imported, and their thread pools must be sized before their first op. What differs between the
frameworks is in ``frameworks``. A CPU rank of TensorFlow does not import it here (10 s of a cold
start): the first cell that uses it does, and what must follow its import (the thread pools' sizes,
the Keras progress hook) is hooked to that import. GPU ranks import it to open the device; a warm
standby imports it ahead (``warm_up``).
"""

from __future__ import annotations

import importlib
import os
import socket
from typing import Any

from .. import keras_flavour
from ..config import Backend, Framework, choices, parse_choice
from ..messages import RankReport
from . import completion, frameworks


def usable_cores() -> int:
    """CPU cores this process may run on (respects taskset and cgroups' cpusets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def load_backend(backend: str, framework: Framework = Framework.TENSORFLOW) -> tuple[Any, str]:
    """The module cells call ``hvd`` and a label for it: a real ``horovod.tensorflow`` (``horovod.torch``
    for PyTorch) for ``horovod`` (and for ``auto`` when it imports), else this package's runtime.

    Args:
        backend: ``auto``, ``horovod`` or ``builtin`` (``--backend``).
        framework: the framework the cluster runs (``--framework``, resolved).
    """
    backend = parse_choice(Backend, backend, f"backend {backend!r}: use one of {', '.join(choices(Backend))}.")
    api = "horovod.torch" if framework is Framework.TORCH else "horovod.tensorflow"
    if backend in (Backend.AUTO, Backend.HOROVOD):
        try:
            import horovod

            if hasattr(horovod, "__hvd_notebook_alias__"):  # _hvd_notebook_horovod's stand-in, not a Horovod
                raise ModuleNotFoundError("no real horovod is installed (import horovod gives hvd_notebook's alias)")
            return importlib.import_module(api), f"horovod {horovod.__version__}"
        except Exception as exc:  # ImportError, or a horovod built for another TensorFlow
            if backend == Backend.HOROVOD:
                raise RuntimeError(
                    f"--backend horovod: {api} does not import here ({type(exc).__name__}: "
                    f"{exc}). Horovod 0.28.1 builds against TensorFlow <= 2.15 only; use --backend builtin "
                    "(or auto) for hvd_notebook's own runtime."
                ) from None
    if framework is Framework.TORCH:
        from ..runtime import torch as runtime_torch

        return runtime_torch, "builtin"
    from .. import runtime

    return runtime, "builtin"


def _install_keras_progress(keras: Any) -> None:
    from . import keras_progress

    keras_progress.install()


def address_towards(address: str) -> str:
    """This machine's source address on its route to the IPv4 ``address``; OSError
    where there is no route. A UDP "connect" sends nothing: it only picks the route.
    (Here, not in the cluster layer, because engines may not import that layer.)

    Args:
        address: an IPv4 address, e.g. the controller's.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((address, 9))
        return s.getsockname()[0]


def _pin_device(gpus: list[str], world_rank: int, local_rank: int) -> str:
    """Make this rank's GPU (by local rank) the only one the framework sees, or none; the device's label."""
    if not gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
        return "CPU"
    if local_rank >= len(gpus):
        raise RuntimeError(
            f"rank {world_rank} on {socket.gethostname()} has local rank {local_rank} but "
            f"only {len(gpus)} GPU(s) were given ({','.join(gpus)}); start fewer ranks "
            "per host or pass --gpus none to run on CPUs."
        )
    os.environ["CUDA_VISIBLE_DEVICES"] = gpus[local_rank]
    return f"GPU {gpus[local_rank]}"


def _prepare(gpus: list[str], backend: str, framework: str) -> tuple[Any, str, int, int, str, Framework]:
    """The slow part of a bootstrap, which holds nothing: the framework chosen, the backend imported,
    the device pinned (no GPU context yet: no op has run), the framework's threads sized. The backend,
    its label, the local rank and size, the device's label, the framework."""
    from ..runtime.core.topology import local_rank_before_init

    chosen = frameworks.resolve(framework)
    # the device is pinned before the framework is imported, and before hvd.init() creates the NCCL
    # communicator on it
    world_rank, local_rank, local_size = local_rank_before_init()
    device = _pin_device(gpus, world_rank, local_rank)
    hvd, backend_label = load_backend(backend, chosen)
    frameworks.size_thread_pools(chosen, max(1, usable_cores() // local_size))
    return hvd, backend_label, local_rank, local_size, device, chosen


def warm_up(gpus: list[str], backend: str = Backend.AUTO, framework: str = Framework.AUTO) -> int:
    """Make this engine a warm standby: everything of ``bootstrap`` that takes time (the
    imports of the framework, Keras and the backend) but no ``hvd.init()``: no communicator, no
    collective state, no GPU context. ``bootstrap`` later finishes it in well under a second.
    Returns this process's id.

    Args:
        gpus: the GPU ids this host's ranks pin, one per local rank; empty for CPU ranks.
        backend: ``--backend``, as for ``bootstrap``.
        framework: ``--framework``, as for ``bootstrap``.
    """
    *_, chosen = _prepare(gpus, backend, framework)
    if chosen is Framework.TENSORFLOW:
        try:  # (the first cell of nearly every notebook imports Keras; the replay's too)
            keras_flavour.keras()
        except ImportError:
            pass
    return os.getpid()


def bootstrap(gpus: list[str], backend: str = Backend.AUTO, controller_ip: str = "127.0.0.1",
              framework: str = Framework.AUTO) -> RankReport:
    """Prepare this engine for ``%%hvd`` cells; return what the rank table shows.

    ``gpus`` lists the GPU ids of this host that the cluster may use, one per
    local rank; an empty list means CPU only (no GPU visible to the framework).

    Args:
        gpus: the GPU ids of this host the ranks pin, one per local rank; empty: CPU only.
        backend: ``auto``, ``horovod`` or ``builtin`` (``--backend``).
        controller_ip: the controller's address: the rank reports its own address on the route to it.
        framework: ``auto``, ``tensorflow`` or ``torch`` (``--framework``).
    """
    from IPython import get_ipython

    hvd, backend_label, local_rank, local_size, device, chosen = _prepare(gpus, backend, framework)
    device = frameworks.open_device(chosen, device)
    hvd.init()
    from . import stacks

    stacks.register(hvd.rank(), hvd.size())  # %hvd stacks, hvd-notebook stacks
    try:
        ip = address_towards(controller_ip)  # (this host's address on the route to the controller)
    except OSError:
        ip = ""
    framework_label = frameworks.label(chosen)
    if chosen is Framework.TORCH:
        group = frameworks.init_torch_distributed(hvd, ip)
        framework_label += f", torch.distributed {group}"
    intra, inter = frameworks.thread_pools(chosen)

    shell = get_ipython()
    if shell is not None:
        shell.user_ns["hvd"] = hvd
        completion.show_pages_as_output(shell)  # obj? in a %%hvd cell

    from . import breakpoints, reporter, tqdm_bars

    reporter.install(hvd.rank())  # what reports to the dashboard: the reporter, and its adapters
    breakpoints.install(hvd.rank())  # breakpoint() in a cell: pdb driven from the notebook
    if chosen is Framework.TENSORFLOW:  # (keras_progress imports Keras: on a CPU rank, a cell imports it first)
        frameworks.when_imported(keras_flavour.module_name(), _install_keras_progress)
    tqdm_bars.install()

    return RankReport(rank=hvd.rank(), size=hvd.size(), local_rank=local_rank, local_size=local_size,
                      host=socket.gethostname(), ip=ip, pid=os.getpid(), device=device, backend=backend_label,
                      framework=framework_label, intra_op_threads=intra, inter_op_threads=inter)
