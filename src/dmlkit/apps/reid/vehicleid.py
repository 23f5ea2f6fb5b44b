"""The VehicleID evaluation protocol: one random gallery image per identity, repeated.

Liu, Tian, Wang, Huang, "Deep Relative Distance Learning: Tell the Difference Between Similar
Vehicles", CVPR 2016, Sec. 5: for a test set of ``N`` identities (800 / 1,600 / 2,400), one
image of every identity is drawn at random into the gallery and all the other images are
queries; a query is matched within rank ``k`` when its identity's gallery image is among its
``k`` nearest gallery images (so Recall@k = CMC(k) with exactly one positive per query). The
draw is repeated (``repeats``, 10 by convention) and Recall@k is reported as mean ± standard
deviation over the draws. The paper's numbers (VGG+CCL, 800/1600/2400): Recall@1 0.49 / 0.43 /
0.38, Recall@5 0.73 / 0.67 / 0.62.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dmlkit.apps.reid._common import DEFAULT_MEMORY_BUDGET, _as_float, _as_ids
from dmlkit.apps.reid.evaluation import evaluate_reid
from dmlkit.exceptions import ConfigError, DataError
from dmlkit.validation import check_integer, check_seed

__all__ = ["VehicleIDResult", "draw_gallery", "vehicleid_protocol"]


@dataclass(frozen=True)
class VehicleIDResult:
    """Recall@k per draw (``values[k]``: one entry per repeat), mAP per draw, and the setup."""

    values: dict[int, list[float]]
    map_values: list[float]
    num_identities: int
    num_queries: int
    repeats: int
    seed: int

    def mean(self, k: int) -> float:
        return float(np.mean(self.values[k]))

    def std(self, k: int) -> float:
        return float(np.std(self.values[k]))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, vals in self.values.items():
            out[f"recall_at_{k}"] = {"mean": self.mean(k), "std": self.std(k), "values": vals}
        out["map"] = {"mean": float(np.mean(self.map_values)),
                      "std": float(np.std(self.map_values)), "values": self.map_values}
        out.update(num_identities=self.num_identities, num_queries=self.num_queries,
                   repeats=self.repeats, seed=self.seed)
        return out


def draw_gallery(ids: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Boolean mask: one uniformly drawn item of every identity (the gallery of one draw)."""
    order = rng.permutation(ids.size)
    _, first = np.unique(ids[order], return_index=True)  # first occurrence in a random order
    mask = np.zeros(ids.size, dtype=bool)
    mask[order[first]] = True
    return mask


def vehicleid_protocol(
    embeddings: Any,
    ids: Any,
    *,
    repeats: int = 10,
    seed: int = 0,
    ks: Sequence[int] = (1, 5),
    metric: str = "euclidean",
    normalize: bool = False,
    ap_mode: str = "standard",
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> VehicleIDResult:
    """Recall@k (mean ± std over ``repeats`` seeded gallery draws) on a VehicleID test set.

    Args:
        embeddings: ``(N, D)`` embeddings of the test images (e.g. ``test_list_800.txt``).
        ids: ``(N,)`` vehicle ids.
        repeats: gallery draws (an integer >= 1); draw ``r`` uses
            ``numpy.random.default_rng([seed, r])``.
        ks: the ranks reported (integers >= 1; anything else is a :class:`ConfigError`).
        metric / normalize / ap_mode: as :func:`dmlkit.apps.reid.evaluate_reid`.
    """
    emb = _as_float(embeddings, "embeddings")
    lab = _as_ids(ids, emb.shape[0], "ids")
    repeats = check_integer(repeats, "repeats")
    seed = check_seed(seed)
    try:
        ranks = [check_integer(k, "each of ks") for k in ks]
    except (TypeError, ConfigError):  # a bare number, or a float, bool or rank < 1 in it
        ranks = []
    if not ranks:
        raise ConfigError(f"ks must be a non-empty sequence of integer ranks >= 1, got {ks!r}")
    uniq, counts = np.unique(lab, return_counts=True)
    if (counts > 1).sum() == 0:
        raise DataError("every identity has a single image: VehicleID needs queries (>= 2 "
                        "images for some identities)")
    values: dict[int, list[float]] = {int(k): [] for k in ranks}
    maps: list[float] = []
    n_queries = 0
    for r in range(repeats):
        gal = draw_gallery(lab, np.random.default_rng([seed, r]))
        res = evaluate_reid(emb[~gal], emb[gal], lab[~gal], lab[gal], metric=metric,
                            normalize=normalize, ap_mode=ap_mode, junk_ids=(),  # every id is real
                            memory_budget=memory_budget)
        for k in values:
            values[k].append(res.rank(k))
        maps.append(res.mAP)
        n_queries = res.num_valid_queries
    return VehicleIDResult(values, maps, int(uniq.size), n_queries, repeats, seed)
