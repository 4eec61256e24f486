"""Hosts: host lists, hostfiles, Slurm allocations, name resolution, and the
address the controller listens on for engines on other hosts.

Nothing here starts a process of the cluster; ``placement`` turns these into
where the ranks go.
"""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ...engine.bootstrap import address_towards
from ..errors import ClusterError


class HostError(ClusterError, ValueError):
    """A host list, hostfile or allocation that cannot work; the message says why."""


@dataclass(frozen=True)
class Host:
    """A host and how many ranks it takes."""

    name: str
    slots: int


def parse_hosts(spec: str) -> list[Host]:
    """``-H host1:4,host2:4`` (slots default to 1), as Open MPI and Horovod write it.

    >>> parse_hosts("node1:2,node2")
    [Host(name='node1', slots=2), Host(name='node2', slots=1)]

    Args:
        spec: the ``-H`` value.
    """
    hosts = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, sep, slots = item.rpartition(":") if ":" in item else (item, "", "1")
        if not name or not slots.isdigit() or int(slots) < 1:
            raise HostError(f"-H {spec!r}: {item!r} is not HOST or HOST:SLOTS (e.g. node1:4,node2:4).")
        hosts.append(Host(name, int(slots)))
    if not hosts:
        raise HostError(f"-H {spec!r} names no host; write e.g. -H node1:4,node2:4.")
    return _merge(hosts)


def read_hostfile(path: str) -> list[Host]:
    """A hostfile in MPICH's (``host:4``) or Open MPI's (``host slots=4``) form;
    ``#`` starts a comment.

    Args:
        path: the hostfile.
    """
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise HostError(f"--hostfile {path}: cannot read it ({exc.strerror}).") from None
    hosts = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = re.fullmatch(r"([^\s:]+)(?::(\d+))?(?:\s+slots\s*=\s*(\d+))?(?:\s+max_slots\s*=\s*\d+)?", line)
        if m is None or (m.group(2) and m.group(3)):
            raise HostError(f"--hostfile {path}, line {number}: {raw.strip()!r} is not 'HOST', 'HOST:SLOTS' "
                            "or 'HOST slots=SLOTS'.")
        slots = int(m.group(2) or m.group(3) or 1)
        if slots < 1:
            raise HostError(f"--hostfile {path}, line {number}: a host needs at least one slot.")
        hosts.append(Host(m.group(1), slots))
    if not hosts:
        raise HostError(f"--hostfile {path} lists no host.")
    return _merge(hosts)


def _merge(hosts: list[Host]) -> list[Host]:
    """One entry per host, slots added up, in first-seen order."""
    slots: dict[str, int] = {}
    for h in hosts:
        slots[h.name] = slots.get(h.name, 0) + h.slots
    return [Host(name, n) for name, n in slots.items()]


def check_slots(hosts: list[Host], n: int | None) -> int:
    """The number of ranks: ``n``, or every slot when None; too few slots is an error.

    Args:
        hosts: the hosts and their slots.
        n: the ranks asked for, or None.
    """
    total = sum(h.slots for h in hosts)
    if n is None:
        return total
    if n > total:
        listed = ",".join(f"{h.name}:{h.slots}" for h in hosts)
        raise HostError(f"-n {n} ranks but the hosts have only {total} slot(s) ({listed}). Give more slots "
                        f"(-H {hosts[0].name}:{-(-n // len(hosts))},...) or start fewer ranks (-n {total}).")
    return n


def resolve(host: str) -> str:
    """The IPv4 address of ``host``; a clear error where the name does not resolve.

    Args:
        host: a host name or address.
    """
    try:
        return socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except (socket.gaierror, IndexError, UnicodeError):
        raise HostError(f"host {host!r}: the name does not resolve here. Check the spelling, /etc/hosts or "
                        "DNS, or give its IP address.") from None


def is_this_host(host: str) -> bool:
    """Does ``host`` name this machine (loopback, its hostname, or one of its addresses)?

    Args:
        host: a host name or address.
    """
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        address = resolve(host)
    except HostError:
        return False
    return ipaddress.ip_address(address).is_loopback or address in local_addresses()


def local_addresses() -> set[str]:
    """This machine's IPv4 addresses (``ip -4 -o addr``; loopback included)."""
    ip = shutil.which("ip")
    if ip is None:
        return {"127.0.0.1"}
    try:
        out = subprocess.run([ip, "-4", "-o", "addr", "show"], capture_output=True, text=True, timeout=10).stdout
    except (subprocess.SubprocessError, OSError):
        return {"127.0.0.1"}
    return {m.group(1) for m in re.finditer(r"\binet (\d+\.\d+\.\d+\.\d+)/", out)} | {"127.0.0.1"}


def controller_address(hosts: list[str], requested: str | None) -> str:
    """The address the controller listens on so that engines on ``hosts`` reach it:
    ``--ip`` if given, else this machine's source address on the route to the
    first host that is not this machine, else loopback (every host is this one).

    Args:
        hosts: the engines' hosts.
        requested: ``--ip``, or None.
    """
    if requested:
        if requested not in local_addresses() and requested != "0.0.0.0":
            mine = ", ".join(sorted(local_addresses()))
            raise HostError(f"--ip {requested}: not an address of this machine ({mine}).")
        return requested
    for host in hosts:
        if is_this_host(host):
            continue
        address = resolve(host)
        try:
            return address_towards(address)
        except OSError as exc:
            raise HostError(f"host {host!r} ({address}): no route to it from here ({exc.strerror}).") from None
    return "127.0.0.1"


# ----------------------------------------------------------------- Slurm
def in_slurm_allocation() -> bool:
    """Does this process run inside a Slurm job (salloc/sbatch)?"""
    return bool(os.environ.get("SLURM_JOB_ID"))


def slurm_tasks() -> int | None:
    """The number of tasks of the allocation this process runs in (``-n`` default under Slurm)."""
    for key in ("SLURM_NTASKS", "SLURM_NPROCS"):
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return None


def slurm_nodes() -> list[str]:
    """Host names of the allocation (``scontrol show hostnames $SLURM_JOB_NODELIST``)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST") or ""
    if not nodelist:
        return []
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return [nodelist] if re.fullmatch(r"[\w.-]+", nodelist) else []
    try:
        out = subprocess.run([scontrol, "show", "hostnames", nodelist], capture_output=True, text=True,
                             timeout=20).stdout
    except (subprocess.SubprocessError, OSError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]
