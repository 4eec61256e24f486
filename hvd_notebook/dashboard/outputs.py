"""Each rank's own output of a cell, for the tabs under the dashboard: its
stdout and stderr in the order they arrived, whether it wrote to stderr, and
how it failed; the badge of its tab, and its text as HTML (shared by the live
tab and the static summary). Plain Python, no display."""

from __future__ import annotations

import html
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

OUTPUT_TAIL_BYTES = 32 * 1024  # each rank keeps (and shows) the last this much of its output
STDOUT, STDERR, NOTE = "stdout", "stderr", "note"  # the kinds of text: the rank's streams, and the dashboard's notes
FAILED_BADGE, STDERR_BADGE = "✗", "⚠"
_STYLE = {STDERR: "color:#a94442;background:#fdf0f0", NOTE: "color:#777;font-style:italic"}
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")  # terminal colours, which a <pre> would show as text
PRE_STYLE = "margin:0;padding:4px;max-height:360px;overflow:auto;white-space:pre-wrap;font-size:12px"


@dataclass
class RankOutput:
    """One rank's output in a cell: ``(kind, text)`` chunks in arrival order, the last
    ``OUTPUT_TAIL_BYTES`` of it (``dropped``: the bytes left out before them)."""

    rank: int
    chunks: list[tuple[str, str]] = field(default_factory=list)
    kept: int = 0  # bytes in chunks
    dropped: int = 0
    wrote_stderr: bool = False
    error: str | None = None  # the error's first line, where the rank failed
    details: str = ""  # ... and its traceback
    version: int = 0  # counts the changes (a view redraws what changed)

    @property
    def wrote(self) -> bool:
        """Whether the rank wrote anything (or failed) in the cell."""
        return bool(self.chunks or self.dropped) or self.error is not None

    @property
    def title(self) -> str:
        """``rank 1``, with its badge: ``rank 1 ✗`` for a failed rank, ``rank 1 ⚠`` for one that wrote to stderr."""
        badge = FAILED_BADGE if self.error is not None else STDERR_BADGE if self.wrote_stderr else ""
        return f"rank {self.rank} {badge}".rstrip()

    def add(self, kind: str, text: str) -> None:
        """Append ``text`` of ``kind`` (stdout, stderr, or a note), without its terminal colours; drop the
        oldest beyond the tail.

        Args:
            kind: ``stdout``, ``stderr`` or ``note``.
            text: what was written.
        """
        text = _ANSI.sub("", text)
        if not text:
            return
        if kind == STDERR:
            self.wrote_stderr = True
        if self.chunks and self.chunks[-1][0] == kind:
            self.chunks[-1] = (kind, self.chunks[-1][1] + text)
        else:
            self.chunks.append((kind, text))
        self.kept += len(text.encode())
        self._trim()
        self.version += 1

    def _trim(self) -> None:
        while self.kept > OUTPUT_TAIL_BYTES and self.chunks:
            kind, text = self.chunks[0]
            data = text.encode()
            excess = self.kept - OUTPUT_TAIL_BYTES
            if len(data) <= excess:
                self.chunks.pop(0)
                cut = len(data)
            else:
                rest = data[excess:].decode(errors="ignore")  # (a character cut in two goes whole)
                cut = len(data) - len(rest.encode())
                self.chunks[0] = (kind, rest)
            self.kept -= cut
            self.dropped += cut

    def fail(self, message: str, details: str = "") -> None:
        """The rank's cell failed with ``message`` (its traceback: ``details``).

        Args:
            message: the error.
            details: the traceback.
        """
        self.error, self.details = message, _ANSI.sub("", details).rstrip()
        self.version += 1

    def note(self, text: str) -> None:
        """A line of the dashboard's own in the rank's output (a reset of the world). A failure so far
        becomes part of the text: the rank runs again.

        Args:
            text: the note.
        """
        if self.error is not None:
            self.add(STDERR, f"failed: {self.error}\n" + (self.details + "\n" if self.details else ""))
            self.error, self.details = None, ""
        self.add(NOTE, text.rstrip("\n") + "\n")


