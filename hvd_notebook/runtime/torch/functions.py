"""``horovod.torch``'s helpers for a model and its optimizer: ``broadcast_parameters``,
``broadcast_optimizer_state``, ``broadcast_object`` and ``allgather_object``.

Parameters and optimizer state travel as one fused broadcast (the core's ``broadcast`` packs every
tensor into one buffer); the optimizer state's structure (param groups, hyperparameters, which
tensors where) goes as a Python object first, so a rank whose optimizer has not stepped yet (no
state at all) receives the root's state whole.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..core import objects as _objects
from ..core import process_sets as _process_sets
from ..core.process_sets import global_process_set
from .mpi_ops import _finished, _route
from .tensors import as_tensor, host_array


def _named(params: Any) -> list[tuple[str, torch.Tensor]]:
    """``params`` (a ``state_dict()``, ``named_parameters()`` or a list of (name, tensor)) as a sorted list."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, Iterable):
        items = list(params)
        if any(not (isinstance(p, tuple) and len(p) == 2) for p in items):
            raise ValueError("hvd.broadcast_parameters takes a dict (model.state_dict()) or a list of "
                             "(name, tensor) pairs (model.named_parameters()).")
    else:
        raise ValueError(f"hvd.broadcast_parameters: invalid params of type {type(params).__name__}; pass "
                         "model.state_dict() or model.named_parameters().")
    return [(str(name), t) for name, t in items if t is not None]


def _broadcast_into(tensors: list[torch.Tensor], names: list[str], root_rank: int, process_set: Any) -> None:
    """Overwrite ``tensors`` with the root's, in one fused broadcast."""
    if not tensors:
        return
    backends = _process_sets.backends(process_set, "hvd.broadcast_parameters")
    root = backends.root(root_rank)
    route = _route(tensors, process_set, "hvd.broadcast_parameters")
    if route is not None:  # (torch.distributed's broadcast writes them in place, with one batched copy)
        with torch.no_grad():
            _finished(route.dist.broadcast(tensors, root, names, route.marked, in_place=True))
        return
    received = backends.mpi.broadcast([host_array(t, reducing=False) for t in tensors], root, names)
    results = [as_tensor(r, t, t.shape) for r, t in zip(received, tensors)]
    if backends.rank == root:
        return
    with torch.no_grad():
        for t, r in zip(tensors, results):
            t.copy_(r)


def broadcast_parameters(params: Any, root_rank: int, process_set: Any = global_process_set) -> None:
    """Overwrite every rank's parameters, or any tensors of a ``state_dict``, with the root rank's.

    All the tensors travel in one fused broadcast; CUDA tensors stay on the GPU where every rank has NCCL. Call it
    after the model is built, so that every rank starts from the same weights.

    >>> hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    Args:
        params: ``model.state_dict()``, or ``model.named_parameters()``: a dict of tensors by name, or an iterable
            of ``(name, tensor)`` pairs. A None value is skipped. Every rank passes the same names, shapes and
            dtypes.
        root_rank: the global rank whose values every rank gets. With ``process_set``, it must be one of the set's
            ranks.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Raises:
        ValueError: ``params`` is neither a dict nor an iterable of ``(name, tensor)`` pairs; a value is not a
            tensor; the runtime is not initialised; ``process_set`` is not a registered ``hvd.ProcessSet`` or does
            not hold this rank; or ``root_rank`` is not a rank of the world or of ``process_set``.
        MismatchError: the ranks' calls do not match, such as models of different shapes. Every rank raises it.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    named = _named(params)
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"hvd.broadcast_parameters: {name!r} is a {type(t).__name__}, not a tensor; broadcast "
                             "other values with hvd.broadcast_object.")
    _broadcast_into([t for _, t in named], [f"broadcast_parameters.{n}" for n, _ in named], root_rank, process_set)


@dataclass(frozen=True)
class _Slot:
    """Where a tensor sat in the root's optimizer state (its index among the broadcast tensors)."""

    index: int
    shape: tuple[int, ...]
    dtype: torch.dtype


