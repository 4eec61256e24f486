"""The server extension's REST handlers, behind Jupyter's own authentication: what the panel shows
(``GET hvd-notebook/clusters``) and its buttons (``POST hvd-notebook/clusters/ID/ACTION``; ``delete`` for a
suspended one). The server runs as the user, so it reads only what that user may read: their own clusters and
suspended clusters, and the node's public register."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import tornado.web
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from .actions import ActionError, carry_out
from .readings import Kernel, Readings

ROUTE = "hvd-notebook"
SNAPSHOT_WITHIN_S = 20.0  # a reading that takes longer is answered 503 (it goes on: the next request awaits it)


class Snapshots:
    """The server's readings, one at a time, in a thread of their own (never in the server's shared pool, where
    readings the browser gave up on would pile up in front of the buttons): a request that finds one under way
    awaits that same one, for at most ``SNAPSHOT_WITHIN_S``.

    Args:
        readings: what reads the figures (``readings.Readings``).
    """

    def __init__(self, readings: Readings) -> None:
        self.readings = readings
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hvd-notebook-panel")
        self._running: asyncio.Future | None = None

    async def latest(self, kernels: dict[int, Kernel]) -> dict[str, Any]:
        """The reading under way, else a new one; ``TimeoutError`` after ``SNAPSHOT_WITHIN_S``.

        Args:
            kernels: this server's kernels by process id (for a new reading).
        """
        if self._running is None or self._running.done():
            self._running = asyncio.get_running_loop().run_in_executor(self._pool, self.readings.snapshot, kernels)
            self._running.add_done_callback(lambda f: f.cancelled() or f.exception())  # (read even if none waits)
        return await asyncio.wait_for(asyncio.shield(self._running), SNAPSHOT_WITHIN_S)


AUTH_RESOURCE = "hvd_notebook"  # what a server's authorizer is asked about: read (the panel), write (its buttons)


class ClustersHandler(APIHandler):
    """``GET``: this user's clusters, their ranks, the node's GPUs (``readings.Readings.snapshot``, one at a
    time: ``Snapshots``)."""

    auth_resource = AUTH_RESOURCE

    @tornado.web.authenticated
    @authorized("read")
    async def get(self) -> None:
        snapshots: Snapshots = self.settings["hvd_notebook_snapshots"]
        try:
            snapshot = await snapshots.latest(await self._kernels())
        except TimeoutError:
            self.set_status(503)
            self.finish(json.dumps({"message": f"The node's figures took over {SNAPSHOT_WITHIN_S:g} s to read (a "
                                               "busy node): the panel asks again."}))
            return
        self.finish(json.dumps(snapshot))

    async def _kernels(self) -> dict[int, Kernel]:
        """This server's kernels by process id, with the notebook each serves."""
        paths = {s["kernel"]["id"]: s.get("path") for s in await self.session_manager.list_sessions()
                 if s.get("kernel")}
        found = {}
        for kernel_id in self.kernel_manager.list_kernel_ids():
            provisioner = getattr(self.kernel_manager.get_kernel(kernel_id), "provisioner", None)
            pid = getattr(provisioner, "pid", None)
            if isinstance(pid, int):
                found[pid] = Kernel(kernel_id, paths.get(kernel_id))
        return found


class ActionHandler(APIHandler):
    """``POST``: a button of the panel on one of this user's clusters (``actions.carry_out``)."""

    auth_resource = AUTH_RESOURCE

    @tornado.web.authenticated
    @authorized("write")
    async def post(self, cluster: str, action: str) -> None:
        """Carry out ``action`` on this user's ``cluster``: its answer as JSON, or an error status saying what to do.

        Args:
            cluster: the cluster's id, from the URL.
            action: the action, from the URL.
        """
        try:
            text = await asyncio.get_running_loop().run_in_executor(None, carry_out, cluster, action)
        except ActionError as exc:
            self.set_status(exc.status)
            self.finish(json.dumps({"message": str(exc)}))
            return
        self.finish(json.dumps({"ok": True, "text": text}))


def setup_handlers(web_app: tornado.web.Application) -> None:
    """Add the handlers under the server's base URL.

    Args:
        web_app: the Jupyter server's application.
    """
    base = url_path_join(web_app.settings["base_url"], ROUTE)
    web_app.settings["hvd_notebook_snapshots"] = Snapshots(Readings())
    web_app.add_handlers(".*$", [
        (url_path_join(base, "clusters"), ClustersHandler),
        (url_path_join(base, "clusters", r"([^/]+)", r"([a-z]+)"), ActionHandler),
    ])
