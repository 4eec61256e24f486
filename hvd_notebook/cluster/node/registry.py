"""The node's register of running clusters, readable by every user.

Each kernel's cluster has a card, ``cluster-UID-KERNEL_PID.json`` in the register's folder
(``nodedir.register_dir()``: ``register/`` in the node's lease folder, sticky like /tmp), written by
its kernel and readable by all: who, which kernel, how many ranks, which GPUs,
since when, and when its last ``%%hvd`` cell ran. Nothing secret is on it (the
cluster's keys and files stay in its owner-only directory). It serves:

- the per-user caps of the node's policy (``policy``): a user's GPUs and CPU ranks
  are summed over their cards whose kernel still runs;
- ``hvd-notebook list --all``: every user's clusters, without reading their files;
- ``hvd-notebook clean --user U``: U's cards whose kernel is gone.

Every other user may put anything in that folder, so a card is read only where it is a regular file
(opened with ``O_NOFOLLOW | O_NONBLOCK``: a link is not followed, a FIFO does not hang the reader) of
at most ``MAX_CARD_BYTES``, owned by the uid its name claims, whose fields have their types and sane
values; any other is a bad card, skipped with one warning (per file and
process, for at most ``MAX_WARNED`` files). Who owns a card is its file's owner (the system's word), not
the text on it, and its kernel must run as that owner. A flood costs a reader little: at most
``MAX_CARDS_PER_USER`` cards of each owner are read (the reader's own first), ``MAX_CARDS`` in all, and
at most ``MAX_EXAMINED`` names are looked at.
The kernel removes its card when the cluster stops; the reaper, when the kernel died.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

import psutil

from ... import private
from ...liveness import alive
from . import nodedir

log = logging.getLogger(__name__)

CARD_PREFIX = "cluster-"
MAX_CARD_BYTES = 64 * 1024  # a card is a few hundred bytes
MAX_CARDS_PER_USER = 16  # cards read per owner: a user runs a few clusters; a flood of cards costs others no more
MAX_CARDS = 256  # cards read in all
MAX_EXAMINED = 4096  # names of the register looked at (an lstat each) per reading
MAX_WARNED = 1024  # bad files warned about per process; beyond, one last warning says so
_CARD_NAME = re.compile(r"cluster-(\d{1,10})-(\d{1,10})\.json")
_warned: set[str] = set()


@dataclass(frozen=True)
class Card:
    """What the node may know of one cluster."""

    cluster: str  # the cluster id, also its directory's name
    workdir: str  # the owner-only directory (for the owner and root)
    kernel: int  # the kernel's pid
    kernel_started: float  # its create time: a reused pid is not mistaken for it
    ranks: int
    gpus: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    last_cell: float = field(default_factory=time.time)  # when the last %%hvd cell ended (or the start)
    busy: bool = False  # a %%hvd cell runs now
    user: str = ""  # filled in from the file's owner when read
    path: str = ""  # the card's own file, filled in when read
    uid: int | None = None  # the file's owner, filled in when read (None: a card of this process's user)

    @property
    def kernel_alive(self) -> bool:
        """The kernel that wrote the card still runs, as the card's owner (a card naming another user's
        process, or a reused pid, is not alive)."""
        owner = os.geteuid() if self.uid is None else self.uid
        try:
            kernel = psutil.Process(self.kernel)
            return (abs(kernel.create_time() - self.kernel_started) < 1.0 and kernel.uids().real == owner
                    and alive(kernel))
        except psutil.Error:
            return False


def card_path(kernel: int | None = None) -> Path:
    """Where the card of this user's cluster of ``kernel`` (this process by default) lies.

    Args:
        kernel: the kernel's PID; None for this process.
    """
    pid = os.getpid() if kernel is None else kernel
    return nodedir.configured_dir() / nodedir.REGISTER / f"{CARD_PREFIX}{os.geteuid()}-{pid}.json"


def write(card: Card) -> None:
    """Write (or replace) this user's card, readable by all: whole, through a fresh name and a rename
    (never through a link or into a file someone else made).

    Args:
        card: the card.
    """
    path = nodedir.register_dir(create=True) / card_path(card.kernel).name
    text = json.dumps({k: v for k, v in asdict(card).items() if k not in _FILLED_IN})
    private.write_text(path, text, 0o644)


def touch(card: Card, busy: bool) -> Card:
    """The card after a cell started (``busy``) or ended, written.

    Args:
        card: the card.
        busy: whether a cell runs.
    """
    updated = replace(card, busy=busy, last_cell=time.time())
    write(updated)
    return updated


def remove(kernel: int | None = None, path: str | Path | None = None) -> None:
    """Remove this user's card of ``kernel``'s cluster (this process's by default), or the card at
    ``path``; gone already (or no register) is fine.

    Args:
        kernel: the kernel's PID; None for this process.
        path: the card's path, in place of ``kernel``.
    """
    try:
        (Path(path) if path else card_path(kernel)).unlink()
    except OSError:
        pass


class BadCard(ValueError):
    """A file in the register that is not a card to trust; says why."""


def _number(low: float, high: float, whole: bool = False):
    def check(value: object) -> bool:
        kinds = (int,) if whole else (int, float)
        return (isinstance(value, kinds) and not isinstance(value, bool) and math.isfinite(value)
                and low <= value <= high)
    return check


def _text(value: object) -> bool:
    return isinstance(value, str) and len(value) <= 4096


def _gpu_ids(value: object) -> bool:
    return (isinstance(value, list) and len(value) <= 1024 and set(map(type, value)) <= {str}
            and max(map(len, value), default=0) <= 64)  # (in C: a card of 1024 ids is checked in microseconds)


_FILLED_IN = ("user", "path", "uid")  # a card's fields that the reader fills in, never written
_TIME = _number(0, 2**34)  # seconds since 1970, before the year 2500: time.localtime takes it
_FIELDS = {"cluster": (_text, "a text"), "workdir": (_text, "a text"),
           "kernel": (_number(1, 2**31 - 1, whole=True), "a pid"),
           "kernel_started": (_TIME, "a time"), "ranks": (_number(0, 2**20, whole=True), "a count"),
           "gpus": (_gpu_ids, "a list of GPU ids"), "started": (_TIME, "a time"), "last_cell": (_TIME, "a time"),
           "busy": (lambda v: isinstance(v, bool), "true or false")}


def parse_card(data: object) -> Card:
    """The card that JSON ``data`` describes; ``BadCard`` where a field is missing, of the wrong type,
    or out of range (a reader must not crash on what another user wrote).

    Args:
        data: the card's parsed JSON.
    """
    if not isinstance(data, dict):
        raise BadCard("it is not a JSON object")
    values = {}
    for f in fields(Card):
        if f.name not in _FIELDS:
            continue  # (user, path, uid: filled in by the reader, never taken from the file)
        if f.name not in data:
            if f.default is MISSING and f.default_factory is MISSING:
                raise BadCard(f"it has no {f.name}")
            continue
        check, what = _FIELDS[f.name]
        if not check(data[f.name]):
            raise BadCard(f"its {f.name} is {str(data[f.name])[:40]!r}, not {what}")
        values[f.name] = data[f.name]
    return Card(**values)


def read_card(path: Path) -> Card:
    """The card at ``path`` (``cluster-UID-PID.json``): a regular file owned by UID, of at most
    ``MAX_CARD_BYTES``, for kernel PID; ``BadCard`` else, ``FileNotFoundError`` where it was just removed.

    Args:
        path: the card's file.
    """
    match = _CARD_NAME.fullmatch(path.name)
    if not match:
        raise BadCard("its name is not cluster-UID-PID.json")
    uid, kernel = int(match.group(1)), int(match.group(2))
    try:
        data = json.loads(private.read_bytes(path, uid=uid, max_bytes=MAX_CARD_BYTES))
    except FileNotFoundError:
        raise
    except private.UnsafePathError as exc:
        raise BadCard(str(exc)) from None
    except OSError as exc:
        raise BadCard(f"it cannot be read ({exc.strerror})") from None
    except (ValueError, RecursionError) as exc:
        raise BadCard(f"it is not JSON ({str(exc)[:100]})") from None
    card = parse_card(data)
    if card.kernel != kernel:
        raise BadCard(f"its kernel {card.kernel} is not the {kernel} of its name")
    return replace(card, user=private.user_name(uid), path=str(path), uid=uid)


def _skip(path: Path, why: str) -> None:
    """One warning per bad file, for at most ``MAX_WARNED`` files (a flood of them fills neither memory nor
    the log); past that, one warning that says so."""
    if str(path) in _warned or len(_warned) > MAX_WARNED:
        return
    _warned.add(str(path))
    if len(_warned) > MAX_WARNED:
        log.warning("hvd_notebook: more than %d bad files in the node's register: no more are named", MAX_WARNED)
    elif path.name.startswith(CARD_PREFIX):
        log.warning("hvd_notebook: skipped %s in the node's register: %s (a card is a JSON file of at most %d "
                    "bytes owned by the uid in its name)", path, why, MAX_CARD_BYTES)
    else:
        log.warning("hvd_notebook: the node's register was not read: %s", why)


def read_all(strict: bool = False) -> list[Card]:
    """The good cards on the node (of every user; at most ``MAX_CARDS_PER_USER`` per owner, the reader's
    own first, ``MAX_CARDS`` in all), oldest first; each bad one is skipped with one warning. None where
    there is no register yet, or where its folder is not to be trusted (with a warning; with ``strict``,
    ``nodedir.LeaseDirError`` then, for readers that must not go on without it).

    Args:
        strict: raise rather than warn where the register's folder is not to be trusted.
    """
    try:
        folder = nodedir.register_dir(create=False)
    except nodedir.LeaseDirError as exc:
        if strict:
            raise
        _skip(nodedir.configured_dir(), str(exc))
        return []
    cards: list[Card] = []
    examined = 0
    for names in _names_by_uid(folder):
        read, examined = _read_some(folder, names, examined)
        cards += read[:MAX_CARDS - len(cards)]
        if len(cards) >= MAX_CARDS or examined >= MAX_EXAMINED:
            break
    return sorted(cards, key=lambda c: c.started)


def _names_by_uid(folder: Path) -> list[list[str]]:
    """The card names in ``folder`` grouped by the uid they claim: the reader's own group first, then by
    uid; each group by kernel pid."""
    groups: dict[int, list[tuple[int, str]]] = {}
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                match = _CARD_NAME.fullmatch(entry.name)  # (not a card being written: .cluster-...)
                if match:
                    groups.setdefault(int(match.group(1)), []).append((int(match.group(2)), entry.name))
    except FileNotFoundError:
        return []
    me = os.geteuid()
    return [[name for _, name in sorted(groups[uid])] for uid in sorted(groups, key=lambda u: (u != me, u))]


def _read_some(folder: Path, names: list[str], examined: int) -> tuple[list[Card], int]:
    """The good cards among ``names`` (one uid's), at most ``MAX_CARDS_PER_USER``, looking at no more than
    ``MAX_EXAMINED`` names in all; with the count of names looked at so far."""
    cards: list[Card] = []
    for name in names:
        if len(cards) >= MAX_CARDS_PER_USER or examined >= MAX_EXAMINED:
            break
        examined += 1
        try:
            cards.append(read_card(folder / name))
        except FileNotFoundError:
            continue  # (removed by its owner since the listing)
        except BadCard as exc:
            _skip(folder / name, str(exc))
    return cards, examined


def held_by(user: str, besides: int | None = None) -> list[Card]:
    """``user``'s cards whose kernel still runs, other than that of the kernel ``besides`` (for the caps:
    ``nodedir.LeaseDirError`` where the register cannot be trusted, rather than no cards).

    Args:
        user: the login name.
        besides: a kernel PID to leave out, or None.
    """
    return [c for c in read_all(strict=True) if c.user == user and c.kernel != besides and c.kernel_alive]
