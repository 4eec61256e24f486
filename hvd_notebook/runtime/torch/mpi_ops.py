"""``horovod.torch``'s collectives on PyTorch tensors, over the runtime's framework-neutral core.

Each collective is the core's (agreement by name, fusion, timeline, stall and mismatch errors):
``mpi_backend`` on a CPU tensor's memory read as numpy (``tensors``), or ``torch.distributed``
(``dist_backend``) for CUDA tensors where the group has NCCL and for CPU tensors under
``HVD_NOTEBOOK_TORCH_TRANSPORT=dist``; a call on that route is issued in its turn and finished by its
caller (``_finished``: here, or in ``synchronize``). The synchronous forms run their call in the calling
thread. The ``_async`` forms return a handle at once and run the call in a worker thread:
the core's coordinator takes calls from any thread in any order and matches them by name across
ranks, so reductions started from several threads (``DistributedOptimizer``'s gradient hooks) that
are ready in the same agreement round share one fused call. ``synchronize(handle)`` waits and
returns the result (raising the call's error); ``poll(handle)`` says whether it is done. The plain
forms are differentiable, with Horovod's gradients (``core/gradients``: an allreduce's gradient is the
same allreduce of the gradient, and so on).

Errors: a mismatch across ranks, or a call every rank refuses, raises ``CollectiveMismatchError`` or
``CollectiveRefusedError`` on every rank: the core's ``MismatchError``/``RefusedError`` (ValueError) that
are also ``RuntimeError``, which is what Horovod's PyTorch API raises. A second asynchronous call under a
name still in flight on this rank raises ``ValueError`` at once, as Horovod's does. Adasum is refused.
"""

from __future__ import annotations

