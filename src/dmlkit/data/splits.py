"""Class-disjoint splits: the literature's splits, ratio splits, and the seed's k-fold blocks.

Metric learning evaluates on classes never seen in training, so every split here partitions
*class ids*, never samples.

- :class:`ClassSplit` holds ``train`` / ``val`` / ``test`` class-id lists and is saved to and
  loaded from JSON so that a split can be published with results.
- :func:`default_split`: the dataset's literature split (CUB 1-100 / 101-200, Cars 1-98 /
  99-196, SOP and In-Shop official lists, Omniglot background / evaluation, ...), with an
  optional validation set carved from the training classes.
- :func:`split_classes`: ratio split by the default class order or a seeded random order, e.g.
  the 4:1:5 train/validation/test split of Oi, Kawakami & Naemura (seed 004), who show that
  the default order (similar classes adjacent) biases results against a random order.
- :func:`kfold_class_partitions` / :func:`fold_split`: the 4-fold cross-validation of Musgrave,
  Belongie & Lim, "A Metric Learning Reality Check" (ECCV 2020): the classes used for
  cross-validation are cut into ``k`` contiguous equal blocks in class order (with the first
  half of a dataset's classes, block 1 is the first 12.5 % of all classes, and so on).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from dmlkit.exceptions import ConfigError, DataError, DataNotFoundError
from dmlkit.utils import atomic_write_json
from dmlkit.validation import check_integer

if TYPE_CHECKING:  # pragma: no cover
    from dmlkit.data.base import MetricDataset

__all__ = [
    "ClassSplit",
    "default_split",
    "fold_split",
    "kfold_class_partitions",
    "split_classes",
]

SPLIT_FORMAT = "dmlkit.class_split/1"


def _ids(values: Iterable[Any]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


def _check_json_ids(part: str, values: Any) -> None:
    """Refuse a split file's list that is not integer class ids: a string ``"123"`` read as the
    classes 1, 2, 3, ``1.5`` as class 1 and ``true`` as class 1."""
    if not isinstance(values, list | tuple):
        raise DataError(f"class split lists must hold integer class ids: {part} is "
                        f"{type(values).__name__} {values!r:.60}, not a list")
    for v in values:
        ok = (isinstance(v, int) and not isinstance(v, bool)) \
            or (isinstance(v, float) and v.is_integer()) \
            or (isinstance(v, str) and v.strip().removeprefix("-").isascii() and v.strip().removeprefix("-").isdecimal())
        if not ok:
            raise DataError(f"class split lists must hold integer class ids: {part} holds {v!r}")


@dataclass(frozen=True)
class ClassSplit:
    """Disjoint class-id lists for training, validation and test.

    ``train`` and ``test`` must be non-empty, ``val`` may be empty (e.g. when validation comes
    from cross-validation folds of ``train``); no class may appear in two parts. ``meta`` is
    free-form provenance (dataset, method, seed) saved with the split.
    """

    train: tuple[int, ...]
    val: tuple[int, ...] = ()
    test: tuple[int, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "train", _ids(self.train))
        object.__setattr__(self, "val", _ids(self.val))
        object.__setattr__(self, "test", _ids(self.test))
        for part in ("train", "test"):
            if not getattr(self, part):
                raise DataError(f"a class split needs at least one {part} class")
        for part in ("train", "val", "test"):
            ids = getattr(self, part)
            if len(set(ids)) != len(ids):
                raise DataError(f"the {part} classes of a split contain duplicates")
        pairs = (("train", "val"), ("train", "test"), ("val", "test"))
        for a, b in pairs:
            common = set(getattr(self, a)) & set(getattr(self, b))
            if common:
                shown = sorted(common)[:10]
                raise DataError(
                    f"class split is not class-disjoint: {len(common)} class(es) in both "
                    f"{a} and {b}, e.g. {shown}"
                )

    # -- (de)serialisation -----------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": SPLIT_FORMAT,
            "train": list(self.train),
            "val": list(self.val),
            "test": list(self.test),
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClassSplit:
        if not isinstance(data, dict) or "train" not in data or "test" not in data:
            raise DataError("a class split needs 'train' and 'test' lists of class ids")
        for part in ("train", "val", "test"):
            _check_json_ids(part, data.get(part) or [])
        try:
            return cls(
                train=data["train"], val=data.get("val") or (), test=data["test"],
                meta=dict(data.get("meta") or {}),
            )
        except (TypeError, ValueError) as exc:
            raise DataError(f"class split lists must hold integer class ids: {exc}") from exc

    def to_json(self, path: str | os.PathLike) -> Path:
        """Write the split to ``path`` (JSON, atomically)."""
        return atomic_write_json(path, self.to_dict())

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> ClassSplit:
        """Read a split written by :meth:`to_json` (or any JSON with train/val/test lists)."""
        path = Path(path)
        if not path.exists():
            raise DataNotFoundError(f"split file not found: {path}")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (ValueError, RecursionError) as exc:  # RecursionError: nested ~100,000 deep
            raise DataError(f"split file {path} is not valid JSON: "
                            f"{exc if isinstance(exc, ValueError) else 'nested too deeply'}") from None
        return cls.from_dict(data)

    # -- use -------------------------------------------------------------------------------
    @property
    def sizes(self) -> dict[str, int]:
        return {"train": len(self.train), "val": len(self.val), "test": len(self.test)}

    def check(self, dataset: MetricDataset) -> None:
        """Raise :class:`DataError` if a class of the split is not in ``dataset``, or, for a
        split that recorded its class names (:meth:`naming`), if ``dataset`` names one of its
        ids otherwise: class ids are positions (an image folder numbers its sorted folders), so
        a folder added or removed since shifts them onto other classes."""
        present = set(dataset.classes.tolist())
        for part in ("train", "val", "test"):
            missing = [c for c in getattr(self, part) if c not in present]
            if missing:
                raise DataError(
                    f"{len(missing)} {part} class(es) of the split are not in dataset "
                    f"{dataset.name!r}, e.g. {missing[:10]}: the split belongs to another dataset"
                )
        recorded = self.meta.get("class_names")
        if isinstance(recorded, dict):
            moved = [(int(c), name, dataset.class_names.get(int(c))) for c, name in recorded.items()
                     if int(c) in present and dataset.class_names.get(int(c)) != name]
            if moved:
                c, was, now = moved[0]
                raise DataError(
                    f"{len(moved)} class id(s) of the split name other classes in dataset {dataset.name!r} "
                    f"now, e.g. class {c} was {was!r} and is {now!r}: the data changed since the split "
                    "was made (classes are numbered in their sorted order); use the data the run was "
                    "made with (--data-root)")

    def naming(self, class_names: Mapping[int, str]) -> ClassSplit:
        """This split with its classes' names (a dataset's ``class_names``) recorded in ``meta``,
        which :meth:`check` compares with the data the split is applied to later."""
        ids = [*self.train, *self.val, *self.test]
        names = {str(c): class_names.get(c, str(c)) for c in ids}
        return ClassSplit(self.train, self.val, self.test, meta={**self.meta, "class_names": names})

    def apply(self, dataset: MetricDataset) -> dict[str, MetricDataset | None]:
        """``{"train": ds, "val": ds or None, "test": ds}`` restricted to each part's classes."""
        self.check(dataset)
        return {
            part: dataset.subset_classes(getattr(self, part)) if getattr(self, part) else None
            for part in ("train", "val", "test")
        }


