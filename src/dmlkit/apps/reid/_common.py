"""Input checks and sizes shared by the re-id evaluation, re-ranking and VehicleID modules."""

from __future__ import annotations

from typing import Any

import numpy as np

from dmlkit.distances import dominant_offset, get_distance
from dmlkit.exceptions import ConfigError, NonFiniteError, ShapeError
from dmlkit.limits import MAX_THREADS
from dmlkit.validation import check_integer

METRICS = ("euclidean", "cosine", "dot")
DEFAULT_MEMORY_BUDGET = 256 * 2**20


# -- inputs ----------------------------------------------------------------------------
def _as_float(x: Any, name: str) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().float().numpy()
    arr = np.ascontiguousarray(np.asarray(x, dtype=np.float32))
    if arr.ndim != 2:
        raise ShapeError(f"{name} must be 2-D (N, D), got shape {arr.shape}")
    if not np.isfinite(arr.sum(dtype=np.float64)):  # NaN / inf propagate; no (N, D) mask
        raise NonFiniteError(f"{name} contain NaN or infinity: check the model's outputs")
    return arr


def _prepared(x: Any, metric: str, normalize: bool, name: str):
    """``x`` (a float32 tensor) as ``metric`` compares it, through the distances' own
    :meth:`~dmlkit.distances.BaseDistance.prepare`: L2-normalised (cosine, or ``normalize``;
    any float32 scale gives the same rows), or raw with a clear error where its products would
    overflow or all be subnormal."""
    return get_distance(metric, normalize_embeddings=normalize or metric == "cosine").prepare(x, name)


def _as_ids(x: Any, n: int, name: str, default: int | None = None) -> np.ndarray:
    if x is None:
        if default is None:
            raise ShapeError(f"{name} are required")
        return np.full(n, default, dtype=np.int64)
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    arr = np.asarray(x)
    if arr.ndim != 1 or arr.shape[0] != n:
        raise ShapeError(f"{name} must be 1-D with {n} entries, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ShapeError(f"{name} must be integers, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and arr.max() > np.iinfo(np.int64).max:  # would wrap
        raise ShapeError(f"{name} must fit in int64, got {int(arr.max())}: renumber them "
                         "(e.g. np.unique(ids, return_inverse=True)[1])")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _as_junk_ids(junk_ids: Any) -> np.ndarray:
    """``junk_ids`` (a sequence of integer ids, e.g. ``(-1,)`` or ``()``) as an int64 array;
    anything else (a bare int, a string, floats) is one :class:`ConfigError` naming the parameter."""
    accepts = "a sequence of integer ids such as (-1,), or () for none"
    try:
        values = None if isinstance(junk_ids, str | bytes) else np.asarray(list(junk_ids))
    except TypeError:  # not iterable: a bare int, None, a 0-d array
        values = None
    if values is None or values.ndim != 1 or values.size and (
            values.dtype == np.bool_ or not np.issubdtype(values.dtype, np.integer)):
        raise ConfigError(f"junk_ids must be {accepts}, got {junk_ids!r}")
    return values.astype(np.int64)


RERANK_KEYS = {"k1": "a positive integer", "k2": "a positive integer", "lambda_value": "a number in [0, 1]"}


def _rerank_params(rerank: Any) -> dict[str, Any] | None:
    """The k-reciprocal settings of ``rerank=`` (``None``/``False``/``{}``: no re-ranking;
    ``True``: the defaults; a dict of some of ``k1``, ``k2``, ``lambda_value``), checked: one :class:`ConfigError`
    naming the parameter, the value and what it accepts for anything else."""
    if isinstance(rerank, bool | np.bool_):
        return {} if rerank else None
    if rerank is None or rerank == {}:  # an empty dict re-ranks nothing, as it always did
        return None
    if not isinstance(rerank, dict):
        raise ConfigError(f"rerank must be True, False, None or a dict of k1, k2, lambda_value, got {rerank!r}")
    unknown = sorted(str(key) for key in rerank if key not in RERANK_KEYS)
    if unknown:
        raise ConfigError(f"rerank got unknown key(s) {', '.join(map(repr, unknown))}: "
                          f"it accepts {', '.join(RERANK_KEYS)}")
    for key, value in rerank.items():
        check_rerank_value(f"rerank[{key!r}]", key, value)
    return dict(rerank)


def check_rerank_value(name: str, key: str, value: Any) -> None:
    """One k-reciprocal setting (``k1``, ``k2``: positive integers; ``lambda_value``: a number in
    [0, 1]); :class:`ConfigError` naming ``name``, the value and what it accepts otherwise."""
    if key != "lambda_value":
        check_integer(value, name)
        return
    ok = isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool | np.bool_) \
        and 0.0 <= float(value) <= 1.0
    if not ok:
        raise ConfigError(f"{name} must be {RERANK_KEYS[key]}, got {value!r}")


