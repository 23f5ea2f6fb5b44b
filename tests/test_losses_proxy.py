"""ProxyNCA, ProxyAnchor and SoftTriple against slow loop references and the peer library."""

from __future__ import annotations

import math

import pytest
import torch

from _reference import (
    check_bfloat16_close_to_float32,
    check_finite_with_gradients,
    check_gradcheck,
    check_matches_loop_reference,
    check_proxy_loss_errors_and_empty_batch,
    dot,
    needs_pml,
    pml_losses,
)
from dmlkit.exceptions import ConfigError
from dmlkit.losses import get_loss
from dmlkit.losses.proxy_losses import ProxyAnchorLoss, ProxyNCALoss, SoftTripleLoss

NAMES = ["proxy_nca", "proxy_anchor", "soft_triple"]


# ------------------------------------------------------------------ slow references (loops)
def _unit(a):
    n = torch.sqrt(dot(a, a))
    return [a[d] / n for d in range(len(a))]


def _cos(a, b):
    return dot(_unit(a), _unit(b))


def _sqdist_normalized(a, b):
    ua, ub = _unit(a), _unit(b)
    return sum((ua[d] - ub[d]) ** 2 for d in range(len(a)))


def _log_sum_exp(values):
    top = max(float(v.detach()) for v in values)
    return top + torch.log(sum(torch.exp(v - top) for v in values))


def ref_proxy_nca(x, labels, proxies, scale, exclude_positive=False, distance="sqeuclidean"):
    """-log( exp(-s d(x, p_y)) / sum_{z in Z} exp(-s d(x, p_z)) ), one sample at a time."""
    losses = []
    for i in range(len(x)):
        y = int(labels[i])
        if distance == "sqeuclidean":
            logits = [-scale * _sqdist_normalized(x[i], proxies[j]) for j in range(len(proxies))]
        else:  # cosine
            logits = [scale * _cos(x[i], proxies[j]) for j in range(len(proxies))]
        denom = [z for j, z in enumerate(logits) if not (exclude_positive and j == y)]
        losses.append(-logits[y] + _log_sum_exp(denom))
    return sum(losses) / len(losses)


def ref_proxy_anchor(x, labels, proxies, alpha, delta):
    """Kim et al. 2020, with explicit sums over proxies and samples."""
    num_classes = len(proxies)
    pos_total, neg_total, with_pos = 0.0, 0.0, 0
    for c in range(num_classes):
        pos = [
            torch.exp(-alpha * (_cos(x[i], proxies[c]) - delta))
            for i in range(len(x))
            if int(labels[i]) == c
        ]
        neg = [
            torch.exp(alpha * (_cos(x[i], proxies[c]) + delta))
            for i in range(len(x))
            if int(labels[i]) != c
        ]
        if pos:
            with_pos += 1
            pos_total = pos_total + torch.log(1 + sum(pos))
        if neg:
            neg_total = neg_total + torch.log(1 + sum(neg))
    return pos_total / with_pos + neg_total / num_classes


def ref_soft_triple(x, labels, centers, num_classes, k, la, gamma, tau, delta):
    """Qian et al. 2019 and the regulariser of its code, loops over classes and centres."""
    losses = []
    for i in range(len(x)):
        y = int(labels[i])
        logits = []
        for c in range(num_classes):
            sims = [_cos(x[i], centers[c * k + t]) for t in range(k)]
            weights = [torch.exp(s / gamma) for s in sims]
            total = sum(weights)
            s_ic = sum(w / total * s for w, s in zip(weights, sims))
            logits.append(la * (s_ic - delta) if c == y else la * s_ic)
        losses.append(-logits[y] + _log_sum_exp(logits))
    loss = sum(losses) / len(losses)
    if tau > 0 and k > 1:
        reg = 0.0
        for c in range(num_classes):
            for t in range(k):
                for u in range(t + 1, k):
                    g = _cos(centers[c * k + t], centers[c * k + u])
                    reg = reg + torch.sqrt(2 + 1e-5 - 2 * g)
        loss = loss + tau * reg / (num_classes * k * (k - 1))
    return loss


def _reference(loss, x, labels, params):
    if isinstance(loss, ProxyNCALoss):
        dist = "sqeuclidean" if not loss.distance.higher_is_closer else "cosine"
        return ref_proxy_nca(x, labels, params["proxies"], loss.scale, loss.exclude_positive, dist)
    if isinstance(loss, ProxyAnchorLoss):
        return ref_proxy_anchor(x, labels, params["proxies"], loss.alpha, loss.margin)
    return ref_soft_triple(
        x,
        labels,
        params["centers"],
        loss.num_classes,
        loss.centers_per_class,
        loss.la,
        loss.gamma,
        loss.tau,
        loss.margin,
    )


