"""Honest comparisons between benchmarked methods (``dmlkit compare``).

* A t-test of metric differences over training seeds and test queries: every method's
  per-query P@1 / R-Precision / MAP@R are recomputed from its saved test embeddings per seed
  (concatenated: the seed's fold models' embeddings, each L2-normalised, concatenated and
  L2-normalised, :func:`dmlkit.validation.concatenate_normalized`; separated: each fold
  model's own embeddings, averaged over the folds), and the mean difference between two
  methods gets the t interval and p-value of
  :func:`dmlkit.protocol.stats.seed_query_t_test` (standard error from both methods'
  seed-to-seed variance and the variance of their per-query difference, Welch-Satterthwaite
  degrees of freedom). A difference is called significant only when that p-value, after
  Holm's correction over the method pairs compared on each metric and mode, is below
  ``1 - confidence``, *and* each method has at least
  :data:`~dmlkit.protocol.stats.MIN_SEEDS_FOR_SIGNIFICANCE` seeds; with fewer the report says
  "too few seeds to tell" and warns: a test over queries alone ignores how much a method
  moves between training runs, which is usually the larger part. The interval is each pair's
  own (not adjusted for the other pairs): one that excludes 0 may still not be significant.
* "Papers versus reality" (Musgrave et al. 2020, figure 4): each method's relative improvement
  over the contrastive and the triplet loss, ``100 * (m - base) / base``
  (:func:`relative_percent`, which the report's figure uses too).
* Pairing checks: every embedding file paired must hold the same test items: the same
  ``indices`` (dataset rows) where both files have them, else the same labels (with a
  warning); results files whose configs select other test items (dataset, its options, the
  class split) are refused.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dmlkit.data import canonical_dataset_name
from dmlkit.exceptions import ConfigError, DataError
from dmlkit.protocol.results import (
    MODES,
    load_listed_embeddings,
    load_results,
    markdown_text,
    metric_label,
    resolved_runs,
)
from dmlkit.protocol.stats import (
    MIN_SEEDS_FOR_SIGNIFICANCE,
    PER_QUERY_METRICS,
    check_confidence,
    holm_adjusted,
    per_query_scores,
    seed_query_t_test,
)
from dmlkit.validation import concatenate_normalized

__all__ = [
    "BASELINES",
    "baseline_methods",
    "compare_results",
    "format_p",
    "method_per_query",
    "method_per_seed_query",
    "relative_improvements",
    "relative_percent",
    "render_compare_markdown",
    "significance_label",
    "variance_marks",
]

BASELINES: tuple[str, ...] = ("contrastive", "triplet")

#: What ``compare`` tests, as its JSON report's ``test`` says it.
TEST_DESCRIPTION = (
    "t-test over training seeds and test queries: se^2 = var(seed means of A)/S_A + var(seed means "
    "of B)/S_B + var(per-query difference of the seed-mean scores)/Q, Welch-Satterthwaite df; the CI "
    "is each pair's own, significant = p < 1 - confidence after Holm's correction over the method "
    "pairs of each metric and mode"
)


def _merge(results_list: Sequence[Mapping[str, Any]]) -> tuple[dict[str, dict[str, Any]], dict[str, int]]:
    """``{method name: entry}`` over every results file, and ``{method name: index of its results
    file}``. A name an earlier file already gave is made unique with its source
    (:func:`_source_labels`): ``ms@<bench name>``, or ``ms@<bench folder>`` where two of the files
    share the bench name (``ms`` and ``ms@b`` did not say which file each came from)."""
    sources = _source_labels(results_list)
    merged: dict[str, dict[str, Any]] = {}
    origin: dict[str, int] = {}
    for i, res in enumerate(results_list):
        for name, entry in res["methods"].items():
            key = name if name not in merged else f"{name}@{sources[i]}"
            if key in merged:  # a method named "ms@b" in the first file
                key = f"{name}@{sources[i]}#{i + 1}"
            merged[key] = entry
            origin[key] = i
    return merged, origin


def _source_labels(results_list: Sequence[Mapping[str, Any]]) -> list[str]:
    """What tells each results file apart: its bench ``name`` when no other file has that name,
    else its folder (a ``results.json``'s bench directory, any other file's own name) with as
    many parent folders as tell the files of that name apart (``second``, ``runB/b``); the
    position among the files (``b#2``) where nothing else does (one file given twice)."""
    names = [str(res.get("name") or "bench") for res in results_list]
    labels = list(names)
    for bench in set(names):
        same = [i for i, n in enumerate(names) if n == bench]
        if len(same) < 2:
            continue
        parts = [_source_path(results_list[i]).parts for i in same]
        longest = max((len(p) for p in parts), default=0)
        tails = next((tails for k in range(1, longest + 1)
                      if len(set(tails := ["/".join(p[-k:]) for p in parts])) == len(same)), None)
        for j, i in enumerate(same):
            labels[i] = tails[j] if tails else f"{bench}#{i + 1}"
    return labels


def _source_path(results: Mapping[str, Any]) -> Path:
    """The bench directory of a ``results.json`` (``load_results`` records its ``_path``; a
    mapping its ``bench_dir``), or the path of a results file of another name."""
    path = results.get("_path")
    if path:
        path = Path(str(path))
        return path.parent if path.name == "results.json" else path
    return Path(str(results.get("bench_dir") or ""))


#: Dataset options that say where or how the data is read, not which items it holds (like
#: ``data.root``, they may differ between two machines running one bench).
_LOCATION_OPTIONS = frozenset({"download", "verify", "strict", "path", "source", "transform", "mode"})


def _test_set_settings(results: Mapping[str, Any]) -> dict[str, Any] | None:
    """What selects a bench's test items, from its ``results.json`` ``config``: the dataset,
    its options (less :data:`_LOCATION_OPTIONS`) and the protocol's class split; ``None``
    when the results hold no config."""
    config = results.get("config")
    if not isinstance(config, Mapping):
        return None
    data = (config.get("fixed") or {}).get("data") or {}
    protocol = config.get("protocol") or {}
    dataset = data.get("dataset")
    settings: dict[str, Any] = {
        "dataset": canonical_dataset_name(str(dataset)) if dataset is not None else None,
        "data options": {k: v for k, v in sorted((data.get("options") or {}).items())
                         if k not in _LOCATION_OPTIONS},
        "protocol.split": protocol.get("split"),
        "protocol.order": protocol.get("order"),
        "protocol.num_classes": _classes_used(results, protocol.get("num_classes")),
    }
    if protocol.get("order") == "random":  # the seed only orders the classes when shuffled
        settings["protocol.order_seed"] = protocol.get("order_seed")
    return settings


def _classes_used(results: Mapping[str, Any], num_classes: Any) -> Any:
    """How many classes the split used: the results' development + test classes (``null``
    protocol.num_classes, all the dataset's, and the same number written out select the same
    classes), else ``protocol.num_classes`` as configured."""
    split = results.get("split")
    if isinstance(split, Mapping):
        dev, test = split.get("dev_classes"), split.get("test_classes")
        if isinstance(dev, int) and isinstance(test, int):
            return dev + test
    return num_classes


def _check_same_test_set(results_list: Sequence[Mapping[str, Any]], used: Sequence[int]) -> None:
    """Refuse results files (those at ``used``) whose configs select other test items."""
    ref: tuple[int, dict[str, Any]] | None = None
    for i in dict.fromkeys(used):
        settings = _test_set_settings(results_list[i])
        if settings is None:
            continue
        if ref is None:
            ref = (i, settings)
            continue
        diff = [f"{k} {ref[1].get(k)!r} vs {v!r}" for k, v in settings.items() if ref[1].get(k) != v]
        if diff:
            a, b = _bench_label(results_list[ref[0]]), _bench_label(results_list[i])
            raise DataError(f"{a} and {b} were benchmarked on different test sets ({'; '.join(diff)}): "
                            "a paired comparison needs the same test items")


def _bench_label(results: Mapping[str, Any]) -> str:
    return str(results.get("_path") or results.get("name", "bench"))


@dataclass
class _TestItems:
    """The test queries a method's embedding files hold: the first file, its labels, the
    dataset rows (``indices``) and the files they were (``paths``, relative to the data root)
    of the first file that has them; ``labels_only``: some file holds no ``indices`` (written
    before they were saved), so it was matched by labels only."""

    path: Path
    labels: np.ndarray
    indices: np.ndarray | None
    labels_only: bool
    paths: np.ndarray | None = None


def _same_items(ref: _TestItems, path: Path, labels: np.ndarray, indices: np.ndarray | None,
                paths: np.ndarray | None = None) -> str | None:
    """Why the queries of ``path`` are not those of ``ref`` (``None`` when they are): other
    dataset rows, other files at the same rows (the data changed between the two runs), or
    other labels."""
    if indices is not None and ref.indices is not None and not np.array_equal(ref.indices, indices):
        same = ", same labels" if np.array_equal(ref.labels, labels) else ""
        return f"different test items (other dataset rows{same})"
    if paths is not None and ref.paths is not None and not np.array_equal(ref.paths, paths):
        row = int(np.flatnonzero(ref.paths != paths)[0]) if ref.paths.shape == paths.shape else 0
        return (f"different test items (the same rows, other files: row {row} is "
                f"{ref.paths[row]} in one and {paths[row]} in the other)")
    if not np.array_equal(ref.labels, labels):
        return "different test queries (other labels)"
    return None


def _method_scores(entry: Mapping[str, Any], mode: str, name: str = "the method"
                   ) -> tuple[dict[str, np.ndarray], _TestItems]:
    """:func:`method_per_seed_query` and the test items its files hold (all checked equal)."""
    runs = entry.get("runs") or []
    if not runs and entry.get("failed_runs"):
        raise DataError(f"every final run of {name} diverged (results.json lists its failed_runs): "
                        "it has no embeddings to compare")
    if not runs:
        raise DataError(f"{name} has no runs (embedding files) to compare")
    by_seed: dict[int, list[Mapping[str, Any]]] = {}
    for r in runs:
        by_seed.setdefault(int(r["seed"]), []).append(r)
    rows: dict[str, list[np.ndarray]] = {m: [] for m in PER_QUERY_METRICS}
    items: _TestItems | None = None
    for seed in sorted(by_seed):
        fold_runs = sorted(by_seed[seed], key=lambda r: int(r["fold"]))
        embs = []
        for r in fold_runs:
            path = Path(r["embeddings"])
            emb, lab, extra = load_listed_embeddings(r, name)
            rows_of, paths_of = extra.get("indices"), extra.get("paths")
            indices = None if rows_of is None else np.asarray(rows_of).reshape(-1)
            paths = None if paths_of is None else np.asarray(paths_of).astype(str).reshape(-1)
            if items is None:
                items = _TestItems(path, lab, indices, indices is None, paths)
            else:
                why = _same_items(items, path, lab, indices, paths)
                if why:
                    raise DataError(f"{path} and {items.path} ({name}) hold {why}: a paired comparison "
                                    "needs the same test set")
                items.labels_only |= indices is None
                if items.indices is None and indices is not None:
                    items.indices = indices
                if items.paths is None and paths is not None:
                    items.paths = paths
            embs.append(emb)
        sets = [concatenate_normalized(embs)] if mode == "concatenated" else embs
        per_set = [per_query_scores(emb, items.labels)[0] for emb in sets]
        for m in PER_QUERY_METRICS:
            rows[m].append(np.mean(np.stack([scores[m] for scores in per_set]), axis=0))
    assert items is not None
    return {m: np.stack(v) for m, v in rows.items()}, items


def method_per_seed_query(entry: Mapping[str, Any], mode: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Per-query scores of one method, one row per training seed: ``{metric: (seeds, queries)}``
    (separated: each seed's row is the mean over its fold models), and the query labels.

    Every embedding file of the method must hold the same test queries: the same ``indices``
    (dataset rows) where both files have them, else the same labels."""
    scores, items = _method_scores(entry, mode)
    return scores, items.labels


def method_per_query(entry: Mapping[str, Any], mode: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Per-query scores of one method averaged over seeds (and over folds when separated)."""
    per_seed, labels = method_per_seed_query(entry, mode)
    return {m: v.mean(axis=0) for m, v in per_seed.items()}, labels


def baseline_methods(methods: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """``{baseline: method}`` for each of :data:`BASELINES` a benchmark holds: the method named
    exactly as the baseline, else one whose loss is the baseline and whose name starts with it
    (``contrastive_xbm``, ``triplet@64``). The one rule behind ``compare``'s relative
    improvements, ``dmlkit plot improvement`` and the report's "Papers versus reality"."""
    found = {}
    for base in BASELINES:
        name = base if base in methods else next(
            (n for n, e in methods.items()
             if ((e.get("loss") or {}).get("name") if isinstance(e, Mapping) else None) == base
             and n.split("@")[0].startswith(base)), None)
        if name is not None:
            found[base] = name
    return found


def relative_percent(value: Any, base: Any) -> float | None:
    """``100 * (value - base) / base``, the one home of the relative improvement (the
    ``compare`` tables and :func:`dmlkit.report.figures.relative_improvement`); ``None`` (n/a)
    when either is missing (a results file holds ``null`` for a NaN mean), not finite, or the
    baseline is 0."""
    if value is None or base is None or not base or not np.isfinite([value, base]).all():
        return None
    return 100.0 * (float(value) - float(base)) / float(base)


def relative_improvements(methods: Mapping[str, Mapping[str, Any]], metrics: Sequence[str]) -> dict[str, Any]:
    """``{baseline: {method: {mode: {metric: percent}}}}`` for the baselines present."""
    out: dict[str, Any] = {}
    for base, base_name in baseline_methods(methods).items():
        b = methods[base_name]
        table: dict[str, Any] = {}
        for name, entry in methods.items():
            if name == base_name:
                continue
            table[name] = {
                mode: {m: relative_percent(entry[mode][m].get("mean"), b[mode][m].get("mean"))
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
    confidence: float = 0.95,
) -> dict[str, Any]:
    """Compare two or more methods from one or more ``results.json`` files.

    Pairs are every pair of the selected methods, or each method against ``baseline``; each
    difference gets :func:`dmlkit.protocol.stats.seed_query_t_test`, Holm-corrected over the
    pairs of each metric and mode (:func:`_correct_for_multiple_pairs`).
    """
    _check_options(confidence, metrics, modes)
    if isinstance(methods, str):  # "triplet" was split into the methods 't', 'r', 'i', ...
        raise ConfigError(f"methods must be a list of names ([{methods!r}]), got the string {methods!r}")
    results_list = [resolved_runs(r) if isinstance(r, Mapping) else load_results(r) for r in paths_or_results]
    merged, origin = _merge(results_list)
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
    _check_same_test_set(results_list, [origin[n] for n in names])
    per_query: dict[tuple[str, str], dict[str, np.ndarray]] = {}
    first: tuple[str, _TestItems] | None = None
    labels_only: list[str] = []
    for name in names:
        for mode in modes:
            scores, items = _method_scores(merged[name], mode, f"method {name!r}")
            if first is None:
                first = (name, items)
            elif mode == modes[0]:  # the same files in every mode
                why = _same_items(first[1], items.path, items.labels, items.indices, items.paths)
                if why:
                    raise DataError(f"methods {first[0]!r} ({first[1].path}) and {name!r} ({items.path}) "
                                    f"were tested on {why}: a paired comparison needs the same test set")
            per_query[(name, mode)] = scores
        if items.labels_only or first[1].indices is None:  # some file of it, or of the first, has no rows
            labels_only.append(name)
    seeds = {name: int(per_query[(name, modes[0])][metrics[0]].shape[0]) for name in names}
    warnings = [
        f"{name} has {n} seed{'s' if n != 1 else ''}: too few to tell a real difference from "
        f"seed noise (need {MIN_SEEDS_FOR_SIGNIFICANCE}; the Reality Check ran 5: protocol.seeds); its "
        "differences are reported but never called significant"
        for name, n in seeds.items() if n < MIN_SEEDS_FOR_SIGNIFICANCE
    ]
    warnings += [  # a bench's diverged final runs: the method is compared over fewer seeds
        f"{name}: the final runs of seed(s) {merged[name]['seeds_failed']} diverged; it is compared "
        f"over its {seeds[name]} finished seed(s)" for name in names if merged[name].get("seeds_failed")
    ]
    if labels_only:
        warnings.append(
            f"the test queries of {', '.join(labels_only)} were matched by their labels only (their "
            "embedding files hold no `indices`, the dataset rows older versions did not save): runs "
            "on other test items with the same labels would be paired unnoticed"
        )
    comparisons = []
    for a, b in pairs:
        for mode in modes:
            for m in metrics:
                res = seed_query_t_test(per_query[(a, mode)][m], per_query[(b, mode)][m],
                                        confidence=confidence)
                comparisons.append({"a": a, "b": b, "mode": mode, "metric": m, **res.to_dict()})
    _correct_for_multiple_pairs(comparisons, confidence)
    table_metrics = [m for m in metrics if all(m in merged[n]["separated"] for n in names)]
    return {
        "methods": names,
        "test": TEST_DESCRIPTION,
        "queries": int(next(iter(per_query.values()))[metrics[0]].shape[1]),
        "seeds": seeds,
        "min_seeds_for_significance": MIN_SEEDS_FOR_SIGNIFICANCE,
        "warnings": warnings,
        # how the test queries were matched: by the files' dataset rows, or by labels alone
        "paired_by": "labels" if labels_only else "indices",
        "confidence": confidence,
        "comparisons": comparisons,
        "relative_improvement": relative_improvements({n: merged[n] for n in names}, table_metrics),
    }


def _correct_for_multiple_pairs(comparisons: list[dict[str, Any]], confidence: float) -> None:
    """Holm's correction of the t-tests over the method pairs of each metric and mode
    (:func:`dmlkit.protocol.stats.holm_adjusted`): with four equal methods, six raw tests at 5 %
    call at least one pair "significant" up to ``1 - 0.95^6`` = 26 % of the time. Each
    comparison keeps its raw ``p`` and gets ``p_holm`` (over the pairs that have enough seeds
    to be tested); ``significant`` is then ``p_holm < 1 - confidence``. The interval stays each
    pair's own: ``significant`` implies that it excludes 0, not the reverse."""
    families: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for c in comparisons:
        c["p_holm"] = None
        if c["significant"] is not None:
            families.setdefault((c["mode"], c["metric"]), []).append(c)
    for family in families.values():
        for c, p in zip(family, holm_adjusted([c["p"] for c in family])):
            c["p_holm"] = float(p)
            # p_holm >= p, and p < 1 - confidence is the CI excluding 0 (one t statistic); the
            # check of the CI only keeps a rounding tie from printing "yes" beside a CI over 0
            c["significant"] = bool(p < 1.0 - confidence and c["excludes_zero"])


def _check_options(confidence: Any, metrics: Sequence[str], modes: Sequence[str]) -> None:
    """One :class:`ConfigError` line for options :func:`compare_results` cannot use: a
    percentage as ``confidence`` (95) gave NaN intervals, ``confidence=0`` called every
    difference significant, no metrics or modes failed with an IndexError."""
    check_confidence(confidence)
    for what, given in (("metrics", metrics), ("modes", modes)):
        if isinstance(given, str):
            raise ConfigError(f"{what} must be a list of names ([{given!r}]), got the string {given!r}")
        if not list(given):
            raise ConfigError(f"{what} must list at least one name, got {given!r}")


def format_p(p: float | None) -> str:
    """A p-value as the compare tables show it (3 significant digits; ``-`` where untested)."""
    return "-" if p is None else f"{p:.3g}"


def significance_label(comparison: Mapping[str, Any]) -> str:
    """``yes`` / ``no`` / ``too few seeds`` for one comparison of :func:`compare_results`."""
    value = comparison.get("significant")
    return "too few seeds" if value is None else ("yes" if value else "no")


def variance_marks(comparisons: Sequence[Mapping[str, Any]], other: str = "(see above)") -> dict[str, str]:
    """``{variance: mark}`` of the comparisons whose CI does not hold both sources of variance
    (``variance`` other than ``"seeds and queries"``, :class:`~dmlkit.protocol.stats.DifferenceTest`):
    ``(queries only)`` with one seed per method, ``(partly seeds)`` where one of the two has one
    seed, ``other`` for any other partial variance (where the text that explains it stands). The
    markdown and the terminal mark those cells: shown as the plain CI the header describes as
    over seeds, they looked far tighter than an interval over retrained models."""
    marks: dict[str, str] = {}
    for c in comparisons:
        variance = c.get("variance")
        if variance and variance != "seeds and queries" and variance not in marks:
            marks[variance] = ("(queries only)" if variance.startswith("queries only") else
                               "(partly seeds)" if variance.startswith("seeds and queries") else other)
    return marks


def render_compare_markdown(report: Mapping[str, Any]) -> str:
    """Two Markdown tables: paired differences, and relative improvements over the baselines.
    Every text that comes from the results files (method names, seeds, warnings) goes through
    :func:`markdown_text`."""
    conf = f"{100 * report['confidence']:g}"  # as the terminal table: 99.5, not 100
    seeds = markdown_text(", ".join(f"{n}: {k}" for n, k in report["seeds"].items()))
    marks = variance_marks(report["comparisons"])
    lines = [
        f"t-test over training seeds ({seeds}) and {report['queries']} test queries (standard "
        f"error from each method's seed-to-seed variance and the variance of the per-query "
        f"difference, Welch-Satterthwaite degrees of freedom); differences in percentage points, "
        f"{conf} % CI of each pair (not adjusted for the others); significant = p < "
        f"{1 - report['confidence']:.2g} after Holm's correction over the method pairs of each "
        f"metric and mode, with at least {report['min_seeds_for_significance']} seeds per method."
        # a method with one seed has no seed variance: its CIs hold less than the sentence says
        + "".join(f" A CI marked {m} holds the variance of {v}, not of seeds and queries: it does "
                  "not show how much the methods move when trained again." for v, m in marks.items()),
        *[f"\nWarning: {markdown_text(w)}." for w in report["warnings"]],
        "",
        f"| A | B | mode | metric | A - B | {conf} % CI | p | p (Holm) | significant |",
        "|---|---|---|---|---:|---|---:|---:|:---:|",
    ]
    for c in report["comparisons"]:
        lines.append(
            f"| {markdown_text(c['a'])} | {markdown_text(c['b'])} | {c['mode']} | {metric_label(c['metric'])} | "
            f"{100 * c['diff']:+.2f} | [{100 * c['ci_low']:+.2f}, {100 * c['ci_high']:+.2f}]"
            f"{' ' + marks[c['variance']] if c.get('variance') in marks else ''} | "
            f"{format_p(c.get('p'))} | {format_p(c.get('p_holm'))} | {significance_label(c)} |"
        )
    for base, info in report["relative_improvement"].items():
        rows = info["relative_percent"]
        if not rows:
            continue
        metrics = list(next(iter(rows.values()))["concatenated"])
        lines += ["", f"Relative improvement over {base} ({markdown_text(info['method'])}), %:", "",
                  "| method | " + " | ".join(f"{mode[:6]}. {metric_label(m)}" for mode in MODES for m in metrics) + " |",
                  "|---|" + "|".join(["---:"] * (len(metrics) * len(MODES))) + "|"]
        for name, modes in rows.items():
            cells = []
            for mode in MODES:
                for m in metrics:
                    v = modes[mode].get(m)
                    cells.append("n/a" if v is None else f"{v:+.1f}")
            lines.append(f"| {markdown_text(name)} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
