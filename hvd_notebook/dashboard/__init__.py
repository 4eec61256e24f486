"""The live dashboard of a ``%%hvd`` cell: a bar per rank, global samples/s,
ETA, loss and metric curves; text where no widget front end is there.

- (the update a rank publishes lives in ``hvd_notebook.messages``: both sides import it)
- ``model``: what the ranks' updates add up to (``ProgressModel``); ``curves``:
  each step's value from Keras' running means, and the smoothing; ``steps``: where the recent
  steps' time went (``StepTiming``)
- ``outputs``: each rank's stdout and stderr of the cell, for its tab
- ``text``, ``widget``: the two views; ``summary``: the static end state
- ``mode``: which view; ``live``: ``Dashboard``, one running cell's dashboard

Importing this package loads no display library; the widget view imports
ipywidgets and bqplot when it is made.
"""

from .live import Dashboard
from .mode import resolve_mode
from .model import ProgressModel, StepBreakdown
from .summary import static_bundle
from .text import TextView

__all__ = ["Dashboard", "ProgressModel", "StepBreakdown", "TextView", "resolve_mode", "static_bundle"]
