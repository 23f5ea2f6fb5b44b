"""FastAP and prototypical-network losses against loop references written from the formulas."""

from __future__ import annotations

import pytest
import torch

from _reference import assert_allclose_value_and_grad as assert_matches
from _reference import backward_value_and_grad as _value_and_grad
from dmlkit.distances import CosineSimilarity, LpDistance
from dmlkit.exceptions import ConfigError, DataError
from dmlkit.losses import get_loss
from dmlkit.losses.fastap import FastAPLoss, soft_histograms
from dmlkit.losses.prototypical import (
    PrototypicalLoss,
    class_means,
    prototypical_loss,
    rank_within_class,
)


def _x(n, d=5, seed=0, scale=1.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=g, dtype=torch.float64) * scale).to(dtype)


def _unit(v):
    return v / torch.sqrt((v * v).sum())


LABELSETS = {
    "several_classes": torch.tensor([0, 0, 1, 1, 1, 2, 2, 3, 3, 0]),
    "one_class": torch.tensor([5, 5, 5, 5, 5, 5]),
    "singletons": torch.tensor([0, 1, 2, 3, 4, 5, 6]),
    "mixed_singletons": torch.tensor([0, 0, 1, 2, 3, 3, 3, 4]),
}


# ------------------------------------------------------------------ FastAP


def ref_fastap(x, y, num_bins=10, power=2, pairs=None, r=None, ry=None):
    """Loops over anchors, bins and references; the triangular kernel written out."""
    r = x if r is None else r
    ry = y if ry is None else ry
    same_set = r is x
    d_max = 2.0**power
    delta = d_max / num_bins
    aps = []
    for i in range(len(x)):
        refs = []
        for j in range(len(r)):
            if same_set and i == j:
                continue
            if pairs is not None and (i, j) not in pairs:
                continue
            is_pos = int(y[i]) == int(ry[j]) if pairs is None else pairs[(i, j)]
            diff = _unit(x[i]) - _unit(r[j])
            d = (diff * diff).sum()
            refs.append((d if power == 2 else torch.sqrt(d), is_pos))
        n_pos = sum(1 for _, p in refs if p)
        if n_pos == 0:
            continue
        h_pos, h_all = [], []
        for ell in range(num_bins + 1):
            z = ell * delta
            hp = x.new_zeros(())
            ha = x.new_zeros(())
            for d, p in refs:
                k = torch.clamp(1 - torch.abs(d - z) / delta, min=0)
                ha = ha + k
                if p:
                    hp = hp + k
            h_pos.append(hp)
            h_all.append(ha)
        ap = x.new_zeros(())
        cum_p = x.new_zeros(())
        cum_a = x.new_zeros(())
        for ell in range(num_bins + 1):
            cum_p = cum_p + h_pos[ell]
            cum_a = cum_a + h_all[ell]
            if float((h_pos[ell] * cum_p).detach()) > 0 and float(cum_a.detach()) > 0:
                ap = ap + h_pos[ell] * cum_p / cum_a
        aps.append(ap / n_pos)
    return 1 - torch.stack(aps).mean()


@pytest.mark.parametrize("labelset", sorted(LABELSETS))
@pytest.mark.parametrize("num_bins,power", [(10, 2), (5, 1), (20, 2)])
def test_fastap_matches_loop_reference(labelset, num_bins, power):
    y = LABELSETS[labelset]
    x = _x(len(y), seed=num_bins + power)
    loss = FastAPLoss(num_bins=num_bins, distance=LpDistance(power=power))
    if labelset == "singletons":
        v, g = _value_and_grad(lambda t: loss(t, y), x)
        assert float(v) == 0.0 and torch.all(g == 0) and loss.num_empty_batches == 1
        return
    assert_matches(lambda t: loss(t, y), lambda t: ref_fastap(t, y, num_bins, power), x)


def test_fastap_soft_histogram_kernel():
    d = torch.tensor([[0.0, 0.5, 1.3, 4.0, 4.2, 5.0, -0.1]], dtype=torch.float64)
    mask = torch.ones_like(d, dtype=torch.bool)
    (h,) = soft_histograms(d, (mask,), num_bins=4, d_max=4.0)
    z = torch.arange(5, dtype=torch.float64)
    expect = torch.clamp(1 - (d.T - z).abs(), min=0).sum(0)
    assert torch.allclose(h[0], expect)


