"""The server extension's REST handlers, behind Jupyter's own authentication: what the panel shows
(``GET hvd-notebook/clusters``) and its buttons (``POST hvd-notebook/clusters/ID/ACTION``). The server runs as
the user, so it reads only what that user may read: their own clusters, and the node's public register."""

from __future__ import annotations

import asyncio
import json

import tornado.web
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from .actions import ActionError, carry_out
from .readings import Kernel, Readings

ROUTE = "hvd-notebook"
AUTH_RESOURCE = "hvd_notebook"  # what a server's authorizer is asked about: read (the panel), write (its buttons)


class ClustersHandler(APIHandler):
    """``GET``: this user's clusters, their ranks, the node's GPUs (``readings.Readings.snapshot``)."""

    auth_resource = AUTH_RESOURCE

    @tornado.web.authenticated
    @authorized("read")
    async def get(self) -> None:
        readings: Readings = self.settings["hvd_notebook_readings"]
        kernels = await self._kernels()
        snapshot = await asyncio.get_running_loop().run_in_executor(None, readings.snapshot, kernels)
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
        try:
            text = await asyncio.get_running_loop().run_in_executor(None, carry_out, cluster, action)
        except ActionError as exc:
            self.set_status(exc.status)
            self.finish(json.dumps({"message": str(exc)}))
            return
        self.finish(json.dumps({"ok": True, "text": text}))


def setup_handlers(web_app: tornado.web.Application) -> None:
    """Add the handlers under the server's base URL."""
    base = url_path_join(web_app.settings["base_url"], ROUTE)
    web_app.settings["hvd_notebook_readings"] = Readings()
    web_app.add_handlers(".*$", [
        (url_path_join(base, "clusters"), ClustersHandler),
        (url_path_join(base, "clusters", r"([^/]+)", r"([a-z]+)"), ActionHandler),
    ])
