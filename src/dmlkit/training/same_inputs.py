"""What the ranks of one ``torchrun`` job must share: the config, the data, the checkpoint.

Each rank reads its own config file and its own data root: per-machine paths may differ
(``docs/distributed.md``), what they hold may not. A rank whose copy of the data lacks an image
or holds another one builds its sampler from its own labels and embeds its shard of the test
split from its own files, so the job's ``metrics.json`` mixed two datasets without a word.
:func:`check_same_config_on_ranks` compares the configs without their per-machine paths, and
:func:`check_same_data` what each rank loaded, split by split
(:meth:`dmlkit.data.base.MetricDataset.portable_fingerprint`: rows, labels, class names, file
paths relative to the data and their sizes; no image is read). Either mismatch is one error line,
raised on every rank, before anything trains. ``dmlkit embed`` compares the checkpoint each rank
loaded (:func:`check_same_checkpoint`) and the split; ``dmlkit evaluate`` its options and inputs,
through :func:`differences_across_ranks`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from dmlkit.config import ExperimentConfig
from dmlkit.distributed import check_same_config, context, mark_every_rank, ranks_by_value
from dmlkit.exceptions import ConfigError, DataError
from dmlkit.utils import sha256_file

__all__ = ["check_same_checkpoint", "check_same_config_on_ranks", "check_same_data",
           "differences_across_ranks", "same_everywhere", "split_summary"]

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


def differences_across_ranks(values: Mapping[str, Hashable],
                             describe: Callable[[Any], str] = str) -> dict[str, str]:
    """``{name: "rank 0: ..., ranks 1, 2: ..."}`` for each entry of ``values`` (this rank's
    picklable, hashable values by name: the same names on every rank) that differs between
    ranks, each value as ``describe`` writes it; empty when the ranks agree, and for one process.
    One collective (:func:`dmlkit.distributed.ranks_by_value`)."""
    if not context().enabled:
        return {}
    names = list(values)
    groups = ranks_by_value(tuple(values[name] for name in names))
    if len(groups) == 1:
        return {}
    differing = {}
    for i, name in enumerate(names):
        held: dict[Any, list[int]] = {}
        for gathered, ranks in groups.items():
            held.setdefault(gathered[i], []).extend(ranks)
        if len(held) > 1:
            differing[name] = ", ".join(f"{_who(sorted(ranks))}: {describe(value)}" for value, ranks in held.items())
    return differing


def check_same_data(sets: Mapping[str, Any]) -> None:
    """Refuse to train when the ranks loaded different data: ``sets`` maps a split's name to its
    dataset (or ``None``). Every rank all-gathers the :func:`split_summary` of each split (one
    collective); a mismatch is one :class:`DataError` on every rank naming each split that
    differs and what each rank holds. A no-op for one process."""
    differing = differences_across_ranks({f"{name} split": split_summary(ds) for name, ds in sets.items()},
                                         _described)
    if not differing:
        return
    raise mark_every_rank(DataError(
        f"the ranks loaded different data ({'; '.join(f'{k}: {v}' for k, v in differing.items())}): every "
        "rank must read an identical copy of the dataset (its --data-root / data.root / $DMLKIT_DATA may "
        "differ between machines, what is under it may not); copy the data again where it differs"))


def check_same_checkpoint(path: str | Path) -> None:
    """Refuse ranks that loaded different checkpoint files (a stale ``best.pt`` on one machine
    mixed two models in one embeddings file): every rank compares the SHA-256 of the file it
    read (its weights and its config; copies of one file are byte-identical wherever they lie),
    one :class:`DataError` on every rank naming what each holds. A no-op for one process."""
    if not context().enabled:
        return
    differing = differences_across_ranks({"checkpoint": sha256_file(path)}, lambda digest: f"sha256 {digest[:12]}")
    if differing:
        raise mark_every_rank(DataError(
            f"the ranks loaded different checkpoints ({differing['checkpoint']}; rank {context().rank} read "
            f"{path}): every rank must read an identical copy of the checkpoint (its path may differ "
            "between machines); copy it again where it differs"))


def _who(ranks: list[int]) -> str:
    """``rank 1`` / ``ranks 0, 2``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _described(summary: Summary) -> str:
    """``24 samples of 4 classes (digest 9f8e7d6c5b4a)``, or ``no samples``."""
    if summary is None:
        return "no samples"
    samples, classes, digest = summary
    return f"{samples} samples of {classes} classes (digest {digest[:12]})"
