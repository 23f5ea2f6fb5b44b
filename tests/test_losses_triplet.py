"""Triplet-based losses (triplet margin, angular, N-pairs, tuplet margin).

Each loss is checked against a slow reference written directly from its formula with explicit
Python loops over triplets/pairs, in float64 (value and gradient), on batches with several
classes, one class and singletons; with torch.autograd.gradcheck; on empty batches; in
bfloat16; against pytorch-metric-learning where equivalent; and for O(B^2) memory.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from _reference import (
    LABEL_SETS,
    batch,
    check_bfloat16_is_finite,
    lse,
    make_distance,
    value_and_grad,
)
from _reference import assert_value_and_grad_match as assert_matches
from _reference import unit as _norm
from dmlkit.distances import DotProductSimilarity
from dmlkit.exceptions import ConfigError, ShapeError
from dmlkit.losses import get_loss
from dmlkit.losses.triplet_losses import (
    AngularLoss,
    NPairsLoss,
    TripletMarginLoss,
    TupletMarginLoss,
)


def ref_dist(kind, u, v):
    """Larger = farther: Euclidean, squared Euclidean, or minus the cosine similarity."""
    u, v = _norm(u), _norm(v)
    if kind == "euclidean":
        return ((u - v) ** 2).sum().clamp_min(1e-30).sqrt()
    if kind == "sqeuclidean":
        return ((u - v) ** 2).sum()
    return -(u * v).sum()


def all_triplets(y, ry=None):
    ref = y if ry is None else ry
    out = []
    for a in range(len(y)):
        for p in range(len(ref)):
            if ref[p] != y[a] or (ry is None and p == a):
                continue
            for n in range(len(ref)):
                if ref[n] != y[a]:
                    out.append((a, p, n))
    return out


# ------------------------------------------------------------------ references
def ref_triplet(x, y, margin=0.2, kind="euclidean", soft=False, reduction="batch_all_nonzero",
                triplets=None, r=None, ry=None, swap=False):
    ref = x if r is None else r
    if swap and reduction == "batch_hard" and triplets is None:
        # hardest positive and hardest negative of each anchor, then the swap on that triplet
        hard = {}
        for a, p, n in all_triplets(y, ry):
            hp, hn = hard.get(a, (p, n))
            if ref_dist(kind, x[a], ref[p]) > ref_dist(kind, x[a], ref[hp]):
                hp = p
            if ref_dist(kind, x[a], ref[n]) < ref_dist(kind, x[a], ref[hn]):
                hn = n
            hard[a] = (hp, hn)
        triplets = [(a, p, n) for a, (p, n) in hard.items()]
    triplets = all_triplets(y, ry) if triplets is None else triplets
    per_anchor: dict[int, list] = {}
    terms = []
    for a, p, n in triplets:
        d_an = ref_dist(kind, x[a], ref[n])
        if swap:  # Balntas et al. 2016: the positive is the anchor if it is nearer the negative
            d_an = torch.minimum(d_an, ref_dist(kind, ref[p], ref[n]))
        v = ref_dist(kind, x[a], ref[p]) - d_an + margin
        t = F.softplus(v) if soft else F.relu(v)
        terms.append(t)
        per_anchor.setdefault(a, []).append(t)
    if reduction == "batch_all":
        return sum(terms) / len(terms)
    if reduction == "batch_all_nonzero":
        return sum(terms) / max(1, sum(1 for t in terms if t.item() > 0))
    hardest = [max(ts, key=lambda t: t.item()) for ts in per_anchor.values()]
    return sum(hardest) / len(hardest)


def ref_angular(x, y, alpha=40.0, pairs=None):
    t2 = math.tan(math.radians(alpha)) ** 2
    pairs = pairs if pairs is not None else [
        (a, p) for a in range(len(y)) for p in range(len(y)) if a != p and y[a] == y[p]
    ]
    xs = [_norm(v) for v in x]
    losses = []
    for a, p in pairs:
        fs = [4 * t2 * ((xs[a] + xs[p]) * xs[n]).sum() - 2 * (1 + t2) * (xs[a] * xs[p]).sum()
              for n in range(len(y)) if y[n] != y[a]]
        losses.append(lse(fs + [torch.zeros((), dtype=x.dtype)]))
    return sum(losses) / len(losses)


def ref_npairs(x, y, normalize=True):
    anchors, positives, seen = [], [], set()
    for a in range(len(y)):
        if int(y[a]) in seen:
            continue
        ps = [p for p in range(len(y)) if p != a and y[p] == y[a]]
        if ps:
            seen.add(int(y[a]))
            anchors.append(a)
            positives.append(ps[0])
    f = (lambda v: _norm(v)) if normalize else (lambda v: v)
    losses = []
    for i, a in enumerate(anchors):
        s = [(f(x[a]) * f(x[p])).sum() for p in positives]
        losses.append(lse(s) - s[i])
    return sum(losses) / len(losses)


def ref_tuplet(x, y, margin=5.73, scale=64.0, pairs=None):
    beta = math.radians(margin)
    cos = lambda u, v: (_norm(u) * _norm(v)).sum()  # noqa: E731
    pos = pairs if pairs is not None else [
        (a, p) for a in range(len(y)) for p in range(len(y)) if a != p and y[a] == y[p]
    ]
    losses = []
    for a, p in pos:
        theta = torch.acos(cos(x[a], x[p]).clamp(-1 + 1e-7, 1 - 1e-7))
        target = torch.cos(theta - beta)
        terms = [scale * (cos(x[a], x[n]) - target) for n in range(len(y)) if y[n] != y[a]]
        losses.append(lse(terms + [torch.zeros((), dtype=x.dtype)]))
    return sum(losses) / len(losses)


# ------------------------------------------------------------------ triplet margin
@pytest.mark.parametrize("reduction", ["batch_all", "batch_all_nonzero", "batch_hard"])
@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("kind", ["euclidean", "sqeuclidean", "cosine"])
def test_triplet_all_triplets_match_reference(reduction, soft, kind):
    x, y = batch(LABEL_SETS["several"], seed=1)
    loss = TripletMarginLoss(margin=0.3, distance=make_distance(kind), soft_margin=soft,
                             reduction=reduction)
    assert_matches(lambda e: loss(e, y),
                   lambda e: ref_triplet(e, y, 0.3, kind, soft, reduction), x)


@pytest.mark.parametrize("reduction", ["batch_all", "batch_all_nonzero", "batch_hard"])
def test_triplet_mined_indices_and_reference_set(reduction):
    x, y = batch(LABEL_SETS["several"], seed=2)
    loss = TripletMarginLoss(margin=0.4, reduction=reduction)
    trip = [(0, 1, 3), (0, 2, 9), (0, 1, 9), (3, 4, 5), (5, 6, 8), (5, 7, 0)]
    idx = tuple(torch.tensor(c) for c in zip(*trip))
    assert_matches(lambda e: loss(e, y, indices=idx),
                   lambda e: ref_triplet(e, y, 0.4, reduction=reduction, triplets=trip), x)
    # pairs: all (a, p, n) with (a, p) a mined positive and (a, n) a mined negative pair
    pairs = (torch.tensor([0, 0, 3]), torch.tensor([1, 2, 4]),
             torch.tensor([0, 0, 3, 5]), torch.tensor([3, 9, 8, 0]))
    from_pairs = [(0, 1, 3), (0, 1, 9), (0, 2, 3), (0, 2, 9), (3, 4, 8)]
    assert_matches(lambda e: loss(e, y, indices=pairs),
                   lambda e: ref_triplet(e, y, 0.4, reduction=reduction, triplets=from_pairs),
                   x)
    r, ry = batch([0, 1, 1, 2, 3, 0, 4], seed=3)
    torch.testing.assert_close(loss(x, y, ref_emb=r, ref_labels=ry),
                               ref_triplet(x, y, 0.4, reduction=reduction, r=r, ry=ry))


@pytest.mark.parametrize("reduction", ["batch_all", "batch_all_nonzero", "batch_hard"])
@pytest.mark.parametrize("soft", [False, True])
@pytest.mark.parametrize("kind", ["euclidean", "sqeuclidean", "cosine"])
def test_triplet_swap_matches_reference(reduction, soft, kind):
    labels = [0] * 10 + [1] * 3 + [2, 2, 3]  # > SORT_ABOVE_POSITIVES positives: no sorting path
    x, y = batch(labels, seed=4)
    loss = TripletMarginLoss(margin=0.3, distance=make_distance(kind), soft_margin=soft,
                             reduction=reduction, swap=True)
    assert_matches(lambda e: loss(e, y),
                   lambda e: ref_triplet(e, y, 0.3, kind, soft, reduction, swap=True), x)
    if reduction != "batch_hard":  # the swap changes the value on this batch
        plain = TripletMarginLoss(margin=0.3, distance=make_distance(kind), soft_margin=soft,
                                  reduction=reduction)
        assert abs(loss(x, y).item() - plain(x, y).item()) > 1e-6


def test_triplet_swap_batch_hard_by_hand():
    # anchor (1, 0), its positive (-1, 0) at distance 2 and the negative (-0.8, 0.6) at
    # distance sqrt(3.6) from the anchor but sqrt(0.4) from the positive
    x = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [-0.8, 0.6]], dtype=torch.float64)
    y = torch.tensor([0, 0, 1])
    loss = TripletMarginLoss(margin=0.1, reduction="batch_hard", swap=True)
    # anchor 0: [2 - sqrt(0.4) + 0.1]; anchor 1 (positive 0, negative 2): the same triplet
    # mirrored, [2 - min(sqrt(0.4), sqrt(3.6)) + 0.1]; anchor 2 has no positive
    expected = 2 - 0.4 ** 0.5 + 0.1
    assert loss(x, y).item() == pytest.approx(expected, rel=1e-12)
    without = TripletMarginLoss(margin=0.1, reduction="batch_hard")(x, y).item()
    assert without == pytest.approx(((2 - 3.6 ** 0.5 + 0.1) + (2 - 0.4 ** 0.5 + 0.1)) / 2)


@pytest.mark.parametrize("reduction", ["batch_all_nonzero", "batch_hard"])
def test_triplet_swap_with_indices_and_reference_set(reduction, monkeypatch):
    x, y = batch(LABEL_SETS["several"], seed=5)
    loss = TripletMarginLoss(margin=0.4, reduction=reduction, swap=True)
    trip = [(0, 1, 3), (0, 2, 9), (0, 1, 9), (3, 4, 5), (5, 6, 8), (5, 7, 0)]
    idx = tuple(torch.tensor(c) for c in zip(*trip))
    assert_matches(lambda e: loss(e, y, indices=idx),
                   lambda e: ref_triplet(e, y, 0.4, reduction=reduction, triplets=trip, swap=True),
                   x)
    r, ry = batch([0, 1, 1, 2, 3, 0, 4], seed=6)
    torch.testing.assert_close(loss(x, y, ref_emb=r, ref_labels=ry),
                               ref_triplet(x, y, 0.4, reduction=reduction, r=r, ry=ry, swap=True))
    # several checkpointed blocks give the same value and gradient as one
    monkeypatch.setattr("dmlkit.losses._pairs.CPU_BLOCK_ELEMENTS", 8)
    assert_matches(lambda e: loss(e, y),
                   lambda e: ref_triplet(e, y, 0.4, reduction=reduction, swap=True), x)


def test_triplet_soft_margin_blocks_agree(monkeypatch):
    """The blocked soft-margin path gives the same value/gradient with tiny blocks."""
    x, y = batch([0, 0, 1, 1, 1, 2, 2, 3] * 3, seed=4)
    loss = TripletMarginLoss(soft_margin=True, reduction="batch_all")
    v1, g1 = value_and_grad(lambda e: loss(e, y), x)
    monkeypatch.setattr("dmlkit.losses._pairs.CPU_BLOCK_ELEMENTS", 7)
    v2, g2 = value_and_grad(lambda e: loss(e, y), x)
    torch.testing.assert_close(v1, v2)
    torch.testing.assert_close(g1, g2)


def test_triplet_hinge_sorting_is_exact_with_ties():
    """Distances with ties (duplicated embeddings) still give the looped value."""
    x, y = batch([0, 0, 1, 1, 2, 2], seed=5)
    x = torch.cat([x, x[:3]])
    y = torch.cat([y, y[:3]])
    loss = TripletMarginLoss(margin=0.5, reduction="batch_all")
    assert_matches(lambda e: loss(e, y), lambda e: ref_triplet(e, y, 0.5, reduction="batch_all"),
                   x)


# ------------------------------------------------------------------ angular
@pytest.mark.parametrize("alpha", [40.0, 50.0])
def test_angular_matches_reference(alpha):
    x, y = batch(LABEL_SETS["several"], seed=6)
    loss = AngularLoss(alpha=alpha)
    assert_matches(lambda e: loss(e, y), lambda e: ref_angular(e, y, alpha), x)
    trip = (torch.tensor([0, 0, 3]), torch.tensor([1, 1, 4]), torch.tensor([3, 5, 0]))
    assert_matches(lambda e: loss(e, y, indices=trip),
                   lambda e: ref_angular(e, y, alpha, pairs=[(0, 1), (0, 1), (3, 4)]), x)


def test_angular_blocks_agree(monkeypatch):
    x, y = batch([0, 0, 1, 1, 1, 2, 2, 3] * 2, seed=7)
    v1, g1 = value_and_grad(lambda e: AngularLoss()(e, y), x)
    monkeypatch.setattr("dmlkit.losses._pairs.CPU_BLOCK_ELEMENTS", 5)
    v2, g2 = value_and_grad(lambda e: AngularLoss()(e, y), x)
    torch.testing.assert_close(v1, v2)
    torch.testing.assert_close(g1, g2)


def test_block_elements_by_device(monkeypatch):
    """CPU blocks stay cache-sized; a GPU's grow with its memory, within [2^22, 2^27]."""
    from types import SimpleNamespace

    from dmlkit.losses._pairs import CPU_BLOCK_ELEMENTS, block_elements

    assert block_elements(torch.device("cpu")) == CPU_BLOCK_ELEMENTS == 1 << 22
    for memory, expected in [(141 * 2**30, 1 << 27), (16 * 2**30, 1 << 25), (1 * 2**30, 1 << 22)]:
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device, m=memory: SimpleNamespace(total_memory=m))
        assert block_elements(torch.device("cuda", 0)) == expected


