"""The collectives as cells call them: Horovod's ``horovod.tensorflow`` API on
numpy arrays and TensorFlow tensors (eager and inside ``tf.function``).

A numpy array in gives a numpy array out; a TensorFlow tensor in gives a
tensor out. Eager host tensors reach the numpy collectives of ``mpi_backend``
through DLPack (``bridges``, no copy) and results come back the same way; GPU
tensors go to ``nccl_backend`` (through ``nccl``) where the world has NCCL; in a graph a
collective is a ``tf.numpy_function`` (allreduce packs its tensors in the
graph first, so a step makes one call). Gradients are registered with
``tf.custom_gradient``; each is ``core/gradients``' rule of its collective.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from typing import Any

import numpy as np

from ..core import gradients as _gradients
from ..core import objects as _objects
from ..core import process_sets as _process_sets
from ..core import world as _world
from ..core.exceptions import ErrorFamily, MismatchError
from ..core.fusion import fused_label, fusion_groups
from ..core.nccl_backend import is_device_array
from ..core.ops import Adasum, Average, Max, Min, Product, Sum, check_op
from ..core.rules import auto_name, names, reject_unsupported, resolve_op
from ..core.rules import scale as _scale
from .bridges import adopt as _adopt
from .bridges import is_eager, is_gpu_tensor
from .bridges import is_tf as _is_tf
from .bridges import tf as _tf
from .bridges import to_numpy as _to_numpy
from .bridges import to_tf as _to_tf
from .compression import Compression
from .nccl import TensorFlowOnNccl


def not_converted(fn: Any) -> Any:
    """Mark ``fn`` as ``tf.autograph.experimental.do_not_convert`` marks functions,
    without importing TensorFlow. Inside a user's ``tf.function`` AutoGraph then
    calls it as it is, instead of rewriting it and everything it calls, the
    callbacks given to ``tf.numpy_function`` included, which would then pay
    AutoGraph's dispatch on every call of every step."""
    target = getattr(fn, "__func__", fn)
    target.autograph_info__ = None
    return fn


def _names(name: str | None, kind: str, tensors: list[Any]) -> list[str]:
    """One name per tensor of a grouped call (``core/rules.names``); a nameless graph tensor is named
    by its own name in the graph."""
    if not name and _is_tf(tensors[0]) and not is_eager(tensors[0]):
        return [_name(None, kind, t) for t in tensors]
    return names(name, kind, len(tensors))


def _scoped(name: str | None, ignore_name_scope: bool, tensor: Any) -> str | None:
    """As Horovod: a name given to a collective built into a graph is prefixed with
    the graph's name scope unless ``ignore_name_scope`` (names label the timeline and
    errors; eager tensors have no scope)."""
    if not name or ignore_name_scope or not _is_tf(tensor) or is_eager(tensor):
        return name
    scope = _tf().compat.v1.get_default_graph().get_name_scope()
    return f"{scope}/{name}" if scope else name


def _name(name: str | None, kind: str, tensor: Any = None) -> str:
    if name:
        return str(name)
    if tensor is not None and _is_tf(tensor) and not is_eager(tensor):  # eager ones have none
        try:
            return tensor.name  # graph tensors and variables have names
        except (AttributeError, ValueError):
            pass
    return auto_name(kind)


def _tf_class(cls: type[BaseException]) -> type[BaseException] | None:
    """As Horovod's TensorFlow ops fail: a mismatch across ranks as a ``FailedPreconditionError``, a bad
    argument as an ``InvalidArgumentError`` (as a graph's numpy_function does); the error stays an instance
    of its own class too, for code that catches that (None: as it is)."""
    tf = _tf()
    if issubclass(cls, MismatchError):
        base, name = tf.errors.FailedPreconditionError, "TensorMismatchError"
    elif issubclass(cls, ValueError):
        base, name = tf.errors.InvalidArgumentError, "InvalidArgumentError"
    else:
        return None

    def __init__(self: Any, message: str) -> None:
        base.__init__(self, None, None, message)

    try:
        return type(name, (base, cls), {"__init__": __init__})
    except TypeError:  # a built-in ValueError subclass with its own layout (UnicodeError): left as it is
        return None


_ERRORS = ErrorFamily(_tf_class)


@functools.cache
def _tape_probes() -> tuple[Any, Any]:
    """``tf.executing_eagerly`` and ``record.could_possibly_record``, looked up once: as TensorFlow's flags
    read directly where its inside allows (their Python wrappers were a measurable part of a small eager call)."""
    from tensorflow.python import pywrap_tfe
    from tensorflow.python.eager import context, record

    context_of, no_tape = context.context, getattr(pywrap_tfe, "TFE_Py_TapeSetIsEmpty", None)
    if no_tape is None or not hasattr(context_of()._thread_local_data, "is_eager"):
        return _tf().executing_eagerly, record.could_possibly_record
    return (lambda: context_of()._thread_local_data.is_eager), (lambda: not no_tape())


def _recording() -> bool:
    """Could a gradient tape record an op now? (Eager ops outside any tape need no gradient.)"""
    executing_eagerly, could_record = _tape_probes()
    return not executing_eagerly() or could_record()


class XLAUnsupportedError(TypeError):
    """An hvd collective was traced into an XLA-compiled function."""


def _check_not_xla() -> None:
    """Collectives run on the host through ``tf.numpy_function``, which XLA cannot
    compile: say so at trace time, with the fix, instead of XLA's own error."""
    from tensorflow.python.framework import ops
    from tensorflow.python.ops import control_flow_util

    if control_flow_util.GraphOrParentsInXlaContext(ops.get_default_graph()):
        raise XLAUnsupportedError(
            "hvd collectives cannot run inside an XLA-compiled function (jit_compile=True; Keras turns it on "
            "by itself where a GPU is visible). Compile the model with model.compile(..., jit_compile=False), "
            "or use tf.function(jit_compile=False)."
        )


def _gpu(backends: Any) -> TensorFlowOnNccl:
    """The NCCL collectives of ``backends`` (the world's, or a process set's) for TensorFlow GPU tensors."""
    return TensorFlowOnNccl(backends.nccl)




def _nccl_of(backends: Any, call: str) -> Any:
    """The NCCL backend that cupy arrays need; a clear error where the world has none."""
    if backends.nccl is None:
        raise ValueError(f"{call} of cupy arrays needs NCCL on every rank (one NVIDIA GPU per rank, cupy installed, "
                         "HVD_NOTEBOOK_NCCL not 0); pass numpy arrays (cupy.asnumpy) to go through the host.")
    return backends.nccl


def _backends(process_set: Any, call: str, tensor: Any = None) -> Any:
    """What a collective on ``process_set`` runs on: the world (``None``, the global set) or the set's own
    communicator and backends, alike in ``mpi``, ``nccl``, ``rank`` and ``size``. A rank outside the set gets
    Horovod's error: an ``InvalidArgumentError`` for TensorFlow tensors, a ``ValueError`` for numpy arrays."""
    if process_set is None:
        return _world.current()
    try:
        return _process_sets.backends(process_set, call)
    except _process_sets.NotAMemberError as exc:
        if tensor is None or not _is_tf(tensor):
            raise
        raise _ERRORS.convert(exc) from None


