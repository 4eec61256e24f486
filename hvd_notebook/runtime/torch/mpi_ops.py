"""``horovod.torch``'s collectives on PyTorch tensors, over the runtime's framework-neutral core.

Each collective is the core's (agreement by name, fusion, timeline, stall and mismatch errors):
``mpi_backend`` on a CPU tensor's memory read as numpy (``tensors``), ``nccl_backend`` on a CUDA
tensor's device memory where every rank has NCCL (``gpu``). The synchronous forms run their call in
the calling thread. The ``_async`` forms return a handle at once and run the call in a worker thread:
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
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

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
    init,
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
from . import gpu
from .compression import Compression
from .tensors import as_tensor, check_same_kind, check_tensor, host_array


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
        return _Call(lambda: self.run()[0], self.names)


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

    def claimed() -> Any:
        try:
            return run()
        except (MismatchError, RefusedError) as exc:
            raise _ERRORS.convert(exc) from None
        finally:
            with _in_flight_lock:
                _in_flight.difference_update(names)

    return claimed


def _now(call: _Call) -> Any:
    """Make ``call`` in this thread; its result."""
    return _claimed(call)()


def _start(call: _Call) -> int:
    """Make ``call`` in a worker; its handle for ``synchronize``."""
    handle = next(_handle_ids)
    _handles[handle] = _workers.submit(_claimed(call))
    return handle


def poll(handle: int) -> bool:
    """True once the call behind ``handle`` has finished (``synchronize`` then returns at once)."""
    pending = _handles.get(handle)
    if pending is None:
        raise ValueError(f"hvd.poll: {handle!r} is not a handle of a running call (synchronize() takes each "
                         "handle once).")
    return pending.done.is_set()


def synchronize(handle: int) -> Any:
    """Wait for the call behind ``handle`` and return its result (raise its error). A handle is
    taken once: a second ``synchronize`` returns None, as Horovod's."""
    pending = _handles.get(handle)
    if pending is None:
        return None
    while not pending.done.wait(0.1):  # (a timed wait: Ctrl-C reaches a waiting main thread)
        pass
    del _handles[handle]
    if pending.error is not None:
        raise pending.error
    return pending.result


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


def _ready(tensors: list[torch.Tensor], process_set: Any, call: str, reducing: bool) -> gpu.Ready | None:
    """For CUDA tensors in a world with NCCL, the point in the caller's stream the call waits for
    (recorded now, in the calling thread); None where the tensors go through the host."""
    if not tensors or not tensors[0].is_cuda:
        return None
    try:
        backends = _backends(process_set, call)
    except ValueError:
        return None  # (the call itself raises it, in its turn)
    return gpu.Ready(tensors, reducing) if gpu.on_nccl(tensors, backends) else None


def _reduce_op(op: int | None, average: bool | None) -> int:
    op = resolve_op(op, average)
    check_op(op)
    return op


def _checked(tensors: list[Any], call: str) -> list[torch.Tensor]:
    checked = [check_tensor(t, call) for t in tensors]
    check_same_kind(checked, call)
    return checked


def _collective(kind: str, tensors: list[Any], name: str | None, process_set: Any, call: str, reducing: bool,
                run: Callable[[Any, list[torch.Tensor], list[str], gpu.Ready | None], list[torch.Tensor]],
                in_place: bool = False, prescale: float = 1.0) -> _Call:
    """A ``kind`` collective of ``tensors`` (their results, a list), checked and named now, and for CUDA
    tensors ordered after the caller's stream now (scaled by ``prescale`` first): ``run(backends, tensors,
    names, ready)`` makes it on the world or ``process_set``; ``in_place`` writes the results into ``tensors``."""
    tensors = _checked(list(tensors), call)
    names = _names(name, kind, len(tensors))
    ready = _ready(_scaled(tensors, prescale), process_set, call, reducing)

    def make() -> list[torch.Tensor]:
        results = run(_backends(process_set, call), tensors, names, ready)
        return [t.copy_(r) for t, r in zip(tensors, results)] if in_place else results

    return _Call(make, tuple(names))


