"""Progress of custom training loops for the ``%%hvd`` dashboard (public name).

>>> import hvd_notebook
>>> hvd_notebook.progress.report(step=10, total=100, epoch=0, epochs=3, loss=0.5)

``report`` is ``engine/custom_loops.report``; ``reporting()`` tells whether updates reach a dashboard now.
"""

from .engine.custom_loops import report
from .engine.reporter import reporting

__all__ = ["report", "reporting"]
