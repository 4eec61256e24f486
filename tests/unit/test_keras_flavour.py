"""keras_flavour: which Keras a process trains with, read as TensorFlow reads ``TF_USE_LEGACY_KERAS``, and what a
rank says where Keras 2 is asked for and ``tf_keras`` is missing (nothing here imports TensorFlow)."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_notebook import keras_flavour


def tensorflows_own_values() -> tuple[str, ...]:
    """The values of TF_USE_LEGACY_KERAS that TensorFlow's lazy loader of tf.keras takes, read from its source."""
    source = Path(importlib.util.find_spec("tensorflow").submodule_search_locations[0]) / "python" / "util" / \
        "lazy_loader.py"
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Compare) and "TF_USE_LEGACY_KERAS" in ast.unparse(node.left):
            return tuple(ast.literal_eval(node.comparators[0]))
    raise AssertionError("TensorFlow no longer reads TF_USE_LEGACY_KERAS in lazy_loader.py")


def test_reads_the_variable_exactly_as_tensorflow_does(monkeypatch):
    assert tuple(keras_flavour._LEGACY_VALUES) == tensorflows_own_values()
    for value, keras2 in (("1", True), ("true", True), ("True", True), ("yes", False), ("TRUE", False),
                          ("0", False), ("", False)):
        monkeypatch.setenv("TF_USE_LEGACY_KERAS", value)
        assert keras_flavour.keras2() is keras2, value
        assert keras_flavour.module_name() == ("tf_keras" if keras2 else "keras")
    monkeypatch.delenv("TF_USE_LEGACY_KERAS")
    assert not keras_flavour.keras2()


def test_label_names_the_installed_keras(monkeypatch):
    monkeypatch.delenv("TF_USE_LEGACY_KERAS", raising=False)
    assert keras_flavour.label() == f"Keras {importlib.metadata.version('keras')}"
    monkeypatch.setenv("TF_USE_LEGACY_KERAS", "1")
    assert keras_flavour.label() == f"Keras 2 (tf_keras {importlib.metadata.version('tf_keras')})"


def test_keras2_asked_without_tf_keras_says_what_to_install():
    # a process in which tf_keras does not import (as where it is not installed): the rank's bootstrap and the
    # runtime's Keras module both say so, and how to install it
    code = ("import sys; sys.modules['tf_keras'] = None\n"
            "from hvd_notebook import keras_flavour\n"
            "from hvd_notebook.engine import frameworks\n"
            "for call in (lambda: frameworks.resolve('auto'), keras_flavour.keras):\n"
            "    try:\n"
            "        call()\n"
            "    except (RuntimeError, ImportError) as exc:\n"
            "        print(type(exc).__name__, exc)\n")
    env = {"TF_USE_LEGACY_KERAS": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["RuntimeError", "ImportError"], out.stdout + out.stderr
    version = importlib.metadata.version("tensorflow-cpu")
    for line in lines:
        assert "asks for Keras 2, but the tf_keras package is not installed" in line
        assert f"pip install --no-deps tf_keras=={version}" in line and "unset TF_USE_LEGACY_KERAS" in line


@pytest.mark.parametrize("value, expected", [("1", "tf_keras"), ("0", "keras")])
def test_the_framework_label_of_a_tensorflow_rank_names_its_keras(monkeypatch, value, expected):
    from hvd_notebook.config import Framework
    from hvd_notebook.engine import frameworks

    monkeypatch.setenv("TF_USE_LEGACY_KERAS", value)
    label = frameworks.label(Framework.TENSORFLOW)
    assert label.startswith("tensorflow 2.") and label.endswith(keras_flavour.label()), label
    assert ("Keras 2 (tf_keras" in label) == (expected == "tf_keras")
    assert "Keras" not in frameworks.label(Framework.TORCH)
