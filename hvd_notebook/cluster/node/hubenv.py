"""The hub's Python environment, checked by ``hvd-notebook setup-node`` before it makes the node's folders.

Every user's JupyterLab runs this environment's Python, loads the panel's JavaScript from its
``share/jupyter/labextensions`` and reads its ``etc/jupyter``: whoever can write a file of it, or replace a
folder on the way to it, changes what runs as every user. So all of it (links followed) must be root's and
writable by root alone. A folder above it may be a sticky one of root's, such as ``/tmp``: others can neither
rename nor remove what is in it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ...private import describe

SHOWN = 5  # paths named in a refusal


def _others_may_write(path: Path, above: bool = False) -> bool:
    """Whether a user other than root could write or replace ``path`` (not following a link); ``above``: a
    folder above the environment, where a sticky folder of root's is safe."""
    st = path.lstat()
    if st.st_uid != 0:
        return True
    if not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return False
    return not (above and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX)


def _walk(top: Path):
    """``top`` and everything under it, links not followed (a link to a folder is yielded, not entered)."""
    yield top
    for folder, dirs, files in os.walk(top):
        for name in dirs + files:
            yield Path(folder, name)


def _check_tree(top: Path, found: list[Path], seen: set[Path]) -> None:
    """Add to ``found`` what others could write of ``top`` (a real path), the folders above it and its tree; a
    link's target is checked the same way, and one that is missing counts (whoever makes it decides)."""
    if top in seen:
        return
    seen.add(top)
    found.extend(p for p in reversed(top.parents) if _others_may_write(p, above=True))
    for path in _walk(top):
        if not path.is_symlink():
            found.extend([path] if _others_may_write(path) else [])
        elif (target := Path(os.path.realpath(path))).exists():
            _check_tree(target, found, seen)
        else:
            found.append(path)


def unsafe_paths(prefix: Path) -> list[Path]:
    """What a user other than root could write in the environment at ``prefix``, links followed, or above it.

    Args:
        prefix: the environment's folder (``sys.prefix`` of its Python).
    """
    found: list[Path] = []
    _check_tree(Path(os.path.realpath(prefix)), found, set())
    return list(dict.fromkeys(found))


def _fixes(root: Path, bad: list[Path]) -> str:
    """The commands that make ``bad`` root's alone: the environment as a whole, anything outside one by one."""
    inside = any(p == root or root in p.parents for p in bad)
    outside = [p for p in bad if p != root and root not in p.parents][:SHOWN]
    return " && ".join(([f"chown -R root: {root} && chmod -R go-w {root}"] if inside else [])
                       + [f"chown root: {p} && chmod go-w {p}" for p in outside])


def refusal(prefix: Path) -> str | None:
    """Why the hub's environment at ``prefix`` is refused, with the commands that fix it; None when only root
    can change it.

    Args:
        prefix: the environment's folder (``sys.prefix`` of its Python).
    """
    bad = unsafe_paths(prefix)
    if not bad:
        return None
    root = Path(os.path.realpath(prefix))
    named = "; ".join(f"{p}: {describe(p.lstat())}" for p in bad[:SHOWN])
    more = f" (and {len(bad) - SHOWN} more)" if len(bad) > SHOWN else ""
    return (f"users other than root could change the hub's Python environment {root}, whose Python every user's "
            f"JupyterLab runs and whose share/jupyter/labextensions gives every user's JupyterLab its "
            f"JavaScript: {named}{more}. Make it root's and written by root alone, as root: `{_fixes(root, bad)}` "
            "(install the package there from its wheel, docs/jupyterhub.md: nothing then points into a checkout), "
            "and run setup-node again.")
