"""Figures of an embedding space, as pure functions that return a matplotlib ``Figure``.

Every figure is print quality: labelled axes with units, a title, line styles and hatching
that stay readable in greyscale, and no dependence on colour alone for meaning (markers and
line styles differ too). Save them with :func:`save_figure` (PNG + SVG). Each is built and
saved in dmlkit's matplotlib settings (:mod:`dmlkit.report.style`: names drawn literally, never
as mathtext), which leave the caller's own settings as they were.

Figures:

* :func:`training_curves` - training loss and validation MAP@R / P@1 per evaluation step,
  one line per fold or run.
* :func:`embedding_map` - a 2-D map of embeddings (UMAP, t-SNE or PCA) coloured by class,
  optionally with image thumbnails at a sample of points.
* :func:`similarity_histograms` - the positive/negative similarity histograms of Oi et al.
  ("Analysis of Evaluation Metrics with the Distance between Positive Pairs and Negative
  Pairs in Deep Metric Learning"), each normalised to area 1, with their Jensen-Shannon
  divergence in the legend; several panels (before/after training, train/val/test).
* :func:`retrieval_gallery` - queries and their top-k neighbours, correct ones marked.
* :func:`per_class_bars` - the best and worst classes by a per-class metric.
* :func:`relative_improvement` - each method's relative improvement over contrastive and
  triplet (the Reality Check's "papers versus reality" view) with a line at zero.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from dmlkit.exceptions import ConfigError, DataError, ShapeError
from dmlkit.protocol.compare import relative_percent
from dmlkit.report.style import styled
from dmlkit.utils import atomic_write_figure
from dmlkit.validation import check_embeddings

__all__ = [
    "check_projection", "cmc_curve", "drawn_projection", "embedding_map", "new_figure", "per_class_bars",
    "project_2d", "projection_name", "projection_title", "reid_strip", "relative_improvement",
    "retrieval_gallery", "save_figure", "similarity_histograms", "training_curves",
]

_LINESTYLES = ["-", "--", "-.", ":"]
_MARKERS = ["o", "s", "^", "D", "v", "P", "X", "*"]
_HATCHES = ["", "//", "..", "xx", "\\\\", "++", "oo", "--"]

def new_figure(nrows: int = 1, ncols: int = 1, *, figsize: tuple[float, float] | None = None,
               **subplots: Any) -> tuple[Figure, Any]:
    """``(figure, axes)`` as ``pyplot.subplots`` returns them, without pyplot: a ``Figure`` on its own
    ``FigureCanvasAgg``; the program's backend and ``MPLBACKEND`` stay as they were (set to Agg at
    import, a notebook's inline plots stopped showing, and child processes inherited the variable)."""
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, **subplots)


@styled
def save_figure(fig: Figure, path_without_suffix: str | os.PathLike, formats: Sequence[str] = ("png", "svg")) -> list[Path]:
    """Save ``fig`` as ``<path>.png`` and ``<path>.svg`` (print quality) and close it.

    A ``.png``/``.svg`` ending of ``path`` is dropped; any other dot stays part of the name
    (``lr0.001`` -> ``lr0.001.png``: replacing the "suffix" wrote ``lr0.png``, and ``lr0.01``
    then overwrote it). Each file is written atomically (:func:`~dmlkit.utils.atomic_write_figure`):
    a killed or failed save leaves the earlier figure or none, never a truncated one."""
    base = Path(path_without_suffix)
    if base.suffix.lower() in (".png", ".svg"):
        base = base.with_suffix("")
    try:
        return [atomic_write_figure(fig, base.parent / f"{base.name}.{fmt}", bbox_inches="tight")
                for fmt in formats]
    finally:  # a pyplot figure (the caller's) is closed there; new_figure's have no manager
        if (pyplot := sys.modules.get("matplotlib.pyplot")) is not None:
            pyplot.close(fig)