def _allreduce_call(tensors: list[Any], average: bool | None, name: str | None, op: int | None, prescale: float,
                    postscale: float, process_set: Any, in_place: bool, call: str) -> _Call:
    """An allreduce of ``tensors``."""
    op = _reduce_op(op, average)

    def run(backends: Any, tensors: list[torch.Tensor], names: list[str], ready: gpu.Ready | None) -> list[Any]:
        if ready is not None:
            return gpu.allreduce(backends.nccl, ready, tensors, op, prescale, postscale, names)
        # (one tensor takes the backend's cached single-tensor path, where it can)
        reduced = backends.mpi.allreduce([host_array(t, reducing=True) for t in tensors], op, prescale, postscale,
                                        names)
        return [as_tensor(r, t) for r, t in zip(reduced, tensors)]

    return _collective("allreduce", tensors, name, process_set, call, True, run, in_place)


def allreduce_async(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                    op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: Any = global_process_set) -> int:
    """Start reducing ``tensor`` over all ranks (default: average); a handle for ``synchronize``."""
    return _start(_allreduce_call([tensor], average, name, op, prescale_factor, postscale_factor, process_set,
                                  False, "hvd.allreduce_async").first())


def allreduce_async_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
                     op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: Any = global_process_set) -> int:
    """As ``allreduce_async``, writing the result into ``tensor``."""
    return _start(_allreduce_call([tensor], average, name, op, prescale_factor, postscale_factor, process_set,
                                  True, "hvd.allreduce_async_").first())


