"""Preflight: check a config against its data before anything is trained or written.

A config can be valid on its own (every key typed and in range) and still not fit the data it
is run on: ``sampler.classes_per_batch = 8`` on a folder of 10 classes whose default split
trains on 5, a validation split of one class (every model scores 100 %, so the "best"
checkpoint is arbitrary) or of classes with one image each (no query has a positive, so
MAP@R is NaN). :func:`preflight` loads the dataset once, builds the class split the run will
use and checks **every** size constraint at once; all violations come back together in one
:class:`PreflightError`, each with a value that fits, in the CLI's spelling
(``--set sampler.classes_per_batch=5``), and the error names the data root and the classes
found. Where the run stays meaningful the problem is a warning (:class:`PreflightWarning`),
e.g. a few validation classes with one image (their queries are left out of MAP@R).

The constraints (and where they come from):

==============================  =========================================================
training classes >= 2           the trainer (a loss needs negatives)
classes_per_batch <= train      :class:`~dmlkit.samplers.MPerClassSampler` (no class twice
classes                         in a batch)
classes_per_batch >= 2,         pair/triplet losses: a batch needs a negative and a positive
samples_per_class >= 2          pair (a cross-batch memory supplies positives itself)
samples_per_class <= smallest   warning: smaller classes repeat their images in a batch
training class
batch % processes == 0          distributed training splits each batch evenly
validation: 0 or >= 2 classes,  one class: MAP@R is 100 % for every model; only singletons:
>= 1 class with >= 2 images     no positive pair, MAP@R is NaN
test: >= 2 classes, >= 1 class  the same, for the reported numbers
with >= 2 images
cross_batch_memory >= batch     a smaller memory never holds a past batch (Wang et al. 2020)
prototypical k_shot < M         every class of a batch needs a query row (Snell et al. 2017)
loss.params.num_classes         one entry per training class (``auto`` fills it in)
>= train classes
==============================  =========================================================

The data root: ``--data-root`` (``data_root=``) and a config's own ``data.root`` are both
explicit. :func:`merge_data_root` uses either one alone, or both when they name the same
folder, and refuses two different folders with one line, rather than letting one silently
replace the other.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dmlkit.config import DataConfig, ExperimentConfig, SplitConfig
from dmlkit.data import ClassSplit
from dmlkit.distributed import context as distributed_context
from dmlkit.exceptions import DataNotFoundError, DmlkitError
from dmlkit.losses import LOSSES, needs_pair_batches
from dmlkit.losses.sharding import check_shardable
from dmlkit.miners import MINERS
from dmlkit.training import builders
from dmlkit.training.builders import build_loss, build_miner, build_split, model_setting_problems
from dmlkit.training.data_root import load_config_dataset
from dmlkit.training.problems import NO_FIT, PreflightError, PreflightWarning, Problem, format_value
from dmlkit.utils import data_root as resolve_data_root

__all__ = [
    "DataSummary",
    "Preflight",
    "PreflightError",
    "PreflightWarning",
    "Problem",
    "TrainStats",
    "batch_problems",
    "build_problems",
    "check_experiment",
    "eval_split_problems",
    "format_value",
    "loss_miner_problems",
    "preflight",
    "refuse_degenerate_eval",
]

logger = logging.getLogger("dmlkit.training")


@dataclass(frozen=True)
class DataSummary:
    """What was found: the dataset, its root and its classes (count and a few names)."""

    dataset: str
    root: str
    num_classes: int
    num_items: int
    names: tuple[str, ...]

    @classmethod
    def of(cls, dataset: Any, name: str, root: str | Path) -> DataSummary:
        names = dataset.class_names
        shown = tuple(_one_line(names.get(int(c), str(c))) for c in dataset.classes[:5].tolist())
        where = dataset.meta.get("root") if isinstance(getattr(dataset, "meta", None), dict) else None
        return cls(name, _one_line(str(where or root)), int(dataset.classes.size), len(dataset), shown)

    def describe(self) -> str:
        more = ", ..." if self.num_classes > len(self.names) else ""
        return (f"{self.dataset} at {self.root}: {self.num_classes} classes "
                f"({', '.join(self.names)}{more}), {self.num_items} items")


def _one_line(name: Any) -> str:
    """``name`` as written, or its ``repr`` where it holds a newline or another character that
    does not print (a class folder named ``a\\nb`` split the error's one line in two)."""
    text = str(name)
    return text if text.isprintable() else repr(text)


@dataclass
class Preflight:
    """The result of a check: the data found, every problem, and what was built on the way."""

    summary: DataSummary
    problems: list[Problem] = field(default_factory=list)
    dataset: Any = None
    split: Any = None
    #: how the classes were split, e.g. "5 train / 0 val / 5 test classes"
    split_note: str = ""

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "warning"]

    def fixes(self) -> list[str]:
        """The ``--set`` fixes of the errors, one per key (the first problem of a key decides)."""
        seen: dict[str, str] = {}
        for p in self.errors:
            if p.fix is not None and p.key not in seen:
                seen[p.key] = p.fix
        return list(seen.values())

    def message(self) -> str:
        errors = self.errors
        head = (f"the config does not fit the data: {self.summary.describe()}"
                + (f"; {self.split_note}" if self.split_note else "")
                + f". {len(errors)} problem{'s' if len(errors) != 1 else ''}:")
        lines = [head, *(f"  - {p.line()}" for p in errors)]
        fixes = self.fixes()
        if len(fixes) > 1:
            lines.append("all fixes together: " + " ".join(fixes))
        if self.warnings:
            lines.append("also (warnings): " + "; ".join(p.line() for p in self.warnings))
        return "\n".join(lines)

    def raise_errors(self) -> None:
        """Raise one :class:`PreflightError` listing every error (nothing if there is none)."""
        if self.errors:
            raise PreflightError(self.message(), self.errors)

    def emit_warnings(self) -> None:
        """Each warning as one :class:`PreflightWarning` (one readable line in the CLI)."""
        for p in self.warnings:
            warnings.warn(p.line(), PreflightWarning, stacklevel=3)


