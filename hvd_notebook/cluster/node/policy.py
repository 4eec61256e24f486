"""The node's fair-sharing rules, set by its admin: how many GPUs and CPU ranks one
user's clusters may hold together, how long a cluster may hold them, after how
long without a ``%%hvd`` cell an idle cluster is suspended or stopped (``idle_action``), or gives its GPUs back
early to a start waiting in the node's queue (``preempt_idle_after``), and how long a suspended cluster's saved
state is kept.

The rules come from up to three places, and the tightest of each wins, so that a
user can make a rule stricter for themselves but never looser than the admin's:

- ``/etc/hvd_notebook/policy.toml`` (``SYSTEM_FILE``; root's, the usual place);
- the file that ``$HVD_NOTEBOOK_POLICY_FILE`` names (a kernelspec's environment);
- the environment variables ``HVD_NOTEBOOK_MAX_GPUS_PER_USER``,
  ``HVD_NOTEBOOK_MAX_CPU_RANKS_PER_USER``, ``HVD_NOTEBOOK_MAX_LEASE_TIME``,
  ``HVD_NOTEBOOK_IDLE_TIMEOUT``, ``HVD_NOTEBOOK_IDLE_ACTION``, ``HVD_NOTEBOOK_SUSPENDED_TTL`` and
  ``HVD_NOTEBOOK_PREEMPT_IDLE_AFTER`` (a kernelspec's ``env``).

A file is read as every file the node shares is (``private.open_regular``): a regular file, reached without
following a link, that does not hang the reader (a FIFO), of at most ``MAX_FILE_BYTES``, and root's or this
user's (the admin's rules, or the user's own stricter ones). A file holds the same rules by their short
names (of ``idle_action``, ``stop`` is the tighter)::

    max_gpus_per_user = 2
    max_cpu_ranks_per_user = 8
    max_lease_time = "8h"      # seconds, or a number with s, m, h or d
    idle_timeout = "30m"
    idle_action = "suspend"    # or "stop"
    suspended_ttl = "7d"
    preempt_idle_after = "5m"  # idle this long, and someone waits for GPUs: the idle action now
    keep_on_kernel_end = true  # a kernel's end suspends its cluster (any source that says true)
"""

from __future__ import annotations

import getpass
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ... import config, private
from ..errors import ClusterError
from . import registry

SYSTEM_FILE = Path("/etc/hvd_notebook/policy.toml")
MAX_FILE_BYTES = 64 * 1024  # a policy file is a few lines
IDLE_SUSPEND, IDLE_STOP = "suspend", "stop"  # idle_action's values, the looser first
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class PolicyError(ClusterError, ValueError):
    """A rule that cannot be read; says where it was and what to write instead."""


