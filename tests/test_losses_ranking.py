"""Tests of dmlkit.losses.pair_weighting_losses against slow loop references written from the formulas.

Each reference below walks pairs/anchors with explicit Python loops on float64 scalars, so
autograd through it gives the reference gradient too.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from _reference import assert_allclose_value_and_grad as assert_matches
from _reference import backward_value_and_grad as _value_and_grad
from dmlkit.distances import CosineSimilarity, LpDistance
from dmlkit.exceptions import ConfigError, ShapeError
from dmlkit.losses import get_loss
from dmlkit.losses.pair_weighting_losses import (
    CoupledClustersLoss,
    DistanceLogisticLoss,
    MultiSimilarityLoss,
    NCALoss,
    NTXentLoss,
    SNRContrastiveLoss,
    SupConLoss,
)

# ------------------------------------------------------------------ scalar distances (float64)


def _unit(x):
    return x / torch.sqrt((x * x).sum())


def cos(a, b):
    return (_unit(a) * _unit(b)).sum()


def sqeuc(a, b):
    d = _unit(a) - _unit(b)
    return (d * d).sum()


def euc(a, b):
    return torch.sqrt(sqeuc(a, b) + 1e-30)


def snr(a, b):
    return torch.var(b - a) / torch.var(a)


def pairs(labels, ref_labels=None):
    """Explicit loop: list of (i, j, same) for every valid pair."""
    same_set = ref_labels is None
    ref_labels = labels if same_set else ref_labels
    out = []
    for i in range(len(labels)):
        for j in range(len(ref_labels)):
            if same_set and i == j:
                continue
            out.append((i, j, int(labels[i]) == int(ref_labels[j])))
    return out


def pairs_from_indices(indices):
    a1, p, a2, n = indices if len(indices) == 4 else (indices[0], indices[1], indices[0], indices[2])
    out = {(int(a), int(b), True) for a, b in zip(a1, p)}
    out |= {(int(a), int(b), False) for a, b in zip(a2, n)}
    return sorted(out)


def lse(values):
    return torch.logsumexp(torch.stack(values), 0)


# ------------------------------------------------------------------ loop references


def ref_ms(x, y, r=None, ry=None, alpha=2.0, beta=50.0, base=0.5, plist=None):
    r = x if r is None else r
    plist = pairs(y, ry) if plist is None else plist
    total = x.new_zeros(())
    for i in range(len(x)):
        ps = [cos(x[i], r[j]) for a, j, s in plist if a == i and s]
        ns = [cos(x[i], r[j]) for a, j, s in plist if a == i and not s]
        if ps:
            total = total + torch.log(1 + sum(torch.exp(-alpha * (v - base)) for v in ps)) / alpha
        if ns:
            total = total + torch.log(1 + sum(torch.exp(beta * (v - base)) for v in ns)) / beta
    return total / len(x)


def ref_ntxent(x, y, r=None, ry=None, tau=0.1, plist=None):
    r = x if r is None else r
    plist = pairs(y, ry) if plist is None else plist
    terms = []
    for i, p, s in plist:
        if not s:
            continue
        sp = cos(x[i], r[p]) / tau
        negs = [cos(x[i], r[n]) / tau for a, n, t in plist if a == i and not t]
        terms.append(-(sp - lse([sp, *negs])))
    return torch.stack(terms).mean()


def ref_supcon(x, y, r=None, ry=None, tau=0.1, plist=None):
    r = x if r is None else r
    plist = pairs(y, ry) if plist is None else plist
    per = []
    for i in range(len(x)):
        allv = [cos(x[i], r[j]) / tau for a, j, s in plist if a == i]
        posv = [cos(x[i], r[j]) / tau for a, j, s in plist if a == i and s]
        if posv:
            den = lse(allv)
            per.append(-sum(v - den for v in posv) / len(posv))
    return torch.stack(per).mean()


def ref_snr(x, y, pos_margin=0.0, neg_margin=1.0, lam=0.001):
    pl, nl = [], []
    for i, j, s in pairs(y):
        d = snr(x[i], x[j])
        (pl if s else nl).append(F.relu(d - pos_margin) if s else F.relu(neg_margin - d))

    def nz(v):
        if not v:
            return x.new_zeros(())
        cnt = sum(1 for t in v if t > 0)
        return sum(v) / max(cnt, 1)

    reg = sum(torch.abs(x[i].sum()) for i in range(len(x))) / len(x)
    return nz(pl) + nz(nl) + lam * reg


def ref_nca(x, y, scale=1.0, r=None, ry=None):
    r = x if r is None else r
    plist = pairs(y, ry)
    per = []
    for i in range(len(x)):
        num = [torch.exp(-scale * sqeuc(x[i], r[j])) for a, j, s in plist if a == i and s]
        den = [torch.exp(-scale * sqeuc(x[i], r[j])) for a, j, s in plist if a == i]
        if num:
            per.append(-torch.log(sum(num) / sum(den)))
    return torch.stack(per).mean()


def ref_dbl(x, y, m=1.0, balanced=False):
    pl, nl = [], []
    c = torch.tensor(m, dtype=x.dtype)
    for i, j, s in pairs(y):
        d = euc(x[i], x[j])
        p = (1 + torch.exp(-c)) / (1 + torch.exp(d - c))
        (pl if s else nl).append(-torch.log(p) if s else -torch.log(1 - p))
    if balanced:
        parts = [sum(v) / len(v) for v in (pl, nl) if v]
        return sum(parts) / len(parts)
    allv = pl + nl
    return sum(allv) / len(allv)


def ref_cc(x, y, margin=1.0, dist="sqeuc"):
    xn = torch.stack([_unit(v) for v in x])
    total, count = x.new_zeros(()), 0
    for k in sorted(set(y.tolist())):
        members = [i for i in range(len(x)) if int(y[i]) == k]
        negs = [j for j in range(len(x)) if int(y[j]) != k]
        if not negs:
            continue
        c = sum(xn[i] for i in members) / len(members)

        def d(u, c=c):
            if dist == "sqeuc":
                diff = u - c
                return (diff * diff).sum()
            return -cos(c, u)  # cosine: distance-like "minus similarity"

        hardest = min(negs, key=lambda j: float(d(xn[j]).detach()))
        for i in members:
            total = total + F.relu(margin + d(xn[i]) - d(xn[hardest]))
            count += 1
    return total / count


# ------------------------------------------------------------------ harness

LABELSETS = {
    "several_classes": torch.tensor([0, 0, 1, 1, 1, 2, 2, 3, 3, 0]),
    "one_class": torch.tensor([5, 5, 5, 5, 5, 5]),
    "singletons": torch.tensor([0, 1, 2, 3, 4, 5, 6]),
    "mixed_singletons": torch.tensor([0, 0, 1, 2, 3, 3, 3, 4]),
}


def _x(n, d=5, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64) * scale


# (loss factory, reference, labelsets where the loss is non-empty)
CASES = {
    "ms": (lambda: MultiSimilarityLoss(), ref_ms),
    "ms_params": (lambda: MultiSimilarityLoss(alpha=3, beta=10, base=0.3),
                  lambda x, y: ref_ms(x, y, alpha=3, beta=10, base=0.3)),
    "ntxent": (lambda: NTXentLoss(), ref_ntxent),
    "ntxent_t05": (lambda: NTXentLoss(temperature=0.5), lambda x, y: ref_ntxent(x, y, tau=0.5)),
    "supcon": (lambda: SupConLoss(), ref_supcon),
    "snr": (lambda: SNRContrastiveLoss(), ref_snr),
    "snr_margins": (lambda: SNRContrastiveLoss(pos_margin=0.2, neg_margin=2.0, regularizer_weight=0.1),
                    lambda x, y: ref_snr(x, y, 0.2, 2.0, 0.1)),
    "nca": (lambda: NCALoss(), ref_nca),
    "nca_scale": (lambda: NCALoss(scale=4.0), lambda x, y: ref_nca(x, y, scale=4.0)),
    "dbl": (lambda: DistanceLogisticLoss(), ref_dbl),
    "dbl_balanced": (lambda: DistanceLogisticLoss(margin=0.7, reduction="balanced"),
                     lambda x, y: ref_dbl(x, y, m=0.7, balanced=True)),
    "cc": (lambda: CoupledClustersLoss(), ref_cc),
    "cc_cosine": (lambda: CoupledClustersLoss(margin=0.3, distance=CosineSimilarity()),
                  lambda x, y: ref_cc(x, y, margin=0.3, dist="cos")),
}


def _expect_empty(name, labelset):
    """Label sets on which a loss has no valid pair/anchor and must return zero_loss."""
    no_pos = labelset == "singletons"
    no_neg = labelset == "one_class"
    if name.startswith(("ntxent", "supcon", "nca")):
        return no_pos
    if name.startswith("cc"):
        return no_neg
    return False


@pytest.mark.parametrize("labelset", sorted(LABELSETS))
@pytest.mark.parametrize("name", sorted(CASES))
def test_value_and_gradient_match_loop_reference(name, labelset):
    make, ref = CASES[name]
    y = LABELSETS[labelset]
    x = _x(len(y), seed=zlib.crc32(f"{name}/{labelset}".encode()) % 1000)
    loss = make()
    if _expect_empty(name, labelset):
        v, g = _value_and_grad(lambda t: loss(t, y), x)
        assert float(v) == 0.0 and torch.all(g == 0)
        assert loss.num_empty_batches == 1
        return
    assert_matches(lambda t: loss(t, y), lambda t: ref(t, y), x)
    assert loss.num_empty_batches == 0


@pytest.mark.parametrize("name", ["ms", "ntxent", "supcon", "snr", "nca", "dbl", "cc"])
def test_gradcheck(name):
    make, _ = CASES[name]
    loss = make()
    y = torch.tensor([0, 0, 1, 1, 2, 2])
    x = _x(6, d=4, seed=3).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: loss(t, y), (x,), eps=1e-6, atol=1e-5)


@pytest.mark.parametrize("name", sorted(CASES))
def test_empty_batch_zero_with_gradient(name):
    """No pair: zero with a zero gradient, except SNR's zero-mean regulariser on a batch of one
    (``lambda * mean_i |sum_k h_ik|`` needs no pair; Yuan et al. 2019, and the peer adds it)."""
    loss = CASES[name][0]()
    for x, y in ((_x(1), torch.tensor([3])), (_x(0), torch.zeros(0, dtype=torch.long))):
        x = x.requires_grad_(True)
        out = loss(x, y)
        out.backward()
        if name.startswith("snr") and len(y) == 1:
            want = loss.regularizer_weight * x.detach().sum(1).abs().mean()
            assert torch.allclose(out.detach(), want, rtol=1e-6, atol=0)
            assert torch.allclose(x.grad, loss.regularizer_weight * torch.sign(x.detach().sum(1, keepdim=True))
                                  .expand_as(x))
            continue
        assert float(out.detach()) == 0.0
        assert x.grad is not None and torch.all(x.grad == 0)
    assert loss.num_empty_batches == 2


@pytest.mark.parametrize("name", sorted(CASES))
def test_bfloat16_and_float32_finite(name):
    loss = CASES[name][0]()
    y = torch.randint(0, 8, (64,), generator=torch.Generator().manual_seed(1))
    ref_val = None
    for dtype in (torch.float32, torch.bfloat16):
        x = _x(64, d=16, seed=2).to(dtype).requires_grad_(True)
        out = loss(x, y)
        out.backward()
        assert torch.isfinite(out) and torch.isfinite(x.grad.float()).all()
        if ref_val is None:
            ref_val = float(out.detach())
        else:  # bf16 rounding of the inputs only: loss close to float32's
            assert abs(float(out.detach()) - ref_val) < 0.05 * max(1.0, abs(ref_val))


def test_large_scales_no_nan():
    y = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    x = _x(8, d=6, seed=4, scale=50.0).requires_grad_(True)
    for loss in (
        MultiSimilarityLoss(alpha=200, beta=5000),
        NTXentLoss(temperature=1e-4),
        SupConLoss(temperature=1e-4),
        NCALoss(scale=1e5),
        NCALoss(scale=1e3, distance=LpDistance(power=2, normalize_embeddings=False)),
        DistanceLogisticLoss(margin=80.0, distance=LpDistance(normalize_embeddings=False)),
    ):
        x.grad = None
        out = loss(x, y)
        out.backward()
        assert torch.isfinite(out), type(loss).__name__
        assert torch.isfinite(x.grad).all(), type(loss).__name__


def test_dbl_negative_at_zero_distance_is_finite():
    x = torch.tensor([[1.0, 0.0], [1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    out = DistanceLogisticLoss()(x, torch.tensor([0, 1]))
    out.backward()
    assert torch.isfinite(out) and out > 10 and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("min_distance", [1e-6, 0.5, 2.0])
@pytest.mark.parametrize("d", [0.25, 1.0, 3.0])
def test_dbl_min_distance_clamps_every_term(min_distance, d):
    """A negative pair at distance ``d`` costs -log(1 - p(max(d, min_distance))) (float64
    oracle): never negative, and flat (zero gradient) below the clamp."""
    m = 1.0
    loss = DistanceLogisticLoss(
        margin=m, min_distance=min_distance, distance=LpDistance(normalize_embeddings=False)
    )
    x = torch.tensor([[0.0], [d]], dtype=torch.float64, requires_grad=True)
    out = loss(x, torch.tensor([0, 1]))
    (grad,) = torch.autograd.grad(out, x)
    d_c = max(d, min_distance)
    p = (1 + math.exp(-m)) / (1 + math.exp(d_c - m))
    assert float(out) == pytest.approx(-math.log1p(-p), rel=1e-10)
    if d < min_distance:
        assert float(grad[1, 0]) == 0.0
    else:
        assert float(grad[1, 0]) < 0.0  # pushes the negative away


# ------------------------------------------------------------------ miner indices and ref_emb

MINED_PAIRS = (
    torch.tensor([0, 2, 3, 5]),
    torch.tensor([1, 3, 4, 6]),
    torch.tensor([0, 0, 2, 3, 5, 7]),
    torch.tensor([2, 7, 5, 0, 1, 4]),
)
MINED_TRIPLETS = (torch.tensor([0, 2, 3, 5]), torch.tensor([1, 4, 4, 6]), torch.tensor([7, 0, 1, 2]))
MINER_LABELS = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3])


@pytest.mark.parametrize("indices", [MINED_PAIRS, MINED_TRIPLETS], ids=["pairs", "triplets"])
@pytest.mark.parametrize("name", ["ms", "ntxent", "supcon"])
def test_miner_indices(name, indices):
    y = MINER_LABELS
    x = _x(len(y), seed=5)
    plist = pairs_from_indices(indices)
    loss = CASES[name][0]()
    ref = {"ms": ref_ms, "ntxent": ref_ntxent, "supcon": ref_supcon}[name]
    assert_matches(lambda t: loss(t, y, indices), lambda t: ref(t, y, plist=plist), x)


def test_miner_indices_nca_restricts_softmax():
    y = MINER_LABELS
    x = _x(len(y), seed=6)
    plist = pairs_from_indices(MINED_PAIRS)

    def ref(t):
        per = []
        for i in range(len(t)):
            num = [torch.exp(-sqeuc(t[i], t[j])) for a, j, s in plist if a == i and s]
            den = [torch.exp(-sqeuc(t[i], t[j])) for a, j, s in plist if a == i]
            if num:
                per.append(-torch.log(sum(num) / sum(den)))
        return torch.stack(per).mean()

    assert_matches(lambda t: NCALoss()(t, y, MINED_PAIRS), ref, x)


def test_bad_indices_raise():
    y = MINER_LABELS
    x = _x(len(y))
    with pytest.raises(ShapeError):
        NTXentLoss()(x, y, (torch.tensor([0]), torch.tensor([99]), torch.tensor([0])))
    with pytest.raises(ShapeError):
        NTXentLoss()(x, y, (torch.tensor([0]),))
    with pytest.raises(ConfigError):
        CoupledClustersLoss()(x, y, MINED_TRIPLETS)


@pytest.mark.parametrize("name", ["ms", "ntxent", "supcon", "nca"])
def test_ref_emb(name):
    y = torch.tensor([0, 0, 1, 2, 2])
    ry = torch.tensor([0, 1, 1, 2, 3, 3, 0])
    x, r = _x(len(y), seed=7), _x(len(ry), seed=8)
    loss = CASES[name][0]()
    ref = {"ms": ref_ms, "ntxent": ref_ntxent, "supcon": ref_supcon, "nca": ref_nca}[name]
    rr = r.detach().clone()
    assert_matches(lambda t: loss(t, y, ref_emb=rr, ref_labels=ry), lambda t: ref(t, y, r=rr, ry=ry), x)


def test_coupled_clusters_ref_emb_supplies_negatives():
    y = torch.tensor([0, 0, 1, 1])
    x = _x(4, seed=9)
    far = _x(3, seed=10)
    ry = torch.tensor([2, 3, 4])
    loss = CoupledClustersLoss()
    # negatives only from the reference set: check against the loop with the ref as negatives
    xn = torch.stack([_unit(v) for v in x])
    rn = torch.stack([_unit(v) for v in far])
    total = 0.0
    for k in (0, 1):
        members = [i for i in range(4) if int(y[i]) == k]
        c = xn[members].mean(0)
        dn = min(float(((rn[j] - c) ** 2).sum()) for j in range(3))
        for i in members:
            total += max(0.0, 1.0 + float(((xn[i] - c) ** 2).sum()) - dn)
    assert math.isclose(float(loss(x, y, ref_emb=far, ref_labels=ry)), total / 4, rel_tol=1e-9)


def test_registry_and_config_errors():
    assert isinstance(get_loss("multi_similarity"), MultiSimilarityLoss)
    assert isinstance(get_loss("ntxent", temperature=0.2), NTXentLoss)
    assert isinstance(get_loss("supcon"), SupConLoss)
    assert isinstance(get_loss("snr_contrastive"), SNRContrastiveLoss)
    assert isinstance(get_loss("nca"), NCALoss)
    assert isinstance(get_loss("distance_logistic"), DistanceLogisticLoss)
    assert isinstance(get_loss("coupled_clusters"), CoupledClustersLoss)
    with pytest.raises(ConfigError):
        SNRContrastiveLoss(distance="cosine")
    with pytest.raises(ConfigError):
        DistanceLogisticLoss(distance="cosine")
    with pytest.raises(ConfigError):
        NTXentLoss(temperature=0)
    with pytest.raises(ConfigError):
        MultiSimilarityLoss(alpha=-1)


def test_ntxent_memory_is_quadratic_not_pos_times_neg():
    """B = 1024 with 4 per class: pml's (pos pairs x neg pairs) mask would be 3072 x ~1M."""
    y = torch.arange(1024) // 4
    x = torch.randn(1024, 32, requires_grad=True)
    out = NTXentLoss()(x, y)
    out.backward()
    assert torch.isfinite(out) and torch.isfinite(x.grad).all()


