"""The report's sections of one set of test embeddings, shared by run and benchmark reports:
pair-similarity histograms, 2-D maps, the retrieval gallery and per-class MAP@R; and
:class:`ReportOptions`, what the report draws and how much of it."""

from __future__ import annotations

import html
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dmlkit.exceptions import DmlkitError
from dmlkit.metrics import knn, per_class, per_query, pos_neg_histograms
from dmlkit.report import figures
from dmlkit.report.html import Figure, Section, table_html
from dmlkit.utils import PROCESS_STATE_LOCK

__all__ = ["ReportOptions", "hist_dict"]


@dataclass
class ReportOptions:
    """What to draw and how much of it.

    Attributes:
        maps: 2-D projections to draw (``umap``, ``tsne``, ``pca``).
        map_classes: classes shown in the 2-D maps (the first ones in test order, as many of them
            as ``max_points`` holds).
        max_points: samples per split used for the histograms and maps (whole classes, at
            least two of them; the maps' caption counts the classes and samples drawn).
        gallery_queries: random and worst queries in the retrieval gallery (each).
        gallery_k: neighbours per gallery row.
        thumbnails: draw image thumbnails where the data are images and can be loaded.
        data_root: where the run's dataset lives (default: the run's config / ``$DMLKIT_DATA``).
        seed: for every random choice (sampled queries, classes, projections).
    """

    maps: Sequence[str] = ("umap", "tsne", "pca")
    map_classes: int = 20
    max_points: int = 2000
    gallery_queries: int = 4
    gallery_k: int = 6
    thumbnails: bool = True
    data_root: str | os.PathLike | None = None
    seed: int = 0
    progress: Callable[[str], None] = field(default=lambda message: None)


@dataclass
class _Split:
    name: str
    embeddings: np.ndarray
    labels: np.ndarray
    image_of: Callable[[int], np.ndarray] | None = None
    #: ``{class id: name}`` (folder names of an image folder) for the figures; None: show ids
    class_names: Mapping[int, str] | None = None
    #: what the figures lack and why (no class names, no thumbnails), a sentence each for the page
    notes: Sequence[str] = ()


def _sample_rows(labels: np.ndarray, max_points: int, seed: int) -> np.ndarray:
    """Rows of whole classes (so every sample keeps its positives), up to ``max_points``, and at
    least two classes (one class has no negative pair: ``--max-points 10`` on classes of 10 or
    more images drew no histogram at all)."""
    if len(labels) <= max_points:
        return np.arange(len(labels))
    rng = np.random.default_rng(seed)
    rows: list[np.ndarray] = []
    total = 0
    for c in rng.permutation(np.unique(labels)):
        members = np.flatnonzero(labels == c)
        if total + len(members) > max_points and len(rows) >= 2:
            break
        rows.append(members)
        total += len(members)
    return np.sort(np.concatenate(rows))



def _map_rows(labels: np.ndarray, map_classes: int, max_points: int) -> tuple[np.ndarray, np.ndarray]:
    """The rows the 2-D maps draw and their classes: whole classes, the first ``map_classes`` in
    test order, as many as ``max_points`` samples hold (at least two classes, as the histograms:
    ``sel[:max_points]`` drew 3 of 6 classes, one of them cut in half, captioned "6 classes")."""
    rows: list[np.ndarray] = []
    total = 0
    for c in np.unique(labels)[:map_classes]:
        members = np.flatnonzero(labels == c)
        if total + len(members) > max_points and len(rows) >= 2:
            break
        rows.append(members)
        total += len(members)
    if not rows:
        return np.arange(0), np.unique(labels)[:0]
    sel = np.sort(np.concatenate(rows))
    return sel, np.unique(labels[sel])