# -- ratio splits ----------------------------------------------------------------------------
def _ratio_counts(n: int, ratios: Sequence[float]) -> list[int]:
    """Integer part sizes summing to ``n`` in proportion to ``ratios`` (largest remainder)."""
    r = np.asarray(ratios, dtype=float)
    if r.ndim != 1 or r.size == 0 or not np.isfinite(r).all() or (r < 0).any() or r.sum() <= 0:
        raise ConfigError(f"ratios must be finite non-negative numbers with a positive sum, got {ratios}")
    exact = n * r / r.sum()
    counts = np.floor(exact).astype(int)
    rest = n - int(counts.sum())
    # largest fractional parts first; ties go to the earlier part (stable sort)
    order = np.argsort(-(exact - counts), kind="stable")
    for i in order[:rest]:
        counts[i] += 1
    return counts.tolist()


def _ordered(classes: Iterable[int], order: str, seed: int) -> np.ndarray:
    ids = np.asarray(list(classes), dtype=np.int64)
    if len(set(ids.tolist())) != ids.size:
        raise DataError("class ids given to a split contain duplicates")
    if order == "default":
        return ids
    if order == "random":
        return np.random.default_rng(seed).permutation(ids)
    raise ConfigError(f"order must be 'default' or 'random', got {order!r}")


def split_classes(
    classes: Iterable[int],
    ratios: Sequence[float] = (4, 1, 5),
    order: str = "default",
    seed: int = 0,
) -> ClassSplit:
    """Split class ids into train/val/test blocks in the given proportions.

    ``order="default"`` cuts the class list as given (the dataset's class order, so similar
    classes stay together); ``order="random"`` first permutes it with
    ``numpy.random.default_rng(seed)``. ``ratios`` has 3 entries (train, val, test) or 2
    (train, test). Sizes use the largest-remainder rule, e.g. 200 classes at 4:1:5 give
    80/20/100 and 196 give 78/20/98 (Oi, Kawakami & Naemura, seed 004).
    """
    if len(ratios) == 2:
        ratios = (ratios[0], 0, ratios[1])
    if len(ratios) != 3:
        raise ConfigError(f"ratios must be (train, val, test) or (train, test), got {ratios}")
    ids = _ordered(classes, order, seed)
    n_train, n_val, _ = _ratio_counts(ids.size, ratios)
    parts = np.split(ids, [n_train, n_train + n_val])
    return ClassSplit(
        train=sorted(parts[0].tolist()), val=sorted(parts[1].tolist()),
        test=sorted(parts[2].tolist()),
        meta={"method": "ratios", "ratios": [float(r) for r in ratios], "order": order,
              "seed": seed},
    )


