"""Figures of the reproduction (docs/reproduction.md), drawn from the committed result JSONs.

* :func:`relative_improvement_figure`: the seed's "papers versus reality" panels (Musgrave et
  al. 2020, Fig. 4: relative improvement over the contrastive and over the triplet loss), with
  what dmlkit's library figure (:func:`dmlkit.report.figures.relative_improvement`) leaves out:
  the 95 % CI of each difference (``dmlkit compare``'s: a t interval over seeds and queries,
  or the hierarchical bootstrap of the comparisons run before it, as the JSON's ``test`` says;
  divided by the baseline's mean) and both evaluation modes.
* :func:`jsd_figures`: seed 004's figures (Oi et al.): per-epoch JSD / P@1 / MAP@R of the train,
  validation and test splits (their Fig. 4), mean positive and negative cosine (Fig. 2), test
  histograms before and after training (Fig. 3), and JSD against MAP@R over all epochs and
  methods.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

DPI = 80
#: Methods in order of publication (the x axis of the seed's figure).
YEAR_ORDER = ("contrastive", "triplet", "proxy_nca", "margin", "normalized_softmax", "cosface", "arcface",
              "fastap", "ms+miner", "soft_triple", "proxy_anchor")
SPLIT_STYLE = {"train": "-", "val": "--", "test": ":"}


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def relative_improvement_figure(results_json: Path, out: Path, *, title: str = "",
                                metric: str = "map_at_r") -> Path:
    """Two panels, vs contrastive and vs triplet: relative ``metric`` improvement (%) per method.

    Bars: ``100 * (m - base) / base`` from the results' means, concatenated and separated; whiskers:
    the CI of ``m - base`` from ``<name>_vs_<base>.json`` (``dmlkit compare``) / base, named in
    the title by the JSON's ``test``.
    """
    results = json.loads(Path(results_json).read_text())["methods"]
    stem = Path(results_json).stem
    bases = [b for b in ("contrastive", "triplet") if b in results]
    methods = [m for m in YEAR_ORDER if m in results] + \
        [m for m in results if m not in YEAR_ORDER and m != "pretrained"]
    fig, axes = plt.subplots(1, len(bases), figsize=(6.0 * len(bases), 3.6), squeeze=False)
    for ax, base in zip(axes[0], bases):
        shown = [m for m in methods if m != base]
        cmp_path = Path(results_json).with_name(f"{stem}_vs_{base}.json")
        cis: dict[tuple[str, str], tuple[float, float]] = {}
        ci_name = "CI"
        if cmp_path.exists():
            report = json.loads(cmp_path.read_text())
            ci_name = "bootstrap CI" if "bootstrap" in report.get("test", "") else "CI, t over seeds and queries"
            for c in report["comparisons"]:
                if c["b"] == base and c["metric"] == metric:
                    cis[(c["a"], c["mode"])] = (c["ci_low"], c["ci_high"])
        x = np.arange(len(shown))
        for i, (mode, color) in enumerate((("concatenated", "0.3"), ("separated", "0.75"))):
            ref = results[base][mode][metric]["mean"]
            rel = np.array([100 * (results[m][mode][metric]["mean"] - ref) / ref for m in shown])
            lo = np.array([100 * cis[(m, mode)][0] / ref if (m, mode) in cis else np.nan for m in shown])
            hi = np.array([100 * cis[(m, mode)][1] / ref if (m, mode) in cis else np.nan for m in shown])
            # whiskers: the CI of the difference, scaled like the bar (not centred on the bar)
            yerr = np.vstack([np.where(np.isnan(lo), 0, rel - lo), np.where(np.isnan(hi), 0, hi - rel)])
            ax.bar(x + (i - 0.5) * 0.4, rel, 0.4, yerr=np.abs(yerr), capsize=2, color=color,
                   edgecolor="black", label=f"{mode}")
        ax.axhline(0, color="black", linewidth=1, linestyle="--")
        ax.set_xticks(x, shown, rotation=30, ha="right")
        ax.set(ylabel=f"relative {'MAP@R' if metric == 'map_at_r' else metric} improvement (%)",
               title=f"{title}: vs {base} (95 % {ci_name})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, out)


def _series(run: Mapping[str, Any], split: str, key: str) -> np.ndarray:
    return np.array([e[split][key] for e in run["epochs"]], dtype=float)


def _runs_of(runs: Sequence[Mapping[str, Any]], dataset: str, order: str) -> list[Mapping[str, Any]]:
    return [r for r in runs if r["dataset"] == dataset and r["order"] == order and r["seed"] == 0]


def jsd_curves(runs: Sequence[Mapping[str, Any]], dataset: str, out: Path) -> Path:
    """Rows JSD / P@1 / MAP@R, columns method x order; lines train, validation, test."""
    cols = [(r["method"], o) for o in ("default", "random") for r in _runs_of(runs, dataset, o)]
    fig, axes = plt.subplots(3, len(cols), figsize=(2.6 * len(cols), 6.4), squeeze=False, sharex=True)
    by_key = {(r["method"], r["order"]): r for r in runs if r["dataset"] == dataset and r["seed"] == 0}
    for j, key in enumerate(cols):
        run = by_key[key]
        epochs = [e["epoch"] for e in run["epochs"]]
        for i, (metric, label) in enumerate((("jsd", "JSD"), ("precision_at_1", "P@1"), ("map_at_r", "MAP@R"))):
            ax = axes[i, j]
            for split, style in SPLIT_STYLE.items():
                ax.plot(epochs, _series(run, split, metric), style, color="black", linewidth=1.2, label=split)
            if i == 0:
                ax.set_title(f"{key[0]}\n{key[1]} order", fontsize=9)
            if j == 0:
                ax.set_ylabel(label)
            if i == 2:
                ax.set_xlabel("epoch")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"{dataset}: per-epoch JSD, P@1 and MAP@R (seed 004, Fig. 4 style)", fontsize=10)
    fig.tight_layout()
    return _save(fig, out)


def mean_similarities(runs: Sequence[Mapping[str, Any]], dataset: str, out: Path) -> Path:
    """Mean cosine of positive and negative pairs, train vs validation, per epoch (Fig. 2 style)."""
    cols = [(r["method"], o) for o in ("default", "random") for r in _runs_of(runs, dataset, o)]
    by_key = {(r["method"], r["order"]): r for r in runs if r["dataset"] == dataset and r["seed"] == 0}
    fig, axes = plt.subplots(1, len(cols), figsize=(2.6 * len(cols), 2.8), squeeze=False, sharey=True)
    for j, key in enumerate(cols):
        run, ax = by_key[key], axes[0, j]
        epochs = [e["epoch"] for e in run["epochs"]]
        for split in ("train", "val"):
            ax.plot(epochs, _series(run, split, "pos_mean"), SPLIT_STYLE[split], color="black", label=f"{split} positive")
            ax.plot(epochs, _series(run, split, "neg_mean"), SPLIT_STYLE[split], color="0.6", label=f"{split} negative")
        ax.set_title(f"{key[0]}\n{key[1]} order", fontsize=9)
        ax.set_xlabel("epoch")
    axes[0, 0].set_ylabel("mean cosine")
    axes[0, 0].legend(fontsize=6)
    fig.suptitle(f"{dataset}: mean similarity of positive / negative pairs (Fig. 2 style)", fontsize=10)
    fig.tight_layout()
    return _save(fig, out)


def test_histograms(runs: Sequence[Mapping[str, Any]], dataset: str, out: Path,
                    method: str = "normalized_softmax") -> Path | None:
    """Test-split histograms before and after training, default and random order (Fig. 3 style)."""
    chosen = [r for r in runs if r["dataset"] == dataset and r["method"] == method and r["seed"] == 0]
    if not chosen:
        return None
    fig, axes = plt.subplots(1, 2 * len(chosen), figsize=(3.0 * 2 * len(chosen), 2.6), squeeze=False)
    k = 0
    for run in sorted(chosen, key=lambda r: r["order"]):
        edges = np.asarray(run["edges"])
        for when, epoch in (("before", run["epochs"][0]), ("after", run["epochs"][-1])):
            ax, t = axes[0, k], epoch["test"]
            ax.stairs(t["neg_density"], edges, fill=True, alpha=0.35, color="0.45", label="negative")
            ax.stairs(t["pos_density"], edges, color="black", linewidth=1.5, label="positive")
            ax.set_title(f"{run['order']} order, {when} (epoch {epoch['epoch']})\nJSD {t['jsd']:.3f}", fontsize=8)
            ax.set_xlabel("cosine similarity")
            k += 1
    axes[0, 0].set_ylabel("density (area 1)")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"{dataset}, {method}: test histograms before / after training (Fig. 3 style)", fontsize=10)
    fig.tight_layout()
    return _save(fig, out)


def jsd_scatter(runs: Sequence[Mapping[str, Any]], out: Path) -> Path:
    """JSD against MAP@R, every epoch of every run (validation and test splits)."""
    datasets = sorted({r["dataset"] for r in runs})
    fig, axes = plt.subplots(1, len(datasets), figsize=(4.2 * len(datasets), 3.4), squeeze=False)
    markers = dict(zip(sorted({r["method"] for r in runs}), "osD^vP"))
    for ax, dataset in zip(axes[0], datasets):
        for r in runs:
            if r["dataset"] != dataset:
                continue
            for split, color in (("val", "0.65"), ("test", "black")):
                ax.scatter(_series(r, split, "jsd"), _series(r, split, "map_at_r"), s=9, marker=markers[r["method"]],
                           facecolors="none", edgecolors=color, linewidths=0.7)
        for m, mk in markers.items():
            ax.scatter([], [], marker=mk, facecolors="none", edgecolors="black", label=m)
        ax.set(title=f"{dataset} (black: test, grey: validation)", xlabel="JSD", ylabel="MAP@R")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _save(fig, out)


def jsd_figures(runs: Sequence[Mapping[str, Any]], out_dir: Path) -> list[Path]:
    """Every seed-004 figure into ``out_dir`` (``jsd_*.png``)."""
    out_dir = Path(out_dir)
    paths = []
    for dataset in sorted({r["dataset"] for r in runs}):
        paths.append(jsd_curves(runs, dataset, out_dir / f"jsd_curves_{dataset}.png"))
        paths.append(mean_similarities(runs, dataset, out_dir / f"jsd_means_{dataset}.png"))
        hist = test_histograms(runs, dataset, out_dir / f"jsd_hist_{dataset}.png")
        if hist is not None:
            paths.append(hist)
    paths.append(jsd_scatter(runs, out_dir / "jsd_scatter.png"))
    return paths
