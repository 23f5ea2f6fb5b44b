"""Input checks shared by the metrics: tensors, labels, finiteness and memory budgets."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dmlkit.exceptions import ConfigError, NonFiniteError, ShapeError

#: Default working-memory budget of the blockwise computations (bytes).
DEFAULT_MEMORY_BUDGET = 256 * 2**20


def as_embeddings(x: Any, name: str = "embeddings") -> torch.Tensor:
    """``x`` as a finite float32 ``(N, D)`` tensor (numpy arrays and tensors accepted)."""
    if isinstance(x, torch.Tensor):
        t = x.detach()
    else:
        try:
            t = torch.from_numpy(np.ascontiguousarray(np.asarray(x)))
        except TypeError as exc:
            raise ShapeError(f"{name} must be a numeric (N, D) array, got {type(x).__name__}") from exc
    if t.dim() != 2:
        raise ShapeError(f"{name} must be 2-D (N, D), got shape {tuple(t.shape)}")
    if not (t.dtype.is_floating_point or t.dtype in (torch.int32, torch.int64, torch.int16, torch.uint8)):
        raise ShapeError(f"{name} must hold numbers, got dtype {t.dtype}")
    t = t.to(torch.float32)
    if t.shape[0] == 0 or t.shape[1] == 0:
        raise ShapeError(f"{name} is empty (shape {tuple(t.shape)}): pass at least one row and column")
    if not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).any(dim=1).sum())
        raise NonFiniteError(
            f"{name} contain NaN or infinity in {bad} row(s): check the model output "
            "(e.g. a diverged training run) and drop or fix those rows before evaluating"
        )
    return t.contiguous()


def as_labels(y: Any, n: int, name: str = "labels") -> torch.Tensor:
    """``y`` as an int64 ``(n,)`` tensor on the CPU."""
    if isinstance(y, torch.Tensor):
        t = y.detach().cpu()
    else:
        arr = np.asarray(y)
        if arr.dtype.kind not in "iub":
            if arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
                arr = arr.astype(np.int64)
            else:
                raise ShapeError(f"{name} must be integers, got dtype {arr.dtype}")
        t = torch.from_numpy(np.ascontiguousarray(arr))
    if t.dtype.is_floating_point:
        if not bool(torch.all(t == t.round())):
            raise ShapeError(f"{name} must be integers, got non-integral floats")
    t = t.to(torch.int64)
    if t.dim() != 1 or t.shape[0] != n:
        raise ShapeError(f"{name} must have shape ({n},) to match the embeddings, got {tuple(t.shape)}")
    return t


def check_budget(memory_budget: int) -> int:
    if not isinstance(memory_budget, int | np.integer) or memory_budget < 2**20:
        raise ConfigError(f"memory_budget must be an integer of at least 1 MiB (bytes), got {memory_budget!r}")
    return int(memory_budget)
