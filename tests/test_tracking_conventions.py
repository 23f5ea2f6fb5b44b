"""Tracking conventions against the reference tools (audit s40_apps, F1, F2, F4).

* F1: OTB's ``groundtruth_rect.txt`` and GOT-10k's ``groundtruth.txt`` are 1-based (MATLAB): the
  target whose top-left pixel is 0-based (40, 30) is written ``41,31,w,h``. dmlkit read the
  numbers unchanged, so the SiamFC exemplar was centred one pixel right and down of the target
  and the NCC template took a background row and column; ``build-data`` wrote 0-based boxes in
  the same layouts. The loaders now subtract 1, the writers add it back (round trip exact), and
  a build records its index base (older builds, 0-based, are read as 0-based).
* F2: frames without valid ground truth were always dropped; ``absent_frames="otb"`` keeps them
  as the OTB toolkit does (``calcSeqErrRobust.m``: overlap -1, centre error -1, all frames in
  the denominator; valid only when all four 1-based numbers are positive).
* F4: a NaN or negative-width predicted box in a scored frame was scored silently.
"""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
import torch
from PIL import Image

from _reference import siamfc_train_sequence, tiny_siamfc_config
from dmlkit.apps.tracking.datasets import Sequence, load_got10k, load_otb, load_tracking_dataset
from dmlkit.apps.tracking.evaluation import evaluate_ope
from dmlkit.apps.tracking.geometry import box_to_center
from dmlkit.apps.tracking.model import SiamFC
from dmlkit.apps.tracking.offline import build_offline_dataset, make_sequence, offline_specs
from dmlkit.apps.tracking.tracker import NCCTracker, SiamFCTracker
from dmlkit.apps.tracking.training import train_siamfc
from dmlkit.exceptions import ConfigError, ShapeError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: The target: 0-based columns 40..69 and rows 30..53 (30 x 24), bright on black.
TARGET = (40, 30, 30, 24)


def _frame() -> np.ndarray:
    img = np.zeros((100, 120, 3), np.uint8)
    x, y, w, h = TARGET
    img[y:y + h, x:x + w] = 200
    return img


def _otb_folder(root, name="Box", gt_line="41\t31\t30\t24", frames=3):
    """An OTB sequence as the benchmark ships it: ``img/0001.jpg`` and a tab-separated,
    1-based ``groundtruth_rect.txt``."""
    seq = root / name
    (seq / "img").mkdir(parents=True)
    for i in range(frames):
        Image.fromarray(_frame()).save(seq / "img" / f"{i + 1:04d}.jpg", quality=100)
    (seq / "groundtruth_rect.txt").write_text("\n".join([gt_line] * frames) + "\n")
    return seq


# ---------------------------------------------------------------- F1: 1-based files
def test_an_otb_box_is_read_one_based_and_the_trackers_centre_on_the_target(tmp_path):
    _otb_folder(tmp_path)
    seq = load_otb(tmp_path)[0]
    np.testing.assert_array_equal(seq.boxes[0], [40, 30, 30, 24])  # was [41, 31, 30, 24]
    assert seq.index_base == 1
    centre, size = box_to_center(seq.boxes[0])
    np.testing.assert_array_equal(centre, [42.0, 55.0])  # (cy, cx): was (43, 56)
    np.testing.assert_array_equal(size, [24, 30])
    ncc = NCCTracker()
    ncc.init(seq.frame(0), seq.boxes[0])
    assert ncc.template.shape == (24, 30)
    assert (ncc.template > 150).all()  # every pixel the target's: it took a background row and column

    torch.manual_seed(0)
    siamfc = SiamFCTracker(SiamFC(width=0.0625))
    siamfc.init(seq.frame(0), seq.boxes[0])
    np.testing.assert_array_equal(siamfc.center, [42.0, 55.0])  # the exemplar's centre


def test_a_got10k_box_is_read_one_based_and_absent_frames_stay_invalid(tmp_path):
    seq = tmp_path / "GOT-10k_Val_000001"
    seq.mkdir()
    for i in range(4):
        Image.fromarray(_frame()).save(seq / f"{i + 1:08d}.jpg")
    # GOT-10k marks some absent frames -1,-1,-1,-1 (got-10k/toolkit issue #10) and in absence.label
    (seq / "groundtruth.txt").write_text("41,31,30,24\n41.5,31.25,30,24\n-1,-1,-1,-1\n41,31,30,24\n")
    (seq / "absence.label").write_text("0\n0\n0\n1\n")
    s = load_got10k(tmp_path)[0]
    np.testing.assert_array_equal(s.boxes[:2], [[40, 30, 30, 24], [40.5, 30.25, 30, 24]])
    assert s.valid.tolist() == [True, True, False, False]
    assert np.isnan(s.boxes[3]).all()
    # an explicit base reads the numbers as 0-based
    np.testing.assert_array_equal(load_tracking_dataset("got10k", tmp_path, index_base=0)[0].boxes[0],
                                  [41, 31, 30, 24])
    with pytest.raises(ConfigError, match="index base .* is 0 or 1"):
        load_otb(tmp_path, index_base=2)


