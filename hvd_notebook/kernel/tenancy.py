"""This kernel's cluster as the node sees it: its card in the node's register
(``cluster.registry``), kept up to date as cells run, and a watch that stops the
cluster when the node's rules (``cluster.policy``) say its time is up: no
``%%hvd`` cell for ``idle_timeout`` (suspended instead where the rules' ``idle_action`` says so: ``suspends``),
or ``max_lease_time`` since it started.

The watch never stops a cluster while one of its cells runs: it asks the session,
which holds its lock around every use of the cluster, and a cell that runs past
the lease time ends first (the session checks again when it ends).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import psutil

from ..cluster.node import queue, registry
from ..cluster.node.policy import IDLE_SUSPEND, Policy, format_duration

log = logging.getLogger(__name__)

WATCH_PERIOD_S = 30.0  # at most; shorter for a short idle_timeout


def due(rules: Policy, card: registry.Card, now: float) -> str | None:
    """Why the rules stop the cluster of ``card`` now, or None.

    Args:
        rules: the node's policy.
        card: the cluster's card.
        now: the time, as ``time.time()``.
    """
    if rules.max_lease_time is not None and now - card.started >= rules.max_lease_time:
        return (f"it had run for {format_duration(rules.max_lease_time)}, the longest this node allows "
                f"({rules.source('max_lease_time')})")
    if rules.idle_timeout is not None and not card.busy and now - card.last_cell >= rules.idle_timeout:
        return (f"it had run no %%hvd cell for {format_duration(rules.idle_timeout)} "
                f"({rules.source('idle_timeout')})")
    if (rules.preempt_idle_after is not None and card.gpus and not card.busy
            and now - card.last_cell >= rules.preempt_idle_after and queue.someone_waits()):
        return (f"it had run no %%hvd cell for {format_duration(rules.preempt_idle_after)} and another start waits "
                f"for GPUs in the node's queue ({rules.source('preempt_idle_after')})")
    return None


def suspends(rules: Policy, card: registry.Card, now: float) -> bool:
    """Whether what is due now (``due``) is the idle rule, and the node's ``idle_action`` suspends.

    Args:
        rules: the node's policy.
        card: the cluster's card.
        now: the time, as ``time.time()``.
    """
    lease_over = rules.max_lease_time is not None and now - card.started >= rules.max_lease_time
    return rules.idle_action == IDLE_SUSPEND and not lease_over and due(rules, card, now) is not None


class Tenancy:
    """The card of this kernel's cluster, and the watch that calls ``release(why)`` when it is due
    (``release`` returns False where the cluster is in use: the watch tries again later).

    Args:
        release: stops the cluster, saying why; False where it is in use.
    """

    def __init__(self, release: Callable[[str], bool]) -> None:
        self._release = release
        self.card: registry.Card | None = None
        self.rules = Policy()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def begin(self, workdir: Path | None, ranks: int, gpus: list[str], rules: Policy,
              keep_start: bool = False) -> None:
        """A cluster started in ``workdir`` (or restarted: ``keep_start`` keeps the lease's start time): its
        card, and a watch where the rules have a time limit.

        Args:
            workdir: the cluster's directory, or None.
            ranks: its number of ranks.
            gpus: the GPUs its lease holds.
            rules: the node's policy.
            keep_start: keep the lease's start time (a restart).
        """
        started = self.card.started if keep_start and self.card is not None else time.time()
        me = psutil.Process()
        self.card = registry.Card(cluster=workdir.name if workdir else "", workdir=str(workdir or ""), kernel=me.pid,
                                  kernel_started=me.create_time(), ranks=ranks, gpus=list(gpus), started=started)
        self.rules = rules
        try:
            registry.write(self.card)
        except OSError as exc:  # the rules still hold for this kernel; only the node cannot see the cluster
            log.warning("hvd_notebook: the node's register %s cannot be written (%s): other notebooks' caps and "
                        "hvd-notebook list --all will not see this cluster", registry.card_path(), exc.strerror or exc)
        limits = (rules.idle_timeout, rules.max_lease_time, rules.preempt_idle_after)
        if self._thread is None and any(t is not None for t in limits):
            self._stop.clear()
            self._thread = threading.Thread(target=self._watch, name="hvd-release-watch", daemon=True)
            self._thread.start()

    def cell(self, busy: bool) -> None:
        """A cell starts (``busy``) or ended.

        Args:
            busy: True as a cell starts, False as it ends.
        """
        if self.card is not None:
            try:
                self.card = registry.touch(self.card, busy)
            except OSError:  # (the lease directory went away): the rules still apply to the card in memory
                self.card = replace(self.card, busy=busy, last_cell=time.time())

    def due(self) -> str | None:
        """Why the cluster must stop now, or None."""
        return due(self.rules, self.card, time.time()) if self.card is not None else None

    def suspends(self) -> bool:
        """Whether the rules' action now is a suspend (``suspends``), not a stop."""
        return suspends(self.rules, self.card, time.time()) if self.card is not None else False

    def end(self) -> None:
        """The cluster stopped: no card, no watch."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)
        if self.card is not None:
            registry.remove(self.card.kernel)
            self.card = None

    def _period(self) -> float:
        limits = [t for t in (self.rules.idle_timeout, self.rules.max_lease_time, self.rules.preempt_idle_after)
                  if t is not None]
        return max(0.5, min([WATCH_PERIOD_S, *(t / 10 for t in limits)]))

    def _watch(self) -> None:
        while not self._stop.wait(self._period()):
            why = self.due()
            if why is not None and self._release(why):
                return


def released_message(why: str, when: float, gpus: list[str]) -> str:
    """What the next ``%hvd`` or ``%%hvd`` says after the node's rules stopped the cluster.

    Args:
        why: why the rules stopped it.
        when: the time it was stopped.
        gpus: the GPUs it held.
    """
    freed = f" and its GPU(s) {','.join(gpus)} released" if gpus else ""
    return (f"This notebook's cluster was stopped at {time.strftime('%H:%M:%S', time.localtime(when))}{freed}: "
            f"{why}. %hvd restart starts it again (%hvd restart --replay also runs again the cells since "
            "%hvd start); the ranks' variables are gone.")
