"""Softmax, normalised softmax and the large-margin family against slow loop references."""

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
from dmlkit.losses.classification_losses import (
    ArcFaceLoss,
    CosFaceLoss,
    LargeMarginSoftmaxLoss,
    NormalizedSoftmaxLoss,
    SoftmaxLoss,
    SphereFaceLoss,
    psi_margin,
)

NAMES = [
    "softmax",
    "normalized_softmax",
    "large_margin_softmax",
    "sphereface",
    "cosface",
    "arcface",
]


# ------------------------------------------------------------------ slow references (loops)
def _norm(a):
    return torch.sqrt(dot(a, a))


def _cos(a, b):
    return dot(a, b) / (_norm(a) * _norm(b))


def _xent(logits, y):
    """-log softmax(logits)[y] for a list of 0-d float64 tensors (plain exp/log: values small)."""
    top = max(float(z.detach()) for z in logits)
    return -(logits[y] - top) + torch.log(sum(torch.exp(z - top) for z in logits))


def ref_softmax(x, labels, w, b):
    losses = []
    for i in range(len(x)):
        logits = [dot(x[i], w[j]) + b[j] for j in range(len(w))]
        losses.append(_xent(logits, int(labels[i])))
    return sum(losses) / len(losses)


def ref_normalized_softmax(x, labels, w, temperature):
    losses = []
    for i in range(len(x)):
        logits = [_cos(x[i], w[j]) / temperature for j in range(len(w))]
        losses.append(_xent(logits, int(labels[i])))
    return sum(losses) / len(losses)


def ref_margin(x, labels, w, m1, m2, m3, s, feature_norm=False, lam=0.0, arcface=None):
    """Seed 002: target logit psi(theta) (monotone extension) or ArcFace's code variant."""
    losses = []
    for i in range(len(x)):
        y = int(labels[i])
        scale = s * _norm(x[i]) if feature_norm else s
        logits = []
        for j in range(len(w)):
            c = _cos(x[i], w[j])
            if j == y:
                theta = torch.acos(c)
                if arcface == "easy":
                    phi = torch.cos(theta + m2) if c > 0 else c
                elif arcface == "threshold":
                    phi = torch.cos(theta + m2) if theta + m2 < math.pi else c - m2 * math.sin(m2)
                else:
                    u = m1 * theta + m2
                    k = math.floor(float(u.detach()) / math.pi)
                    phi = (-1) ** k * torch.cos(u) - 2 * k - m3
                c = (lam * c + phi) / (1 + lam)
            logits.append(scale * c)
        losses.append(_xent(logits, y))
    return sum(losses) / len(losses)