def test_got10k_reads_a_folders_index_base_once(tmp_path, monkeypatch):
    """The base (meta.json) was read and parsed again for every sequence: 16.7 s for 5,000."""
    from dmlkit.apps.tracking import datasets

    for k in range(3):
        seq = tmp_path / f"GOT-10k_Val_{k:06d}"
        seq.mkdir()
        for i in range(2):
            Image.fromarray(_frame()).save(seq / f"{i + 1:08d}.jpg")
        (seq / "groundtruth.txt").write_text("41,31,30,24\n41,31,30,24\n")
    calls = []
    real = datasets.box_index_base
    monkeypatch.setattr(datasets, "box_index_base", lambda *a, **k: calls.append(a) or real(*a, **k))
    assert len(load_got10k(tmp_path)) == 3 and len(calls) == 1


def test_build_data_writes_one_based_files_and_reads_back_the_exact_boxes(tmp_path):
    out = tmp_path / "d"
    meta = build_offline_dataset(out, num_train=1, num_test=1, train_frames=3, test_frames=3, seed=2,
                                 frame_size=(96, 96))
    assert meta["box_index_base"] == 1
    assert json.loads((out / "meta.json").read_text())["box_index_base"] == 1
    for split, load, gt_name in (("train", lambda: load_got10k(out), "groundtruth.txt"),
                                 ("test", lambda: load_otb(out / "test"), "groundtruth_rect.txt")):
        spec = offline_specs(split, 1, 3, seed=2, frame_size=(96, 96))[0]
        truth = make_sequence(spec).boxes  # 0-based, in memory
        folder = out / split / spec.name
        written = np.loadtxt(folder / gt_name, delimiter=",")
        np.testing.assert_array_equal(written, truth + [1, 1, 0, 0])  # 1-based, as the benchmarks
        loaded = load()[0]
        np.testing.assert_array_equal(loaded.boxes, truth)  # the round trip is exact
        assert loaded.index_base == 1


def test_a_build_of_older_dmlkit_is_read_zero_based_as_it_was_written(tmp_path):
    """A build whose meta.json records no box_index_base was written 0-based by older dmlkit."""
    out = tmp_path / "d"
    build_offline_dataset(out, num_train=1, num_test=1, train_frames=3, test_frames=3, seed=2,
                          frame_size=(96, 96))
    meta = json.loads((out / "meta.json").read_text())
    del meta["box_index_base"]
    (out / "meta.json").write_text(json.dumps(meta))
    spec = offline_specs("test", 1, 3, seed=2, frame_size=(96, 96))[0]
    truth = make_sequence(spec).boxes
    gt = out / "test" / spec.name / "groundtruth_rect.txt"
    gt.write_text("\n".join(",".join(str(int(v)) for v in b) for b in truth) + "\n")  # as it wrote them
    seq = load_otb(out / "test")[0]
    np.testing.assert_array_equal(seq.boxes, truth)
    assert seq.index_base == 0
    # without its meta.json the folder is any OTB folder: 1-based, unless told otherwise
    (out / "meta.json").unlink()
    np.testing.assert_array_equal(load_otb(out / "test")[0].boxes, truth - [1, 1, 0, 0])
    np.testing.assert_array_equal(load_otb(out / "test", index_base=0)[0].boxes, truth)


def test_track_evaluate_writes_result_boxes_in_the_ground_truths_base(tmp_path, run_cli):
    _otb_folder(tmp_path / "otb", frames=4)
    code, out, err = run_cli(["track", "evaluate", str(tmp_path / "otb"), "--methods", "ncc",
                              "--out-dir", str(tmp_path / "ev"), "--json"])
    assert code == 0, err
    results = json.loads((tmp_path / "ev" / "results.json").read_text())["ncc"]
    assert results["box_index_base"] == 1 and results["absent_frames"] == "drop"
    boxes = np.loadtxt(tmp_path / "ev" / "boxes" / "ncc" / "Box.txt", delimiter=",")
    np.testing.assert_array_equal(boxes, [[41, 31, 30, 24]] * 4)  # the file's own numbers: a static target
    assert json.loads(out)["ncc"]["success_auc"] == pytest.approx(20 / 21)
    code, _, err = run_cli(["track", "evaluate", str(tmp_path / "otb"), "--methods", "ncc", "--index-base", "2"])
    assert code == 2 and len(err.strip().splitlines()) == 1 and "0 or 1" in err


