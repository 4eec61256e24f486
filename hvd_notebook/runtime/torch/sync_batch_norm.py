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
    """Drop-in for ``torch.nn.BatchNorm1d/2d/3d`` (any input of shape (N, C, ...))."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm expects an input of at least 2 dimensions (N, C, ...), not "
                             f"{input.dim()}.")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
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