# -- constraints on evaluation splits ------------------------------------------------------------
@dataclass(frozen=True)
class TrainStats:
    """What the batch constraints need to know about a training split."""

    num_classes: int
    num_items: int
    min_class_size: int
    where: str = "the training split"

    @classmethod
    def of(cls, labels: Any, where: str = "the training split") -> TrainStats:
        _, counts = np.unique(np.asarray(labels), return_counts=True)
        if counts.size == 0:
            return cls(0, 0, 0, where=where)
        return cls(int(counts.size), int(counts.sum()), int(counts.min()), where=where)

    @classmethod
    def smallest(cls, stats: Iterable[TrainStats], where: str) -> TrainStats:
        """The elementwise minimum (the fold every constraint must fit)."""
        stats = list(stats)
        return cls(min(s.num_classes for s in stats), min(s.num_items for s in stats),
                   min(s.min_class_size for s in stats), where=where)


def eval_split_problems(labels: Any, split: str, key: str, fit: Any = NO_FIT, *,
                        hint: str | None = None, names: dict[int, str] | None = None) -> list[Problem]:
    """Problems of an evaluation split (validation or test) with these labels.

    * one class: every query's neighbours are all positives, MAP@R = P@1 = 100 % for any model
      (error);
    * no class with two items: no query has a positive pair, every metric is NaN (error);
    * some classes with one item: their queries are left out of the metrics (warning).

    ``key``/``fit``/``hint`` say what to change (the config key and a value that fits).
    """
    ids, counts = np.unique(np.asarray(labels), return_counts=True)
    if ids.size == 0:
        return []
    names = {c: _one_line(n) for c, n in (names or {}).items()}
    problems = []
    todo = {"fit": fit} if fit is not NO_FIT else {}
    if ids.size == 1:
        only = names.get(int(ids[0]), str(int(ids[0])))
        problems.append(Problem(key, f"the {split} split has one class ({only}): every model scores "
                                f"100 % on it, so its numbers mean nothing", hint=hint, **todo))
    elif (counts >= 2).sum() == 0:
        problems.append(Problem(key, f"every {split} class has one item ({ids.size} classes): no "
                                "query has a positive, so MAP@R and P@1 are undefined (NaN)",
                                hint=hint or f"give the {split} classes at least 2 items each", **todo))
    else:
        single = ids[counts < 2]
        if single.size:
            shown = ", ".join(names.get(int(c), str(int(c))) for c in single[:3])
            problems.append(Problem(
                key, f"{single.size} of {ids.size} {split} classes have one item ({shown}"
                f"{', ...' if single.size > 3 else ''}): their queries have no positive and are "
                "left out of the metrics", severity="warning"))
    return problems