# ------------------------------------------------------------------ n-pairs
@pytest.mark.parametrize("normalize", [True, False])
def test_npairs_matches_reference(normalize):
    x, y = batch([2, 0, 2, 1, 0, 1, 1, 3, 4, 4], seed=8)
    loss = NPairsLoss(distance=DotProductSimilarity(normalize_embeddings=normalize))
    assert_matches(lambda e: loss(e, y), lambda e: ref_npairs(e, y, normalize), x)


def test_npairs_with_mined_pairs_takes_first_pair_per_class():
    x, y = batch([0, 0, 0, 1, 1, 2, 2], seed=9)
    pairs = (torch.tensor([2, 0, 4, 6]), torch.tensor([1, 1, 3, 5]),
             torch.tensor([0]), torch.tensor([3]))
    # class 0: (2, 1) comes first; class 1: (4, 3); class 2: (6, 5)
    sims = lambda e: [[(_norm(e[a]) * _norm(e[p])).sum() for p in (1, 3, 5)]  # noqa: E731
                      for a in (2, 4, 6)]

    def ref(e):
        s = sims(e)
        return sum(lse(row) - row[i] for i, row in enumerate(s)) / 3

    assert_matches(lambda e: NPairsLoss()(e, y, indices=pairs), ref, x)


# ------------------------------------------------------------------ tuplet margin
@pytest.mark.parametrize("params", [{}, {"margin": 10.0, "scale": 16.0}])
def test_tuplet_matches_reference(params):
    x, y = batch(LABEL_SETS["several"], seed=10)
    loss = TupletMarginLoss(**params)
    assert_matches(lambda e: loss(e, y), lambda e: ref_tuplet(e, y, **params), x)


