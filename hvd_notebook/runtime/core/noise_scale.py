"""The gradient noise scale, measured while data-parallel training runs.

McCandlish, Kaplan, Amodei et al., "An Empirical Model of Large-Batch Training" (2018), Appendix A.1.
Each step of data-parallel training holds two gradient estimates of one true gradient G: each rank's
own, over its batch ``B_small``, and their average over the ``n`` ranks, over ``B_big = n * B_small``.
With ``|G_small|^2`` the mean over ranks of each rank's squared norm and ``|G_big|^2`` the squared norm
of the average,

    |G|^2   ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(S)   ~ (|G_small|^2 - |G_big|^2) / (1/B_small - 1/B_big)

are unbiased, and the simple noise scale ``B_simple = tr(S) / |G|^2`` estimates the critical batch
size: the global batch beyond which more ranks stop paying off. As the paper advises, the two estimates
are averaged over steps (here exponential moving averages, bias-corrected as Adam's) and then divided.

The bindings compute the two squared norms where the gradients live (a GPU's stay on the GPU), reduce
the local one with the gradients' own allreduce, and ``record`` them here once per optimizer step.
This module is framework-free: it takes plain numbers.
"""

from __future__ import annotations

import math
import warnings

from ... import config


def enabled(ranks: int) -> bool:
    """Measure where gradients are averaged over at least 2 ranks, unless ``HVD_NOTEBOOK_NOISE_SCALE=0``."""
    return ranks >= 2 and config.NOISE_SCALE.flag()


class NoiseScale:
    """Moving averages of ``|G|^2`` and ``tr(S)`` over optimizer steps, and their ratio ``B_simple``.

    >>> ns = NoiseScale()
    >>> ns.record(local_sq=3.0, global_sq=2.0, ranks=2, batch=32)
    >>> round(ns.value())
    64

    ``batch`` is a rank's samples per backward pass, ``passes`` the passes accumulated into one step's
    gradient: ``B_small = batch * passes``. Where the optimizer cannot tell the batch (a custom loop), the
    estimate is kept per sample of batch and ``value(batch_size)`` takes it then.
    """

    def __init__(self, decay: float | None = None) -> None:
        self._decay = decay  # None: HVD_NOTEBOOK_NOISE_SCALE_DECAY, read at each step
        self.steps = 0
        self._signal = 0.0  # moving average of |G|^2
        self._noise = 0.0  # moving average of tr(S) (in units of the batch where it was not known)
        self._weight = 0.0  # 1 - decay**steps: Adam's bias correction
        self.batch: int | None = None  # the last batch recorded, where known
        self.passes = 1
        self.ranks = 0

    def record(self, local_sq: float, global_sq: float, ranks: int, batch: int | None = None,
               passes: int = 1) -> None:
        """One optimizer step: ``local_sq`` the mean over the ``ranks`` of each one's squared gradient
        norm, ``global_sq`` the squared norm of their average. A step whose norms are not finite (a
        skipped loss-scaling step) is left out."""
        if ranks < 2 or not (math.isfinite(local_sq) and math.isfinite(global_sq)):
            return
        b_small = float(batch * passes if batch else 1)  # (unknown: per sample of B_small, see value)
        b_big = ranks * b_small
        signal = (b_big * global_sq - b_small * local_sq) / (b_big - b_small)
        noise = (local_sq - global_sq) / (1.0 / b_small - 1.0 / b_big)
        d = self.decay()
        self._signal = d * self._signal + (1 - d) * signal
        self._noise = d * self._noise + (1 - d) * noise
        self._weight = d * self._weight + (1 - d)
        self.steps += 1
        self.batch, self.passes, self.ranks = batch, passes, ranks

    def decay(self) -> float:
        d = float(config.NOISE_SCALE_DECAY.number()) if self._decay is None else self._decay
        if not 0 <= d < 1:
            raise ValueError(f"{config.NOISE_SCALE_DECAY.name}={d}: the decay is a number in [0, 1), e.g. 0.99.")
        return d

    @property
    def needs_batch(self) -> bool:
        """Its steps did not say their batch (a custom loop): ``value`` needs it."""
        return self.steps > 0 and self.batch is None

    def gradient_sq(self) -> float | None:
        """The averaged estimate of ``|G|^2``."""
        return self._signal / self._weight if self.steps else None

    def value(self, batch_size: int | None = None) -> float | None:
        """``B_simple`` in samples; None before the first step, where the batch is unknown, or while the
        averaged ``|G|^2`` is not positive (the gradient is still lost in its noise)."""
        if not self.steps or self._signal <= 0:
            return None
        if self.batch is not None:
            return self._noise / self._signal
        if batch_size is None:
            return None
        return batch_size * self.passes * self._noise / self._signal


_latest: NoiseScale | None = None
_told_batch: int | None = None  # the samples per rank and pass that the loop told (``tell_batch``)
_said_it_needs_the_batch = False
NEEDS_THE_BATCH = ("hvd.noise_scale() is None: the optimizer cannot tell the batch size in this loop. Pass it, "
                   "hvd.noise_scale(batch_size=32) (the samples per rank and backward pass), or tell it to the "
                   "dashboard once, hvd_notebook.progress.report(..., batch_size=32), and it is used from then on.")


def latest() -> NoiseScale | None:
    """The estimator that recorded last in this process (each distributed optimizer or tape has its own)."""
    return _latest


def record(estimator: NoiseScale, local_sq: float, global_sq: float, ranks: int, batch: int | None = None,
           passes: int = 1) -> None:
    """``estimator.record(...)``, and it becomes the one ``hvd.noise_scale()`` reads."""
    global _latest
    estimator.record(local_sq, global_sq, ranks, batch, passes)
    _latest = estimator


def tell_batch(batch_size: int) -> None:
    """The samples per rank and backward pass of the loop that trains, as it told them to the dashboard
    (``hvd_notebook.progress.report(batch_size=...)``): ``noise_scale()`` takes them where the optimizer
    cannot tell."""
    global _told_batch
    _told_batch = int(batch_size)


def noise_scale(batch_size: int | None = None) -> float | None:
    """Return the gradient noise scale measured by the distributed optimizer or tape that stepped last.

    The noise scale ``B_simple`` estimates the critical batch size, in samples: the global batch beyond which more
    ranks stop paying off (McCandlish et al. 2018). It is measured on each step of a ``DistributedOptimizer``, a
    ``DistributedGradientTape`` or a ``NoiseScaleHook``, and averaged over steps.

    Args:
        batch_size: the samples per rank and backward pass. Needed only where the optimizer cannot tell the batch
            size: ``DistributedGradientTape``, PyTorch's ``DistributedOptimizer`` and ``NoiseScaleHook``, unless
            the loop told it to the dashboard (``hvd_notebook.progress.report(batch_size=...)``). Keras's ``fit``
            tells it, and then this argument is ignored. Defaults to None.

    Returns:
        The noise scale in samples, as a float. None before a step has run on at least 2 ranks, where the batch size
        is needed but not known (said once, with what to do), or while the averaged gradient is still lost in its
        noise.
    """
    global _said_it_needs_the_batch
    estimator = latest()
    if estimator is None:
        return None
    batch = batch_size if batch_size is not None else _told_batch
    if estimator.needs_batch and batch is None:
        if not _said_it_needs_the_batch:
            _said_it_needs_the_batch = True
            warnings.warn(NEEDS_THE_BATCH, stacklevel=2)
        return None
    return estimator.value(batch)
