"""The node's register of running clusters, readable by every user.

Each kernel's cluster has a card, ``cluster-UID-KERNEL_PID.json`` in the lease directory
(``leases.lease_dir()``: one folder for the whole node, sticky like /tmp), written by
its kernel and readable by all: who, which kernel, how many ranks, which GPUs,
since when, and when its last ``%%hvd`` cell ran. Nothing secret is on it (the
cluster's keys and files stay in its owner-only directory). It serves:

- the per-user caps of the node's policy (``policy``): a user's GPUs and CPU ranks
  are summed over their cards whose kernel still runs;
- ``hvd-notebook list --all``: every user's clusters, without reading their files;
- ``hvd-notebook clean --user U``: where U's cluster directories are.

Who owns a card is its file's owner (the system's word), not the text on it.
The kernel removes its card when the cluster stops; the reaper, when the kernel died.
"""

from __future__ import annotations

import json
import os
import pwd
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import psutil

from . import leases

CARD_PREFIX = "cluster-"


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
    return leases.lease_dir() / f"{CARD_PREFIX}{os.getuid()}-{os.getpid() if kernel is None else kernel}.json"


def write(card: Card) -> None:
    """Write (or replace) this user's card, readable by all."""
    path = card_path(card.kernel)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    text = json.dumps({k: v for k, v in asdict(card).items() if k not in ("user", "path")})
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)  # whatever the umask: the node's users read it
    tmp.replace(path)


def touch(card: Card, busy: bool) -> Card:
    """The card after a cell started (``busy``) or ended, written."""
    updated = replace(card, busy=busy, last_cell=time.time())
    write(updated)
    return updated


def remove(kernel: int | None = None, path: str | Path | None = None) -> None:
    """Remove this user's card of ``kernel``'s cluster (this process's by default), or the card at
    ``path``; gone already is fine."""
    try:
        Path(path or card_path(kernel)).unlink()
    except OSError:
        pass


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def read_all() -> list[Card]:
    """Every card on the node (of every user), oldest first; unreadable ones are skipped."""
    cards = []
    for path in leases.lease_dir().glob(f"{CARD_PREFIX}*.json"):
        try:
            uid = path.stat().st_uid
            data = json.loads(path.read_text())
            cards.append(Card(**{k: v for k, v in data.items() if k in Card.__dataclass_fields__},
                              user=_user(uid), path=str(path)))
        except (OSError, ValueError, TypeError):
            continue
    return sorted(cards, key=lambda c: c.started)


def held_by(user: str, besides: int | None = None) -> list[Card]:
    """``user``'s cards whose kernel still runs, other than that of the kernel ``besides``."""
    return [c for c in read_all() if c.user == user and c.kernel != besides and c.kernel_alive]
