"""``hvd.SyncBatchNorm``: batch normalisation whose statistics are those of the global batch.

In training, each rank's per-channel sum, sum of squares and count are summed over the ranks with
one differentiable allreduce (its gradient is the same allreduce of the gradient), so the backward
pass is synchronised too; the running statistics are updated from the global ones. In evaluation
(or on one rank) it is ``BatchNorm`` as it is.
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from ..core import world as _world
from ..core.ops import Sum
from .mpi_ops import allreduce


class SyncBatchNorm(_BatchNorm):
    """Batch normalization with the statistics of the batch of all ranks, for inputs of shape ``(N, C, ...)``.

    It is a drop-in for ``torch.nn.BatchNorm1d``, ``BatchNorm2d`` and ``BatchNorm3d``. In training, each rank's
    per-channel sum, sum of squares and count are summed over the ranks by one differentiable allreduce, so the
    backward pass is synchronised too. The running statistics are updated from the global ones. In evaluation, or on
    one rank, it is ``BatchNorm`` as it is.

    >>> model = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3), hvd.SyncBatchNorm(16))

    Args:
        num_features: the number of channels, ``C`` of an input of shape ``(N, C, ...)``.
        eps: added to the variance for numerical stability. Defaults to 1e-5.
        momentum: the weight of each batch in the running statistics. None keeps a cumulative average. Defaults to
            0.1.
        affine: learn a per-channel weight and bias. Defaults to True.
        track_running_stats: keep running statistics for evaluation. Defaults to True.
        device: the device of the layer's parameters and buffers. Defaults to None.
        dtype: the dtype of the layer's parameters and buffers. Defaults to None.
    """

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of at least 2 dimensions (N, C, ...), not "
                             f"{input.dim()}.")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """Normalize ``input`` with the global batch's statistics in training, or as ``BatchNorm`` otherwise.

        A collective call in training: every rank runs it with the same number of channels.

        Args:
            input: a tensor of shape ``(N, C, ...)``, of at least 2 dimensions.

        Returns:
            The normalized tensor, of ``input``'s shape.

        Raises:
            ValueError: ``input`` has fewer than 2 dimensions, or the runtime is not initialised.
            CollectiveMismatchError: the ranks' allreduces do not match, such as different channel counts.
            StallError: the allreduce cannot complete: a rank it waits for has shut down, or the wait passed
                ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        """
        self._check_input_dim(input)
        if not self.training or _world.current().size == 1:
            return super().forward(input)
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        count = torch.tensor([input.numel() / channels], dtype=input.dtype, device=input.device)
        local = torch.cat([input.sum(dims), (input * input).sum(dims), count])
        total = allreduce(local, op=Sum, name=None)
        n = total[-1]
        mean = total[:channels] / n
        var = total[channels:2 * channels] / n - mean * mean
        if self.track_running_stats and self.running_mean is not None:
            with torch.no_grad():
                self.num_batches_tracked += 1
                momentum = (1.0 / float(self.num_batches_tracked)) if self.momentum is None else self.momentum
                self.running_mean.mul_(1 - momentum).add_(mean.detach() * momentum)
                unbiased = var.detach() * (n.detach() / (n.detach() - 1).clamp(min=1))
                self.running_var.mul_(1 - momentum).add_(unbiased * momentum)
        shape = [1, channels] + [1] * (input.dim() - 2)
        out = (input - mean.reshape(shape)) * torch.rsqrt(var.reshape(shape) + self.eps)
        if self.affine:
            out = out * self.weight.reshape(shape) + self.bias.reshape(shape)
        return out


__all__ = ["SyncBatchNorm"]
