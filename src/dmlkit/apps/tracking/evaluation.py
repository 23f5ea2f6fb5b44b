"""OTB one-pass evaluation (OPE): success and precision plots.

Y. Wu, J. Lim, M.-H. Yang, "Online Object Tracking: A Benchmark", CVPR 2013 (and TPAMI 2015).
The tracker is initialised with the ground truth of the first frame and run once to the end.
For frame t with ground truth box g_t and predicted box p_t:

* overlap  ``S_t = |p_t ∩ g_t| / |p_t ∪ g_t|`` (intersection over union of the rectangles);
* centre location error ``e_t = ||c(p_t) - c(g_t)||_2`` in pixels.

Success plot: ``succ(θ) = #{t : S_t > θ} / n`` for the 21 thresholds θ = 0, 0.05, ..., 1;
its area under the curve (AUC) is the mean of those 21 values (the benchmark's ranking score).
Precision plot: ``prec(τ) = #{t : e_t <= τ} / n`` for τ = 0, 1, ..., 50 pixels; the
representative score is ``prec(20)``. The comparisons (strict ``>`` for overlap, ``<=`` for
the error) are those of the OTB toolkit. Over a dataset each sequence's curve is computed
first and the curves are averaged with equal weight per sequence (as in the OTB toolkit and
the GOT-10k toolkit's OTB experiment).

Frames whose ground truth is missing or absent, two rules (``absent_frames``):

* ``"drop"`` (the default): frames whose ground truth is not finite (NaN) or empty (w <= 0 or
  h <= 0) are left out of their sequence's averages (``n`` counts the others), as the GOT-10k
  toolkit leaves out frames whose target is not visible (``covers > 0``);
* ``"otb"``: the OTB toolkit's rule (``calcSeqErrRobust.m`` + ``perfPlot.m`` of
  jwlim/tracker_benchmark; pysot-toolkit's OPE follows it): a frame's ground truth is valid when
  all four numbers of the 1-based file are positive (``rect_anno > 0``), i.e. in dmlkit's
  0-based boxes ``x > -1, y > -1, w > 0, h > 0`` (NaN fails); every other frame stays in ``n``
  with overlap -1 (a failure at every overlap threshold) and centre error -1 (a success at every
  error threshold). This is the rule behind published OTB numbers; the two rules agree on
  sequences whose every frame has a valid box.

The first frame is counted (its prediction is the given start). A predicted box that is not
finite or has no area (w <= 0 or h <= 0) in a frame that is scored is refused
(:class:`ShapeError` naming the sequence and frame): its overlap (0) and centre error
(infinite, or from the negative width) measure nothing; the OTB toolkit replaces such a box
with the previous frame's, which a caller can do before evaluating. dmlkit's trackers never
output one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dmlkit.exceptions import ConfigError, DataError, ShapeError

#: The rules for frames without a valid ground-truth box (module docstring).
ABSENT_FRAMES = ("drop", "otb")

SUCCESS_THRESHOLDS = np.linspace(0.0, 1.0, 21)
PRECISION_THRESHOLDS = np.arange(0, 51, dtype=np.float64)


def _boxes(boxes: np.ndarray | Sequence, name: str) -> np.ndarray:
    arr = np.asarray(boxes, dtype=np.float64)
    if arr.ndim == 1 and arr.shape[0] == 4:
        arr = arr[None]
    if arr.ndim != 2 or arr.shape[1] != 4:
        raise ShapeError(f"{name} must be (N, 4) boxes (x, y, w, h), got shape {arr.shape}")
    return arr


def _pair(pred: np.ndarray | Sequence, gt: np.ndarray | Sequence) -> tuple[np.ndarray, np.ndarray]:
    p, g = _boxes(pred, "predicted boxes"), _boxes(gt, "ground-truth boxes")
    if p.shape != g.shape:
        raise ShapeError(
            f"{len(p)} predicted boxes but {len(g)} ground-truth boxes: one box per frame each"
        )
    return p, g


def check_absent_frames(absent_frames: str) -> str:
    """``absent_frames`` (``"drop"`` or ``"otb"``, any case), else one :class:`ConfigError` line."""
    rule = absent_frames.strip().lower() if isinstance(absent_frames, str) else None
    if rule not in ABSENT_FRAMES:
        raise ConfigError(f"absent_frames (--absent-frames) must be 'drop' (leave frames without ground truth "
                          f"out) or 'otb' (the OTB toolkit's rule), got {absent_frames!r}")
    return rule


def valid_frames(gt: np.ndarray | Sequence, absent_frames: str = "drop") -> np.ndarray:
    """Mask of frames with a usable ground truth: finite values and positive width and height;
    with ``absent_frames="otb"`` also ``x > -1`` and ``y > -1`` (the OTB toolkit's
    ``rect_anno > 0`` on its 1-based numbers, in dmlkit's 0-based boxes)."""
    g = _boxes(gt, "ground-truth boxes")
    with np.errstate(invalid="ignore"):
        ok = np.isfinite(g).all(axis=1) & (g[:, 2] > 0) & (g[:, 3] > 0)
        if check_absent_frames(absent_frames) == "otb":
            ok &= (g[:, 0] > -1) & (g[:, 1] > -1)
    return ok


def check_predictions(pred: np.ndarray | Sequence, scored: np.ndarray, name: str = "seq") -> None:
    """Refuse (:class:`ShapeError`, one line naming the sequence and the first such frame) a
    predicted box that is not finite or has no area (w <= 0 or h <= 0) in a ``scored`` frame:
    its overlap is 0 and its centre error infinite or taken from the negative width. The OTB
    toolkit carries the previous frame's box over such a frame instead."""
    p = _boxes(pred, "predicted boxes")
    with np.errstate(invalid="ignore"):
        bad = scored & ~(np.isfinite(p).all(axis=1) & (p[:, 2] > 0) & (p[:, 3] > 0))
    if bad.any():
        t = int(np.flatnonzero(bad)[0])
        raise ShapeError(f"sequence {name!r}: {int(bad.sum())} predicted box(es) are not finite or have no area, "
                         f"first frame {t} (0-based): {p[t].tolist()}; every scored frame needs a box with finite "
                         "x, y and positive w, h (the OTB toolkit carries the previous frame's box over such frames)")


def overlap(pred: np.ndarray | Sequence, gt: np.ndarray | Sequence) -> np.ndarray:
    """Per-frame intersection over union of ``(x, y, w, h)`` boxes, in [0, 1]."""
    p, g = _pair(pred, gt)
    pw, ph = np.clip(p[:, 2], 0, None), np.clip(p[:, 3], 0, None)
    gw, gh = np.clip(g[:, 2], 0, None), np.clip(g[:, 3], 0, None)
    iw = np.clip(np.minimum(p[:, 0] + pw, g[:, 0] + gw) - np.maximum(p[:, 0], g[:, 0]), 0, None)
    ih = np.clip(np.minimum(p[:, 1] + ph, g[:, 1] + gh) - np.maximum(p[:, 1], g[:, 1]), 0, None)
    inter = iw * ih
    union = pw * ph + gw * gh - inter
    with np.errstate(invalid="ignore", divide="ignore"):
        iou = np.where(union > 0, inter / np.where(union > 0, union, 1.0), 0.0)
    # at most 1: the intersection's width (x + w) - x rounds apart from w, so a box against
    # itself scored up to 1 + 1e-14 and counted as a success at the threshold 1 (the GOT-10k
    # toolkit clips too)
    return np.clip(np.nan_to_num(iou, nan=0.0), 0.0, 1.0)


def center_error(pred: np.ndarray | Sequence, gt: np.ndarray | Sequence) -> np.ndarray:
    """Per-frame Euclidean distance between box centres, in pixels."""
    p, g = _pair(pred, gt)
    pc = p[:, :2] + p[:, 2:] / 2.0
    gc = g[:, :2] + g[:, 2:] / 2.0
    err = np.sqrt(((pc - gc) ** 2).sum(axis=1))
    return np.where(np.isfinite(err), err, np.inf)


def success_curve(ious: np.ndarray, thresholds: np.ndarray = SUCCESS_THRESHOLDS) -> np.ndarray:
    """Fraction of frames with overlap strictly above each threshold."""
    ious = np.asarray(ious, dtype=np.float64)
    if ious.size == 0:
        raise ShapeError("success_curve needs at least one frame")
    return (ious[:, None] > np.asarray(thresholds)[None, :]).mean(axis=0)


def precision_curve(
    errors: np.ndarray, thresholds: np.ndarray = PRECISION_THRESHOLDS
) -> np.ndarray:
    """Fraction of frames with centre error at most each threshold (pixels)."""
    errors = np.asarray(errors, dtype=np.float64)
    if errors.size == 0:
        raise ShapeError("precision_curve needs at least one frame")
    return (errors[:, None] <= np.asarray(thresholds)[None, :]).mean(axis=0)


@dataclass
class SequenceResult:
    """One sequence's one-pass result: per-frame measures and curves. ``frames`` is the number
    of tracked frames (those without valid ground truth included; default: ``len(ious)``), whose
    updates (all frames but the first) ``fps`` measures."""

    name: str
    ious: np.ndarray
    center_errors: np.ndarray
    success: np.ndarray
    precision: np.ndarray
    fps: float | None = None
    frames: int | None = None

    @property
    def tracked_frames(self) -> int:
        """Frames tracked: ``frames``, else (not given) ``len(ious)``."""
        return len(self.ious) if self.frames is None else int(self.frames)

    @property
    def scored_frames(self) -> int:
        """Frames with valid ground truth: those the success and precision curves average."""
        return len(self.ious)

    @property
    def updates(self) -> int:
        """Timed updates: every tracked frame but the first (the initialisation)."""
        return self.tracked_frames - 1

    @property
    def auc(self) -> float:
        return float(self.success.mean())

    @property
    def precision_at_20(self) -> float:
        return float(self.precision[20])


@dataclass
class OPEResult:
    """A tracker's one-pass evaluation over a set of sequences."""

    sequences: list[SequenceResult]
    #: the rule for frames without valid ground truth the curves were computed under
    absent_frames: str = "drop"
    success: np.ndarray = field(init=False)
    precision: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        if not self.sequences:
            raise ShapeError("an OPE result needs at least one sequence")
        self.success = np.mean([s.success for s in self.sequences], axis=0)
        self.precision = np.mean([s.precision for s in self.sequences], axis=0)

    @property
    def auc(self) -> float:
        """Success AUC: mean of the 21-point success curve."""
        return float(self.success.mean())

    @property
    def precision_at_20(self) -> float:
        return float(self.precision[20])

    @property
    def fps(self) -> float | None:
        """Updates per second over all timed sequences (total updates / total time), if timed.

        A sequence's time is its updates (tracked frames but the first) over its fps: frames
        left out of the measures for want of ground truth were tracked and timed too."""
        rates = [s for s in self.sequences
                 if s.fps is not None and np.isfinite(s.fps) and s.fps > 0 and s.updates > 0]
        if not rates:
            return None
        return float(sum(s.updates for s in rates) / sum(s.updates / s.fps for s in rates))

    def summary(self) -> dict[str, float | int | str | None]:
        """Success AUC, precision at 20 px, the sequence count, ``num_frames`` (frames tracked)
        and ``num_scored_frames`` (the frames the curves average: those with valid ground truth,
        every frame under ``absent_frames="otb"``), fps, and the ``absent_frames`` rule."""
        return {
            "success_auc": self.auc,
            "precision_at_20": self.precision_at_20,
            "num_sequences": len(self.sequences),
            "num_frames": int(sum(s.tracked_frames for s in self.sequences)),
            "num_scored_frames": int(sum(s.scored_frames for s in self.sequences)),
            "fps": self.fps,
            "absent_frames": self.absent_frames,
        }

    def to_dict(self) -> dict:
        return {
            **self.summary(),
            "success_thresholds": SUCCESS_THRESHOLDS.tolist(),
            "success_curve": self.success.tolist(),
            "precision_thresholds": PRECISION_THRESHOLDS.tolist(),
            "precision_curve": self.precision.tolist(),
            "per_sequence": {
                s.name: {"success_auc": s.auc, "precision_at_20": s.precision_at_20,
                         "frames": s.tracked_frames, "scored_frames": s.scored_frames, "fps": s.fps}
                for s in self.sequences
            },
        }


def evaluate_sequence(
    pred: np.ndarray | Sequence, gt: np.ndarray | Sequence, name: str = "seq",
    fps: float | None = None, absent_frames: str = "drop",
) -> SequenceResult:
    """One-pass measures of one sequence; frames with invalid ground truth left out
    (``absent_frames="drop"``) or kept as the OTB toolkit keeps them (``"otb"``: their overlap
    and centre error are its code -1, in ``ious`` and ``center_errors`` too; and the first
    frame's prediction replaced by its ground truth, as the toolkit does). A sequence needs a
    valid box after the first frame, which is the tracker's given start (GOT-10k's test split
    annotates only that one: every tracker scored about 0.95 on it). Invalid predictions in
    scored frames are refused (:func:`check_predictions`)."""
    rule = check_absent_frames(absent_frames)
    p, g = _pair(pred, gt)
    if not valid_frames(g)[1:].any():
        raise ShapeError(f"sequence {name!r} has no valid ground-truth box after its first frame (the "
                         "given start): nothing to measure (GOT-10k's test split is scored by its server; "
                         "evaluate on val)")
    keep = valid_frames(g, rule)
    if rule == "otb":  # calcSeqErrRobust.m: results(1,:) = rect_anno(1,:), the given start scores 1
        p = p.copy()
        p[0] = g[0]
    check_predictions(p, keep, name)
    if rule == "drop":
        ious = overlap(p[keep], g[keep])
        errs = center_error(p[keep], g[keep])
    else:  # calcSeqErrRobust.m: errCoverage(~idx) = -1, errCenter(~idx) = -1, over all frames
        ious, errs = np.full(len(g), -1.0), np.full(len(g), -1.0)
        ious[keep] = overlap(p[keep], g[keep])
        errs[keep] = center_error(p[keep], g[keep])
    return SequenceResult(name, ious, errs, success_curve(ious), precision_curve(errs), fps, len(p))


def evaluate_ope(
    predictions: Mapping[str, np.ndarray], ground_truth: Mapping[str, np.ndarray], *,
    fps: Mapping[str, float] | None = None, absent_frames: str = "drop",
) -> OPEResult:
    """OTB one-pass evaluation of ``{sequence: (N, 4) boxes}`` against the ground truth (both
    0-based, :mod:`~dmlkit.apps.tracking.geometry`). ``absent_frames``: ``"drop"`` leaves frames
    without a valid ground-truth box out, ``"otb"`` keeps them as the OTB toolkit does (the rule
    of published OTB numbers; module docstring)."""
    rule = check_absent_frames(absent_frames)
    if fps is not None and not isinstance(fps, Mapping):
        raise ConfigError(f"fps must map sequence names to frames per second, got {type(fps).__name__}")
    missing = sorted(set(ground_truth) - set(predictions))
    if missing:
        raise ShapeError(f"no predictions for sequences {missing[:5]}: run the tracker on them")
    fps = fps or {}
    return OPEResult([
        evaluate_sequence(predictions[name], ground_truth[name], name, fps.get(name), rule)
        for name in ground_truth
    ], absent_frames=rule)


def plot_ope(results: Mapping[str, OPEResult], title: str = "OPE"):
    """Success and precision plots (matplotlib figure, two axes) of several trackers.

    Legends carry the ranking scores as in the OTB paper: AUC for success, precision at
    20 pixels for precision. The figure is drawn without pyplot
    (:func:`dmlkit.report.figures.new_figure`): the program's matplotlib backend and
    ``MPLBACKEND`` stay as they were (each call switched them to Agg).
    """
    from dmlkit.report.figures import new_figure  # lazy: matplotlib loads only to draw
    from dmlkit.report.style import figure_style  # lazy: matplotlib loads only to draw

    with figure_style():  # dmlkit's settings: tracker names drawn literally, never as mathtext
        return _plot_ope(new_figure, results, title)


def _plot_ope(new_figure: Any, results: Mapping[str, OPEResult], title: str):
    fig, (ax_s, ax_p) = new_figure(1, 2, figsize=(10, 4.2))
    for name, res in sorted(results.items(), key=lambda kv: -kv[1].auc):
        ax_s.plot(SUCCESS_THRESHOLDS, res.success, label=f"{name} [{res.auc:.3f}]")
    for name, res in sorted(results.items(), key=lambda kv: -kv[1].precision_at_20):
        ax_p.plot(PRECISION_THRESHOLDS, res.precision, label=f"{name} [{res.precision_at_20:.3f}]")
    ax_s.set(title=f"Success plots of {title}", xlabel="Overlap threshold",
             ylabel="Success rate", xlim=(0, 1), ylim=(0, 1.02))
    ax_p.set(title=f"Precision plots of {title}", xlabel="Location error threshold (pixels)",
             ylabel="Precision", xlim=(0, 50), ylim=(0, 1.02))
    for ax in (ax_s, ax_p):
        ax.grid(alpha=0.3)
        ax.legend(loc="lower left" if ax is ax_s else "lower right", fontsize=8)
    fig.tight_layout()
    return fig


def check_ground_truth(sequences) -> None:
    """Refuse, before any tracking, sequences that one-pass evaluation cannot score: without
    ground truth, without a valid box (finite, positive width and height) in the first frame
    (the tracker's start) or without one after it (:func:`evaluate_sequence`). One
    :class:`DataError` names each such sequence (the first five); it came after the tracking of
    every earlier sequence."""
    problems = []
    for seq in sequences:
        keep = None if seq.boxes is None else valid_frames(seq.boxes)
        if keep is None:
            problems.append(f"{seq.name!r} has no ground truth")
        elif not keep[0]:
            problems.append(f"{seq.name!r} has no valid ground-truth box in its first frame")
        elif not keep[1:].any():
            problems.append(f"{seq.name!r} has no valid ground-truth box after its first frame")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise DataError(f"cannot evaluate: {'; '.join(problems[:5])}{more}; fix or leave out those sequences "
                        "(GOT-10k's test split is scored by its server: evaluate on val)")


def run_ope(tracker, sequences, progress: bool = False,
            absent_frames: str = "drop") -> tuple[OPEResult, dict[str, np.ndarray]]:
    """Run ``tracker`` (anything with ``track(frames, init_box)``) once over each annotated
    sequence from its first ground-truth box; returns the OPE result (``absent_frames`` as in
    :func:`evaluate_ope`) and the predicted boxes. Every sequence's ground truth is checked
    before any is tracked (:func:`check_ground_truth`)."""
    absent_frames = check_absent_frames(absent_frames)
    check_ground_truth(sequences)
    preds, gts, fps = {}, {}, {}
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(len(s) for s in sequences), desc="tracking", unit="frame")
    for seq in sequences:
        if seq.boxes is None or not np.isfinite(seq.boxes[0]).all():
            raise ShapeError(f"sequence {seq.name!r} has no ground-truth box in its first frame")
        result = tracker.track(seq, seq.boxes[0],
                               progress=(lambda: bar.update(1)) if bar else None)
        preds[seq.name], gts[seq.name], fps[seq.name] = result.boxes, seq.boxes, result.fps
    if bar is not None:
        bar.close()
    return evaluate_ope(preds, gts, fps=fps, absent_frames=absent_frames), preds
