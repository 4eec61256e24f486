"""JupyterHub on one GPU node, with hvd_notebook for every user (docs/jupyterhub.md).

Real Unix users log in with their system password (PAM) and get their own JupyterLab, started as
themselves by the local process spawner; every notebook's cluster runs as its user, under that user's
own 0700 directory, with GPUs leased through the node's shared lease folder and the node's
fair-sharing rules (/etc/hvd_notebook/policy.toml) enforced by the kernel.

Run as root (the spawner switches to each user):  jupyterhub -f /etc/jupyterhub/jupyterhub_config.py

The settings read from the environment have the defaults of the steps in docs/jupyterhub.md;
tests/integration/test_jupyterhub.py loads this file and overrides only the login (a test password
instead of PAM), the ports and the state folder.
"""

import os

c = get_config()  # noqa: F821 (JupyterHub's config loader defines it)

# The environment every single-user server and kernel runs in: installed once by the admin, readable
# (not writable) by every user, with the kernelspec installed into it (install-kernel --sys-prefix).
PYTHON = os.environ.get("HVD_HUB_PYTHON", "/opt/hvd_notebook/bin/python")

c.JupyterHub.bind_url = os.environ.get("HVD_HUB_URL", "http://127.0.0.1:8000")  # put TLS in front of it
c.JupyterHub.hub_ip = "127.0.0.1"  # the hub's API: for the proxy and the single-user servers only

# real Unix users, their system passwords
c.JupyterHub.authenticator_class = "pam"
c.Authenticator.allow_all = True  # every user of the node; or list them: c.Authenticator.allowed_users = {...}
c.Authenticator.admin_users = set(filter(None, os.environ.get("HVD_HUB_ADMINS", "").split(",")))
# root never logs in: a server spawned as root would run every notebook, and every cluster, as root
c.Authenticator.blocked_users = {"root"}

# each user's JupyterLab runs as that user, from the shared environment
c.JupyterHub.spawner_class = "localprocess"
# Kernels talk to their server over Unix sockets beside their 0600 connection file, in the user's 0700
# runtime folder (~/.local/share/jupyter/runtime), not over TCP on loopback, where any local user could
# subscribe to a kernel's iopub and read every cell and output. (In cmd, not args: a site's own
# c.Spawner.args then cannot drop it.)
c.Spawner.cmd = [PYTHON, "-m", "jupyterhub.singleuser", "--KernelManager.transport=ipc"]
c.Spawner.default_url = "/lab"
c.Spawner.notebook_dir = "~"
c.Spawner.start_timeout = 120
c.Spawner.http_timeout = 120
# What a kernel needs from the server's environment. The node's settings for hvd_notebook (its GPUs, the
# lease folder, the policy) live in the kernelspec's env and in /etc/hvd_notebook/policy.toml, not here:
# they then hold for kernels started any other way too.
c.Spawner.env_keep = ["PATH", "LANG", "LC_ALL", "JUPYTERHUB_SINGLEUSER_APP"]

# a user's server stops when the hub does, and with it its kernels and their clusters
c.JupyterHub.cleanup_servers = True