@dataclass(frozen=True)
class Policy:
    """The rules in force (None: no such rule); ``sources`` names where each was set."""

    max_gpus_per_user: int | None = None
    max_cpu_ranks_per_user: int | None = None
    max_lease_time: float | None = None  # seconds a cluster may run after it started
    idle_timeout: float | None = None  # seconds without a %%hvd cell before it is suspended or stopped
    idle_action: str = IDLE_SUSPEND  # what idle_timeout does: IDLE_SUSPEND or IDLE_STOP
    suspended_ttl: float | None = None  # seconds a suspended cluster's saved state is kept
    preempt_idle_after: float | None = None  # seconds idle after which a start waiting for GPUs takes them back
    keep_on_kernel_end: bool = False  # a kernel's end suspends its cluster (as %hvd start --keep asks)
    sources: tuple[tuple[str, str], ...] = ()  # (rule, where it was set), for messages

    def source(self, rule: str) -> str:
        """Where ``rule`` was set, for an error message.

        Args:
            rule: the rule's name.
        """
        return dict(self.sources).get(rule, "the node's policy")

    def describe(self) -> str:
        """``at most 2 GPUs per user, released after 30 min idle``; empty without rules."""
        parts = []
        if self.max_gpus_per_user is not None:
            parts.append(f"at most {self.max_gpus_per_user} GPU(s) per user")
        if self.max_cpu_ranks_per_user is not None:
            parts.append(f"at most {self.max_cpu_ranks_per_user} CPU rank(s) per user")
        ends = [f"stops after {format_duration(self.max_lease_time)}"] if self.max_lease_time is not None else []
        if self.idle_timeout is not None:
            idle = f"after {format_duration(self.idle_timeout)} without a %%hvd cell"
            suspends = self.idle_action == IDLE_SUSPEND
            ends.append(f"is suspended {idle}" if suspends else idle if ends else f"stops {idle}")
        if ends:
            parts.append("a cluster " + " or ".join(ends))
        if self.preempt_idle_after is not None:
            parts.append(f"an idle cluster gives its GPUs back after {format_duration(self.preempt_idle_after)} "
                         "when another start waits for them")
        if self.suspended_ttl is not None:
            parts.append(f"a suspended cluster is kept for {format_duration(self.suspended_ttl)}")
        return ", ".join(parts)

    def room(self, gpus: bool, asked: int | None) -> int | None:
        """How many GPUs (``gpus``) or CPU ranks a new cluster of this kernel may take beside the
        user's other clusters on this node (None: no cap); ``PolicyError`` naming those clusters
        where ``asked`` (or, with None, even one) is more than that.

        Args:
            gpus: whether the new cluster's ranks have GPUs.
            asked: the GPUs or ranks asked for, or None.
        """
        rule = "max_gpus_per_user" if gpus else "max_cpu_ranks_per_user"
        cap = getattr(self, rule)
        if cap is None:
            return None
        others = [c for c in registry.held_by(getpass.getuser(), besides=os.getpid()) if bool(c.gpus) == gpus]
        used = sum(len(c.gpus) if gpus else c.ranks for c in others)
        left = max(0, cap - used)
        if (asked or 1) <= left:
            return left
        what = "GPU(s)" if gpus else "CPU rank(s)"
        held = "; ".join(f"{c.cluster} (kernel {c.kernel}): " + (f"GPU {','.join(c.gpus)}" if gpus else
                                                                  f"{c.ranks} rank(s)") for c in others)
        wanted = f"-n {asked}" if asked is not None else "one rank per free GPU"
        advice = f"Start fewer ranks (-n {left}), or stop" if left else "Stop"
        raise PolicyError(
            f"{wanted} is more than you may have: this node allows {cap} {what} per user ({self.source(rule)}), "
            f"and your other clusters hold {used}" + (f": {held}" if held else "") + f". {advice} one of them "
            "(%hvd stop in its notebook; hvd-notebook list shows them all).")


_RULES = {"max_gpus_per_user": config.MAX_GPUS_PER_USER, "max_cpu_ranks_per_user": config.MAX_CPU_RANKS_PER_USER,
          "max_lease_time": config.MAX_LEASE_TIME, "idle_timeout": config.IDLE_TIMEOUT,
          "idle_action": config.IDLE_ACTION, "suspended_ttl": config.SUSPENDED_TTL,
          "preempt_idle_after": config.PREEMPT_IDLE_AFTER,
          "keep_on_kernel_end": config.KEEP_ON_KERNEL_END}  # each rule, its variable
_DURATIONS = ("max_lease_time", "idle_timeout", "suspended_ttl", "preempt_idle_after")


def parse_duration(value: object, where: str) -> float:
    """Seconds from ``90``, ``"90s"``, ``"30m"``, ``"8h"`` or ``"1d"``.

    Args:
        value: the rule's value.
        where: where it was set, for the error.
    """
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(value).lower())
    if isinstance(value, bool) or not match or float(match.group(1)) <= 0:
        raise PolicyError(f"{where}: {value!r} is not a duration; write seconds or a number with s, m, h or d, "
                          "e.g. \"30m\".")
    return float(match.group(1)) * _UNITS[match.group(2)]


def format_duration(seconds: float) -> str:
    """``30 min``, ``8 h``, ``45 s``.

    Args:
        seconds: the duration.
    """
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g} {unit}"
    return f"{seconds:g} s"