def _any_indexed_slices(tensors: list[Any]) -> bool:
    """Is any of ``tensors`` a ``tf.IndexedSlices`` (none can be where TensorFlow was never imported)?"""
    tf = sys.modules.get("tensorflow")
    if tf is None:
        return False
    slices = tf.IndexedSlices
    return any(isinstance(t, slices) for t in tensors)


def _on_gpus(tensors: list[Any]) -> bool:
    """Eager tensors that all live in GPU memory, in a world that reduces GPU tensors with NCCL.
    (TensorFlow keeps int32 tensors of a GPU device in host memory: those go through MPI.)"""
    return _world.current().nccl is not None and all(is_gpu_tensor(t) and t.dtype != _tf().int32 for t in tensors)


@functools.cache
def _has_gpus() -> bool:
    """Does TensorFlow see a GPU in this process? (Asked once: CPU-only ranks then
    skip every per-tensor device check.)"""
    return bool(_tf().config.list_logical_devices("GPU"))


def _back_on_devices(results: list[Any], tensors: list[Any]) -> list[Any]:
    """Host results of GPU-placed inputs (int32, or a world without NCCL) placed
    where their inputs were, as the same op on the device would have left them."""
    tf = _tf()
    if not _has_gpus() or not any(is_gpu_tensor(t) for t in tensors):
        return results
    placed = []
    for r, t in zip(results, tensors):
        if is_gpu_tensor(t):
            with tf.device(t.device):
                r = tf.identity(r)
        placed.append(r)
    return placed


def _on_tf(fn: Any, tensors: list[Any], out_dtypes: list[Any], out_shapes: list[Any],
           gpu_fn: Any = None) -> list[Any]:
    """Run ``fn(list of numpy) -> list of numpy`` on TensorFlow tensors; where they
    are on GPUs and NCCL runs, ``gpu_fn(list of tensors) -> list of tensors`` instead."""
    tf = _tf()
    if tf.executing_eagerly():
        try:
            if gpu_fn is not None and _on_gpus(tensors):
                return list(gpu_fn(tensors))
            outs = fn([_to_numpy(t) for t in tensors])
        except ValueError as exc:  # (a MismatchError too)
            raise _ERRORS.convert(exc) from None
        results = [_to_tf(o, d) for o, d in zip(outs, out_dtypes)]
        return _back_on_devices(results, tensors) if gpu_fn is not None else results

    _check_not_xla()
    if gpu_fn is not None and _world.current().nccl is not None:
        # a py_function keeps its inputs where TensorFlow placed them (on the GPU),
        # where a numpy_function would copy them to the host
        return _py_function(lambda xs: _on_tf(fn, xs, out_dtypes, out_shapes, gpu_fn), tensors, out_dtypes,
                            out_shapes)

    outs = _graph_numpy_function(fn, tensors, out_dtypes)
    for o, shape in zip(outs, out_shapes):
        o.set_shape(shape)
    return outs


def _graph_numpy_function(fn: Any, tensors: list[Any], out_dtypes: list[Any]) -> list[Any]:
    """``fn(list of numpy) -> list of numpy`` as one ``numpy_function`` op of a graph, in build order.

    A ``numpy_function`` can fail a step only with InvalidArgumentError or UnknownError; in a TF1 graph a
    mismatch across ranks fails ``session.run`` with Horovod's FailedPreconditionError instead: the op
    returns the mismatch as a string and a gate after it raises. (A ``tf.function`` keeps the plain op:
    the gate's cond would cost every training step.)"""
    tf = _tf()
    gated = not getattr(tf.compat.v1.get_default_graph(), "building_function", False)

    def run(*arrays: np.ndarray) -> list[Any]:
        try:
            outs = [np.asarray(o, dtype=d.as_numpy_dtype) for o, d in zip(fn(list(arrays)), out_dtypes)]
        except MismatchError as exc:
            if not gated:
                raise
            return [np.zeros(0, d.as_numpy_dtype) for d in out_dtypes] + [np.bytes_(str(exc).encode())]
        return outs + [np.bytes_(b"")] if gated else outs

    tout = [*out_dtypes, tf.string] if gated else list(out_dtypes)
    outs = _in_build_order(lambda: tf.numpy_function(not_converted(run), tensors, Tout=tout, stateful=True))
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    if not gated:
        return outs
    *outs, mismatch = outs
    check = tf.cond(tf.equal(mismatch, ""), lambda: tf.constant(b""), lambda: _failed_precondition(mismatch))
    with tf.control_dependencies([check]):
        return [tf.identity(o) for o in outs]


def _failed_precondition(message: Any) -> Any:
    """An op that fails with FailedPreconditionError carrying ``message`` (a string tensor) when it runs.
    TensorFlow has no op to raise an error of a chosen code; reading a path below ``/dev/null`` fails
    with this code (ENOTDIR) and a message that holds the path."""
    tf = _tf()
    return tf.io.read_file(tf.strings.join(["/dev/null/hvd_notebook: ", message]), name="hvd_mismatch")


_last_collective: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # graph: its newest collective op


def _in_build_order(build: Any) -> Any:
    """``build()``'s collective op, run after the one built before it in the same TF1
    graph. A session's executor runs independent ops in any order, each in a thread of
    its pool until it returns; collectives in a different order on each rank would
    fill the pools with calls that wait for each other. (A ``tf.function``, or a
    branch of a cond or a loop, orders its stateful ops in program order by itself.)"""
    tf = _tf()
    graph = tf.compat.v1.get_default_graph()
    if getattr(graph, "building_function", False):
        return build()
    previous = _last_collective.get(graph)
    with tf.control_dependencies([previous] if previous is not None else []):
        outs = build()
    first = outs[0] if isinstance(outs, (list, tuple)) else outs
    _last_collective[graph] = first.op
    return outs


def _py_function(eager_fn: Any, tensors: list[Any], out_dtypes: list[Any], out_shapes: list[Any]) -> list[Any]:
    """``eager_fn(list of eager tensors) -> list of tensors`` as one op of a graph."""
    tf = _tf()
    outs = _in_build_order(lambda: tf.py_function(lambda *xs: eager_fn(list(xs)), tensors, Tout=list(out_dtypes)))
    if not isinstance(outs, (list, tuple)):
        outs = [outs]
    for o, shape in zip(outs, out_shapes):
        o.set_shape(shape)
    return list(outs)