def _walk(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` (dicts, lists and tuples, nested) with each of its leaves ``x`` replaced by ``leaf(x)``."""
    if isinstance(value, dict):
        return {k: _walk(v, leaf) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_walk(v, leaf) for v in value)
    return leaf(value)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None,
                              process_set: Any = global_process_set) -> None:
    """Give every rank the root rank's optimizer state, also where the other ranks' optimizers have not stepped yet.

    The state's structure, the param groups with their hyperparameters, travels as a Python object; its tensors,
    such as momentum buffers, travel in one fused broadcast. Afterwards, as in Horovod, every parameter that takes a
    gradient has one: zeros where it had none.

    >>> hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    Args:
        optimizer: the ``torch.optim.Optimizer``. Its parameters are in the same order on every rank.
        root_rank: the global rank whose state every rank gets. With ``process_set``, it must be one of the set's
            ranks.
        model: Horovod's argument for models whose parameters are not the optimizer's. It is not used.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Raises:
        ValueError: ``optimizer`` is a ``torch.optim.LBFGS``, whose state Horovod does not broadcast either; the
            runtime is not initialised; ``process_set`` is not a registered ``hvd.ProcessSet`` or does not hold this
            rank; or ``root_rank`` is not a rank of the world or of ``process_set``.
        MismatchError: the ranks' calls do not match, such as models of different shapes. Every rank raises it.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("hvd.broadcast_optimizer_state does not support torch.optim.LBFGS (as Horovod); "
                         "broadcast its state_dict() with hvd.broadcast_object.")
    backends = _process_sets.backends(process_set, "hvd.broadcast_optimizer_state")
    root = backends.root(root_rank)
    tensors: list[torch.Tensor] = []

    def hollow(x: Any) -> Any:
        """A tensor as a ``_Slot`` (appended to ``tensors``)."""
        if not isinstance(x, torch.Tensor):
            return x
        tensors.append(x)
        return _Slot(len(tensors) - 1, tuple(x.shape), x.dtype)

    structure = _walk(optimizer.state_dict(), hollow) if backends.rank == root else None
    structure = _objects.broadcast_object(structure, root_rank, name="broadcast_optimizer_state.structure",
                                              process_set=process_set)
    if backends.rank != root:
        slots: list[_Slot] = []
        _walk(structure, lambda x: slots.append(x) if isinstance(x, _Slot) else x)
        tensors = [torch.empty(s.shape, dtype=s.dtype) for s in sorted(slots, key=lambda s: s.index)]
    _broadcast_into(tensors, [f"broadcast_optimizer_state.{i}" for i in range(len(tensors))], root_rank,
                    process_set)
    if backends.rank != root:
        optimizer.load_state_dict(_walk(structure, lambda x: tensors[x.index] if isinstance(x, _Slot) else x))
    # as Horovod, which steps an optimizer without state once on zero gradients to create it: every
    # parameter that takes a gradient has one afterwards (zeros where it had none)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None,
                     process_set: Any = global_process_set) -> Any:
    """Give every rank the root rank's Python object.

    The object is pickled and sent through MPI, so it can be anything ``pickle`` takes.

    Args:
        obj: the object to send. Only the root's is read; the other ranks may pass None.
        root_rank: the global rank whose object every rank gets. Defaults to 0.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name, so that nameless calls pair in call order.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Returns:
        The root's object: ``obj`` itself on the root, an unpickled copy on the other ranks.

    Raises:
        ValueError: the runtime is not initialised; ``process_set`` is not a registered ``hvd.ProcessSet`` or does
            not hold this rank; or ``root_rank`` is not a rank of the world or of ``process_set``.
        MismatchError: the ranks called different collectives under this name, or this one with different arguments.
            Every rank raises it.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    return _objects.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj: Any, name: str | None = None, process_set: Any = global_process_set) -> list[Any]:
    """Gather every rank's Python object into a list, in rank order.

    The objects are pickled and sent through MPI, so they can be anything ``pickle`` takes.

    Args:
        obj: this rank's object.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name, so that nameless calls pair in call order.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Returns:
        A list with one object per rank, in rank order: ``size()`` items, or the set's size with ``process_set``.

    Raises:
        ValueError: the runtime is not initialised, or ``process_set`` is not a registered ``hvd.ProcessSet`` or
            does not hold this rank.
        MismatchError: the ranks called different collectives under this name, or this one with different arguments.
            Every rank raises it.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    return _objects.allgather_object(obj, name, process_set)


__all__ = ["allgather_object", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters"]
