"""The collectives on numpy arrays: negotiation, fusion, MPI calls, timeline.

Everything here works on host memory with the MPI library's own collectives
(``Allreduce`` in place on a fused buffer, ``Allgatherv``, ``Bcast``,
``Alltoallv``, ``Reduce_scatter``): bandwidth-optimal algorithms chosen by
MPI, never a gather to one rank. ``collectives.py`` wraps these for
TensorFlow tensors.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from . import basics
from .negotiation import MismatchError, Negotiator, Signature, describe_mismatch
from .timeline import Timeline

# Reduction ops, with Horovod's values
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}
DEFAULT_FUSION_THRESHOLD = 128 * 1024 * 1024  # bytes, as Horovod's HOROVOD_FUSION_THRESHOLD


def fusion_groups(items: list[tuple[Any, int]]) -> list[list[int]]:
    """Indices of ``(dtype, nbytes)`` items grouped by dtype, in order, each
    group's bytes within ``HOROVOD_FUSION_THRESHOLD`` (one tensor per group at 0)."""
    threshold = fusion_threshold()
    groups: list[list[int]] = []
    open_group: dict[Any, tuple[list[int], int]] = {}
    for i, (key, nbytes) in enumerate(items):
        members, total = open_group.get(key, ([], 0))
        if members and (threshold <= 0 or total + nbytes > threshold):
            members, total = [], 0
        if not members:
            groups.append(members)
        members.append(i)
        open_group[key] = (members, total + nbytes)
    return groups


def allreduce_signature(op: int, dtype: str, shapes: tuple, prescale: float, postscale: float, label: str,
                        via: str = "MPI") -> Signature:
    """What must match across ranks for one (fused) allreduce; ``via`` is where the
    data goes (MPI on the host, NCCL on the GPU): every rank must take the same road."""
    return Signature("allreduce", (("op", OP_NAMES[op]), ("dtype", dtype), ("shapes", shapes),
                                   ("prescale_factor", prescale), ("postscale_factor", postscale),
                                   ("via", via)), label)


def fused_label(names: list[str]) -> str:
    """How the timeline names a fusion buffer: its first tensor and how many more."""
    return names[0] if len(names) == 1 else f"{names[0]} +{len(names) - 1} fused"


def fusion_threshold() -> int:
    """Bytes per fusion buffer, from ``HOROVOD_FUSION_THRESHOLD`` (0: no fusion)."""
    try:
        return int(os.environ.get("HOROVOD_FUSION_THRESHOLD", DEFAULT_FUSION_THRESHOLD))
    except ValueError:
        return DEFAULT_FUSION_THRESHOLD


def _reduce_dtype(dtype: np.dtype) -> np.dtype:
    """MPI has no half-precision types: float16 and bfloat16 are reduced as float32."""
    if dtype.itemsize == 2 and _dtype_name(dtype) in ("float16", "bfloat16"):
        return np.dtype(np.float32)
    return dtype


def _bytes(arr: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)