# ------------------------------------------------------------------ allreduce
@not_converted
def allreduce(tensor: Any, average: bool | None = None, device_dense: str = "", device_sparse: str = "",
              compression: Any = Compression.none, op: int | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, name: str | None = None, process_set: Any = None,
              ignore_name_scope: bool = False) -> Any:
    """Reduce a tensor over all ranks, by default to its average, as ``hvd.allreduce``.

    A numpy array in gives a numpy array out, and a TensorFlow tensor a tensor: eagerly, in a ``tf.function`` and in
    a TF1 graph. GPU tensors are reduced by NCCL where every rank has a GPU. The call is differentiable: the
    gradient of an allreduce is the same allreduce of the gradient.

    >>> hvd.allreduce(np.array([1.0, 2.0]) * (hvd.rank() + 1), op=hvd.Sum)  # on 2 ranks
    array([3., 6.])

    Args:
        tensor: the value to reduce: a TensorFlow tensor or variable, a numpy or cupy array, or anything
            ``np.asarray`` takes. Every rank passes one of the same shape and dtype. A ``tf.IndexedSlices`` is
            allgathered instead, as in Horovod.
        average: Horovod's deprecated form of ``op``: True means ``hvd.Average``, False ``hvd.Sum``. Give ``op`` or
            ``average``, not both.
        device_dense: accepted for Horovod's signature; it must stay empty. GPU tensors are reduced where they live.
        device_sparse: accepted for Horovod's signature; it must stay empty.
        compression: ``hvd.Compression.none`` (the default), or ``hvd.Compression.fp16`` to send floating tensors as
            float16. The result has the input's dtype either way.
        op: the reduction: ``hvd.Average``, ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``. With neither
            ``op`` nor ``average``, ``hvd.Average``. An average of integers is truncated toward zero.
        prescale_factor: a factor applied to each rank's tensor before the reduction. Defaults to 1.0.
        postscale_factor: a factor applied to the result after the reduction. Defaults to 1.0.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name (in a graph, the tensor's own name), so that nameless calls pair in call
            order.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. The default, None, means every rank.
        ignore_name_scope: in a graph, use ``name`` as it is, without the graph's name scope before it. Defaults to
            False.

    Returns:
        The reduced value, of ``tensor``'s shape and dtype: a ``tf.Tensor`` for a TensorFlow tensor, a cupy array
        for a cupy array, else a numpy array. For a ``tf.IndexedSlices``, a ``tf.IndexedSlices`` of every rank's
        rows, their values divided by the size for ``hvd.Average``.

    Raises:
        ValueError: the runtime is not initialised; ``op`` and ``average`` are both given, or ``op`` is not an op;
            ``device_dense`` or ``device_sparse`` is set; a rank's tensor cannot be reduced, such as one of a string
            dtype, in which case every rank raises; or ``process_set`` is not a registered ``hvd.ProcessSet`` or
            does not hold this rank. Eagerly, for TensorFlow tensors, a refusal and a rank outside ``process_set``
            are raised as a ``tf.errors.InvalidArgumentError`` that is also a ``ValueError``.
        NotImplementedError: ``op=hvd.Adasum``, which the built-in runtime does not implement; or, for
            ``tf.IndexedSlices``, an op other than ``hvd.Average`` and ``hvd.Sum``, or a scale factor.
        MismatchError: the ranks called different collectives under this name, or this one with different arguments,
            shapes or dtypes. Every rank raises it. Eagerly, for TensorFlow tensors, it is also a
            ``tf.errors.FailedPreconditionError``; in a TF1 graph, ``session.run`` raises
            ``FailedPreconditionError``.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
        XLAUnsupportedError: the call is traced into an XLA-compiled function (``jit_compile=True``).
    """
    if device_dense or device_sparse:
        reject_unsupported("hvd.allreduce", device_dense=device_dense, device_sparse=device_sparse)
    op = resolve_op(op, average)
    backends = _backends(process_set, "hvd.allreduce", tensor)
    eager = is_eager(tensor)
    if compression is Compression.none and (eager or type(tensor) is np.ndarray):
        name = _name(name, "allreduce")  # (once: where the general path takes the call, it keeps this name)
        out = (_eager_allreduce_one(backends, tensor, op, prescale_factor, postscale_factor, name) if eager
               else backends.mpi.allreduce_one(tensor, op, prescale_factor, postscale_factor, name))
        if out is not None:
            return out
    return grouped_allreduce([tensor], op=op, compression=compression, prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor, name=_scoped(name, ignore_name_scope, tensor),
                             process_set=process_set)[0]


def _eager_allreduce_one(backends: Any, tensor: Any, op: int, prescale: float, postscale: float, name: str) -> Any:
    """One eager host tensor outside any gradient tape, the commonest call: read in
    place, reduced by the MPI backend's single-tensor path into a pooled buffer that
    becomes the result without a copy. None where the general path must take it.
    (``world``: the world or a process set's backends, see ``_backends``.)"""
    if backends.nccl is not None or _has_gpus() or _recording():
        return None
    arr = _to_numpy(tensor)
    try:
        out = backends.mpi.allreduce_one(arr, op, prescale, postscale, name)
    except ValueError as exc:  # (a MismatchError too)
        raise _ERRORS.convert(exc) from None
    return None if out is None else _adopt(out)


@not_converted
def grouped_allreduce(tensors: list[Any], average: bool | None = None, device_dense: str = "",
                      device_sparse: str = "", compression: Any = Compression.none, op: int | None = None,
                      prescale_factor: float = 1.0, postscale_factor: float = 1.0, name: str | None = None,
                      process_set: Any = None) -> list[Any]:
    """Reduce several tensors over all ranks in one call, by default to their averages.

    The ranks agree on the whole group once. Tensors of one dtype are fused into buffers of up to
    ``HOROVOD_FUSION_THRESHOLD`` bytes, one MPI or NCCL call each. Otherwise it works as ``allreduce`` on each
    tensor, differentiable too.

    Args:
        tensors: a list of tensors, as ``allreduce`` takes. Every rank passes the same number, of the same shapes
            and dtypes, in the same order.
        average: Horovod's deprecated form of ``op``: True means ``hvd.Average``, False ``hvd.Sum``. Give ``op`` or
            ``average``, not both.
        device_dense: accepted for Horovod's signature; it must stay empty. GPU tensors are reduced where they live.
        device_sparse: accepted for Horovod's signature; it must stay empty.
        compression: ``hvd.Compression.none`` (the default), or ``hvd.Compression.fp16`` to send floating tensors as
            float16. The result has the input's dtype either way.
        op: the reduction: ``hvd.Average``, ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``. With neither
            ``op`` nor ``average``, ``hvd.Average``. An average of integers is truncated toward zero.
        prescale_factor: a factor applied to each rank's tensor before the reduction. Defaults to 1.0.
        postscale_factor: a factor applied to the result after the reduction. Defaults to 1.0.
        name: the name that pairs this call across ranks; tensor ``i`` is labelled ``name.i``. The default, None,
            takes automatic names (in a graph, the tensors' own names).
        process_set: the ``hvd.ProcessSet`` whose ranks take part. The default, None, means every rank.

    Returns:
        A list of the reduced values, one per tensor in ``tensors``, each as ``allreduce`` returns it. An empty list
        for an empty ``tensors``.

    Raises:
        ValueError: the runtime is not initialised; ``op`` and ``average`` are both given, or ``op`` is not an op;
            ``device_dense`` or ``device_sparse`` is set; a rank's tensor cannot be reduced, such as one of a string
            dtype, in which case every rank raises; or ``process_set`` is not a registered ``hvd.ProcessSet`` or
            does not hold this rank. Eagerly, for TensorFlow tensors, a refusal and a rank outside ``process_set``
            are raised as a ``tf.errors.InvalidArgumentError`` that is also a ``ValueError``.
        NotImplementedError: ``op=hvd.Adasum``, which the built-in runtime does not implement; or, for
            ``tf.IndexedSlices``, an op other than ``hvd.Average`` and ``hvd.Sum``, or a scale factor.
        MismatchError: the ranks called different collectives under this name, or this one with different arguments,
            shapes or dtypes. Every rank raises it. Eagerly, for TensorFlow tensors, it is also a
            ``tf.errors.FailedPreconditionError``; in a TF1 graph, ``session.run`` raises
            ``FailedPreconditionError``.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
        XLAUnsupportedError: the call is traced into an XLA-compiled function (``jit_compile=True``).
    """
    if device_dense or device_sparse:
        reject_unsupported("hvd.grouped_allreduce", device_dense=device_dense, device_sparse=device_sparse)
    op = resolve_op(op, average)
    if not tensors:
        return []
    if _any_indexed_slices(tensors):
        return _allreduce_with_slices(tensors, op, compression, prescale_factor, postscale_factor, name, process_set)
    backends = _backends(process_set, "hvd.grouped_allreduce", tensors[0])
    plain = compression is Compression.none  # (the common case: no pass over the tensors for it)
    compressed, ctxs = (tensors, ()) if plain else zip(*(compression.compress(t) for t in tensors))
    names = _names(name, "allreduce", tensors)
    if is_device_array(compressed[0]):
        reduced = _nccl_of(backends, "hvd.grouped_allreduce").allreduce(list(compressed), op, prescale_factor,
                                                                       postscale_factor, names)
    elif _is_tf(compressed[0]):
        reduced = _tf_grouped_allreduce(list(compressed), names, op, prescale_factor, postscale_factor,
                                        backends, process_set)
    else:
        reduced = backends.mpi.allreduce([np.asarray(t) for t in compressed], op, prescale_factor, postscale_factor,
                                        names)
    return reduced if plain else [compression.decompress(r, c) for r, c in zip(reduced, ctxs)]