# -- training curves -------------------------------------------------------------------------
@styled
def training_curves(
    runs: Mapping[str, Sequence[Mapping[str, Any]]],
    metrics: Sequence[str] = ("map_at_r", "precision_at_1"),
) -> Figure:
    """Loss and validation metrics against the training step.

    Args:
        runs: ``{run name (e.g. "fold 0"): log records}``, the records of a run's
            ``log.jsonl`` (``{"event": "train", "step", "loss"}`` and
            ``{"event": "eval", "step", <metric>...}``).
        metrics: validation metrics to plot, one panel each.
    """
    if not runs:
        raise DataError("no training logs to plot")
    fig, axes = new_figure(1, 1 + len(metrics), figsize=(4.2 * (1 + len(metrics)), 3.4))
    axes = np.atleast_1d(axes)
    for i, (name, records) in enumerate(runs.items()):
        # markers every tenth point by count: a fractional markevery draws none on a one-point
        # series (a run evaluated once showed empty validation panels)
        style = dict(linestyle=_LINESTYLES[i % 4], marker=_MARKERS[i % len(_MARKERS)])
        train = _points(name, [r for r in records if r.get("event") == "train" and r.get("loss") is not None],
                        "loss")
        if train:
            steps, loss = (np.array(c, dtype=float) for c in zip(*train))
            axes[0].plot(steps, _smooth(loss), label=name, markersize=3, markevery=max(1, steps.size // 10),
                         **style)
        evals = [r for r in records if r.get("event") == "eval"]
        for ax, metric in zip(axes[1:], metrics):
            pts = _points(name, [r for r in evals if metric in r], metric)
            if pts:
                s, v = zip(*pts)
                ax.plot(s, 100 * np.asarray(v, dtype=float), label=name, markersize=4,
                        markevery=max(1, len(s) // 10), **style)
    if not any(ax.get_lines() for ax in axes):  # a blank figure is no answer: say what is missing
        raise DataError(f"the logs hold no training loss and no validation {', '.join(metrics)}: "
                        "nothing to draw (a run logs them as it trains and evaluates)")
    axes[0].set(title="Training loss (smoothed)", xlabel="step (batches)", ylabel="loss")
    for ax, metric in zip(axes[1:], metrics):
        ax.set(title=f"Validation {_pretty(metric)}", xlabel="step (batches)", ylabel=f"{_pretty(metric)} (%)")
    if len(runs) <= 4:
        for ax in axes:
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
    else:  # many runs: one compact legend beside the panels, naming every run drawn in any panel
        # (from the loss panel alone, a run logged without losses was drawn and not named)
        named = {}
        for ax in axes:
            for handle, label in zip(*ax.get_legend_handles_labels()):
                named.setdefault(label, handle)
        if named:
            fig.legend(list(named.values()), list(named), loc="center left", bbox_to_anchor=(1.0, 0.5),
                       fontsize=7)
    fig.tight_layout()
    return fig


def _points(run: str, records: Sequence[Mapping[str, Any]], key: str) -> list[tuple[float, float]]:
    """``(step, value)`` of log records (a null value is NaN); a record without a numeric step
    or with a value that is no number is one :class:`DataError` naming the run (a damaged log
    gave a KeyError or ValueError traceback)."""
    def number(x: Any) -> bool:
        return isinstance(x, int | float) and not isinstance(x, bool)

    out = []
    for r in records:
        step, value = r.get("step"), r.get(key)
        if not number(step) or not (value is None or number(value)):
            what = "no numeric step" if not number(step) else f"a {key} that is not a number"
            raise DataError(f"{run}: a log record has {what} ({str(dict(r))[:80]}): the log is damaged")
        out.append((float(step), math.nan if value is None else float(value)))
    return out


def _smooth(values: np.ndarray, window: int = 0) -> np.ndarray:
    window = window or max(1, len(values) // 50)
    if window <= 1:
        return values
    kernel = np.ones(window) / window
    padded = np.concatenate([np.full(window - 1, values[0]), values])
    return np.convolve(padded, kernel, mode="valid")


# -- 2-D maps ---------------------------------------------------------------------------------
#: The 2-D projections of :func:`project_2d`.
PROJECTIONS = ("umap", "tsne", "pca")


#: Fewer rows than this and UMAP (its spectral initialisation) fails: PCA draws the map.
_UMAP_MIN_ROWS = 4


def check_projection(method: str) -> None:
    """Refuse a projection name :func:`project_2d` does not know (:class:`ConfigError`)."""
    if method not in PROJECTIONS:
        raise ConfigError(f"unknown projection {method!r}: use {', '.join(PROJECTIONS)}")


def project_2d(embeddings: np.ndarray, method: str = "umap", seed: int = 0) -> np.ndarray:
    """Project ``(N, D)`` embeddings to ``(N, 2)`` with ``umap``, ``tsne`` or ``pca``.

    UMAP (McInnes et al. 2018, umap-learn) and t-SNE (van der Maaten & Hinton 2008,
    scikit-learn) use cosine geometry since dmlkit embeddings are L2-normalised; PCA is the
    fast fallback. UMAP falls back to PCA when umap-learn is not installed or for fewer than 4 rows.
    """
    check_projection(method)
    x = check_embeddings(embeddings).cpu().numpy()  # (N, D), finite: NaN is refused, not drawn
    n = len(x)
    if n < 3:
        raise DataError("a 2-D map needs at least 3 embeddings")
    drawn = drawn_projection(method, n, x.shape[1])
    if drawn == "2-d":
        return np.asarray(x, dtype=np.float32)
    if drawn == "pca":
        from sklearn.decomposition import PCA

        return np.asarray(PCA(n_components=2, random_state=seed).fit_transform(x), dtype=np.float32)
    if method == "tsne":
        from sklearn.manifold import TSNE

        perplexity = float(min(30.0, max(2.0, (n - 1) / 3)))
        return TSNE(
            n_components=2, metric="cosine", init="pca", perplexity=perplexity, random_state=seed
        ).fit_transform(x).astype(np.float32)
    import umap  # drawn_projection checked it imports

    reducer = umap.UMAP(
        n_components=2, metric="cosine", n_neighbors=min(15, n - 1), random_state=seed, n_jobs=1
    )
    return np.asarray(reducer.fit_transform(x), dtype=np.float32)


def drawn_projection(method: str, rows: int, dim: int) -> str:
    """The projection :func:`project_2d` draws for ``method`` on ``(rows, dim)`` embeddings:
    ``"2-d"`` when they are 2-D already (drawn as they are), ``"pca"`` for UMAP with fewer than 4
    rows or without umap-learn, else ``method``. Titles name what was drawn, not what was asked."""
    if dim <= 2:
        return "2-d"
    if method == "umap":
        if rows < _UMAP_MIN_ROWS:  # umap's spectral start needs more rows than components + 1
            return "pca"
        try:
            import umap  # noqa: F401
        except ImportError:  # optional extra
            return "pca"
    return method


#: How titles and captions spell each projection (t-SNE as its authors write it, not "TSNE").
_PROJECTION_NAMES = {"umap": "UMAP", "tsne": "t-SNE", "pca": "PCA"}


def projection_name(method: str) -> str:
    """``"UMAP"``, ``"t-SNE"`` or ``"PCA"`` for a :data:`PROJECTIONS` name."""
    return _PROJECTION_NAMES.get(method, method.upper())


def projection_title(method: str, rows: int, dim: int) -> str:
    """``"UMAP"``, or what was drawn instead (``"PCA (UMAP needs umap-learn and 4 points)"``)."""
    drawn = drawn_projection(method, rows, dim)
    if drawn == method:
        return projection_name(method)
    if drawn == "2-d":
        return "2-D embeddings (not projected)"
    return f"PCA (UMAP needs umap-learn and at least {_UMAP_MIN_ROWS} points)"


def class_label(label: Any, class_names: Mapping[Any, str] | None = None) -> str:
    """How a figure names a class: its name (the folder name of an image-folder dataset) when
    ``class_names`` (``{id: name}``) has it, else the id."""
    if class_names:
        for key in (label, _as_int(label)):
            if key is not None and key in class_names:
                return str(class_names[key])
    return str(label)


def _as_int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


@styled
def embedding_map(
    points_2d: np.ndarray,
    labels: np.ndarray,
    title: str,
    thumbnails: Mapping[int, np.ndarray] | None = None,
    max_legend_classes: int = 40,
    class_names: Mapping[Any, str] | None = None,
) -> Figure:
    """Scatter of 2-D points coloured (and shaped) by class, with optional thumbnails.

    The legend stands beside the axes, where it covers no point, and names every class (two
    columns above 20) up to ``max_legend_classes``; with more, the title says that the classes
    are not named. (The legend was drawn for at most 12 classes, so the report's default map of
    20 classes named none, and said nothing.) Thumbnails are drawn beside their points, offset
    away from the map's centre with a line to the point, and under every point: drawn on their
    points, 12 thumbnails hid whole clusters of a 20-class UMAP.

    Args:
        points_2d: ``(N, 2)`` from :func:`project_2d`.
        labels: ``(N,)`` class ids.
        title: e.g. ``"UMAP of test embeddings"``.
        thumbnails: ``{row index: image array (H, W) or (H, W, 3) in [0, 1]}`` drawn beside
            their points.
        max_legend_classes: the most classes the legend names.
        class_names: ``{id: name}``: the legend shows names (:func:`class_label`).
    """
    from matplotlib.offsetbox import AnnotationBbox, OffsetImage

    pts = np.asarray(points_2d)
    labels = np.asarray(labels)
    if pts.shape != (len(labels), 2):
        raise ShapeError(f"points must be (N, 2) matching labels, got {pts.shape} and {labels.shape}")
    classes = np.unique(labels)
    named = len(classes) <= max_legend_classes
    columns = 1 if len(classes) <= 20 else 2
    fig, ax = new_figure(figsize=(6.5 + (1.8 * columns if named else 0.0), 6.0))
    cmap = colormaps["tab20" if len(classes) > 10 else "tab10"]
    for i, c in enumerate(classes):
        sel = labels == c
        ax.scatter(
            pts[sel, 0], pts[sel, 1], s=10, alpha=0.75, color=cmap(i % cmap.N),
            marker=_MARKERS[i % len(_MARKERS)], label=class_label(c, class_names) if named else None,
            linewidths=0, zorder=_POINTS_Z,
        )
    if thumbnails:
        ax.margins(0.12)  # room for the thumbnails of the outermost points
        for idx, image in thumbnails.items():
            img = np.asarray(image)
            zoom = 24.0 / max(img.shape[:2])
            box = OffsetImage(img, zoom=zoom, cmap="gray" if img.ndim == 2 else None)
            ax.add_artist(AnnotationBbox(
                box, tuple(pts[idx]), xybox=_thumbnail_offset(pts, int(idx)), boxcoords="offset points",
                frameon=True, pad=0.1, zorder=_POINTS_Z - 0.5,
                arrowprops={"arrowstyle": "-", "color": "0.35", "linewidth": 0.6}))
    shown = f"{len(classes)} classes, {len(labels)} points" + ("" if named else "; too many classes to name")
    ax.set(title=f"{title} ({shown})", xlabel="component 1 (a.u.)", ylabel="component 2 (a.u.)")
    if named:
        ax.legend(title="class", markerscale=2, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                  borderaxespad=0.0, ncol=columns)
    fig.tight_layout()
    return fig


#: The points' layer: above the grid (1.5 with ``axes.axisbelow: line``) and the thumbnails.
_POINTS_Z = 2.0
#: How far (points) a thumbnail's centre sits from its point: half a 24-point thumbnail and a gap.
_THUMBNAIL_OFFSET = 30.0


def _thumbnail_offset(pts: np.ndarray, idx: int) -> tuple[float, float]:
    """Where the thumbnail of row ``idx`` goes, in points from its point: :data:`_THUMBNAIL_OFFSET`
    away from the median of ``pts``, in axes-scaled units (so that a map much wider than tall
    still pushes outwards); straight up for the median point itself."""
    span = np.ptp(pts, axis=0)
    span[span == 0] = 1.0
    d = (pts[idx] - np.median(pts, axis=0)) / span
    norm = float(np.hypot(*d))
    if norm < 1e-9:
        return (0.0, _THUMBNAIL_OFFSET)
    return (float(_THUMBNAIL_OFFSET * d[0] / norm), float(_THUMBNAIL_OFFSET * d[1] / norm))


# -- similarity histograms --------------------------------------------------------------------
@styled
def similarity_histograms(panels: Mapping[str, Mapping[str, Any]]) -> Figure:
    """Positive vs negative pair similarity histograms, each normalised to area 1.

    Args:
        panels: ``{panel title: histogram}`` where a histogram is the mapping returned by
            :func:`dmlkit.metrics.pos_neg_histograms`: ``bin_edges``, ``positive_density``,
            ``negative_density`` and ``js_divergence`` (base 2, in [0, 1]).
    """
    if not panels:
        raise DataError("no histograms to plot")
    n = len(panels)
    fig, axes = new_figure(1, n, figsize=(4.0 * n, 3.3), sharey=False)
    axes = np.atleast_1d(axes)
    for ax, (title, h) in zip(axes, panels.items()):
        edges = np.asarray(h["bin_edges"], dtype=float)
        pos = np.asarray(h["positive_density"], dtype=float)
        neg = np.asarray(h["negative_density"], dtype=float)
        ax.stairs(neg, edges, fill=True, alpha=0.35, color="0.45", hatch="//", label="negative pairs")
        ax.stairs(pos, edges, fill=False, linewidth=1.8, color="black", label="positive pairs")
        ax.set(
            title=f"{title}\nJS divergence = {float(h['js_divergence']):.3f}",
            xlabel="cosine similarity", ylabel="density (area = 1)",
        )
        ax.legend(loc="upper left")
    fig.tight_layout()
    return fig


# -- retrieval gallery ------------------------------------------------------------------------
@styled
def retrieval_gallery(
    rows: Sequence[Mapping[str, Any]],
    image_of: Any = None,
    title: str = "Retrieval gallery",
    class_names: Mapping[Any, str] | None = None,
) -> Figure:
    """Queries (left column) and their top-k neighbours, correct ones marked.

    Args:
        rows: one per query: ``{"query": index, "query_label": label, "neighbors": [indices],
            "neighbor_labels": [labels], "caption": str}``.
        image_of: callable ``index -> image array`` (thumbnails) or ``None`` to draw labels.
        class_names: ``{id: name}``: cells are captioned with names (correctness compares ids).
    """
    if not rows:
        raise DataError("no queries for the gallery")
    k = max(len(r["neighbors"]) for r in rows)
    fig, axes = new_figure(len(rows), k + 1, figsize=(1.25 * (k + 1), 1.45 * len(rows)), squeeze=False)
    for i, row in enumerate(rows):
        cells = [(row["query"], row["query_label"], None)] + [
            (n, lab, lab == row["query_label"]) for n, lab in zip(row["neighbors"], row["neighbor_labels"])
        ]
        for j in range(k + 1):
            ax = axes[i, j]
            ax.set_xticks([])
            ax.set_yticks([])
            ax.grid(False)
            if j >= len(cells):
                ax.axis("off")
                continue
            index, label, correct = cells[j]
            if image_of is not None:
                img = np.asarray(image_of(int(index)))
                ax.imshow(img, cmap="gray" if img.ndim == 2 else None)
            else:
                ax.text(0.5, 0.5, class_label(label, class_names), ha="center", va="center", fontsize=9)
            if correct is None:
                colour, mark, width = "black", "query", 2.5
            elif correct:
                colour, mark, width = "tab:green", "✓ correct", 3.0
            else:
                colour, mark, width = "tab:red", "✗ wrong", 1.0
            for spine in ax.spines.values():
                spine.set_edgecolor(colour)
                spine.set_linewidth(width)
                spine.set_linestyle("-" if correct is not False else "--")
            shown = class_label(label, class_names) if class_names else f"class {label}"
            ax.set_xlabel(f"{mark}\n{shown}", fontsize=7)
        axes[i, 0].set_ylabel(row.get("caption", ""), fontsize=7)
    fig.suptitle(f"{title}: query, then nearest neighbours (rank 1 to {k})")
    fig.tight_layout()
    return fig


# -- per-class metric -------------------------------------------------------------------------
@styled
def per_class_bars(values: Mapping[Any, float], metric: str = "map_at_r", top: int = 10,
                   class_names: Mapping[Any, str] | None = None) -> Figure:
    """The ``top`` best and worst classes by a per-class metric, as horizontal bars, named by
    ``class_names`` (``{id: name}``) where given. The dotted line is the mean over the classes
    (each class counts once), labelled so: with classes of unequal size it is not the metric
    over all queries that a results table gives."""
    if len(values) < 2:  # one class: a lone bar (100 % with only itself to find) ranks nothing
        raise DataError(f"a best/worst chart needs at least 2 classes with a value, got {len(values)}")
    items = sorted(values.items(), key=lambda kv: kv[1])
    top = min(top, len(items))  # the titles count the bars drawn
    worst = items[:top]
    best = items[-top:][::-1]
    fig, axes = new_figure(1, 2, figsize=(9, 0.32 * max(len(best), len(worst)) + 1.4))
    for ax, chosen, name, hatch in ((axes[0], best, "best", ""), (axes[1], worst, "worst", "//")):
        labels = [class_label(c, class_names) for c, _ in chosen][::-1]
        if len(set(labels)) < len(labels):  # two classes with one name: keep the bars apart
            labels = [f"{class_label(c, class_names)} ({c})" for c, _ in chosen][::-1]
        vals = [100 * v for _, v in chosen][::-1]
        ax.barh(labels, vals, color="0.55" if hatch else "0.25", hatch=hatch, edgecolor="black")
        ax.set(title=f"{top} {name} classes", xlabel=f"{_pretty(metric)} (%)", ylabel="class")
    mean = 100 * float(np.mean(list(values.values())))
    for ax in axes:
        ax.axvline(mean, color="black", linestyle=":", label=f"mean over classes {mean:.1f}%")
        ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


# -- relative improvement ---------------------------------------------------------------------
@styled
def relative_improvement(
    results: Mapping[str, Mapping[str, float]],
    baselines: Sequence[str] = ("contrastive", "triplet"),
    metric: str = "map_at_r",
    mode: str | None = None,
) -> Figure:
    """Relative improvement ``100 * (m - m_base) / m_base`` of each method over each baseline
    (:func:`dmlkit.protocol.compare.relative_percent`; n/a for a missing, NaN or zero value).

    Args:
        results: ``{method: {metric: value}}`` (e.g. the concatenated MAP@R of a benchmark).
        baselines: methods to compare against; those absent from ``results`` are skipped.
        mode: the benchmark's mode the values are of (``concatenated`` / ``separated``), named
            in the title (the two modes' figures were titled alike).
    """
    present = [b for b in baselines if b in results]
    if not present:
        raise DataError(f"none of the baselines {list(baselines)} is among the methods {sorted(results)}")
    methods = [m for m in results if m not in present and m != "pretrained"] or [m for m in results if m not in present]
    if not methods:  # an empty figure with a legend read as a result
        raise DataError(f"no method besides the baselines {present} to compare with them")
    fig, ax = new_figure(figsize=(max(5.0, 1.1 * len(methods) + 2), 3.6))
    width = 0.8 / len(present)
    x = np.arange(len(methods))
    for i, base in enumerate(present):
        ref = results[base][metric]
        rel = np.array([np.nan if (p := relative_percent(results[m][metric], ref)) is None else p
                        for m in methods], dtype=float)
        known = np.isfinite(rel)
        # no value (NaN, or a baseline at 0) is an empty bar labelled n/a: an undrawn NaN bar
        # sat on the zero line and read as "no improvement"
        bars = ax.bar(x + (i - (len(present) - 1) / 2) * width, np.where(known, rel, 0.0), width,
                      label=f"vs {base}", color=("0.3", "0.7")[i % 2], hatch=_HATCHES[i % len(_HATCHES)],
                      edgecolor="black")
        ax.bar_label(bars, labels=[f"{v:+.1f}" if ok else "n/a" for v, ok in zip(rel, known)],
                     fontsize=7, padding=2)
    ax.axhline(0, color="black", linewidth=1.2, linestyle="--", label="no improvement")
    ax.set_xticks(x, methods, rotation=20, ha="right")
    ax.set(title=f"Relative improvement in {_pretty(metric)}" + (f" ({mode})" if mode else ""), ylabel="relative improvement (%)", xlabel="method")
    ax.legend()
    fig.tight_layout()
    return fig


_PRETTY = {
    "map_at_r": "MAP@R",
    "precision_at_1": "P@1",
    "r_precision": "R-Precision",
    "nmi": "NMI",
    "ami": "AMI",
    "pair_f1": "F1",
    "pos_neg_js": "JS divergence",
}


def _pretty(metric: str) -> str:
    if metric in _PRETTY:
        return _PRETTY[metric]
    if metric.startswith("recall_at_"):
        return f"Recall@{metric.rsplit('_', 1)[1]}"
    if metric.startswith("precision_at_"):
        return f"P@{metric.rsplit('_', 1)[1]}"
    return metric


# -- re-identification ------------------------------------------------------------------------
@styled
def cmc_curve(curves: Mapping[str, Sequence[float]], title: str = "CMC curve",
              max_rank: int = 50) -> Figure:
    """Cumulative matching characteristic: ``{name: [CMC(1), CMC(2), ...]}`` in ``[0, 1]``."""
    if not curves:
        raise DataError("no CMC curve to draw")
    fig, ax = new_figure(figsize=(5.5, 3.8))
    for i, (name, cmc) in enumerate(curves.items()):
        y = 100 * np.asarray(cmc, dtype=float)[:max_rank]
        ax.plot(np.arange(1, y.size + 1), y, _LINESTYLES[i % 4], marker=_MARKERS[i % 8],
                markevery=max(1, y.size // 10), label=f"{name} (Rank-1 {y[0]:.1f} %)")
    ax.set_xlabel("rank")
    ax.set_ylabel("matching rate (%)")
    ax.set_title(title)
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


@styled
def reid_strip(examples: Sequence[Mapping[str, Any]], image_of_path: Any = None,
               title: str = "Re-id ranking") -> Figure:
    """Queries and their ranked gallery, junk included: positive (green, solid), negative
    (red, dashed), junk (grey, dotted: same identity + same camera or a junk id; ignored by
    the protocol).

    Args:
        examples: ``{"query_id", "gallery_ids", "status": [...], "query_path"?,
            "gallery_paths"?}`` per query (``dmlkit reid``'s ``reid.json``).
        image_of_path: callable ``path -> image array`` or ``None`` to draw the ids.
    """
    if not examples:
        raise DataError("no re-id examples to draw")
    k = max(len(e["status"]) for e in examples)
    fig, axes = new_figure(len(examples), k + 1, figsize=(1.1 * (k + 1), 1.55 * len(examples)),
                             squeeze=False)
    style = {"query": ("black", "-", 2.5), "positive": ("tab:green", "-", 3.0),
             "negative": ("tab:red", "--", 1.0), "junk": ("tab:gray", ":", 1.5)}
    for i, e in enumerate(examples):
        paths = [e.get("query_path")] + list(e.get("gallery_paths") or [None] * len(e["status"]))
        ids = [e["query_id"]] + list(e["gallery_ids"])
        kinds = ["query"] + list(e["status"])
        for j in range(k + 1):
            ax = axes[i, j]
            ax.set_xticks([])
            ax.set_yticks([])
            ax.grid(False)
            if j >= len(kinds):
                ax.axis("off")
                continue
            if image_of_path is not None and paths[j] is not None:
                img = np.asarray(image_of_path(paths[j]))
                ax.imshow(img, cmap="gray" if img.ndim == 2 else None)
            else:
                ax.text(0.5, 0.5, str(ids[j]), ha="center", va="center", fontsize=9)
            colour, line, width = style[kinds[j]]
            for spine in ax.spines.values():
                spine.set_edgecolor(colour)
                spine.set_linewidth(width)
                spine.set_linestyle(line)
            label = kinds[j] if j == 0 else f"{j}: {kinds[j]}"
            ax.set_xlabel(f"{label}\nid {ids[j]}", fontsize=6)
    fig.suptitle(f"{title}: query, then the gallery by rank (junk shown, not counted)")
    fig.tight_layout()
    return fig