def refuse_degenerate_eval(labels: Any, split: str = "validation") -> None:
    """Raise a :class:`PreflightError` if an evaluation split (given as explicit datasets, e.g.
    to :class:`~dmlkit.training.loop.Trainer`) can only give meaningless numbers: one class,
    or no class with two items (no positive pair, NaN metrics)."""
    errors = [p for p in eval_split_problems(labels, split, split,
                                             hint="pass a split with >= 2 classes of >= 2 items")
              if p.severity == "error"]
    if errors:
        raise PreflightError(errors[0].message + f": {errors[0].hint}", errors)


# -- constraints on training batches ----------------------------------------------------------------
def batch_problems(config: ExperimentConfig, stats: TrainStats, *, sampler_key: str = "sampler",
                   loss_key: str = "loss", world_size: int = 1) -> list[Problem]:
    """Problems of ``config``'s batches and loss against a training split (``stats``).

    Later checks use the fitting values of earlier ones, so the fixes work together.
    """
    problems: list[Problem] = []
    n = stats.num_classes
    if n < 2:
        return problems  # reported with the split
    s = config.sampler
    c, m = s.classes_per_batch, s.samples_per_class
    pairs = needs_pair_batches(config.loss.name, config.loss.params)
    xbm = config.loss.cross_batch_memory
    where = stats.where
    if c > n:
        problems.append(Problem(f"{sampler_key}.classes_per_batch", f"is {c} but {where} has {n} "
                                "classes (a batch holds each class once)", fit=n))
        c = n
    elif pairs and c < 2:
        problems.append(Problem(f"{sampler_key}.classes_per_batch", f"is 1: the {config.loss.name} "
                                "loss needs a negative pair, i.e. 2 classes in a batch", fit=2))
        c = 2
    if pairs and not xbm and m < 2:
        problems.append(Problem(f"{sampler_key}.samples_per_class", f"is 1: the {config.loss.name} "
                                "loss needs a positive pair, i.e. 2 samples of a class in a batch",
                                fit=2))
        m = 2
    if stats.min_class_size < m:
        low = 2 if pairs and not xbm else 1
        todo = {"fit": stats.min_class_size} if stats.min_class_size >= low else {
            "hint": "add images to the smallest classes"}
        problems.append(Problem(f"{sampler_key}.samples_per_class", f"is {m} but the smallest class of "
                                f"{where} has {stats.min_class_size} items: its batches repeat images",
                                severity="warning", **todo))
    if world_size > 1 and (c * m) % world_size:
        fit_c = next((k for k in range(c, 0, -1) if (k * m) % world_size == 0 and (k >= 2 or not pairs)), None)
        todo = {"fit": fit_c} if fit_c else {"hint": f"make classes_per_batch x samples_per_class a "
                                              f"multiple of {world_size}"}
        problems.append(Problem(f"{sampler_key}.classes_per_batch", f"x samples_per_class = {c} x {m} "
                                f"cannot be split evenly over {world_size} processes", **todo))
    batch = c * m
    if xbm:
        usable = max(batch, stats.num_items // batch * batch)
        if xbm < batch:
            problems.append(Problem(f"{loss_key}.cross_batch_memory", f"is {xbm}, smaller than one "
                                    f"batch ({c} x {m} = {batch}): it never holds a past batch",
                                    fit=usable))
        elif xbm > stats.num_items:
            problems.append(Problem(f"{loss_key}.cross_batch_memory", f"is {xbm} but {where} has "
                                    f"{stats.num_items} items: the memory keeps stale copies of the "
                                    "same images", fit=usable, severity="warning"))
    params = config.loss.params
    k_shot = params.get("k_shot")
    if config.loss.name == "prototypical" and isinstance(k_shot, int) and k_shot >= m:
        if m >= 2:
            problems.append(Problem(f"{loss_key}.params.k_shot", f"is {k_shot} but a batch has "
                                    f"{m} samples per class: no class keeps a query row", fit=m - 1))
        else:
            problems.append(Problem(f"{sampler_key}.samples_per_class", f"is {m} but "
                                    f"{loss_key}.params.k_shot is {k_shot}: no class keeps a query row",
                                    fit=k_shot + 1))
    num_classes = params.get("num_classes")
    if isinstance(num_classes, int) and not isinstance(num_classes, bool) and num_classes < n:
        problems.append(Problem(f"{loss_key}.params.num_classes", f"is {num_classes} but {where} "
                                f"has {n} classes", fit="auto"))
    return problems


def build_problems(config: ExperimentConfig, num_classes: int, *, loss_key: str = "loss",
                   miner_key: str = "miner", dataset: Any = None) -> list[Problem]:
    """Build the miner and the loss once with the config's parameters (for ``num_classes``
    training classes, :func:`loss_miner_problems`): a parameter name or value they refuse is
    reported with the others. The model's settings are checked too, and ``model.in_channels``
    against the images of ``data.transform`` (without a transform, against ``dataset``'s first
    sample, when given)."""
    problems = loss_miner_problems(config, num_classes, loss_key=loss_key, miner_key=miner_key)
    problems += [Problem(key, message) for key, message in model_setting_problems(config)]
    m = config.model
    if m.frozen_trunk and not m.pretrained and m.weights is None:  # features of random weights
        problems.append(Problem("model.pretrained", "is false with model.frozen_trunk: the head would "
                                "train on a randomly initialised trunk that never learns", fit=True,
                                severity="warning"))
    channels, source = input_channels(config.data.transform, dataset)
    if channels is not None and config.model.in_channels != channels:  # else a traceback at step 1
        problems.append(Problem("model.in_channels", f"is {config.model.in_channels} but {source} "
                                f"{channels}-channel images", fit=channels))
    return problems


def loss_miner_problems(config: ExperimentConfig, num_classes: int, *, loss_key: str = "loss",
                        miner_key: str = "miner") -> list[Problem]:
    """What the miner and the loss refuse when built with the config's parameters (for
    ``num_classes`` training classes), and their pairing: the part of :func:`build_problems`
    that a bench's searched parameters change (the model's settings do not: checked once)."""
    problems = []
    miner = None
    try:
        miner = build_miner(config.miner)
    except DmlkitError as exc:  # an unknown name is the name's problem, not the parameters'
        known = config.miner is None or config.miner.name in MINERS
        problems.append(_build_problem(exc, miner_key, "miner", known))
    pairing = builders.pairing_problems(config, loss_key, miner_key)  # else refused at step 1
    problems += [Problem(key, message, fit=None) for key, message in pairing]
    section, miner = (builders.without_memory(config.loss), None) if pairing else (config.loss, miner)
    try:
        loss = build_loss(section, max(num_classes, 1), config.model.embedding_size, miner)
    except DmlkitError as exc:
        problems.append(_build_problem(exc, loss_key, "loss", config.loss.name in LOSSES))
    else:
        if config.training.distributed_loss == "local_anchors":  # else refused after the run dir is written
            try:
                check_shardable(loss, config.loss.name)
            except DmlkitError as exc:
                problems.append(Problem("training.distributed_loss", str(exc), fit="replicated"))
    return problems


def input_channels(transform: str | None, dataset: Any = None) -> tuple[int | None, str]:
    """The channels of the images the model gets, and what says so (``"... gives"``): the
    ``transform`` preset, or with none (``None``, ``"none"``) ``dataset``'s first sample as
    training reads it (``None`` when unknown: no dataset, or a sample that is not ``(C, H, W)``)."""
    if transform in _TRANSFORM_CHANNELS:
        return _TRANSFORM_CHANNELS[transform], f"data.transform {transform!r} gives"
    if transform not in (None, "none") or dataset is None or len(dataset) == 0:
        return None, ""
    if transform == "none" and hasattr(dataset, "with_transform"):
        dataset = dataset.with_transform(None)  # as build_datasets does for "none"
    shape = getattr(dataset[0][0], "shape", ())
    return (int(shape[0]), "the dataset's own samples (no data.transform) are") \
        if len(shape) == 3 else (None, "")


def _build_problem(exc: Exception, key: str, kind: str, known_name: bool) -> Problem:
    """The problem of building a ``kind`` (loss or miner) under ``key``: its name when unknown,
    else its parameters."""
    if not known_name:
        return Problem(f"{key}.name", str(exc).removeprefix(f"{kind}.name "),
                       hint=f"docs/losses.md lists every {kind}")
    return Problem(f"{key}.params", str(exc).removeprefix(f"{kind}.params for "),
                   hint=f"docs/losses.md lists each {kind}'s parameters")


#: Channels of the images each image transform preset gives (:func:`dmlkit.data.get_transforms`).
_TRANSFORM_CHANNELS = {"grayscale": 1, "imagenet": 3, "imagenet_resize": 3}


# -- the class split ---------------------------------------------------------------------------------
def _split_counts(split: ClassSplit) -> str:
    return f"{len(split.train)} train / {len(split.val)} val / {len(split.test)} test classes"


def _try_split(sc: SplitConfig, dataset: Any) -> ClassSplit | None:
    try:
        return build_split(sc, dataset)
    except DataNotFoundError:
        raise
    except DmlkitError:
        return None


def _split_sizes_fit(split: ClassSplit | None) -> bool:
    return (split is not None and len(split.train) >= 2 and len(split.test) >= 2
            and len(split.val) != 1)


def _fit_ratios(n: int, ratios: Sequence[float]) -> list[int] | None:
    """Class counts ``[train, val, test]`` closest to ``ratios`` with >= 2 train and test
    classes and 0 or >= 2 validation classes (brute force; only for small datasets)."""
    if n > 500:
        return None
    r = np.asarray(ratios, dtype=float)
    want = n * r / r.sum()
    best, best_cost = None, np.inf
    vals = [0] if r[1] == 0 else range(2, n - 3)
    for v in vals:
        for t in range(2, n - v - 1):
            s = n - v - t
            if s < 2:
                continue
            cost = float(np.abs(np.array([t, v, s]) - want).sum())
            if cost < best_cost:
                best, best_cost = [t, v, s], cost
    return best


def _fit_val_fraction(sc: SplitConfig, dataset: Any) -> tuple[float, ClassSplit] | None:
    """The smallest ``val_fraction`` giving >= 2 validation and >= 2 training classes."""
    base = _try_split(sc.model_copy(update={"val_fraction": 0.0}), dataset)
    if base is None:
        return None
    n_train = len(base.train)
    for target in range(2, n_train - 1):
        vf = round(target / n_train, 3)
        if not 0 < vf < 1:
            continue
        split = _try_split(sc.model_copy(update={"val_fraction": vf}), dataset)
        if split is not None and len(split.val) == target and len(split.train) >= 2:
            return vf, split
    return None


def _no_validation_warning(sc: SplitConfig, dataset: Any, split: ClassSplit | None, key: str) -> list[Problem]:
    """A warning for a split without validation classes that could have some: best.pt is then
    the last model, not the best on validation; the fix is a ``val_fraction`` that fits the data."""
    if split is None or len(split.val) or sc.kind == "file" or sc.val_fraction > 0:
        return []
    fitted = _fit_val_fraction(sc, dataset)
    message = ("is 0: no validation classes, so checkpoints/best.pt will be the last model, not the "
               "best on validation MAP@R")
    if fitted is None:
        return []  # too few classes to carve out two: nothing to suggest
    return [Problem(f"{key}.val_fraction", message, fit=fitted[0], severity="warning")]


def plan_split(data: DataConfig, dataset: Any, prefix: str = "") -> tuple[ClassSplit | None, list[Problem], str]:
    """The class split ``data.split`` gives on ``dataset`` (or, when it does not fit, the split
    of the fitting values), the split's problems, and a note on how the classes were split."""
    sc = data.split
    key = f"{prefix}data.split"
    n = int(dataset.classes.size)
    split = _try_split(sc, dataset)
    if _split_sizes_fit(split):
        return split, _no_validation_warning(sc, dataset, split, key), _split_counts(split)
    if sc.kind == "file":  # the file decides: say what is wrong with it
        try:
            build_split(sc, dataset)
        except DmlkitError as exc:
            return None, [Problem(f"{key}.path", str(exc), hint="fix or replace the split file")], ""
        return split, [Problem(f"{key}.path", f"{_split_counts(split)}: a split needs >= 2 train "
                               "and test classes and 0 or >= 2 validation classes",
                               hint="fix or replace the split file")], _split_counts(split)
    problems: list[Problem] = []
    if sc.kind == "ratio":
        base = _try_split(sc.model_copy(update={"val_fraction": 0.0}), dataset)
        if not _split_sizes_fit(base):
            fit = _fit_ratios(n, sc.ratios or (4, 1, 5))
            got = _split_counts(base) if base is not None else "an empty part"
            if fit is None:
                problems.append(Problem(f"{key}.ratios", f"{list(sc.ratios or ())} of {n} classes give "
                                        f"{got}", hint="a split needs >= 2 train and test classes (and "
                                        "0 or >= 2 validation classes): use more classes"))
                return None, problems, ""
            problems.append(Problem(f"{key}.ratios", f"{list(sc.ratios or ())} of {n} classes give "
                                    f"{got}; each part needs >= 2 classes (validation: 0 or >= 2)",
                                    fit=fit))
            sc = sc.model_copy(update={"ratios": tuple(float(x) for x in fit)})
            split = _try_split(sc, dataset)
            if _split_sizes_fit(split):
                return split, problems, _split_counts(split) + f" (with --set {key}.ratios={format_value(fit)})"
    if sc.val_fraction > 0:
        fitted = _fit_val_fraction(sc, dataset)
        have = "no" if split is None else str(len(split.val))
        if fitted is not None:
            vf, split = fitted
            problems.append(Problem(f"{key}.val_fraction", f"{sc.val_fraction} gives {have} validation "
                                    "class(es) and training needs >= 2 (one validation class scores "
                                    "100 % for every model)", fit=vf))
            return split, problems, _split_counts(split) + f" (with --set {key}.val_fraction={vf})"
        problems.append(Problem(f"{key}.val_fraction", f"{sc.val_fraction}: too few classes for both "
                                "training and validation (each needs >= 2); without validation "
                                "best.pt is the last model", fit=0))
        sc = sc.model_copy(update={"val_fraction": 0.0})
        split = _try_split(sc, dataset)
        if _split_sizes_fit(split):
            return split, problems, _split_counts(split) + f" (with --set {key}.val_fraction=0)"
    if split is not None and len(split.train) >= 2 and len(split.test) >= 2:
        return split, problems, _split_counts(split)  # one validation class: the eval check says so
    have = _split_counts(split) if split is not None else "no usable split"
    problems.append(Problem(key, f"{n} classes give {have}: training and test each need >= 2 "
                            "classes", hint="use a dataset with at least 4 classes"))
    return (split if split is not None and len(split.train) >= 2 else None), problems, have


# -- the whole experiment ---------------------------------------------------------------------------
def check_experiment(config: ExperimentConfig, dataset: Any, *, root: str | Path | None = None,
                     world_size: int | None = None) -> Preflight:
    """Every size constraint of ``config`` against ``dataset`` (all its classes); raises nothing.

    Checks the class split (>= 2 train and test classes, 0 or >= 2 validation classes), the
    validation and test classes' sizes (:func:`eval_split_problems`) and the batches and loss
    against the training classes (:func:`batch_problems`). ``world_size`` defaults to the
    current process group's size.
    """
    if world_size is None:
        world_size = distributed_context().world_size
    summary = DataSummary.of(dataset, config.data.dataset,
                             root if root is not None else resolve_data_root(config.data.root))
    split, problems, note = plan_split(config.data, dataset, "")
    report = Preflight(summary, problems, dataset=dataset, split=split, split_note=note)
    if split is None:
        return report
    labels = np.asarray(dataset.labels)
    names = dataset.class_names
    sc = config.data.split
    if split.val:
        val_labels = labels[np.isin(labels, split.val)]
        if sc.val_fraction:
            where: dict[str, Any] = {"fit": 0}
        else:
            where = {"hint": "change the split's validation classes, or add images to them"}
        report.problems += eval_split_problems(
            val_labels, "validation", "data.split.val_fraction" if sc.val_fraction else
            ("data.split.ratios" if sc.kind == "ratio" else "data.split"), **where, names=names)
    test_labels = labels[np.isin(labels, split.test)]
    report.problems += eval_split_problems(test_labels, "test", "data.split",
                                           hint="choose a split whose test classes have >= 2 items",
                                           names=names)
    groups = getattr(dataset, "sample_groups", None)
    if groups is not None and "query" in set(np.asarray(groups)[np.isin(labels, split.test)].tolist()):
        report.problems.append(Problem(  # else a user reads the wrong protocol's number unwarned
            "data.dataset", "marks test images as query/gallery, but train's test metrics rank every "
            "test image against all the others; for the query -> gallery protocol run `dmlkit reid "
            "RUN_DIR` (re-id) or `dmlkit evaluate QUERY.npz -r GALLERY.npz` after training",
            severity="warning"))
    train = TrainStats.of(labels[np.isin(labels, split.train)])
    report.problems += batch_problems(config, train, world_size=world_size)
    report.problems += build_problems(config, train.num_classes, dataset=dataset)
    return report


def preflight(config: ExperimentConfig, *, dataset: Any = None, data_root: str | Path | None = None,
              world_size: int | None = None, raise_errors: bool = True,
              emit_warnings: bool = True) -> Preflight:
    """Load the config's dataset (unless given) and check every size constraint at once.

    Raises one :class:`PreflightError` listing every error, each with a fitting value in CLI
    spelling, and naming the data root and the classes found; emits each warning as a
    :class:`PreflightWarning`. The returned :class:`Preflight` holds the loaded ``dataset``
    and the ``split`` (hand both on, so the data is read once)::

        check = preflight(config)
        sets = build_datasets(config, dataset=check.dataset)
    """
    root: Any = None
    if dataset is None:
        dataset, root = load_config_dataset(config.data, data_root)
    report = check_experiment(config, dataset, root=root, world_size=world_size)
    if raise_errors:
        report.raise_errors()
    if emit_warnings:
        report.emit_warnings()
    return report
