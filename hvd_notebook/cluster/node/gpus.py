"""The GPUs of this host, as the driver's command-line tool reports them.

The notebook kernel never creates a CUDA context, so it asks ``nvidia-smi``
rather than TensorFlow.
"""

from __future__ import annotations

import shutil
import subprocess

from ... import config
from ..errors import ClusterError


def detect_gpus() -> list[str]:
    """GPU ids on this host: ``$HVD_NOTEBOOK_GPUS`` if set, else ``nvidia-smi``'s list."""
    listed = config.GPUS.text()
    if listed is not None:
        return [g.strip() for g in listed.split(",") if g.strip()]
    out = _nvidia_smi("--query-gpu=index", "--format=csv,noheader")
    return [line.strip() for line in out.splitlines() if line.strip()]


def resolve_gpus(spec: str) -> list[str]:
    """Turn ``--gpus auto|none|0,1`` into the list of GPU ids to pin ranks to.

    Args:
        spec: ``--gpus``'s value.
    """
    spec = spec.strip()
    if spec == "auto":
        return detect_gpus()
    if spec == "none":
        return []
    ids = [g.strip() for g in spec.split(",")]
    if not ids or not all(g.isdigit() for g in ids) or len(set(ids)) != len(ids):
        raise ClusterError(
            f"--gpus {spec!r} is not valid: use auto, none, or distinct GPU ids such as 0,1."
        )
    return ids


def gpu_memory_by_pid() -> dict[int, int]:
    """Bytes of GPU memory each process holds on this host (empty where there is no GPU).
    Asked of the driver, so busy ranks need not answer."""
    return parse_gpu_memory(_nvidia_smi("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"))


def parse_gpu_memory(csv_text: str) -> dict[int, int]:
    """``nvidia-smi --query-compute-apps=pid,used_memory`` output (MiB) as pid -> bytes.

    Args:
        csv_text: nvidia-smi's output.
    """
    used: dict[int, int] = {}
    for line in csv_text.splitlines():
        pid, _, mib = line.partition(",")
        if pid.strip().isdigit() and mib.strip().isdigit():
            used[int(pid)] = used.get(int(pid), 0) + int(mib) * 2**20
    return used


def _nvidia_smi(*args: str) -> str:
    """What ``nvidia-smi ARGS`` prints; empty where there is no driver (or it fails)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ""
    try:
        return subprocess.run([smi, *args], capture_output=True, text=True, timeout=20, check=True).stdout
    except (subprocess.SubprocessError, OSError):
        return ""
