"""The Horovod-compatible runtime that ``%%hvd`` cells call ``hvd``.

Its API contract is ``horovod.tensorflow``: the same names, arguments and
defaults, so cell code written for Horovod runs unchanged. It also works in a
plain script started with ``mpiexec -n 2 python train.py``.

    import hvd_notebook.runtime as hvd
    hvd.init()
    total = hvd.allreduce(np.ones(3), op=hvd.Sum)   # array([2., 2., 2.]) on 2 ranks

Cut as Horovod's own (docs/architecture.md): ``core`` (``horovod/common``: framework-free, numpy and cupy),
and the bindings on it: ``tensorflow`` (``horovod.tensorflow``, whose API this package re-exports), ``keras``
(``horovod.tensorflow.keras``, ``horovod.keras``) and ``torch`` (``horovod.torch``).
"""

from .tensorflow import *  # noqa: F403 (the TensorFlow binding's API; its __all__ leaves out LAZY_NAMES)
from .tensorflow import LAZY_NAMES as _LAZY_NAMES
from .tensorflow import __all__ as _api
from .tensorflow import __getattr__ as __getattr__  # the Keras names, imported when first used
from .tensorflow import _executing_eagerly as _executing_eagerly  # Horovod's tests import this private name

__all__ = [*_api, *_LAZY_NAMES]