def _tf_grouped_allreduce(tensors: list[Any], names: list[str], op: int, prescale: float,
                          postscale: float, backends: Any, process_set: Any) -> list[Any]:
    tf = _tf()
    tensors = [t if isinstance(t, tf.Tensor) else tf.convert_to_tensor(t) for t in tensors]
    if not _recording():  # eager, no tape: custom_gradient's bookkeeping is not needed
        return _eager_grouped_allreduce(tensors, names, op, prescale, postscale, backends)

    @tf.custom_gradient
    def reduce_tf(*xs: Any) -> Any:
        if tf.executing_eagerly():
            outs = _eager_grouped_allreduce(list(xs), names, op, prescale, postscale, backends)
        else:
            outs = _graph_grouped_allreduce(list(xs), names, op, prescale, postscale, backends)

        def grad(*dys: Any) -> Any:
            return _gradients.allreduce(_TensorFlowOps(process_set, backends), list(dys), op, prescale, postscale)

        return outs, grad

    return list(reduce_tf(*tensors))


def _eager_grouped_allreduce(tensors: list[Any], names: list[str], op: int, prescale: float,
                             postscale: float, backends: Any) -> list[Any]:
    """Host tensors are read in place (DLPack); the results are views of the reduced
    fusion buffers, adopted by TensorFlow without a copy. GPU tensors go to NCCL
    where it runs (``nccl_backend``)."""
    if _on_gpus(tensors):
        try:
            return _gpu(backends).allreduce(tensors, op, prescale, postscale, names)
        except MismatchError as exc:
            raise _ERRORS.convert(exc) from None
    arrays = [_to_numpy(t) for t in tensors]
    try:
        fused = backends.mpi.allreduce_fused(arrays, op, prescale, postscale, names)
    except ValueError as exc:  # (a MismatchError too)
        raise _ERRORS.convert(exc) from None
    results: list[Any] = [None] * len(tensors)
    for group, buf, offsets in fused:
        fused_out = len(group) > 1  # (a tensor alone was reduced straight into its result)
        with (backends.timeline.phase("MEMCPY_OUT_FUSION_BUFFER", fused_label([names[i] for i in group]), buf.nbytes)
              if fused_out else contextlib.nullcontext()):
            for i, piece in zip(group, _unfuse(buf, offsets, [arrays[i] for i in group])):
                results[i] = piece
    return _back_on_devices(results, tensors)


def _unfuse(buf: np.ndarray, offsets: list[int], arrays: list[np.ndarray]) -> list[Any]:
    """The tensors in a reduced fusion buffer, as TensorFlow tensors sharing its memory."""
    if len(arrays) > 1 and all(a.ndim == 1 for a in arrays):
        # many flat tensors: one tf.split of the buffer is cheaper than an adoption each
        sizes, end = [], 0  # each tensor starts 64-byte aligned, with padding before it where needed
        for a, off in zip(arrays, offsets):
            sizes += [off - end, a.size]
            end = off + a.size
        flat = _adopt(buf)
        if end == buf.size and not any(sizes[0::2]):  # no padding at all: split into the tensors alone
            return _tf().split(flat, sizes[1::2])
        return _tf().split(flat, sizes + [buf.size - end])[1::2]
    # each tensor adopts its shaped view of the buffer: cheaper than an eager tf.reshape
    return [_adopt(buf[off:off + a.size].reshape(a.shape)) for a, off in zip(arrays, offsets)]


def _graph_grouped_allreduce(tensors: list[Any], names: list[str], op: int, prescale: float,
                             postscale: float, backends: Any) -> list[Any]:
    """In a graph: TensorFlow packs each dtype's tensors into one flat tensor, one
    ``numpy_function`` reduces it, TensorFlow splits it again."""
    _check_not_xla()
    if backends.nccl is not None:  # the tensors may be on a GPU: reduce them where they are, fused, in one op
        return _py_function(lambda xs: _eager_grouped_allreduce(xs, names, op, prescale, postscale, backends), tensors,
                            [t.dtype for t in tensors], [t.shape for t in tensors])
    groups = fusion_groups([(t.dtype, (t.shape.num_elements() or 0) * t.dtype.size) for t in tensors])
    results: list[Any] = [None] * len(tensors)
    for group in groups:
        pieces = _graph_allreduce_group(backends.mpi, [tensors[i] for i in group],
                                        fused_label([names[i] for i in group]), op, prescale, postscale)
        for i, piece in zip(group, pieces):
            results[i] = piece
    return results


def _graph_allreduce_group(mpi: Any, tensors: list[Any], label: str, op: int, prescale: float,
                           postscale: float) -> list[Any]:
    """One fusion group in a graph: concat, one ``numpy_function``, split."""
    tf = _tf()
    shapes = tuple(tuple(t.shape.as_list()) if t.shape.rank is not None else None for t in tensors)

    def reduce_flat(flat: np.ndarray) -> np.ndarray:
        ((_, buf, _),) = mpi.allreduce_fused([flat], op, prescale, postscale, [label], shapes)
        return buf

    static = all(t.shape.is_fully_defined() for t in tensors)
    flats = [t if t.shape.rank == 1 else tf.reshape(t, [-1]) for t in tensors]
    flat = tf.concat(flats, 0) if len(flats) > 1 else flats[0]
    (out,) = _graph_numpy_function(lambda arrays: [reduce_flat(arrays[0])], [flat],
                                   [tensors[0].dtype])
    out.set_shape([None])
    sizes = [t.shape.num_elements() for t in tensors] if static else [tf.size(t) for t in tensors]
    pieces = tf.split(out, sizes) if len(tensors) > 1 else [out]
    results = []
    for t, piece in zip(tensors, pieces):
        if t.shape.rank != 1 or not static:
            piece = tf.reshape(piece, t.shape if static else tf.shape(t))
        piece.set_shape(t.shape)
        results.append(piece)
    return results