# ---------------------------------------------------------------- F2: frames without ground truth
def _otb_oracle(preds, gts, rule):
    """OPE by the OTB toolkit's definitions on 1-based file numbers, in exact rationals:
    calcRectInt (right = left + w - 1, intersection = min(right) - max(left) + 1), centres
    ``x + (w - 1) / 2``; ``rule="otb"``: calcSeqErrRobust.m (the first prediction replaced by the
    ground truth, ``results(1,:) = rect_anno(1,:)``; invalid unless all four numbers > 0;
    overlap and error -1, every frame counted), ``"drop"``: invalid frames left out."""
    succ, prec = [], []
    for p_seq, g_seq in zip(preds, gts):
        if rule == "otb":
            p_seq = np.vstack([g_seq[:1], p_seq[1:]])
        ious, errs = [], []
        for p, g in zip(p_seq, g_seq):
            finite_area = bool(np.isfinite(g).all()) and g[2] > 0 and g[3] > 0
            valid = finite_area and (rule == "drop" or (g[0] > 0 and g[1] > 0))
            if not valid:
                if rule == "otb":
                    ious.append(Fraction(-1))
                    errs.append(-1.0)
                continue
            a, b = [Fraction(float(v)) for v in p], [Fraction(float(v)) for v in g]
            iw = max(Fraction(0), min(a[0] + a[2] - 1, b[0] + b[2] - 1) - max(a[0], b[0]) + 1)
            ih = max(Fraction(0), min(a[1] + a[3] - 1, b[1] + b[3] - 1) - max(a[1], b[1]) + 1)
            ious.append(iw * ih / (a[2] * a[3] + b[2] * b[3] - iw * ih))
            ca = [a[0] + (a[2] - 1) / 2, a[1] + (a[3] - 1) / 2]
            cb = [b[0] + (b[2] - 1) / 2, b[1] + (b[3] - 1) / 2]
            errs.append(float((ca[0] - cb[0]) ** 2 + (ca[1] - cb[1]) ** 2) ** 0.5)
        succ.append([Fraction(sum(i > Fraction(k, 20) for i in ious), len(ious)) for k in range(21)])
        prec.append([Fraction(sum(e <= t for e in errs), len(errs)) for t in range(51)])
    s = [sum(c) / len(c) for c in zip(*succ)]
    return np.array([float(v) for v in s]), np.array([float(sum(c) / len(c)) for c in zip(*prec)])


def test_absent_frames_drop_and_otb_against_the_reports_oracle_numbers():
    # the report's example (repro_otb_invalid_frames.py): 3 of 10 frames absent, drift on the last 4
    g = np.array([[10, 10, 20, 20]] * 10, float)
    g[[3, 4, 5]] = 0
    p = g.copy()
    p[[3, 4, 5]] = [10, 10, 20, 20]
    p[6:, 0] += 8
    drop = evaluate_ope({"s": p - [1, 1, 0, 0]}, {"s": g - [1, 1, 0, 0]})  # the loaders' 0-based boxes
    otb = evaluate_ope({"s": p - [1, 1, 0, 0]}, {"s": g - [1, 1, 0, 0]}, absent_frames="otb")
    assert drop.auc == pytest.approx(32 / 49, abs=1e-15) and drop.precision[0] == pytest.approx(3 / 7)
    assert otb.auc == pytest.approx(16 / 35, abs=1e-15) and otb.precision[0] == pytest.approx(6 / 10)
    assert drop.summary()["num_scored_frames"] == 7 and otb.summary()["num_scored_frames"] == 10
    assert drop.absent_frames == "drop" and otb.summary()["absent_frames"] == "otb"
    # as the docs first wrote the call: the rule in fps's place was an AttributeError deep inside
    with pytest.raises(TypeError):
        evaluate_ope({"s": p}, {"s": g}, "otb")
    with pytest.raises(ConfigError, match="fps must map sequence names"):
        evaluate_ope({"s": p}, {"s": g}, fps="otb")
    for rule, res in (("drop", drop), ("otb", otb)):
        s, pr = _otb_oracle([p], [g], rule)
        np.testing.assert_array_equal(res.success, s)
        np.testing.assert_array_equal(res.precision, pr)