class RankOutputs:
    """Every rank's output in one cell; ``shown``: the ranks whose output the cell prints as well.

    >>> outputs = RankOutputs([0, 1], shown={0})
    >>> outputs.write(1, "stderr", "careful\\n"); outputs[1].title
    'rank 1 ⚠'

    Args:
        ranks: the ranks that run the cell.
        shown: the ranks whose output the cell prints as well.
    """

    def __init__(self, ranks: Iterable[int], shown: Iterable[int]) -> None:
        self.by_rank = {rank: RankOutput(rank) for rank in ranks}
        self.shown = set(shown)

    def __getitem__(self, rank: int) -> RankOutput:
        if rank not in self.by_rank:  # (a rank of a new world after a reset)
            self.by_rank[rank] = RankOutput(rank)
        return self.by_rank[rank]

    @property
    def ranks(self) -> list[int]:
        return sorted(self.by_rank)

    def write(self, rank: int, kind: str, text: str) -> None:
        """``RankOutput.add`` on ``rank``'s output.

        Args:
            rank: the rank that wrote.
            kind: as for ``RankOutput.add``.
            text: as for ``RankOutput.add``.
        """
        self[rank].add(kind, text)

    def fail(self, rank: int, message: str, details: str = "") -> None:
        """``RankOutput.fail`` on ``rank``'s output.

        Args:
            rank: the rank whose cell failed.
            message: as for ``RankOutput.fail``.
            details: as for ``RankOutput.fail``.
        """
        self[rank].fail(message, details)

    def note(self, text: str) -> None:
        """The same note in every rank's output.

        Args:
            text: the note.
        """
        for output in self.by_rank.values():
            output.note(text)

    @property
    def hidden_news(self) -> bool:
        """Whether a rank whose output the cell does not print wrote something or failed."""
        return any(o.wrote and o.rank not in self.shown for o in self.by_rank.values())

    @property
    def selected(self) -> int:
        """The rank whose tab is open first: the first one the cell prints (rank 0 by default)."""
        shown = sorted(r for r in self.shown if r in self.by_rank)
        return shown[0] if shown else self.ranks[0]


def fmt_bytes(size: int) -> str:
    """``812 bytes``, ``12.5 KiB``, ``3.1 MiB``.

    Args:
        size: a number of bytes.
    """
    if size < 1024:
        return f"{size} bytes"
    return f"{size / 1024:.1f} KiB" if size < 1024 * 1024 else f"{size / 1024 / 1024:.1f} MiB"


def output_html(output: RankOutput) -> str:
    """One rank's output as HTML: a ``<pre>`` with stderr in red and the dashboard's notes in grey, a note
    where the start was left out, and the failure below.

    Args:
        output: one rank's output.
    """
    parts = []
    if output.dropped:
        parts.append(f"<div class='hvd-output-truncated' style='color:#777;font-style:italic'>(the first "
                     f"{fmt_bytes(output.dropped)} are left out: the last {fmt_bytes(output.kept)} follow)</div>")
    if output.chunks:
        spans = "".join(html.escape(text) if kind == STDOUT else
                        f"<span class='hvd-{kind}' style='{_STYLE[kind]}'>{html.escape(text)}</span>"
                        for kind, text in output.chunks)
        parts.append(f"<pre class='hvd-rank-output' style='{PRE_STYLE}'>{spans}</pre>")
    if output.error is not None:
        parts.append(f"<div class='hvd-rank-failed' style='color:#d9534f'>{FAILED_BADGE} failed: "
                     f"{html.escape(output.error)}</div>")
        if output.details:
            parts.append(f"<pre class='hvd-rank-traceback' style='{PRE_STYLE};{_STYLE[STDERR]}'>"
                         f"{html.escape(output.details)}</pre>")
    if not parts:
        parts.append("<div class='hvd-no-output' style='color:#777;font-style:italic'>(no output)</div>")
    return "".join(parts)


def outputs_text(outputs: RankOutputs) -> str:
    """One line for a text version: which ranks wrote how much, with their badges.

    Args:
        outputs: every rank's output in the cell.
    """
    parts = []
    for rank in outputs.ranks:
        output = outputs[rank]
        if output.wrote:
            lines = sum(text.count("\n") for _, text in output.chunks)
            parts.append(f"{output.title} ({lines} line{'s' if lines != 1 else ''})")
    return "output per rank: " + ", ".join(parts) if parts else ""