# ------------------------------------------------------------------ pytorch-metric-learning

pml_losses = pytest.importorskip("pytorch_metric_learning.losses")
pml_distances = pytest.importorskip("pytorch_metric_learning.distances")
pml_regs = pytest.importorskip("pytorch_metric_learning.regularizers")


def _pml_cases():
    return {
        "ms": (MultiSimilarityLoss(), pml_losses.MultiSimilarityLoss()),
        "ms_params": (MultiSimilarityLoss(alpha=3, beta=10, base=0.3),
                      pml_losses.MultiSimilarityLoss(alpha=3, beta=10, base=0.3)),
        "ntxent": (NTXentLoss(temperature=0.07), pml_losses.NTXentLoss(temperature=0.07)),
        "supcon": (SupConLoss(temperature=0.1), pml_losses.SupConLoss(temperature=0.1)),
        "nca": (NCALoss(scale=2.0), pml_losses.NCALoss(softmax_scale=2.0)),
        "snr": (
            SNRContrastiveLoss(regularizer_weight=0.01),
            pml_losses.SignalToNoiseRatioContrastiveLoss(
                distance=pml_distances.SNRDistance(normalize_embeddings=False),
                embedding_regularizer=pml_regs.ZeroMeanRegularizer(),
                embedding_reg_weight=0.01,
            ),
        ),
    }