def test_fastap_miner_indices_and_ref_emb():
    y = torch.tensor([0, 0, 1, 1, 2, 2])
    x = _x(6, seed=21)
    a1, p = torch.tensor([0, 2, 4, 1]), torch.tensor([1, 3, 5, 0])
    a2, n = torch.tensor([0, 0, 2, 4, 1]), torch.tensor([2, 4, 5, 0, 3])
    pairs = {(int(a), int(b)): True for a, b in zip(a1, p)}
    pairs |= {(int(a), int(b)): False for a, b in zip(a2, n)}
    loss = FastAPLoss()
    assert_matches(lambda t: loss(t, y, (a1, p, a2, n)), lambda t: ref_fastap(t, y, pairs=pairs), x)
    ry = torch.tensor([0, 1, 2, 2, 3, 0, 1])
    r = _x(7, seed=22)
    assert_matches(
        lambda t: loss(t, y, ref_emb=r, ref_labels=ry), lambda t: ref_fastap(t, y, r=r, ry=ry), x
    )


def test_fastap_gradcheck_zero_and_bfloat16():
    y = torch.tensor([0, 0, 1, 1, 2, 2])
    loss = FastAPLoss()
    x = _x(6, d=4, seed=23).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: loss(t, y), (x,), eps=1e-6, atol=1e-5)
    z = _x(1).requires_grad_(True)
    out = loss(z, torch.tensor([0]))
    out.backward()
    assert float(out.detach()) == 0.0 and torch.all(z.grad == 0)
    yb = torch.arange(64) // 4
    vals = []
    for dtype in (torch.float32, torch.bfloat16):
        xb = _x(64, d=16, seed=24, dtype=dtype).requires_grad_(True)
        out = loss(xb, yb)
        out.backward()
        assert torch.isfinite(out) and torch.isfinite(xb.grad.float()).all()
        vals.append(float(out.detach()))
    assert abs(vals[0] - vals[1]) < 0.02


def test_fastap_config_errors():
    with pytest.raises(ConfigError):
        FastAPLoss(distance=CosineSimilarity())
    with pytest.raises(ConfigError):
        FastAPLoss(distance=LpDistance(normalize_embeddings=False))
    with pytest.raises(ConfigError):
        FastAPLoss(num_bins=0)
    assert isinstance(get_loss("fastap", num_bins=20), FastAPLoss)


@pytest.mark.parametrize("value", [2.9, 37.95, 5.0, True])
def test_fractional_counts_are_refused_not_truncated(value):
    """num_bins=37.95 trained with 37 bins (int() truncation) while a search recorded 37.95;
    a count is an integer (dmlkit.validation.check_integer), never rounded silently."""
    with pytest.raises(ConfigError, match=f"num_bins must be a positive integer, got {value!r}"):
        FastAPLoss(num_bins=value)
    with pytest.raises(ConfigError, match=f"k_shot must be a positive integer or None, got {value!r}"):
        PrototypicalLoss(k_shot=value)
    assert FastAPLoss(num_bins=37).num_bins == 37 and PrototypicalLoss(k_shot=3).k_shot == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("num_bins", [10, 25])
def test_fastap_equals_pytorch_metric_learning(dtype, num_bins):
    pml_losses = pytest.importorskip("pytorch_metric_learning.losses")
    y = torch.randint(0, 6, (48,), generator=torch.Generator().manual_seed(25))
    x = _x(48, d=16, seed=26, dtype=dtype)
    v1, g1 = _value_and_grad(lambda t: FastAPLoss(num_bins=num_bins)(t, y), x)
    v2, g2 = _value_and_grad(lambda t: pml_losses.FastAPLoss(num_bins=num_bins)(t, y), x)
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    assert abs(float(v1) - float(v2)) <= tol, (float(v1), float(v2))
    assert torch.allclose(g1, g2, atol=tol, rtol=1e-4)


# ------------------------------------------------------------------ prototypical


def ref_proto(support, sy, query, qy):
    """Loops: prototypes as explicit means, then d(q, c_y) + log sum_k exp(-d(q, c_k))."""
    classes = sorted(set(sy.tolist()))
    protos = {}
    for k in classes:
        members = [support[i] for i in range(len(support)) if int(sy[i]) == k]
        protos[k] = sum(members) / len(members)
    total = query.new_zeros(())
    for q, k in zip(query, qy.tolist()):
        dists = {c: ((q - protos[c]) ** 2).sum() for c in classes}
        total = total + dists[k] + torch.logsumexp(torch.stack([-dists[c] for c in classes]), 0)
    return total / len(query)


def test_rank_within_class():
    y = torch.tensor([3, 1, 3, 3, 0, 1, 0])
    assert rank_within_class(y).tolist() == [0, 0, 1, 2, 0, 1, 1]
    assert rank_within_class(torch.zeros(0, dtype=torch.long)).numel() == 0


def test_class_means():
    x = _x(5)
    y = torch.tensor([2, 0, 2, 2, 0])
    classes, centres, inv = class_means(x, y)
    assert classes.tolist() == [0, 2]
    assert torch.allclose(centres[0], x[[1, 4]].mean(0))
    assert torch.allclose(centres[1], x[[0, 2, 3]].mean(0))
    assert inv.tolist() == [1, 0, 1, 1, 0]