def _allreduce_with_slices(tensors: list[Any], op: int, compression: Any, prescale: float, postscale: float,
                           name: str | None, process_set: Any) -> list[Any]:
    """As Horovod: the ``tf.IndexedSlices`` among ``tensors`` allgathered (values and indices, one grouped
    allgather each) instead of a dense allreduce; the dense ones reduced together."""
    tf = _tf()
    check_op(op, (Average, Sum), "allreduce of tf.IndexedSlices", error=NotImplementedError)
    if prescale != 1.0 or postscale != 1.0:  # as Horovod: refused, not silently ignored
        raise NotImplementedError("allreduce of tf.IndexedSlices does not support prescale_factor or "
                                  "postscale_factor; scale the values before or after the allreduce.")
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [i for i, t in enumerate(tensors) if not isinstance(t, tf.IndexedSlices)]
    out: list[Any] = [None] * len(tensors)
    values = grouped_allgather([tensors[i].values for i in sparse], name=name and f"{name}.values",
                               process_set=process_set)
    indices = grouped_allgather([tensors[i].indices for i in sparse], name=name and f"{name}.indices",
                                process_set=process_set)
    size = _backends(process_set, "hvd.allreduce").size
    for i, v, ix in zip(sparse, values, indices):
        out[i] = tf.IndexedSlices(v / tf.cast(size, v.dtype) if op == Average else v, ix,
                                  dense_shape=tensors[i].dense_shape)
    if dense:
        reduced = grouped_allreduce([tensors[i] for i in dense], op=op, compression=compression,
                                    name=name and f"{name}.dense", process_set=process_set)
        for i, r in zip(dense, reduced):
            out[i] = r
    return out


def _differentiable(tensors: list[Any], call: str, backends: Any, process_set: Any, collective: Any, shape: Any,
                    rule: Any, scaled: Any = lambda run: run) -> list[Any]:
    """``collective(backend, tensors)`` (an allgather, broadcast or reducescatter) of ``tensors`` among ``backends``:
    cupy arrays through NCCL (``call`` names it where there is none), numpy arrays through MPI, TensorFlow
    tensors as one op of output shapes ``shape(x)`` whose gradients are ``rule(ops, grads, inputs)``
    (``core/gradients``); ``scaled`` wraps each way of running it."""
    on_host = scaled(lambda arrays: collective(backends.mpi, arrays))
    if is_device_array(tensors[0]):
        return scaled(lambda arrays: collective(_nccl_of(backends, call), arrays))(list(tensors))
    if not _is_tf(tensors[0]):
        return on_host([np.asarray(t) for t in tensors])
    tf = _tf()

    @tf.custom_gradient
    def run(*xs: Any) -> Any:
        outs = _on_tf(on_host, list(xs), [x.dtype for x in xs], [shape(x) for x in xs],
                      gpu_fn=scaled(lambda ts: collective(_gpu(backends), ts)))
        return outs, lambda *dys: rule(_TensorFlowOps(process_set, backends), list(dys), xs)

    return list(run(*[tf.convert_to_tensor(t) for t in tensors]))


def _any_rows(x: Any) -> list[Any]:
    """``x``'s static shape, with any number of rows."""
    return [None] + x.shape[1:].as_list()


# ------------------------------------------------------------------ allgather
@not_converted
def allgather(tensor: Any, name: str | None = None, process_set: Any = None, ignore_name_scope: bool = False) -> Any:
    """Concatenate a tensor from every rank along its first dimension.

    The first dimension may differ between ranks; the other dimensions and the dtype may not. The call is
    differentiable: a rank's gradient is its own rows of the gradient averaged over the ranks.

    >>> hvd.allgather(np.full(hvd.rank() + 1, hvd.rank()))  # on 2 ranks
    array([0, 1, 1])

    Args:
        tensor: this rank's part: a TensorFlow tensor, a numpy or cupy array, or anything ``np.asarray`` takes, of
            at least one dimension.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name (in a graph, the tensor's own name), so that nameless calls pair in call
            order.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. The default, None, means every rank.
        ignore_name_scope: in a graph, use ``name`` as it is, without the graph's name scope before it. Defaults to
            False.

    Returns:
        Every rank's ``tensor`` concatenated in rank order, of ``tensor``'s dtype and of the kind ``allreduce``
        returns. Its first dimension is the sum of the ranks' first dimensions.

    Raises:
        ValueError: the runtime is not initialised; a rank's tensor is a scalar, or of a dtype that cannot be sent,
            in which case every rank raises; or ``process_set`` is not a registered ``hvd.ProcessSet`` or does not
            hold this rank. Eagerly, for TensorFlow tensors, a refusal and a rank outside ``process_set`` are raised
            as a ``tf.errors.InvalidArgumentError`` that is also a ``ValueError``.
        MismatchError: the ranks called different collectives under this name, or this one with different arguments,
            shapes or dtypes. Every rank raises it. Eagerly, for TensorFlow tensors, it is also a
            ``tf.errors.FailedPreconditionError``; in a TF1 graph, ``session.run`` raises
            ``FailedPreconditionError``.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
        XLAUnsupportedError: the call is traced into an XLA-compiled function (``jit_compile=True``).
    """
    return grouped_allgather([tensor], name=_scoped(name, ignore_name_scope, tensor), process_set=process_set)[0]


@not_converted
def grouped_allgather(tensors: list[Any], name: str | None = None, process_set: Any = None) -> list[Any]:
    """Concatenate several tensors from every rank along their first dimensions, in one call.

    Each tensor is gathered as ``allgather`` gathers it; the ranks agree on the whole group once.

    Args:
        tensors: a list of tensors, as ``allgather`` takes. Every rank passes the same number, in the same order.
        name: the name that pairs this call across ranks; tensor ``i`` is labelled ``name.i``. The default, None,
            takes automatic names (in a graph, the tensors' own names).
        process_set: the ``hvd.ProcessSet`` whose ranks take part. The default, None, means every rank.

    Returns:
        A list with one gathered value per tensor, each as ``allgather`` returns it. An empty list for an empty
        ``tensors``.

    Raises:
        ValueError: the runtime is not initialised; a rank's tensor is a scalar, or of a dtype that cannot be sent,
            in which case every rank raises; or ``process_set`` is not a registered ``hvd.ProcessSet`` or does not
            hold this rank. Eagerly, for TensorFlow tensors, a refusal and a rank outside ``process_set`` are raised
            as a ``tf.errors.InvalidArgumentError`` that is also a ``ValueError``.
        MismatchError: the ranks called different collectives under this name, or this one with different arguments,
            shapes or dtypes. Every rank raises it. Eagerly, for TensorFlow tensors, it is also a
            ``tf.errors.FailedPreconditionError``; in a TF1 graph, ``session.run`` raises
            ``FailedPreconditionError``.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
        XLAUnsupportedError: the call is traced into an XLA-compiled function (``jit_compile=True``).
    """
    if not tensors:
        return []
    backends = _backends(process_set, "hvd.grouped_allgather", tensors[0])
    names = _names(name, "allgather", tensors)
    return _differentiable(
        tensors, "hvd.allgather", backends, process_set, lambda b, xs: b.allgather(xs, names), _any_rows,
        lambda ops, dys, xs: _gradients.allgather(ops, dys, [_tf().shape(x)[0] for x in xs]))


