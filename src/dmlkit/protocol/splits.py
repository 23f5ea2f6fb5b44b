"""Class splits and class-disjoint cross-validation folds of the fair protocol.

* ``halves`` (Musgrave et al. 2020, section 4.2): the first half of the classes (in the chosen
  order) is used for cross-validation, the second half is the test set. The development
  classes are cut into ``k`` contiguous, deterministic blocks: with ``k = 4`` the first
  0-12.5 % of all classes form partition 1, 12.5-25 % partition 2, and so on. Fold ``f``
  trains on the other ``k - 1`` blocks and validates on block ``f``.
* ``ratio_4_1_5`` (Oi, Kawakami & Naemura, seed 004): train / validation / test = 4:1:5 of
  the classes, one fixed split (one "fold").

Either can use the dataset's default class order or a random order drawn from a seeded
generator (seed 004 shows the default order biases results: related classes sit together).

The test classes never reach the search: :class:`TestClassGuard` checks every dataset handed
to training during the search and raises :class:`TestSetLeakError` if it holds a test class.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dmlkit.data.splits import ClassSplit, kfold_class_partitions, split_classes
from dmlkit.exceptions import ConfigError, DataError

__all__ = [
    "BenchSplit",
    "Fold",
    "TestClassGuard",
    "TestSetLeakError",
    "make_bench_split",
    "order_classes",
]


class TestSetLeakError(DataError):
    """A test class reached a stage that must not see it (search or model selection)."""

    __test__ = False  # not a pytest class


@dataclass(frozen=True)
class Fold:
    """One cross-validation fold: train on ``train`` classes, select models on ``val`` classes."""

    index: int
    train: tuple[int, ...]
    val: tuple[int, ...]


@dataclass(frozen=True)
class BenchSplit:
    """Development (cross-validation) classes, their folds, and the held-out test classes."""

    kind: str
    order: str
    order_seed: int
    dev: tuple[int, ...]
    test: tuple[int, ...]
    folds: tuple[Fold, ...]
    class_order: tuple[int, ...] = field(repr=False, compare=False, default=())

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "order": self.order,
            "order_seed": self.order_seed,
            "dev": list(self.dev),
            "test": list(self.test),
            "folds": [{"index": f.index, "train": list(f.train), "val": list(f.val)} for f in self.folds],
            "class_order": list(self.class_order),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchSplit:
        return cls(
            kind=data["kind"], order=data["order"], order_seed=int(data["order_seed"]),
            dev=tuple(int(c) for c in data["dev"]), test=tuple(int(c) for c in data["test"]),
            folds=tuple(Fold(int(f["index"]), tuple(map(int, f["train"])), tuple(map(int, f["val"])))
                        for f in data["folds"]),
            class_order=tuple(int(c) for c in data.get("class_order", ())),
        )

    def class_split(self):
        """The :class:`dmlkit.data.ClassSplit` (train = development classes) with the folds in
        its ``meta``, as written to ``split.json``."""
        if self.kind == "ratio_4_1_5":
            f = self.folds[0]
            return ClassSplit(train=f.train, val=f.val, test=self.test, meta=self.to_dict())
        return ClassSplit(train=self.dev, val=(), test=self.test, meta=self.to_dict())


def order_classes(classes: Iterable[int], order: str = "default", seed: int = 0) -> list[int]:
    """``classes`` sorted (the dataset's default order) or in a seeded random permutation.

    The random order is ``numpy.random.default_rng(seed).permutation`` of the sorted ids, the
    same order :func:`dmlkit.data.split_classes` uses.
    """
    ordered = sorted(int(c) for c in classes)
    if order == "default":
        return ordered
    if order == "random":
        rng = np.random.default_rng(seed)
        return [ordered[i] for i in rng.permutation(len(ordered))]
    raise ConfigError(f"class order must be 'default' or 'random', got {order!r}")


def make_bench_split(
    classes: Iterable[int],
    kind: str = "halves",
    *,
    order: str = "default",
    seed: int = 0,
    folds: int = 4,
    num_classes: int | None = None,
    default_dev: Iterable[int] | None = None,
) -> BenchSplit:
    """The protocol's split of ``classes`` (ids).

    ``num_classes`` keeps only the first ``num_classes`` classes of the chosen order (quick
    presets). ``halves``: dev = the first half (:func:`dmlkit.data.split_classes` with ratios
    1:1), test = the rest, and ``folds`` contiguous blocks of dev in the chosen order
    (:func:`dmlkit.data.kfold_class_partitions`). ``ratio_4_1_5``: 40 % train, 10 %
    validation, 50 % test, one fold.
    """
    ordered = order_classes(classes, order, seed)
    if num_classes is not None:
        if num_classes > len(ordered):
            raise ConfigError(f"protocol.num_classes = {num_classes} but the dataset has {len(ordered)} classes")
        ordered = ordered[:num_classes]
    n = len(ordered)
    # ``ordered`` is already in the chosen order: cut it as given
    if kind == "default":
        if default_dev is None:
            raise ConfigError("split 'default' needs the dataset's training classes (default_dev)")
        dev_set = {int(c) for c in default_dev}
        dev = [c for c in ordered if c in dev_set]
        test = [c for c in ordered if c not in dev_set]
        if len(dev) < 2 * folds or not test:
            raise DataError(f"the default split leaves {len(dev)} training / {len(test)} test classes: "
                            f"too few for {folds} folds")
        blocks = kfold_class_partitions(dev, folds)
        fold_list = tuple(
            Fold(i, tuple(c for j, b in enumerate(blocks) if j != i for c in b), tuple(blocks[i]))
            for i in range(folds)
        )
    elif kind == "halves":
        parts = split_classes(ordered, (1, 0, 1), order="default")
        dev_set = set(parts.train)
        dev = [c for c in ordered if c in dev_set]
        test = [c for c in ordered if c not in dev_set]
        if len(dev) < 2 * folds:  # the larger half of an odd count is the development half
            raise DataError(
                f"{n} classes give {len(dev)} cross-validation classes: too few for {folds} folds "
                "(need at least 2 classes per fold); use more classes or fewer folds"
            )
        blocks = kfold_class_partitions(dev, folds)
        fold_list = tuple(
            Fold(i, tuple(c for j, b in enumerate(blocks) if j != i for c in b), tuple(blocks[i]))
            for i in range(folds)
        )
    elif kind == "ratio_4_1_5":
        if folds != 1:
            raise ConfigError("split 'ratio_4_1_5' is one fixed split: folds must be 1")
        parts = split_classes(ordered, (4, 1, 5), order="default")
        if len(parts.train) < 2 or len(parts.val) < 2 or len(parts.test) < 2:
            raise DataError(f"{n} classes are too few for a 4:1:5 split (need >= 2 per part)")
        rank = {c: i for i, c in enumerate(ordered)}
        train = sorted(parts.train, key=rank.__getitem__)
        val = sorted(parts.val, key=rank.__getitem__)
        test = sorted(parts.test, key=rank.__getitem__)
        dev = train + val
        fold_list = (Fold(0, tuple(train), tuple(val)),)
    else:
        raise ConfigError(f"unknown split {kind!r}: use 'halves', 'default' or 'ratio_4_1_5'")
    return BenchSplit(
        kind=kind, order=order, order_seed=seed, dev=tuple(dev), test=tuple(test),
        folds=fold_list, class_order=tuple(ordered),
    )


class TestClassGuard:
    """Refuses any dataset that contains a test class (used on everything the search touches)."""

    __test__ = False

    def __init__(self, test_classes: Iterable[int]):
        self.test_classes = frozenset(int(c) for c in test_classes)

    def check_labels(self, labels: Any, where: str) -> None:
        present = set(np.unique(np.asarray(labels)).tolist())
        leaked = present & self.test_classes
        if leaked:
            shown = sorted(leaked)[:10]
            raise TestSetLeakError(
                f"{where} holds {len(leaked)} test class(es) (e.g. {shown}): the test split must not "
                "be used before the final evaluation"
            )

    def check(self, dataset: Any, where: str) -> Any:
        """Return ``dataset`` unchanged after checking its labels; raise if a test class is in it."""
        if dataset is None:
            return dataset
        self.check_labels(dataset.labels, where)
        return dataset
