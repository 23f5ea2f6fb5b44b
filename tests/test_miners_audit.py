"""Audit fixes of the miners: ties broken by the smaller index whatever the strategy
(SemiHardMiner's "sort", HardNegativePairMiner's top-k), parameters refused as one ConfigError
line, and the stats the docstring promises."""

from __future__ import annotations

import pytest
import torch

from dmlkit.miners import SemiHardMiner

pytestmark = pytest.mark.usefixtures("one_thread")


def _duplicate_batch(seed: int, size: int = 48, distinct: int = 5, classes: int = 3):
    """A batch whose embeddings repeat (every row has ~size/distinct copies): tied distances
    everywhere."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(distinct, 8, generator=g)
    emb = base[torch.randint(0, distinct, (size,), generator=g)]
    labels = torch.randint(0, classes, (size,), generator=g)
    return emb, labels


def _semi_hard_oracle(f: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor, fallback: str,
                      margin: float) -> list[tuple[int, int, int]]:
    """FaceNet's semi-hard rule in loops; of tied negatives the smaller index."""
    out = []
    sign = -1.0 if fallback == "easiest" else 1.0
    for a, (row, pos_row, neg_row) in enumerate(zip(f.tolist(), pos.tolist(), neg.tolist())):
        negs = [n for n, is_neg in enumerate(neg_row) if is_neg]
        for p in (p for p, is_pos in enumerate(pos_row) if is_pos):
            farther = [n for n in negs if row[n] > row[p]]
            if farther:
                n = min(farther, key=lambda j: (row[j], j))
                if row[n] < row[p] + margin:
                    out.append((a, p, n))
            elif negs and fallback != "none":
                out.append((a, p, min(negs, key=lambda j: (sign * row[j], j))))
    return sorted(out)


@pytest.mark.parametrize("fallback", ["easiest", "hardest", "none"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("use_ref", [False, True])
def test_semi_hard_sort_gives_the_blocks_triplets_on_tied_distances(fallback, seed, use_ref):
    """With duplicate embeddings, "sort" (the "auto" choice for anchors with many positives)
    took an arbitrary tied negative (unstable sort) and fallback "easiest" the last tied
    farthest one; both strategies now give the same triplets, ties to the smaller index."""
    emb, labels = _duplicate_batch(seed)
    ref_emb, ref_labels = _duplicate_batch(seed + 10, size=30) if use_ref else (None, None)
    probe = SemiHardMiner(margin=0.5, fallback=fallback)
    f = probe.farness(emb, emb if ref_emb is None else ref_emb, not use_ref)
    pos, neg = probe.label_masks(labels, labels if ref_labels is None else ref_labels, not use_ref)
    expected = _semi_hard_oracle(f, pos, neg, fallback, 0.5)
    assert expected
    for strategy in ("blocks", "sort", "auto"):
        miner = SemiHardMiner(margin=0.5, fallback=fallback, strategy=strategy)
        got = miner(emb, labels, ref_emb, ref_labels)
        assert sorted(zip(*[t.tolist() for t in got])) == expected, strategy


def test_semi_hard_easiest_fallback_takes_the_smaller_tied_index():
    """Negatives 2 and 3 are the same point, nearer than the positive: fallback "easiest"
    takes negative 2 with either strategy (the sort strategy took 3)."""
    emb = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.1], [1.0, 0.1]], dtype=torch.float64)
    labels = torch.tensor([0, 0, 1, 1])
    for strategy in ("blocks", "sort"):
        a, p, n = SemiHardMiner(strategy=strategy)(emb, labels)
        assert list(zip(a.tolist(), p.tolist(), n.tolist())) == [
            (0, 1, 2), (1, 0, 2), (2, 3, 0), (3, 2, 0)], strategy