class Runtime:
    """The collectives of one initialised world (see ``basics.init``)."""

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.negotiator = Negotiator(comm)
        self.timeline = Timeline()
        self.joined = False
        self.nccl: Any = None  # nccl_backend.NcclRuntime where every rank has a GPU (start_nccl)
        self._one: dict[tuple, tuple[Signature, int, Any, Any]] = {}  # allreduce_one's cache
        self._mpi_ops = {Sum: MPI.SUM, Average: MPI.SUM, Min: MPI.MIN, Max: MPI.MAX, Product: MPI.PROD}

    def start_nccl(self, local_rank: int) -> None:
        """Create the NCCL communicator where every rank has a GPU (collective)."""
        from . import nccl_backend

        self.nccl = nccl_backend.start(self.comm, local_rank, self.timeline, self._agree)

    def free(self) -> None:
        if self.nccl is not None:
            self.nccl.free()
            self.nccl = None
        self.negotiator.free()

    # ------------------------------------------------------------ agreement
    def _agree(self, sig: Signature, allow_joined: bool = False) -> None:
        with self.timeline.phase(f"NEGOTIATE_{sig.kind.upper()}", sig.name, 0):
            signatures = self.negotiator.agree(sig)
        if signatures is not None:
            self._disagree(signatures, allow_joined)

    def _disagree(self, signatures: list[Signature], allow_joined: bool) -> None:
        """Signatures differ: fine where the others have joined, else an error naming what differs."""
        active = [s for s in signatures if s.kind != "join"]
        if allow_joined and active and all(s == active[0] for s in active):
            return  # joined ranks take part with zeros (see join())
        raise MismatchError(describe_mismatch(signatures))

    # ------------------------------------------------------------ allreduce
    def allreduce(self, arrays: list[np.ndarray], op: int, prescale: float, postscale: float,
                  names: list[str]) -> list[np.ndarray]:
        """Reduce each array over all ranks; arrays of one dtype are fused into
        buffers of up to ``HOROVOD_FUSION_THRESHOLD`` bytes, one MPI call each."""
        results: list[np.ndarray | None] = [None] * len(arrays)
        for group, buf, offsets in self.allreduce_fused(arrays, op, prescale, postscale, names):
            with self.timeline.phase("MEMCPY_OUT_FUSION_BUFFER", fused_label([names[i] for i in group]), buf.nbytes):
                for i, off in zip(group, offsets):
                    results[i] = buf[off:off + arrays[i].size].reshape(arrays[i].shape)
        return results  # type: ignore[return-value]

    def allreduce_fused(self, arrays: list[np.ndarray], op: int, prescale: float, postscale: float,
                        names: list[str], shapes: tuple | None = None) -> list[tuple[list[int], np.ndarray, list[int]]]:
        """Like ``allreduce`` but returns, per fusion buffer, the indices of the
        arrays in it, the reduced 1-D buffer and each array's element offset.
        ``shapes`` replaces the arrays' own shapes in the agreement check (for a
        buffer that TensorFlow packed from tensors of these shapes)."""
        if op == Adasum:
            raise NotImplementedError(
                "op=hvd.Adasum is not supported by hvd_notebook's built-in runtime; use hvd.Average or hvd.Sum."
            )
        if op not in self._mpi_ops:
            raise ValueError(f"op={op!r} is not one of hvd.Average, hvd.Sum, hvd.Min, hvd.Max, hvd.Product.")
        if len(arrays) == 1 and (shapes is None or len(shapes) == 1):
            # one tensor: the single-tensor path, agreeing on the same signature
            shape = arrays[0].shape if shapes is None else shapes[0]
            if shape is not None and None not in shape:  # (a graph's dynamic shape takes the general path)
                one = self.allreduce_one(arrays[0].reshape(shape), op, prescale, postscale, names[0])
                if one is not None:
                    return [([0], one.reshape(-1), [0])]
        out = []
        for group in self._fusion_groups(arrays):
            buf, offsets = self._allreduce_group([arrays[i] for i in group], op, prescale, postscale,
                                                 [names[i] for i in group], shapes)
            out.append((group, buf, offsets))
        return out

    def allreduce_one(self, arr: np.ndarray, op: int, prescale: float, postscale: float,
                      label: str) -> np.ndarray | None:
        """The common case, one tensor, with everything that depends only on its
        shape, dtype and arguments (validation, signature, its hash) cached: the
        same work as ``allreduce_fused`` for one array, minus Python. The result
        has the array's shape. None (before any communication) where the general
        path must take it: a dtype MPI cannot reduce, a prescale."""
        key = (arr.shape, arr.dtype, op, prescale, postscale)
        hit = self._one.get(key)
        if hit is None:
            if op not in self._mpi_ops or prescale != 1.0 or _reduce_dtype(arr.dtype) != arr.dtype:
                return None
            sig = allreduce_signature(op, _dtype_name(arr.dtype), (arr.shape,), prescale, postscale, "")
            # MPI's result is the answer, or scaled in place as _reduce scales it (floats), in a pooled buffer
            factors = ((1.0 / self.size,) if op == Average else ()) + ((postscale,) if postscale != 1.0 else ())
            lean = not factors or arr.dtype.kind == "f"
            hit = self._one[key] = (sig, self.negotiator.hash_of(sig), self._mpi_ops[op] if lean else None,
                                    tuple(arr.dtype.type(f) for f in factors))
        sig, h, mpi_op, factors = hit
        timeline = self.timeline
        if timeline.path is None:  # (the phases' context managers cost a microsecond)
            signatures = self.negotiator.agree(sig, h, label)
        else:
            with timeline.phase("NEGOTIATE_ALLREDUCE", label, 0):
                signatures = self.negotiator.agree(sig, h, label)
        if signatures is not None:
            self._disagree(signatures, allow_joined=True)  # raises unless the others have joined
        if mpi_op is None or not arr.flags.c_contiguous:
            return self._reduce([arr], op, prescale, postscale, label)[0].reshape(arr.shape)
        buf = _pool.get(arr.nbytes).view(arr.dtype)
        if arr.ndim != 1:
            buf = buf.reshape(arr.shape)
        if timeline.path is None:
            self.comm.Allreduce(arr, buf, op=mpi_op)
        else:
            with timeline.phase("MPI_ALLREDUCE", label, arr.nbytes):
                self.comm.Allreduce(arr, buf, op=mpi_op)
        for factor in factors:
            buf *= factor
        return buf

    @staticmethod
    def _fusion_groups(arrays: list[np.ndarray]) -> list[list[int]]:
        return fusion_groups([(a.dtype.str, a.nbytes) for a in arrays])

    def _allreduce_group(self, arrays: list[np.ndarray], op: int, prescale: float, postscale: float,
                         names: list[str], shapes: tuple | None = None) -> tuple[np.ndarray, list[int]]:
        dtype = arrays[0].dtype
        label = fused_label(names)
        sig = allreduce_signature(op, _dtype_name(dtype), shapes or tuple(a.shape for a in arrays), prescale,
                                  postscale, label)
        self._agree(sig, allow_joined=True)
        return self._reduce(arrays, op, prescale, postscale, label)

    def _reduce(self, arrays: list[np.ndarray], op: int, prescale: float, postscale: float,
                label: str) -> tuple[np.ndarray, list[int]]:
        """The data movement of one (fused) allreduce into a pooled buffer whose
        tensors each start at a 64-byte aligned offset, so that every result can
        become a TensorFlow tensor without a copy (``collectives._to_tf``).

        A single tensor of a type MPI reduces is reduced straight from its own
        memory into the buffer (out of place: no copy at all); several tensors
        are copied into the buffer and reduced in place."""
        dtype = arrays[0].dtype
        work = _reduce_dtype(dtype)
        mpi_op = self._mpi_ops[op]
        if len(arrays) == 1 and work == dtype and prescale == 1.0 and arrays[0].flags.c_contiguous:
            src = arrays[0]
            offsets, buf = [0], aligned_empty(src.size, dtype)
            with self.timeline.phase("MPI_ALLREDUCE", label, buf.nbytes):
                self.comm.Allreduce(src.reshape(-1) if src.ndim != 1 else src, buf, op=mpi_op)
        else:
            # offsets aligned for the narrower of the two dtypes the buffer will hold
            offsets, total = _aligned_offsets([a.size for a in arrays], min(work.itemsize, dtype.itemsize))
            buf = aligned_empty(total, work)
            with self.timeline.phase("MEMCPY_IN_FUSION_BUFFER", label, buf.nbytes):
                if total == sum(a.size for a in arrays):  # no padding needed: one C call copies them all
                    np.concatenate([a.reshape(-1) for a in arrays], out=buf, casting="same_kind")
                else:
                    end = 0
                    for a, off in zip(arrays, offsets):
                        if off > end:
                            buf[end:off] = 0  # padding between tensors
                        buf[off:off + a.size] = a.reshape(-1)
                        end = off + a.size
            if prescale != 1.0:
                buf = _scale(buf, prescale)
            with self.timeline.phase("MPI_ALLREDUCE", label, buf.nbytes):
                self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=mpi_op)
        if op == Average:
            buf = buf / self.size if buf.dtype.kind in "iub" else _scale(buf, 1.0 / self.size)
        if postscale != 1.0:
            buf = _scale(buf, postscale)
        if buf.dtype != dtype and not (op == Average and dtype.kind in "iub"):
            with self.timeline.phase("MEMCPY_OUT_FUSION_BUFFER", label, buf.nbytes):
                half = aligned_empty(buf.size, dtype)  # back from float32 to float16/bfloat16
                half[:] = buf
                buf = half
        elif buf.__array_interface__["data"][0] % ALIGN_BYTES:  # integers averaged into a new float64 array
            aligned = aligned_empty(buf.size, buf.dtype)
            aligned[:] = buf
            buf = aligned
        return buf, offsets

    # ------------------------------------------------------------ allgather
    def allgather(self, arrays: list[np.ndarray], names: list[str]) -> list[np.ndarray]:
        """Concatenate each array over ranks along its first dimension (which may differ)."""
        for arr, name in zip(arrays, names):
            if arr.ndim == 0:
                raise ValueError(f"allgather of '{name}': the tensor needs at least one dimension (it is a scalar).")
        label = names[0] if len(names) == 1 else f"{names[0]} +{len(names) - 1} grouped"
        sig = Signature("allgather", (("dtypes", tuple(a.dtype.name for a in arrays)),
                                      ("trailing shapes", tuple(a.shape[1:] for a in arrays))), label)
        self._agree(sig)
        rows = np.array([a.shape[0] for a in arrays], dtype=np.int64)
        all_rows = np.empty((self.size, len(arrays)), dtype=np.int64)
        self.comm.Allgather(rows, all_rows)
        outs = []
        with self.timeline.phase("MPI_ALLGATHER", label, sum(a.nbytes for a in arrays)):
            for i, arr in enumerate(arrays):
                row_bytes = int(np.prod(arr.shape[1:], dtype=np.int64)) * arr.dtype.itemsize
                counts = all_rows[:, i] * row_bytes
                displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
                out = np.empty((int(all_rows[:, i].sum()),) + arr.shape[1:], dtype=arr.dtype)
                self.comm.Allgatherv(_bytes(arr), [out.reshape(-1).view(np.uint8), counts, displs, self.MPI.BYTE])
                outs.append(out)
        return outs

    # ------------------------------------------------------------ broadcast
    def broadcast(self, arrays: list[np.ndarray], root_rank: int, names: list[str]) -> list[np.ndarray]:
        """Every rank gets root_rank's arrays; all arrays travel in one fused buffer."""
        self._check_root(root_rank)
        label = names[0] if len(names) == 1 else f"{names[0]} +{len(names) - 1} fused"
        sig = Signature("broadcast", (("root_rank", root_rank), ("dtypes", tuple(a.dtype.name for a in arrays)),
                                      ("shapes", tuple(a.shape for a in arrays))), label)
        self._agree(sig)
        nbytes = sum(a.nbytes for a in arrays)
        buf = np.empty(nbytes, dtype=np.uint8)
        if self.rank == root_rank:
            offset = 0
            for a in arrays:
                buf[offset:offset + a.nbytes] = _bytes(a)
                offset += a.nbytes
        with self.timeline.phase("MPI_BROADCAST", label, nbytes):
            self.comm.Bcast(buf, root=root_rank)
        outs, offset = [], 0
        for a in arrays:
            outs.append(buf[offset:offset + a.nbytes].view(a.dtype).reshape(a.shape).copy())
            offset += a.nbytes
        return outs

    def _check_root(self, root_rank: int) -> None:
        if not isinstance(root_rank, (int, np.integer)) or not 0 <= root_rank < self.size:
            raise ValueError(f"root_rank={root_rank!r} is not a rank: use 0..{self.size - 1}.")

    # ------------------------------------------------------------- alltoall
    def alltoall(self, arr: np.ndarray, splits: np.ndarray | None, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Send rows ``splits[r]`` of ``arr`` to rank r; return what arrived and from whom how many rows."""
        if arr.ndim == 0:
            raise ValueError(f"alltoall of '{name}': the tensor needs at least one dimension.")
        if splits is None:
            if arr.shape[0] % self.size:
                raise ValueError(f"alltoall of '{name}': without splits, the first dimension ({arr.shape[0]}) "
                                 f"must divide evenly by the number of ranks ({self.size}).")
            splits = np.full(self.size, arr.shape[0] // self.size, dtype=np.int64)
        splits = np.asarray(splits, dtype=np.int64).reshape(-1)
        if splits.size != self.size or splits.min() < 0 or splits.sum() != arr.shape[0]:
            raise ValueError(f"alltoall of '{name}': splits {splits.tolist()} must have one non-negative entry "
                             f"per rank ({self.size}) summing to the first dimension ({arr.shape[0]}).")
        self._agree(Signature("alltoall", (("dtype", arr.dtype.name), ("trailing shape", arr.shape[1:])), name))
        received = np.empty(self.size, dtype=np.int64)
        self.comm.Alltoall(splits, received)
        row_bytes = int(np.prod(arr.shape[1:], dtype=np.int64)) * arr.dtype.itemsize
        out = np.empty((int(received.sum()),) + arr.shape[1:], dtype=arr.dtype)
        send_counts, recv_counts = splits * row_bytes, received * row_bytes
        with self.timeline.phase("MPI_ALLTOALL", name, arr.nbytes):
            self.comm.Alltoallv(
                [_bytes(arr), send_counts, np.concatenate([[0], np.cumsum(send_counts)[:-1]]), self.MPI.BYTE],
                [out.reshape(-1).view(np.uint8), recv_counts, np.concatenate([[0], np.cumsum(recv_counts)[:-1]]),
                 self.MPI.BYTE],
            )
        return out, received

    # -------------------------------------------------------- reducescatter
    def reducescatter(self, arrays: list[np.ndarray], op: int, names: list[str]) -> list[np.ndarray]:
        """Reduce over ranks, then give rank r its block of rows (the first
        ``rows % size`` ranks get one row more)."""
        if op not in (Average, Sum, Min, Max, Product):
            raise ValueError(f"reducescatter supports hvd.Average, Sum, Min, Max and Product, not {op!r}.")
        outs = []
        for arr, name in zip(arrays, names):
            if arr.ndim == 0:
                raise ValueError(f"reducescatter of '{name}': the tensor needs at least one dimension.")
            sig = Signature("reducescatter", (("op", OP_NAMES[op]), ("dtype", arr.dtype.name),
                                              ("shape", arr.shape)), name)
            self._agree(sig)
            base, extra = divmod(arr.shape[0], self.size)
            rows = [base + (1 if r < extra else 0) for r in range(self.size)]
            row_elems = int(np.prod(arr.shape[1:], dtype=np.int64))
            work = _reduce_dtype(arr.dtype)
            send = np.ascontiguousarray(arr, dtype=work).reshape(-1)
            out = np.empty(rows[self.rank] * row_elems, dtype=work)
            with self.timeline.phase("MPI_REDUCESCATTER", name, arr.nbytes):
                self.comm.Reduce_scatter(send, out, [r * row_elems for r in rows], op=self._mpi_ops[op])
            if op == Average:
                out = out / self.size if out.dtype.kind in "iub" else _scale(out, 1.0 / self.size)
            out_dtype = out.dtype if (op == Average and arr.dtype.kind in "iub") else arr.dtype
            outs.append(out.reshape((rows[self.rank],) + arr.shape[1:]).astype(out_dtype, copy=False))
        return outs

    # --------------------------------------------------------------- others
    def broadcast_object(self, obj: Any, root_rank: int, name: str) -> Any:
        self._check_root(root_rank)
        self._agree(Signature("broadcast_object", (("root_rank", root_rank),), name))
        return self.comm.bcast(obj, root=root_rank)

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        self._agree(Signature("allgather_object", (), name))
        return self.comm.allgather(obj)

    def barrier(self) -> None:
        # agreement needs every rank's contribution: it is a barrier in itself
        self._agree(Signature("barrier"))

    def join(self) -> int:
        """Take part, with zeros, in the other ranks' allreduces until every rank
        has joined; return the rank that joined last."""
        served = 0
        while True:
            signatures = self.negotiator.agree(Signature("join"))
            if signatures is None:
                break
            active = [s for s in signatures if s.kind != "join"]
            if not all(s == active[0] for s in active) or active[0].kind != "allreduce":
                raise MismatchError(
                    "After hvd.join() a rank can only take part in allreduce; " + describe_mismatch(signatures)
                )
            fields = dict(active[0].fields)
            op = next(k for k, v in OP_NAMES.items() if v == fields["op"])
            dtype = np.dtype(fields["dtype"]) if fields["dtype"] != "bfloat16" else _bfloat16()
            if fields.get("via") == "NCCL":
                elements = sum(int(np.prod(shape, dtype=np.int64)) for shape in fields["shapes"])
                self.nccl.allreduce_zeros(fields["dtype"], elements, op)
            else:
                zeros = [np.zeros(shape, dtype=dtype) for shape in fields["shapes"]]
                self._reduce(zeros, op, fields["prescale_factor"], fields["postscale_factor"], "join")
            served += 1
        return int(self.comm.allreduce(self.rank if served == 0 else -1, op=self.MPI.MAX))


ALIGN_BYTES = 64  # TensorFlow adopts host memory without a copy only when 64-byte aligned


class _BufferPool:
    """Result buffers for allreduce, reused once nothing refers to them any more.

    A fresh buffer costs page faults on first touch (about a quarter of a large
    allreduce's time here). Results are handed out as views of pooled buffers;
    a TensorFlow tensor adopted through DLPack keeps its view, and so the
    buffer, referenced. A buffer whose only reference is the pool's own is free.
    """

    MAX_BYTES = 512 * 1024 * 1024

    def __init__(self) -> None:
        self.buffers: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}  # nbytes: [(owner, aligned view)]
        self.total = 0

    def get(self, nbytes: int) -> np.ndarray:
        """A free aligned buffer of ``nbytes`` (uint8), from the pool where one is
        free. Use a view of it (``.view(dtype)``), never the array itself: the pool
        sees a buffer in use by the views that refer to its memory."""
        # numpy points every view at the array that owns the memory (``raw``), so a
        # live view, or a tensor that adopted one, shows as an extra reference to it
        candidates = self.buffers.get(nbytes, ())
        for raw, aligned in candidates:
            if sys.getrefcount(raw) == 4:  # the pool's tuple, ``aligned``, this loop variable, getrefcount's argument
                return aligned
        raw = np.empty(nbytes + ALIGN_BYTES, dtype=np.uint8)
        start = -raw.__array_interface__["data"][0] % ALIGN_BYTES
        aligned = raw[start:start + nbytes]
        if self.total + nbytes <= self.MAX_BYTES and len(candidates) < 4:
            self.buffers.setdefault(nbytes, []).append((raw, aligned))
            self.total += nbytes
        return aligned


_pool = _BufferPool()


def aligned_empty(size: int, dtype: np.dtype) -> np.ndarray:
    """An uninitialised 1-D array whose data starts on a 64-byte boundary (pooled)."""
    dtype = np.dtype(dtype)
    return _pool.get(size * dtype.itemsize).view(dtype)


def _aligned_offsets(sizes: list[int], itemsize: int) -> tuple[list[int], int]:
    """Element offsets of each tensor in a fusion buffer, each on a 64-byte boundary."""
    step = max(1, ALIGN_BYTES // itemsize)
    offsets, end = [], 0
    for n in sizes:
        start = -(-end // step) * step
        offsets.append(start)
        end = start + n
    return offsets, end


def _scale(buf: np.ndarray, factor: float) -> np.ndarray:
    if buf.dtype.kind == "f":
        buf *= buf.dtype.type(factor)
        return buf
    return (buf * factor).astype(buf.dtype)


_DTYPE_NAMES: dict[np.dtype, str] = {}


def _dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, cached: numpy computes it in Python on every access."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype.name
    return name


def _bfloat16() -> np.dtype:
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


_runtime: Runtime | None = None
_runtime_world: Any = None


def runtime() -> Runtime:
    """The collectives of the current world; raises before ``init()``."""
    global _runtime, _runtime_world
    world = basics._w()
    if _runtime_world is not world:
        _runtime = Runtime(world.comm)
        _runtime_world = world
    return _runtime  # type: ignore[return-value]


def reset() -> None:
    """Forget the current world's collectives (``shutdown()``)."""
    global _runtime, _runtime_world
    if _runtime is not None:
        _runtime.free()
    _runtime, _runtime_world = None, None
