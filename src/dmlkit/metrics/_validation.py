"""Input checks shared by the metrics: tensors, labels, finiteness and memory budgets."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dmlkit.exceptions import ConfigError, ShapeError
from dmlkit.validation import check_embeddings, check_labels

#: Default working-memory budget of the blockwise computations (bytes).
DEFAULT_MEMORY_BUDGET = 256 * 2**20


def as_embeddings(x: Any, name: str = "embeddings", first_row: int | None = None) -> torch.Tensor:
    """``x`` as a finite float32 ``(N, D)`` tensor: :func:`dmlkit.validation.check_embeddings`."""
    return check_embeddings(x, name, first_row)


def as_labels(y: Any, n: int, name: str = "labels") -> torch.Tensor:
    """``y`` as an int64 ``(n,)`` tensor on the CPU (:func:`dmlkit.validation.check_labels`;
    string labels become codes into their sorted names)."""
    return torch.from_numpy(check_labels(y, n, name)[0])


def as_label_pair(
    query_labels: Any, nq: int, reference_labels: Any | None, nr: int
) -> tuple[torch.Tensor, torch.Tensor | None, list[str] | None]:
    """Query and reference labels encoded together (string class names share one code table)."""
    ql, names = check_labels(query_labels, nq, "query labels")
    if reference_labels is None:
        return torch.from_numpy(ql), None, names
    rl, ref_names = check_labels(reference_labels, nr, "reference labels", class_names=names)
    if names is None and ref_names is not None:  # else integer ids meet codes of sorted names
        raise ShapeError("reference labels are class-name strings but the query labels are numbers: use the "
                         "same kind of labels for both")
    return torch.from_numpy(ql), torch.from_numpy(rl), ref_names


def check_budget(memory_budget: int) -> int:
    if not isinstance(memory_budget, int | np.integer) or memory_budget < 2**20:
        raise ConfigError(f"memory_budget must be an integer of at least 1 MiB (bytes), got {memory_budget!r}")
    return int(memory_budget)
