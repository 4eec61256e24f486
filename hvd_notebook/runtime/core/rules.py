"""The Horovod rules every binding applies alike, written once: how a nameless call is named, which op
``op=``/``average=`` mean, which compatibility arguments are refused and what to do instead, and how a
factor scales a tensor."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from .ops import Average, Sum

_next_number = 0  # of the next automatic name
_numbers = threading.Lock()


def _take_numbers(count: int) -> int:
    """The first of ``count`` consecutive numbers taken from the counter together, so that no other call,
    however it interleaves, is given one of them."""
    global _next_number
    with _numbers:
        first, _next_number = _next_number, _next_number + count
    return first


def auto_names(kind: str, count: int) -> list[str]:
    """``count`` automatic names for the tensors of one grouped call."""
    first = _take_numbers(count)
    return [f"{kind}.noname.{first + i}" for i in range(count)]


def auto_name(kind: str) -> str:
    """The next automatic name of a nameless call (``allreduce.noname.7``); every rank counts alike,
    so nameless calls pair by call order, whichever binding made them. (Without ``auto_names``' list: every
    small nameless call takes this path.)"""
    return f"{kind}.noname.{_take_numbers(1)}"


def next_auto_number() -> int:
    """The number the next automatic name will have."""
    return _next_number


def continue_auto_names_from(number: int) -> None:
    """Go on counting from ``number``: after ``join()``, where the ranks that were still calling took names
    the joined rank did not (it served their calls with zeros), every rank goes on from the highest count,
    so that their nameless calls pair again."""
    global _next_number
    with _numbers:
        _next_number = max(_next_number, number)


def names(name: str | None, kind: str, count: int) -> list[str]:
    """One name per tensor of a call: ``name`` itself for a single tensor, ``name.i`` for several, the
    counter's for a nameless call."""
    if not name:
        return auto_names(kind, count)
    return [str(name)] if count == 1 else [f"{name}.{i}" for i in range(count)]


def resolve_op(op: int | None, average: bool | None) -> int:
    """The op of Horovod's ``op=`` or its deprecated ``average=`` (default: Average)."""
    if op is not None and average is not None:
        raise ValueError("pass either op= or the deprecated average=, not both.")
    if op is None:
        return Sum if average is False else Average
    return op


# Horovod arguments this runtime does not implement, and what to do instead
_UNSUPPORTED = {
    "device_dense": "omit it (tensors are reduced where they live: with NCCL for GPU tensors where every rank "
                    "has a GPU, else with MPI on the host)",
    "device_sparse": "omit it (sparse gradients are allgathered where they live)",
    "session": "pass a tf.compat.v1.Session or omit it (TensorFlow 2 runs eagerly and has no session)",
    "device": "omit it (variables are broadcast where they live)",
    "num_groups": "omit it (tensors are fused by dtype up to HOROVOD_FUSION_THRESHOLD bytes; set that "
                  "environment variable to change the grouping)",
    "groups": "omit it (tensors are fused by dtype up to HOROVOD_FUSION_THRESHOLD bytes; set that "
              "environment variable to change the grouping)",
}


def reject_unsupported(call: str, **arguments: Any) -> None:
    """Raise ``ValueError`` for a Horovod-compatibility argument (``_UNSUPPORTED``)
    given a value other than its default (None, "" or 0), saying what to do."""
    for name, value in arguments.items():
        if value is not None and not (isinstance(value, (str, int, list, tuple)) and not value):
            raise ValueError(f"{call}({name}={value!r}): {name} is not supported by hvd_notebook's built-in "
                             f"runtime; {_UNSUPPORTED[name]}.")


def scale(x: Any, factor: float) -> Any:
    """``x * factor`` in ``x``'s dtype, computed as Horovod does: float16 in float32 (the factor is not
    rounded to float16 first), integers in float64 then truncated. Other arrays and tensors (a framework's
    own): ``x * factor``."""
    if factor == 1.0:
        return x
    if not isinstance(x, np.ndarray):
        return x * factor
    if x.dtype == np.float16:
        return (x.astype(np.float32) * np.float32(factor)).astype(np.float16)
    if x.dtype.kind in "iub":
        return (x * factor).astype(x.dtype)
    return x * x.dtype.type(factor)
