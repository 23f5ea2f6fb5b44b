"""One run directory, one run: its data, its checkpoints and its outputs belong together.

``dmlkit train --resume``, ``dmlkit embed`` and ``dmlkit report`` read a run directory as one
whole, but its parts can come apart, and each mix was silent:

* ``data.root`` may change on resume (a moved copy of the data is legitimate), so a resume
  pointed at another dataset rewrote ``split.json``, trained its next epochs on the other data
  and compared them with a baseline of the first;
* ``dmlkit embed RUN --data-root OTHER`` replaced ``RUN/embeddings/test.npz`` (the file
  ``metrics.json`` describes) by embeddings of other images;
* a ``best.pt`` copied in from another run was drawn by ``dmlkit report`` beside this run's
  ``metrics.json``.

So ``split.json`` records, per split, the portable fingerprint of the data the run started on
(:func:`recording_data`; :meth:`dmlkit.data.base.MetricDataset.portable_fingerprint`: rows,
labels, class names, file paths relative to the data and their sizes: the same for a moved
copy). A resume applies the run's own split and compares the data with that record
(:func:`check_resumed_data`); ``embed`` writes no embeddings of other data into the run
(:func:`refuse_other_data_in_run`); a checkpoint whose config is not the run's ``config.yaml``,
or a ``best.pt`` of another step than ``metrics.json``'s best, is refused
(:func:`load_run_checkpoint`). A run written before the record existed is compared by its
split's class names alone (:meth:`dmlkit.data.ClassSplit.check`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dmlkit.config import ExperimentConfig, load_config
from dmlkit.data import ClassSplit
from dmlkit.distributed import mark_every_rank
from dmlkit.exceptions import CheckpointError, ConfigError, DataError
from dmlkit.training.checkpoint import (
    find_checkpoint,
    model_from_payload,
    read_checkpoint,
    training_changes,
)
from dmlkit.training.same_inputs import split_summary
from dmlkit.utils import read_json_object

__all__ = ["FINGERPRINTS", "check_checkpoint_of_run", "check_resumed_data", "data_differences",
           "default_embeddings_name", "load_run_checkpoint", "read_run_split", "recording_data",
           "refuse_other_data_in_run", "refuse_replacing_run_test_embeddings", "run_dir_of",
           "with_run_split"]

#: The key of ``split.json``'s ``meta`` that records the data the run started on:
#: ``{split: {"samples", "classes", "fingerprint"} or null}``.
FINGERPRINTS = "fingerprints"


def run_dir_of(checkpoint: str | Path) -> Path:
    """The run directory of a checkpoint file (``RUN_DIR/checkpoints/best.pt``, or a file beside
    the run's files)."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else checkpoint.parent


def with_run_split(config: ExperimentConfig, run_dir: str | Path) -> ExperimentConfig:
    """``config`` reading its classes from the run's own ``split.json`` when it has one: the
    classes the run was trained and tested on. A bench's final run trains on its fold's classes,
    which its config's ``data.split`` (the dataset's default) does not describe: the report of
    such a run embedded the dataset's published test split instead of the bench's."""
    split = Path(run_dir) / "split.json"
    if not split.is_file():
        return config
    return config.override([f"data.split={{kind: file, path: {json.dumps(str(split.resolve()))}}}"])


def read_run_split(run_dir: str | Path) -> ClassSplit | None:
    """The run's ``split.json`` (``None`` when it has none); a damaged one is a :class:`DataError`."""
    path = Path(run_dir) / "split.json"
    return ClassSplit.from_json(path) if path.is_file() else None


def _record(summary: Any) -> dict[str, Any] | None:
    """A :func:`split_summary` as ``split.json`` stores it."""
    if summary is None:
        return None
    samples, classes, digest = summary
    return {"samples": samples, "classes": classes, "fingerprint": digest}


def recording_data(split: ClassSplit, sets: Mapping[str, Any]) -> ClassSplit:
    """``split`` with the data of ``sets`` (split name -> dataset or ``None``: those the run
    trains and tests on) recorded in its ``meta`` under :data:`FINGERPRINTS`."""
    record = {name: _record(split_summary(dataset)) for name, dataset in sets.items()}
    return ClassSplit(split.train, split.val, split.test, meta={**split.meta, FINGERPRINTS: record})


def _described(record: Any) -> str:
    """``24 samples of 6 classes (fingerprint 9f8e7d6c5b4a)``, or ``no samples``."""
    if not isinstance(record, dict):
        return "no samples"
    return (f"{record.get('samples')} samples of {record.get('classes')} classes "
            f"(fingerprint {str(record.get('fingerprint'))[:12]})")


def data_differences(split: ClassSplit | None, sets: Mapping[str, Any]) -> list[str]:
    """One ``"test split: ... recorded, ... now"`` per dataset of ``sets`` (split name ->
    dataset or ``None``) that is not what ``split`` (a run's ``split.json``) recorded; empty
    when they agree, or when nothing was recorded (no split.json, a run from before the record)."""
    recorded = split.meta.get(FINGERPRINTS) if split is not None else None
    if not isinstance(recorded, dict):
        return []
    out = []
    for name, dataset in sets.items():
        if name not in recorded:
            continue
        now = _record(split_summary(dataset))
        if now != recorded[name]:
            out.append(f"{name} split: {_described(recorded[name])} when the run started, "
                       f"{_described(now)} now")
    return out


def check_resumed_data(run_dir: Path, split: ClassSplit, sets: Mapping[str, Any], root: Any) -> None:
    """Refuse to resume ``run_dir`` on other data than it started on (``split``: its
    ``split.json``; ``sets``: the datasets the resume would train and test on, read from
    ``root``): one :class:`DataError` on every rank, before the run directory is touched. A
    moved copy of the data has the same fingerprints and resumes."""
    differences = data_differences(split, sets)
    if differences:
        raise mark_every_rank(DataError(
            f"cannot resume {run_dir}: the data under {root} are not those the run was trained on "
            f"({'; '.join(differences)}): resume with the run's own data (a moved copy is fine: "
            "--data-root or data.root naming it), or start a new run directory"))


def refuse_other_data_in_run(output: Path, checkpoint: Path, split: str, differences: list[str]) -> None:
    """Refuse to write embeddings of other data than the run's (``differences``:
    :func:`data_differences` of the embedded split) into the run directory of ``checkpoint``,
    where they would pass for the run's own (``embeddings/test.npz`` is what ``metrics.json``
    describes). Written elsewhere (``-o``) they are fine."""
    run_dir = run_dir_of(checkpoint).resolve()
    if not differences or not Path(output).resolve().is_relative_to(run_dir):
        return
    raise mark_every_rank(DataError(
        f"the {split} split read now is not the data {run_dir} was trained on "
        f"({'; '.join(differences)}): refusing to write its embeddings {output} into the run "
        "directory, where they would pass for the run's own; pass -o to a file outside the run to "
        "embed these data, or --data-root the run's own data (a moved copy is fine)"))


def check_checkpoint_of_run(checkpoint: Path, payload: Mapping[str, Any]) -> None:
    """Refuse a checkpoint inside a run directory that is not that run's: its config trains
    otherwise than the run's ``config.yaml`` (:func:`training_changes`: the keys a resume may
    change aside), or it is the run's ``checkpoints/best.pt`` but holds another step than the
    ``best_step`` of ``metrics.json``. One :class:`CheckpointError` naming the first difference.
    A checkpoint outside a run (no ``config.yaml`` beside it) is not compared."""
    run_dir = run_dir_of(checkpoint)
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        return
    changed = training_changes(payload["config"], load_config(config_file), source=str(checkpoint))
    if changed:
        more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
        raise CheckpointError(
            f"{checkpoint} is not a checkpoint of the run {run_dir}: its config differs from the "
            f"run's config.yaml in {changed[0]}{more} (checkpoint -> config.yaml); "
            "it came from another run: put the run's own checkpoints back, or pass the checkpoint "
            "file from outside the run directory")
    metrics_file = run_dir / "metrics.json"
    if checkpoint.name != "best.pt" or checkpoint.parent.name != "checkpoints" or not metrics_file.is_file():
        return
    best_step = read_json_object(metrics_file, "metrics.json of dmlkit train").get("best_step")
    if isinstance(best_step, int) and not isinstance(best_step, bool) and best_step != int(payload["step"]):
        raise CheckpointError(
            f"{checkpoint} holds the model of step {int(payload['step'])} but {metrics_file} describes "
            f"the best model of step {best_step}: the two come from different runs or attempts; put "
            "the run's own best.pt back (or train the run again)")


def load_run_checkpoint(path: str | Path, device: str = "cpu") -> tuple[Path, Any, ExperimentConfig]:
    """``(checkpoint file, model in eval mode, config)`` of a checkpoint file or a run directory's
    best one (:func:`~dmlkit.training.checkpoint.find_checkpoint`), refused when it is not its
    run directory's (:func:`check_checkpoint_of_run`)."""
    found = find_checkpoint(path)
    payload = read_checkpoint(found)
    check_checkpoint_of_run(found, payload)
    model, config = model_from_payload(payload, found, device)
    return found, model, config


def refuse_replacing_run_test_embeddings(output: Path, checkpoint: Path, split: str) -> None:
    """Refuse ``-o RUN/embeddings/test.npz`` (what ``metrics.json`` describes, and ``compare``/
    ``report`` read) for another split or checkpoint than the test split of ``best.pt``."""
    run_dir = run_dir_of(checkpoint)
    if ((split, checkpoint.name) == ("test", "best.pt") or not (run_dir / "metrics.json").is_file()
            or output.resolve() != (run_dir / "embeddings" / "test.npz").resolve()):
        return
    raise mark_every_rank(ConfigError(
        f"--output {output} is the run's own test embeddings (of checkpoints/best.pt, described by "
        f"{run_dir / 'metrics.json'}): refusing to write the {split} split of {checkpoint.name} over "
        f"it; leave out -o (writes embeddings/{default_embeddings_name(checkpoint, split)})"))


def default_embeddings_name(checkpoint: str | Path, split: str, suffix: str = ".npz") -> str:
    """The file ``dmlkit embed`` writes in ``RUN_DIR/embeddings`` without ``-o``.

    ``best.pt`` embeds as ``<split><suffix>`` (``test.npz``): the checkpoint training embedded
    the test classes with, so the file is the one ``metrics.json`` describes (same weights, same
    classes from ``split.json``, same evaluation transform). Any other checkpoint gets its own
    ``<split>-<stem><suffix>`` (``test-last.npz``): it never replaces the best checkpoint's
    embeddings that ``dmlkit evaluate``/``compare``/``report`` read beside ``metrics.json``.
    """
    stem = Path(checkpoint).stem
    return f"{split}{suffix}" if Path(checkpoint).name == "best.pt" else f"{split}-{stem}{suffix}"