# ------------------------------------------------------------------ broadcast
@not_converted
def broadcast(tensor: Any, root_rank: int, name: str | None = None, ignore_name_scope: bool = False,
              process_set: Any = None) -> Any:
    """Give every rank the root rank's value of a tensor.

    The call is differentiable: the gradient is averaged over the ranks and flows back to the root only; the other
    ranks get zeros.

    Args:
        tensor: this rank's value: a TensorFlow tensor, a numpy or cupy array, or anything ``np.asarray`` takes.
            Every rank passes one of the same shape and dtype; only the root's values are read.
        root_rank: the global rank whose value every rank gets. With ``process_set``, it must be one of the set's
            ranks.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name (in a graph, the tensor's own name), so that nameless calls pair in call
            order.
        ignore_name_scope: in a graph, use ``name`` as it is, without the graph's name scope before it. Defaults to
            False.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. The default, None, means every rank.

    Returns:
        The root's value, of ``tensor``'s shape and dtype and of the kind ``allreduce`` returns.

    Raises:
        ValueError: the runtime is not initialised; ``root_rank`` is not a rank of the world or of ``process_set``,
            or a rank's tensor is of a dtype that cannot be sent, in which case every rank raises; or
            ``process_set`` is not a registered ``hvd.ProcessSet`` or does not hold this rank. Eagerly, for
            TensorFlow tensors, a refusal and a rank outside ``process_set`` are raised as a
            ``tf.errors.InvalidArgumentError`` that is also a ``ValueError``.
        MismatchError: the ranks called different collectives under this name, or this one with different arguments,
            shapes or dtypes. Every rank raises it. Eagerly, for TensorFlow tensors, it is also a
            ``tf.errors.FailedPreconditionError``; in a TF1 graph, ``session.run`` raises
            ``FailedPreconditionError``.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
        XLAUnsupportedError: the call is traced into an XLA-compiled function (``jit_compile=True``).
    """
    backends = _backends(process_set, "hvd.broadcast", tensor)
    names = [_name(_scoped(name, ignore_name_scope, tensor), "broadcast", tensor)]
    root = backends.root(root_rank)  # (Horovod's root_rank is a global rank)
    return _differentiable(
        [tensor], "hvd.broadcast", backends, process_set, lambda b, xs: b.broadcast(xs, root, names), lambda x: x.shape,
        lambda ops, dys, _: [_gradients.broadcast(ops, dys[0], backends.rank == root)])[0]


@not_converted
def broadcast_variables(variables: list[Any], root_rank: int, process_set: Any = None,
                        inplace: bool = False) -> Any:
    """Assign the root rank's values to every rank's variables, in one fused broadcast.

    Use it after the variables are created, so that every rank starts from the same values.

    >>> hvd.broadcast_variables(model.variables, root_rank=0)

    Args:
        variables: the TensorFlow variables to assign. Every rank passes the same number, of the same shapes and
            dtypes, in the same order.
        root_rank: the global rank whose values every rank gets. With ``process_set``, it must be one of the set's
            ranks.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. The default, None, means every rank.
        inplace: accepted for Horovod's signature. Variables are always assigned in place.

    Returns:
        None eagerly, and for an empty ``variables``. In a graph, an op that makes the assignments when run.

    Raises:
        ValueError: the runtime is not initialised; ``root_rank`` is not a rank of the world or of ``process_set``,
            in which case every rank raises; or ``process_set`` is not a registered ``hvd.ProcessSet`` or does not
            hold this rank. Eagerly, for TensorFlow tensors, a refusal and a rank outside ``process_set`` are raised
            as a ``tf.errors.InvalidArgumentError`` that is also a ``ValueError``.
        MismatchError: the ranks called different collectives under this name, or this one with different arguments,
            shapes or dtypes. Every rank raises it. Eagerly, for TensorFlow tensors, it is also a
            ``tf.errors.FailedPreconditionError``; in a TF1 graph, ``session.run`` raises
            ``FailedPreconditionError``.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
        XLAUnsupportedError: the call is traced into an XLA-compiled function (``jit_compile=True``).
    """
    variables = list(variables)
    if not variables:
        return None
    assigns = _assign_from_root(variables, root_rank, [_name(None, "broadcast_variables", v) for v in variables],
                                _backends(process_set, "hvd.broadcast_variables", variables[0]))
    return None if _tf().executing_eagerly() else _tf().group(*assigns)


@not_converted
def broadcast_(variables: list[Any], root_rank: int, name: str | None = None, process_set: Any = None) -> list[Any]:
    """Assign the root rank's values to every rank's variables, and return their new values.

    This is Horovod's in-place broadcast. All the variables travel in one fused broadcast.

    Args:
        variables: the TensorFlow variables to assign. Every rank passes the same number, of the same shapes and
            dtypes, in the same order.
        root_rank: the global rank whose values every rank gets. With ``process_set``, it must be one of the set's
            ranks.
        name: the name that pairs this call across ranks; variable ``i`` is labelled ``name.i``. The default, None,
            names each by the variable's own name or an automatic name.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. The default, None, means every rank.

    Returns:
        A list with each variable's new value as a tensor. In a graph, the tensors read the variables after the
        assignments. An empty list for an empty ``variables``.

    Raises:
        ValueError: the runtime is not initialised; ``root_rank`` is not a rank of the world or of ``process_set``,
            in which case every rank raises; or ``process_set`` is not a registered ``hvd.ProcessSet`` or does not
            hold this rank. Eagerly, for TensorFlow tensors, a refusal and a rank outside ``process_set`` are raised
            as a ``tf.errors.InvalidArgumentError`` that is also a ``ValueError``.
        MismatchError: the ranks called different collectives under this name, or this one with different arguments,
            shapes or dtypes. Every rank raises it. Eagerly, for TensorFlow tensors, it is also a
            ``tf.errors.FailedPreconditionError``; in a TF1 graph, ``session.run`` raises
            ``FailedPreconditionError``.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
        XLAUnsupportedError: the call is traced into an XLA-compiled function (``jit_compile=True``).
    """
    variables = list(variables)
    if not variables:
        return []
    names = [f"{name}.{i}" for i in range(len(variables))] if name else \
        [_name(None, "broadcast_", v) for v in variables]
    assigns = _assign_from_root(variables, root_rank, names, _backends(process_set, "hvd.broadcast_", variables[0]))
    tf = _tf()
    if tf.executing_eagerly():
        return [v.read_value() for v in variables]
    with tf.control_dependencies(assigns):
        return [tf.identity(v.read_value()) for v in variables]


def _assign_from_root(variables: list[Any], root_rank: int, names: list[str], backends: Any) -> list[Any]:
    """Broadcast the variables' values from ``root_rank`` in one fused call among ``world`` (the world or a
    process set's backends) and assign them; the assignments."""
    tf = _tf()
    root = backends.root(root_rank)

    def bcast_np(arrays: list[np.ndarray]) -> list[np.ndarray]:
        return backends.mpi.broadcast(arrays, root, names)

    values = _on_tf(bcast_np, [v.read_value() if hasattr(v, "read_value") else tf.convert_to_tensor(v)
                               for v in variables],
                    [v.dtype.base_dtype if hasattr(v.dtype, "base_dtype") else v.dtype for v in variables],
                    [v.shape for v in variables], gpu_fn=lambda ts: _gpu(backends).broadcast(ts, root, names))
    return [v.assign(x) for v, x in zip(variables, values)]


