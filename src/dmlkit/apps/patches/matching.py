"""Matching two sets of patches (two images' keypoints): the n x m score matrix and mutual matches.

A 2-channel network must run once per pair (``n * m`` passes); networks with descriptors
describe each patch once (``n + m`` branch passes) and then score the ``n * m`` pairs from the
descriptors (a distance, or the small decision head of ``siam``-type networks). The
matches are the mutual nearest neighbours (each is the other's best), optionally filtered by
Lowe's ratio test (best / second-best distance, Lowe, IJCV 2004) for distance scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dmlkit.apps.patches.models import PatchNet, SiameseNet
from dmlkit.exceptions import ConfigError, NonFiniteError, ShapeError

__all__ = ["PatchMatches", "match_patches", "mutual_matches", "score_matrix"]


def _check_both_sets(n: int, m: int) -> None:
    """Both sets of a match hold patches: an empty one is a :class:`ShapeError` (``argmax`` over
    an empty row or column was a raw IndexError)."""
    if n == 0 or m == 0:
        raise ShapeError(f"both sets need patches, got {n} and {m}")


@torch.no_grad()
def score_matrix(model: PatchNet, a: torch.Tensor, b: torch.Tensor, batch_size: int = 2048) -> torch.Tensor:
    """Scores of every pair ``(a_i, b_j)``, float32 ``(n, m)``, higher = match.

    Memory: the descriptors plus one block of ``batch_size`` pairs (2-channel networks) or one
    row block of the matrix (decision heads).
    """
    model.eval()
    n, m = a.shape[0], b.shape[0]
    _check_both_sets(n, m)
    if getattr(model, "has_descriptor", False):
        side2 = 1 if isinstance(model, SiameseNet) and not model.shared else 0
        da = torch.cat([model.describe(a[i : i + batch_size], 0) for i in range(0, n, batch_size)])
        db = torch.cat([model.describe(b[i : i + batch_size], side2) for i in range(0, m, batch_size)])
        if model.kind == "descriptor":
            # the direct difference, not torch's |x|^2 + |y|^2 - 2 x.y shortcut (its cancellation
            # put a descriptor about 1e-3 from an exact copy of itself, which reorders near-ties in
            # the mutual matches and the ratio test)
            return -torch.cdist(da, db, compute_mode="donot_use_mm_for_euclid_dist")
        out = torch.empty(n, m, device=a.device)
        rows = max(1, batch_size // m)
        for i in range(0, n, rows):
            r = da[i : i + rows]
            out[i : i + rows] = model.decide(
                r.repeat_interleave(m, 0), db.repeat(r.shape[0], 1)
            ).reshape(r.shape[0], m)
        return out
    out = torch.empty(n * m, device=a.device)
    for s in range(0, n * m, batch_size):
        idx = torch.arange(s, min(s + batch_size, n * m), device=a.device)
        out[idx] = model.score(a[idx // m], b[idx % m]).float()
    return out.reshape(n, m)


@dataclass(frozen=True)
class PatchMatches:
    """Matched index pairs ``(i, j)`` into the two sets and their scores (higher = better)."""

    i: np.ndarray
    j: np.ndarray
    score: np.ndarray

    def __len__(self) -> int:
        return int(self.i.shape[0])


def mutual_matches(scores: torch.Tensor | np.ndarray, ratio: float | None = None) -> PatchMatches:
    """Mutual nearest neighbours of a score matrix (``argmax`` of row ``i`` is ``j`` and of column
    ``j`` is ``i``). With ``ratio`` (scores must be negative distances), keep a match only when
    ``best distance < ratio * second-best distance`` in its row (Lowe's ratio test)."""
    s = torch.as_tensor(scores, dtype=torch.float64)
    if s.dim() != 2:
        raise ShapeError(f"scores must be (n, m), got {tuple(s.shape)}")
    _check_both_sets(*s.shape)
    if not bool(torch.isfinite(s).all()):  # argmax takes NaN as the best score
        raise NonFiniteError(
            f"{int((~torch.isfinite(s)).sum())} score(s) are NaN or infinite: the network diverged; retrain it"
        )
    best_j = s.argmax(1)
    best_i = s.argmax(0)
    i = torch.arange(s.shape[0])
    keep = best_i[best_j] == i
    if ratio is not None:
        if not 0.0 < ratio <= 1.0:
            raise ConfigError(f"ratio must be in (0, 1], got {ratio}")
        if s.shape[1] < 2:
            raise ShapeError("the ratio test needs at least two candidates per row")
        if bool((s > 0).any()):
            raise ConfigError("the ratio test needs negative distances as scores (a descriptor network)")
        top2 = (-s).topk(2, dim=1, largest=False).values  # two smallest distances
        keep &= top2[:, 0] < ratio * top2[:, 1]
    ii = i[keep]
    jj = best_j[keep]
    return PatchMatches(ii.numpy(), jj.numpy(), s[ii, jj].numpy())


def match_patches(
    model: PatchNet, a: torch.Tensor, b: torch.Tensor, *, ratio: float | None = None, batch_size: int = 2048
) -> PatchMatches:
    """Match two sets of prepared patches: :func:`score_matrix` then :func:`mutual_matches`
    (``ratio``: Lowe's ratio test, for descriptor networks only: it compares distances)."""
    if ratio is not None and getattr(model, "kind", None) != "descriptor":
        raise ConfigError(
            f"the ratio test compares descriptor distances; {getattr(model, 'name', type(model).__name__)} "
            "is a decision network: match without ratio, or use a descriptor network (-l2, hardnet)"
        )
    return mutual_matches(score_matrix(model, a, b, batch_size), ratio)