import functools
import itertools
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..core import basics as _basics
from ..core import coordinator as _coordinator
from ..core import gradients as _gradients
from ..core import objects as _objects
from ..core import world as _world
from ..core.basics import (  # (Horovod's mpi_ops holds the process queries too: horovod.torch.mpi_ops.rank)
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from ..core.exceptions import ErrorFamily, MismatchError, RefusedError
from ..core.ops import Average, Sum, check_op
from ..core.process_sets import backends as _backends
from ..core.process_sets import global_process_set
from ..core.rules import names as _names
from ..core.rules import resolve_op
from . import device, dist_backend
from . import group as _group
from .compression import Compression
from .tensors import as_tensor, check_same_kind, check_tensor, host_array


@functools.wraps(_basics.init)
def init(comm: Any = None, process_sets: Any = None) -> None:  # noqa: D103 (the core's docstring)
    _basics.init(comm, process_sets)
    # the default torch.distributed group, where tensors travel through it and none is there (a script's)
    _group.ensure_default_group(types.SimpleNamespace(rank=rank, size=size, local_rank=local_rank,
                                                      local_size=local_size,
                                                      broadcast_object=_objects.broadcast_object))


# ------------------------------------------------------------------ errors
class CollectiveMismatchError(MismatchError, RuntimeError):
    """Ranks called different collectives, or one with different arguments (a RuntimeError, as Horovod's
    PyTorch API raises)."""


class CollectiveRefusedError(RefusedError, RuntimeError):
    """A rank refused its call, so every rank raises (a RuntimeError, as Horovod's PyTorch API raises)."""


def _torch_class(cls: type[BaseException]) -> type[BaseException] | None:
    """The class Horovod's PyTorch API raises for the core's error class ``cls`` (None: as it is)."""
    if issubclass(cls, RuntimeError):
        return None
    if issubclass(cls, RefusedError):
        return CollectiveRefusedError
    return CollectiveMismatchError if issubclass(cls, MismatchError) else None


_ERRORS = ErrorFamily(_torch_class)


# ------------------------------------------------------------------ handles
class _Pending:
    """One asynchronous call: its result or error once its worker has finished."""

    __slots__ = ("done", "result", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class _Workers:
    """Daemon threads that run asynchronous calls, one more started whenever none is idle: a call
    waiting for the other ranks must never keep a later call from starting, or ranks that issue
    calls in different orders would wait for each other for ever."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.jobs: list[tuple[_Pending, Callable[[], Any]]] = []
        self.wake = threading.Condition(self.lock)
        self.idle = 0
        self.started = itertools.count()

    def submit(self, fn: Callable[[], Any]) -> _Pending:
        pending = _Pending()
        with self.lock:
            self.jobs.append((pending, fn))
            if self.idle:
                self.wake.notify()
            else:
                threading.Thread(target=self._work, name=f"hvd-torch-async-{next(self.started)}", daemon=True).start()
        return pending

    def _work(self) -> None:
        _coordinator.calls_here_are_unordered()
        while True:
            with self.lock:
                while not self.jobs:
                    self.idle += 1
                    self.wake.wait()
                    self.idle -= 1
                pending, fn = self.jobs.pop(0)
            try:
                pending.result = fn()
            except BaseException as exc:  # handed to synchronize(), raised there
                pending.error = exc
            pending.done.set()


_workers = _Workers()
_handles: dict[int, _Pending] = {}
_handle_ids = itertools.count(1)


@dataclass(frozen=True)
class _Call:
    """One collective, checked, named and ordered in the calling thread: ``run`` makes it, here (``_now``:
    the synchronous forms) or in a worker (``_start``: the asynchronous ones); ``names``: its tensors'."""

    run: Callable[[], Any]
    names: tuple[str, ...]

    def first(self) -> _Call:
        """The same call, giving the first of its results (the forms that take one tensor)."""
        return _Call(lambda: _first(self.run()), self.names)


def _first(results: Any) -> Any:
    """The first of a call's results (a ``dist_backend.Deferred``'s, once finished)."""
    if isinstance(results, dist_backend.Deferred):
        return results.then(lambda finished: finished[0])
    return results[0]


_in_flight: set[str] = set()  # names of this rank's calls not finished yet
_in_flight_lock = threading.Lock()


def _claimed(call: _Call) -> Callable[[], Any]:
    """``call.run``, raising ``_ERRORS``' errors, with the call's names taken until it ends; refused
    now where a call of this rank under one of them is in flight."""
    run, names = call.run, call.names
    with _in_flight_lock:
        taken = [n for n in names if n in _in_flight]
        if taken:
            raise ValueError(f"a collective named {taken[0]!r} is already in flight on rank "
                             f"{_world.current().rank}: synchronize it first, or give the second call "
                             "another name.")
        _in_flight.update(names)

    def release() -> None:
        with _in_flight_lock:
            _in_flight.difference_update(names)

    def claimed() -> Any:
        try:
            result = run()
        except (MismatchError, RefusedError) as exc:
            release()
            raise _ERRORS.convert(exc) from None
        except BaseException:
            release()
            raise
        if isinstance(result, dist_backend.Deferred):  # (its names stay taken until its caller finishes it)
            return _Finishing(result, release)
        release()
        return result

    return claimed


class _Finishing:
    """A call issued through ``torch.distributed``: its caller finishes it (``finish``), and its names are
    taken until then."""

    __slots__ = ("deferred", "release")

    def __init__(self, deferred: dist_backend.Deferred, release: Callable[[], None]) -> None:
        self.deferred, self.release = deferred, release

    def finish(self) -> Any:
        try:
            return self.deferred.finish()
        finally:
            self.release()


def _finished(result: Any) -> Any:
    """A call's result, finished where it was issued through ``torch.distributed``."""
    return result.finish() if isinstance(result, (_Finishing, dist_backend.Deferred)) else result


def _now(call: _Call) -> Any:
    """Make ``call`` in this thread; its result."""
    return _finished(_claimed(call)())


def _start(call: _Call) -> int:
    """Make ``call`` in a worker; its handle for ``synchronize``."""
    handle = next(_handle_ids)
    _handles[handle] = _workers.submit(_claimed(call))
    return handle


def poll(handle: int) -> bool:
    """Tell whether the asynchronous call behind a handle has finished.

    Once it has, ``synchronize(handle)`` returns at once.

    Args:
        handle: a handle that an ``_async`` call returned, not synchronized yet.

    Returns:
        True where the call has finished, with its result or its error; else False.

    Raises:
        ValueError: ``handle`` is not the handle of a call in flight, or it was synchronized already.
    """
    pending = _handles.get(handle)
    if pending is None:
        raise ValueError(f"hvd.poll: {handle!r} is not a handle of a running call (synchronize() takes each "
                         "handle once).")
    if not pending.done.is_set():
        return False
    return not isinstance(pending.result, _Finishing) or pending.result.deferred.ready()


def synchronize(handle: int) -> Any:
    """Wait for the asynchronous call behind a handle, and return its result.

    A handle is taken once: a second ``synchronize`` of it returns None, as Horovod's does.

    Args:
        handle: a handle that an ``_async`` call returned.

    Returns:
        The call's result, as its synchronous form returns it: a tensor, a list of tensors for a grouped call, or a
        tuple for ``alltoall_async`` with splits. None for a handle taken already or unknown.

    Raises:
        Exception: the error the call raised, such as ``CollectiveMismatchError``, ``StallError`` or
            ``HorovodInternalError``, raised here on its first ``synchronize``.
    """
    pending = _handles.get(handle)
    if pending is None:
        return None
    while not pending.done.wait(0.1):  # (a timed wait: Ctrl-C reaches a waiting main thread)
        pass
    del _handles[handle]
    if pending.error is not None:
        raise pending.error
    return _finished(pending.result)


# ------------------------------------------------------------------ the calls
class _Differentiable(torch.autograd.Function):
    """A collective as autograd sees it: ``make(tensors)`` is its ``_Call`` (made in ``forward``), ``rule(grads)``
    its gradients (its collective's rule in ``core/gradients``)."""

    @staticmethod
    def forward(ctx: Any, make: Callable[[Any], _Call], rule: Callable[[list], list], *tensors: torch.Tensor) -> Any:
        ctx.rule = rule
        return tuple(_now(make(tensors)))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        return (None, None, *ctx.rule(list(grads)))


def _differentiable(tensors: list[torch.Tensor], make: Callable[[Any], _Call], rule: Callable[[list], list],
                    compression: Any = Compression.none) -> list[torch.Tensor]:
    """The results of ``make``'s collective of ``tensors``, sent compressed by ``compression``, whose gradients
    are ``rule``'s."""
    compressed, ctxs = zip(*(compression.compress(t) for t in tensors))
    outs = _Differentiable.apply(make, rule, *compressed)
    return [compression.decompress(o, c) for o, c in zip(outs, ctxs)]


class _Route:
    """A call that goes through ``torch.distributed``: its backend, and the point in the caller's stream its
    inputs are written by (``device.mark``, recorded in the calling thread; None on the CPU)."""

    __slots__ = ("dist", "marked")

    def __init__(self, dist: dist_backend.DistBackend, marked: Any) -> None:
        self.dist, self.marked = dist, marked


def _route(tensors: list[torch.Tensor], process_set: Any, call: str) -> _Route | None:
    """``torch.distributed``'s way for these tensors (CUDA tensors where the group has NCCL; CPU tensors under
    ``HVD_NOTEBOOK_TORCH_TRANSPORT=dist``), decided now, in the calling thread; None: the MPI library's."""
    if not tensors:
        return None
    if device.is_cuda(tensors) and not _group.has_nccl(None):
        return None  # (through the host)
    if not device.is_cuda(tensors) and _group.transport() != "dist":
        return None
    try:
        backends = _backends(process_set, call)
    except ValueError:
        return None  # (the call itself raises it, in its turn)
    world = _world.current()
    if not _group.spans(world):
        if device.is_cuda(tensors):
            return None  # (through the host: the default group is not this world's)
        raise RuntimeError(f"{call}: HVD_NOTEBOOK_TORCH_TRANSPORT=dist needs torch.distributed's default group over "
                           f"hvd's world (rank {world.rank} of {world.size}); call hvd.init() for every rank of the "
                           "job (it makes the group), or unset the variable to use the MPI library.")
    return _Route(dist_backend.of(backends, world), device.mark(tensors))


def through_dist(tensor: torch.Tensor, process_set: Any) -> bool:
    """Would a call of ``tensor`` on ``process_set`` go through ``torch.distributed`` now (``_route``'s choice,
    without its errors)?"""
    if device.is_cuda([tensor]):
        return _group.has_nccl(None) and _group.spans(_world.current())
    return _group.transport() == "dist" and _group.spans(_world.current())


def _reduce_op(op: int | None, average: bool | None) -> int:
    op = resolve_op(op, average)
    check_op(op)
    return op


def _checked(tensors: list[Any], call: str) -> list[torch.Tensor]:
    checked = [check_tensor(t, call) for t in tensors]
    check_same_kind(checked, call)
    return checked


def _collective(kind: str, tensors: list[Any], name: str | None, process_set: Any, call: str,
                run: Callable[[Any, list[torch.Tensor], list[str], _Route | None], Any],
                in_place: bool = False, prescale: float = 1.0) -> _Call:
    """A ``kind`` collective of ``tensors`` (their results, a list), checked, named and routed now (for
    ``torch.distributed``, ordered after the caller's stream now): ``run(backends, tensors, names, route)`` makes
    it on the world or ``process_set`` (a ``dist_backend.Deferred`` on that route, which writes the results into
    ``tensors`` itself where ``in_place``); ``in_place`` writes the results into ``tensors``. On that route the
    tensors are scaled by ``prescale`` now, before the mark (the MPI library's ``run`` scales them itself)."""
    tensors = _checked(list(tensors), call)
    names = _names(name, kind, len(tensors))
    route = _route(tensors, process_set, call)
    if route is not None and prescale != 1.0:
        tensors = [scale(t, prescale) for t in tensors]
        route.marked = device.mark(tensors)

    def make() -> Any:
        results = run(_backends(process_set, call), tensors, names, route)
        if route is not None or not in_place:
            return results
        return [t.copy_(r) for t, r in zip(tensors, results)]

    return _Call(make, tuple(names))


def _allreduce_call(tensors: list[Any], average: bool | None, name: str | None, op: int | None, prescale: float,
                    postscale: float, process_set: Any, in_place: bool, call: str) -> _Call:
    """An allreduce of ``tensors``."""
    op = _reduce_op(op, average)

    def run(backends: Any, tensors: list[torch.Tensor], names: list[str], route: _Route | None) -> Any:
        if route is not None:
            return route.dist.allreduce(tensors, op, prescale, postscale, names, route.marked, in_place)
        # (one tensor takes the backend's cached single-tensor path, where it can)
        reduced = backends.mpi.allreduce([host_array(t, reducing=True) for t in tensors], op, prescale, postscale,
                                        names)
        return [as_tensor(r, t) for r, t in zip(reduced, tensors)]

    return _collective("allreduce", tensors, name, process_set, call, run, in_place)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = global_process_set) -> int:
    """Start reducing a tensor over all ranks, by default to its average, and return a handle at once.

    The call runs in a worker thread. Calls started together, from any thread, that are ready in the same agreement
    round share one fused MPI or NCCL call. The call's own errors are raised by ``synchronize(handle)``: those of
    the synchronous form other than the argument checks below.

    Args:
        tensor: a dense ``torch.Tensor``, on the CPU or a CUDA device. Every rank passes one of the same shape and
            dtype.
        average: Horovod's deprecated form of ``op``: True means ``hvd.Average``, False ``hvd.Sum``. Give ``op`` or
            ``average``, not both.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name, so that nameless calls pair in call order. One name may be in flight only
            once on a rank.
        op: the reduction: ``hvd.Average``, ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``. With neither
            ``op`` nor ``average``, ``hvd.Average``. An average of integers is truncated toward zero.
        prescale_factor: a factor applied to each rank's tensor before the reduction. Defaults to 1.0.
        postscale_factor: a factor applied to the result after the reduction. Defaults to 1.0.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Returns:
        A handle, an int, for ``synchronize`` and ``poll``. ``synchronize`` returns a new tensor holding the reduced
        value.

    Raises:
        TypeError: a tensor is not a ``torch.Tensor``, or is sparse.
        ValueError: ``op`` and ``average`` are both given, or ``op`` is not an op; or a call under the same name is
            still in flight on this rank.
        NotImplementedError: ``op=hvd.Adasum``, which the built-in runtime does not implement.
    """
    return _start(_allreduce_call([tensor], average, name, op, prescale_factor, postscale_factor, process_set,
                                  False, "hvd.allreduce_async").first())


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = global_process_set) -> int:
    """Start reducing a tensor over all ranks in place, by default to its average, and return a handle at once.

    It is ``allreduce_async`` that writes the result into ``tensor``. The call's own errors are raised by
    ``synchronize(handle)``: those of the synchronous form other than the argument checks below.

    Args:
        tensor: a dense ``torch.Tensor``, on the CPU or a CUDA device. Every rank passes one of the same shape and
            dtype. Its values are overwritten with the result.
        average: Horovod's deprecated form of ``op``: True means ``hvd.Average``, False ``hvd.Sum``. Give ``op`` or
            ``average``, not both.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name, so that nameless calls pair in call order. One name may be in flight only
            once on a rank.
        op: the reduction: ``hvd.Average``, ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``. With neither
            ``op`` nor ``average``, ``hvd.Average``. An average of integers is truncated toward zero.
        prescale_factor: a factor applied to each rank's tensor before the reduction. Defaults to 1.0.
        postscale_factor: a factor applied to the result after the reduction. Defaults to 1.0.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Returns:
        A handle, an int, for ``synchronize`` and ``poll``. ``synchronize`` returns ``tensor`` itself, holding the
        reduced value.

    Raises:
        TypeError: a tensor is not a ``torch.Tensor``, or is sparse.
        ValueError: ``op`` and ``average`` are both given, or ``op`` is not an op; or a call under the same name is
            still in flight on this rank.
        NotImplementedError: ``op=hvd.Adasum``, which the built-in runtime does not implement.
    """
    return _start(_allreduce_call([tensor], average, name, op, prescale_factor, postscale_factor, process_set,
                                  True, "hvd.allreduce_async_").first())


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Reduce a tensor over all ranks in place, by default to its average.

    Args:
        tensor: a dense ``torch.Tensor``, on the CPU or a CUDA device. Every rank passes one of the same shape and
            dtype. Its values are overwritten with the result.
        average: Horovod's deprecated form of ``op``: True means ``hvd.Average``, False ``hvd.Sum``. Give ``op`` or
            ``average``, not both.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name, so that nameless calls pair in call order. One name may be in flight only
            once on a rank.
        op: the reduction: ``hvd.Average``, ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``. With neither
            ``op`` nor ``average``, ``hvd.Average``. An average of integers is truncated toward zero.
        prescale_factor: a factor applied to each rank's tensor before the reduction. Defaults to 1.0.
        postscale_factor: a factor applied to the result after the reduction. Defaults to 1.0.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Returns:
        ``tensor`` itself, holding the reduced value.

    Raises:
        TypeError: a tensor is not a ``torch.Tensor``, or is sparse.
        ValueError: ``op`` and ``average`` are both given, or ``op`` is not an op; the runtime is not initialised;
            ``process_set`` is not a registered ``hvd.ProcessSet`` or does not hold this rank; a call under the same
            name is still in flight on this rank; or a rank's tensor cannot be reduced, such as a bool tensor, in
            which case every rank raises: the other ranks raise a ``CollectiveRefusedError``, a ``ValueError`` that
            is also a ``RuntimeError``.
        NotImplementedError: ``op=hvd.Adasum``, which the built-in runtime does not implement.
        CollectiveMismatchError: the ranks called different collectives under this name, or this one with different
            arguments, shapes or dtypes. Every rank raises it. It is a ``MismatchError`` that is also a
            ``RuntimeError``, as Horovod's PyTorch API raises.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    return _now(_allreduce_call([tensor], average, name, op, prescale_factor, postscale_factor, process_set, True,
                                "hvd.allreduce_").first())


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = global_process_set) -> torch.Tensor:
    """Reduce a tensor over all ranks, by default to its average, as a new tensor.

    CUDA tensors are reduced by NCCL where every rank has a GPU, else through the host. The call is differentiable:
    the gradient of an allreduce is the same allreduce of the gradient.

    >>> hvd.allreduce(torch.ones(2) * (hvd.rank() + 1), op=hvd.Sum)   # on 2 ranks
    tensor([3., 3.])

    Args:
        tensor: a dense ``torch.Tensor``, on the CPU or a CUDA device. Every rank passes one of the same shape and
            dtype.
        average: Horovod's deprecated form of ``op``: True means ``hvd.Average``, False ``hvd.Sum``. Give ``op`` or
            ``average``, not both.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name, so that nameless calls pair in call order. One name may be in flight only
            once on a rank.
        compression: ``hvd.Compression.none`` (the default), or ``hvd.Compression.fp16`` to send floating tensors as
            float16. The result has the input's dtype either way.
        op: the reduction: ``hvd.Average``, ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``. With neither
            ``op`` nor ``average``, ``hvd.Average``. An average of integers is truncated toward zero.
        prescale_factor: a factor applied to each rank's tensor before the reduction. Defaults to 1.0.
        postscale_factor: a factor applied to the result after the reduction. Defaults to 1.0.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Returns:
        A new tensor of ``tensor``'s shape, dtype and device holding the reduced value.

    Raises:
        TypeError: a tensor is not a ``torch.Tensor``, or is sparse.
        ValueError: ``op`` and ``average`` are both given, or ``op`` is not an op; the runtime is not initialised;
            ``process_set`` is not a registered ``hvd.ProcessSet`` or does not hold this rank; a call under the same
            name is still in flight on this rank; or a rank's tensor cannot be reduced, such as a bool tensor, in
            which case every rank raises: the other ranks raise a ``CollectiveRefusedError``, a ``ValueError`` that
            is also a ``RuntimeError``.
        NotImplementedError: ``op=hvd.Adasum``, which the built-in runtime does not implement.
        CollectiveMismatchError: the ranks called different collectives under this name, or this one with different
            arguments, shapes or dtypes. Every rank raises it. It is a ``MismatchError`` that is also a
            ``RuntimeError``, as Horovod's PyTorch API raises.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    check_tensor(tensor, "hvd.allreduce")
    op = _reduce_op(op, average)
    if compression is Compression.none and not (tensor.requires_grad and torch.is_grad_enabled()):
        # nothing to differentiate or compress: the call itself, without autograd's bookkeeping
        return _now(_allreduce_call([tensor], None, name, op, prescale_factor, postscale_factor, process_set,
                                    False, "hvd.allreduce").first())
    return _reduced([tensor], name, compression, op, prescale_factor, postscale_factor, process_set,
                    "hvd.allreduce")[0]


def _reduced(tensors: list[torch.Tensor], name: str | None, compression: Any, op: int, prescale: float,
             postscale: float, process_set: Any, call: str) -> list[torch.Tensor]:
    """The differentiable allreduce of ``tensors`` (checked)."""
    return _differentiable(
        tensors, lambda ts: _allreduce_call(ts, None, name, op, prescale, postscale, process_set, False, call),
        lambda grads: _gradients.allreduce(_TorchOps(process_set), grads, op, prescale, postscale), compression)


def grouped_allreduce_async(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                            op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: Any = global_process_set) -> int:
    """Start reducing several tensors over all ranks in one call, and return a handle at once.

    The tensors share fusion buffers, as in ``grouped_allreduce``. The call's own errors are raised by
    ``synchronize(handle)``: those of the synchronous form other than the argument checks below.

    Args:
        tensors: a list of dense ``torch.Tensor``, all on the CPU or all on CUDA devices. Every rank passes the same
            number, of the same shapes and dtypes, in the same order.
        average: Horovod's deprecated form of ``op``: True means ``hvd.Average``, False ``hvd.Sum``. Give ``op`` or
            ``average``, not both.
        name: the name that pairs this call across ranks; tensor ``i`` is labelled ``name.i``. The default, None,
            takes automatic names. One name may be in flight only once on a rank.
        op: the reduction: ``hvd.Average``, ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``. With neither
            ``op`` nor ``average``, ``hvd.Average``. An average of integers is truncated toward zero.
        prescale_factor: a factor applied to each rank's tensor before the reduction. Defaults to 1.0.
        postscale_factor: a factor applied to the result after the reduction. Defaults to 1.0.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Returns:
        A handle, an int, for ``synchronize`` and ``poll``. ``synchronize`` returns a list of new tensors holding
        the reduced values.

    Raises:
        TypeError: a tensor is not a ``torch.Tensor``, or is sparse.
        ValueError: ``op`` and ``average`` are both given, or ``op`` is not an op; the tensors are on different
            kinds of device; or a call under the same name is still in flight on this rank.
        NotImplementedError: ``op=hvd.Adasum``, which the built-in runtime does not implement.
    """
    return _start(_allreduce_call(tensors, average, name, op, prescale_factor, postscale_factor, process_set, False,
                                  "hvd.grouped_allreduce_async"))


def grouped_allreduce_async_(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = global_process_set) -> int:
    """Start reducing several tensors over all ranks in place, in one call, and return a handle at once.

    It is ``grouped_allreduce_async`` that writes each result into its tensor. The call's own errors are raised by
    ``synchronize(handle)``: those of the synchronous form other than the argument checks below.

    Args:
        tensors: a list of dense ``torch.Tensor``, all on the CPU or all on CUDA devices. Every rank passes the same
            number, of the same shapes and dtypes, in the same order. Their values are overwritten with the results.
        average: Horovod's deprecated form of ``op``: True means ``hvd.Average``, False ``hvd.Sum``. Give ``op`` or
            ``average``, not both.
        name: the name that pairs this call across ranks; tensor ``i`` is labelled ``name.i``. The default, None,
            takes automatic names. One name may be in flight only once on a rank.
        op: the reduction: ``hvd.Average``, ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``. With neither
            ``op`` nor ``average``, ``hvd.Average``. An average of integers is truncated toward zero.
        prescale_factor: a factor applied to each rank's tensor before the reduction. Defaults to 1.0.
        postscale_factor: a factor applied to the result after the reduction. Defaults to 1.0.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Returns:
        A handle, an int, for ``synchronize`` and ``poll``. ``synchronize`` returns the list of ``tensors``
        themselves, holding the reduced values.

    Raises:
        TypeError: a tensor is not a ``torch.Tensor``, or is sparse.
        ValueError: ``op`` and ``average`` are both given, or ``op`` is not an op; the tensors are on different
            kinds of device; or a call under the same name is still in flight on this rank.
        NotImplementedError: ``op=hvd.Adasum``, which the built-in runtime does not implement.
    """
    return _start(_allreduce_call(tensors, average, name, op, prescale_factor, postscale_factor, process_set, True,
                                  "hvd.grouped_allreduce_async_"))


def grouped_allreduce_(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Reduce several tensors over all ranks in place, in one call, by default to their averages.

    Args:
        tensors: a list of dense ``torch.Tensor``, all on the CPU or all on CUDA devices. Every rank passes the same
            number, of the same shapes and dtypes, in the same order. Their values are overwritten with the results.
        average: Horovod's deprecated form of ``op``: True means ``hvd.Average``, False ``hvd.Sum``. Give ``op`` or
            ``average``, not both.
        name: the name that pairs this call across ranks; tensor ``i`` is labelled ``name.i``. The default, None,
            takes automatic names. One name may be in flight only once on a rank.
        op: the reduction: ``hvd.Average``, ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``. With neither
            ``op`` nor ``average``, ``hvd.Average``. An average of integers is truncated toward zero.
        prescale_factor: a factor applied to each rank's tensor before the reduction. Defaults to 1.0.
        postscale_factor: a factor applied to the result after the reduction. Defaults to 1.0.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Returns:
        The list of ``tensors`` themselves, holding the reduced values.

    Raises:
        TypeError: a tensor is not a ``torch.Tensor``, or is sparse.
        ValueError: ``op`` and ``average`` are both given, or ``op`` is not an op; the tensors are on different
            kinds of device; the runtime is not initialised; ``process_set`` is not a registered ``hvd.ProcessSet``
            or does not hold this rank; a call under the same name is still in flight on this rank; or a rank's
            tensor cannot be reduced, such as a bool tensor, in which case every rank raises: the other ranks raise
            a ``CollectiveRefusedError``, a ``ValueError`` that is also a ``RuntimeError``.
        NotImplementedError: ``op=hvd.Adasum``, which the built-in runtime does not implement.
        CollectiveMismatchError: the ranks called different collectives under this name, or this one with different
            arguments, shapes or dtypes. Every rank raises it. It is a ``MismatchError`` that is also a
            ``RuntimeError``, as Horovod's PyTorch API raises.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    return _now(_allreduce_call(tensors, average, name, op, prescale_factor, postscale_factor, process_set, True,
                                "hvd.grouped_allreduce_"))


def grouped_allreduce(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Any = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Reduce several tensors over all ranks in one call, by default to their averages, as new tensors.

    The ranks agree on the whole group once, and tensors of one dtype share fusion buffers. The call is
    differentiable, as ``allreduce`` is.

    Args:
        tensors: a list of dense ``torch.Tensor``, all on the CPU or all on CUDA devices. Every rank passes the same
            number, of the same shapes and dtypes, in the same order.
        average: Horovod's deprecated form of ``op``: True means ``hvd.Average``, False ``hvd.Sum``. Give ``op`` or
            ``average``, not both.
        name: the name that pairs this call across ranks; tensor ``i`` is labelled ``name.i``. The default, None,
            takes automatic names. One name may be in flight only once on a rank.
        compression: ``hvd.Compression.none`` (the default), or ``hvd.Compression.fp16`` to send floating tensors as
            float16. The result has the input's dtype either way.
        op: the reduction: ``hvd.Average``, ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``. With neither
            ``op`` nor ``average``, ``hvd.Average``. An average of integers is truncated toward zero.
        prescale_factor: a factor applied to each rank's tensor before the reduction. Defaults to 1.0.
        postscale_factor: a factor applied to the result after the reduction. Defaults to 1.0.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Returns:
        A list of new tensors, one per tensor in ``tensors``, each of its input's shape, dtype and device. An empty
        list for an empty ``tensors``.

    Raises:
        TypeError: a tensor is not a ``torch.Tensor``, or is sparse.
        ValueError: ``op`` and ``average`` are both given, or ``op`` is not an op; the tensors are on different
            kinds of device; the runtime is not initialised; ``process_set`` is not a registered ``hvd.ProcessSet``
            or does not hold this rank; a call under the same name is still in flight on this rank; or a rank's
            tensor cannot be reduced, such as a bool tensor, in which case every rank raises: the other ranks raise
            a ``CollectiveRefusedError``, a ``ValueError`` that is also a ``RuntimeError``.
        NotImplementedError: ``op=hvd.Adasum``, which the built-in runtime does not implement.
        CollectiveMismatchError: the ranks called different collectives under this name, or this one with different
            arguments, shapes or dtypes. Every rank raises it. It is a ``MismatchError`` that is also a
            ``RuntimeError``, as Horovod's PyTorch API raises.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    tensors = _checked(list(tensors), "hvd.grouped_allreduce")
    if not tensors:
        return []
    return _reduced(tensors, name, compression, _reduce_op(op, average), prescale_factor, postscale_factor,
                    process_set, "hvd.grouped_allreduce")


# ------------------------------------------------------------------ allgather
def _allgather(backends: Any, tensors: list[torch.Tensor], names: list[str],
               route: _Route | None = None) -> Any:
    if route is not None:
        return route.dist.allgather(tensors, names, route.marked)
    gathered = backends.mpi.allgather([host_array(t, reducing=False) for t in tensors], names)
    return [as_tensor(g, t) for g, t in zip(gathered, tensors)]


def _allgather_call(tensors: list[Any], name: str | None, process_set: Any, call: str) -> _Call:
    return _collective("allgather", tensors, name, process_set, call, _allgather)


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set) -> int:
    """Start concatenating a tensor from every rank along its first dimension, and return a handle at once.

    The call's own errors are raised by ``synchronize(handle)``: those of the synchronous form other than the
    argument checks below.

    Args:
        tensor: a dense ``torch.Tensor`` of at least one dimension, on the CPU or a CUDA device.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name, so that nameless calls pair in call order. One name may be in flight only
            once on a rank.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Returns:
        A handle, an int, for ``synchronize`` and ``poll``. ``synchronize`` returns the gathered tensor, as
        ``allgather`` does.

    Raises:
        TypeError: a tensor is not a ``torch.Tensor``, or is sparse.
        ValueError: a call under the same name is still in flight on this rank.
    """
    return _start(_allgather_call([tensor], name, process_set, "hvd.allgather_async").first())


def grouped_allgather_async(tensors: list[torch.Tensor], name: str | None = None,
                            process_set: Any = global_process_set) -> int:
    """Start concatenating several tensors from every rank, in one call, and return a handle at once.

    The call's own errors are raised by ``synchronize(handle)``: those of the synchronous form other than the
    argument checks below.

    Args:
        tensors: a list of dense ``torch.Tensor`` of at least one dimension, all on the CPU or all on CUDA devices.
            Every rank passes the same number, in the same order.
        name: the name that pairs this call across ranks; tensor ``i`` is labelled ``name.i``. The default, None,
            takes automatic names. One name may be in flight only once on a rank.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Returns:
        A handle, an int, for ``synchronize`` and ``poll``. ``synchronize`` returns a list of the gathered tensors.

    Raises:
        TypeError: a tensor is not a ``torch.Tensor``, or is sparse.
        ValueError: the tensors are on different kinds of device; a call under the same name is still in flight on
            this rank.
    """
    return _start(_allgather_call(tensors, name, process_set, "hvd.grouped_allgather_async"))


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set) -> torch.Tensor:
    """Concatenate a tensor from every rank along its first dimension, as a new tensor.

    The first dimension may differ between ranks; the other dimensions and the dtype may not. The call is
    differentiable: a rank's gradient is its own rows of the gradient averaged over the ranks.

    Args:
        tensor: a dense ``torch.Tensor`` of at least one dimension, on the CPU or a CUDA device.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name, so that nameless calls pair in call order. One name may be in flight only
            once on a rank.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Returns:
        A new tensor of ``tensor``'s dtype and device: every rank's tensor concatenated in rank order.

    Raises:
        TypeError: a tensor is not a ``torch.Tensor``, or is sparse.
        ValueError: the runtime is not initialised; ``process_set`` is not a registered ``hvd.ProcessSet`` or does
            not hold this rank; a call under the same name is still in flight on this rank; or a rank's tensor is a
            scalar, in which case every rank raises: the other ranks raise a ``CollectiveRefusedError``, a
            ``ValueError`` that is also a ``RuntimeError``.
        CollectiveMismatchError: the ranks called different collectives under this name, or this one with different
            arguments, shapes or dtypes. Every rank raises it. It is a ``MismatchError`` that is also a
            ``RuntimeError``, as Horovod's PyTorch API raises.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    check_tensor(tensor, "hvd.allgather")
    return _gathered([tensor], name, process_set, "hvd.allgather")[0]


