"""Ranked List loss (Wang et al., CVPR 2019, arXiv:1903.03238; issue 19, point 1).

Checked against the paper's formula on a hand-computed batch, against a float64 loop
reference (value and gradient; with miner indices and a reference set), against
pytorch-metric-learning's ``RankedListLoss`` (the loop reference with pml's two deviations
switched on reproduces pml exactly; switched off it reproduces dmlkit), and on the batches
where a careless implementation returns NaN.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from _reference import LABEL_SETS, assert_value_and_grad_match, batch
from _reference import unit as _norm
from dmlkit.exceptions import ConfigError
from dmlkit.losses import RankedListLoss, get_loss


def _dist(u, v):
    return ((_norm(u) - _norm(v)) ** 2).sum().clamp_min(1e-30).sqrt()


def ref_ranked_list(x, y, margin=0.4, alpha=None, Tn=10.0, Tp=0.0, imbalance=0.5, r=None,
                    ry=None, pairs=None, eps_per_column=0.0, skip_zero_negative=False,
                    detach_weights=False):
    """Loop over anchors of the paper's L = 1/B sum_i (1 - lambda) L_P(i) + lambda L_N(i).

    ``pairs`` = {anchor: (positives, negatives)} restricts the candidates (miner indices).
    ``eps_per_column`` / ``skip_zero_negative`` add pml's deviations: ``eps`` added to the
    weight sum once per reference column, and negatives at distance exactly 0 ignored.
    """
    alpha = 1 + margin / 2 if alpha is None else alpha
    ref, ry_ = (x, y) if r is None else (r, ry)
    total = 0
    for i in range(len(x)):
        if pairs is None:
            cand_p = [j for j in range(len(ref)) if ry_[j] == y[i] and (r is not None or j != i)]
            cand_n = [j for j in range(len(ref)) if ry_[j] != y[i]]
        else:
            cand_p, cand_n = pairs.get(i, ([], []))
        terms = []
        for cands, temp, excess_of, keep in (
            (cand_p, Tp, lambda d: d - (alpha - margin), lambda d: True),
            (cand_n, Tn, lambda d: alpha - d, lambda d: not (skip_zero_negative and d == 0)),
        ):
            num, den = 0, eps_per_column * len(ref)
            for j in cands:
                d = _dist(x[i], ref[j])
                excess = excess_of(d)
                if excess > 0 and keep(d):
                    w = torch.exp(temp * (excess.detach() if detach_weights else excess))
                    num, den = num + w * excess, den + w
            terms.append(num / den if torch.is_tensor(num) else x.sum() * 0)
        total = total + (1 - imbalance) * terms[0] + imbalance * terms[1]
    return total / len(x)


def test_hand_computed_batch_follows_the_paper():
    # unit vectors a=(1,0), b=(0,1) of class 0 and c=(-1,0), d=(0.6,0.8) of class 1:
    # |ab| = |bc| = sqrt 2, |ac| = 2, |ad| = sqrt 0.8, |bd| = sqrt 0.4, |cd| = sqrt 3.2
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.6, 0.8]], dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 1])
    alpha, bound = 1.2, 0.8  # margin 0.4: positives beyond 0.8, negatives within 1.2
    s2, s08, s04, s32 = math.sqrt(2), math.sqrt(0.8), math.sqrt(0.4), math.sqrt(3.2)
    # anchor a: positive b (beyond 0.8), negative d only (c is at 2 > 1.2): single-element sets
    l_a = 0.5 * (s2 - bound) + 0.5 * (alpha - s08)
    l_b = 0.5 * (s2 - bound) + 0.5 * (alpha - s04)  # negative d only (c at sqrt 2 > 1.2)
    l_c = 0.5 * (s32 - bound) + 0.5 * 0.0  # no negative within 1.2
    # anchor d: negatives a and b, weighted by exp(Tn (alpha - d)) with Tn = 1
    wa, wb = math.exp(alpha - s08), math.exp(alpha - s04)
    l_n = (wa * (alpha - s08) + wb * (alpha - s04)) / (wa + wb)
    l_d = 0.5 * (s32 - bound) + 0.5 * l_n
    expected = (l_a + l_b + l_c + l_d) / 4
    loss = RankedListLoss(margin=0.4, Tn=1.0, Tp=0.0, imbalance=0.5)
    assert loss(x, y).item() == pytest.approx(expected, rel=1e-12)
    # positives weighted too (Tp = 2): anchors c and d have one positive each, a and b one:
    # single-element weighted means, so only lambda changes the value
    lam = RankedListLoss(margin=0.4, Tn=1.0, Tp=2.0, imbalance=0.25)(x, y).item()
    expected_lam = (0.75 * (2 * (s2 - bound) + 2 * (s32 - bound))
                    + 0.25 * ((alpha - s08) + (alpha - s04) + l_n)) / 4
    assert lam == pytest.approx(expected_lam, rel=1e-12)


@pytest.mark.parametrize("labels", list(LABEL_SETS))
@pytest.mark.parametrize("params", [
    {},
    {"Tp": 3.0, "Tn": 5.0, "imbalance": 0.3},
    {"margin": 0.6, "alpha": 1.0, "Tn": 0.0},
    {"Tp": 2.0, "detach_weights": True},
])
def test_matches_loop_reference(labels, params):
    x, y = batch(LABEL_SETS[labels], seed=31)
    loss = RankedListLoss(**params)
    assert_value_and_grad_match(lambda e: loss(e, y), lambda e: ref_ranked_list(e, y, **params), x)


def test_with_indices_and_reference_set():
    x, y = batch(LABEL_SETS["several"], seed=32)
    loss = RankedListLoss(Tp=1.0)
    a1, p = torch.tensor([0, 0, 5]), torch.tensor([1, 2, 6])
    a2, n = torch.tensor([0, 5, 5, 8]), torch.tensor([3, 0, 9, 4])
    pairs = {0: ([1, 2], [3]), 5: ([6], [0, 9]), 8: ([], [4])}
    assert_value_and_grad_match(lambda e: loss(e, y, indices=(a1, p, a2, n)),
                                lambda e: ref_ranked_list(e, y, Tp=1.0, pairs=pairs), x)
    r, ry = batch([0, 1, 1, 2, 3, 0, 4], seed=33)
    torch.testing.assert_close(loss(x, y, ref_emb=r, ref_labels=ry),
                               ref_ranked_list(x, y, Tp=1.0, r=r, ry=ry))


pml = pytest.importorskip("pytorch_metric_learning")


@pytest.mark.parametrize("params", [{"Tn": 10.0}, {"Tn": 5.0, "Tp": 2.0, "imbalance": 0.3},
                                    {"Tn": 1.0, "alpha": 1.0, "margin": 0.2}])
def test_equal_to_pml_up_to_its_documented_deviations(params):
    from pytorch_metric_learning.losses import RankedListLoss as PeerLoss

    g = torch.Generator().manual_seed(34)
    x = torch.randn(24, 8, generator=g, dtype=torch.float64)
    y = torch.arange(6).repeat_interleave(4)
    kwargs = {"margin": 0.4, **params}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # pml warns about temperatures above 5
        peer = PeerLoss(**kwargs)
    # pml = the paper's formula with 1e-5 added per column to the weight sums
    assert_value_and_grad_match(
        lambda e: peer(e, y),
        lambda e: ref_ranked_list(e, y, **kwargs, eps_per_column=1e-5, skip_zero_negative=True),
        x,
    )
    # dmlkit = the paper's formula; the two differ by about 1e-5 B / sum(w) per anchor
    ours = RankedListLoss(**kwargs)
    assert_value_and_grad_match(lambda e: ours(e, y), lambda e: ref_ranked_list(e, y, **kwargs), x)
    gap = abs(ours(x, y).item() - peer(x, y).item())
    assert gap < 1e-5 * len(y)


def test_negative_at_distance_zero_counts():
    # a negative identical to the anchor is the worst violation: dmlkit counts alpha - 0
    from pytorch_metric_learning.losses import RankedListLoss as PeerLoss

    x = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]], dtype=torch.float64)
    y = torch.tensor([0, 1, 0, 1])
    ours = RankedListLoss(margin=0.4, Tn=0.0, Tp=0.0, imbalance=1.0)  # negative term only
    # anchor 0: negatives 1 (d = 0) and 3 (d = sqrt 2 > 1.2, not selected); same for the rest
    assert ours(x, y).item() == pytest.approx(1.2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert PeerLoss(margin=0.4, Tn=0.0, imbalance=1.0)(x, y).item() == pytest.approx(0.0)


@pytest.mark.parametrize("labels", [
    [0, 0, 1, 1],  # tight classes far apart: no positive beyond, no negative within
    [3, 3, 3, 3],  # a single class: no negatives
    [0, 1, 2, 3],  # one sample per class: no positives
])
def test_no_selected_pair_is_zero_with_finite_gradient(labels):
    if labels == [0, 0, 1, 1]:
        x = torch.tensor([[1.0, 0.0], [1.0, 0.01], [-1.0, 0.0], [-1.0, 0.01]])
    else:
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(35))
    x.requires_grad_(True)
    loss = RankedListLoss(Tp=1.0)
    out = loss(x, torch.tensor(labels))
    out.backward()
    assert torch.isfinite(out) and torch.isfinite(x.grad).all()
    if labels == [0, 0, 1, 1]:
        assert out.item() == 0.0 and (x.grad == 0).all()


def test_large_temperatures_do_not_overflow():
    x, y = batch(LABEL_SETS["several"], seed=36, dtype=torch.float32)
    x.requires_grad_(True)
    out = RankedListLoss(Tn=1e4, Tp=1e4)(x, y)
    out.backward()
    assert torch.isfinite(out) and torch.isfinite(x.grad).all()
    # (a naive exp(1e4 * excess) is inf); at a huge temperature each weighted mean is the
    # largest violation of its set
    e = x.detach().double()
    total = 0.0
    for i in range(len(y)):
        d = [_dist(e[i], e[j]).item() for j in range(len(y))]
        pos = [d[j] - 0.8 for j in range(len(y)) if y[j] == y[i] and j != i and d[j] > 0.8]
        neg = [1.2 - d[j] for j in range(len(y)) if y[j] != y[i] and d[j] < 1.2]
        total += 0.5 * max(pos, default=0.0) + 0.5 * max(neg, default=0.0)
    assert out.item() == pytest.approx(total / len(y), rel=1e-4)


def test_config_and_invalid_arguments():
    loss = get_loss("ranked_list", margin=0.2, Tn=5, Tp=1, imbalance=0.7)
    assert (loss.alpha, loss.Tn, loss.Tp, loss.imbalance) == (1.1, 5.0, 1.0, 0.7)
    for bad in ({"imbalance": 1.5}, {"Tn": -1.0}, {"margin": -0.1}, {"distance": "cosine"}):
        with pytest.raises(ConfigError):
            RankedListLoss(**bad)


def test_built_from_a_yaml_loss_section():
    import yaml

    from dmlkit.config import LossConfig
    from dmlkit.training import build_loss

    section = LossConfig(**yaml.safe_load(
        "name: ranked_list\nparams: {margin: 0.4, Tn: 10, Tp: 0, imbalance: 0.5}\n"))
    loss = build_loss(section, num_classes=4, embedding_size=8)
    assert isinstance(loss, RankedListLoss) and loss.alpha == pytest.approx(1.2)
    x, y = batch(LABEL_SETS["several"], seed=37)
    assert loss(x, y).item() == pytest.approx(ref_ranked_list(x, y).item(), rel=1e-12)
