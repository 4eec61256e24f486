"""``torch.distributed``'s process groups for the PyTorch binding: the default group over the world's ranks
(gloo on CPU ranks, NCCL on GPU ranks) and one group per process set.

The default group is the one a torch cluster's engine makes at start (``init_default_group``), so that DDP and
FSDP work in cells as they are; a script under ``mpiexec`` or ``hvd-notebook run`` gets it from ``hvd.init()``
where the binding needs it (``needed``). Where every rank is on one host, the rendezvous is a ``FileStore`` in
the user's private folder (no port at all: torch's TCPStore listens on every interface, whatever address it is
given, and lets anyone in) and gloo and NCCL use the loopback interface only. Across hosts, rank 0 serves a
TCPStore bound to one address alone, on a port the system picks. A process set's group is made inside the set's
first agreed turn that needs it (every member is there), cached on the set's backends and dropped with them.
"""

from __future__ import annotations

import atexit
import datetime
import os
import secrets
import socket
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ... import config, private

# one host: gloo's and NCCL's sockets (NCCL's bootstrap included) on loopback only, and no NCCL RAS
# thread answering every local user on localhost:28028; whatever the environment or /etc/nccl.conf says
ONE_HOST_TORCH_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "NCCL_RAS_ENABLE": "0"}
STORE_PREFIX = "store-"  # the rendezvous files in the private folder: store-PID-RANDOM, PID rank 0's
TRANSPORTS = ("mpi", "dist")
_SHARE_NAME = "hvd_notebook.torch_distributed"

Share = Callable[[Any], Any]  # rank 0's object to every rank (a collective)


def transport() -> str:
    """``HVD_NOTEBOOK_TORCH_TRANSPORT``: how CPU tensors travel (``mpi`` or ``dist``); a clear error for another."""
    value = (config.TORCH_TRANSPORT.text() or "mpi").strip().lower()
    if value not in TRANSPORTS:
        raise ValueError(f"{config.TORCH_TRANSPORT.name}={value!r}: use mpi (CPU tensors through the MPI "
                         "library) or dist (through torch.distributed's gloo).")
    return value


def needed() -> bool:
    """Does this process's binding move tensors through ``torch.distributed`` (the dist transport, or a GPU)?"""
    from . import device

    return transport() == "dist" or device.available()


def backend_name() -> str:
    """The default group's backend a new one gets here: NCCL where a GPU and NCCL are, else gloo."""
    import torch.distributed as dist

    from . import device

    return "nccl" if device.available() and dist.is_nccl_available() else "gloo"


def init_default_group(hvd: Any, address: str, timeout_s: float = 1800.0, share: Share | None = None) -> str:
    """``torch.distributed``'s default process group over the MPI world's ranks (a collective call: every rank
    makes it); its backend (``none`` where torch has no ``distributed``). Sets ``MASTER_ADDR``, ``MASTER_PORT``
    (across hosts only), ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` as torchrun does.

    Args:
        hvd: this rank's ``hvd`` module (its rank, size and local size).
        address: this rank's address that the other hosts reach; rank 0's serves the store across hosts.
        timeout_s: how long the rendezvous and each collective may wait.
        share: gives every rank rank 0's object (a collective); None: ``hvd.broadcast_object``.
    """
    import torch.distributed as dist

    if not dist.is_available():
        return "none"
    if dist.is_initialized():
        return dist.get_backend()
    if share is None:
        share = lambda obj: hvd.broadcast_object(obj, root_rank=0, name=_SHARE_NAME)  # noqa: E731
    timeout = datetime.timedelta(seconds=timeout_s)
    if hvd.local_size() == hvd.size():
        os.environ.update(ONE_HOST_TORCH_ENV)
        store, master = _file_store(hvd.rank(), hvd.size(), share), {"MASTER_ADDR": "127.0.0.1"}
        os.environ.pop("MASTER_PORT", None)
    else:
        store, host, port = _tcp_store(hvd.rank(), hvd.size(), address, timeout, share)
        master = {"MASTER_ADDR": host, "MASTER_PORT": str(port)}
    backend = backend_name()
    dist.init_process_group(backend, store=store, rank=hvd.rank(), world_size=hvd.size(), timeout=timeout)
    os.environ.update(master, RANK=str(hvd.rank()), WORLD_SIZE=str(hvd.size()), LOCAL_RANK=str(hvd.local_rank()),
                      LOCAL_WORLD_SIZE=str(hvd.local_size()))
    return backend


