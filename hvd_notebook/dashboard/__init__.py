"""The live dashboard of a ``%%hvd`` cell: a bar per rank, global samples/s,
ETA, loss and metric curves; text where no widget front end is there."""

from .dashboard import MODES, Board, Progress, TextView, WidgetView, resolve_mode, static_bundle

__all__ = ["MODES", "Board", "Progress", "TextView", "WidgetView", "resolve_mode", "static_bundle"]
