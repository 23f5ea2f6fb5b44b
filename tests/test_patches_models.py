"""Patch networks: shapes, output ranges, weight sharing, the hinge losses, scoring paths, training."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dmlkit.apps.patches import (
    ARCHITECTURES,
    DECISION_ARCHITECTURES,
    DESCRIPTOR_ARCHITECTURES,
    PatchPairs,
    TrainSettings,
    build_patch_model,
    hinge_embedding_loss,
    hinge_loss,
    prepare_patches,
    score_pairs,
    train_patch_model,
)
from dmlkit.exceptions import ConfigError, ShapeError
from dmlkit.metrics import fpr95


@pytest.mark.parametrize("size", [32, 64])
def test_every_architecture_runs(size: int) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    a, b = torch.randn(3, 1, size, size), torch.randn(3, 1, size, size)
    assert set(ARCHITECTURES) == set(DECISION_ARCHITECTURES) | set(DESCRIPTOR_ARCHITECTURES)
    for name in ARCHITECTURES:
        m = build_patch_model(name, size, 0.125).eval()
        with torch.no_grad():
            o, s = m(a, b), m.score(a, b)
        assert o.shape == (3,) and s.shape == (3,) and torch.isfinite(s).all()
        if name in DECISION_ARCHITECTURES:
            assert (o.abs() <= 1).all() and torch.allclose(o, torch.tanh(s))
        else:
            assert (o >= 0).all() and torch.allclose(o, -s)  # a distance
        if m.has_descriptor:
            with torch.no_grad():
                assert torch.allclose(m.decide(m.describe(a, 0), m.describe(b, 1)), s, atol=1e-5)


def test_weight_sharing_and_2stream_inputs() -> None:
    siam, pseudo = build_patch_model("siam", 32, 0.125), build_patch_model("pseudo-siam", 32, 0.125)
    assert siam.branch1 is siam.branch2 and pseudo.branch1 is not pseudo.branch2
    n_siam = sum(p.numel() for p in siam.branch1.parameters())
    assert sum(p.numel() for p in pseudo.parameters()) - sum(p.numel() for p in siam.parameters()) == n_siam
    # a 2-channel net sees the order of the two patches; its input is their stack
    m = build_patch_model("2ch", 32, 0.125)
    assert m.features[0].in_channels == 2
    # the fovea stream only sees the centre: changing the border moves only the retina stream
    two = build_patch_model("siam-2stream-l2", 32, 0.125).eval()
    x = torch.randn(1, 1, 32, 32)
    y = x.clone()
    y[..., :4, :] += 5.0
    with torch.no_grad():
        assert torch.equal(two.branch1.fovea(x[..., 8:24, 8:24]), two.branch1.fovea(y[..., 8:24, 8:24]))
        assert not torch.allclose(two.describe(x), two.describe(y))


def test_prepare_patches_and_errors() -> None:
    rng = np.random.default_rng(0)
    p = rng.integers(0, 256, (4, 64, 64)).astype(np.uint8)
    x = prepare_patches(p, 32)
    assert x.shape == (4, 1, 32, 32)
    assert torch.allclose(x.mean(dim=(1, 2, 3)), torch.zeros(4), atol=1e-5)
    assert torch.allclose(x.std(dim=(1, 2, 3)), torch.ones(4), atol=1e-4)
    # area downsampling: the mean of 2 x 2 blocks
    raw = torch.as_tensor(p[0], dtype=torch.float32)
    blocks = raw.reshape(32, 2, 32, 2).mean(dim=(1, 3))
    assert torch.allclose(x[0, 0], (blocks - blocks.mean()) / blocks.std(), atol=1e-4)
    assert torch.isfinite(prepare_patches(np.zeros((1, 64, 64), np.uint8))).all()
    with pytest.raises(ShapeError):
        prepare_patches(np.zeros((2, 3, 64, 64)))
    with pytest.raises(ConfigError, match="unknown patch architecture"):
        build_patch_model("3ch")
    with pytest.raises(ConfigError):
        build_patch_model("2ch", 48)
    with pytest.raises(ShapeError):
        build_patch_model("2ch", 32)(torch.zeros(2, 1, 64, 64), torch.zeros(2, 1, 64, 64))


def test_hinge_losses_follow_their_formulas() -> None:
    o = torch.tensor([0.5, -0.2, 1.0, -1.0])
    y = torch.tensor([1.0, 1.0, -1.0, -1.0])
    # max(0, 1 - y o): 0.5, 1.2, 2.0, 0.0
    assert hinge_loss(o, y).item() == pytest.approx((0.5 + 1.2 + 2.0 + 0.0) / 4)
    d = torch.tensor([0.3, 1.5, 0.4, 1.2])
    # matches: d; non-matches: max(0, 1 - d)
    assert hinge_embedding_loss(d, y, 1.0).item() == pytest.approx((0.3 + 1.5 + 0.6 + 0.0) / 4)


def _toy_pairs(n_points: int = 96, seed: int = 0):
    """Real crops of a photograph: two views of each point = the same window shifted by one
    pixel with a brightness change; non-matches = two different points."""
    import skimage.data as skdata

    img = skdata.camera().astype(np.float64)
    rng = np.random.default_rng(seed)
    ys = rng.integers(2, img.shape[0] - 70, n_points)
    xs = rng.integers(2, img.shape[1] - 70, n_points)
    views = []
    for y, x in zip(ys, xs):
        a = img[y : y + 64, x : x + 64]
        b = img[y + 1 : y + 65, x + 1 : x + 65] * rng.uniform(0.7, 1.3) + rng.uniform(-20, 20)
        views += [a, np.clip(b, 0, 255)]
    patches = np.stack(views).round().astype(np.uint8)
    point_ids = np.repeat(np.arange(n_points), 2)
    pos_l = np.arange(n_points) * 2
    neg_l = np.arange(n_points) * 2
    neg_r = ((np.arange(n_points) + 1 + rng.integers(0, n_points - 1, n_points)) % n_points) * 2 + 1
    left, right = np.r_[pos_l, neg_l], np.r_[pos_l + 1, neg_r]
    label = (point_ids[left] == point_ids[right]).astype(np.int64)
    return patches, point_ids, PatchPairs(left.astype(np.int64), right.astype(np.int64), label)


def test_scoring_paths_agree() -> None:
    patches, _, pairs = _toy_pairs(24)
    x = prepare_patches(patches, 32)
    for name in ("pseudo-siam", "siam-l2", "hardnet", "2ch"):
        torch.manual_seed(0)
        m = build_patch_model(name, 32, 0.125).eval()
        fast = score_pairs(m, x, pairs, batch_size=7)
        with torch.no_grad():
            direct = m.score(x[torch.from_numpy(pairs.left)], x[torch.from_numpy(pairs.right)]).double().numpy()
        np.testing.assert_allclose(fast, direct, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["2ch", "siam-l2", "hardnet"])
def test_training_learns_real_correspondences(name: str) -> None:
    """A few steps on real crops: the loss falls and FPR95 ends low and no worse than untrained."""
    torch.manual_seed(0)
    patches, point_ids, pairs = _toy_pairs(64)
    x = prepare_patches(patches, 32)
    m = build_patch_model(name, 32, 0.125)
    before = fpr95(score_pairs(m, x, pairs), pairs.label)
    log = train_patch_model(
        m, x, pairs, point_ids, TrainSettings(epochs=6, batch_size=32, lr=3e-3, log_every=1, seed=0)
    )
    after = fpr95(score_pairs(m, x, pairs), pairs.label)
    assert np.isfinite([r["loss"] for r in log]).all()
    assert np.mean([r["loss"] for r in log[-6:]]) < np.mean([r["loss"] for r in log[:6]])
    assert after < 0.5 and after <= before


def test_score_matrix_equals_pairwise_scores() -> None:
    from dmlkit.apps.patches import score_matrix

    torch.manual_seed(0)
    a, b = torch.randn(5, 1, 32, 32), torch.randn(7, 1, 32, 32)
    for name in ("2ch", "siam", "pseudo-siam-l2"):
        m = build_patch_model(name, 32, 0.125).eval()
        s = score_matrix(m, a, b, batch_size=6)
        ii, jj = torch.meshgrid(torch.arange(5), torch.arange(7), indexing="ij")
        with torch.no_grad():
            direct = m.score(a[ii.reshape(-1)], b[jj.reshape(-1)]).reshape(5, 7)
        assert s.shape == (5, 7)
        torch.testing.assert_close(s, direct, rtol=1e-4, atol=1e-4)


def test_mutual_matches_and_ratio_test() -> None:
    from dmlkit.apps.patches import mutual_matches

    d = torch.tensor([[0.1, 0.9, 0.8], [0.5, 0.45, 0.9], [0.2, 0.6, 0.95]])
    m = mutual_matches(-d)
    # row 0 -> col 0 (mutual), row 1 -> col 1 (mutual), row 2 -> col 0 (col 0 prefers row 0)
    assert m.i.tolist() == [0, 1] and m.j.tolist() == [0, 1]
    assert m.score.tolist() == pytest.approx([-0.1, -0.45])
    r = mutual_matches(-d, ratio=0.8)  # row 1: 0.45 / 0.5 = 0.9 fails the ratio test
    assert r.i.tolist() == [0]
    with pytest.raises(ConfigError):
        mutual_matches(d, ratio=0.8)  # similarities, not distances


def test_linear_decision_output_escapes_a_saturated_start() -> None:
    """A constant, saturated output: the hinge on tanh(z) has (almost) no gradient left, the hinge
    on the linear z still pushes the non-matches down."""
    torch.manual_seed(0)
    x = torch.randn(8, 1, 32, 32)
    y = torch.tensor([1.0, -1.0] * 4)
    grads = {}
    for out in ("tanh", "linear"):
        m = build_patch_model("siam", 32, 0.125)
        with torch.no_grad():
            m.head[-1].bias.fill_(10.0)
        z = m.logits(x, x.flip(0))
        o = z if out == "linear" else torch.tanh(z)
        hinge_loss(o, y).backward()
        grads[out] = m.head[-1].bias.grad.abs().item()
    assert grads["tanh"] < 1e-6 and grads["linear"] == pytest.approx(0.5, abs=1e-6)
    with pytest.raises(ConfigError):
        TrainSettings(decision_output="sigmoid")
