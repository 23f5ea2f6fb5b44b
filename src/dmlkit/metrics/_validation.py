"""Input checks shared by the metrics: tensors, labels, finiteness and memory budgets."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dmlkit.exceptions import ConfigError
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


#: Odd 64-bit weights of :func:`row_hashes` (fixed: hashes compare across calls and blocks).
_HASH_WEIGHTS = np.random.default_rng(0x5EED).integers(1, 2**62, size=4096, dtype=np.int64) * 2 + 1


def row_hashes(x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """A 64-bit hash of each row's bits (int64, on ``x``'s device): ``sum_t w_t bits_t`` modulo
    ``2^64`` with fixed random odd weights, ``rows`` rows at a time (by default 8 MB of int64
    products). Identical rows hash alike; two different rows collide with probability about
    ``2^-64``. 0.65 s for 10^6 x 128 on one EPYC core."""
    d = x.shape[1]
    rows = rows or max(1, 2**20 // max(1, d))
    weights = torch.from_numpy(_HASH_WEIGHTS[np.arange(d) % _HASH_WEIGHTS.size]).to(x.device)
    bits = x.contiguous().view(torch.int32)
    return torch.cat([(bits[a:a + rows].to(torch.int64) * weights).sum(dim=1)
                      for a in range(0, x.shape[0], rows)] or [torch.empty(0, dtype=torch.int64)])


def shared_rows_warning(query_hashes: torch.Tensor, reference_hashes: torch.Tensor) -> str | None:
    """The warning for query rows that also appear, bit for bit, in a separate reference set
    (``None`` if none does): each then retrieves its own copy first, at distance 0."""
    shared = int(torch.isin(query_hashes, reference_hashes.to(query_hashes.device)).sum())
    if shared == 0:
        return None
    return (f"{shared:,} of the {query_hashes.numel():,} query embeddings also appear, identical, in the "
            "reference set: each retrieves its own copy first (at distance 0), which inflates the metrics "
            "when it is the same item; take them out of the reference set, or leave the reference out "
            "(reference=None; no --reference) to exclude each query from its own neighbours")


def check_budget(memory_budget: int) -> int:
    if not isinstance(memory_budget, int | np.integer) or memory_budget < 2**20:
        raise ConfigError(f"memory_budget must be an integer of at least 1 MiB (bytes), got {memory_budget!r}")
    return int(memory_budget)
