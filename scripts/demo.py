"""`make demo`: execute notebooks/01-quickstart.ipynb headless on 2 CPU ranks,
save the executed copy under build/, and print what a user wants to see.

``--out DIR`` saves it in DIR instead; where build/ cannot be written (a clone
that belongs to another user), it goes to $TMPDIR/hvd_notebook-demo-$USER/."""

from __future__ import annotations

import argparse
import getpass
import os
import re
import sys
import tempfile
import time
import uuid
from pathlib import Path

import nbformat
from jupyter_client.manager import KernelManager
from jupyter_core.paths import jupyter_runtime_dir
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "notebooks" / "01-quickstart.ipynb"
TARGET = ROOT / "build" / "01-quickstart.ipynb"


def writable(folder: Path) -> bool:
    """Whether ``folder`` can be written, or created in its nearest existing parent."""
    while not folder.exists():
        folder = folder.parent
    return os.access(folder, os.W_OK | os.X_OK)


def target(out: str | None) -> Path:
    """Where the executed notebook goes: ``out``, else build/, else (not writable) under $TMPDIR."""
    if out:
        return Path(out).resolve() / TARGET.name
    if writable(TARGET.parent):
        return TARGET
    return Path(tempfile.gettempdir()) / f"hvd_notebook-demo-{getpass.getuser()}" / TARGET.name


def shown(path: Path) -> str:
    """``path`` relative to the repository where it lies inside it (build/...), else in full."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def cell_text(cell: nbformat.NotebookNode) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif "data" in out:
            parts.append(out["data"].get("text/plain", ""))
    return "".join(parts)


def private_kernel() -> KernelManager:
    """The notebook's kernel on Unix sockets in the user's private Jupyter runtime folder (``ipc``, as the hub's
    kernels): over TCP, any local user could subscribe to its output on a loopback port (ipykernel warns so)."""
    runtime = Path(jupyter_runtime_dir())
    runtime.mkdir(mode=0o700, parents=True, exist_ok=True)
    return KernelManager(kernel_name="python3", transport="ipc",
                         connection_file=str(runtime / f"kernel-demo-{uuid.uuid4().hex}.json"))


def main() -> int:
    parser = argparse.ArgumentParser(description="make demo: run notebooks/01-quickstart.ipynb headless "
                                     "on 2 CPU ranks and print a summary.")
    parser.add_argument("--out", metavar="DIR", help="folder for the executed notebook (default: build/)")
    saved = target(parser.parse_args().out)
    os.environ.setdefault("HVD_NOTEBOOK_GPUS", "")  # the demo runs on CPU ranks
    nb = nbformat.read(SOURCE, as_version=4)
    client = NotebookClient(nb, timeout=600, km=private_kernel(), resources={"metadata": {"path": str(SOURCE.parent)}})
    print(f"Running {SOURCE.relative_to(ROOT)} on 2 CPU ranks ...", flush=True)
    t0 = time.perf_counter()
    failed = None
    try:
        client.execute()
    except CellExecutionError as exc:
        failed = exc
    wall = time.perf_counter() - t0
    saved.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, saved)

    text = "\n".join(cell_text(c) for c in nb.cells if c.cell_type == "code")
    table = re.search(r"Started \d+ MPI ranks[^\n]*\n((?:.+\n?)+?)(?:\n|$)", text)
    accuracies = re.findall(r"\[(\d+)\] test accuracy ([0-9.]+)", text)
    epochs = re.findall(r"^\[hvd_notebook\] fit epoch .*$", text, flags=re.M)  # the dashboard's text lines
    readings = re.findall(r"^\[hvd_notebook\] .*noise scale.*$", text, flags=re.M)  # the gradient noise scale, read

    print()
    if table:
        print(table.group(0).rstrip())
    if epochs:
        print("\n".join(epochs))
    if readings:
        print(readings[-1])
    for rank, acc in sorted(accuracies):
        print(f"rank {rank}: final test accuracy {float(acc):.3f}")
    print(f"wall time: {wall:.1f} s for the whole notebook")
    print(f"executed notebook: {shown(saved)}")
    if failed is not None:
        print(f"\nThe notebook failed:\n{failed}", file=sys.stderr)
        return 1
    if len(accuracies) != 2:
        print("\nThe notebook ran but did not report an accuracy for each rank.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
