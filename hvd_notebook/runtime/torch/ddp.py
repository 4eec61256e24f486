"""The gradient noise scale under ``torch.nn.parallel.DistributedDataParallel``: a communication hook.

DDP reduces gradients in its own buckets, outside Horovod's optimizer. ``NoiseScaleHook`` does what DDP's
default hook does (each bucket divided by the group's size, then summed over it) and, beside each bucket's
allreduce, one of the bucket's squared norm on this rank; when every bucket of a backward pass is back, the
step's two norms go to the estimator that ``hvd.noise_scale()`` reads (``core.noise_scale``).

>>> model = DDP(model)
>>> model.register_comm_hook(None, NoiseScaleHook())
>>> ...  # train
>>> hvd.noise_scale(batch_size=64)
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ..core import noise_scale
from ..core.noise_scale import NoiseScale


class NoiseScaleHook:
    """A DDP communication hook that averages gradients and measures the gradient noise scale.

    It is a hook for ``torch.nn.parallel.DistributedDataParallel``. It averages each gradient bucket as DDP's
    default hook does: divided by the group's size, then summed over the group. Beside each bucket's allreduce it
    reduces the bucket's squared norm. When every bucket of a backward pass is back, the step's two norms go to the
    estimator that ``hvd.noise_scale()`` reads. Where the measurement is off (``HVD_NOTEBOOK_NOISE_SCALE=0``, or one
    rank), it is DDP's default hook.

    >>> model = DDP(model)
    >>> model.register_comm_hook(None, NoiseScaleHook())
    >>> hvd.noise_scale(batch_size=64)

    It takes no argument. Register it with ``register_comm_hook(state, hook)``, where the state is the process
    group, or None for the default one.
    """

    def __init__(self) -> None:
        self.__name__ = self.__qualname__ = "noise_scale_hook"  # (DDP logs its hook by name)
        self.noise = NoiseScale()
        self._lock = threading.Lock()  # bucket callbacks run on the communication threads
        self._local_sq = self._global_sq = 0.0
        self._back = 0  # buckets of this backward pass reduced so far
        self._buckets: int | None = None  # buckets a backward pass has (known once the last one started)

    # (no annotations on the bucket and the result: DDP refuses a hook whose are not its own classes)
    def __call__(self, group: Any, bucket):  # noqa: ANN001, ANN204
        import torch.distributed as dist

        group = group if group is not None else dist.group.WORLD
        size = dist.get_world_size(group)
        buffer = bucket.buffer()
        if not noise_scale.enabled(size):  # DDP's default hook
            buffer.div_(size)
            return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda f: f.value()[0])
        local_sq = _squared(buffer).reshape(1)
        if bucket.is_last():
            self._buckets = bucket.index() + 1
        buffer.div_(size)
        reduced = dist.all_reduce(buffer, group=group, async_op=True).get_future()
        local = dist.all_reduce(local_sq, group=group, async_op=True).get_future()

        def back(_: Any) -> torch.Tensor:
            out = reduced.value()[0]
            self._bucket_back(float(local.value()[0]) / size, float(_squared(out)), size)
            return out

        return torch.futures.collect_all([reduced, local]).then(back)

    def _bucket_back(self, local_sq: float, global_sq: float, size: int) -> None:
        with self._lock:
            self._local_sq += local_sq
            self._global_sq += global_sq
            self._back += 1
            if self._back != self._buckets:
                return
            step = self._local_sq, self._global_sq
            self._local_sq = self._global_sq = 0.0
            self._back, self._buckets = 0, None  # (DDP may rebuild its buckets after the first pass)
        noise_scale.record(self.noise, *step, ranks=size)

    def noise_scale(self, batch_size: int) -> float | None:
        """Return the gradient noise scale measured through this hook.

        Args:
            batch_size: the samples per rank and step.

        Returns:
            The noise scale in samples, as a float, or None while there is no estimate.
        """
        return self.noise.value(batch_size)


def _squared(flat: torch.Tensor) -> torch.Tensor:
    flat = flat if flat.dtype == torch.float32 else flat.float()
    return torch.dot(flat, flat)


__all__ = ["NoiseScaleHook"]
