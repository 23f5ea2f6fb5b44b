"""Pair-based losses (contrastive, lifted, generalised lifted, margin, circle) and _pairs helpers.

Each loss is checked against a slow reference written directly from its formula with explicit
Python loops over pairs, in float64 (value and gradient), on batches with several classes, one
class and singletons; with torch.autograd.gradcheck; on empty batches; in bfloat16; and against
pytorch-metric-learning where the two are equivalent.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from _reference import (
    LABEL_SETS,
    assert_value_and_grad_match,
    batch,
    check_bfloat16_is_finite,
    lse,
    make_distance,
    value_and_grad,
)
from _reference import unit as _norm
from dmlkit.exceptions import ConfigError, ShapeError
from dmlkit.losses import get_loss
from dmlkit.losses._pairs import (
    check_indices,
    compact_mask,
    indices_to_masks,
    label_masks,
    masked_logsumexp,
    pair_masks,
    to_pair_indices,
)
from dmlkit.losses.pair_losses import (
    CircleLoss,
    ContrastiveLoss,
    CosineSimilarityLoss,
    GeneralizedLiftedStructureLoss,
    LiftedStructureLoss,
    MarginLoss,
)


# ------------------------------------------------------------------ reference building blocks
def ref_dist(kind, u, v):
    """Distance (larger = farther) or similarity between two single vectors, from scratch."""
    u, v = _norm(u), _norm(v)
    if kind == "euclidean":
        return ((u - v) ** 2).sum().clamp_min(1e-30).sqrt()
    if kind == "sqeuclidean":
        return ((u - v) ** 2).sum()
    if kind == "cosine":
        return (u * v).sum()
    raise ValueError(kind)


def all_pairs(y, ry=None):
    """Ordered (i, j) pairs of the batch (i != j) or of batch x reference."""
    ref = y if ry is None else ry
    out = []
    for i in range(len(y)):
        for j in range(len(ref)):
            if ry is None and i == j:
                continue
            out.append((i, j, bool(y[i] == ref[j])))
    return out


def assert_matches(loss, reference, x, y, **kwargs):
    assert_value_and_grad_match(lambda e: loss(e, y, **kwargs), reference, x)


# ------------------------------------------------------------------ reference losses
def ref_contrastive(x, y, pos_margin=0.0, neg_margin=1.0, kind="euclidean", dpow=1, hpow=1,
                    reduction="mean_nonzero", pairs=None, r=None, ry=None):
    ref = x if r is None else r
    pairs = all_pairs(y, ry) if pairs is None else pairs
    pos, neg = [], []
    sim = kind == "cosine"
    for i, j, same in pairs:
        d = ref_dist(kind, x[i], ref[j]) ** dpow
        if same:
            v = (pos_margin - d) if sim else (d - pos_margin)
            pos.append(F.relu(v) ** hpow)
        else:
            v = (d - neg_margin) if sim else (neg_margin - d)
            neg.append(F.relu(v) ** hpow)

    def red(terms):
        if not terms:
            return x.sum() * 0
        if reduction == "mean":
            return sum(terms) / len(terms)
        nz = [t for t in terms if t.item() > 0]
        return sum(terms) / max(len(nz), 1)

    return red(pos) + red(neg)


def ref_lifted(x, y, neg_margin=1.0, pos_margin=0.0, r=None, ry=None):
    ref, rlab = (x, y) if r is None else (r, ry)
    terms = []
    for i, j, same in all_pairs(y, ry):
        if not same:
            continue
        vals = [neg_margin - ref_dist("euclidean", x[i], ref[k])
                for k in range(len(rlab)) if rlab[k] != y[i]]
        vals += [neg_margin - ref_dist("euclidean", ref[j], ref[k])
                 for k in range(len(rlab)) if rlab[k] != rlab[j]]
        jij = lse(vals) + ref_dist("euclidean", x[i], ref[j]) - pos_margin
        terms.append(F.relu(jij) ** 2 / 2)
    return sum(terms) / len(terms)


def ref_generalized_lifted(x, y, neg_margin=1.0, pos_margin=0.0, kind="euclidean", r=None,
                           ry=None):
    ref, rlab = (x, y) if r is None else (r, ry)
    terms = []
    for i in range(len(y)):
        sign = -1.0 if kind == "cosine" else 1.0  # a similarity mirrors both margins
        ps = [sign * (ref_dist(kind, x[i], ref[j]) - pos_margin) for j in range(len(rlab))
              if rlab[j] == y[i] and (r is not None or j != i)]
        ns = [sign * (neg_margin - ref_dist(kind, x[i], ref[j])) for j in range(len(rlab))
              if rlab[j] != y[i]]
        if ps and ns:
            terms.append(F.relu(lse(ps) + lse(ns)))
    return sum(terms) / len(terms)


def ref_margin(x, y, margin=0.2, beta=None, pairs=None, nu=0.0, per_class=False):
    """beta: tensor of betas (one, or one per class)."""
    pairs = all_pairs(y) if pairs is None else pairs
    terms, betas = [], []
    for i, j, same in pairs:
        b = beta[y[i]] if per_class else beta[0]
        d = ref_dist("euclidean", x[i], x[j])
        yij = 1.0 if same else -1.0
        terms.append(F.relu(margin + yij * (d - b)))
        betas.append(b)
    active = sum(1 for t in terms if t.item() > 0)
    loss = sum(terms) / max(active, 1)
    if nu:
        loss = loss + nu * (sum(betas) / len(betas) if per_class else beta[0])
    return loss


def ref_circle(x, y, m=0.4, gamma=80.0, r=None, ry=None):
    ref, rlab = (x, y) if r is None else (r, ry)
    terms = []
    for i in range(len(y)):
        ps, ns = [], []
        for j in range(len(rlab)):
            if r is None and j == i:
                continue
            s = ref_dist("cosine", x[i], ref[j])
            if rlab[j] == y[i]:
                ap = F.relu(1 + m - s.detach())
                ps.append(-gamma * ap * (s - (1 - m)))
            else:
                an = F.relu(s.detach() + m)
                ns.append(gamma * an * (s - m))
        if ps and ns:
            terms.append(F.softplus(lse(ps) + lse(ns)))
    return sum(terms) / len(terms)


# ------------------------------------------------------------------ _pairs helpers
def test_label_masks_exclude_diagonal_only_without_reference():
    y = torch.tensor([0, 0, 1])
    pos, neg = label_masks(y)
    assert pos.tolist() == [[False, True, False], [True, False, False], [False, False, False]]
    assert neg.tolist() == [[False, False, True], [False, False, True], [True, True, False]]
    pos_r, neg_r = label_masks(y, torch.tensor([0, 1]))
    assert pos_r.tolist() == [[True, False], [True, False], [False, True]]
    assert (pos_r ^ neg_r).all()


def test_indices_conversion_and_validation():
    a, p, n = torch.tensor([0, 0]), torch.tensor([1, 1]), torch.tensor([2, 3])
    a1, p1, a2, n2 = to_pair_indices((a, p, n))
    assert a1.tolist() == [0, 0] and p1.tolist() == [1, 1] and n2.tolist() == [2, 3]
    pos, neg = indices_to_masks((a, p, n), 4, 4)
    assert pos.sum() == 1 and neg.sum() == 2  # duplicates collapse
    assert check_indices((a, p, n), 4, 4) == "triplet"
    assert check_indices((a, p, a, n), 4, 4) == "pair"
    with pytest.raises(ShapeError, match="out of range"):
        check_indices((a, p, torch.tensor([2, 9])), 4, 4)
    with pytest.raises(ShapeError):
        check_indices((a, p), 4, 4)
    with pytest.raises(ShapeError, match="equal lengths"):
        check_indices((a, p, torch.tensor([2])), 4, 4)
    with pytest.raises(ShapeError, match="both positive and negative"):
        indices_to_masks((a, p, a, p), 4, 4)
    y = torch.tensor([0, 0, 1, 1])
    pos, neg = pair_masks(y, (a, p, n))
    assert pos[0, 1] and neg[0, 2] and neg[0, 3] and pos.sum() == 1


def test_masked_logsumexp_matches_loop_and_is_safe_on_empty_rows():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [0.0, 0.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, False, True], [False, False, False], [True, True, True]])
    out = masked_logsumexp(x, mask)
    assert out[0].item() == pytest.approx(math.log(math.exp(1) + math.exp(3)))
    assert out[1].item() == 0.0
    assert out[2].item() == pytest.approx(math.log(3))
    out.sum().backward()
    assert torch.isfinite(x.grad).all() and (x.grad[1] == 0).all() and x.grad[0, 1] == 0
    one = masked_logsumexp(x.detach(), mask, add_one=True)
    assert one[0].item() == pytest.approx(math.log(1 + math.exp(1) + math.exp(3)))
    assert one[1].item() == pytest.approx(0.0)
    big = torch.full((2, 3), 1e4, dtype=torch.bfloat16)
    assert torch.isfinite(masked_logsumexp(big, mask[:2])).all()


def test_compact_mask():
    mask = torch.tensor([[False, True, True, False], [False, False, False, False], [True] * 4])
    cols, valid = compact_mask(mask)
    assert cols.shape == (3, 4)
    assert cols[0, :2].tolist() == [1, 2] and valid[0].tolist() == [True, True, False, False]
    assert not valid[1].any() and cols[2].tolist() == [0, 1, 2, 3]


# ------------------------------------------------------------------ contrastive
@pytest.mark.parametrize("labels", list(LABEL_SETS))
@pytest.mark.parametrize(
    "params",
    [
        {},
        {"pos_margin": 0.3, "neg_margin": 1.2},
        {"distance_power": 2, "hinge_power": 2, "pos_margin": 0.1, "neg_margin": 1.5},
        {"hinge_power": 2, "reduction": "mean"},
        {"kind": "cosine", "pos_margin": 0.9, "neg_margin": 0.2},
        {"kind": "sqeuclidean", "neg_margin": 2.0},
    ],
)
def test_contrastive_matches_reference(labels, params):
    params = dict(params)
    kind = params.pop("kind", "euclidean")
    x, y = batch(LABEL_SETS[labels])
    loss = ContrastiveLoss(distance=make_distance(kind), **params)
    ref_kwargs = {
        "pos_margin": params.get("pos_margin", 0.0),
        "neg_margin": params.get("neg_margin", 1.0),
        "dpow": params.get("distance_power", 1),
        "hpow": params.get("hinge_power", 1),
        "reduction": params.get("reduction", "mean_nonzero"),
        "kind": kind,
    }
    assert_matches(loss, lambda e: ref_contrastive(e, y, **ref_kwargs), x, y)


def test_contrastive_with_mined_pairs_triplets_and_reference_set():
    x, y = batch(LABEL_SETS["several"], seed=3)
    loss = ContrastiveLoss(pos_margin=0.2)
    a1, p = torch.tensor([0, 0, 3, 5]), torch.tensor([1, 2, 4, 7])
    a2, n = torch.tensor([0, 1, 8]), torch.tensor([3, 9, 2])
    pairs = [(0, 1, True), (0, 2, True), (3, 4, True), (5, 7, True),
             (0, 3, False), (1, 9, False), (8, 2, False)]
    assert_matches(loss, lambda e: ref_contrastive(e, y, pos_margin=0.2, pairs=pairs), x, y,
                   indices=(a1, p, a2, n))
    trip = (torch.tensor([0, 0]), torch.tensor([1, 1]), torch.tensor([3, 4]))
    pairs_t = [(0, 1, True), (0, 1, True), (0, 3, False), (0, 4, False)]
    assert_matches(loss, lambda e: ref_contrastive(e, y, pos_margin=0.2, pairs=pairs_t), x, y,
                   indices=trip)
    r, ry = batch([0, 1, 1, 3, 7], seed=4)
    v = loss(x, y, ref_emb=r, ref_labels=ry)
    expected = ref_contrastive(x, y, pos_margin=0.2, r=r, ry=ry)
    torch.testing.assert_close(v, expected)


# ------------------------------------------------------------------ lifted structure
@pytest.mark.parametrize("labels", ["several"])
@pytest.mark.parametrize("margins", [(1.0, 0.0), (0.5, 0.2)])
def test_lifted_matches_reference(labels, margins):
    x, y = batch(LABEL_SETS[labels], seed=1)
    loss = LiftedStructureLoss(neg_margin=margins[0], pos_margin=margins[1])
    assert_matches(loss, lambda e: ref_lifted(e, y, *margins), x, y)


def test_lifted_with_reference_set():
    x, y = batch([0, 0, 1, 2, 2], seed=5)
    r, ry = batch([0, 1, 1, 2, 3, 0], seed=6)
    v1, g1 = value_and_grad(lambda e: LiftedStructureLoss()(e, y, ref_emb=r, ref_labels=ry), x)
    v2, g2 = value_and_grad(lambda e: ref_lifted(e, y, r=r, ry=ry), x)
    torch.testing.assert_close(v1, v2)
    torch.testing.assert_close(g1, g2)


# ------------------------------------------------------------------ generalised lifted
@pytest.mark.parametrize("labels", ["several"])
@pytest.mark.parametrize("kind", ["euclidean", "cosine"])
def test_generalized_lifted_matches_reference(labels, kind):
    x, y = batch(LABEL_SETS[labels], seed=2)
    margins = (1.0, 0.0) if kind == "euclidean" else (0.3, 0.8)
    loss = GeneralizedLiftedStructureLoss(
        neg_margin=margins[0], pos_margin=margins[1], distance=make_distance(kind)
    )
    assert_matches(
        loss, lambda e: ref_generalized_lifted(e, y, margins[0], margins[1], kind), x, y
    )
    r, ry = batch([0, 1, 1, 2, 3, 0], seed=6)
    torch.testing.assert_close(
        loss(x, y, ref_emb=r, ref_labels=ry),
        ref_generalized_lifted(x, y, margins[0], margins[1], kind, r=r, ry=ry),
    )


# ------------------------------------------------------------------ margin
@pytest.mark.parametrize("labels", list(LABEL_SETS))
def test_margin_matches_reference(labels):
    x, y = batch(LABEL_SETS[labels], seed=7)
    loss = MarginLoss(learn_beta=False).double()
    assert_matches(loss, lambda e: ref_margin(e, y, beta=torch.tensor([1.2])), x, y)


def test_margin_per_class_beta_gradient_and_regulariser():
    x, y = batch(LABEL_SETS["several"], seed=8)
    loss = MarginLoss(num_classes=5, nu=0.1, beta=0.9).double()
    with torch.no_grad():
        loss.beta.copy_(torch.tensor([0.9, 1.0, 1.1, 0.8, 1.3]))
    beta_ref = loss.beta.detach().clone().requires_grad_(True)
    out = loss(x, y)
    out.backward()
    expected = ref_margin(x, y, beta=beta_ref, nu=0.1, per_class=True)
    expected.backward()
    torch.testing.assert_close(out.detach(), expected.detach())
    torch.testing.assert_close(loss.beta.grad, beta_ref.grad)
    assert loss.beta.grad.abs().sum() > 0
    assert [n for n, _ in loss.named_parameters()] == ["beta"]
    with pytest.raises(ConfigError, match="labels in"):
        loss(x, y + 10)


def test_margin_with_triplets_and_pairs():
    x, y = batch(LABEL_SETS["several"], seed=9)
    loss = MarginLoss(learn_beta=False).double()
    trip = (torch.tensor([0, 0, 3]), torch.tensor([1, 2, 4]), torch.tensor([5, 9, 0]))
    pairs = [(0, 1, True), (0, 2, True), (3, 4, True), (0, 5, False), (0, 9, False),
             (3, 0, False)]
    assert_matches(loss, lambda e: ref_margin(e, y, beta=torch.tensor([1.2]), pairs=pairs), x, y,
                   indices=trip)


# ------------------------------------------------------------------ circle
@pytest.mark.parametrize("labels", ["several"])
@pytest.mark.parametrize("params", [{}, {"m": 0.25, "gamma": 256.0}])
def test_circle_matches_reference(labels, params):
    x, y = batch(LABEL_SETS[labels], seed=10)
    loss = CircleLoss(**params)
    assert_matches(loss, lambda e: ref_circle(e, y, **params), x, y)
    r, ry = batch([0, 1, 1, 2, 3, 0], seed=6)
    torch.testing.assert_close(
        loss(x, y, ref_emb=r, ref_labels=ry), ref_circle(x, y, r=r, ry=ry, **params)
    )


def test_circle_needs_a_similarity():
    with pytest.raises(ConfigError, match="cosine"):
        CircleLoss(distance="euclidean")


# ------------------------------------------------------------------ cosine similarity loss
def ref_cosine_similarity(x, y, negative_target=0.0, reduction="mean", pairs=None, r=None,
                          ry=None):
    """Seed 003: 1/2 (y - cos)^2 per pair, y = 1 (same class) or negative_target."""
    ref = x if r is None else r
    pairs = all_pairs(y, ry) if pairs is None else pairs
    pos = [0.5 * (1 - ref_dist("cosine", x[i], ref[j])) ** 2 for i, j, same in pairs if same]
    neg = [0.5 * (negative_target - ref_dist("cosine", x[i], ref[j])) ** 2
           for i, j, same in pairs if not same]
    if reduction == "mean":
        return sum(pos + neg) / len(pos + neg)
    means = [sum(t) / len(t) for t in (pos, neg) if t]
    return sum(means) / len(means)


@pytest.mark.parametrize("labels", list(LABEL_SETS))
@pytest.mark.parametrize("params", [{}, {"negative_target": -1.0},
                                    {"negative_target": 0.2, "reduction": "balanced"}])
def test_cosine_similarity_matches_formula(labels, params):
    x, y = batch(LABEL_SETS[labels], seed=21)
    assert_matches(get_loss("cosine_similarity", **params),
                   lambda e: ref_cosine_similarity(e, y, **params), x, y)


def test_cosine_similarity_by_hand_and_with_pairs_triplets_reference_set():
    # cos = 0 (orthogonal), 1 (same direction), -0.6: the seed's 1/0 labels by hand
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [-0.6, 0.8]], dtype=torch.float64)
    y = torch.tensor([0, 1, 0, 1])
    loss = CosineSimilarityLoss()
    a1, p = torch.tensor([0]), torch.tensor([2])  # same class, cos 1 -> 0
    a2, n = torch.tensor([0, 0]), torch.tensor([1, 3])  # different, cos 0 -> 0 and -0.6 -> 0.18
    assert loss(x, y, indices=(a1, p, a2, n)).item() == pytest.approx((0 + 0 + 0.18) / 3)
    # with targets +-1 it is half the contrastive loss on cosine with squared hinges (1, -1)
    contrastive = ContrastiveLoss(pos_margin=1.0, neg_margin=-1.0, distance="cosine",
                                  hinge_power=2, reduction="mean")
    for idx in ((a1, p, a1[:0], p[:0]), (a1[:0], p[:0], a2[:1], n[:1]), (a1[:0], p[:0], a2[1:], n[1:])):
        half = CosineSimilarityLoss(negative_target=-1.0)(x, y, indices=idx)
        assert half.item() == pytest.approx(contrastive(x, y, indices=idx).item() / 2)
    # mined triplets give (a, p) and (a, n); a reference set gives batch x reference pairs
    xr, yr = batch(LABEL_SETS["several"], seed=22)
    trip = (torch.tensor([0, 3]), torch.tensor([1, 4]), torch.tensor([5, 0]))
    pairs = [(0, 1, True), (3, 4, True), (0, 5, False), (3, 0, False)]
    assert_matches(loss, lambda e: ref_cosine_similarity(e, yr, pairs=pairs), xr, yr,
                   indices=trip)
    r, ry = batch([0, 1, 1, 2, 7], seed=23)
    torch.testing.assert_close(loss(xr, yr, ref_emb=r, ref_labels=ry),
                               ref_cosine_similarity(xr, yr, r=r, ry=ry))


def test_cosine_similarity_invalid_arguments():
    with pytest.raises(ConfigError):
        CosineSimilarityLoss(negative_target=1.0)
    with pytest.raises(ConfigError):
        CosineSimilarityLoss(reduction="sum")


# ------------------------------------------------------------------ all pair losses
ALL = {
    "contrastive": {},
    "cosine_similarity": {},
    "lifted_structure": {},
    "generalized_lifted_structure": {},
    "margin": {},
    "circle": {},
}


@pytest.mark.parametrize("name", list(ALL))
def test_gradcheck(name):
    x, y = batch([0, 0, 1, 1, 2], dim=3, seed=11)
    loss = get_loss(name, **ALL[name]).double()
    if name == "circle":
        # the weights alpha are constants (no gradient) by design, which finite differences
        # cannot see; check instead the limit where alpha is exactly constant in x
        loss = CircleLoss(m=0.4, gamma=2.0).double()
        x = x.clone().requires_grad_(True)
        fn = lambda e: ref_circle(e, y, gamma=2.0)  # noqa: E731
        torch.testing.assert_close(
            torch.autograd.grad(loss(x, y), x)[0], torch.autograd.grad(fn(x), x)[0]
        )
        return
    x = x.clone().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda e: loss(e, y), (x,), eps=1e-6, atol=1e-5)


EMPTY = {
    # (labels with no usable pair for this loss)
    "contrastive": [3],
    "cosine_similarity": [3],
    "lifted_structure": [1, 1, 1, 1],
    "generalized_lifted_structure": [0, 1, 2, 3],
    "margin": [3],
    "circle": [2, 2, 2],
}


@pytest.mark.parametrize("name", list(ALL))
def test_empty_batch_gives_zero_with_gradient(name):
    loss = get_loss(name)
    x = torch.randn(len(EMPTY[name]), 4, requires_grad=True)
    out = loss(x, torch.tensor(EMPTY[name]))
    assert out.item() == 0.0 and out.requires_grad
    out.backward()
    assert x.grad is not None and (x.grad == 0).all()
    assert loss.num_empty_batches == 1
    # mined indices with no pair at all
    e = torch.empty(0, dtype=torch.long)
    x2 = torch.randn(6, 4, requires_grad=True)
    out = loss(x2, torch.tensor([0, 0, 1, 1, 2, 2]), indices=(e, e, e, e))
    assert out.item() == 0.0 and out.requires_grad and loss.num_empty_batches == 2


@pytest.mark.parametrize("name", list(ALL))
@pytest.mark.parametrize("scale", [1.0, 1e3])
def test_bfloat16_is_finite(name, scale):
    check_bfloat16_is_finite(name, scale, seed=12)


def test_large_scale_float32_is_finite():
    x = torch.randn(32, 8) * 1e4
    y = torch.randint(0, 4, (32,))
    for name in ALL:
        xx = x.clone().requires_grad_(True)
        out = get_loss(name, distance="dot") if name == "circle" else get_loss(name)
        val = out(xx, y)
        val.backward()
        assert torch.isfinite(val) and torch.isfinite(xx.grad).all(), name


def test_invalid_configs():
    with pytest.raises(ConfigError):
        ContrastiveLoss(distance="cosine", distance_power=2)
    with pytest.raises(ConfigError):
        ContrastiveLoss(reduction="sum")
    with pytest.raises(ConfigError):
        MarginLoss(num_classes=0)


@pytest.mark.parametrize(("name", "param", "bad", "message"), [
    ("circle", "gamma", (0.0, -80.0, math.inf), "gamma must be a positive finite number"),
    ("tuplet_margin", "scale", (0.0, -64.0, math.inf), "scale must be a positive finite number"),
    ("margin", "nu", (-2.0, -1e-9, math.nan), "nu must be a finite number of at least 0"),
])
def test_scales_and_regulariser_weights_refuse_a_wrong_sign(name, param, bad, message):
    """A negative scale turned the objective upside down (lower loss on a batch with scrambled
    labels), 0 made it constant, nu < 0 made the loss unbounded below in beta; all were
    accepted, unlike the sibling scales and temperatures."""
    for value in bad:
        with pytest.raises(ConfigError, match=message):
            get_loss(name, **{param: value})
    get_loss(name, **{param: 0.0 if param == "nu" else 1.0})  # the boundary that is allowed


# ------------------------------------------------------------------ pytorch-metric-learning
pml = pytest.importorskip("pytorch_metric_learning")


def _pml_cases():
    from pytorch_metric_learning import distances as pd
    from pytorch_metric_learning import losses as pl

    return [
        ("contrastive", {}, pl.ContrastiveLoss()),
        ("contrastive", {"distance": "cosine", "pos_margin": 0.8, "neg_margin": 0.3},
         pl.ContrastiveLoss(pos_margin=0.8, neg_margin=0.3, distance=pd.CosineSimilarity())),
        ("lifted_structure", {}, pl.LiftedStructureLoss()),
        ("generalized_lifted_structure", {}, pl.GeneralizedLiftedStructureLoss()),
        ("circle", {}, pl.CircleLoss()),
    ]


@pytest.mark.parametrize("case", range(5))
def test_equal_to_pml(case):
    from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

    name, kwargs, peer = _pml_cases()[case]
    g = torch.Generator().manual_seed(13)
    x = torch.randn(64, 32, generator=g)
    y = torch.arange(16).repeat_interleave(4)  # 16 classes x 4, as an M-per-class batch
    ours = get_loss(name, **kwargs)
    assert abs(ours(x, y).item() - peer(x, y).item()) < 1e-5
    pairs = lmu.get_all_pairs_indices(y)
    sub = tuple(t[::3] for t in pairs)
    assert abs(ours(x, y, indices=sub).item() - peer(x, y, sub).item()) < 1e-5


def test_margin_equal_to_pml_on_triplets():
    from pytorch_metric_learning import losses as pl
    from pytorch_metric_learning.utils import loss_and_miner_utils as lmu

    g = torch.Generator().manual_seed(14)
    x = torch.randn(32, 16, generator=g)
    y = torch.arange(8).repeat_interleave(4)
    trip = lmu.get_all_triplets_indices(y)
    for ours, peer in [
        (MarginLoss(learn_beta=False), pl.MarginLoss()),
        (MarginLoss(num_classes=8), pl.MarginLoss(num_classes=8, learn_beta=True)),
        (MarginLoss(nu=0.1), pl.MarginLoss(nu=0.1, learn_beta=True)),
    ]:
        assert abs(ours(x, y, indices=trip).item() - peer(x, y, trip).item()) < 1e-5
