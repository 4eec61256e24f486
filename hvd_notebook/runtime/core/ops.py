"""The reduction ops (Horovod's names and values) and the arithmetic every
backend applies around a reduction: scaling, averaging, the row split.

Works on numpy and cupy arrays alike (both have ``dtype.kind`` and in-place ``*=``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Reduction ops, with Horovod's values
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}
_OPS_BY_NAME = {name: op for op, name in OP_NAMES.items()}
REDUCING_OPS = (Average, Sum, Min, Max, Product)  # what the built-in backends reduce (no Adasum)


def op_named(name: str) -> int:
    """The op a signature names (``"Sum"`` -> ``Sum``)."""
    return _OPS_BY_NAME[name]


def op_refusal(op: Any, accepted: tuple[int, ...] = REDUCING_OPS, what: str | None = None) -> str | None:
    """Why ``op`` is refused where only ``accepted`` are, as one message that lists them; None where it is one.

    Args:
        op: the ``op=`` a caller gave (any object: a wrong one is named as given).
        accepted: the ops the call takes (the built-in backends reduce ``REDUCING_OPS``; Adasum none).
        what: the call, to start the message with (``"hvd.DistributedOptimizer"``); None: no name.
    """
    name = _op_name(op)
    if name is not None and _OPS_BY_NAME[name] in accepted:
        return None
    given = f"hvd.{name}" if name else repr(op)
    where = " by hvd_notebook's built-in runtime" if name == "Adasum" else " here" if name else ""
    names = [f"hvd.{OP_NAMES[a]}" for a in accepted]
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"
    return f"{what + ': ' if what else ''}op={given} is not supported{where}; give op={listed}."


def _op_name(op: Any) -> str | None:
    """Horovod's name of ``op`` (numpy integers too, as ``==`` takes them); None for anything that is no op."""
    try:
        return OP_NAMES.get(op)
    except TypeError:  # (unhashable)
        return None


def check_op(op: Any, accepted: tuple[int, ...] = REDUCING_OPS, what: str | None = None,
             error: type[Exception] | None = None) -> None:
    """Raise for an op outside ``accepted`` (``op_refusal``'s message): the one op check of every binding.

    Args:
        op, accepted, what: as for ``op_refusal``.
        error: the exception to raise; None: Horovod's, ``NotImplementedError`` for Adasum (an op it has that
            this runtime lacks), ``ValueError`` for any other.
    """
    refusal = op_refusal(op, accepted, what)
    if refusal is not None:
        raise (error or (NotImplementedError if _op_name(op) == "Adasum" else ValueError))(refusal)


_DTYPE_NAMES: dict[np.dtype, str] = {}


def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, cached: numpy computes it in Python on every access."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype.name
    return name


HALF_DTYPE_NAMES = ("float16", "bfloat16")


def dtype_refusal(dtype: np.dtype, reducing: bool) -> str | None:
    """Why collectives cannot send (or, ``reducing``, reduce) arrays of ``dtype``; None where they can."""
    if dtype.hasobject:
        return (f"dtype {dtype} holds Python objects (strings?), which collectives cannot send; use "
                "hvd.broadcast_object or hvd.allgather_object for those")
    if reducing and not (dtype.kind in "iuf" or dtype_name(dtype) in HALF_DTYPE_NAMES):
        return (f"dtype {dtype_name(dtype)} cannot be reduced; cast it to an integer or float dtype (int8 to "
                "int64, uint8 to uint64, float16, bfloat16, float32, float64)")
    return None


def reduce_dtype(dtype: np.dtype) -> np.dtype:
    """MPI has no half-precision types: float16 and bfloat16 are reduced as float32."""
    if dtype.itemsize == 2 and dtype_name(dtype) in HALF_DTYPE_NAMES:
        return np.dtype(np.float32)
    return dtype


def bfloat16() -> np.dtype:
    """numpy's bfloat16 (from ml_dtypes, which TensorFlow installs)."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype a signature names, bfloat16 included."""
    return bfloat16() if name == "bfloat16" else np.dtype(name)


def scale(buf: Any, factor: float) -> Any:
    """``buf * factor`` in ``buf``'s dtype: in place for floats, a new array for integers."""
    if buf.dtype.kind == "f":
        buf *= buf.dtype.type(factor)
        return buf
    return (buf * factor).astype(buf.dtype)


def average(buf: Any, size: int) -> Any:
    """The mean of a sum over ``size`` ranks in the sum's dtype, as Horovod 0.28's kernels: floats
    in place, integers truncated toward zero (a new array)."""
    return scale(buf, 1.0 / size)


def finish_reduction(buf: Any, op: int, size: int, postscale: float) -> Any:
    """What follows the summation: the average's division, then the postscale."""
    if op == Average:
        buf = average(buf, size)
    if postscale != 1.0:
        buf = scale(buf, postscale)
    return buf


def even_rows(rows: int, size: int) -> list[int]:
    """Rows per rank when ``rows`` are split as evenly as possible (the first ``rows % size`` get one more)."""
    base, extra = divmod(rows, size)
    return [base + (1 if r < extra else 0) for r in range(size)]