def test_absent_frames_otb_matches_the_oracle_on_random_sequences():
    """Random boxes with NaN, all-zero and x <= 0 (1-based) ground truth: the OTB rule counts a
    box whose 1-based x is 0 or less as invalid (x > -1 in dmlkit's 0-based boxes)."""
    rng = np.random.default_rng(7)
    for _ in range(25):
        preds, gts = {}, {}
        for k in range(3):
            n = int(rng.integers(4, 12))
            g = np.column_stack([rng.integers(-3, 40, n), rng.integers(-3, 40, n),
                                 rng.integers(1, 30, (n, 2))]).astype(float)
            g[0] = [5, 6, 10, 12]
            g[1] = [7, 7, 10, 12]
            g[rng.random(n) < 0.2] = 0
            g[rng.random(n) < 0.1] = np.nan
            p = g + rng.integers(-6, 7, (n, 4)) * [1, 1, 0.5, 0.5]
            p[:, 2:] = np.abs(np.nan_to_num(p[:, 2:], nan=5.0)) + 1
            p[:, :2] = np.nan_to_num(p[:, :2], nan=3.0)  # p[0] off the given start: the OTB rule scores g[0]
            preds[f"s{k}"], gts[f"s{k}"] = p, g
        for rule in ("drop", "otb"):
            res = evaluate_ope({k: v - [1, 1, 0, 0] for k, v in preds.items()},
                               {k: v - [1, 1, 0, 0] for k, v in gts.items()}, absent_frames=rule)
            s, pr = _otb_oracle(list(preds.values()), list(gts.values()), rule)
            np.testing.assert_allclose(res.success, s, rtol=0, atol=1e-15)
            np.testing.assert_allclose(res.precision, pr, rtol=0, atol=1e-15)


def test_track_evaluate_absent_frames_option(tmp_path, run_cli):
    seq = _otb_folder(tmp_path / "otb", frames=5)
    (seq / "groundtruth_rect.txt").write_text("41,31,30,24\n41,31,30,24\n0,0,0,0\nNaN,NaN,NaN,NaN\n41,31,30,24\n")
    results = {}
    for rule in ("drop", "otb"):
        code, out, err = run_cli(["track", "evaluate", str(tmp_path / "otb"), "--methods", "ncc",
                                  "--absent-frames", rule, "--json"])
        assert code == 0, err
        results[rule] = json.loads(out)["ncc"]
    # the static target is found exactly: IoU 1 wherever scored
    assert results["drop"]["num_scored_frames"] == 3 and results["drop"]["success_auc"] == pytest.approx(20 / 21)
    assert results["otb"]["num_scored_frames"] == 5 and results["otb"]["absent_frames"] == "otb"
    assert results["otb"]["success_auc"] == pytest.approx(3 / 5 * 20 / 21)
    assert results["otb"]["precision_at_20"] == 1.0
    code, out, err = run_cli(["track", "evaluate", str(tmp_path / "otb"), "--methods", "ncc",
                              "--absent-frames", "keep"])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "'drop'" in err and "'otb'" in err


# ---------------------------------------------------------------- F4: invalid predictions
@pytest.mark.parametrize("bad, what", [([np.nan, 10, 20, 20], "nan"), ([10, 10, -20, 20], "-20"),
                                       ([10, 10, 20, 0], "0.0")])
def test_a_predicted_box_without_finite_numbers_or_area_is_refused(bad, what):
    gt = np.array([[10.0, 10.0, 20.0, 20.0]] * 5)
    pred = gt.copy()
    pred[3] = bad
    with pytest.raises(ShapeError) as err:
        evaluate_ope({"walk": pred}, {"walk": gt})
    msg = str(err.value)
    assert "\n" not in msg and "'walk'" in msg and "frame 3" in msg and what in msg.lower()
    # a frame that is not scored (no ground truth) may hold any prediction, as before
    gt[3] = np.nan
    assert evaluate_ope({"walk": pred}, {"walk": gt}).auc == pytest.approx(20 / 21)


def test_resuming_a_run_that_read_one_based_files_unconverted_says_so(tmp_path):
    """A run started by dmlkit before the conversion learnt from the files' numbers as they are:
    its resume on the converted boxes is refused with a line that says why, not a bare
    "other training sequences"."""
    seq = siamfc_train_sequence()  # 0-based boxes; a GOT-10k file holds them + 1
    cfg = tiny_siamfc_config(tmp_path, epochs=2)
    as_read_before = Sequence(seq.name, seq.frames, seq.boxes + [1, 1, 0, 0])
    train_siamfc(cfg, tmp_path / "run", sequences=[as_read_before], progress=False, max_epochs=1)
    as_read_now = Sequence(seq.name, seq.frames, seq.boxes, index_base=1)
    with pytest.raises(ConfigError, match="started by an older dmlkit, which read the 1-based boxes .* train it again"):
        train_siamfc(cfg, tmp_path / "run", sequences=[as_read_now], progress=False, resume=True)
    with pytest.raises(ConfigError, match="training sequences differ"):  # other data: as before
        train_siamfc(cfg, tmp_path / "run", sequences=[Sequence(seq.name, seq.frames, seq.boxes + 3)],
                     progress=False, resume=True)
