"""Inference: embed a dataset with a trained model, in batches, without gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dmlkit.exceptions import NonFiniteError

__all__ = ["embed", "resolve_device"]


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; asking for CUDA without one is an error."""
    from dmlkit.exceptions import ConfigError

    if isinstance(device, torch.device):
        return device
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("training.device is 'cuda' but no CUDA GPU is available: use 'auto' or 'cpu'")
    return torch.device(device)


@torch.no_grad()
def embed(
    model: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    dataset: Dataset,
    batch_size: int = 256,
    device: str | torch.device | None = "auto",
    *,
    num_workers: int = 0,
    amp: bool = False,
    progress: bool = False,
    desc: str = "embed",
) -> tuple[np.ndarray, np.ndarray]:
    """``(embeddings float32 (N, D), labels int64 (N,))`` of every sample of ``dataset``, in order.

    ``model`` is put in eval mode (and restored afterwards). ``amp`` uses ``torch.autocast`` on
    CUDA only. Labels are the dataset's own (original) class ids.
    """
    dev = resolve_device(device)
    was_training = getattr(model, "training", False)
    if isinstance(model, nn.Module):
        model.eval()
        model.to(dev)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers,
                        pin_memory=dev.type == "cuda")
    out: list[np.ndarray] = []
    labels: list[np.ndarray] = []
    iterator: Any = loader
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(loader, desc=desc, leave=False)
    use_amp = amp and dev.type == "cuda"
    try:
        for x, y in iterator:
            x = x.to(dev, non_blocking=True)
            with torch.autocast(device_type=dev.type, enabled=use_amp):
                e = model(x)
            out.append(e.float().cpu().numpy())
            labels.append(np.asarray(y, dtype=np.int64))
    finally:
        if isinstance(model, nn.Module) and was_training:
            model.train()
    if not out:
        return np.zeros((0, 0), dtype=np.float32), np.zeros((0,), dtype=np.int64)
    emb = np.concatenate(out).astype(np.float32, copy=False)
    if not np.isfinite(emb).all():
        raise NonFiniteError("the model produced NaN/inf embeddings: the checkpoint is likely diverged")
    return emb, np.concatenate(labels).astype(np.int64, copy=False)
