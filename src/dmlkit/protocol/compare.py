"""Honest comparisons between benchmarked methods (``dmlkit compare``).

* Hierarchical bootstrap of metric differences over training seeds and test queries: every
  method's per-query P@1 / R-Precision / MAP@R are recomputed from its saved test embeddings
  per seed (concatenated: the seed's fold models' embeddings concatenated and L2-normalised;
  separated: each fold model's own embeddings, averaged over the folds), and the mean
  difference between two methods gets a percentile bootstrap CI that resamples each method's
  seeds and, inside, the same test queries for both (seeded; see
  :func:`dmlkit.protocol.stats.hierarchical_bootstrap`). A difference is called significant
  only when that CI excludes zero *and* each method has at least
  :data:`~dmlkit.protocol.stats.MIN_SEEDS_FOR_SIGNIFICANCE` seeds; with fewer the report says
  "too few seeds to tell" and warns: a bootstrap over queries alone ignores how much a method
  moves between training runs, which is usually the larger part.
* "Papers versus reality" (Musgrave et al. 2020, figure 4): each method's relative improvement
  over the contrastive and the triplet loss, ``100 * (m - base) / base``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dmlkit.embeddings import load_embeddings
from dmlkit.exceptions import ConfigError, DataError
from dmlkit.protocol.results import MODES, load_results, metric_label, resolved_runs
from dmlkit.protocol.stats import (
    MIN_SEEDS_FOR_SIGNIFICANCE,
    PER_QUERY_METRICS,
    hierarchical_bootstrap,
    per_query_scores,
)
from dmlkit.validation import check_embeddings, normalize_rows

__all__ = [
    "BASELINES",
    "compare_results",
    "method_per_query",
    "method_per_seed_query",
    "relative_improvements",
    "render_compare_markdown",
    "significance_label",
]

BASELINES: tuple[str, ...] = ("contrastive", "triplet")


def _merge(results_list: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """``{method name: entry}`` over every results file (names made unique with the bench name)."""
    merged: dict[str, dict[str, Any]] = {}
    for res in results_list:
        for name, entry in res["methods"].items():
            key = name if name not in merged else f"{name}@{res.get('name', 'bench')}"
            if key in merged:
                key = f"{name}@{res.get('_path', len(merged))}"
            merged[key] = entry
    return merged


def method_per_seed_query(entry: Mapping[str, Any], mode: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Per-query scores of one method, one row per training seed: ``{metric: (seeds, queries)}``
    (separated: each seed's row is the mean over its fold models), and the query labels."""
    runs = entry.get("runs") or []
    if not runs:
        raise DataError("a method in the results has no runs (embedding files) to compare")
    by_seed: dict[int, list[Mapping[str, Any]]] = {}
    for r in runs:
        by_seed.setdefault(int(r["seed"]), []).append(r)
    rows: dict[str, list[np.ndarray]] = {m: [] for m in PER_QUERY_METRICS}
    labels_ref: np.ndarray | None = None
    for seed in sorted(by_seed):
        fold_runs = sorted(by_seed[seed], key=lambda r: int(r["fold"]))
        embs = []
        for r in fold_runs:
            path = Path(r["embeddings"])
            emb, lab, _ = load_embeddings(path)
            check_embeddings(emb, f"embeddings in {path}")  # which of the runs' files, not "query embeddings"
            if labels_ref is None:
                labels_ref = lab
            elif not np.array_equal(labels_ref, lab):
                raise DataError(f"{path}: the test queries differ from the method's other runs")
            embs.append(emb)
        sets = [normalize_rows(np.concatenate(embs, axis=1))] if mode == "concatenated" else embs
        per_set = [per_query_scores(emb, labels_ref)[0] for emb in sets]
        for m in PER_QUERY_METRICS:
            rows[m].append(np.mean(np.stack([scores[m] for scores in per_set]), axis=0))
    assert labels_ref is not None
    return {m: np.stack(v) for m, v in rows.items()}, labels_ref


