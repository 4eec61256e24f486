"""Progress of custom training loops for the ``%%hvd`` dashboard (public name).

>>> import hvd_notebook.progress
>>> hvd_notebook.progress.report(step=10, total=100, epoch=0, epochs=3, loss=0.5)

The reporter lives in ``hvd_notebook.engine.progress``; this name is that module.
"""

import sys

from .engine import progress as _progress

sys.modules[__name__] = _progress