RERANK_METRICS = ("euclidean", "cosine")


def check_rerank_metric(metric: str) -> None:
    """Re-ranking works on a distance: ``metric`` must be one of :data:`RERANK_METRICS`
    (:class:`ConfigError` otherwise; ``dot`` is a similarity)."""
    if metric not in RERANK_METRICS:
        raise ConfigError(f"re-ranking needs a distance: metric 'euclidean' or 'cosine', got {metric!r}")


def _check_metric(metric: str, name: str = "metric") -> None:
    if metric not in METRICS:
        raise ConfigError(f"{name} must be one of {', '.join(METRICS)}, got {metric!r}")


def _check_ap_mode(ap_mode: str) -> bool:
    if ap_mode not in ("standard", "trapezoid"):
        raise ConfigError(f"ap_mode must be 'standard' or 'trapezoid', got {ap_mode!r}")
    return ap_mode == "trapezoid"


def check_memory_budget(memory_budget: Any) -> int:
    """``memory_budget`` (bytes of working memory per block) as an ``int`` of at least 1:
    :func:`dmlkit.validation.check_integer`, else one :class:`ConfigError`. 0, -5, 0.5 or
    ``True`` were clamped to one row per block without a word (``dmlkit reid --memory-mb 0`` is
    refused). 1 byte is allowed: it means one query row per block."""
    return check_integer(memory_budget, "memory_budget", hint=" (bytes of working memory)")


def check_threads(threads: Any) -> int | None:
    """``threads`` as ``None`` (torch's thread count) or an ``int`` from 1 to
    :data:`dmlkit.limits.MAX_THREADS`, else one :class:`ConfigError` (``-1`` was taken as a
    count and ``0`` as "the default" without a word)."""
    if threads is None:
        return None
    return check_integer(threads, "threads", hint=" (None: torch's thread count)", most=MAX_THREADS)


def _block_rows(n_cols: int, memory_budget: int) -> int:
    return int(max(1, min(4096, memory_budget // max(1, 8 * n_cols))))


def _centred(query, gallery):
    """``(query, gallery)`` less the gallery's :func:`dmlkit.distances.dominant_offset`; as
    given (not copied) when it has none.

    Features sharing an offset of 100 in 128 dimensions (``|g|^2`` about 1.3e6, a float32
    spacing of 0.125) ranked squared distances of 0.7-0.9 at random (Rank-1 0.30 for 1.00)."""
    if gallery.shape[0] == 0:
        return query, gallery
    shift = dominant_offset(gallery)
    if not bool(shift.any()):  # rows without a dominating offset: exact as given
        return query, gallery
    return query - shift, gallery - shift


def _sq_norms(x, rows: int = 8192):
    """Row-wise squared norms, a chunk of rows at a time (no temporary as large as ``x``)."""
    import torch

    return torch.cat([(c * c).sum(1) for c in x.split(rows)]) if x.shape[0] else x.new_zeros(0)