def _file_store(rank: int, size: int, share: Share) -> Any:
    """A ``FileStore`` for this world, in a file that rank 0 names afresh (a file left by an earlier world is
    never read again) inside the user's private ``torch`` folder; the others check that folder before they use
    it."""
    import torch.distributed as dist

    path = problem = None
    if rank == 0:
        try:
            folder = private.subdir("torch")
            path = str(folder / f"{STORE_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
            atexit.register(_unlink, path)  # (FileStore removes it too, where every rank closes it)
        except OSError as exc:
            problem = str(exc)
    path, problem = share((path, problem))
    if problem is None and rank != 0:
        try:
            private.check_dir(Path(path).parent)
        except OSError as exc:
            problem = str(exc)
    if problem is not None:
        raise RuntimeError(f"torch.distributed on rank {rank}: no private folder for its rendezvous file "
                           f"({problem}).")
    return dist.FileStore(path, size)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _tcp_store(rank: int, size: int, address: str, timeout: datetime.timedelta,
               share: Share) -> tuple[Any, str, int]:
    """Across hosts: rank 0 serves a TCPStore on a socket bound to ``address`` alone (torch itself would bind
    every interface) and tells the others where; (the store, its host, its port)."""
    import torch.distributed as dist

    store, port, problem = None, 0, None
    if rank == 0:
        try:
            listener = socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET)
            listener.bind((address, 0))
            listener.listen(socket.SOMAXCONN)
            port, fd = listener.getsockname()[1], listener.detach()  # (the store owns the descriptor now)
            store = dist.TCPStore(address, port, size, is_master=True, timeout=timeout, wait_for_workers=False,
                                  master_listen_fd=fd)
        except (OSError, RuntimeError) as exc:
            problem = f"rank 0 could not serve it on {address}: {exc}"
    host, port, problem = share((address, port, problem))
    if problem is not None:
        raise RuntimeError(f"torch.distributed on rank {rank}: no rendezvous store ({problem}).")
    if store is None:
        store = dist.TCPStore(host, port, size, is_master=False, timeout=timeout)
    return store, host, port


def ensure_default_group(hvd: Any) -> None:
    """Make the default group where the binding needs one and none is there (``hvd.init()`` of a script: a
    collective call). Across hosts rank 0 serves the store on its host name's address; where that is a loopback
    address, none is made here (an engine makes it with its address towards the controller)."""
    import torch.distributed as dist

    if not (dist.is_available() and not dist.is_initialized() and needed()):
        return
    address = "127.0.0.1"
    if hvd.local_size() != hvd.size():
        address = hvd.broadcast_object(socket.gethostbyname(socket.gethostname()), root_rank=0, name=_SHARE_NAME)
        if address.startswith("127."):
            return
    init_default_group(hvd, address)


def spans(world: Any) -> bool:
    """Is there a default group, over ``world``'s ranks (hvd's rank and size are its own)?"""
    import torch.distributed as dist

    return (dist.is_available() and dist.is_initialized() and dist.get_world_size() == world.size
            and dist.get_rank() == world.rank)


_groups: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def group_of(backends: Any, world: Any) -> Any:
    """The ``torch.distributed`` group of ``backends`` (the world's: the default group, None; a process set's:
    its own, made now, in the set's agreed turn, where every member is there)."""
    if backends is world:
        return None
    group = _groups.get(backends)
    if group is None:
        import torch.distributed as dist

        group = _groups[backends] = dist.new_group(list(backends.ranks), use_local_synchronization=True)
        weakref.finalize(backends, _destroy, group)  # (freed with the set)
    return group


def _destroy(group: Any) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group(group)
        except (RuntimeError, ValueError):  # (the default group went first)
            pass


def has_nccl(group: Any) -> bool:
    """Does ``group`` (None: the default one) move CUDA tensors with NCCL?"""
    import torch.distributed as dist

    return dist.is_initialized() and "nccl" in str(dist.get_backend(group)).lower()


__all__ = ["ONE_HOST_TORCH_ENV", "STORE_PREFIX", "ensure_default_group", "group_of", "has_nccl",
           "init_default_group", "needed", "spans", "transport"]
