"""Which view a ``%%hvd`` cell's dashboard uses."""

from __future__ import annotations

import os

from ..config import PROGRESS, DashboardMode, choices, parse_choice


def resolve_mode(mode: str | None = None) -> DashboardMode:
    """``widgets`` where a Jupyter front end can show them, else ``text``; the
    environment variable ``HVD_NOTEBOOK_PROGRESS`` overrides ``auto``.

    Args:
        mode: ``auto`` (also where None), ``widgets``, ``text`` or ``none``; ``auto`` reads ``HVD_NOTEBOOK_PROGRESS``
            first.
    """
    text = (mode or DashboardMode.AUTO).lower()
    if text == DashboardMode.AUTO:
        text = (PROGRESS.text() or DashboardMode.AUTO).lower()
    resolved = parse_choice(
        DashboardMode, text, f"progress mode {text!r}: use one of {', '.join(choices(DashboardMode))}.")
    if resolved != DashboardMode.AUTO:
        return resolved
    return DashboardMode.WIDGETS if widget_frontend() else DashboardMode.TEXT


def widget_frontend() -> bool:
    """True in a kernel started by a Jupyter server (JupyterLab, Notebook, Hub),
    which sets JPY_SESSION_NAME; nbclient/nbconvert and terminals do not."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is None or getattr(shell, "kernel", None) is None:
            return False
        import bqplot  # noqa: F401
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return bool(os.environ.get("JPY_SESSION_NAME"))
