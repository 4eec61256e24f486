"""The PyTorch binding's collectives through ``torch.distributed``: gloo for CPU tensors, NCCL for CUDA tensors.

Agreement is the core's, as for the MPI backend (same signatures, with ``via="DIST"``; same refusals, timeline
phases and errors): it handles host metadata only. In its agreed turn a call packs its tensors into one flat
buffer (cached per signature with its per-tensor views, filled by one ``torch._foreach_copy_``) and issues one
``torch.distributed`` collective with ``async_op=True`` (the ranks issue in the agreed order); the turn is then
released. Allreduces agreed in one round share one call (the core's ``Work`` protocol, as ``core/mpi_backend``'s
``_AllreduceWork``). The caller finishes the call (``Issued.finish``): the device module's ``after`` (on NCCL the
caller's stream waits, not the host), then one op for the average or scale and one batched copy out. Half types
are reduced in float32, integers averaged as Horovod does (truncated), as the core does.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..core import ops
from ..core.fusion import fused_label, fusion_groups, fusion_threshold
from ..core.mpi_backend import alltoall_splits
from ..core.signatures import (
    AllreduceCall,
    allgather_signature,
    allreduce_signature,
    alltoall_signature,
    broadcast_signature,
    reducescatter_signature,
)
from . import device
from .group import group_of

VIA = "DIST"  # the road every rank's signatures name: a rank on MPI and one here never pair
_HALF = (torch.float16, torch.bfloat16)
_OPS = {ops.Sum: dist.ReduceOp.SUM, ops.Average: dist.ReduceOp.SUM, ops.Min: dist.ReduceOp.MIN,
        ops.Max: dist.ReduceOp.MAX, ops.Product: dist.ReduceOp.PRODUCT}
_NUMPY: dict[torch.dtype, np.dtype | None] = {}
_CACHED_BUFFERS = 64  # flat buffers kept per backend (one per signature in use)
_ALIGN = 16  # bytes: each tensor's start in a byte buffer, so that it can be viewed as its dtype
# a call of one tensor this large (agreed: its shape is in its signature) shares no call: reduced in place
# where it can be (DistributedOptimizer's flat buckets), it would otherwise be copied in and out of a buffer
ALONE_BYTES = 1 << 20


def dtype_name(dtype: torch.dtype) -> str:
    """The dtype's name as the agreement names it (``bfloat16`` included)."""
    return str(dtype).removeprefix("torch.")


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a reduction of ``dtype`` runs in: float32 for the half types, as the core reduces them."""
    return torch.float32 if dtype in _HALF else dtype


def dtype_refusal(dtype: torch.dtype, reducing: bool) -> str | None:
    """Why ``dtype`` cannot take part (``ops.dtype_refusal``'s words); None where it can."""
    if dtype in _HALF:
        return None
    numpy = _NUMPY.get(dtype)
    if dtype not in _NUMPY:
        numpy = _NUMPY[dtype] = torch.empty(0, dtype=dtype).numpy().dtype
    return ops.dtype_refusal(numpy, reducing)  # type: ignore[arg-type]


def scale_(flat: torch.Tensor, factor: float) -> torch.Tensor:
    """``flat * factor`` into ``flat`` (one op): floats as they are, integers in float64 then truncated."""
    if flat.is_floating_point():
        return flat.mul_(factor)
    return flat.copy_(flat.to(torch.float64).mul_(factor))


def finish_(flat: torch.Tensor, op: int, size: int, postscale: float) -> torch.Tensor:
    """The average's division, then the postscale, in place (``ops.finish_reduction`` on a tensor)."""
    if op == ops.Average:
        scale_(flat, 1.0 / size)
    if postscale != 1.0:
        scale_(flat, postscale)
    return flat


class Issued:
    """A collective issued in its turn, finished by its caller: ``finish()`` waits (the device module's ``after``)
    and returns ``then(buffer)``."""

    __slots__ = ("work", "buffer", "then")

    def __init__(self, work: Any, buffer: torch.Tensor, then: Callable[[torch.Tensor], Any]) -> None:
        self.work, self.buffer, self.then = work, buffer, then

    def finish(self) -> Any:
        device.after(self.work, self.buffer)
        return self.then(self.buffer)

    def ready(self) -> bool:
        """Has its data moved (``poll``)?"""
        return bool(self.work.is_completed())


class Deferred:
    """A call's result once its issued parts are finished (``finish``), and what to do after (``also``)."""

    def __init__(self, parts: list[Any], combine: Callable[[list[Any]], Any]) -> None:
        self.parts, self.combine = parts, combine

    def finish(self) -> Any:
        return self.combine([p.finish() for p in self.parts])

    def ready(self) -> bool:
        """Has every part's data moved (``poll``)?"""
        return all(p.ready() for p in self.parts)

    def then(self, after: Callable[[Any], Any]) -> Deferred:
        """The same call, its result passed through ``after``."""
        return Deferred([self], lambda results: after(results[0]))


class _Buffers:
    """Flat buffers and their per-tensor views, made once per key (a signature and device) and reused."""

    def __init__(self) -> None:
        self.cache: OrderedDict[tuple, tuple[torch.Tensor, list[torch.Tensor]]] = OrderedDict()

    def get(self, key: tuple, shapes: list[torch.Size], dtype: torch.dtype,
            where: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
        found = self.cache.get(key)
        if found is not None:
            self.cache.move_to_end(key)
            return found
        sizes = [math.prod(s) for s in shapes]
        flat = torch.empty(sum(sizes), dtype=dtype, device=where)
        views = [v.view(s) for v, s in zip(flat.split(sizes), shapes)]
        self.cache[key] = (flat, views)
        if len(self.cache) > _CACHED_BUFFERS:
            self.cache.popitem(last=False)
        return flat, views


class _AllreduceWork:
    """One agreed allreduce's packing and issue, which the allreduces agreed right after it may join
    (``Coordinator.run_fused``): one ``torch.distributed`` call for all their tensors."""

    __slots__ = ("backend", "tensors", "op", "prescale", "postscale", "label", "marked", "in_place", "fusion_key",
                 "nbytes", "solo", "done", "issued", "span")

    def __init__(self, backend: DistBackend, tensors: list[torch.Tensor], op: int, prescale: float,
                 postscale: float, label: str, marked: Any, in_place: bool) -> None:
        self.backend, self.tensors, self.label, self.marked, self.in_place = backend, tensors, label, marked, in_place
        self.op, self.prescale, self.postscale = op, prescale, postscale
        dtype = work_dtype(tensors[0].dtype)
        self.fusion_key: tuple = (dtype, tensors[0].device, op, prescale, postscale)  # (agreed, or alike everywhere)
        self.nbytes = sum(t.numel() for t in tensors) * dtype.itemsize
        if len(tensors) == 1 and self.nbytes >= ALONE_BYTES:  # (its name is agreed and in flight once)
            self.fusion_key = ("alone", label)
        self.solo, self.done = True, False
        self.issued: Any = None  # (the dist work, the flat buffer, its views)
        self.span = (0, 0, 0)  # this request's elements in the buffer (start, end) and its first view's index

    def run(self, followers: list[_AllreduceWork]) -> None:
        works = [self, *followers]
        tensors = [t for w in works for t in w.tensors]
        label = fused_label([w.label for w in works]) if followers else self.label
        backend = self.backend
        own = self.in_place and not followers and len(tensors) == 1 and _flat_already(tensors[0])
        if own:  # (a flat tensor reduced in place, such as DistributedOptimizer's bucket: no pack, no unpack)
            flat, views = tensors[0], None
        else:
            key = (label, tuple(t.shape for t in tensors), tensors[0].dtype, tensors[0].device)
            flat, views = backend.buffers.get(key, [t.shape for t in tensors], work_dtype(tensors[0].dtype),
                                              tensors[0].device)
        # (the inputs stay referenced until their caller has waited for the call: no per-tensor record_stream)
        with device.enter([w.marked for w in works]):
            if views is not None:
                with backend.timeline.phase("MEMCPY_IN_FUSION_BUFFER", label, flat.nbytes):
                    torch._foreach_copy_(views, tensors)
            if self.prescale != 1.0:
                scale_(flat, self.prescale)
            with backend.timeline.phase(f"{backend.prefix}_ALLREDUCE", label, flat.nbytes):
                work = dist.all_reduce(flat, op=_OPS[self.op], group=backend.group(), async_op=True)
        start = first = 0
        for w in works:
            count = sum(t.numel() for t in w.tensors)
            w.issued, w.span = (work, flat, views), (start, start + count, first)
            start, first = start + count, first + len(w.tensors)

    def finished(self) -> Issued:
        """How the caller finishes: its slice averaged and scaled, then copied out (into the tensors where
        ``in_place``) with one batched copy."""
        work, flat, views = self.issued
        start, end, first = self.span
        size, op, postscale, tensors, in_place = self.backend.size, self.op, self.postscale, self.tensors, \
            self.in_place

        def then(flat: torch.Tensor) -> list[torch.Tensor]:
            piece = flat if end - start == flat.numel() else flat[start:end]
            finish_(piece, op, size, postscale)
            if views is None:  # (reduced in the tensor itself)
                return tensors
            if in_place:
                torch._foreach_copy_(tensors, views[first:first + len(tensors)])
                return tensors
            out = piece.to(tensors[0].dtype, copy=True)
            return [o.view(t.shape) for o, t in zip(out.split([t.numel() for t in tensors]), tensors)]

        return Issued(work, flat, then)


def _flat_already(tensor: torch.Tensor) -> bool:
    """Can ``tensor`` itself be the call's buffer (one dense, contiguous tensor of its work dtype)?"""
    return tensor.layout == torch.strided and tensor.is_contiguous() and tensor.dtype == work_dtype(tensor.dtype)


def _in_order(results: list[Any], order: list[int] | None) -> list[Any]:
    """Results given in fusion-plan order (``order``: each one's index), in the tensors' order."""
    if order is None:
        return results
    out: list[Any] = [None] * len(results)
    for i, r in zip(order, results):
        out[i] = r
    return out


def _byte_layout(shapes: list[tuple], dtypes: list[torch.dtype]) -> tuple[list[int], list[int], int]:
    """Each tensor's start and bytes in one byte buffer (starts ``_ALIGN``-aligned), and the buffer's bytes."""
    offsets, sizes, end = [], [], 0
    for shape, dtype in zip(shapes, dtypes):
        start = -(-end // _ALIGN) * _ALIGN
        nbytes = math.prod(shape) * dtype.itemsize
        offsets.append(start)
        sizes.append(nbytes)
        end = start + nbytes
    return offsets, sizes, end


def _typed_views(buf: torch.Tensor, shapes: list[tuple], dtypes: list[torch.dtype],
                 offsets: list[int], sizes: list[int]) -> list[torch.Tensor]:
    """The tensors a byte buffer holds at ``offsets``, as views of it."""
    return [buf[o:o + n].view(d).view(s) for o, n, d, s in zip(offsets, sizes, dtypes, shapes)]


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any) -> Any:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, inp, group=group, async_op=True)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, op: Any, group: Any) -> Any:
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(out, inp, op=op, group=group, async_op=True)