def _parse(rule: str, value: object, where: str) -> float | int | str | bool:
    if rule in _DURATIONS:
        return parse_duration(value, where)
    if rule == "keep_on_kernel_end":
        if str(value).lower() not in ("true", "false", "1", "0"):
            raise PolicyError(f"{where}: {value!r} is not true or false.")
        return str(value).lower() in ("true", "1")
    if rule == "idle_action":
        if value not in (IDLE_SUSPEND, IDLE_STOP):
            raise PolicyError(f"{where}: {value!r} is not an idle action; write \"{IDLE_SUSPEND}\" or \"{IDLE_STOP}\".")
        return str(value)
    try:
        count = int(str(value))
    except ValueError:
        count = -1
    if isinstance(value, bool) or count < 0:
        raise PolicyError(f"{where}: {value!r} is not a whole number of 0 or more.")
    return count


def _checked_text(path: Path) -> str:
    """The text of the policy file ``path``: a regular file of root's or this user's (not a link, a FIFO or a
    huge file), read through ``private.open_regular``; ``FileNotFoundError`` where there is none."""
    try:
        fd = private.open_regular(path, uid=-1, max_bytes=MAX_FILE_BYTES)
    except private.UnsafePathError as exc:
        raise PolicyError(f"The policy file {exc}: ask the node's admin to make it a plain file of root's.") from None
    with os.fdopen(fd, "rb") as f:
        owner = os.fstat(f.fileno()).st_uid
        if owner not in (0, os.geteuid()):
            raise PolicyError(f"The policy file {path} belongs to {private.user_name(owner)} (uid {owner}), not to "
                              "root or you, so it was not read: ask the node's admin to make it root's.")
        return f.read(MAX_FILE_BYTES + 1).decode(errors="replace")


def _read_file(path: Path, required: bool) -> dict[str, object]:
    try:
        rules = tomllib.loads(_checked_text(path))
    except FileNotFoundError:
        if not required:
            return {}
        raise PolicyError(f"The policy file {path} cannot be read (No such file or directory); ask the node's "
                          "admin.") from None
    except OSError as exc:
        raise PolicyError(f"The policy file {path} cannot be read ({exc.strerror}); ask the node's admin.") from None
    except tomllib.TOMLDecodeError as exc:
        raise PolicyError(f"The policy file {path} is not TOML: {exc}. Ask the node's admin to fix it.") from None
    unknown = sorted(set(rules) - set(_RULES))
    if unknown:
        raise PolicyError(f"The policy file {path} has unknown rule(s) {', '.join(unknown)}; the rules are "
                          f"{', '.join(_RULES)}.")
    return rules


def _tighter(value: float | int | str | bool, than: float | int | str | bool) -> bool:
    """Is ``value`` the tighter of a rule's two values (the smaller number; of idle actions, stop)?"""
    if isinstance(value, bool):  # (keep_on_kernel_end: any source that says true)
        return value and not than
    if isinstance(value, str):
        return (IDLE_SUSPEND, IDLE_STOP).index(value) > (IDLE_SUSPEND, IDLE_STOP).index(str(than))
    return value < than  # type: ignore[operator]


def load(environ: Mapping[str, str] | None = None, system_file: Path = SYSTEM_FILE) -> Policy:
    """The rules in force: the tightest of the system file, ``$HVD_NOTEBOOK_POLICY_FILE``'s and the
    environment's. ``PolicyError`` for a rule that cannot be read.

    Args:
        environ: the environment; None for this process's.
        system_file: the node's policy file.
    """
    environ = os.environ if environ is None else environ
    found: list[tuple[str, object, str]] = []  # (rule, value, where)
    named = config.POLICY_FILE.text(environ)
    files = [(system_file, False)] + ([(Path(named), True)] if named else [])  # (named: must be read)
    for path, required in files:
        found += [(rule, value, f"{path}: {rule}") for rule, value in _read_file(path, required).items()]
    found += [(rule, environ[env.name], f"${env.name}") for rule, env in _RULES.items() if environ.get(env.name)]
    chosen: dict[str, float | int | str | bool] = {}
    sources: dict[str, str] = {}
    for rule, value, where in found:
        parsed = _parse(rule, value, where)
        if rule not in chosen or _tighter(parsed, chosen[rule]):
            chosen[rule], sources[rule] = parsed, where
    return Policy(**chosen, sources=tuple(sorted(sources.items())))