def test_tuplet_needs_cosine():
    with pytest.raises(ConfigError):
        TupletMarginLoss(distance="euclidean")


# ------------------------------------------------------------------ one class / singletons
ALL = ["triplet", "angular", "n_pairs", "tuplet_margin"]


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("labels", ["one_class", "singletons"])
def test_degenerate_batches(name, labels):
    """One class: no negatives; singletons: no positives. Zero with gradient, except N-pairs
    on one class (a single pair: cross-entropy of one logit is 0, not an empty batch)."""
    x, y = batch(LABEL_SETS[labels], seed=11)
    x.requires_grad_(True)
    loss = get_loss(name)
    out = loss(x, y)
    assert out.item() == pytest.approx(0.0, abs=1e-12) and out.requires_grad
    out.backward()
    assert (x.grad == 0).all()
    expect_empty = not (name == "n_pairs" and labels == "one_class")
    assert loss.num_empty_batches == int(expect_empty)


@pytest.mark.parametrize("name", ALL)
def test_empty_mined_indices(name):
    e = torch.empty(0, dtype=torch.long)
    x = torch.randn(6, 4, requires_grad=True)
    loss = get_loss(name)
    out = loss(x, torch.tensor([0, 0, 1, 1, 2, 2]), indices=(e, e, e))
    assert out.item() == 0.0 and out.requires_grad and loss.num_empty_batches == 1
    out.backward()