def _embedding_sections(test: _Split, before: _Split | None, others: Mapping[str, _Split],
                        fig_dir: Path, options: ReportOptions, what: str,
                        state: str = "after training", notes: Sequence[str] = ()) -> list[Section]:
    """Histograms, maps, gallery and per-class chart of ``test`` (labelled ``test, <state>``);
    ``notes`` (e.g. which models the figures show) open the first section."""
    sections: list[Section] = []
    # histograms: before/after and train/val/test
    panels: dict[str, Any] = {}
    hist_rows = []
    rows = _sample_rows(test.labels, options.max_points, options.seed)
    def histogram(split: _Split, rows: np.ndarray):
        # bins over the observed similarity range of the drawn rows, so that a model whose
        # similarities all lie in, say, [0.95, 1] still gets a readable histogram; the table also
        # gives pos_neg_js (the metric's fixed bins over [-1, 1]) of every row of the split, the
        # value metrics.json and `dmlkit evaluate` give for these embeddings (not the sample's)
        drawn = pos_neg_histograms(split.embeddings[rows], split.labels[rows], bins=60, range="observed")
        with PROCESS_STATE_LOCK, warnings.catch_warnings(record=True) as caught:  # one filter swap at a time
            warnings.simplefilter("always")
            metric = pos_neg_histograms(split.embeddings, split.labels).js
        # the metric's resolution warning (every pair in a few of its bins: it reads near 0
        # whatever the ranking) marks its cell: suppressed, 0.0000 read as "no separation"
        said = [str(w.message).removeprefix("pos_neg_js: ") for w in caught
                if str(w.message).startswith("pos_neg_js")]
        return drawn, metric, said

    candidates: list[tuple[str, _Split, np.ndarray]] = []
    if before is not None:
        candidates.append(("test, before training", before, rows))
    candidates.append((f"test, {state}", test, rows))
    for name, split in others.items():
        candidates.append((f"{name}, after training", split,
                           _sample_rows(split.labels, options.max_points, options.seed)))
    failed: list[tuple[str, str]] = []
    for title, split, r in candidates:
        try:
            panels[title] = histogram(split, r)
        except DmlkitError as exc:  # e.g. one class: no negative pair -- say why, draw the rest
            failed.append((title, str(exc)))
    hist_notes: list[str] = []
    for title, (h, metric, said) in panels.items():
        js = f"{metric:.4f}" + (" (unreliable: see the note below)" if said else "")
        hist_notes += [f"pos_neg_js of {title}: {line}" for line in said]
        hist_rows.append([title, f"{h.js:.4f}", js, h.num_positive_pairs, h.num_negative_pairs])
    # a panel that could not be drawn: after the drawn ones, its reason in a note (it stood
    # first, with the reason in the "negative pairs drawn" column)
    for title, why in failed:
        hist_rows.append([title, "not drawn", "n/a", "n/a", "n/a"])
        hist_notes.append(f"{title}: not drawn: {why}")
    hist_figs = []
    if panels:
        png = figures.save_figure(figures.similarity_histograms({k: hist_dict(v) for k, (v, _, _) in panels.items()}),
                                  fig_dir / "histograms")
        hist_figs.append(Figure(png[0], f"Similarity histograms of {what}", png[1]))
    sections.append(Section(
        "Positive and negative pair similarities",
        [*notes, "Histograms of the cosine similarities of all positive (same-class) and all negative pairs, "
         "each normalised to area 1 (Oi et al.), with 60 bins over each panel's observed range. The "
         "Jensen-Shannon divergence (base 2) measures how well they separate: 0 = identical "
         "distributions, 1 = disjoint. It depends on the bins: the table gives it over the drawn "
         "bins and as the metric pos_neg_js (100 bins over [-1, 1], shared by every model), which "
         "reads near 0 when every similarity falls in a few of its bins. The panels draw the pairs "
         f"of at most {options.max_points} samples a split (whole classes; the pair counts are "
         "theirs); pos_neg_js is over every sample of the split (train and val: the sample the "
         "report embeds), the value `dmlkit evaluate` and metrics.json give for the test "
         "embeddings. A split without both kinds of pair has no histogram."],
        [table_html(["split", "JS, drawn bins", "pos_neg_js", "positive pairs drawn",
                     "negative pairs drawn"], hist_rows),
         *(f'<p class="note">{html.escape(n)}</p>' for n in hist_notes)],
        hist_figs,
    ))
    # 2-D maps
    sel, classes = _map_rows(test.labels, options.map_classes, options.max_points)
    all_classes = len(np.unique(test.labels))
    shown = (f"{len(classes)} of the {all_classes} test classes" if len(classes) < all_classes
             else f"{all_classes} test classes") + f", {len(sel)} samples"
    map_figs = []
    map_notes = []
    for method in options.maps:
        options.progress(f"{method} map")
        name = figures.projection_name(method)
        if len(sel) < 4:
            map_notes.append(f"No {name} map: {len(sel)} test samples are too few to project.")
            continue
        try:
            pts = figures.project_2d(test.embeddings[sel], method, seed=options.seed)
        except (DmlkitError, ValueError) as exc:  # e.g. t-SNE's perplexity above the sample count
            map_notes.append(f"No {name} map: {exc}")
            continue
        thumbs = None
        if test.image_of is not None:
            rng = np.random.default_rng(options.seed)
            picks = rng.choice(len(sel), size=min(12, len(sel)), replace=False)
            thumbs = {int(p): test.image_of(int(sel[p])) for p in picks}
        drawn = figures.projection_title(method, len(sel), test.embeddings.shape[1])  # PCA may stand in
        fig = figures.embedding_map(pts, test.labels[sel], f"{drawn} of test embeddings", thumbs,
                                    class_names=test.class_names)
        png = figures.save_figure(fig, fig_dir / f"map_{method}")
        map_figs.append(Figure(png[0], f"{drawn} map of {what} ({shown})", png[1]))
    sections.append(Section("Maps of the test embeddings", [
        "Each point is a test sample, coloured and shaped by class (the legend beside the map names "
        "the classes, up to 40); thumbnails show a sample of the images where the data are images, each beside "
        "its point with a line to it. UMAP and t-SNE preserve neighbourhoods, not distances; "
        "PCA is linear and fast.", *test.notes, *map_notes], [], map_figs))
    # gallery and per-class
    scores, r_q = per_query(test.embeddings, test.labels, metrics=["map_at_r"])
    ap = scores["map_at_r"]
    rng = np.random.default_rng(options.seed)
    valid = np.flatnonzero(r_q > 0)
    if len(valid):
        random_q = rng.choice(valid, size=min(options.gallery_queries, len(valid)), replace=False)
        worst_q = valid[np.argsort(ap[valid], kind="stable")[: options.gallery_queries]]
        chosen = [(int(q), "random") for q in random_q] + [(int(q), "worst") for q in worst_q]
        nn = knn(test.embeddings[[q for q, _ in chosen]], test.embeddings, k=options.gallery_k + 1)
        rows_g = []
        for (q, kind), neigh in zip(chosen, nn.indices.numpy()):
            neigh = [int(n) for n in neigh if n != q][: options.gallery_k]
            rows_g.append({"query": q, "query_label": int(test.labels[q]), "neighbors": neigh,
                           "neighbor_labels": [int(test.labels[n]) for n in neigh],
                           "caption": f"{kind}\nAP@R={100 * ap[q]:.0f}%"})
        png = figures.save_figure(figures.retrieval_gallery(rows_g, test.image_of, "Test retrieval",
                                                            class_names=test.class_names),
                                  fig_dir / "gallery")
        sections.append(Section("Retrieval gallery", [
            f"{options.gallery_queries} random and the {options.gallery_queries} worst-scoring test queries "
            "(by average precision at R) with their nearest neighbours; green solid frames are correct "
            "(same class), red dashed frames are wrong.", *test.notes], [],
            [Figure(png[0], "Retrieval gallery", png[1])]))
    pc = per_class(test.embeddings, test.labels, metrics=["map_at_r"])
    values = {c: row["map_at_r"] for c, row in pc.items() if np.isfinite(row["map_at_r"])}
    if len(values) >= 2:
        png = figures.save_figure(figures.per_class_bars(values, "map_at_r", class_names=test.class_names),
                                  fig_dir / "per_class")
        sections.append(Section("Per-class MAP@R", [
            f"MAP@R of each test class (mean over its queries); {len(values)} classes. The dotted line "
            "is the mean over classes (each class counts once): with classes of unequal size it is not "
            "the MAP@R over all queries of the Results table.",
            *[n for n in test.notes if n.startswith("Classes")]], [],
            [Figure(png[0], "Best and worst test classes by MAP@R", png[1])]))
    return sections


def hist_dict(h) -> dict[str, Any]:
    """A :func:`dmlkit.metrics.pos_neg_histograms` result as the mapping the figures take."""
    return {"bin_edges": h.edges, "positive_density": h.pos_density,
            "negative_density": h.neg_density, "js_divergence": h.js}
