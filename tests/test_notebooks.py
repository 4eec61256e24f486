"""The example notebooks run top to bottom headless, as `make demo` runs them,
and reach the figures they promise."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
from conftest import cluster_processes
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def test_quickstart_trains_on_two_ranks():
    before = cluster_processes()
    nb = nbformat.read(NOTEBOOKS / "01-quickstart.ipynb", as_version=4)
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code"), "committed with outputs"
    NotebookClient(nb, timeout=600, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    text = "".join(
        out.get("text", "") + out.get("data", {}).get("text/plain", "")
        for c in nb.cells if c.cell_type == "code" for out in c.outputs
    )
    assert "Started 2 MPI ranks (hvd: builtin)." in text
    assert "[0] rank 0 of 2: " in text and "[1] rank 1 of 2: " in text
    accuracies = {int(r): float(a) for r, a in re.findall(r"\[(\d)\] test accuracy ([0-9.]+)", text)}
    assert set(accuracies) == {0, 1}
    assert all(a > 0.85 for a in accuracies.values()), accuracies
    assert accuracies[0] == accuracies[1]  # different seeds, one model: the broadcast and the optimizer worked
    assert "Cluster stopped." in text
    assert cluster_processes() <= before