def grouped_allgather(tensors: list[torch.Tensor], name: str | None = None,
                      process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Concatenate several tensors from every rank along their first dimensions, in one call.

    Each tensor is gathered as ``allgather`` gathers it; the call is differentiable too.

    Args:
        tensors: a list of dense ``torch.Tensor`` of at least one dimension, all on the CPU or all on CUDA devices.
            Every rank passes the same number, in the same order.
        name: the name that pairs this call across ranks; tensor ``i`` is labelled ``name.i``. The default, None,
            takes automatic names. One name may be in flight only once on a rank.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Returns:
        A list with one new tensor per tensor in ``tensors``, as ``allgather`` returns it. An empty list for an
        empty ``tensors``.

    Raises:
        TypeError: a tensor is not a ``torch.Tensor``, or is sparse.
        ValueError: the tensors are on different kinds of device; the runtime is not initialised; ``process_set`` is
            not a registered ``hvd.ProcessSet`` or does not hold this rank; a call under the same name is still in
            flight on this rank; or a rank's tensor is a scalar, in which case every rank raises: the other ranks
            raise a ``CollectiveRefusedError``, a ``ValueError`` that is also a ``RuntimeError``.
        CollectiveMismatchError: the ranks called different collectives under this name, or this one with different
            arguments, shapes or dtypes. Every rank raises it. It is a ``MismatchError`` that is also a
            ``RuntimeError``, as Horovod's PyTorch API raises.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    tensors = _checked(list(tensors), "hvd.grouped_allgather")
    return _gathered(tensors, name, process_set, "hvd.grouped_allgather") if tensors else []


def _gathered(tensors: list[torch.Tensor], name: str | None, process_set: Any, call: str) -> list[torch.Tensor]:
    """The differentiable allgather of ``tensors`` (checked)."""
    rows = [t.shape[0] if t.dim() else 0 for t in tensors]  # (a scalar is refused by the call itself)
    return _differentiable(tensors, lambda ts: _allgather_call(ts, name, process_set, call),
                           lambda grads: _gradients.allgather(_TorchOps(process_set), grads, rows))


# ------------------------------------------------------------------ broadcast
def _broadcast_call(tensor: Any, root_rank: int, name: str | None, process_set: Any, in_place: bool,
                    call: str) -> _Call:
    """A broadcast of ``tensor`` (its result, a list of one)."""

    def run(backends: Any, tensors: list[torch.Tensor], names: list[str], route: _Route | None) -> Any:
        root = backends.root(root_rank)
        if route is not None:
            return route.dist.broadcast(tensors, root, names, route.marked, in_place)
        received = backends.mpi.broadcast([host_array(t, reducing=False) for t in tensors], root, names)
        return [as_tensor(r, t) for r, t in zip(received, tensors)]

    return _collective("broadcast", [tensor], name, process_set, call, run, in_place)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = global_process_set) -> int:
    """Start giving every rank the root rank's value of a tensor, and return a handle at once.

    The call's own errors are raised by ``synchronize(handle)``: those of the synchronous form other than the
    argument checks below.

    Args:
        tensor: a dense ``torch.Tensor``, on the CPU or a CUDA device. Every rank passes one of the same shape and
            dtype. Only the root's values are read.
        root_rank: the global rank whose value every rank gets. With ``process_set``, it must be one of the set's
            ranks.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name, so that nameless calls pair in call order. One name may be in flight only
            once on a rank.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Returns:
        A handle, an int, for ``synchronize`` and ``poll``. ``synchronize`` returns a new tensor holding the root's
        value.

    Raises:
        TypeError: a tensor is not a ``torch.Tensor``, or is sparse.
        ValueError: a call under the same name is still in flight on this rank.
    """
    return _start(_broadcast_call(tensor, root_rank, name, process_set, False, "hvd.broadcast_async").first())


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = global_process_set) -> int:
    """Start overwriting a tensor with the root rank's value of it, and return a handle at once.

    It is ``broadcast_async`` that writes the result into ``tensor``. The call's own errors are raised by
    ``synchronize(handle)``: those of the synchronous form other than the argument checks below.

    Args:
        tensor: a dense ``torch.Tensor``, on the CPU or a CUDA device. Every rank passes one of the same shape and
            dtype. Its values are overwritten with the root's.
        root_rank: the global rank whose value every rank gets. With ``process_set``, it must be one of the set's
            ranks.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name, so that nameless calls pair in call order. One name may be in flight only
            once on a rank.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Returns:
        A handle, an int, for ``synchronize`` and ``poll``. ``synchronize`` returns ``tensor`` itself, holding the
        root's value.

    Raises:
        TypeError: a tensor is not a ``torch.Tensor``, or is sparse.
        ValueError: a call under the same name is still in flight on this rank.
    """
    return _start(_broadcast_call(tensor, root_rank, name, process_set, True, "hvd.broadcast_async_").first())


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Overwrite a tensor with the root rank's value of it.

    Args:
        tensor: a dense ``torch.Tensor``, on the CPU or a CUDA device. Every rank passes one of the same shape and
            dtype. Its values are overwritten with the root's.
        root_rank: the global rank whose value every rank gets. With ``process_set``, it must be one of the set's
            ranks.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name, so that nameless calls pair in call order. One name may be in flight only
            once on a rank.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Returns:
        ``tensor`` itself, holding the root's value.

    Raises:
        TypeError: a tensor is not a ``torch.Tensor``, or is sparse.
        ValueError: ``root_rank`` is not one of ``process_set``'s ranks; the runtime is not initialised;
            ``process_set`` is not a registered ``hvd.ProcessSet`` or does not hold this rank; a call under the same
            name is still in flight on this rank; or ``root_rank`` is not a rank of the world, in which case every
            rank raises: the other ranks raise a ``CollectiveRefusedError``, a ``ValueError`` that is also a
            ``RuntimeError``.
        CollectiveMismatchError: the ranks called different collectives under this name, or this one with different
            arguments, shapes or dtypes. Every rank raises it. It is a ``MismatchError`` that is also a
            ``RuntimeError``, as Horovod's PyTorch API raises.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    return _now(_broadcast_call(tensor, root_rank, name, process_set, True, "hvd.broadcast_").first())


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """Give every rank the root rank's value of a tensor, as a new tensor.

    The call is differentiable: the gradient is averaged over the ranks and flows back to the root only; the other
    ranks get zeros.

    Args:
        tensor: a dense ``torch.Tensor``, on the CPU or a CUDA device. Every rank passes one of the same shape and
            dtype. Only the root's values are read.
        root_rank: the global rank whose value every rank gets. With ``process_set``, it must be one of the set's
            ranks.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name, so that nameless calls pair in call order. One name may be in flight only
            once on a rank.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Returns:
        A new tensor of ``tensor``'s shape, dtype and device holding the root's value.

    Raises:
        TypeError: a tensor is not a ``torch.Tensor``, or is sparse.
        ValueError: ``root_rank`` is not one of ``process_set``'s ranks; the runtime is not initialised;
            ``process_set`` is not a registered ``hvd.ProcessSet`` or does not hold this rank; a call under the same
            name is still in flight on this rank; or ``root_rank`` is not a rank of the world, in which case every
            rank raises: the other ranks raise a ``CollectiveRefusedError``, a ``ValueError`` that is also a
            ``RuntimeError``.
        CollectiveMismatchError: the ranks called different collectives under this name, or this one with different
            arguments, shapes or dtypes. Every rank raises it. It is a ``MismatchError`` that is also a
            ``RuntimeError``, as Horovod's PyTorch API raises.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    check_tensor(tensor, "hvd.broadcast")
    return _differentiable(
        [tensor], lambda ts: _broadcast_call(ts[0], root_rank, name, process_set, False, "hvd.broadcast"),
        lambda grads: [_gradients.broadcast(_TorchOps(process_set), grads[0], _world.current().rank == root_rank)])[0]


# ------------------------------------------------------------------ alltoall
def _splits(splits: Any) -> np.ndarray | None:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        splits = splits.detach().cpu().numpy()
    return np.asarray(splits, dtype=np.int64).reshape(-1)


def _alltoall_now(tensor: torch.Tensor, splits: np.ndarray | None, name: str, process_set: Any,
                  route: _Route | None) -> Any:
    if route is not None:
        return route.dist.alltoall(tensor, splits, name, route.marked)
    backends = _backends(process_set, "hvd.alltoall")
    out, received = backends.mpi.alltoall(host_array(tensor, reducing=False), splits, name)
    return as_tensor(out, tensor), torch.from_numpy(np.asarray(received, dtype=np.int32))


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: Any = global_process_set) -> int:
    """Start sending a block of rows of a tensor to each rank, and return a handle at once.

    It is ``alltoall`` in a worker thread. The call's own errors are raised by ``synchronize(handle)``: those of the
    synchronous form other than the argument checks below.

    Args:
        tensor: a dense ``torch.Tensor`` of at least one dimension. The dimensions after the first and the dtype are
            the same on every rank.
        splits: how many rows go to each rank, as ``alltoall`` takes them. The default, None, sends equal parts.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name, so that nameless calls pair in call order. One name may be in flight only
            once on a rank.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Returns:
        A handle, an int, for ``synchronize`` and ``poll``. ``synchronize`` returns a tuple of the rows that arrived
        and an int32 CPU tensor of how many rows came from each rank, with or without ``splits``.

    Raises:
        TypeError: a tensor is not a ``torch.Tensor``, or is sparse.
        ValueError: a call under the same name is still in flight on this rank.
    """
    return _start(_alltoall_call(tensor, splits, name, process_set, "hvd.alltoall_async"))


def _alltoall_call(tensor: Any, splits: Any, name: str | None, process_set: Any, call: str) -> _Call:
    (tensor,) = _checked([tensor], call)
    names, split_array = _names(name, "alltoall", 1), _splits(splits)
    route = _route([tensor], process_set, call)
    return _Call(lambda: _alltoall_now(tensor, split_array, names[0], process_set, route), tuple(names))


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Any, name: str | None, process_set: Any) -> Any:
        out, received = _now(_alltoall_call(tensor, splits, name, process_set, "hvd.alltoall"))
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _received_grad: Any) -> Any:
        return _gradients.alltoall(_TorchOps(ctx.process_set), grad, ctx.received), None, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
             process_set: Any = global_process_set) -> Any:
    """Send a block of rows of a tensor to each rank, and concatenate the blocks that arrive.

    Rank ``r`` gets the ``splits[r]`` rows that follow those sent to the ranks before it. What arrives is
    concatenated in rank order. The rows travel through the host. The call is differentiable: each rank's rows of
    the gradient go back to the rank they came from.

    Args:
        tensor: a dense ``torch.Tensor`` of at least one dimension. The dimensions after the first and the dtype are
            the same on every rank.
        splits: how many rows go to each rank: a list or tensor of one non-negative int per rank, summing to the
            first dimension. The default, None, sends equal parts, which needs a first dimension that the number of
            ranks divides.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name, so that nameless calls pair in call order. One name may be in flight only
            once on a rank.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Returns:
        Without ``splits``, a new tensor of ``tensor``'s dtype and device with the rows that arrived. With
        ``splits``, a tuple of that tensor and an int32 CPU tensor of how many rows came from each rank.

    Raises:
        TypeError: a tensor is not a ``torch.Tensor``, or is sparse.
        ValueError: the runtime is not initialised; ``process_set`` is not a registered ``hvd.ProcessSet`` or does
            not hold this rank; a call under the same name is still in flight on this rank; or a rank's tensor is a
            scalar or its ``splits`` do not fit its rows, in which case every rank raises: the other ranks raise a
            ``CollectiveRefusedError``, a ``ValueError`` that is also a ``RuntimeError``.
        CollectiveMismatchError: the ranks called different collectives under this name, or this one with different
            arguments, shapes or dtypes. Every rank raises it. It is a ``MismatchError`` that is also a
            ``RuntimeError``, as Horovod's PyTorch API raises.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    check_tensor(tensor, "hvd.alltoall")
    out, received = _Alltoall.apply(tensor, splits, name, process_set)
    return out if splits is None else (out, received)


