"""The build steps pyproject.toml cannot declare.

- ``hvd_notebook-horovod.pth`` into site-packages. Its one line registers ``_hvd_notebook_horovod``'s finder at
  interpreter start, so that ``import horovod.tensorflow`` gives hvd_notebook's runtime where no real Horovod
  is installed (docs/coming-from-horovod.md). A regular build puts the file at the root of the wheel
  (site-packages); an editable build (``pip install -e``) writes it where setuptools' ``install`` command puts
  the library root of the editable wheel, which is where setuptools writes every non-editable file.
- The JupyterLab panel, built from ``labextension/`` (npm, ``scripts/build-labextension.sh``) by every
  non-editable build and shipped in the wheel's data files (``share/jupyter/labextensions/hvd-notebook-lab``),
  so that ``pip install`` of the wheel is its whole install, with nothing pointing into a checkout. Its file list
  is computed once it is built (pyproject.toml's data-files globs are read before). An editable install leaves
  it to ``make install`` (scripts/ensure-labextension.sh links the build output).
"""

import subprocess
import sys
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build_py import build_py
from setuptools.errors import ExecError

PTH_NAME = "hvd_notebook-horovod.pth"  # sorts after __editable__.*.pth, whose finder it may need
PTH_LINE = "import _hvd_notebook_horovod; _hvd_notebook_horovod.install()\n"
ROOT = Path(__file__).resolve().parent
LAB_BUILD = Path("hvd_notebook", "lab", "labextension")  # relative to ROOT, as data_files takes it
LAB_DEST = "share/jupyter/labextensions/hvd-notebook-lab"


def labextension_data_files() -> list[tuple[str, list[str]]]:
    """``data_files`` entries for every file of the built panel (paths relative to ROOT), one per folder."""
    built = ROOT / LAB_BUILD
    entries = []
    for folder in [built, *sorted(p for p in built.rglob("*") if p.is_dir())]:
        files = sorted(p.relative_to(ROOT).as_posix() for p in folder.iterdir() if p.is_file())
        if files:
            entries.append(((Path(LAB_DEST) / folder.relative_to(built)).as_posix(), files))
    return entries


class BuildLabextension(Command):
    """Build the JupyterLab panel where its build is missing or stale, and add it to the wheel's data files."""

    description = "build the JupyterLab extension (npm) into hvd_notebook/lab/labextension and ship it"
    user_options: list = []

    def initialize_options(self) -> None:
        pass

    def finalize_options(self) -> None:
        pass

    def run(self) -> None:
        script = ROOT / "scripts" / "build-labextension.sh"
        if subprocess.run(["bash", str(script), sys.executable], cwd=ROOT).returncode != 0:
            raise ExecError("the JupyterLab panel did not build (the reason is above); a wheel is not built without it")
        if self.distribution.data_files is None:
            self.distribution.data_files = []
        self.distribution.data_files.extend(labextension_data_files())  # in place: install_data's list


class BuildPyWithPth(build_py):
    """``build_py`` that also writes the .pth file beside the packages, and builds the panel for a wheel."""

    def run(self) -> None:
        super().run()
        root = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        Path(root).mkdir(parents=True, exist_ok=True)
        Path(root, PTH_NAME).write_text(PTH_LINE)
        if not self.editable_mode:
            self.run_command("build_labextension")

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, str(Path(self.build_lib, PTH_NAME))]


setup(cmdclass={"build_py": BuildPyWithPth, "build_labextension": BuildLabextension})
