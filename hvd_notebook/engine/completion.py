"""Engine side of completion and inspection in ``%%hvd`` cells: this rank's own IPython completer and
inspector on its live namespace, asked by the notebook kernel (``kernel/completion.py``) through
ipyparallel's ``apply``; plain tuples and dicts go back. ``obj?`` run in a cell shows its page as the
cell's output (``show_pages_as_output``): an engine has no pager, and ipyparallel drops the page."""

from __future__ import annotations

from typing import Any


def complete(code: str, cursor_pos: int) -> tuple[int, list[tuple[str, str]]]:
    """Completions of ``code`` at ``cursor_pos`` from this engine's namespace: where they start in ``code``,
    and each one's text and type (all end at ``cursor_pos``).

    >>> complete("import os\\nos.pa", 14)
    (12, [('.pardir', 'attribute'), ('.path', 'attribute'), ('.pathconf', 'attribute'), ...])

    Args:
        code: the cell's text so far.
        cursor_pos: the cursor's offset in ``code``.
    """
    from IPython import get_ipython
    from IPython.core.completer import provisionalcompleter, rectify_completions

    completer = get_ipython().Completer
    # Jedi's static analysis can take seconds on a framework's modules; the namespace itself is live
    jedi, completer.use_jedi = completer.use_jedi, False
    try:
        with provisionalcompleter():
            found = list(rectify_completions(code, completer.completions(code, cursor_pos)))
    finally:
        completer.use_jedi = jedi
    if not found:
        return cursor_pos, []
    return found[0].start, [(c.text, c.type) for c in found]


def inspect(name: str, detail_level: int = 0, omit_sections: tuple[str, ...] = ()) -> dict[str, Any]:
    """What ``name?`` (``name??`` with ``detail_level`` 1) shows of this engine's object, as a MIME bundle
    (``text/plain``, ``text/html``); empty where this engine has no such object.

    Args:
        name: the expression asked about, e.g. ``model.fit``.
        detail_level: 0 for ``name?``, 1 for ``name??`` (the source).
        omit_sections: sections of IPython's inspector to leave out.
    """
    from IPython import get_ipython

    try:
        return dict(get_ipython().object_inspect_mime(name, detail_level=detail_level,
                                                      omit_sections=omit_sections))
    except KeyError:
        return {}


def show_pages_as_output(shell: Any) -> None:
    """What this engine's shell would page (``obj?``, ``%magic``) is displayed instead: ipyparallel keeps a
    cell's displays (the notebook shows rank 0's) but not the pager's payload. The notebook kernel does
    the same where ``InteractiveShell.display_page`` is set; priority 90 runs before ipykernel's pager.

    Args:
        shell: this engine's IPython shell.
    """
    from IPython.core import page

    shell.set_hook("show_in_pager", page.as_hook(page.display_page), 90)
