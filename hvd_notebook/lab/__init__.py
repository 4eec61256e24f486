"""hvd_notebook in JupyterLab itself: a server extension (``handlers``) that feeds the left-sidebar panel
and the status-bar item of the prebuilt JupyterLab extension (TypeScript sources in ``labextension/`` at the
repository's root, built into ``labextension/`` here by ``make install``). See docs/jupyterlab.md."""

from __future__ import annotations

import os
from typing import Any

from .. import config

LABEXTENSION = "hvd-notebook-lab"  # the prebuilt extension's name (labextension/package.json)


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "hvd_notebook.lab"}]


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": LABEXTENSION}]


def _load_jupyter_server_extension(server_app: Any) -> None:
    """Called by Jupyter Server when the extension is enabled: the panel's handlers added.

    Args:
        server_app: the running ``jupyter_server.serverapp.ServerApp``.
    """
    from .handlers import setup_handlers

    taken = node_settings_from_kernelspec(server_app.kernel_spec_manager)
    setup_handlers(server_app.web_app)
    server_app.log.info("hvd_notebook: the JupyterLab panel's server extension is loaded%s",
                        f" (the node's settings from the kernelspec: {', '.join(taken)})" if taken else "")


NODE_SETTINGS = (config.LEASE_DIR, config.GPUS, config.POLICY_FILE)  # where the node's leases, GPUs and rules are


def node_settings_from_kernelspec(specs: Any) -> list[str]:
    """The node's settings that the admin put in the kernelspec's environment (docs/jupyterhub.md), where the
    server's own environment lacks them: the panel then reads the lease folder and the rules that the kernels
    use. The names of the settings taken.

    Args:
        specs: the server's ``KernelSpecManager``.
    """
    try:
        env = specs.get_kernel_spec(config.KERNEL_NAME).env or {}
    except Exception:  # (no hvd_notebook kernelspec: the server's environment is all there is)
        return []
    taken = [s.name for s in NODE_SETTINGS if s.name in env and s.name not in os.environ]
    for name in taken:
        os.environ[name] = str(env[name])
    return taken