class _Moves:
    """The collectives other than allreduce (``DistBackend`` adds it): each packed and issued in its agreed
    turn, finished by its caller."""

    negotiator: Any
    timeline: Any
    comm: Any
    rank: int
    size: int
    prefix: str
    group: Callable[[], Any]

    def refuse_dtype(self, sig: Any, kind: str, name: str, dtype: torch.dtype, reducing: bool = False) -> None:
        """Raise on every rank where this rank's ``dtype`` cannot take part in the call ``sig``."""
        why = dtype_refusal(dtype, reducing)
        if why:
            self.negotiator.refuse(sig, f"{kind} of '{name}': {why}")

    def check_root(self, root: int, sig: Any) -> None:
        """Raise on every rank unless ``root`` is a rank of this communicator."""
        if not isinstance(root, (int, np.integer)) or not 0 <= root < self.size:
            self.negotiator.refuse(sig, f"root_rank={root!r} is not a rank: use 0..{self.size - 1}.")

    # ------------------------------------------------------------ broadcast
    def broadcast(self, tensors: list[torch.Tensor], root: int, names: list[str], marked: Any,
                  in_place: bool = False) -> Deferred:
        """Every rank gets rank ``root``'s tensors (of this communicator), all in one byte buffer."""
        label = fused_label(names)
        shapes, dtypes = [tuple(t.shape) for t in tensors], [t.dtype for t in tensors]
        sig = broadcast_signature(root, tuple(dtype_name(d) for d in dtypes), tuple(shapes), label)
        self.check_root(root, sig)
        for t, name in zip(tensors, names):
            self.refuse_dtype(sig, "broadcast", name, t.dtype)
        offsets, sizes, total = _byte_layout(shapes, dtypes)
        buf = torch.empty(total, dtype=torch.uint8, device=tensors[0].device)
        views = _typed_views(buf, shapes, dtypes, offsets, sizes)
        with self.negotiator.turn(sig), device.enter([marked]):
            if self.rank == root:
                torch._foreach_copy_(views, tensors)
            with self.timeline.phase(f"{self.prefix}_BROADCAST", label, total):
                work = dist.broadcast(buf, group=self.group(), group_src=root, async_op=True)
        mine = self.rank == root

        def then(_: torch.Tensor) -> list[torch.Tensor]:
            if not in_place:
                return views
            if not mine:
                torch._foreach_copy_(tensors, views)
            return tensors

        return Deferred([Issued(work, buf, then)], lambda results: results[0])

    # ------------------------------------------------------------ allgather
    def allgather(self, tensors: list[torch.Tensor], names: list[str], marked: Any) -> Deferred:
        """Concatenate each tensor over the ranks along its first dimension (which may differ), all in one
        call of equal blocks (each rank's padded to the largest)."""
        label = names[0] if len(names) == 1 else f"{names[0]} +{len(names) - 1} grouped"
        dtypes = [t.dtype for t in tensors]
        sig = allgather_signature(tuple(dtype_name(d) for d in dtypes), tuple(tuple(t.shape[1:]) for t in tensors),
                                  label)
        for t, name in zip(tensors, names):
            if t.dim() == 0:
                self.negotiator.refuse(sig, f"allgather of '{name}': the tensor needs at least one dimension "
                                       "(it is a scalar).")
            self.refuse_dtype(sig, "allgather", name, t.dtype)
        with self.negotiator.turn(sig):
            all_rows = self.comm.allgather([int(t.shape[0]) for t in tensors])
            shapes = [[(rows[i], *t.shape[1:]) for i, t in enumerate(tensors)] for rows in all_rows]
            layouts = [_byte_layout(s, dtypes) for s in shapes]
            block = -(-max(total for _, _, total in layouts) // _ALIGN) * _ALIGN  # (each block's start aligned)
            send = torch.zeros(block, dtype=torch.uint8, device=tensors[0].device)
            recv = torch.empty(self.size * block, dtype=torch.uint8, device=tensors[0].device)
            with device.enter([marked]):
                offsets, sizes, _ = layouts[self.rank]
                torch._foreach_copy_(_typed_views(send, shapes[self.rank], dtypes, offsets, sizes), tensors)
                with self.timeline.phase(f"{self.prefix}_ALLGATHER", label, recv.nbytes):
                    work = _all_gather(recv, send, self.group())

        def then(recv: torch.Tensor) -> list[torch.Tensor]:
            blocks = [_typed_views(recv[r * block:(r + 1) * block], shapes[r], dtypes, *layouts[r][:2])
                      for r in range(self.size)]
            return [torch.cat([b[i] for b in blocks]) for i in range(len(tensors))]

        return Deferred([Issued(work, recv, then)], lambda results: results[0])

    # -------------------------------------------------------- reducescatter
    def reducescatter(self, tensors: list[torch.Tensor], op: int, names: list[str], marked: Any) -> Deferred:
        """Reduce over the ranks, then give rank r its block of rows (``ops.even_rows``); each tensor one call."""
        return Deferred([self._reducescatter_one(t, op, name, marked) for t, name in zip(tensors, names)],
                        lambda results: results)

    def _reducescatter_one(self, tensor: torch.Tensor, op: int, name: str, marked: Any) -> Issued:
        sig = reducescatter_signature(op, dtype_name(tensor.dtype), tuple(tensor.shape), name)
        if tensor.dim() == 0:  # (the op was checked by the call, before any communication)
            self.negotiator.refuse(sig, f"reducescatter of '{name}': the tensor needs at least one dimension.")
        self.refuse_dtype(sig, "reducescatter", name, tensor.dtype, reducing=True)
        rows = ops.even_rows(int(tensor.shape[0]), self.size)
        row_elems = math.prod(tensor.shape[1:])
        block, dtype = max(rows) * row_elems, work_dtype(tensor.dtype)
        recv = torch.empty(block, dtype=dtype, device=tensor.device)
        with self.negotiator.turn(sig), device.enter([marked]):
            send = _padded_blocks(tensor, rows, row_elems, block, dtype)
            with self.timeline.phase(f"{self.prefix}_REDUCESCATTER", name, send.nbytes):
                work = _reduce_scatter(recv, send, _OPS[op], self.group())
        size, mine = self.size, rows[self.rank]

        def then(recv: torch.Tensor) -> torch.Tensor:
            out = finish_(recv[:mine * row_elems], op, size, 1.0)
            return out.to(tensor.dtype).view((mine, *tensor.shape[1:]))

        return Issued(work, recv, then)

    # ------------------------------------------------------------- alltoall
    def alltoall(self, tensor: torch.Tensor, splits: Any, name: str, marked: Any) -> Deferred:
        """Send rows ``splits[r]`` of ``tensor`` to rank r; (what arrived, how many rows from each rank)."""
        sig = alltoall_signature(dtype_name(tensor.dtype), tuple(tensor.shape[1:]), name)
        try:
            splits = alltoall_splits(tuple(tensor.shape), splits, self.size, name)
        except ValueError as exc:
            self.negotiator.refuse(sig, str(exc))
        self.refuse_dtype(sig, "alltoall", name, tensor.dtype)
        row_elems = math.prod(tensor.shape[1:])
        with self.negotiator.turn(sig):
            received = np.asarray(self.comm.alltoall([int(s) for s in splits]), dtype=np.int64)
            out = torch.empty((int(received.sum()), *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
            with device.enter([marked]):
                send = tensor.contiguous().view(-1).view(torch.uint8)
                with self.timeline.phase(f"{self.prefix}_ALLTOALL", name, send.nbytes):
                    work = dist.all_to_all_single(out.view(-1).view(torch.uint8), send,
                                                  [int(r) * row_elems * tensor.element_size() for r in received],
                                                  [int(s) * row_elems * tensor.element_size() for s in splits],
                                                  group=self.group(), async_op=True)
        counts = torch.from_numpy(received.astype(np.int32))
        return Deferred([Issued(work, out, lambda out: (out, counts))], lambda results: results[0])


def _padded_blocks(tensor: torch.Tensor, rows: list[int], row_elems: int, block: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """``tensor``'s rows in ``dtype``, rank r's rows at ``r * block`` (equal blocks, as one call sends them)."""
    flat = tensor.reshape(-1)
    if all(r == rows[0] for r in rows):
        return flat.to(dtype, copy=True)
    send = torch.zeros(len(rows) * block, dtype=dtype, device=tensor.device)
    start = 0
    for r, n in enumerate(rows):
        send[r * block:r * block + n * row_elems] = flat[start:start + n * row_elems]
        start += n * row_elems
    return send


class DistBackend(_Moves):
    """The collectives of one communicator (the world's or a process set's) on ``torch.distributed``'s group
    for it. Built once per ``Backends`` (``of``).

    Args:
        backends: the core's communicator, agreement and timeline (``world.Backends``).
        world: the world (its group is torch.distributed's default one).
    """

    def __init__(self, backends: Any, world: Any) -> None:
        # (weakly: the backends own this object through ``of``'s table, and a set's are freed with the set)
        self.backends, self.world = weakref.ref(backends), weakref.ref(world)
        self.negotiator, self.timeline, self.comm = backends.negotiator, backends.timeline, backends.comm
        self.rank, self.size = backends.rank, backends.size
        self.buffers = _Buffers()
        self.prefix = "NCCL" if "nccl" in str(dist.get_backend()).lower() else "GLOO"  # (a set's group: alike)

    def group(self) -> Any:
        """The group (made in the set's first turn that needs it: every member is there)."""
        return group_of(self.backends(), self.world())

    # ------------------------------------------------------------ allreduce
    def allreduce(self, tensors: list[torch.Tensor], op: int, prescale: float, postscale: float, names: list[str],
                  marked: Any, in_place: bool = False) -> Deferred:
        """Reduce each tensor over the ranks, fused into calls of one dtype of up to ``HOROVOD_FUSION_THRESHOLD``
        bytes; the result (a list of tensors) once ``finish``-ed."""
        ops.check_op(op)
        parts = []
        for group in self.fusion_plan(tensors):
            members = [tensors[i] for i in group]
            label = fused_label([names[i] for i in group])
            sig = allreduce_signature(op, dtype_name(members[0].dtype), tuple(tuple(t.shape) for t in members),
                                      prescale, postscale, label, via=VIA)
            self.refuse_dtype(sig, "allreduce", label, members[0].dtype, reducing=True)
            work = _AllreduceWork(self, members, op, prescale, postscale, label, marked, in_place)
            self.negotiator.run(sig, work, allow_joined=True)
            parts.append(work.finished())
        order = [i for group in self.fusion_plan(tensors) for i in group] if len(parts) > 1 else None
        return Deferred(parts, lambda results: _in_order([r for rs in results for r in rs], order))

    @staticmethod
    def fusion_plan(tensors: list[torch.Tensor]) -> list[list[int]]:
        """Which tensors share a call (``fusion.fusion_groups`` by dtype and bytes)."""
        dtype, threshold = tensors[0].dtype, fusion_threshold()
        nbytes = [t.numel() * work_dtype(t.dtype).itemsize for t in tensors]
        if threshold > 0 and all(t.dtype == dtype for t in tensors) and sum(nbytes) <= threshold:
            return [list(range(len(tensors)))]
        return fusion_groups([(str(t.dtype), n) for t, n in zip(tensors, nbytes)])

    def allreduce_zeros(self, call: AllreduceCall) -> None:
        """Take part with zeros in the other ranks' allreduce (after ``hvd.join()``)."""
        dtype = work_dtype(getattr(torch, call.dtype))
        zeros = torch.zeros(call.elements, dtype=dtype, device=device.working_device(self.prefix == "NCCL"))
        with self.timeline.phase(f"{self.prefix}_ALLREDUCE", "join", zeros.nbytes):
            dist.all_reduce(zeros, op=_OPS[call.op], group=self.group())


_backends: weakref.WeakKeyDictionary[Any, DistBackend] = weakref.WeakKeyDictionary()


def of(backends: Any, world: Any) -> DistBackend:
    """The ``DistBackend`` of ``backends`` (the world's or a process set's), made once; the world's serves a
    joined rank's zeros in the allreduces that name ``VIA``."""
    found = _backends.get(backends)
    if found is None:
        found = _backends[backends] = DistBackend(backends, world)
        serving = getattr(backends, "serving", None)
        if serving is not None:
            serving[VIA] = found
    return found


__all__ = ["VIA", "Deferred", "DistBackend", "Issued", "dtype_refusal", "of", "work_dtype"]
