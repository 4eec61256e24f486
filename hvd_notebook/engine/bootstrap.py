"""What runs once in every engine after it connects: pin the device, set
TensorFlow's threads, initialise the runtime, and put ``hvd`` in the namespace.

The order matters: ``CUDA_VISIBLE_DEVICES`` must be set before TensorFlow is
imported, and TensorFlow's thread pools must be sized before its first op.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from ..config import Backend, choices


def usable_cores() -> int:
    """CPU cores this process may run on (respects taskset and cgroups' cpusets)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def load_backend(backend: str) -> tuple[Any, str]:
    """The module cells call ``hvd`` and a label for it: a real ``horovod.tensorflow``
    for ``horovod`` (and for ``auto`` when it imports), else this package's runtime."""
    try:
        backend = Backend(backend)
    except ValueError:
        raise ValueError(f"backend {backend!r}: use one of {', '.join(choices(Backend))}.") from None
    if backend in (Backend.AUTO, Backend.HOROVOD):
        try:
            import horovod

            if hasattr(horovod, "__hvd_notebook_alias__"):  # _hvd_notebook_horovod's stand-in, not a Horovod
                raise ModuleNotFoundError("no real horovod is installed (import horovod gives hvd_notebook's alias)")
            import horovod.tensorflow as horovod_tf

            return horovod_tf, f"horovod {horovod.__version__}"
        except Exception as exc:  # ImportError, or a horovod built for another TensorFlow
            if backend == Backend.HOROVOD:
                raise RuntimeError(
                    f"--backend horovod: horovod.tensorflow does not import here ({type(exc).__name__}: "
                    f"{exc}). Horovod 0.28.1 builds against TensorFlow <= 2.15 only; use --backend builtin "
                    "(or auto) for hvd_notebook's own runtime."
                ) from None
    from .. import runtime

    return runtime, "builtin"


def address_towards(address: str) -> str:
    """This machine's source address on its route to the IPv4 ``address``; OSError
    where there is no route. A UDP "connect" sends nothing: it only picks the route.
    (Here, not in the cluster layer, because engines may not import that layer.)"""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((address, 9))
        return s.getsockname()[0]


def _address_towards(host: str) -> str:
    """This host's address on the route to ``host``; empty where there is none."""
    try:
        return address_towards(host)
    except OSError:
        return ""


def _pin_device(gpus: list[str], world_rank: int, local_rank: int) -> str:
    """Make this rank's GPU (by local rank) the only one TensorFlow sees, or none; the device's label."""
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


def _size_thread_pools(intra: int, inter: int = 1) -> None:
    """Size TensorFlow's thread pools, before its first op."""
    # Read by TensorFlow when it creates its thread pools; set for any library
    # (and any later TensorFlow import) that looks at the environment instead.
    os.environ["TF_NUM_INTRAOP_THREADS"] = str(intra)
    os.environ["TF_NUM_INTEROP_THREADS"] = str(inter)
    os.environ.setdefault("OMP_NUM_THREADS", str(intra))

    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(intra)
    tf.config.threading.set_inter_op_parallelism_threads(inter)


def _prepare(gpus: list[str], backend: str) -> tuple[Any, str, int, int, str]:
    """The slow part of a bootstrap, which holds nothing: the backend imported, the device
    pinned (no GPU context yet: no op has run), TensorFlow's threads sized. The backend, its
    label, the local rank and size, the device's label."""
    from ..runtime.topology import local_rank_before_init

    hvd, backend_label = load_backend(backend)
    # the device is pinned before hvd.init(), which creates the NCCL communicator on it
    world_rank, local_rank, local_size = local_rank_before_init()
    device = _pin_device(gpus, world_rank, local_rank)
    _size_thread_pools(max(1, usable_cores() // local_size))
    return hvd, backend_label, local_rank, local_size, device


def warm_up(gpus: list[str], backend: str = Backend.AUTO) -> int:
    """Make this engine a warm standby: everything of ``bootstrap`` that takes time (the
    imports of TensorFlow, Keras and the backend) but no ``hvd.init()``: no communicator, no
    collective state, no GPU context. ``bootstrap`` later finishes it in well under a second.
    Returns this process's id."""
    _prepare(gpus, backend)
    try:
        import keras  # noqa: F401  (the first cell of nearly every notebook; the replay's too)
    except ImportError:
        pass
    return os.getpid()


def bootstrap(gpus: list[str], backend: str = Backend.AUTO, controller_ip: str = "127.0.0.1") -> dict[str, Any]:
    """Prepare this engine for ``%%hvd`` cells; return what the rank table shows.

    ``gpus`` lists the GPU ids of this host that the cluster may use, one per
    local rank; an empty list means CPU only (no GPU visible to TensorFlow).
    """
    from IPython import get_ipython

    hvd, backend_label, local_rank, local_size, device = _prepare(gpus, backend)

    import tensorflow as tf

    for gpu in tf.config.list_physical_devices("GPU"):
        # take GPU memory as needed, not all of it: other notebooks may share the card
        tf.config.experimental.set_memory_growth(gpu, True)
        details = tf.config.experimental.get_device_details(gpu)
        if details.get("device_name"):
            device = f"{device} ({details['device_name']})"
    hvd.init()
    from . import stacks

    stacks.register(hvd.rank(), hvd.size())  # %hvd stacks, hvd-notebook stacks
    intra = tf.config.threading.get_intra_op_parallelism_threads()
    inter = tf.config.threading.get_inter_op_parallelism_threads()

    shell = get_ipython()
    if shell is not None:
        shell.user_ns["hvd"] = hvd

    from . import progress

    progress.install(hvd.rank())  # fit/evaluate/predict report to the notebook's dashboard

    return {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": local_rank,
        "local_size": local_size,
        "host": socket.gethostname(),
        "ip": _address_towards(controller_ip),
        "pid": os.getpid(),
        "device": device,
        "backend": backend_label,
        "intra_op_threads": intra,
        "inter_op_threads": inter,
    }