def _check_session(call: str, session: Any) -> None:
    """Horovod evaluates an object collective's ops with ``session`` in a TF1 graph; here the object
    travels through MPI without a TensorFlow op, so any session gives the same result. Not a session: refused."""
    if session is not None and not callable(getattr(session, "run", None)):
        reject_unsupported(call, session=session)


@not_converted
def broadcast_object(obj: Any, root_rank: int = 0, session: Any = None, name: str | None = None,
                     process_set: Any = None) -> Any:
    """Give every rank the root rank's Python object.

    The object is pickled and sent through MPI, without a TensorFlow op, so the call works the same eagerly and in a
    graph.

    Args:
        obj: the object to send. Only the root's is read; the other ranks may pass None.
        root_rank: the global rank whose object every rank gets. Defaults to 0.
        session: Horovod's TF1 session argument. A ``tf.compat.v1.Session`` or None; it is not needed, since no op
            runs.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name, so that nameless calls pair in call order.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. The default, None, means every rank.

    Returns:
        The root's object: ``obj`` itself on the root, an unpickled copy on the other ranks.

    Raises:
        ValueError: ``session`` is not a session; the runtime is not initialised; ``process_set`` is not a
            registered ``hvd.ProcessSet`` or does not hold this rank; or ``root_rank`` is not a rank of the world or
            of ``process_set``.
        MismatchError: the ranks called different collectives under this name, or this one with different arguments.
            Every rank raises it.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    _check_session("hvd.broadcast_object", session)
    return _objects.broadcast_object(obj, root_rank, name, process_set)


def broadcast_object_fn(root_rank: int = 0, session: Any = None, name: str | None = None,
                        process_set: Any = None) -> Any:
    """Make a function that gives every rank the root rank's Python object, as Horovod's TF1 helper.

    Horovod's helper builds its broadcast ops once for many calls. Here each call of the function is a
    ``broadcast_object`` call, which needs no ops.

    Args:
        root_rank: the global rank whose object every rank gets. Defaults to 0.
        session: Horovod's TF1 session argument. A ``tf.compat.v1.Session`` or None; it is not needed.
        name: the name of every call the function makes. The default, None, uses ``"broadcast_object_fn"``.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. The default, None, means every rank.

    Returns:
        A function ``fn(obj)`` that returns the root's object and raises what ``broadcast_object`` raises.

    Raises:
        ValueError: ``session`` is not a session.
    """
    _check_session("hvd.broadcast_object_fn", session)
    name = name or "broadcast_object_fn"
    return lambda obj: broadcast_object(obj, root_rank, session=session, name=name, process_set=process_set)


@not_converted
def allgather_object(obj: Any, session: Any = None, name: str | None = None, process_set: Any = None) -> list[Any]:
    """Gather every rank's Python object into a list, in rank order.

    The objects are pickled and sent through MPI, without a TensorFlow op, so the call works the same eagerly and in
    a graph.

    Args:
        obj: this rank's object.
        session: Horovod's TF1 session argument. A ``tf.compat.v1.Session`` or None; it is not needed, since no op
            runs.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name, so that nameless calls pair in call order.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. The default, None, means every rank.

    Returns:
        A list with one object per rank, in rank order: ``size()`` items, or the set's size with ``process_set``.

    Raises:
        ValueError: ``session`` is not a session; the runtime is not initialised; or ``process_set`` is not a
            registered ``hvd.ProcessSet`` or does not hold this rank.
        MismatchError: the ranks called different collectives under this name, or this one with different arguments.
            Every rank raises it.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    _check_session("hvd.allgather_object", session)
    return _objects.allgather_object(obj, name, process_set)


# ------------------------------------------------------------- alltoall etc.
@not_converted
def alltoall(tensor: Any, splits: Any = None, name: str | None = None, ignore_name_scope: bool = False,
             process_set: Any = None) -> Any:
    """Send a block of rows of a tensor to each rank, and concatenate the blocks that arrive.

    Rank ``r`` gets the ``splits[r]`` rows that follow those sent to the ranks before it. What arrives is
    concatenated in rank order. The call is differentiable: each rank's rows of the gradient go back to the rank
    they came from.

    Args:
        tensor: the rows to send: a TensorFlow tensor, a numpy array, or anything ``np.asarray`` takes, of at least
            one dimension. The dimensions after the first and the dtype are the same on every rank.
        splits: how many rows go to each rank: one non-negative int per rank, summing to the first dimension. The
            default, None, sends equal parts, which needs a first dimension that the number of ranks divides.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name (in a graph, the tensor's own name), so that nameless calls pair in call
            order.
        ignore_name_scope: in a graph, use ``name`` as it is, without the graph's name scope before it. Defaults to
            False.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. The default, None, means every rank.

    Returns:
        Without ``splits``, the rows that arrived, of ``tensor``'s dtype: a ``tf.Tensor`` for a TensorFlow tensor,
        else a numpy array. With ``splits``, a tuple of those rows and an int32 vector of how many rows came from
        each rank.

    Raises:
        ValueError: the runtime is not initialised; a rank's tensor is a scalar, its ``splits`` do not fit its rows,
            or its dtype cannot be sent, in which case every rank raises; or ``process_set`` is not a registered
            ``hvd.ProcessSet`` or does not hold this rank. Eagerly, for TensorFlow tensors, a refusal and a rank
            outside ``process_set`` are raised as a ``tf.errors.InvalidArgumentError`` that is also a
            ``ValueError``.
        MismatchError: the ranks called different collectives under this name, or this one with different arguments,
            shapes or dtypes. Every rank raises it. Eagerly, for TensorFlow tensors, it is also a
            ``tf.errors.FailedPreconditionError``; in a TF1 graph, ``session.run`` raises
            ``FailedPreconditionError``.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
        XLAUnsupportedError: the call is traced into an XLA-compiled function (``jit_compile=True``).
    """
    backends = _backends(process_set, "hvd.alltoall", tensor)
    label = _name(_scoped(name, ignore_name_scope, tensor), "alltoall", tensor)
    if is_device_array(tensor):  # (a GPU array: through NCCL, where it is)
        out, received = _nccl_of(backends, "hvd.alltoall").alltoall(tensor, splits, label)
        return out if splits is None else (out, received.astype(np.int32))
    if not _is_tf(tensor):
        out, received = backends.mpi.alltoall(np.asarray(tensor), None if splits is None else np.asarray(splits), label)
        return out if splits is None else (out, received.astype(np.int32))
    tf = _tf()
    tensor = tf.convert_to_tensor(tensor)
    splits_t = tf.zeros([0], tf.int32) if splits is None else tf.cast(splits, tf.int32)

    def a2a_np(arrays: list[np.ndarray]) -> list[np.ndarray]:
        arr, sp = arrays
        out, received = backends.mpi.alltoall(arr, None if splits is None else sp, label)
        return [out, received.astype(np.int32)]

    @tf.custom_gradient
    def a2a_tf(x: Any) -> Any:
        out, received = _on_tf(a2a_np, [x, splits_t], [x.dtype, tf.int32], [_any_rows(x), [backends.size]])

        def grad(dy: Any, *_: Any) -> Any:
            return _gradients.alltoall(_TensorFlowOps(process_set, backends), dy, received)

        return (out, received), grad

    out, received = a2a_tf(tensor)
    return out if splits is None else (out, received)