@pytest.mark.parametrize("name", ALL)
def test_gradcheck(name):
    x, y = batch([0, 0, 1, 1, 2], dim=3, seed=12)
    x.requires_grad_(True)
    loss = get_loss(name)
    assert torch.autograd.gradcheck(lambda e: loss(e, y), (x,), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize(
    "kwargs", [{"soft_margin": True}, {"reduction": "batch_hard"}, {"reduction": "batch_all"}]
)
def test_gradcheck_triplet_variants(kwargs):
    x, y = batch([0, 0, 1, 1, 2, 0], dim=3, seed=13)
    x.requires_grad_(True)
    loss = TripletMarginLoss(margin=0.5, **kwargs)
    assert torch.autograd.gradcheck(lambda e: loss(e, y), (x,), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("scale", [1.0, 1e3])
def test_bfloat16_is_finite(name, scale):
    check_bfloat16_is_finite(name, scale, seed=14)


def test_unnormalized_npairs_large_scale_is_finite():
    x = (torch.randn(16, 8) * 1e3).requires_grad_(True)
    y = torch.arange(8).repeat(2)
    out = NPairsLoss(distance=DotProductSimilarity(normalize_embeddings=False))(x, y)
    out.backward()
    assert torch.isfinite(out) and torch.isfinite(x.grad).all()


def test_invalid_arguments():
    with pytest.raises(ConfigError):
        TripletMarginLoss(reduction="mean")
    with pytest.raises(ConfigError):
        AngularLoss(alpha=95)
    x, y = batch([0, 0, 1], seed=0)
    with pytest.raises(ShapeError):
        TripletMarginLoss()(x, y, indices=(torch.tensor([0]), torch.tensor([1]),
                                           torch.tensor([7])))


def test_all_triplets_memory_is_quadratic(monkeypatch):
    """B = 128 with 2 classes has 520k triplets (2 MB of float32); what autograd keeps for the
    backward pass stays below eight float64 (B, B) matrices (1 MB): blocks are checkpointed,
    so only (B, R) tensors are held."""
    monkeypatch.setattr("dmlkit.losses._pairs.CPU_BLOCK_ELEMENTS", 1 << 15)  # force several blocks at this small B
    g = torch.Generator().manual_seed(15)
    b = 128
    x = torch.randn(b, 32, generator=g, requires_grad=True)
    y = torch.arange(2).repeat(b // 2)
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    for loss in (TripletMarginLoss(reduction="batch_all"), TripletMarginLoss(soft_margin=True),
                 AngularLoss()):
        storages.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = loss(x, y)
        out.backward()
        assert storages and sum(storages.values()) <= 8 * b * b * 8, type(loss).__name__
        assert torch.isfinite(x.grad).all()


# ------------------------------------------------------------------ pytorch-metric-learning
pml = pytest.importorskip("pytorch_metric_learning")


def _pml_cases():
    from pytorch_metric_learning import distances as pd
    from pytorch_metric_learning import losses as pl

    return [
        ("triplet", {"margin": 0.05}, pl.TripletMarginLoss(margin=0.05)),
        ("triplet", {"margin": 0.2, "soft_margin": True},
         pl.TripletMarginLoss(margin=0.2, smooth_loss=True)),
        ("triplet", {"margin": 0.1, "distance": "cosine"},
         pl.TripletMarginLoss(margin=0.1, distance=pd.CosineSimilarity())),
        ("triplet", {"margin": 0.2, "swap": True}, pl.TripletMarginLoss(margin=0.2, swap=True)),
        ("triplet", {"margin": 0.1, "distance": "cosine", "swap": True, "soft_margin": True},
         pl.TripletMarginLoss(margin=0.1, distance=pd.CosineSimilarity(), swap=True,
                              smooth_loss=True)),
        ("angular", {}, pl.AngularLoss(alpha=40)),
        ("n_pairs", {}, pl.NPairsLoss()),
        ("tuplet_margin", {}, pl.TupletMarginLoss()),
    ]


@pytest.mark.parametrize("case", range(8))
def test_equal_to_pml(case):
    from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

    name, kwargs, peer = _pml_cases()[case]
    g = torch.Generator().manual_seed(16)
    x = F.normalize(torch.randn(48, 32, generator=g), dim=1)  # pml's angular needs unit inputs
    y = torch.arange(12).repeat_interleave(4)
    ours = get_loss(name, **kwargs)
    assert abs(ours(x, y).item() - peer(x, y).item()) < 1e-5
    if name == "tuplet_margin":  # mat-based: duplicated pairs count once, so use unique pairs
        sub = tuple(t[::5] for t in lmu.get_all_pairs_indices(y))
    else:
        sub = tuple(t[::7] for t in lmu.get_all_triplets_indices(y))
    assert abs(ours(x, y, indices=sub).item() - peer(x, y, sub).item()) < 1e-5
