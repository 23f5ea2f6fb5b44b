"""Check a bench config against its data before the first trial (and before anything is written).

The protocol splits the classes into development and test classes and the development classes
into ``protocol.folds`` class-disjoint folds (:func:`~dmlkit.protocol.splits.make_bench_split`);
every method then trains on each fold's training classes and is selected on its validation
classes. :func:`check_bench` checks all of it against the dataset at once, so that a config
that cannot run fails in one error listing every violation with a fitting value
(``--set protocol.folds=2``, ``--set fixed.sampler.classes_per_batch=2``) instead of failing
each of its trials the same way:

* ``protocol.num_classes`` <= the dataset's classes;
* the split and folds fit the classes (``halves``: ``classes // 2 >= 2 x folds``; ``default``:
  ``dev classes >= 2 x folds``; ``ratio_4_1_5``: >= 2 classes per part);
* each fold's validation classes and the test classes can give a meaningful number
  (:func:`~dmlkit.training.preflight.eval_split_problems`);
* every method's batches and loss fit the smallest fold's training classes
  (:func:`~dmlkit.training.preflight.batch_problems`), with ``fixed.classification_sampler``
  for classification losses when it is set;
* the loss and miner build at the corners of each method's search space and at
  ``SEARCH_SAMPLES`` fixed random points of it (a refused point would be a FAIL trial);
* warning: a triplet loss's margin is searched while a miner keeps only the triplets inside its
  own margin (:func:`inert_margin_problems`): past the miner's reach the loss margin changes
  nothing, and those trials train the same model.

When the folds do not fit, the later checks use the fitting number of folds, so the fixes
work together.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dmlkit.data.splits import default_split
from dmlkit.distances import CosineSimilarity, LpDistance
from dmlkit.exceptions import DmlkitError
from dmlkit.losses import needs_pair_batches
from dmlkit.protocol.config import BenchConfig, MethodConfig
from dmlkit.protocol.space import search_corners, search_samples
from dmlkit.protocol.splits import BenchSplit, make_bench_split
from dmlkit.training.builders import build_loss, build_miner
from dmlkit.training.preflight import (
    DataSummary,
    Preflight,
    Problem,
    TrainStats,
    batch_problems,
    build_problems,
    eval_split_problems,
    loss_miner_problems,
)

__all__ = ["check_bench", "inert_margin_problems"]


def _make_split(config: BenchConfig, classes: list[int], dataset: Any, folds: int,
                num_classes: int | None, kind: str) -> BenchSplit:
    p = config.protocol
    default_dev = None
    if kind == "default":
        published = default_split(dataset)
        default_dev = [*published.train, *published.val]
    return make_bench_split(classes, kind, order=p.order, seed=p.order_seed, folds=folds,
                            num_classes=num_classes, default_dev=default_dev)


def _fit_split(config: BenchConfig, classes: list[int], dataset: Any,
               num_classes: int | None) -> tuple[BenchSplit | None, list[Problem]]:
    """The configured split, or the split of the largest number of folds that fits."""
    p = config.protocol
    folds = int(p.folds or 1)
    try:
        return _make_split(config, classes, dataset, folds, num_classes, p.split), []
    except DmlkitError as exc:
        reason = str(exc)
    n = num_classes or len(classes)
    if p.split in ("halves", "default"):
        for k in range(folds - 1, 1, -1):
            try:
                split = _make_split(config, classes, dataset, k, num_classes, p.split)
            except DmlkitError:
                continue
            return split, [Problem("protocol.folds", f"{folds} folds do not fit: {reason}", fit=k)]
    if p.split == "halves" and num_classes is not None and num_classes < 4 * folds <= len(classes):
        # protocol.num_classes cut the classes, not the dataset: keep more of them
        with contextlib.suppress(DmlkitError):
            split = _make_split(config, classes, dataset, folds, 4 * folds, p.split)
            return split, [Problem("protocol.num_classes", f"{num_classes} classes are too few for "
                                   f"split 'halves' with {folds} folds: {reason}", fit=4 * folds)]
    try:  # too few classes to cross-validate: the one fixed 4:1:5 split may still fit
        split = _make_split(config, classes, dataset, 1, num_classes, "ratio_4_1_5")
    except DmlkitError:
        return None, [Problem("protocol.split", f"{n} classes are too few for split {p.split!r} "
                              f"with {folds} folds: {reason}", hint="use a dataset with more classes "
                              "(split halves with 2 folds needs at least 8)")]
    return split, [Problem("protocol.split", f"{folds} folds do not fit: {reason}", fit="ratio_4_1_5"),
                   *([Problem("protocol.folds", "split ratio_4_1_5 is one fixed split", fit=1)]
                     if folds != 1 else [])]


def check_bench(config: BenchConfig, dataset: Any, *, root: str | Path | None = None,
                methods: Sequence[str] | None = None) -> Preflight:
    """Every size constraint of a bench config against ``dataset`` (all its classes), for the
    ``methods`` named (default all); each searched parameter at the ends of its range (and
    each of its choices), then :data:`SEARCH_SAMPLES` fixed random points of the search space,
    must build the loss and miner too. Raises nothing.

    Use ``report.raise_errors()`` for one :class:`~dmlkit.training.preflight.PreflightError`
    listing every error. ``report.split`` is the :class:`BenchSplit` that was checked.
    """
    summary = DataSummary.of(dataset, config.fixed.data.dataset, root or "")
    report = Preflight(summary, dataset=dataset)
    p = config.protocol
    classes = [int(c) for c in dataset.classes.tolist()]
    num_classes = p.num_classes
    if num_classes is not None and num_classes > len(classes):
        report.problems.append(Problem("protocol.num_classes", f"is {num_classes} but the dataset "
                                       f"has {len(classes)} classes", fit=len(classes)))
        num_classes = len(classes)
    split, problems = _fit_split(config, classes, dataset, num_classes)
    report.problems += problems
    if split is None:
        return report
    report.split = split
    folds = split.folds
    report.split_note = (f"{len(split.dev)} development classes in {len(folds)} fold(s) "
                         f"(training on {min(len(f.train) for f in folds)}-{max(len(f.train) for f in folds)} "
                         f"classes), {len(split.test)} test classes"
                         + (f" (with {' '.join(q.fix for q in problems if q.has_fit)})"
                            if any(q.has_fit for q in problems) else ""))
    labels = np.asarray(dataset.labels)
    names = dataset.class_names

    def part(ids) -> np.ndarray:
        return labels[np.isin(labels, list(ids))]

    seen: set[tuple[str, str]] = set()
    for f in folds:
        for prob in eval_split_problems(part(f.val), f"fold {f.index} validation", "protocol.folds",
                                        hint="the folds' validation classes need >= 2 items each",
                                        names=names):
            if (prob.key, prob.severity) not in seen:  # one line per kind, not one per fold
                seen.add((prob.key, prob.severity))
                report.problems.append(prob)
    report.problems += eval_split_problems(part(split.test), "test", "protocol.split",
                                           hint="the test classes need >= 2 items each", names=names)
    stats = [TrainStats.of(part(f.train)) for f in folds]
    smallest = min(range(len(folds)), key=lambda i: stats[i].num_classes)
    worst = TrainStats.smallest(stats, where=f"fold {folds[smallest].index}'s training split")
    by_key: dict[tuple[str, str, Any], list[str]] = {}
    lines: dict[tuple[str, str, Any], Problem] = {}
    selected = [(i, m) for i, m in enumerate(config.methods) if methods is None or m.name in methods]
    for i, method in selected:
        cfg = config.experiment(method)
        classification = not needs_pair_batches(method.loss.name, method.loss.params)
        sampler_key = ("fixed.classification_sampler" if classification
                       and config.fixed.classification_sampler is not None else "fixed.sampler")
        found = batch_problems(cfg, worst, sampler_key=sampler_key, loss_key=f"methods.{i}.loss")
        found += build_problems(cfg, worst.num_classes, loss_key=f"methods.{i}.loss",
                                miner_key=f"methods.{i}.miner", dataset=dataset)
        if not found:  # the fixed settings build: now the searched ones, corners and samples
            found += _search_problems(config, method, i, worst.num_classes)
        found += inert_margin_problems(config, method, i)  # whatever else is found: said with it
        for prob in found:
            k = (prob.key, prob.message, prob.fit if prob.has_fit else None)
            by_key.setdefault(k, []).append(method.name)
            lines.setdefault(k, prob)
    for k, prob in lines.items():
        who = by_key[k]
        if prob.key.startswith("fixed.") and len(selected) > 1:
            prob = Problem(prob.key, f"{prob.message} (method{'s' if len(who) > 1 else ''} "
                           f"{', '.join(who)})", **({"fit": prob.fit} if prob.has_fit else {}),
                           severity=prob.severity, hint=prob.hint)
        report.problems.append(prob)
    return report


#: Random points of a method's search space that the preflight builds after its corners
#: (:func:`dmlkit.protocol.space.search_samples`, fixed seed): a constraint that refuses 10% of
#: the space is missed with probability 0.9^32 = 3%, one that refuses 20% with 0.08%.
SEARCH_SAMPLES = 32


def _search_problems(config: BenchConfig, method: Any, index: int, num_classes: int) -> list[Problem]:
    """What the loss or miner refuses at the corners of ``method``'s search space
    (:func:`dmlkit.protocol.space.search_corners`), once per distinct message; when the corners
    build and two or more loss or miner parameters are searched, what they refuse at
    :data:`SEARCH_SAMPLES` fixed random points of it (a constraint coupling two searched
    parameters holds at both corners), as one problem: the first refused point with its values,
    and how many were refused. (A constraint on one parameter is an interval: its ends decide,
    and ``optimizer.loss_lr`` builds nothing.)"""
    problems: dict[str, Problem] = {}
    hint = ("every combination of values of the searched ranges must be one the loss and miner "
            "accept (the check builds them at the ranges' ends and at "
            f"{SEARCH_SAMPLES} fixed random points, so it can miss a small refused part)")
    for params in search_corners(method.search):
        for message in _refusals(config, method, index, num_classes, params):
            problems.setdefault(message, Problem(
                f"methods.{index}.search", f"with {_shown(params)}: {message}", hint=hint))
    if problems or sum(key.startswith(("loss.", "miner.")) for key in method.search) < 2:
        return list(problems.values())  # one searched loss or miner parameter: its ends decide
    refused = [(params, messages) for params in search_samples(method.search, SEARCH_SAMPLES)
               if (messages := _refusals(config, method, index, num_classes, params))]
    if not refused:
        return []
    params, messages = refused[0]
    return [Problem(f"methods.{index}.search",
                    f"with {_shown(params)}: {messages[0]} ({len(refused)} of {SEARCH_SAMPLES} random "
                    "points of the search space are refused; their ends are accepted)",
                    hint=hint + ": narrow the ranges of the parameters that a constraint couples so "
                    "that no combination breaks it")]


def _refusals(config: BenchConfig, method: Any, index: int, num_classes: int,
              params: dict[str, Any]) -> list[str]:
    """The messages of what the loss or miner refuses with the searched ``params`` (built
    alone: the model's settings, the same at every point, were checked with the fixed ones)."""
    return [prob.message for prob in loss_miner_problems(
        config.experiment(method, params), num_classes,
        loss_key=f"methods.{index}.loss", miner_key=f"methods.{index}.miner")]


def _shown(params: dict[str, Any]) -> str:
    """``key=value, ...`` of searched ``params``, sorted by key."""
    return ", ".join(f"{k}={v!r}" for k, v in sorted(params.items()))


#: Losses whose hinge is ``[d_ap - d_an + margin]_+`` on the triplets they are given: the loss
#: name and its margin parameter (a soft margin, ``soft_margin: true``, has no hinge; the ratio
#: form ``[1 - d_an / (m + d_ap)]_+``, ``form: ratio``, keeps ``m`` in its gradient).
TRIPLET_HINGE_MARGINS = {"triplet": "margin"}


def inert_margin_problems(config: BenchConfig, method: MethodConfig, index: int) -> list[Problem]:
    """A warning where ``method`` searches the margin of a triplet hinge loss
    (:data:`TRIPLET_HINGE_MARGINS`) while its miner keeps only the triplets inside the miner's
    own margin ``mu`` (``batch_all`` with ``nonzero``, ``semi_hard``, or any miner with a
    ``margin``: pytorch-metric-learning's ``TripletMarginMiner`` is ``batch_all``).

    Every mined triplet then has ``d_an - d_ap < R``, the miner's reach in the loss's distance
    (:func:`_miner_reach`; ``semi_hard``'s fallback negatives are closer than the positive).
    For a loss margin ``m >= R`` every mined triplet is inside the hinge, whose gradient
    ``d(d_ap - d_an)`` does not depend on ``m``, and the reduction averages the same triplets:
    the trials train bit-identical models, and the search of ``m`` is flat there (measured on
    the shipped presets before the miner was removed: ``batch_all(margin=0.1)`` gave the same
    gradient for m = 0.1 ... 1.0). On real batches few triplets reach ``R`` (a positive at
    distance 0), so ``m`` goes flat well below it."""
    param = TRIPLET_HINGE_MARGINS.get(method.loss.name)
    searched = method.search.get(f"loss.{param}")
    if searched is None or method.miner is None or method.loss.params.get("soft_margin") is True:
        return []
    if method.loss.params.get("form", "difference") == "ratio":  # [1 - d_an / (m + d_ap)]_+: m in every gradient
        return []
    mu_search = method.search.get("miner.margin")
    try:
        cfg = config.experiment(method, {} if mu_search is None else {"miner.margin": mu_search.high})
        miner = build_miner(cfg)
        loss = build_loss(cfg, 2, config.fixed.model.embedding_size, miner=miner)
    except DmlkitError:  # reported by the other checks
        return []
    mu = getattr(miner, "margin", None)
    if not isinstance(mu, int | float) or not getattr(miner, "nonzero", True):
        return []
    reach = _miner_reach(miner.distance, float(mu), getattr(loss, "distance", None))
    above = (f"above {reach:.3g} (the miner's reach in the loss's distance; on real batches from well "
             "below it)") if reach is not None else "beyond the miner's reach"
    own = f"searched up to {mu}" if mu_search is not None else f"{mu}"
    return [Problem(
        f"methods.{index}.miner",
        f"method {method.name!r} searches loss.{param} over {searched.low}-{searched.high}, but its miner "
        f"{method.miner.name} keeps only the triplets inside its own margin {own} (in "
        f"{type(miner.distance).__name__}), so any loss.{param} {above} finds every mined triplet "
        "inside its hinge and trains the same model",
        severity="warning",
        hint=f"remove the miner (the triplet loss's default reduction batch_all_nonzero already "
             f"averages only the triplets with a non-zero loss), or fix loss.{param} and search "
             "miner.margin")]


def _miner_reach(miner_distance: Any, mu: float, loss_distance: Any) -> float | None:
    """The largest ``d_an - d_ap`` (in ``loss_distance``) of a triplet that a miner keeping
    ``farness(a, n) - farness(a, p) < mu`` in ``miner_distance`` can return, or ``None`` where
    it is not worked out here. The same distance: ``mu``. Cosine similarity (the miners'
    default) against the Euclidean distance of normalised embeddings (the triplet loss's):
    with ``d = sqrt(2 - 2 s)``, ``sqrt(2 - 2 s_an) - sqrt(2 - 2 s_ap)`` under
    ``s_ap - s_an < mu`` is largest at ``s_ap = 1``: ``sqrt(2 mu)`` (at most 2, the diameter)."""
    if loss_distance is None:
        return None
    if repr(miner_distance) == repr(loss_distance):
        return mu
    euclidean = (isinstance(loss_distance, LpDistance) and loss_distance.p == 2 and loss_distance.power == 1
                 and loss_distance.normalize_embeddings)
    if isinstance(miner_distance, CosineSimilarity) and euclidean:
        return min(math.sqrt(2 * max(mu, 0.0)), 2.0)
    return None
