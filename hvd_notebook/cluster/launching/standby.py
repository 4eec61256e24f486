"""A warm standby world, which a cluster's restart promotes instead of starting cold.

A cold restart takes ~8 s on a small host, and the new world's first TensorFlow cell ~10 s
more for the import. A standby is a second controller and world of engines of the cluster's shape,
launched in a background thread once the cluster is up, whose ranks have done those
imports and pinned their device (``engine.bootstrap.warm_up``) but hold no communicator,
no collective state, no GPU context and no lease (the cluster's own lease covers both
worlds). ``MPICluster.restart`` ends the old world and promotes the standby: only the rest
of the bootstrap remains (``hvd.init()``), then a fresh standby starts in the background.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from ... import config
from ...config import ClusterOptions, Standby
from ..errors import ClusterError
from .placements import Placement

if TYPE_CHECKING:
    from .world import LaunchedWorld

CANCEL_WAIT_S = 60.0  # a standby being launched stops at its next step; ipyparallel's own steps are bounded


def choose(options: ClusterOptions, placement: Placement) -> Standby:
    """What ``--standby`` (else ``HVD_NOTEBOOK_STANDBY``) asks for, checked against the placement.

    Args:
        options: the cluster's options.
        placement: its placement.
    """
    text = options.standby or config.STANDBY.text() or Standby.AUTO.value
    choice = config.parse_choice(
        Standby, text, f"--standby {text!r} (or HVD_NOTEBOOK_STANDBY): use auto, on or off.", ClusterError)
    refusal = placement.standby_refusal()
    if choice is Standby.ON and refusal is not None:
        raise ClusterError(refusal)
    return choice


def wanted(choice: Standby, placement: Placement, n: int) -> bool:
    """Whether a cluster of ``n`` ranks keeps a standby: ``on``; or ``auto`` for ranks on this host
    whose free memory holds the standby's ranks twice over.

    Args:
        choice: what ``choose`` returned.
        placement: the cluster's placement.
        n: its number of ranks.
    """
    if choice is not Standby.AUTO:
        return choice is Standby.ON
    return placement.standby_by_default(n)


class WarmStandby:
    """One standby world, launched in a background thread as soon as it is made.

    >>> standby = WarmStandby(lambda: LaunchedWorld(placement, shape, options))
    >>> standby.state                   # "starting", then "ready"
    >>> world = standby.take(timeout)   # the launched world, or None (then it is stopped)

    Args:
        make_world: makes the world to launch.
    """

    def __init__(self, make_world: Callable[[], LaunchedWorld]) -> None:
        self.world = make_world()  # not launched: warm_up brings it up
        self.error: str | None = None
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._launch, name="hvd-notebook-standby", daemon=True)
        self._thread.start()

    def _launch(self) -> None:
        try:
            self.world.warm_up(self._cancelled)
        except BaseException as exc:  # a thread's exception would only be printed
            self.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__

    @property
    def state(self) -> str:
        """``starting``, ``ready``, or ``failed: why``."""
        if self._thread.is_alive():
            return "starting"
        return f"failed: {self.error}" if self.error is not None else "ready"

    def settle(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for its launch to end (``state`` is then ready or failed).

        Args:
            timeout: seconds to wait at most.
        """
        self._thread.join(timeout)

    def pids(self) -> set[int]:
        """Its processes so far."""
        return self.world.pids()

    def take(self, timeout: float) -> LaunchedWorld | None:
        """The standby's world, once launched (waiting up to ``timeout`` seconds for a standby still
        starting), where all of it still runs; else None, and nothing of it is left running.

        Args:
            timeout: seconds to wait at most.
        """
        self._thread.join(timeout)
        if self._thread.is_alive() or self.error is not None or not self.world.engines_whole():
            self.cancel()
            return None
        return self.world

    def cancel(self) -> None:
        """Stop it, however far it got."""
        self._cancelled.set()
        self._thread.join(CANCEL_WAIT_S)
        self.world.stop()