# ------------------------------------------------------------------ reducescatter
def scale(t: torch.Tensor, factor: float) -> torch.Tensor:
    """``t * factor`` in ``t``'s dtype, computed as Horovod does: integers in float64 then truncated,
    float16 and bfloat16 in float32."""
    if factor == 1.0:
        return t
    if not t.is_floating_point():
        return (t.double() * factor).to(t.dtype)
    if t.dtype in (torch.float16, torch.bfloat16):
        return (t.float() * factor).to(t.dtype)
    return t * factor


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        process_set: Any = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start reducing a tensor over all ranks and keeping this rank's block of rows; return a handle at once.

    The call's own errors are raised by ``synchronize(handle)``: those of the synchronous form other than the
    argument checks below.

    Args:
        tensor: a dense ``torch.Tensor`` of at least one dimension, on the CPU or a CUDA device. Every rank passes
            one of the same shape and dtype.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name, so that nameless calls pair in call order. One name may be in flight only
            once on a rank.
        op: the reduction: ``hvd.Average`` (the default), ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.
        prescale_factor: a factor applied to each rank's tensor before the reduction. Defaults to 1.0.
        postscale_factor: a factor applied to the result after the reduction. Defaults to 1.0.

    Returns:
        A handle, an int, for ``synchronize`` and ``poll``. ``synchronize`` returns this rank's block, as
        ``reducescatter`` does.

    Raises:
        TypeError: a tensor is not a ``torch.Tensor``, or is sparse.
        ValueError: ``op`` is not an op; or a call under the same name is still in flight on this rank.
        NotImplementedError: ``op=hvd.Adasum``, which the built-in runtime does not implement.
    """
    return _start(_reducescatter_call([tensor], name, op, process_set, prescale_factor, postscale_factor,
                                      "hvd.reducescatter_async").first())


def _reducescatter_call(tensors: list[Any], name: str | None, op: int, process_set: Any, prescale: float,
                        postscale: float, call: str) -> _Call:
    check_op(op)

    def run(backends: Any, tensors: list[torch.Tensor], names: list[str], route: _Route | None) -> Any:
        if route is not None:  # (scaled already, before its mark: see _collective)
            return route.dist.reducescatter(tensors, op, names, route.marked).then(
                lambda results: [scale(r, postscale) for r in results])
        outs = backends.mpi.reducescatter([host_array(scale(t, prescale), reducing=True) for t in tensors], op,
                                          names)
        return [scale(as_tensor(o, t), postscale) for o, t in zip(outs, tensors)]

    return _collective("reducescatter", tensors, name, process_set, call, run, prescale=prescale)


def grouped_reducescatter_async(tensors: list[torch.Tensor], name: str | None = None, op: int = Average,
                                process_set: Any = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start reducing several tensors and keeping this rank's block of each; return a handle at once.

    The call's own errors are raised by ``synchronize(handle)``: those of the synchronous form other than the
    argument checks below.

    Args:
        tensors: a list of dense ``torch.Tensor`` of at least one dimension, all on the CPU or all on CUDA devices.
            Every rank passes the same number, of the same shapes and dtypes, in the same order.
        name: the name that pairs this call across ranks; tensor ``i`` is labelled ``name.i``. The default, None,
            takes automatic names. One name may be in flight only once on a rank.
        op: the reduction: ``hvd.Average`` (the default), ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.
        prescale_factor: a factor applied to each rank's tensor before the reduction. Defaults to 1.0.
        postscale_factor: a factor applied to the result after the reduction. Defaults to 1.0.

    Returns:
        A handle, an int, for ``synchronize`` and ``poll``. ``synchronize`` returns a list with this rank's block of
        each tensor.

    Raises:
        TypeError: a tensor is not a ``torch.Tensor``, or is sparse.
        ValueError: ``op`` is not an op; the tensors are on different kinds of device; or a call under the same name
            is still in flight on this rank.
        NotImplementedError: ``op=hvd.Adasum``, which the built-in runtime does not implement.
    """
    return _start(_reducescatter_call(tensors, name, op, process_set, prescale_factor, postscale_factor,
                                      "hvd.grouped_reducescatter_async"))


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = Compression.none,
                  op: int = Average, process_set: Any = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce a tensor over all ranks, and keep this rank's block of rows of the result.

    The rows are split as evenly as possible, in rank order: the first ``rows % size`` ranks get one row more. The
    call is differentiable: the gradient is every rank's rows gathered, times the size for ``hvd.Sum`` and times
    both scale factors.

    Args:
        tensor: a dense ``torch.Tensor`` of at least one dimension, on the CPU or a CUDA device. Every rank passes
            one of the same shape and dtype.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name, so that nameless calls pair in call order. One name may be in flight only
            once on a rank.
        compression: ``hvd.Compression.none`` (the default), or ``hvd.Compression.fp16`` to send floating tensors as
            float16. The result has the input's dtype either way.
        op: the reduction: ``hvd.Average`` (the default), ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.
        prescale_factor: a factor applied to each rank's tensor before the reduction. Defaults to 1.0.
        postscale_factor: a factor applied to the result after the reduction. Defaults to 1.0.

    Returns:
        A new tensor of ``tensor``'s dtype and device: this rank's block of the reduced value.

    Raises:
        TypeError: a tensor is not a ``torch.Tensor``, or is sparse.
        ValueError: ``op`` is not an op; the runtime is not initialised; ``process_set`` is not a registered
            ``hvd.ProcessSet`` or does not hold this rank; a call under the same name is still in flight on this
            rank; or a rank's tensor is a scalar or cannot be reduced, such as a bool tensor, in which case every
            rank raises: the other ranks raise a ``CollectiveRefusedError``, a ``ValueError`` that is also a
            ``RuntimeError``.
        NotImplementedError: ``op=hvd.Adasum``, which the built-in runtime does not implement.
        CollectiveMismatchError: the ranks called different collectives under this name, or this one with different
            arguments, shapes or dtypes. Every rank raises it. It is a ``MismatchError`` that is also a
            ``RuntimeError``, as Horovod's PyTorch API raises.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    check_tensor(tensor, "hvd.reducescatter")
    return _scattered([tensor], name, compression, op, process_set, prescale_factor, postscale_factor,
                      "hvd.reducescatter")[0]


