"""The panel's buttons, carried out as their magics would be: a notebook's cluster is interrupted, restarted
or stopped by its own kernel (a request in the cluster's directory, ``kernel.panel``), so that the notebook's
next cell says what happened; "where is every rank" is answered here, by the ranks themselves (what
``%hvd stacks`` and ``hvd-notebook stacks`` print); a job of ``hvd-notebook run`` is stopped as Ctrl-C in its
terminal would (its launcher ends its ranks)."""

from __future__ import annotations

import re
import time

from ..cluster.finding import ClusterDir, find_clusters, own_cluster_dirs, own_suspended
from ..cluster.launching.suspension import Claim, SuspendError, format_size
from ..cluster.processes import stacks
from ..cluster.processes.pids import ask_to_end
from ..cluster.processes.workdir import CELL_ENDS_S
from .readings import KERNEL_ACTIONS, SCRIPT_ACTIONS, SERVER_ACTIONS

SUSPENDED_ACTIONS = ("delete",)  # on a suspended cluster: answered here (what hvd-notebook delete does)
ACTIONS = (*KERNEL_ACTIONS, *SERVER_ACTIONS, *SUSPENDED_ACTIONS)
ANSWER_WITHIN_S = CELL_ENDS_S + 60.0  # a stop waits for an interrupted cell, then stops the cluster
_CLUSTER_ID = re.compile(r"hvd-[0-9]+-[0-9]+")


class ActionError(Exception):
    """An action that cannot be carried out: its HTTP status and what to do.

    Args:
        status: the HTTP status to answer with.
        message: what to do.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def carry_out(cluster_id: str, action: str) -> str:
    """Carry out ``action`` on this user's cluster ``cluster_id`` (blocking: up to ``ANSWER_WITHIN_S``); what
    happened, in a sentence, or the stacks' text; ``ActionError`` where it cannot be done.

    Args:
        cluster_id: the cluster directory's name.
        action: the panel's request ("stop", "restart", "stacks", ...).
    """
    if action not in ACTIONS:
        raise ActionError(404, f"{action!r} is not an action of the panel: use one of {', '.join(ACTIONS)}.")
    if action == "delete":
        return _delete_suspended(cluster_id)
    found = _find(cluster_id)
    if action == "stacks":
        return _stacks(found)
    activity = found.workdir.read_activity()
    if activity is None:  # a job of hvd-notebook run, or a cluster still starting
        if action != "stop" or found.workdir.job() is None:
            raise ActionError(409, f"{cluster_id} takes no {action} from the panel now (it is still starting, or "
                                   f"is a job of hvd-notebook run, which offers {', '.join(SCRIPT_ACTIONS)}).")
        return _stop_job(found)
    if action not in activity.actions:
        raise ActionError(409, f"The kernel of {cluster_id} does not take {action!r} requests.")
    answer = found.workdir.ask(action)
    deadline = time.monotonic() + ANSWER_WITHIN_S
    while time.monotonic() < deadline:
        try:
            text = answer.read_text()
        except FileNotFoundError:
            time.sleep(0.1)
            continue
        answer.unlink(missing_ok=True)
        return text
    answer.with_suffix(".json").unlink(missing_ok=True)  # (not to be carried out later)
    raise ActionError(504, f"The kernel of {cluster_id} did not answer the {action} within {ANSWER_WITHIN_S:g} s: "
                           "it may be stuck. Interrupt or restart that notebook's kernel from JupyterLab.")


def _find(cluster_id: str) -> ClusterDir:
    if not _CLUSTER_ID.fullmatch(cluster_id):
        raise ActionError(404, f"{cluster_id!r} is not the name of a cluster (hvd-PID-NUMBER).")
    for base in own_cluster_dirs():
        for found in find_clusters(base):
            if found.path.name == cluster_id and not found.orphaned:
                return found
    raise ActionError(404, f"You have no running cluster {cluster_id} on this node (it may have just ended).")


def _delete_suspended(cluster_id: str) -> str:
    """This user's suspended cluster ``cluster_id`` removed (``hvd-notebook delete``): 404 where it is not one of
    theirs, 409 where a notebook takes it back right now."""
    if not _CLUSTER_ID.fullmatch(cluster_id):
        raise ActionError(404, f"{cluster_id!r} is not the name of a cluster (hvd-PID-NUMBER).")
    target = next((s for s in own_suspended() if s.id == cluster_id), None)
    if target is None:
        raise ActionError(404, f"You have no suspended cluster {cluster_id} on this node (it may have just been "
                               "resumed or deleted).")
    size = target.size()
    try:
        Claim(target).done()
    except SuspendError as exc:
        raise ActionError(409, str(exc)) from None
    return f"Deleted the suspended cluster {cluster_id} ({format_size(size)} freed)."


def _stacks(found: ClusterDir) -> str:
    pids = [p for p in stacks.registered_pids() if p in set(found.live_pids)]
    if not pids:
        return "No rank of this cluster answers on this host (ranks on other hosts answer there)."
    return stacks.format_stacks(stacks.collect(pids))


def _stop_job(found: ClusterDir) -> str:
    owner = found.workdir.owner()
    process = ask_to_end(owner) if owner else None  # (hvd-notebook run ends its ranks, then itself)
    if process is None:
        raise ActionError(404, f"The launcher of {found.path.name} has ended already.")
    return f"Asked the launcher of {found.path.name} (pid {process.pid}) to end its ranks."
