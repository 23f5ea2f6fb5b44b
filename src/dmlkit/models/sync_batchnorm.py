"""BatchNorm over the global batch of a distributed job, on GPUs and CPUs.

A BatchNorm layer that trains normalises with its batch's statistics; under
``DistributedDataParallel`` each rank would see only its share, so the model would differ from
a one-process run on the same global batch. :func:`convert_sync_batchnorm` replaces every
training BatchNorm layer by one whose statistics are those of the global batch:

* CUDA: PyTorch's :class:`torch.nn.SyncBatchNorm`.
* CPU (gloo): :class:`GlobalBatchNorm`, since ``torch.nn.SyncBatchNorm`` refuses CPU tensors.
  It all-reduces the per-channel sum (mean ``mu = sum x / N``) and then the sum of squared
  deviations (``var = sum (x - mu)^2 / N``, two passes, summed in float64 as one-process
  BatchNorm does on the CPU), both with
  :func:`dmlkit.distributed.all_reduce_with_grad` so the gradient flows through the statistics
  to every rank; the running variance uses the unbiased ``N / (N - 1)`` factor like
  ``torch.nn.BatchNorm`` (Ioffe & Szegedy, ICML 2015).

Frozen BatchNorm (:func:`dmlkit.models.freeze_batchnorm`, the Reality Check's setting) uses its
running statistics, needs no synchronisation, and is left as it is.
"""

from __future__ import annotations

import torch
from torch import nn

from dmlkit.distributed import all_reduce_with_grad, context
from dmlkit.models.embedder import _FrozenBNMixin

__all__ = ["GlobalBatchNorm", "convert_sync_batchnorm"]


class GlobalBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm (any of 1d/2d/3d) with statistics over every rank's batch; plain BatchNorm
    when no process group is running or in eval mode."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2-D input (got {input.dim()}-D input)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and context().enabled):
            return super().forward(x)
        dims = [0, *range(2, x.dim())]
        shape = (1, -1) + (1,) * (x.dim() - 2)
        local_n = torch.tensor([x.numel() // x.shape[1]], dtype=torch.float64, device=x.device)
        torch.distributed.all_reduce(local_n)
        n = float(local_n.item())
        # float64 sums, as one-process BatchNorm accumulates on the CPU
        mean = (all_reduce_with_grad(x.sum(dims, dtype=torch.float64)) / n).to(x.dtype)
        centred = x - mean.view(shape)
        var = (all_reduce_with_grad((centred * centred).sum(dims, dtype=torch.float64)) / n).to(x.dtype)
        if self.track_running_stats:
            with torch.no_grad():
                assert self.num_batches_tracked is not None
                self.num_batches_tracked.add_(1)
                m = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                     else self.momentum)
                unbiased = var * (n / max(n - 1.0, 1.0))
                self.running_mean.mul_(1 - m).add_(mean.detach().to(self.running_mean.dtype), alpha=m)
                self.running_var.mul_(1 - m).add_(unbiased.detach().to(self.running_var.dtype), alpha=m)
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.affine:
            y = y * self.weight.view(shape) + self.bias.view(shape)
        return y


def convert_sync_batchnorm(module: nn.Module, device: str | torch.device = "cpu") -> nn.Module:
    """Every training BatchNorm layer of ``module`` computes global-batch statistics (returns
    the converted module; state dicts stay compatible). Frozen BatchNorm is kept."""
    if torch.device(device).type == "cuda":
        return _convert(module, lambda bn: nn.SyncBatchNorm.convert_sync_batchnorm(bn))
    return _convert(module, _to_global)


def _to_global(bn: nn.modules.batchnorm._BatchNorm) -> nn.Module:
    new = GlobalBatchNorm(bn.num_features, bn.eps, bn.momentum, bn.affine, bn.track_running_stats)
    new.load_state_dict(bn.state_dict())
    new.train(bn.training)
    if bn.affine:
        new.weight.requires_grad_(bn.weight.requires_grad)
        new.bias.requires_grad_(bn.bias.requires_grad)
    return new.to(next(iter(bn.state_dict().values())).device) if bn.state_dict() else new


def _convert(module: nn.Module, make) -> nn.Module:
    """``module`` with every training BatchNorm replaced by ``make(bn)``. The replacement keeps
    a :func:`~dmlkit.models.mark_fresh_batchnorm` mark, so that ``freeze_batchnorm`` (called on
    the converted model) still leaves a fresh head's, neck's or random trunk's BatchNorm
    training: frozen after ``DistributedDataParallel`` was built, it would get no gradient."""
    if (isinstance(module, nn.modules.batchnorm._BatchNorm)
            and not isinstance(module, (_FrozenBNMixin, GlobalBatchNorm, nn.SyncBatchNorm))):
        new = make(module)
        if getattr(module, "_dmlkit_fresh_bn", False):
            new._dmlkit_fresh_bn = True
        return new
    for name, child in module.named_children():
        new = _convert(child, make)
        if new is not child:
            setattr(module, name, new)
    return module