@pytest.mark.parametrize("name", ["ms", "ms_params", "ntxent", "supcon", "nca", "snr"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_equals_pytorch_metric_learning(name, dtype):
    ours, theirs = _pml_cases()[name]
    y = torch.randint(0, 6, (48,), generator=torch.Generator().manual_seed(11))
    x = _x(48, d=16, seed=12).to(dtype)
    v1, g1 = _value_and_grad(lambda t: ours(t, y), x)
    v2, g2 = _value_and_grad(lambda t: theirs(t, y), x)
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    assert abs(float(v1) - float(v2)) <= tol * max(1.0, abs(float(v2))), (float(v1), float(v2))
    assert torch.allclose(g1, g2, atol=tol, rtol=1e-4 if dtype == torch.float32 else 1e-8)


@pytest.mark.parametrize("name", ["ms", "ntxent", "supcon"])
def test_equals_pml_with_ref_emb(name):
    ours, theirs = _pml_cases()[name]
    y = torch.randint(0, 4, (20,), generator=torch.Generator().manual_seed(13))
    ry = torch.randint(0, 4, (30,), generator=torch.Generator().manual_seed(14))
    x, r = _x(20, d=8, seed=15), _x(30, d=8, seed=16)
    a = ours(x, y, ref_emb=r, ref_labels=ry)
    b = theirs(x, y, ref_emb=r, ref_labels=ry)
    assert abs(float(a) - float(b)) < 1e-10


def test_nca_underflow_fallback_is_exact():
    """At scale 300 the same-class softmax mass underflows in float32 for some anchors: the
    exact per-row log-sum-exp path must then agree with a float64 log-space reference."""
    y = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    x64 = _x(8, d=6, seed=40)
    scale = 300.0

    def ref(t):
        per = []
        for i in range(len(t)):
            allv = [-scale * sqeuc(t[i], t[j]) for j in range(len(t)) if j != i]
            posv = [-scale * sqeuc(t[i], t[j]) for j in range(len(t)) if j != i and y[j] == y[i]]
            per.append(lse(allv) - lse(posv))
        return torch.stack(per).mean()

    x32 = x64.float().requires_grad_(True)
    out = NCALoss(scale=scale)(x32, y)
    out.backward()
    xr = x64.clone().requires_grad_(True)
    expect = ref(xr)
    expect.backward()
    assert float(expect.detach()) > 50  # deep in the underflow regime of exp in float32
    assert abs(float(out.detach()) - float(expect.detach())) < 1e-4 * float(expect.detach())
    assert torch.allclose(x32.grad.double(), xr.grad, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("name", ["ms", "ntxent", "supcon", "nca", "snr", "dbl"])
@pytest.mark.parametrize("labelset", ["several_classes", "one_class", "mixed_singletons"])
def test_label_path_equals_all_pairs_indices(name, labelset):
    """The label fast paths give the same value and gradient as the mask path fed all pairs."""
    y = LABELSETS[labelset]
    same = y[:, None] == y[None]
    a1, p = (same & ~torch.eye(len(y), dtype=torch.bool)).nonzero(as_tuple=True)
    a2, n = (~same).nonzero(as_tuple=True)
    loss = CASES[name][0]()
    x = _x(len(y), seed=41)
    if name in ("ntxent", "supcon", "nca") and len(a1) == 0:
        return
    assert_matches(lambda t: loss(t, y), lambda t: loss(t, y, (a1, p, a2, n)), x)
