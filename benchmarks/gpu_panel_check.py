"""The JupyterLab panel's GPU reader on a real GPU (step 5 of gpu_check.sh): what the server extension reads
from NVML for the node's GPUs, and for a rank's process on one of them: its device's utilisation and memory,
and the memory the process holds there (a child process that holds 1 GiB of the GPU through PyTorch); a rank of a
job of ``hvd-notebook run``, which names no device, placed on that GPU by what it holds there.

    python benchmarks/gpu_panel_check.py OUT.json
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

HELD = 1 << 30
HOLDER = f"""
import sys, time, torch
x = torch.empty({HELD}, dtype=torch.uint8, device="cuda:0")
torch.cuda.synchronize()
print("holding", flush=True)
sys.stdin.read()
"""


def main(out: str) -> int:
    from hvd_notebook.lab.readings import Readings

    readings = Readings()
    devices = readings.nvml.devices()
    if devices is None:
        print("gpu_panel_check: NVML did not load (nvidia-ml-py missing, or no driver)", file=sys.stderr)
        return 1
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        time.sleep(1.0)
        rank = {"rank": 0, "pid": holder.pid, "host": socket.gethostname(), "device": "GPU 0", "here": True}
        first = readings._rank(rank, readings.nvml.devices())
        time.sleep(1.0)
        second = readings._rank(rank, readings.nvml.devices())
        script_rank = readings._rank({**rank, "device": ""}, readings.nvml.devices())  # a job's: found by NVML
        snapshot = readings.snapshot({})
    finally:
        holder.stdin.close()
        holder.wait(30)
    gpu = second["gpu"]
    checks = {
        "devices listed": len(devices) >= 1 and all(d["memory_total"] > 0 for d in devices),
        "the node's GPUs in the snapshot": snapshot["gpus"] is not None and len(snapshot["gpus"]) == len(devices),
        "the rank's GPU read": gpu is not None and gpu["index"] == 0 and isinstance(gpu["util"], int),
        "the rank's process holds >= 1 GiB there": gpu is not None and (gpu["process_memory"] or 0) >= HELD,
        "a script's rank placed on the GPU it holds memory on": script_rank["device"] == "GPU 0",
        "its CPU share read from the second reading": first["cpu_percent"] is None
        and second["cpu_percent"] is not None,
    }
    report = {"devices": [{k: d[k] for k in ("index", "name", "util", "memory_used", "memory_total")}
                          for d in devices], "rank": second, "checks": checks}
    json.dump(report, open(out, "w"), indent=2)
    for what, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
    print(f"GPU 0: {devices[0]['name']}, {gpu and gpu['util']} % busy, process memory "
          f"{(gpu or {}).get('process_memory')} bytes")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