def method_per_query(entry: Mapping[str, Any], mode: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Per-query scores of one method averaged over seeds (and over folds when separated)."""
    per_seed, labels = method_per_seed_query(entry, mode)
    return {m: v.mean(axis=0) for m, v in per_seed.items()}, labels


def _baseline_of(name: str, entry: Mapping[str, Any], base: str) -> bool:
    loss = (entry.get("loss") or {}).get("name")
    return name == base or (loss == base and name.split("@")[0].startswith(base))


def _relative_percent(value: Any, base: Any) -> float | None:
    """``100 * (value - base) / base``; ``None`` (n/a) when either is missing (a results file
    holds ``null`` for a NaN mean) or the baseline is 0."""
    if value is None or base is None or not base or not np.isfinite([value, base]).all():
        return None
    return 100.0 * (value - base) / base


def relative_improvements(methods: Mapping[str, Mapping[str, Any]], metrics: Sequence[str]) -> dict[str, Any]:
    """``{baseline: {method: {mode: {metric: percent}}}}`` for the baselines present."""
    out: dict[str, Any] = {}
    for base in BASELINES:
        # the method named exactly as the baseline wins over a variant of it (contrastive_xbm)
        base_name = base if base in methods else next(
            (n for n, e in methods.items() if _baseline_of(n, e, base)), None)
        if base_name is None:
            continue
        b = methods[base_name]
        table: dict[str, Any] = {}
        for name, entry in methods.items():
            if name == base_name:
                continue
            table[name] = {
                mode: {m: _relative_percent(entry[mode][m].get("mean"), b[mode][m].get("mean"))
                       for m in metrics if m in entry[mode] and m in b[mode]}
                for mode in MODES
            }
        out[base] = {"method": base_name, "relative_percent": table}
    return out


def compare_results(
    paths_or_results: Sequence[str | Path | Mapping[str, Any]],
    *,
    methods: Sequence[str] | None = None,
    baseline: str | None = None,
    metrics: Sequence[str] = PER_QUERY_METRICS,
    modes: Sequence[str] = MODES,
    resamples: int = 1000,
    seed: int = 0,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """Compare two or more methods from one or more ``results.json`` files.

    Pairs are every pair of the selected methods, or each method against ``baseline``.
    """
    results_list = [resolved_runs(r) if isinstance(r, Mapping) else load_results(r) for r in paths_or_results]
    merged = _merge(results_list)
    # a method, metric or mode given twice is compared once (in the order first given)
    names = list(dict.fromkeys(methods)) if methods else list(merged)
    metrics, modes = list(dict.fromkeys(metrics)), list(dict.fromkeys(modes))
    unknown = [n for n in names if n not in merged]
    if unknown:
        raise ConfigError(f"unknown method(s) {unknown}; the results hold {list(merged)}")
    if len(names) < 2:
        raise ConfigError(f"compare needs at least two methods, got {names}")
    bad = [m for m in metrics if m not in PER_QUERY_METRICS]
    if bad:
        raise ConfigError(f"per-query comparison supports {list(PER_QUERY_METRICS)}, not {bad}")
    for mode in modes:
        if mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {mode!r}")
    if baseline is not None and baseline not in names:
        raise ConfigError(f"baseline {baseline!r} is not among the compared methods {names}")
    pairs = ([(n, baseline) for n in names if n != baseline] if baseline
             else list(itertools.combinations(names, 2)))
    per_query: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    labels_seen: np.ndarray | None = None
    for name in names:
        for mode in modes:
            scores, labels = method_per_seed_query(merged[name], mode)
            if labels_seen is None:
                labels_seen = labels
            elif not np.array_equal(labels_seen, labels):
                raise DataError(
                    f"method {name!r} was tested on other queries than {names[0]!r}: a paired "
                    "comparison needs the same test set (same dataset, split and order)"
                )
            per_query[(name, mode)] = scores
    seeds = {name: int(per_query[(name, modes[0])][metrics[0]].shape[0]) for name in names}
    warnings = [
        f"{name} has {n} seed{'s' if n != 1 else ''}: too few to tell a real difference from "
        f"seed noise (need {MIN_SEEDS_FOR_SIGNIFICANCE}; the Reality Check ran 5: protocol.seeds); its "
        "differences are reported but never called significant"
        for name, n in seeds.items() if n < MIN_SEEDS_FOR_SIGNIFICANCE
    ]
    comparisons = []
    for a, b in pairs:
        for mode in modes:
            for m in metrics:
                res = hierarchical_bootstrap(per_query[(a, mode)][m], per_query[(b, mode)][m],
                                             resamples=resamples, confidence=confidence, seed=seed)
                comparisons.append({"a": a, "b": b, "mode": mode, "metric": m, **res.to_dict()})
    table_metrics = [m for m in metrics if all(m in merged[n]["separated"] for n in names)]
    return {
        "methods": names,
        "test": "hierarchical percentile bootstrap over training seeds and test queries (the CI); "
                "significant when it excludes 0 and Welch's t-test over the seeds' means rejects equal means",
        "queries": int(next(iter(per_query.values()))[metrics[0]].shape[1]),
        "seeds": seeds,
        "min_seeds_for_significance": MIN_SEEDS_FOR_SIGNIFICANCE,
        "warnings": warnings,
        "resamples": resamples,
        "seed": seed,
        "confidence": confidence,
        "comparisons": comparisons,
        "relative_improvement": relative_improvements({n: merged[n] for n in names}, table_metrics),
    }


def significance_label(comparison: Mapping[str, Any]) -> str:
    """``yes`` / ``no`` / ``too few seeds`` for one comparison of :func:`compare_results`."""
    value = comparison.get("significant")
    return "too few seeds" if value is None else ("yes" if value else "no")


def render_compare_markdown(report: Mapping[str, Any]) -> str:
    """Two Markdown tables: paired differences, and relative improvements over the baselines."""
    conf = int(round(100 * report["confidence"]))
    seeds = ", ".join(f"{n}: {k}" for n, k in report["seeds"].items())
    lines = [
        f"Hierarchical bootstrap over training seeds ({seeds}) and {report['queries']} test "
        f"queries ({report['resamples']} resamples, seed {report['seed']}); differences in "
        f"percentage points, {conf} % CI; significant = the CI excludes 0 and Welch's t-test over "
        f"the seeds' means gives p < {1 - report['confidence']:.2g}, with at least "
        f"{report['min_seeds_for_significance']} seeds per method.",
        *[f"\nWarning: {w}." for w in report["warnings"]],
        "",
        "| A | B | mode | metric | A − B | CI | significant |",
        "|---|---|---|---|---:|---|:---:|",
    ]
    for c in report["comparisons"]:
        lines.append(
            f"| {c['a']} | {c['b']} | {c['mode']} | {metric_label(c['metric'])} | "
            f"{100 * c['diff']:+.2f} | [{100 * c['ci_low']:+.2f}, {100 * c['ci_high']:+.2f}] | "
            f"{significance_label(c)} |"
        )
    for base, info in report["relative_improvement"].items():
        rows = info["relative_percent"]
        if not rows:
            continue
        metrics = list(next(iter(rows.values()))["concatenated"])
        lines += ["", f"Relative improvement over {base} ({info['method']}), %:", "",
                  "| method | " + " | ".join(f"{mode[:6]}. {metric_label(m)}" for mode in MODES for m in metrics) + " |",
                  "|---|" + "|".join(["---:"] * (len(metrics) * len(MODES))) + "|"]
        for name, modes in rows.items():
            cells = []
            for mode in MODES:
                for m in metrics:
                    v = modes[mode].get(m)
                    cells.append("n/a" if v is None else f"{v:+.1f}")
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
