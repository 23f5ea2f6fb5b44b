"""Audit fixes of the distances: SNRDistance on rows sharing a large offset (float32 precision)
and the normalising distances' refusal of non-finite rows."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dmlkit.distances import (
    CosineSimilarity,
    DotProductSimilarity,
    LpDistance,
    SNRDistance,
)
from dmlkit.exceptions import NonFiniteError


def _snr_oracle(q: np.ndarray, r: np.ndarray) -> np.ndarray:
    """``Var(b - a) / Var(a)`` in float64, row pair by row pair."""
    q, r = q.astype(np.float64), r.astype(np.float64)
    return np.array([[np.var(b - a, ddof=1) / np.var(a, ddof=1) for b in r] for a in q])


@pytest.mark.parametrize("offset", [100.0, 250.0])
def test_snr_keeps_float32_precision_on_rows_sharing_an_offset(offset):
    """64-d float32 rows of ``offset + N(0, 1)`` were off by up to 1.3e-2 relative (the expanded
    form rounded with the offset) and reordered the top-5 neighbours; centred as LpDistance
    does, the error is float32 rounding."""
    rng = np.random.default_rng(0)
    q = (offset + rng.standard_normal((8, 64))).astype(np.float32)
    r = (offset + rng.standard_normal((50, 64))).astype(np.float32)
    expected = _snr_oracle(q, r)
    got = SNRDistance()(torch.from_numpy(q), torch.from_numpy(r)).double().numpy()
    assert np.abs(got - expected).max() / np.abs(expected).max() < 1e-6
    self_got = SNRDistance()(torch.from_numpy(r)).double().numpy()
    self_expected = _snr_oracle(r, r)
    assert np.abs(self_got - self_expected).max() / np.abs(self_expected).max() < 1e-6
    assert np.all(np.diag(self_got) == 0)


def test_snr_anchor_variance_stays_on_the_raw_rows():
    """The centring moves the rows by a vector that is not constant over the features, so the
    anchor's variance (the signal) must come from the rows as given."""
    rng = np.random.default_rng(1)
    shift = np.linspace(0.0, 500.0, 32)
    q = (shift + rng.standard_normal((4, 32))).astype(np.float32)
    r = (shift + rng.standard_normal((6, 32))).astype(np.float32)
    got = SNRDistance()(torch.from_numpy(q), torch.from_numpy(r)).double().numpy()
    expected = _snr_oracle(q, r)
    assert np.abs(got - expected).max() / np.abs(expected).max() < 1e-5


NORMALISING = [CosineSimilarity(), LpDistance(), LpDistance(p=1), LpDistance(power=2),
               DotProductSimilarity(), SNRDistance(normalize_embeddings=True)]


@pytest.mark.parametrize("distance", NORMALISING, ids=repr)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_normalising_distances_refuse_nonfinite_rows(distance, bad):
    """A NaN or infinite row normalised to NaN values (Lp p=2 even gave finite 0.0 entries)
    where every un-normalised distance raised NonFiniteError: now all of them raise it."""
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))
    x[1, 0] = bad
    clean = torch.randn(5, 3, generator=torch.Generator().manual_seed(1))
    with pytest.raises(NonFiniteError, match="query embeddings contain NaN or infinity"):
        distance(x, clean)
    with pytest.raises(NonFiniteError, match="reference embeddings contain NaN or infinity"):
        distance(clean, x)
    with pytest.raises(NonFiniteError, match="embeddings contain NaN or infinity"):
        distance(x)
    with pytest.raises(NonFiniteError, match="embeddings contain NaN or infinity"):
        distance.paired(x, clean[:4])
