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
values; any other is a bad card, skipped with one warning (per file and process). Who owns a card is
its file's owner (the system's word), not the text on it.
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
from . import nodedir

log = logging.getLogger(__name__)

CARD_PREFIX = "cluster-"
MAX_CARD_BYTES = 64 * 1024  # a card is a few hundred bytes
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

    @property
    def kernel_alive(self) -> bool:
        """The kernel that wrote the card still runs."""
        try:
            return abs(psutil.Process(self.kernel).create_time() - self.kernel_started) < 1.0
        except psutil.Error:
            return False


def card_path(kernel: int | None = None) -> Path:
    """Where the card of this user's cluster of ``kernel`` (this process by default) lies."""
    pid = os.getpid() if kernel is None else kernel
    return nodedir.configured_dir() / nodedir.REGISTER / f"{CARD_PREFIX}{os.geteuid()}-{pid}.json"


def write(card: Card) -> None:
    """Write (or replace) this user's card, readable by all: whole, through a fresh name and a rename
    (never through a link or into a file someone else made)."""
    path = nodedir.register_dir(create=True) / card_path(card.kernel).name
    text = json.dumps({k: v for k, v in asdict(card).items() if k not in ("user", "path")})
    private.write_text(path, text, 0o644)


def touch(card: Card, busy: bool) -> Card:
    """The card after a cell started (``busy``) or ended, written."""
    updated = replace(card, busy=busy, last_cell=time.time())
    write(updated)
    return updated


def remove(kernel: int | None = None, path: str | Path | None = None) -> None:
    """Remove this user's card of ``kernel``'s cluster (this process's by default), or the card at
    ``path``; gone already (or no register) is fine."""
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
    return isinstance(value, list) and len(value) <= 1024 and all(isinstance(g, str) and len(g) <= 64 for g in value)


_TIME = _number(0, 2**34)  # seconds since 1970, before the year 2500: time.localtime takes it
_FIELDS = {"cluster": (_text, "a text"), "workdir": (_text, "a text"),
           "kernel": (_number(1, 2**31 - 1, whole=True), "a pid"),
           "kernel_started": (_TIME, "a time"), "ranks": (_number(0, 2**20, whole=True), "a count"),
           "gpus": (_gpu_ids, "a list of GPU ids"), "started": (_TIME, "a time"), "last_cell": (_TIME, "a time"),
           "busy": (lambda v: isinstance(v, bool), "true or false")}


def parse_card(data: object) -> Card:
    """The card that JSON ``data`` describes; ``BadCard`` where a field is missing, of the wrong type,
    or out of range (a reader must not crash on what another user wrote)."""
    if not isinstance(data, dict):
        raise BadCard("it is not a JSON object")
    values = {}
    for f in fields(Card):
        if f.name not in _FIELDS:
            continue  # (user and path: filled in by the reader, never taken from the file)
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
    ``MAX_CARD_BYTES``, for kernel PID; ``BadCard`` else, ``FileNotFoundError`` where it was just removed."""
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
    return replace(card, user=private.user_name(uid), path=str(path))


def _skip(path: Path, why: str) -> None:
    if str(path) in _warned:
        return
    _warned.add(str(path))
    if path.name.startswith(CARD_PREFIX):
        log.warning("hvd_notebook: skipped %s in the node's register: %s (a card is a JSON file of at most %d "
                    "bytes owned by the uid in its name)", path, why, MAX_CARD_BYTES)
    else:
        log.warning("hvd_notebook: the node's register was not read: %s", why)


def read_all(strict: bool = False) -> list[Card]:
    """Every good card on the node (of every user), oldest first; each bad one is skipped with one warning.
    None where there is no register yet, or where its folder is not to be trusted (with a warning; with
    ``strict``, ``nodedir.LeaseDirError`` then, for readers that must not go on without it)."""
    try:
        folder = nodedir.register_dir(create=False)
    except nodedir.LeaseDirError as exc:
        if strict:
            raise
        _skip(nodedir.configured_dir(), str(exc))
        return []
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return []
    cards = []
    for name in names:
        if not name.startswith(CARD_PREFIX):
            continue  # (a card being written: .cluster-...)
        try:
            cards.append(read_card(folder / name))
        except FileNotFoundError:
            continue  # (removed by its owner since the listing)
        except BadCard as exc:
            _skip(folder / name, str(exc))
    return sorted(cards, key=lambda c: c.started)


def held_by(user: str, besides: int | None = None) -> list[Card]:
    """``user``'s cards whose kernel still runs, other than that of the kernel ``besides`` (for the caps:
    ``nodedir.LeaseDirError`` where the register cannot be trusted, rather than no cards)."""
    return [c for c in read_all(strict=True) if c.user == user and c.kernel != besides and c.kernel_alive]