@not_converted
def reducescatter(tensor: Any, op: int = Average, name: str | None = None, process_set: Any = None,
                  ignore_name_scope: bool = False, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> Any:
    """Reduce a tensor over all ranks, and keep this rank's block of rows of the result.

    The rows are split as evenly as possible, in rank order: the first ``rows % size`` ranks get one row more. The
    call is differentiable: the gradient is every rank's rows gathered, times the size for ``hvd.Sum`` and times
    both scale factors.

    Args:
        tensor: the value to reduce: a TensorFlow tensor, a numpy or cupy array, or anything ``np.asarray`` takes,
            of at least one dimension. Every rank passes one of the same shape and dtype.
        op: the reduction: ``hvd.Average`` (the default), ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name (in a graph, the tensor's own name), so that nameless calls pair in call
            order.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. The default, None, means every rank.
        ignore_name_scope: in a graph, use ``name`` as it is, without the graph's name scope before it. Defaults to
            False.
        prescale_factor: a factor applied to each rank's tensor before the reduction. Defaults to 1.0.
        postscale_factor: a factor applied to the result after the reduction. Defaults to 1.0.

    Returns:
        This rank's block of the reduced value, of ``tensor``'s dtype and of the kind ``allreduce`` returns; its
        dimensions after the first are ``tensor``'s.

    Raises:
        ValueError: the runtime is not initialised; ``op`` is not one of the five ops above, a rank's tensor is a
            scalar, or its dtype cannot be reduced, in which case every rank raises; or ``process_set`` is not a
            registered ``hvd.ProcessSet`` or does not hold this rank. Eagerly, for TensorFlow tensors, a refusal and
            a rank outside ``process_set`` are raised as a ``tf.errors.InvalidArgumentError`` that is also a
            ``ValueError``.
        MismatchError: the ranks called different collectives under this name, or this one with different arguments,
            shapes or dtypes. Every rank raises it. Eagerly, for TensorFlow tensors, it is also a
            ``tf.errors.FailedPreconditionError``; in a TF1 graph, ``session.run`` raises
            ``FailedPreconditionError``.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
        XLAUnsupportedError: the call is traced into an XLA-compiled function (``jit_compile=True``).
    """
    return grouped_reducescatter([tensor], op=op, name=_scoped(name, ignore_name_scope, tensor),
                                 process_set=process_set, prescale_factor=prescale_factor,
                                 postscale_factor=postscale_factor)[0]


@not_converted
def grouped_reducescatter(tensors: list[Any], op: int = Average, name: str | None = None,
                          process_set: Any = None, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[Any]:
    """Reduce several tensors over all ranks, and keep this rank's block of rows of each.

    Each tensor is reduced and split as ``reducescatter`` does it; the call is differentiable too.

    Args:
        tensors: a list of tensors, as ``reducescatter`` takes. Every rank passes the same number, of the same
            shapes and dtypes, in the same order.
        op: the reduction: ``hvd.Average`` (the default), ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``.
        name: the name that pairs this call across ranks; tensor ``i`` is labelled ``name.i``. The default, None,
            takes automatic names (in a graph, the tensors' own names).
        process_set: the ``hvd.ProcessSet`` whose ranks take part. The default, None, means every rank.
        prescale_factor: a factor applied to each rank's tensors before the reduction. Defaults to 1.0.
        postscale_factor: a factor applied to the results after the reduction. Defaults to 1.0.

    Returns:
        A list with this rank's block of each reduced tensor, as ``reducescatter`` returns it. An empty list for an
        empty ``tensors``.

    Raises:
        ValueError: the runtime is not initialised; ``op`` is not one of the five ops above, a rank's tensor is a
            scalar, or its dtype cannot be reduced, in which case every rank raises; or ``process_set`` is not a
            registered ``hvd.ProcessSet`` or does not hold this rank. Eagerly, for TensorFlow tensors, a refusal and
            a rank outside ``process_set`` are raised as a ``tf.errors.InvalidArgumentError`` that is also a
            ``ValueError``.
        MismatchError: the ranks called different collectives under this name, or this one with different arguments,
            shapes or dtypes. Every rank raises it. Eagerly, for TensorFlow tensors, it is also a
            ``tf.errors.FailedPreconditionError``; in a TF1 graph, ``session.run`` raises
            ``FailedPreconditionError``.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
        XLAUnsupportedError: the call is traced into an XLA-compiled function (``jit_compile=True``).
    """
    if not tensors:
        return []
    backends = _backends(process_set, "hvd.grouped_reducescatter", tensors[0])
    names = _names(name, "reducescatter", tensors)

    def scaled(reduce: Any) -> Any:
        """``reduce`` with the prescale before and the postscale after (numpy or TensorFlow)."""
        def run(xs: list[Any]) -> list[Any]:
            outs = reduce([_scale(x, prescale_factor) if prescale_factor != 1.0 else x for x in xs])
            return [_scale(o, postscale_factor) if postscale_factor != 1.0 else o for o in outs]

        return run

    return _differentiable(
        tensors, "hvd.reducescatter", backends, process_set, lambda b, xs: b.reducescatter(xs, op, names), _any_rows,
        lambda ops, dys, _: _gradients.reducescatter(ops, dys, op, prescale_factor, postscale_factor), scaled)


class _TensorFlowOps:
    """What ``core/gradients``' rules are made of, on TensorFlow tensors among the ranks of ``process_set``
    (``backends``: its communicator and backends, see ``_backends``)."""

    def __init__(self, process_set: Any, backends: Any) -> None:
        self.process_set, self.backends, self.size = process_set, backends, backends.size
        self.grouped_allreduce = functools.partial(grouped_allreduce, process_set=process_set)
        self.grouped_allgather = functools.partial(grouped_allgather, process_set=process_set)

    def alltoall(self, tensor: Any, splits: Any) -> Any:
        return alltoall(tensor, splits=splits, process_set=self.process_set)[0]

    def own_rows(self, gathered: Any, rows: Any) -> Any:
        tf = _tf()
        own = tf.reshape(rows, [1])
        all_rows = tf.reshape(allgather(own, process_set=self.process_set), [self.size])
        return tf.split(gathered, all_rows, axis=0)[self.backends.rank]


join = not_converted(_objects.join)
barrier = not_converted(_objects.barrier)
start_timeline, stop_timeline = _objects.start_timeline, _objects.stop_timeline


__all__ = [
    "Adasum", "Average", "Max", "Min", "Product", "Sum", "allgather", "allgather_object", "allreduce",
    "alltoall", "barrier", "broadcast", "broadcast_", "broadcast_object", "broadcast_object_fn",
    "broadcast_variables", "grouped_allgather",
    "grouped_allreduce", "grouped_reducescatter", "join", "reducescatter", "start_timeline", "stop_timeline",
]