def kfold_class_partitions(classes: Iterable[int], k: int = 4) -> list[list[int]]:
    """Cut the class list (in the order given) into ``k`` contiguous, near-equal blocks.

    The Reality Check's deterministic partitions: with the first half of a dataset's classes
    passed in, block 0 is the first 12.5 % of all classes, block 1 the next 12.5 %, and so on.
    When ``len(classes)`` is not a multiple of ``k`` the first blocks get one class more.
    """
    ids = [int(c) for c in classes]
    k = check_integer(k, "k", least=2, hint=" (class folds for cross-validation)")  # 2.5 made 2
    if len(ids) < k:
        raise DataError(f"cannot make {k} class folds from {len(ids)} classes")
    if len(set(ids)) != len(ids):
        raise DataError("class ids given to kfold_class_partitions contain duplicates")
    return [block.tolist() for block in np.array_split(np.asarray(ids, dtype=np.int64), k)]


def fold_split(train_classes: Iterable[int], k: int, fold: int) -> tuple[list[int], list[int]]:
    """``(train, val)`` class lists of cross-validation fold ``fold`` (0-based).

    ``val`` is block ``fold`` of :func:`kfold_class_partitions` and ``train`` the other blocks.
    """
    blocks = kfold_class_partitions(train_classes, k)
    if not 0 <= fold < k:
        raise ConfigError(f"fold must be in 0..{k - 1}, got {fold}")
    train = [c for i, b in enumerate(blocks) if i != fold for c in b]
    return train, list(blocks[fold])


# -- literature splits -----------------------------------------------------------------------
def default_split(
    dataset: MetricDataset,
    val_fraction: float = 0.0,
    order: str = "default",
    seed: int = 0,
) -> ClassSplit:
    """The dataset's standard class split, with an optional validation set.

    Uses the dataset's class groups (``dataset.class_groups`` and ``dataset.split_groups``:
    Omniglot background -> train / evaluation -> test, CUB 1-100 / 101-200, Cars 1-98 /
    99-196, SOP and In-Shop official lists, a CSV's split column). A dataset without groups is
    split in half by class order (the literature convention). A CSV split column without
    train or without test rows raises :class:`DataError` naming the values it holds. ``val_fraction > 0`` moves the
    last ``round(val_fraction * n_train)`` (at least one) training classes in ``order``
    (``"default"`` class order or a seeded ``"random"`` order) to the validation set.
    """
    if not 0.0 <= val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in [0, 1), got {val_fraction}")
    groups = dataset.split_groups
    by_group: dict[str, list[int]] = {}
    for c, g in dataset.class_groups.items():
        by_group.setdefault(g, []).append(c)
    train_group, test_group = groups.get("train"), groups.get("test")
    meta: dict[str, Any] = {"dataset": dataset.name}
    if train_group in by_group and test_group in by_group:
        train = sorted(by_group[train_group])
        test = sorted(by_group[test_group])
        val = sorted(by_group.get(groups.get("val", ""), []))
        left_out = sorted(set(dataset.classes.tolist()) - set(train) - set(val) - set(test))
        if left_out:  # else silently in no split: neither trained on nor evaluated
            named = {g for c, g in dataset.class_groups.items() if c in set(left_out)}
            raise DataError(
                f"dataset {dataset.name!r}: {len(left_out)} class(es) (e.g. {left_out[:5]}) are in no "
                f"split group (theirs: {sorted(named) or 'none'}; the split reads "
                f"{sorted({g for g in (train_group, test_group, groups.get('val')) if g})}): give every "
                "class a group, or no groups at all for the half/half split"
            )
        meta["method"] = f"default ({train_group} / {test_group})"
    elif dataset.meta.get("split_column"):  # a CSV's split column: never silently the halves
        found = ", ".join(repr(v) for v in dataset.meta["split_column"])
        lacking = " or ".join(f"{g!r} rows" + (" ('query'/'gallery' count as test)" if g == "test" else "")
                              for g in ("train", "test") if groups.get(g) not in by_group)
        raise DataError(
            f"dataset {dataset.name!r}: its split column has no {lacking} (values found: {found}); "
            "mark the classes to train on 'train' and those to test on 'test', or drop the split "
            "column (first / second half of the classes), or choose another split (data.split.kind)"
        )
    else:
        half = split_classes(dataset.classes.tolist(), (1, 0, 1))
        train, val, test = list(half.train), [], list(half.test)
        meta["method"] = "default (first half / second half of the class order)"
    if val_fraction > 0:
        if val:
            raise ConfigError(
                f"dataset {dataset.name!r} already defines validation classes; use val_fraction=0"
            )
        ordered = _ordered(train, order, seed).tolist()
        n_val = max(1, int(round(val_fraction * len(ordered))))
        if n_val >= len(ordered):
            raise ConfigError(f"val_fraction={val_fraction} leaves no training classes")
        val = sorted(ordered[len(ordered) - n_val:])
        train = sorted(ordered[: len(ordered) - n_val])
        meta.update({"val_fraction": val_fraction, "order": order, "seed": seed})
    return ClassSplit(train=train, val=val, test=test, meta=meta)
