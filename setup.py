"""The one build step pyproject.toml cannot declare: ship ``hvd_notebook-horovod.pth`` into site-packages.

Its one line registers ``_hvd_notebook_horovod``'s finder at interpreter start, so that ``import
horovod.tensorflow`` gives hvd_notebook's runtime where no real Horovod is installed
(docs/coming-from-horovod.md). A regular build puts the file at the root of the wheel (site-packages);
an editable build (``pip install -e``) writes it where setuptools' ``install`` command puts the
library root of the editable wheel, which is where setuptools writes every non-editable file.
"""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PTH_NAME = "hvd_notebook-horovod.pth"  # sorts after __editable__.*.pth, whose finder it may need
PTH_LINE = "import _hvd_notebook_horovod; _hvd_notebook_horovod.install()\n"


class BuildPyWithPth(build_py):
    """``build_py`` that also writes the .pth file beside the packages."""

    def run(self) -> None:
        super().run()
        root = self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib
        Path(root).mkdir(parents=True, exist_ok=True)
        Path(root, PTH_NAME).write_text(PTH_LINE)

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        return outputs if self.editable_mode else [*outputs, str(Path(self.build_lib, PTH_NAME))]


setup(cmdclass={"build_py": BuildPyWithPth})