def _batch(kind: str, num_classes: int = 5, dim: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if kind == "several":
        labels = torch.tensor([0, 1, 2, 0, 1, 3, 1, 2, 0])
    elif kind == "one_class":
        labels = torch.full((6,), 2)
    elif kind == "singletons":
        labels = torch.randperm(num_classes, generator=g)[:4]
    else:
        raise ValueError(kind)
    return torch.randn(len(labels), dim, generator=g, dtype=torch.float64), labels


CASES = [
    ("proxy_nca", {}),
    ("proxy_nca", {"scale": 3.0, "exclude_positive": True}),
    ("proxy_nca", {"scale": 8.0, "distance": "cosine"}),
    ("proxy_anchor", {"alpha": 4.0}),
    ("proxy_anchor", {}),
    ("soft_triple", {"centers_per_class": 3}),
    ("soft_triple", {"centers_per_class": 1, "la": 5.0}),
    ("soft_triple", {"centers_per_class": 2, "tau": 0.0, "gamma": 0.5}),
]


@pytest.mark.parametrize("kind", ["several", "one_class", "singletons"])
@pytest.mark.parametrize(("name", "kw"), CASES)
def test_value_and_gradient_match_loop_reference(name, kw, kind):
    torch.manual_seed(1)
    loss = get_loss(name, num_classes=5, embedding_size=4, **kw).double()
    x, labels = _batch(kind)
    check_matches_loop_reference(
        loss, x, labels, lambda x2, y, ref_params: _reference(loss, x2, y, ref_params)
    )


@pytest.mark.parametrize(("name", "kw"), CASES)
def test_gradcheck(name, kw):
    torch.manual_seed(2)
    check_gradcheck(get_loss(name, num_classes=3, embedding_size=3, **kw).double())


def test_soft_triple_regulariser_zero_when_centres_merge():
    loss = SoftTripleLoss(4, 8, centers_per_class=3, tau=0.2).double()
    with torch.no_grad():
        loss.centers.copy_(torch.randn(4, 1, 8, dtype=torch.float64).expand(4, 3, 8).reshape(12, 8))
    assert loss.regularizer().item() == pytest.approx(math.sqrt(1e-5) / 2, rel=1e-6)


def test_proxy_anchor_ignores_proxies_without_positives_in_positive_term():
    # Only class 0 in the batch: the positive term averages over one proxy, negatives over all.
    loss = ProxyAnchorLoss(3, 4).double()
    x = torch.randn(5, 4, dtype=torch.float64)
    labels = torch.zeros(5, dtype=torch.long)
    sim = (
        torch.nn.functional.normalize(x, dim=1)
        @ torch.nn.functional.normalize(loss.proxies, dim=1).T
    )
    pos = torch.log1p(torch.exp(-32 * (sim[:, 0] - 0.1)).sum())
    neg = torch.log1p(torch.exp(32 * (sim[:, 1:] + 0.1)).sum(0)).sum() / 3
    torch.testing.assert_close(loss(x, labels), pos + neg)


# ------------------------------------------------------------------ numerics
@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_finite_and_close_to_float32(name):
    torch.manual_seed(0)
    loss = get_loss(name, num_classes=10, embedding_size=32)
    x = torch.randn(64, 32)
    labels = torch.randint(0, 10, (64,))
    check_bfloat16_close_to_float32(loss, x, labels)


STRESS = [
    ("proxy_nca", {"scale": 1000.0}),
    ("proxy_nca", {"scale": 1000.0, "exclude_positive": True}),
    ("proxy_anchor", {"alpha": 1000.0, "margin": 0.5}),
    ("soft_triple", {"la": 1000.0, "gamma": 1e-3}),
]


@pytest.mark.parametrize(("name", "kw"), STRESS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_scale_stays_finite(name, kw, dtype):
    torch.manual_seed(0)
    loss = get_loss(name, num_classes=50, embedding_size=16, **kw).to(dtype)
    x = torch.randn(128, 16) * 100
    x[0] = 0.0
    labels = torch.randint(0, 50, (128,))
    check_finite_with_gradients(loss, x.to(dtype).requires_grad_(), labels)


# ------------------------------------------------------------------ peer library
@needs_pml
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("which", ["proxy_nca", "proxy_nca_scaled", "proxy_anchor", "soft_triple"])
def test_matches_pytorch_metric_learning(which, dtype):
    torch.manual_seed(0)
    c, d = 9, 16
    if which.startswith("proxy_nca"):
        s = 1.0 if which == "proxy_nca" else 9.0
        ours, theirs = ProxyNCALoss(c, d, scale=s), pml_losses.ProxyNCALoss(c, d, softmax_scale=s)
        ours, theirs = ours.to(dtype), theirs.to(dtype)
        theirs.proxies.data.copy_(ours.proxies.data)
    elif which == "proxy_anchor":
        ours, theirs = ProxyAnchorLoss(c, d), pml_losses.ProxyAnchorLoss(c, d, margin=0.1, alpha=32)
        ours, theirs = ours.to(dtype), theirs.to(dtype)
        theirs.proxies.data.copy_(ours.proxies.data)
    else:
        ours = SoftTripleLoss(c, d, tau=0.0)
        theirs = pml_losses.SoftTripleLoss(
            c, d, centers_per_class=10, la=20, gamma=0.1, margin=0.01
        )
        ours, theirs = ours.to(dtype), theirs.to(dtype)
        theirs.fc.data.copy_(ours.centers.data.T)
    x = torch.randn(64, d, dtype=dtype)
    labels = torch.randint(0, 6, (64,))  # some proxies without positives
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(ours(x, labels), theirs(x, labels), rtol=tol, atol=tol)


# ------------------------------------------------------------------ API and errors
@pytest.mark.parametrize("name", NAMES)
def test_errors_and_api(name):
    loss = get_loss(name, num_classes=4, embedding_size=8)
    check_proxy_loss_errors_and_empty_batch(loss, negative_labels=[-1, 1, 2])


@pytest.mark.parametrize("dim", [2, 7, 128])
@pytest.mark.parametrize("name", NAMES)
def test_proxies_learn_with_their_own_optimiser(name, dim):
    torch.manual_seed(0)
    loss = get_loss(name, num_classes=6, embedding_size=dim)
    x = torch.randn(24, dim)
    labels = torch.arange(24) % 6
    opt = torch.optim.Adam(loss.parameters(), lr=0.05)
    before = loss(x, labels).item()
    for _ in range(10):
        opt.zero_grad()
        loss(x, labels).backward()
        opt.step()
    assert loss(x, labels).item() < before


def test_bad_configs():
    with pytest.raises(ConfigError, match="similarity"):
        ProxyAnchorLoss(3, 4, distance="euclidean")
    with pytest.raises(ConfigError):
        ProxyNCALoss(1, 4, exclude_positive=True)
    with pytest.raises(ConfigError):
        SoftTripleLoss(3, 4, centers_per_class=0)
    with pytest.raises(ConfigError):
        SoftTripleLoss(3, 4, tau=-1)
    with pytest.raises(ConfigError):
        ProxyNCALoss(3, 4, scale=0)
    assert SoftTripleLoss(3, 4, centers_per_class=5).centers.shape == (15, 4)


def test_memory_is_b_by_classes():
    """No B x B intermediate: a batch of 4096 with 100 classes runs quickly in small memory."""
    torch.manual_seed(0)
    x = torch.randn(4096, 64, requires_grad=True)
    labels = torch.randint(0, 100, (4096,))
    for name in NAMES:
        loss = get_loss(name, num_classes=100, embedding_size=64)
        loss(x, labels).backward()
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("exclude_positive", [False, True])
def test_proxy_nca_fast_path_equals_distance_logits(exclude_positive):
    """The unit squared-Euclidean shortcut (2 s cos) gives the loss of the public logits."""
    loss = ProxyNCALoss(6, 5, scale=3.0, exclude_positive=exclude_positive).double()
    x = torch.randn(10, 5, dtype=torch.float64)
    labels = torch.arange(10) % 6
    logits = loss.get_logits(x)  # -3 |x - p|^2
    if exclude_positive:
        pos = logits.gather(1, labels[:, None]).squeeze(1)
        others = logits.scatter(1, labels[:, None], float("-inf"))
        expected = (torch.logsumexp(others, 1) - pos).mean()
    else:
        expected = torch.nn.functional.cross_entropy(logits, labels)
    torch.testing.assert_close(loss(x, labels), expected)
