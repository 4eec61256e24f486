"""The one check of the ipyparallel version, which the rank channel imports before anything else of it.

ipyparallel has no public way to ask the controller for its queues with a deadline, nor to send an engine a
control message of one's own: the channel (``channel.py``, the only module that may) does both through five
private names of the ``Client`` (``PRIVATE_NAMES``). A private name can change in any release, so importing
this module fails on an ipyparallel outside the releases they were tested with, and says what to install.
"""

from __future__ import annotations

import re

import ipyparallel

from ..errors import ClusterError

TESTED = ((9, 2),)  # (major, minor) releases of ipyparallel these private names were tested with
PRIVATE_NAMES = ("_send", "_query_stream", "_build_targets", "_unwrap_exception", "_send_control_request")


class UntestedIpyparallel(ClusterError):
    """The installed ipyparallel is not one whose private names were tested."""


def check(version: str) -> None:
    """Raise ``UntestedIpyparallel`` where ipyparallel ``version`` is not a release of ``TESTED``.

    Args:
        version: the installed ipyparallel's version.
    """
    found = re.match(r"(\d+)\.(\d+)", version)
    if found is None or (int(found[1]), int(found[2])) not in TESTED:
        tested = ", ".join(f"{major}.{minor}.x" for major, minor in TESTED)
        wanted = " or ".join(f"'ipyparallel=={major}.{minor}.*'" for major, minor in TESTED)
        raise UntestedIpyparallel(
            f"ipyparallel {version} is installed, but hvd_notebook uses private parts of ipyparallel's Client "
            f"({', '.join(PRIVATE_NAMES)}) that were tested with ipyparallel {tested} only: install a tested one "
            f"(pip install {wanted}), or an hvd_notebook release that names ipyparallel {version} as tested.")


check(ipyparallel.__version__)