# ------------------------------------------------------------------ helpers
def _batch(kind: str, num_classes: int = 5, dim: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if kind == "several":
        labels = torch.tensor([0, 1, 2, 0, 1, 3, 4, 2, 0, 4])
    elif kind == "one_class":
        labels = torch.full((6,), 2)
    elif kind == "singletons":
        labels = torch.randperm(num_classes, generator=g)[:5]
    else:
        raise ValueError(kind)
    x = torch.randn(len(labels), dim, generator=g, dtype=torch.float64)
    return x, labels


def _make(name: str, num_classes=5, dim=4, **kw):
    torch.manual_seed(1)
    return get_loss(name, num_classes=num_classes, embedding_size=dim, **kw).double()


def _reference(loss, x, labels, params, lam=0.0):
    w = params["weight"]
    if isinstance(loss, SoftmaxLoss):
        return ref_softmax(x, labels, w, params["bias"])
    if isinstance(loss, NormalizedSoftmaxLoss):
        return ref_normalized_softmax(x, labels, w, loss.temperature)
    arc = None
    if isinstance(loss, ArcFaceLoss):
        arc = "easy" if loss.easy_margin else "threshold"
    return ref_margin(
        x,
        labels,
        w,
        loss.m1,
        loss.m2,
        loss.m3,
        loss.scale,
        feature_norm=loss.feature_norm_scale,
        lam=lam,
        arcface=arc,
    )


CASES = [
    ("softmax", {}),
    ("normalized_softmax", {}),
    ("normalized_softmax", {"scale": 3.0}),
    ("large_margin_softmax", {}),
    ("large_margin_softmax", {"m1": 2.0, "m2": 0.3, "m3": 0.1, "scale": 4.0}),
    ("large_margin_softmax", {"m1": 1.5, "m2": 2.0, "scale": 2.0}),
    ("sphereface", {}),
    ("sphereface", {"margin": 3, "anneal": True, "lambda_base": 2.0}),
    ("cosface", {}),
    ("cosface", {"margin": 0.2, "scale": 8.0}),
    ("arcface", {}),
    ("arcface", {"margin": 2.3, "scale": 4.0}),
    ("arcface", {"easy_margin": True, "scale": 4.0}),
]


@pytest.mark.parametrize("kind", ["several", "one_class", "singletons"])
@pytest.mark.parametrize(("name", "kw"), CASES)
def test_value_and_gradient_match_loop_reference(name, kw, kind):
    loss = _make(name, **kw)
    x, labels = _batch(kind)
    lam = getattr(loss, "current_lambda", lambda: 0.0)()  # before the step counter moves
    check_matches_loop_reference(
        loss, x, labels, lambda x2, y, ref_params: _reference(loss, x2, y, ref_params, lam)
    )


@pytest.mark.parametrize(("name", "kw"), CASES)
def test_gradcheck(name, kw):
    check_gradcheck(_make(name, num_classes=3, dim=3, **kw))


def test_psi_is_continuous_and_decreasing():
    theta = torch.linspace(0, math.pi, 2001, dtype=torch.float64)
    for m1, m2, m3 in [
        (4, 0, 0),
        (3, 0, 0),
        (1, 0.5, 0),
        (1.5, 2.0, 0.1),
        (1, 3.1, 0),
        (1, 0, 0.35),
    ]:
        psi = psi_margin(torch.cos(theta), m1, m2, m3)
        assert (psi.diff() <= 1e-12).all(), (m1, m2, m3)
        assert psi.diff().abs().max() < 0.05  # no jumps
        assert torch.allclose(psi[0], torch.tensor(math.cos(m2) - m3, dtype=torch.float64))


def test_arcface_target_logit_is_monotone_up_to_its_margin_limit_and_larger_is_refused():
    """cos(theta) - m sin(m) continues cos(theta + m) without an upward jump at theta = pi - m
    exactly while cos m + m sin m >= 1; above that root the margin is refused."""
    m = 2.3311223704144224  # the root, to float64 precision
    assert math.cos(m) + m * math.sin(m) == pytest.approx(1.0, abs=1e-14)
    theta = torch.linspace(0, math.pi, 4001, dtype=torch.float64)
    for margin in (0.5, 2.0, m):
        logit = ArcFaceLoss(2, 3, margin=margin).target_logit(torch.cos(theta))
        assert (logit.diff() <= 1e-12).all(), margin
    for margin in (2.34, 3.0, math.pi - 1e-6):
        with pytest.raises(ConfigError, match="at most 2.3311"):
            ArcFaceLoss(2, 3, margin=margin)
        with pytest.raises(ConfigError, match="at most 2.3311"):
            get_loss("arcface", num_classes=2, embedding_size=3, margin=margin, easy_margin=True)


def test_presets_are_the_family():
    x, labels = _batch("several")
    for preset, family in [
        (CosFaceLoss(5, 4, margin=0.35, scale=64), {"m3": 0.35, "scale": 64}),
        (SphereFaceLoss(5, 4, margin=4), {"m1": 4, "scale": 1.0, "feature_norm_scale": True}),
    ]:
        fam = LargeMarginSoftmaxLoss(5, 4, **family)
        fam.weight.data.copy_(preset.weight.data)
        torch.testing.assert_close(preset(x.float(), labels), fam(x.float(), labels))
    # ArcFace with a margin small enough that theta + m never passes pi: same as m2 family.
    arc, fam = ArcFaceLoss(5, 4, margin=0.5), LargeMarginSoftmaxLoss(5, 4, m2=0.5)
    fam.weight.data.copy_(arc.weight.data)
    xa = fam.weight.data[labels] + 0.01 * x.float()  # close to own class: small angles
    torch.testing.assert_close(arc(xa, labels), fam(xa, labels))


def test_sphereface_annealing_schedule_and_state():
    loss = SphereFaceLoss(5, 4, anneal=True)
    x, labels = _batch("several")
    assert loss.current_lambda() == 1000.0
    loss.train()
    for _ in range(3):
        loss(x.float(), labels)
    assert int(loss.anneal_step) == 3
    assert loss.current_lambda() == pytest.approx(1000.0 / (1 + 0.12 * 3))
    loss.eval()
    loss(x.float(), labels)
    assert int(loss.anneal_step) == 3
    state = loss.state_dict()
    assert int(state["anneal_step"]) == 3
    fresh = SphereFaceLoss(5, 4, anneal=True)
    fresh.load_state_dict(state)
    assert fresh.current_lambda() == loss.current_lambda()
    loss.anneal_step.fill_(10**6)
    assert loss.current_lambda() == 5.0


# ------------------------------------------------------------------ numerics
@pytest.mark.parametrize("name", NAMES)
def test_bfloat16_finite_and_close_to_float32(name):
    torch.manual_seed(0)
    loss = get_loss(name, num_classes=10, embedding_size=32)
    x = torch.nn.functional.normalize(torch.randn(64, 32), dim=1) * 3
    labels = torch.randint(0, 10, (64,))
    check_bfloat16_close_to_float32(loss, x, labels)


def test_bfloat16_under_autocast():
    loss = CosFaceLoss(10, 16)
    x = torch.randn(8, 16, requires_grad=True)
    labels = torch.arange(8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = loss(x, labels)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, loss(x, labels))


STRESS = [
    ("arcface", {"margin": 2.33, "scale": 64.0}),
    ("arcface", {"margin": 2.33, "scale": 64.0, "easy_margin": True}),
    ("cosface", {"margin": 3.0, "scale": 64.0}),
    ("large_margin_softmax", {"m1": 4.0, "m2": 3.1, "m3": 3.0, "scale": 64.0}),
    ("sphereface", {"margin": 4}),
    ("normalized_softmax", {"temperature": 1e-3}),
    ("softmax", {}),
]


@pytest.mark.parametrize(("name", "kw"), STRESS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_scale_and_margins_stay_finite(name, kw, dtype):
    torch.manual_seed(0)
    loss = get_loss(name, num_classes=50, embedding_size=16, **kw).to(dtype)
    x = torch.randn(128, 16) * 1000  # large norms (SphereFace uses |x| as the scale)
    x[0] = 0.0  # a zero embedding
    labels = torch.randint(0, 50, (128,))
    with torch.no_grad():  # some embeddings exactly on their class weight: cos = 1
        x[1:5] = loss.weight[labels[1:5]].float() * 50
        x[5:9] = -loss.weight[labels[5:9]].float() * 50  # and exactly opposite: theta = pi
    check_finite_with_gradients(loss, x.to(dtype).requires_grad_(), labels)


# ------------------------------------------------------------------ peer library
def _pml_pairs():
    return [
        (
            NormalizedSoftmaxLoss(7, 16),
            lambda: pml_losses.NormalizedSoftmaxLoss(7, 16, temperature=0.05),
            "W",
        ),
        (CosFaceLoss(7, 16), lambda: pml_losses.CosFaceLoss(7, 16, margin=0.35, scale=64), "W"),
        (
            ArcFaceLoss(7, 16),
            lambda: pml_losses.ArcFaceLoss(7, 16, margin=math.degrees(0.5), scale=64),
            "W",
        ),
        (
            ArcFaceLoss(7, 16, margin=2.3),
            lambda: pml_losses.ArcFaceLoss(7, 16, margin=math.degrees(2.3), scale=64),
            "W",
        ),
        (SphereFaceLoss(7, 16), lambda: pml_losses.SphereFaceLoss(7, 16, margin=4, scale=1), "W"),
        (
            LargeMarginSoftmaxLoss(7, 16, m1=3, scale=1, feature_norm_scale=True),
            lambda: pml_losses.LargeMarginSoftmaxLoss(7, 16, margin=3, scale=1),
            "W_unit",
        ),
    ]


@needs_pml
@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # pml's scipy.binom on numpy 2
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("idx", range(6))
def test_matches_pytorch_metric_learning(idx, dtype):
    torch.manual_seed(idx)
    ours, make_theirs, how = _pml_pairs()[idx]
    ours, theirs = ours.to(dtype), make_theirs().to(dtype)
    w = ours.weight.data
    theirs.W.data.copy_(torch.nn.functional.normalize(w, dim=1).T if how == "W_unit" else w.T)
    x = torch.randn(64, 16, dtype=dtype)
    labels = torch.randint(0, 7, (64,))
    a, b = ours(x, labels), theirs(x, labels)
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


# ------------------------------------------------------------------ API and errors
@pytest.mark.parametrize("name", NAMES)
def test_errors_and_api(name):
    loss = get_loss(name, num_classes=4, embedding_size=8)
    check_proxy_loss_errors_and_empty_batch(loss, negative_labels=[0, -1, 2])
    # own parameters for a separate optimiser
    params = list(loss.parameters())
    assert params and params[0].shape == (4, 8)


@pytest.mark.parametrize("dim", [1, 3, 128])
@pytest.mark.parametrize("name", NAMES)
def test_any_embedding_size_and_training_step(name, dim):
    torch.manual_seed(0)
    loss = get_loss(name, num_classes=6, embedding_size=dim)
    x = torch.randn(24, dim)
    labels = torch.arange(24) % 6
    opt = torch.optim.SGD(loss.parameters(), lr=0.5 if name != "softmax" else 0.1)
    before = loss(x, labels).item()
    if dim == 1:  # unit-norm weights in 1-D are +-1: no direction to learn, only check it runs
        loss(x, labels).backward()
        assert all(torch.isfinite(p.grad).all() for p in loss.parameters())
        return
    for _ in range(5):
        opt.zero_grad()
        loss(x, labels).backward()
        opt.step()
    assert loss(x, labels).item() < before


def test_bad_configs():
    with pytest.raises(ConfigError):
        LargeMarginSoftmaxLoss(3, 4, m1=0.5)
    with pytest.raises(ConfigError):
        ArcFaceLoss(3, 4, margin=4.0)
    with pytest.raises(ConfigError):
        CosFaceLoss(3, 4, margin=-0.1)
    with pytest.raises(ConfigError):
        NormalizedSoftmaxLoss(3, 4, temperature=0)
    with pytest.raises(ConfigError):
        CosFaceLoss(3, 4, scale=float("inf"))
    assert NormalizedSoftmaxLoss(3, 4, scale=20).temperature == pytest.approx(0.05)
