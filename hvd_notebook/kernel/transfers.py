"""What ``%hvd pull``, ``%hvd push`` and ``%hvd status`` ask of a running cluster's ranks, through its rank
channel, with each failure said as the user's error (``failures.HvdError``)."""

from __future__ import annotations

import sys
from typing import Any

from ..cluster.launching.channel import ControllerSilent
from ..cluster.launching.cluster import MPICluster
from ..cluster.launching.status import rank_status
from ..config import PREFIX
from ..messages import RankStatus
from . import failures
from .failures import HvdError


def pull(cluster: MPICluster, name: str, rank: int) -> Any:
    """The value of ``name`` on ``rank``.

    Args:
        cluster: the running cluster.
        name: the variable's name on the rank.
        rank: the rank to take it from.
    """
    if rank not in [r.rank for r in cluster.ranks]:
        raise HvdError(f"--rank {rank} does not exist: this cluster has ranks 0..{(cluster.n or 0) - 1}.")
    try:
        return cluster.channel.pull(name, rank)
    except ControllerSilent as exc:
        raise HvdError(f"Pulling {name!r} from rank {rank} failed: {exc}.") from None
    except Exception as exc:
        ename = getattr(exc, "ename", type(exc).__name__)
        if ename == "NameError":
            raise HvdError(f"Rank {rank} has no variable named {name!r}.") from None
        raise HvdError(f"Pulling {name!r} from rank {rank} failed: {ename}: "
                       f"{getattr(exc, 'evalue', exc)}") from None


def push(cluster: MPICluster, name: str, value: Any) -> None:
    """Set ``name`` to ``value`` on every rank of ``cluster``.

    Args:
        cluster: the running cluster.
        name: the variable's name on the ranks.
        value: its value (pickled to each rank).
    """
    try:
        cluster.channel.push({name: value})
    except ControllerSilent as exc:
        raise HvdError(f"Pushing {name!r} to the ranks failed: {exc}.") from None
    except Exception as exc:
        raise HvdError(f"Pushing {name!r} to the ranks failed: {type(exc).__name__}: {exc}. "
                       "The object must be picklable.") from None


def status(cluster: MPICluster) -> list[RankStatus]:
    """One row per rank of ``cluster``: alive or dead, host, pid, device, memory (host, and GPU where the ranks
    have GPUs), what it runs (unknown, with a line on stderr, where the controller does not answer).

    Args:
        cluster: the running cluster.
    """
    busy: dict[int, bool] | None
    try:
        if not cluster.channel.routes():
            raise ControllerSilent(failures.CONTROLLER_ENDED)
        busy = cluster.channel.settled_busy()
    except ControllerSilent as exc:  # (what each rank runs is then unknown; the rest is asked of the OS)
        print(f"{PREFIX} {exc}", file=sys.stderr, flush=True)
        busy = None
    except Exception:
        busy = {}
    return rank_status(cluster, busy)
