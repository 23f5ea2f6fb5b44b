"""SiamFC tracking: network, OTB one-pass evaluation (hand-computed cases), labels and loss,
tracker geometry, NCC baseline, and the crops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dmlkit.apps.tracking import (
    NCCTracker,
    SiamFC,
    SiamFCTracker,
    TrackerConfig,
    center_error,
    crop_and_resize,
    evaluate_ope,
    evaluate_sequence,
    exemplar_side,
    logistic_loss,
    make_labels,
    overlap,
    parse_box,
    precision_curve,
    success_curve,
    xcorr,
)
from dmlkit.apps.tracking.evaluation import SUCCESS_THRESHOLDS
from dmlkit.exceptions import ConfigError, ShapeError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# ---------------------------------------------------------------- model


def test_paper_sizes_exemplar_6x6_search_22x22_score_17x17():
    model = SiamFC(width=0.25).eval()
    z = torch.rand(2, 3, 127, 127) * 255
    x = torch.rand(2, 3, 255, 255) * 255
    with torch.no_grad():
        fz, fx = model.embed(z), model.embed(x)
        assert fz.shape[-2:] == (6, 6) and fx.shape[-2:] == (22, 22)
        assert model.score(fz, fx).shape == (2, 1, 17, 17)


def test_backbone_is_the_papers_five_unpadded_convolutions():
    model = SiamFC(width=1.0)
    convs = [m for m in model.backbone if isinstance(m, torch.nn.Conv2d)]
    assert [c.kernel_size[0] for c in convs] == [11, 5, 3, 3, 3]
    assert [c.out_channels for c in convs] == [96, 256, 384, 384, 256]
    assert [c.groups for c in convs] == [1, 2, 1, 2, 2]
    assert all(c.padding == (0, 0) for c in convs)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())


def test_xcorr_grouped_equals_per_pair_convolution():
    g = torch.Generator().manual_seed(0)
    z = torch.randn(3, 4, 3, 3, generator=g)
    x = torch.randn(3, 4, 9, 8, generator=g)
    out = xcorr(z, x)
    ref = torch.cat([F.conv2d(x[i:i + 1], z[i:i + 1]) for i in range(3)])
    assert out.shape == (3, 1, 7, 6)
    torch.testing.assert_close(out, ref)
    # one exemplar against several search images (the tracker's scales)
    torch.testing.assert_close(xcorr(z[:1], x), torch.cat([F.conv2d(x[i:i + 1], z[:1]) for i in range(3)]))
    # a hand-computed value
    assert torch.isclose(out[1, 0, 2, 3], (z[1] * x[1, :, 2:5, 3:6]).sum(), atol=1e-5)
    with pytest.raises(ShapeError):
        xcorr(z[:2], x)


def test_fully_convolutional_shift_by_stride_shifts_the_map_by_one_cell():
    model = SiamFC(width=0.25).eval()
    img = torch.rand(1, 3, 127, 127) * 255
    with torch.no_grad():
        a = model.embed(img[..., :119, :119])
        b = model.embed(img[..., 8:, 8:])
    torch.testing.assert_close(a[..., 1:, 1:], b[..., :-1, :-1], atol=1e-4, rtol=1e-4)


def test_score_is_scaled_correlation_plus_bias():
    model = SiamFC(width=0.25).eval()
    with torch.no_grad():
        model.log_gain.fill_(np.log(2.0))
        model.bias.fill_(0.5)
        z = torch.rand(1, 3, 95, 95) * 255
        x = torch.rand(1, 3, 119, 119) * 255
        expected = 2e-3 * xcorr(model.embed(z), model.embed(x)) + 0.5
        torch.testing.assert_close(model(z, x), expected)


def test_model_rejects_bad_input():
    with pytest.raises(ShapeError):
        SiamFC(width=0.25).embed(torch.zeros(1, 1, 127, 127))
    with pytest.raises(ShapeError):
        SiamFC(width=0.25).embed(torch.zeros(1, 3, 60, 60))
    with pytest.raises(ConfigError):
        SiamFC(width=0.0)


# ---------------------------------------------------------------- evaluation


def test_overlap_and_center_error_hand_computed():
    gt = np.array([[0, 0, 10, 10]] * 4, dtype=float)
    pred = np.array([[0, 0, 10, 10], [5, 0, 10, 10], [20, 20, 5, 5], [3, 4, 10, 10]], float)
    np.testing.assert_allclose(overlap(pred, gt), [1.0, 50 / 150, 0.0, (7 * 6) / (200 - 42)])
    np.testing.assert_allclose(center_error(pred, gt), [0.0, 5.0, np.hypot(22.5 - 5, 22.5 - 5), 5.0])


def test_success_curve_21_thresholds_strict_and_auc_hand_computed():
    assert len(SUCCESS_THRESHOLDS) == 21
    ious = np.array([1.0, 0.5, 0.25, 0.0])
    curve = success_curve(ious)
    # S > t: 3 frames for t < 0.25, 2 for 0.25 <= t < 0.5, 1 for 0.5 <= t < 1, 0 at t = 1
    expected = np.array([3] * 5 + [2] * 5 + [1] * 10 + [0]) / 4
    np.testing.assert_allclose(curve, expected)
    assert curve.mean() == pytest.approx(35 / 84)  # AUC = 5/12


def test_perfect_tracker_auc_is_20_of_21_and_precision_is_one():
    gt = np.array([[10, 10, 20, 30], [12, 11, 22, 29], [15, 9, 18, 33]], float)
    res = evaluate_sequence(gt, gt)
    assert res.auc == pytest.approx(20 / 21)
    assert res.precision_at_20 == 1.0

    # fractional boxes (GOT-10k's): (x + w) - x rounds apart from w, and IoU of a box with
    # itself came out up to 1 + 1e-14, a success at the threshold 1 (AUC 0.973 for 0.952)
    boxes = np.random.default_rng(0).uniform(1, 300, size=(1000, 4))
    assert overlap(boxes, boxes).max() <= 1.0
    assert evaluate_sequence(boxes, boxes).auc == pytest.approx(20 / 21)


def test_precision_curve_inclusive_at_20_pixels():
    errors = np.array([0.0, 20.0, 20.5, 50.0, np.inf])
    curve = precision_curve(errors)
    assert len(curve) == 51
    assert curve[0] == pytest.approx(1 / 5)
    assert curve[20] == pytest.approx(2 / 5)
    assert curve[50] == pytest.approx(4 / 5)


def test_dataset_curves_average_sequences_with_equal_weight_and_skip_invalid_frames():
    gt_a = np.array([[0, 0, 10, 10]] * 2, float)
    pred_a = np.array([[0, 0, 10, 10], [100, 100, 10, 10]], float)  # AUC (20/21 + 0) / 2
    gt_b = np.array([[0, 0, 10, 10], [np.nan] * 4, [0, 0, 0, 0], [0, 0, 10, 10]], float)
    pred_b = np.array([[0, 0, 10, 10], [50, 50, 5, 5], [50, 50, 5, 5], [0, 0, 10, 10]], float)
    res = evaluate_ope({"a": pred_a, "b": pred_b}, {"a": gt_a, "b": gt_b})
    assert res.sequences[1].ious.shape == (2,)  # the two invalid frames are left out
    assert res.sequences[0].auc == pytest.approx(10 / 21)
    assert res.sequences[1].auc == pytest.approx(20 / 21)
    assert res.auc == pytest.approx(15 / 21)
    assert res.precision_at_20 == pytest.approx((0.5 + 1.0) / 2)
    with pytest.raises(ShapeError):
        evaluate_ope({"a": pred_a}, {"a": gt_a, "b": gt_b})
    with pytest.raises(ShapeError):
        evaluate_sequence(pred_a[:1], gt_a)
    first_only = np.vstack([gt_a[:1], np.full((4, 4), np.nan)])  # GOT-10k's test split: frame 0 only
    with pytest.raises(ShapeError, match="no valid ground-truth box after its first frame"):
        evaluate_sequence(np.repeat(gt_a[:1], 5, axis=0), first_only)  # scored about 0.95 for anything


def test_plot_ope_has_two_panels_with_scores_in_legend():
    from dmlkit.apps.tracking import plot_ope

    gt = np.array([[0, 0, 10, 10]] * 3, float)
    res = evaluate_ope({"s": gt}, {"s": gt})
    fig = plot_ope({"perfect": res})
    labels = [t.get_text() for ax in fig.axes for t in ax.get_legend().get_texts()]
    assert labels == ["perfect [0.952]", "perfect [1.000]"]


# ---------------------------------------------------------------- labels and loss


def test_labels_positive_disk_of_radius_r_over_stride_and_balanced_weights():
    labels, weights = make_labels(17, 8, 16.0)
    pos = labels > 0
    assert int(pos.sum()) == 13  # integer points with ||u - c|| <= 2
    assert bool(pos[8, 8]) and bool(pos[6, 8]) and not bool(pos[6, 6])
    assert weights[pos].sum() == pytest.approx(0.5)
    assert weights[~pos].sum() == pytest.approx(0.5)
    shifted, _ = make_labels(17, 8, 16.0, shift=(8.0, 0.0))
    assert torch.equal(shifted[1:], labels[:-1])  # the target one cell lower


def test_logistic_loss_formula_and_stability():
    labels, weights = make_labels()
    labels, weights = labels[None, None], weights[None, None]
    assert float(logistic_loss(torch.zeros_like(labels), labels, weights)) == pytest.approx(np.log(2))
    scores = torch.randn(1, 1, 17, 17)
    manual = (weights * torch.log1p(torch.exp(-labels * scores))).sum()
    torch.testing.assert_close(logistic_loss(scores, labels, weights), manual)
    big = logistic_loss(-1000 * labels, labels, weights)
    assert torch.isfinite(big) and float(big) == pytest.approx(1000.0)
    assert float(logistic_loss(1000 * labels, labels, weights)) == pytest.approx(0.0, abs=1e-6)


# ---------------------------------------------------------------- crops and boxes


def test_exemplar_side_context_rule():
    # w = 30, h = 10: p = (w + h) / 4 = 10, s_z = sqrt(50 * 30)
    assert exemplar_side(np.array([10.0, 30.0])) == pytest.approx(np.sqrt(50 * 30))


def test_crop_and_resize_copies_pixels_and_pads_with_the_mean():
    g = torch.Generator().manual_seed(0)
    img = torch.rand(3, 40, 50, generator=g) * 255
    crop = crop_and_resize(img, np.array([20.0, 25.0]), 20.0, 20)[0]
    torch.testing.assert_close(crop[:, 1:-1, 1:-1], img[:, 11:29, 16:34], atol=1e-3, rtol=0)
    far = crop_and_resize(img, np.array([-100.0, -100.0]), [10.0, 20.0], 8)
    assert far.shape == (2, 3, 8, 8)
    torch.testing.assert_close(far[1, :, 0, 0], img.mean(dim=(1, 2)))


def test_parse_box():
    np.testing.assert_array_equal(parse_box("1,2,30,40"), [1, 2, 30, 40])
    np.testing.assert_array_equal(parse_box("1 2\t30 40"), [1, 2, 30, 40])
    for bad in ("1,2,3", "a,b,c,d", "1,2,0,4"):
        with pytest.raises(ShapeError):
            parse_box(bad)


# ---------------------------------------------------------------- tracker


class _PeakTracker(SiamFCTracker):
    """A SiamFC tracker whose response maps have one peak at a chosen place."""

    peak: tuple[int, int, int] = (1, 135, 135)

    def response(self, frame):
        maps = np.zeros((self.config.num_scales, self.upscale_size, self.upscale_size))
        s, r, c = self.peak
        maps[s, r, c] = 1.0
        return maps * self.penalties[:, None, None], None


def test_tracker_maps_the_peak_back_to_image_pixels_and_damps_the_scale():
    cfg = TrackerConfig(window_influence=0.0)
    tracker = _PeakTracker(SiamFC(width=0.25), cfg)
    frame = np.zeros((200, 300, 3), np.uint8)
    box = np.array([100.0, 80.0, 40.0, 20.0])
    tracker.init(frame, box)
    assert tracker.upscale_size == 272
    x_side = tracker.x_side
    assert x_side == pytest.approx(exemplar_side(np.array([20.0, 40.0])) * 255 / 127)
    # peak 16 upsampled cells right and down of the centre (135.5), middle scale
    tracker.peak = (1, 135 + 16, 135 + 16)
    new = tracker.update(frame)
    shift = (16 - 0.5) * 8 / 16 * x_side / 255
    np.testing.assert_allclose(new, [100 + shift, 80 + shift, 40, 20], rtol=1e-9)
    # peak in the larger scale: size and search region grow by (1 - lr) + lr * step
    tracker.peak = (2, 135, 135)
    grown = tracker.update(frame)
    factor = (1 - cfg.scale_lr) + cfg.scale_lr * cfg.scale_step
    np.testing.assert_allclose(grown[2:], [40 * factor, 20 * factor])
    assert tracker.x_side == pytest.approx(x_side * factor)


def test_tracker_config_validation_and_five_scales():
    with pytest.raises(ConfigError):
        TrackerConfig(num_scales=2)
    five = TrackerConfig.five_scales()
    tracker = SiamFCTracker(SiamFC(width=0.25), five)
    np.testing.assert_allclose(tracker.scale_factors, 1.025 ** np.arange(-2, 3))
    assert tracker.penalties.tolist() == [0.962, 0.962, 1.0, 0.962, 0.962]


def test_siamfc_tracker_runs_on_real_frames_and_returns_one_box_per_frame(real_translation):
    frames, boxes = real_translation
    result = SiamFCTracker(SiamFC(width=0.25)).track(frames[:3], boxes[0])
    assert result.boxes.shape == (3, 4)
    np.testing.assert_array_equal(result.boxes[0], boxes[0])
    assert np.isfinite(result.boxes).all() and (result.boxes[:, 2:] > 0).all()
    assert result.fps > 0


def test_tracker_runs_its_network_channels_last_with_the_same_response(real_translation):
    """``to_device`` stores the tracker's CPU network channels-last (0.73x the time of an update,
    benchmarks/README.md); the response maps are those of the default layout."""
    frames, boxes = real_translation
    torch.manual_seed(0)
    tracker = SiamFCTracker(SiamFC(width=0.25))
    convs = [m.weight for m in tracker.model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert all(w.is_contiguous(memory_format=torch.channels_last) for w in convs)
    assert not any(w.is_contiguous() for w in convs)
    tracker.init(frames[0], boxes[0])
    placed = tracker.response(frames[1])[0]
    tracker.model.to(memory_format=torch.contiguous_format)
    tracker.init(frames[0], boxes[0])
    default = tracker.response(frames[1])[0]
    np.testing.assert_allclose(placed, default, rtol=1e-4, atol=1e-5 * float(np.abs(default).max()))


@pytest.fixture(scope="module")
def real_translation():
    """A real photo crop translating over a real photo background: exact integer boxes."""
    import skimage.data as skdata

    bg = skdata.coffee()[:200, :280]
    obj = skdata.astronaut()[60:120, 170:215]
    frames, boxes = [], []
    for t in range(8):
        f = bg.copy()
        x, y = 60 + 7 * t, 50 + 4 * t
        f[y:y + 60, x:x + 45] = obj
        frames.append(f)
        boxes.append([x, y, 45, 60])
    return frames, np.array(boxes, float)


def test_ncc_baseline_is_exact_on_pure_translation(real_translation):
    frames, boxes = real_translation
    result = NCCTracker().track(frames, boxes[0])
    np.testing.assert_allclose(result.boxes, boxes)
    assert evaluate_sequence(result.boxes, boxes).auc == pytest.approx(20 / 21)


def test_track_rejects_bad_initial_box(real_translation):
    frames, _ = real_translation
    with pytest.raises(ShapeError):
        NCCTracker().track(frames, [0, 0, 0, 10])
