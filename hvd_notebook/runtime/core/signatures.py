"""What must be equal on every rank for one collective call, one builder per
collective (used by both backends alike), and the errors when ranks disagree."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .ops import OP_NAMES, op_named

REFUSED = "refused"


@dataclass(frozen=True)
class Signature:
    """What must be equal on every rank for one collective call (``name`` labels it, unchecked)."""

    kind: str
    fields: tuple[tuple[str, Any], ...] = ()
    name: str = field(default="", compare=False)

    def describe(self) -> str:
        return f"{self.kind}('{self.name}')" if self.name else self.kind

    def named(self, name: str | None) -> Signature:
        """The same signature labelled ``name`` (itself where ``name`` is None)."""
        return self if name is None else Signature(self.kind, self.fields, name)

    def refused(self, message: str) -> Signature:
        """What a rank offers for a call it refuses (``Negotiator.refuse``): never equal to a valid one."""
        return Signature(self.kind, ((REFUSED, message),), self.name)

    @property
    def refusal(self) -> str | None:
        """The reason this rank refused the call (None for a valid call)."""
        return self.fields[0][1] if self.fields and self.fields[0][0] == REFUSED else None


def describe_mismatch(signatures: list[Signature]) -> str:
    """A sentence naming the ranks and what differed between them."""
    kinds = {s.kind for s in signatures}
    if len(kinds) > 1:
        calls = "; ".join(f"rank {r}: {s.describe()}" for r, s in enumerate(signatures))
        return (f"Ranks called different collectives at the same point ({calls}). Every rank must call "
                "the same collectives in the same order.")
    first = signatures[0]
    diffs = []
    keys = [k for k, _ in first.fields]
    for i, key in enumerate(keys):
        by_value: dict[str, list[int]] = {}
        for r, s in enumerate(signatures):
            by_value.setdefault(repr(s.fields[i][1]) if i < len(s.fields) else "?", []).append(r)
        if len(by_value) > 1:
            diffs.append(f"{key}: " + ", ".join(f"rank(s) {ranks} {value}" for value, ranks in by_value.items()))
    names = {s.name for s in signatures}
    tensor = f" of tensor '{first.name}'" if len(names) == 1 and first.name else ""
    return (f"{first.kind}{tensor} does not match across ranks: " + "; ".join(diffs or ["arguments differ"])
            + f". Every rank must pass the same {', '.join(keys) or 'arguments'}.")


# ---------------------------------------------------------------- builders
# dtypes are given by name and shapes as tuples of ints, whatever the tensor type


def allreduce_signature(op: int, dtype: str, shapes: tuple, prescale: float, postscale: float, label: str,
                        via: str = "MPI") -> Signature:
    """One (fused) allreduce; ``via`` is where the data goes (MPI on the host, NCCL on
    the GPU): every rank must take the same road."""
    return Signature("allreduce", (("op", OP_NAMES[op]), ("dtype", dtype), ("shapes", shapes),
                                   ("prescale_factor", prescale), ("postscale_factor", postscale),
                                   ("via", via)), label)


def allgather_signature(dtypes: tuple[str, ...], trailing_shapes: tuple, label: str) -> Signature:
    """A (grouped) allgather: the first dimension may differ between ranks, the rest not."""
    return Signature("allgather", (("dtypes", dtypes), ("trailing shapes", trailing_shapes)), label)


def broadcast_signature(root_rank: int, dtypes: tuple[str, ...], shapes: tuple, label: str) -> Signature:
    """A (fused) broadcast from ``root_rank``."""
    return Signature("broadcast", (("root_rank", root_rank), ("dtypes", dtypes), ("shapes", shapes)), label)


def alltoall_signature(dtype: str, trailing_shape: tuple, label: str) -> Signature:
    """An alltoall: the rows sent may differ between ranks, their shape not."""
    return Signature("alltoall", (("dtype", dtype), ("trailing shape", trailing_shape)), label)


def reducescatter_signature(op: int, dtype: str, shape: tuple, label: str) -> Signature:
    """A reducescatter of one tensor."""
    return Signature("reducescatter", (("op", OP_NAMES[op]), ("dtype", dtype), ("shape", shape)), label)


def broadcast_object_signature(root_rank: int, label: str) -> Signature:
    """A broadcast of a picklable object from ``root_rank``."""
    return Signature("broadcast_object", (("root_rank", root_rank),), label)


def allgather_object_signature(label: str) -> Signature:
    """An allgather of picklable objects (any object, any size)."""
    return Signature("allgather_object", (), label)


BARRIER = Signature("barrier")
JOIN = Signature("join")  # a joined rank's side of every later collective


class AllreduceCall(NamedTuple):
    """An allreduce signature's fields, read back (to serve it with zeros after ``hvd.join()``)."""

    op: int
    dtype: str
    shapes: tuple
    prescale: float
    postscale: float
    via: str

    @classmethod
    def of(cls, sig: Signature) -> AllreduceCall:
        fields = dict(sig.fields)
        return cls(op_named(fields["op"]), fields["dtype"], fields["shapes"], fields["prescale_factor"],
                   fields["postscale_factor"], fields.get("via", "MPI"))

    @property
    def elements(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)
