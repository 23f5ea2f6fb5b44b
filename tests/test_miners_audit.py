"""Audit fixes of the miners: ties broken by the smaller index whatever the strategy
(SemiHardMiner's "sort", HardNegativePairMiner's top-k), parameters refused as one ConfigError
line, and the stats the docstring promises."""

from __future__ import annotations

import math
import re

import pytest
import torch

from dmlkit.config import MinerConfig
from dmlkit.exceptions import ConfigError
from dmlkit.miners import (
    MINERS,
    AllTripletsMiner,
    BaseMiner,
    BatchAllMiner,
    DistanceWeightedMiner,
    HardNegativePairMiner,
    MultiSimilarityMiner,
    SemiHardMiner,
)
from dmlkit.training.builders import build_miner

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


@pytest.mark.parametrize("ratio", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("use_ref", [False, True])
def test_hard_negative_pairs_cut_ties_by_the_smaller_index(ratio, use_ref):
    """The k hardest negative pairs, hardest first, of equal distances the smaller row-major
    index first and at the cut (torch.topk chose any of them)."""
    emb, labels = _duplicate_batch(3, size=24)
    ref_emb, ref_labels = _duplicate_batch(4, size=20) if use_ref else (None, None)
    miner = HardNegativePairMiner(neg_pos_ratio=ratio, min_negatives=3)
    refs = emb if ref_emb is None else ref_emb
    f = miner.farness(emb, refs, not use_ref).tolist()
    _, neg = miner.label_masks(labels, labels if ref_labels is None else ref_labels, not use_ref)
    a1, p, a2, n = miner(emb, labels, ref_emb, ref_labels)
    pairs = sorted((f[i][j], i * len(refs) + j, i, j) for i, j in neg.nonzero().tolist())
    assert list(zip(a2.tolist(), n.tolist())) == [(i, j) for *_, i, j in pairs[: a2.numel()]]
    assert a2.numel() == min(max(round(ratio * a1.numel()), 3), len(pairs))


def test_hard_negative_pairs_on_an_all_tied_batch_take_the_first_pairs():
    emb = torch.ones(6, 3)
    labels = torch.tensor([0, 0, 0, 1, 1, 1])
    _, _, a2, n = HardNegativePairMiner()(emb, labels)
    expected = [(i, j) for i in range(6) for j in range(6) if labels[i] != labels[j]][:12]
    assert list(zip(a2.tolist(), n.tolist())) == expected


@pytest.mark.parametrize(("make", "message"), [
    (lambda: SemiHardMiner(margin=math.nan), "margin must be a finite number, got nan"),
    (lambda: BatchAllMiner(margin=math.inf), "margin must be a finite number, got inf"),
    (lambda: BatchAllMiner(margin="0.2"), "margin must be a finite number"),
    (lambda: MultiSimilarityMiner(epsilon=math.nan), "epsilon must be a finite number"),
    (lambda: HardNegativePairMiner(neg_pos_ratio=math.nan), "neg_pos_ratio must be a finite number of at least 0"),
    (lambda: HardNegativePairMiner(neg_pos_ratio=-1.0), "neg_pos_ratio must be a finite number of at least 0"),
    (lambda: HardNegativePairMiner(min_negatives=2.7), "min_negatives must be a non-negative integer, got 2.7"),
    (lambda: HardNegativePairMiner(min_negatives=True), "min_negatives must be a non-negative integer"),
    (lambda: DistanceWeightedMiner(seed=-1), "seed must be a non-negative integer"),
    (lambda: DistanceWeightedMiner(seed=1.5), "seed must be a non-negative integer"),
    (lambda: DistanceWeightedMiner(seed=2**64), "seed must be a non-negative integer"),
    (lambda: AllTripletsMiner(max_triplets=2.5), "max_triplets must be a non-negative integer or None"),
], ids=range(12))
def test_miner_parameters_are_refused_at_construction(make, message):
    """NaN margins and epsilons mined nothing or anything without a word, a fractional count
    was truncated, a bad seed raised Python's ValueError at the first call: one ConfigError
    line, when the miner is made."""
    with pytest.raises(ConfigError, match=f"^{message}"):
        make()


def test_config_miner_parameters_are_checked_or_work():
    """Through the config: a 2**64 seed is one ConfigError line; a ratio of 1e308 (which
    overflowed to OverflowError at the first call) asks for every negative pair."""
    with pytest.raises(ConfigError, match="seed must be a non-negative integer"):
        build_miner(MinerConfig(name="distance_weighted", params={"seed": 2**64}))
    miner = build_miner(MinerConfig(name="hard_negative_pairs", params={"neg_pos_ratio": 1e308}))
    labels = torch.arange(12) % 3
    emb = torch.randn(12, 4, generator=torch.Generator().manual_seed(0))
    _, _, a2, _ = miner(emb, labels)
    assert a2.numel() == int((labels[:, None] != labels[None]).sum())


def test_the_stats_are_those_the_docstring_names():
    """BaseMiner's docstring promised ``num_anchors`` in ``stats``, which no miner set: every
    name it lists is set by some miner, and every miner sets only names it lists."""
    documented = set(re.findall(r"``(num_\w+)``", BaseMiner.__doc__))
    emb, labels = _duplicate_batch(5, size=12)
    seen: set[str] = set()
    for name, cls in MINERS.items():
        miner = cls()
        miner(torch.randn(12, 8, generator=torch.Generator().manual_seed(0)), labels)
        assert set(miner.stats) <= documented, name
        out = miner(emb, labels)
        assert miner.num_mined == out[0].numel() + (out[2].numel() if len(out) == 4 else 0), name
        seen |= set(miner.stats)
    assert seen == documented
