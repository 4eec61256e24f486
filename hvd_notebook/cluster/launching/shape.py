"""The shape of a cluster: how many ranks, pinned to which GPUs, and how few a restart may go on with.

``MPICluster`` resolves it once, at its first start, from what ``%hvd start`` asked for (``ClusterOptions``,
never rewritten) and the node (the GPUs free then); its worlds, its standby, the session and the node's card
read it from there. A restart keeps it, or makes a smaller one where GPUs or hosts are gone (``smaller``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

from ...config import PREFIX
from ..errors import ClusterError
from ..node import leases
from ..node.gpus import detect_gpus
from ..node.policy import Policy
from .placements import Placement


@dataclass(frozen=True)
class ClusterShape:
    """How many ranks a cluster has, and on what.

    Args:
        ranks: the number of ranks.
        gpus: the GPU ids the ranks pin by local rank (empty: CPU ranks).
        min_ranks: the fewest ranks a restart may go on with where GPUs or hosts are gone (``--min-np``).
    """

    ranks: int
    gpus: tuple[str, ...] = ()
    min_ranks: int = 1

    @classmethod
    def resolve(cls, ranks: int | None, gpus: list[str], min_np: int | None) -> ClusterShape:
        """The shape of a cluster starting now: ``ranks`` asked for (None: one per GPU of ``gpus``, which are
        leased), ``min_np`` as ``--min-np`` gave it (None: every rank).

        Args:
            ranks: the ranks asked for, or None.
            gpus: the GPUs leased.
            min_np: ``--min-np``, or None.
        """
        n = len(gpus) if ranks is None else ranks
        return cls(n, tuple(gpus), min_np or n)

    def smaller(self, ranks: int, why: str, gone: tuple[str, ...] = ()) -> ClusterShape:
        """This shape on ``ranks`` ranks without the GPUs ``gone``; a ClusterError saying ``why`` where
        ``--min-np`` allows no fewer than it had.

        Args:
            ranks: the ranks left.
            why: what went wrong, for the error.
            gone: the GPUs lost.
        """
        if ranks < self.min_ranks:
            raise ClusterError(f"{why}: {ranks} rank(s) could go on, fewer than the {self.min_ranks} that "
                               f"--min-np asks for. Start again with what is left (%hvd start --restart -n {ranks}), "
                               "or with "
                               f"--min-np {max(ranks, 1)} to let restarts go on with fewer ranks.")
        return replace(self, ranks=ranks, gpus=tuple(g for g in self.gpus if g not in gone))


class Holding:
    """What a cluster holds on the node: its shape, once its first start resolved it, and the lease of its GPUs
    (kept by a restart, released by a stop).

    Args:
        min_np: ``--min-np`` as asked for (None: every rank).
    """

    def __init__(self, min_np: int | None) -> None:
        self.min_np = min_np
        self.shape: ClusterShape | None = None  # resolved at the first start; a restart keeps it or shrinks it
        self.lease: leases.Lease | None = None

    def take(self, placement: Placement, host_gpus: list[str], asked: int | None, owner: str,
             rules: Policy) -> ClusterShape:
        """The shape, resolved at the first call from the ranks ``asked`` for (None: one per free GPU) and the GPUs
        ``placement`` leases for ``owner`` under the node's ``rules``; the same shape afterwards.

        Args:
            placement: the cluster's placement.
            host_gpus: the GPU ids this host has for the cluster.
            asked: the ranks asked for, or None.
            owner: the lease's owner.
            rules: the node's policy.
        """
        if self.shape is None:
            gpus, self.lease = placement.take_gpus(host_gpus, asked, owner, rules)
            self.shape = ClusterShape.resolve(None if self.lease is not None else asked, gpus, self.min_np)
        return self.shape

    def current(self) -> ClusterShape:
        """The shape, which every restart has (its start resolved it)."""
        if self.shape is None:
            raise ClusterError("the cluster never started: run %hvd start")
        return self.shape

    def shrink(self, n: int, why: str, gone: tuple[str, ...] = ()) -> None:
        """Go on with ``n`` ranks (without the GPUs ``gone``, which the lease drops), where ``--min-np`` allows
        it, and say so; else a ClusterError saying ``why``.

        Args:
            n: the ranks left.
            why: what went wrong, for the error.
            gone: the GPUs lost.
        """
        old = self.current()
        self.shape = old.smaller(n, why, gone)
        if gone and self.lease is not None:
            self.lease.drop(list(gone))
        print(f"{PREFIX} {why}: the new world has {n} rank(s) instead of {old.ranks} "
              f"(--min-np {old.min_ranks}).", file=sys.stderr, flush=True)

    def drop_gone_gpus(self) -> bool:
        """Where the driver no longer lists some of the GPUs (fallen off the bus, reset, taken away): drop them
        from the lease and the shape. Whether the shape changed."""
        gpus = self.current().gpus
        present = set(detect_gpus()) if gpus else set()
        gone = tuple(g for g in gpus if g not in present)
        if not present or not gone:  # (no GPUs, or the driver cannot tell)
            return False
        self.shrink(len(gpus) - len(gone), f"GPU(s) {','.join(gone)} are no longer listed by the driver", gone)
        return True

    def release(self) -> None:
        """Release the lease (the cluster stopped)."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None
