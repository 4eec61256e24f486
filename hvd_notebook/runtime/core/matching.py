"""Which of the collectives waiting on every rank run now, in which order, and
which fail: the decision each rank takes alike from every rank's list of
waiting requests (a pure function, so that every rank reaches the same one).

As in Horovod, requests are matched by name: a name waiting on every rank is
ready, whatever the order in which the ranks issued it (graph mode, several
threads, independent ops in a ``tf.function``); ready names run in the order of
the first active rank. A request the runtime named itself for an eager call in
program order (``Entry.by_order``) is paired by call order instead where each
rank waits in exactly one such call: a thread blocked in its one collective can
issue no other, so that pairing is what the program means even where the
ranks' automatic names have drifted apart.

A rank that has called ``hvd.join()`` waits with the ``JOIN`` request only; it
takes part, with zeros, in the other ranks' allreduces that allow it.
"""

from __future__ import annotations

from typing import NamedTuple

from .signatures import JOIN, Signature, describe_mismatch


class Entry(NamedTuple):
    """One waiting request as the other ranks see it."""

    key: str  # the name it is matched by
    by_order: bool  # an automatic name of an eager call: paired by call order when alone
    allow_joined: bool  # joined ranks may take part with zeros
    signature: Signature  # labelled with the request's name
    fusable: bool = False  # its data may share a call with the requests agreed after it


class Verdict(NamedTuple):
    """What every rank does with one matched request: ``positions[r]`` is its index in
    rank r's list (None on a joined rank); ``error`` fails it on every rank; ``serve``
    is the signature joined ranks serve with zeros."""

    positions: tuple[int | None, ...]
    error: str | None = None
    serve: Signature | None = None
    refused_by: tuple[int, ...] = ()  # ranks that refused the call (its error is theirs)
    fusable: bool = False  # fusable on every rank (how a rank's call reached the coordinator may differ)


class Decision(NamedTuple):
    verdicts: list[Verdict]
    all_joined: bool = False


def decide(lists: list[list[Entry]], stuck: list[bool]) -> Decision:
    """The verdicts for one round, from every rank's waiting requests (index = rank).
    ``stuck[r]``: rank r's requests have not changed for a while; where every active
    rank is stuck in exactly one request and no name matches, those requests fail."""
    joined = [waits_in_join(entries) for entries in lists]
    if all(joined):
        return Decision([], all_joined=True)
    active = [r for r, j in enumerate(joined) if not j]
    any_joined = len(active) < len(lists)
    firsts = tuple(None if j else 0 for j in joined)  # each active rank's first request
    if all(len(lists[r]) == 1 and lists[r][0].by_order for r in active):
        return Decision([_verdict(lists, firsts, any_joined)])
    verdicts = [_verdict(lists, positions, any_joined) for positions in _matched_by_name(lists, active)]
    if not verdicts and all(stuck[r] and len(lists[r]) == 1 for r in active):
        signatures = [lists[r][0].signature if not joined[r] else JOIN for r in range(len(lists))]
        return Decision([Verdict(firsts, error=_unmatched(signatures))])
    return Decision(verdicts)


def waits_in_join(entries: list[Entry]) -> bool:
    """Whether a rank's waiting requests are the ``JOIN`` alone (it has joined).

    Args:
        entries: one rank's waiting requests, as gathered in a round.
    """
    return len(entries) == 1 and entries[0].signature.kind == JOIN.kind


def _matched_by_name(lists: list[list[Entry]], active: list[int]) -> list[tuple[int | None, ...]]:
    """Positions of each name waiting on every active rank (the n-th occurrence of a
    name matches the n-th elsewhere), in the first active rank's order."""
    where: list[dict[str, list[int]]] = []
    for entries in lists:
        by_key: dict[str, list[int]] = {}
        for i, entry in enumerate(entries):
            by_key.setdefault(entry.key, []).append(i)
        where.append(by_key)
    matched = []
    seen: dict[str, int] = {}
    for entry in lists[active[0]]:
        n = seen[entry.key] = seen.get(entry.key, -1) + 1
        if all(len(where[r].get(entry.key, ())) > n for r in active):
            matched.append(tuple(where[r][entry.key][n] if r in active else None for r in range(len(lists))))
    return matched


def _verdict(lists: list[list[Entry]], positions: tuple[int | None, ...], any_joined: bool) -> Verdict:
    entries = [lists[r][p] if p is not None else None for r, p in enumerate(positions)]
    active = [e for e in entries if e is not None]
    refused_by = tuple(r for r, e in enumerate(entries) if e is not None and e.signature.refusal is not None)
    if refused_by:
        r = refused_by[0]
        reason = entries[r].signature.refusal  # type: ignore[union-attr]
        return Verdict(positions, error=f"{entries[r].signature.describe()} was refused on rank(s) "  # type: ignore[union-attr]
                       f"{list(refused_by)}: {reason}", refused_by=refused_by)
    first = active[0].signature
    if not all(e.signature == first for e in active):
        return Verdict(positions, error=describe_mismatch([e.signature if e else JOIN for e in entries]))
    if not any_joined:
        return Verdict(positions, fusable=all(e.fusable for e in active))
    if first.kind != "allreduce" or not all(e.allow_joined for e in active):
        return Verdict(positions, error="After hvd.join() a rank can only take part in allreduce; "
                       + describe_mismatch([e.signature if e else JOIN for e in entries]))
    return Verdict(positions, serve=first)


def _unmatched(signatures: list[Signature]) -> str:
    """Every rank waits in one collective and no two have the same name."""
    if len({s.kind for s in signatures}) > 1:
        return describe_mismatch(signatures)
    calls = "; ".join(f"rank {r}: {s.describe()}" for r, s in enumerate(signatures))
    return (f"Ranks wait in collectives of different names ({calls}). Collectives are matched by name: give "
            "the same call the same name on every rank (or no name, to have them paired in call order).")