def test_prototypical_function_matches_reference():
    sy = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    qy = torch.tensor([0, 1, 1, 2, 3, 3, 0])
    s, q = _x(7, seed=30), _x(7, seed=31)
    s_ = s.clone().requires_grad_(True)
    q_ = q.clone().requires_grad_(True)
    s2 = s.clone().requires_grad_(True)
    q2 = q.clone().requires_grad_(True)
    a = prototypical_loss(s_, sy, q_, qy)
    b = ref_proto(s2, sy, q2, qy)
    a.backward()
    b.backward()
    assert torch.allclose(a, b) and torch.allclose(s_.grad, s2.grad) and torch.allclose(q_.grad, q2.grad)
    # the class form with ref_emb = support is the same computation
    assert torch.allclose(PrototypicalLoss()(q, qy, ref_emb=s, ref_labels=sy), b.detach())


def test_prototypical_missing_support_class():
    with pytest.raises(DataError):
        prototypical_loss(_x(2), torch.tensor([0, 1]), _x(1), torch.tensor([7]))


def _split_ref(x, y, k_shot):
    seen: dict[int, int] = {}
    sup, qry = [], []
    counts = {int(c): int((y == c).sum()) for c in y.unique()}
    for i, c in enumerate(y.tolist()):
        shots = max(1, counts[c] // 2) if k_shot is None else min(k_shot, counts[c])
        (sup if seen.get(c, 0) < shots else qry).append(i)
        seen[c] = seen.get(c, 0) + 1
    return x[sup], y[sup], x[qry], y[qry]


@pytest.mark.parametrize("labelset", sorted(LABELSETS))
@pytest.mark.parametrize("k_shot", [None, 1, 2])
def test_prototypical_batch_split_matches_reference(labelset, k_shot):
    y = LABELSETS[labelset]
    x = _x(len(y), seed=32)
    loss = PrototypicalLoss(k_shot=k_shot)
    s, sy, q, qy = _split_ref(x, y, k_shot)
    if len(q) == 0 or len(sy.unique()) < 2:
        v, g = _value_and_grad(lambda t: loss(t, y), x)
        assert float(v) == 0.0 and torch.all(g == 0) and loss.num_empty_batches == 1
        return

    def ref(t):
        s, sy, q, qy = _split_ref(t, y, k_shot)
        return ref_proto(s, sy, q, qy)

    assert_matches(lambda t: loss(t, y), ref, x)


def test_prototypical_episode_layout():
    """An N-way K-shot Q-query episode laid out class by class (support first)."""
    n_way, k_shot, n_query = 3, 2, 3
    y = torch.arange(n_way).repeat_interleave(k_shot + n_query)
    x = _x(len(y), seed=33)
    support_mask = PrototypicalLoss(k_shot=k_shot).split(y)
    expect = torch.tensor(([True] * k_shot + [False] * n_query) * n_way)
    assert torch.equal(support_mask, expect)
    a = PrototypicalLoss(k_shot=k_shot)(x, y)
    b = prototypical_loss(x[expect], y[expect], x[~expect], y[~expect])
    assert torch.allclose(a, b)


def test_prototypical_gradcheck_bfloat16_and_options():
    y = torch.tensor([0, 0, 1, 1, 2, 2])
    loss = PrototypicalLoss()
    x = _x(6, d=4, seed=34).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda t: loss(t, y), (x,), eps=1e-6, atol=1e-5)
    yb = torch.arange(64) // 8
    for dtype in (torch.float32, torch.bfloat16):
        xb = _x(64, d=16, seed=35, scale=10.0, dtype=dtype).requires_grad_(True)
        out = loss(xb, yb)
        out.backward()
        assert torch.isfinite(out) and torch.isfinite(xb.grad.float()).all()
    # cosine similarity as logits: a finite, different loss
    out = PrototypicalLoss(distance="cosine")(_x(8, seed=36), torch.arange(8) // 2)
    assert torch.isfinite(out) and 0 < float(out.detach()) < 10
    with pytest.raises(ConfigError):
        PrototypicalLoss(k_shot=0)
    with pytest.raises(ConfigError):
        loss(_x(6), y, (torch.tensor([0]), torch.tensor([1]), torch.tensor([2])))
    assert isinstance(get_loss("prototypical", k_shot=5), PrototypicalLoss)


def test_prototypical_large_distances_finite():
    y = torch.arange(12) // 3
    x = _x(12, d=8, seed=37, scale=1e3).requires_grad_(True)
    out = PrototypicalLoss()(x, y)
    out.backward()
    assert torch.isfinite(out) and torch.isfinite(x.grad).all()