def allreduce_(tensor: torch.Tensor, average: bool | None = None, name: str | None = None, op: int | None = None,
               prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks in place; returns ``tensor``."""
    return _now(_allreduce_call([tensor], average, name, op, prescale_factor, postscale_factor, process_set, True,
                                "hvd.allreduce_").first())


def allreduce(tensor: torch.Tensor, average: bool | None = None, name: str | None = None,
              compression: Any = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, process_set: Any = global_process_set) -> torch.Tensor:
    """``tensor`` reduced over all ranks (default: average) as a new tensor; differentiable.

    >>> hvd.allreduce(torch.ones(2) * (hvd.rank() + 1), op=hvd.Sum)   # on 2 ranks
    tensor([3., 3.])
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
    """Start reducing several tensors at once (fused into as few MPI calls as the fusion threshold allows)."""
    return _start(_allreduce_call(tensors, average, name, op, prescale_factor, postscale_factor, process_set, False,
                                  "hvd.grouped_allreduce_async"))


def grouped_allreduce_async_(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                             op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: Any = global_process_set) -> int:
    """As ``grouped_allreduce_async``, writing each result into its tensor."""
    return _start(_allreduce_call(tensors, average, name, op, prescale_factor, postscale_factor, process_set, True,
                                  "hvd.grouped_allreduce_async_"))


def grouped_allreduce_(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                       op: int | None = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Reduce several tensors in place; returns them."""
    return _now(_allreduce_call(tensors, average, name, op, prescale_factor, postscale_factor, process_set, True,
                                "hvd.grouped_allreduce_"))


def grouped_allreduce(tensors: list[torch.Tensor], average: bool | None = None, name: str | None = None,
                      compression: Any = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0, process_set: Any = global_process_set) -> list[torch.Tensor]:
    """Several tensors reduced over all ranks, fused; differentiable."""
    tensors = _checked(list(tensors), "hvd.grouped_allreduce")
    if not tensors:
        return []
    return _reduced(tensors, name, compression, _reduce_op(op, average), prescale_factor, postscale_factor,
                    process_set, "hvd.grouped_allreduce")


# ------------------------------------------------------------------ allgather
def _allgather(backends: Any, tensors: list[torch.Tensor], names: list[str],
               ready: gpu.Ready | None = None) -> list[torch.Tensor]:
    if ready is not None:
        return gpu.allgather(backends.nccl, ready, tensors, names)
    gathered = backends.mpi.allgather([host_array(t, reducing=False) for t in tensors], names)
    return [as_tensor(g, t) for g, t in zip(gathered, tensors)]


def _allgather_call(tensors: list[Any], name: str | None, process_set: Any, call: str) -> _Call:
    return _collective("allgather", tensors, name, process_set, call, False, _allgather)


def allgather_async(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set) -> int:
    """Start concatenating ``tensor`` over ranks along its first dimension (which may differ by rank)."""
    return _start(_allgather_call([tensor], name, process_set, "hvd.allgather_async").first())


def grouped_allgather_async(tensors: list[torch.Tensor], name: str | None = None,
                            process_set: Any = global_process_set) -> int:
    """Start ``allgather`` of several tensors in one call."""
    return _start(_allgather_call(tensors, name, process_set, "hvd.grouped_allgather_async"))


def allgather(tensor: torch.Tensor, name: str | None = None, process_set: Any = global_process_set) -> torch.Tensor:
    """``tensor`` concatenated over ranks along its first dimension; differentiable."""
    check_tensor(tensor, "hvd.allgather")
    return _gathered([tensor], name, process_set, "hvd.allgather")[0]


def grouped_allgather(tensors: list[torch.Tensor], name: str | None = None,
                      process_set: Any = global_process_set) -> list[torch.Tensor]:
    """``allgather`` of several tensors in one call; differentiable."""
    tensors = _checked(list(tensors), "hvd.grouped_allgather")
    return _gathered(tensors, name, process_set, "hvd.grouped_allgather") if tensors else []


def _gathered(tensors: list[torch.Tensor], name: str | None, process_set: Any, call: str) -> list[torch.Tensor]:
    """The differentiable allgather of ``tensors`` (checked)."""
    rows = [t.shape[0] for t in tensors]
    return _differentiable(tensors, lambda ts: _allgather_call(ts, name, process_set, call),
                           lambda grads: _gradients.allgather(_TorchOps(process_set), grads, rows))


# ------------------------------------------------------------------ broadcast
def _broadcast_call(tensor: Any, root_rank: int, name: str | None, process_set: Any, in_place: bool,
                    call: str) -> _Call:
    """A broadcast of ``tensor`` (its result, a list of one)."""

    def run(backends: Any, tensors: list[torch.Tensor], names: list[str], ready: gpu.Ready | None) -> list[Any]:
        root = backends.root(root_rank)
        if ready is not None:
            return gpu.broadcast(backends.nccl, ready, tensors, root, names)
        received = backends.mpi.broadcast([host_array(t, reducing=False) for t in tensors], root, names)
        return [as_tensor(r, t) for r, t in zip(received, tensors)]

    return _collective("broadcast", [tensor], name, process_set, call, False, run, in_place)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                    process_set: Any = global_process_set) -> int:
    """Start giving every rank ``root_rank``'s ``tensor``."""
    return _start(_broadcast_call(tensor, root_rank, name, process_set, False, "hvd.broadcast_async").first())


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
                     process_set: Any = global_process_set) -> int:
    """As ``broadcast_async``, writing the result into ``tensor``."""
    return _start(_broadcast_call(tensor, root_rank, name, process_set, True, "hvd.broadcast_async_").first())


def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None,
               process_set: Any = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` with ``root_rank``'s; returns ``tensor``."""
    return _now(_broadcast_call(tensor, root_rank, name, process_set, True, "hvd.broadcast_").first())


def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None,
              process_set: Any = global_process_set) -> torch.Tensor:
    """``root_rank``'s ``tensor`` on every rank, as a new tensor; differentiable."""
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


def _alltoall_now(tensor: torch.Tensor, splits: np.ndarray | None, name: str, process_set: Any) -> Any:
    backends = _backends(process_set, "hvd.alltoall")
    out, received = backends.mpi.alltoall(host_array(tensor, reducing=False), splits, name)
    return as_tensor(out, tensor), torch.from_numpy(np.asarray(received, dtype=np.int32))


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: str | None = None,
                   process_set: Any = global_process_set) -> int:
    """Start sending rows ``splits[r]`` of ``tensor`` to rank r (equal parts where None); ``synchronize``
    returns what arrived and how many rows came from each rank."""
    return _start(_alltoall_call(tensor, splits, name, process_set, "hvd.alltoall_async"))


def _alltoall_call(tensor: Any, splits: Any, name: str | None, process_set: Any, call: str) -> _Call:
    (tensor,) = _checked([tensor], call)
    names, split_array = _names(name, "alltoall", 1), _splits(splits)
    return _Call(lambda: _alltoall_now(tensor, split_array, names[0], process_set), tuple(names))


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
    """Rows ``splits[r]`` of ``tensor`` sent to rank r (equal parts where None), what arrived
    concatenated; with ``splits`` given, also how many rows came from each rank. Differentiable."""
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


def _scaled(tensors: list[torch.Tensor], prescale: float) -> list[torch.Tensor]:
    """CUDA tensors scaled before their reduction, on the caller's stream (host tensors are scaled later)."""
    if prescale == 1.0 or not tensors or not tensors[0].is_cuda:
        return tensors
    return [scale(t, prescale) for t in tensors]


def reducescatter_async(tensor: torch.Tensor, name: str | None = None, op: int = Average,
                        process_set: Any = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start reducing ``tensor`` over ranks and keeping this rank's block of its first dimension."""
    return _start(_reducescatter_call([tensor], name, op, process_set, prescale_factor, postscale_factor,
                                      "hvd.reducescatter_async").first())


def _reducescatter_call(tensors: list[Any], name: str | None, op: int, process_set: Any, prescale: float,
                        postscale: float, call: str) -> _Call:
    check_op(op)

    def run(backends: Any, tensors: list[torch.Tensor], names: list[str], ready: gpu.Ready | None) -> list[Any]:
        if ready is not None:  # (the prescale was applied before the event: see _scaled)
            results = gpu.reducescatter(backends.nccl, ready, tensors, op, names)
        else:
            outs = backends.mpi.reducescatter([host_array(scale(t, prescale), reducing=True) for t in tensors], op,
                                              names)
            results = [as_tensor(o, t) for o, t in zip(outs, tensors)]
        return [scale(r, postscale) for r in results]

    return _collective("reducescatter", tensors, name, process_set, call, True, run, prescale=prescale)


def grouped_reducescatter_async(tensors: list[torch.Tensor], name: str | None = None, op: int = Average,
                                process_set: Any = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """Start ``reducescatter`` of several tensors."""
    return _start(_reducescatter_call(tensors, name, op, process_set, prescale_factor, postscale_factor,
                                      "hvd.grouped_reducescatter_async"))


def reducescatter(tensor: torch.Tensor, name: str | None = None, compression: Any = Compression.none,
                  op: int = Average, process_set: Any = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """``tensor`` reduced over ranks, this rank's block of its first dimension; differentiable."""
    check_tensor(tensor, "hvd.reducescatter")
    return _scattered([tensor], name, compression, op, process_set, prescale_factor, postscale_factor,
                      "hvd.reducescatter")[0]


def grouped_reducescatter(tensors: list[torch.Tensor], name: str | None = None, compression: Any = Compression.none,
                          op: int = Average, process_set: Any = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[torch.Tensor]:
    """``reducescatter`` of several tensors; differentiable."""
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
    """Start reducing a sparse tensor as Horovod does: its indices and values allgathered, the sum (or
    average) made by ``coalesce``. Returns, as Horovod's, a function that waits and returns the reduced
    sparse tensor."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise TypeError("hvd.sparse_allreduce_async takes a sparse torch.Tensor; hvd.allreduce_async takes dense "
                        "ones.")
    check_op(op)
    if op not in (Average, Sum):
        raise NotImplementedError("sparse allreduce supports op=hvd.Average or hvd.Sum only.")
    grad = tensor.coalesce()
    names = [f"{name}.values", f"{name}.indices"]
    values, indices = grad.values(), grad.indices().t().contiguous()

    def run() -> torch.Tensor:
        backends = _backends(process_set, "hvd.sparse_allreduce_async")
        v, i = _allgather(backends, [values, indices], names)
        out = torch.sparse_coo_tensor(i.t(), v, grad.shape, check_invariants=False).coalesce()  # (valid: coalesced)
        return out / backends.size if op == Average else out

    handle = _start(_Call(run, tuple(names)))
    return lambda: synchronize(handle)


# ------------------------------------------------------------------ the rest
def join(device: int = -1) -> int:
    """Say this rank has no more data: it takes part, with zeros, in the other ranks' allreduces until
    every rank has joined. Returns the rank that joined last. (``device``: Horovod's device for the
    zeros; here the core makes them where the other ranks' tensors are.)"""
    return _objects.join()


def barrier(process_set: Any = global_process_set) -> None:
    """Return once every rank (of ``process_set``) has called ``barrier()``."""
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
