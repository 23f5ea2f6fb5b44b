"""What the ranks of one ``torchrun`` job must share before training: the config and the data.

Each rank reads its own config file and its own data root: per-machine paths may differ
(``docs/distributed.md``), what they hold may not. A rank whose copy of the data lacks an image
or holds another one builds its sampler from its own labels and embeds its shard of the test
split from its own files, so the job's ``metrics.json`` mixed two datasets without a word.
:func:`check_same_config_on_ranks` compares the configs without their per-machine paths, and
:func:`check_same_data` what each rank loaded, split by split
(:meth:`dmlkit.data.base.MetricDataset.portable_fingerprint`: rows, labels, class names, file
paths relative to the data and their sizes; no image is read). Either mismatch is one error line,
raised on every rank, before anything trains.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import numpy as np

from dmlkit.config import ExperimentConfig
from dmlkit.distributed import check_same_config, context, mark_every_rank, ranks_by_value
from dmlkit.exceptions import ConfigError, DataError

__all__ = ["check_same_config_on_ranks", "check_same_data", "same_everywhere", "split_summary"]

#: Config keys that may differ between the ranks of one job: per-machine paths.
PER_MACHINE_KEYS = (("data", "root"), ("model", "feature_cache_dir"))

#: ``(samples, classes, portable fingerprint)`` of one split, ``None`` for a split without samples.
Summary = tuple[int, int, str] | None


def same_everywhere(config: ExperimentConfig) -> dict[str, Any]:
    """The part of ``config`` every rank must share (all but :data:`PER_MACHINE_KEYS`)."""
    data = config.model_dump(mode="json")
    for section, key in PER_MACHINE_KEYS:
        data.get(section, {}).pop(key, None)
    return data


def check_same_config_on_ranks(config: ExperimentConfig) -> None:
    """Refuse ranks started with different configs (per-machine paths aside): one
    :class:`ConfigError` on every rank, printed once by rank 0."""
    try:
        check_same_config(same_everywhere(config))
    except ConfigError as exc:
        raise mark_every_rank(exc) from None


def split_summary(dataset: Any) -> Summary:
    """``(samples, classes, fingerprint)`` of a split, the same on every copy of the data.

    A :class:`~dmlkit.data.base.MetricDataset` gives its portable fingerprint; another dataset
    (a caller's own, with ``labels``) the digest of its labels."""
    if dataset is None:
        return None
    labels = np.asarray(dataset.labels)
    portable = getattr(dataset, "portable_fingerprint", None)
    digest = portable() if portable is not None else hashlib.sha256(
        labels.astype(np.int64).tobytes()).hexdigest()[:32]
    return len(dataset), int(np.unique(labels).size), digest


def check_same_data(sets: Mapping[str, Any]) -> None:
    """Refuse to train when the ranks loaded different data: ``sets`` maps a split's name to its
    dataset (or ``None``). Every rank all-gathers the :func:`split_summary` of each split (one
    collective); a mismatch is one :class:`DataError` on every rank naming each split that
    differs and what each rank holds. A no-op for one process."""
    if not context().enabled:
        return
    names = list(sets)
    groups = ranks_by_value(tuple(split_summary(sets[name]) for name in names))
    if len(groups) == 1:
        return
    differing = []
    for i, name in enumerate(names):
        held: dict[Summary, list[int]] = {}
        for summaries, ranks in groups.items():
            held.setdefault(summaries[i], []).extend(ranks)
        if len(held) > 1:
            differing.append(f"{name} split: " + ", ".join(
                _holding(sorted(ranks), summary) for summary, ranks in held.items()))
    raise mark_every_rank(DataError(
        f"the ranks loaded different data ({'; '.join(differing)}): every rank must read an "
        "identical copy of the dataset (its --data-root / data.root / $DMLKIT_DATA may differ "
        "between machines, what is under it may not); copy the data again where it differs"))


def _holding(ranks: list[int], summary: Summary) -> str:
    """``ranks 0, 2: 24 samples of 4 classes (digest 9f8e7d6c5b4a)``."""
    who = f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    if summary is None:
        return f"{who}: no samples"
    samples, classes, digest = summary
    return f"{who}: {samples} samples of {classes} classes (digest {digest[:12]})"