def grouped_reducescatter(tensors: list[torch.Tensor], name: str | None = None, compression: Any = Compression.none,
                          op: int = Average, process_set: Any = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """Reduce several tensors over all ranks, and keep this rank's block of rows of each.

    Each tensor is reduced and split as ``reducescatter`` does it; the call is differentiable too.

    Args:
        tensors: a list of dense ``torch.Tensor`` of at least one dimension, all on the CPU or all on CUDA devices.
            Every rank passes the same number, of the same shapes and dtypes, in the same order.
        name: the name that pairs this call across ranks; tensor ``i`` is labelled ``name.i``. The default, None,
            takes automatic names. One name may be in flight only once on a rank.
        compression: ``hvd.Compression.none`` (the default), or ``hvd.Compression.fp16`` to send floating tensors as
            float16. The result has the input's dtype either way.
        op: the reduction: ``hvd.Average`` (the default), ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.
        prescale_factor: a factor applied to each rank's tensor before the reduction. Defaults to 1.0.
        postscale_factor: a factor applied to the result after the reduction. Defaults to 1.0.

    Returns:
        A list with this rank's block of each reduced tensor, as new tensors. An empty list for an empty
        ``tensors``.

    Raises:
        TypeError: a tensor is not a ``torch.Tensor``, or is sparse.
        ValueError: ``op`` is not an op; the tensors are on different kinds of device; the runtime is not
            initialised; ``process_set`` is not a registered ``hvd.ProcessSet`` or does not hold this rank; a call
            under the same name is still in flight on this rank; or a rank's tensor is a scalar or cannot be
            reduced, such as a bool tensor, in which case every rank raises: the other ranks raise a
            ``CollectiveRefusedError``, a ``ValueError`` that is also a ``RuntimeError``.
        NotImplementedError: ``op=hvd.Adasum``, which the built-in runtime does not implement.
        CollectiveMismatchError: the ranks called different collectives under this name, or this one with different
            arguments, shapes or dtypes. Every rank raises it. It is a ``MismatchError`` that is also a
            ``RuntimeError``, as Horovod's PyTorch API raises.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    tensors = _checked(list(tensors), "hvd.grouped_reducescatter")
    if not tensors:
        return []
    return _scattered(tensors, name, compression, op, process_set, prescale_factor, postscale_factor,
                      "hvd.grouped_reducescatter")


def _scattered(tensors: list[torch.Tensor], name: str | None, compression: Any, op: int, process_set: Any,
               prescale: float, postscale: float, call: str) -> list[torch.Tensor]:
    """The differentiable reducescatter of ``tensors`` (checked)."""
    return _differentiable(
        tensors, lambda ts: _reducescatter_call(ts, name, op, process_set, prescale, postscale, call),
        lambda grads: _gradients.reducescatter(_TorchOps(process_set), grads, op, prescale, postscale), compression)


def sparse_allreduce_async(tensor: torch.Tensor, name: str, op: int,
                           process_set: Any = global_process_set) -> Callable[[], torch.Tensor]:
    """Start reducing a sparse tensor as Horovod does, and return a function that waits for the result.

    Every rank's indices and values are allgathered, and ``coalesce`` sums the values of equal indices. With
    ``hvd.Average`` the sum is then divided by the number of ranks. The reduction's own errors are raised by the
    returned function: those of ``grouped_allgather`` other than the argument checks below.

    Args:
        tensor: a sparse ``torch.Tensor`` of the same dense shape on every rank.
        name: the name that pairs this call across ranks. Its indices and values travel as ``name.indices`` and
            ``name.values``.
        op: ``hvd.Average`` or ``hvd.Sum``.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Returns:
        A function that takes no argument, waits for the reduction, and returns the reduced sparse tensor,
        coalesced. It raises the call's errors, as ``synchronize`` does.

    Raises:
        TypeError: ``tensor`` is not a sparse ``torch.Tensor``.
        ValueError: ``op`` is not an op, or a call under the same name is still in flight on this rank.
        NotImplementedError: ``op`` is neither ``hvd.Average`` nor ``hvd.Sum``.
    """
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise TypeError("hvd.sparse_allreduce_async takes a sparse torch.Tensor; hvd.allreduce_async takes dense "
                        "ones.")
    check_op(op)
    if op not in (Average, Sum):
        raise NotImplementedError("sparse allreduce supports op=hvd.Average or hvd.Sum only.")
    grad = tensor.coalesce()
    names = [f"{name}.values", f"{name}.indices"]
    values, indices = grad.values(), grad.indices().t().contiguous()
    route = _route([values, indices], process_set, "hvd.sparse_allreduce_async")

    def run() -> torch.Tensor:
        backends = _backends(process_set, "hvd.sparse_allreduce_async")
        v, i = _finished(_allgather(backends, [values, indices], names, route))
        out = torch.sparse_coo_tensor(i.t(), v, grad.shape, check_invariants=False).coalesce()  # (valid: coalesced)
        return out / backends.size if op == Average else out

    handle = _start(_Call(run, tuple(names)))
    return lambda: synchronize(handle)


# ------------------------------------------------------------------ the rest
def join(device: int = -1) -> int:
    """Say that this rank has no more data, and wait until every rank has said so.

    Until then this rank takes part in the other ranks' allreduces with zeros, so that ranks with more batches can
    go on. Only allreduces can be served so.

    Args:
        device: Horovod's device for the zeros. It is not used: the zeros are made where the other ranks' tensors
            are. Defaults to -1.

    Returns:
        The rank that joined last, as an int (the same on every rank), as in Horovod.

    Raises:
        ValueError: the runtime is not initialised.
        MismatchError: another rank called a collective other than an allreduce while this rank had joined, or the
            ranks' calls did not match. Every rank raises it.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    world = _world.current()
    if _group.spans(world):  # the others' calls through torch.distributed are served there, even where this rank
        dist_backend.of(world, world)  # never made one (its backend registers as their road's server)
    return _objects.join()


def barrier(process_set: Any = global_process_set) -> None:
    """Wait until every rank has called ``barrier()``.

    Args:
        process_set: the ``hvd.ProcessSet`` whose ranks take part. Defaults to ``hvd.global_process_set``: every
            rank.

    Raises:
        ValueError: the runtime is not initialised, or ``process_set`` is not a registered ``hvd.ProcessSet`` or
            does not hold this rank.
        MismatchError: another rank called a different collective where this one called ``barrier()``. Every rank
            raises it.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    _objects.barrier(process_set)


# ------------------------------------------------------------------ gradients
class _TorchOps:
    """What ``core/gradients``' rules are made of, on torch tensors among the ranks of ``process_set``."""

    def __init__(self, process_set: Any) -> None:
        self.process_set = process_set
        self.grouped_allreduce = functools.partial(grouped_allreduce, process_set=process_set)
        self.grouped_allgather = functools.partial(grouped_allgather, process_set=process_set)

    @property
    def size(self) -> int:
        return _backends(self.process_set, "hvd.reducescatter").size

    def alltoall(self, tensor: torch.Tensor, splits: Any) -> torch.Tensor:
        back, _ = _Alltoall.apply(tensor, splits, None, self.process_set)
        return back

    def own_rows(self, gathered: torch.Tensor, rows: int) -> torch.Tensor:
        all_rows = allgather(torch.tensor([rows], dtype=torch.int64), process_set=self.process_set)
        rank = _backends(self.process_set, "hvd.allgather").rank
        return gathered.narrow(0, int(all_rows[:rank].sum()), rows)


__all__ = [
    "allgather", "allgather_async", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async",
    "join", "poll", "reducescatter", "reducescatter_async", "sparse_allreduce_async", "synchronize",
    "CollectiveMismatchError", "CollectiveRefusedError",
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "init",
    "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
    "rank", "rocm_built", "shutdown", "size",
]
