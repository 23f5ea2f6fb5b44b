"""``train()``: one call from a config to a complete run directory.

:func:`train` opens the run directory (or checks that a resumed one fits the config), builds
the datasets from ``config.data`` unless the caller passes them (the protocol passes its
cross-validation folds), runs a :class:`~dmlkit.training.loop.Trainer`, then embeds the test
classes with the best checkpoint. It writes the same run directory as ``dmlkit train``::

    config.yaml, provenance.json, split.json (datasets from the config), log.jsonl,
    checkpoints/{last,best}.pt, embeddings/test.npz, metrics.json

The builders live in :mod:`dmlkit.training.builders`, the loop in :mod:`dmlkit.training.loop`,
checkpoints and resume checks in :mod:`dmlkit.training.checkpoint` and inference in
:mod:`dmlkit.embeddings`; their public names stay importable from here.
"""

from __future__ import annotations

import json
import logging
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dmlkit.config import ExperimentConfig, config_from_dict, dump_config
from dmlkit.embeddings import (
    HeadOnly,
    InferenceOptions,
    dataset_rows,
    embed_model,
    embed_split,
    resolve_device,
    save_embeddings,
)
from dmlkit.embeddings import trunk_features as _trunk_features
from dmlkit.exceptions import CheckpointError, ConfigError, DataError
from dmlkit.metrics import evaluate
from dmlkit.training.builders import (
    UnusedParametersWarning,
    build_datasets,
    build_loss,
    build_miner,
    build_model,
    build_optimizer,
    build_split,
)
from dmlkit.training.checkpoint import (
    RESUMABLE_CHANGES,
    check_resumable,
    find_checkpoint,
    load_checkpoint,
    read_checkpoint,
    sweep_orphan_temporaries,
)
from dmlkit.training.loop import Trainer, TrainState, scalar_metrics
from dmlkit.utils import atomic_write_json, provenance, seed_everything

__all__ = [
    "RESUMABLE_CHANGES",
    "TrainResult",
    "UnusedParametersWarning",
    "build_datasets",
    "build_loss",
    "build_miner",
    "build_model",
    "build_optimizer",
    "build_split",
    "dataset_rows",
    "embed_run",
    "embed_split",
    "evaluate_test_set",
    "open_run_dir",
    "train",
]

logger = logging.getLogger("dmlkit.training")



@dataclass
class TrainResult:
    """What :func:`train` returns (everything is also on disk in ``run_dir``)."""

    run_dir: Path
    best_checkpoint: Path
    best_step: int
    val_metrics: dict[str, float]
    history: list[dict[str, Any]]
    test_metrics: dict[str, float] | None = None
    last_checkpoint: Path | None = None
    epochs_completed: int = 0
    steps: int = 0
    stop_reason: str = "epochs"
    train_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)
    #: metrics of the model at step 0 (untrained / pretrained-only), per split
    baseline: dict[str, dict[str, float]] = field(default_factory=dict)

    @classmethod
    def from_state(cls, trainer: Trainer, state: TrainState) -> TrainResult:
        return cls(
            run_dir=trainer.run_dir, best_checkpoint=trainer.best_path, best_step=int(state.best_step),
            val_metrics=dict(state.best_metrics), history=list(state.history),
            last_checkpoint=trainer.last_path, epochs_completed=state.epoch, steps=state.step,
            stop_reason=str(state.stop_reason), train_seconds=float(state.elapsed),
        )


def open_run_dir(run_dir: Path, config: ExperimentConfig, resume: bool) -> dict[str, Any] | None:
    """Create (or reopen, with ``resume``) a run directory; returns the ``last.pt`` payload to resume.

    Writes ``config.yaml`` and, once, ``provenance.json``. Refuses to overwrite an existing
    run, to resume a missing one, or to resume with a config that changes the training.
    """
    last_path = run_dir / "checkpoints" / "last.pt"
    payload: dict[str, Any] | None = None
    if resume:
        sweep_orphan_temporaries(run_dir)  # left by a kill during an atomic write
        if not last_path.exists():
            raise CheckpointError(f"nothing to resume: {last_path} does not exist; run without --resume to start")
        payload = read_checkpoint(last_path)
        check_resumable(payload["config"], config)
    elif last_path.exists():
        raise CheckpointError(
            f"{run_dir} already holds a run ({last_path}): pass --resume (resume=True) to continue "
            "it, or choose another run directory"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(config, run_dir / "config.yaml")
    if payload is None or not (run_dir / "provenance.json").exists():
        atomic_write_json(run_dir / "provenance.json", provenance(config.seed, extra={"run_dir": str(run_dir)}))
    return payload


def evaluate_baseline(trainer: Trainer, test_set) -> dict[str, dict[str, float]]:
    """The model as it starts (untrained, or pretrained trunk + fresh head) on validation and
    test: the number training has to beat. Computed at step 0 without touching any random
    state, so training is the same with or without it; written to ``baseline.json``."""
    config = trainer.config
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
           torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    out: dict[str, dict[str, float]] = {}
    try:
        val = trainer.val_metrics()  # the validation path training uses (cached features)
        if val is not None:
            out["val"] = val
        if test_set is not None and len(np.unique(np.asarray(test_set.labels))) >= 2:
            emb, lab = embed_model(trainer.model, test_set, trainer.options, progress=False)
            out["test"] = scalar_metrics(evaluate(emb, lab, metrics=list(config.training.eval_metrics),
                                                  **config.evaluation.metric_options()))
    finally:
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        if rng[3] is not None:
            torch.cuda.set_rng_state_all(rng[3])
    return out


def baseline_warnings(baseline: dict[str, dict[str, float]], trained: dict[str, dict[str, float] | None]) -> list[str]:
    """One line per split where the trained model's MAP@R is not above the step-0 model's."""
    lines = []
    for split, base in baseline.items():
        now = trained.get(split) or {}
        if "map_at_r" in base and "map_at_r" in now and now["map_at_r"] <= base["map_at_r"]:
            lines.append(f"training did not beat the untrained model on {split}: MAP@R "
                         f"{100 * now['map_at_r']:.2f} after training vs {100 * base['map_at_r']:.2f} "
                         "at step 0; check the learning rate, the loss settings and the data")
    return lines


def evaluate_test_set(trainer: Trainer, test_set) -> dict[str, float]:
    """Embed ``test_set`` with the best checkpoint, write ``embeddings/test.npz``, return its metrics."""
    config = trainer.config
    trainer.model.load_state_dict(read_checkpoint(trainer.best_path)["model"])
    emb, lab = embed_model(trainer.model, test_set, trainer.options, progress=trainer.progress)
    metrics = scalar_metrics(evaluate(emb, lab, metrics=list(config.training.eval_metrics),
                                      **config.evaluation.metric_options()))
    save_embeddings(trainer.run_dir / "embeddings" / "test.npz", emb, lab, indices=dataset_rows(test_set))
    return metrics


def train(
    config: ExperimentConfig | dict[str, Any],
    run_dir: str | Path,
    *,
    train_set=None,
    val_set=None,
    test_set=None,
    resume: bool = False,
    progress: bool = True,
    data_root: str | Path | None = None,
) -> TrainResult:
    """Train the model a config describes; write the run directory; return a :class:`TrainResult`.

    Args:
        config: an :class:`ExperimentConfig` (or a plain dict validated into one).
        run_dir: where config, logs, checkpoints, split, embeddings and metrics go.
        train_set, val_set, test_set: explicit datasets (e.g. the protocol's cross-validation
            folds, already transformed). By default all three come from ``config.data`` and
            the class split is written to ``split.json``. The test set is never used for model
            selection: after training the best checkpoint embeds it, writes
            ``embeddings/test.npz`` and adds test metrics to ``metrics.json``.
        resume: continue from ``run_dir/checkpoints/last.pt`` (bit-exact on CPU).
        progress: show progress bars and log the run's shape.
        data_root: where the datasets are (``--data-root``); recorded as ``data.root`` in
            ``config.yaml`` so that ``dmlkit embed``/``dmlkit report`` find them again.
    """
    if not isinstance(config, ExperimentConfig):
        config = config_from_dict(config)
    if data_root is not None:
        config = config.override({"data.root": str(data_root)})
    run_dir = Path(run_dir)
    payload = open_run_dir(run_dir, config, resume)

    device = resolve_device(config.training.device)
    seed_everything(config.seed)
    if train_set is None:
        sets = build_datasets(config, ("train", "val", "test"))
        sets["split"].to_json(run_dir / "split.json")
        train_set = sets["train"]
        val_set = sets["val"] if val_set is None else val_set
        test_set = sets["test"] if test_set is None else test_set
    if progress:
        logger.info("%s: %d train samples / %d classes, %d val classes, %d test classes -> %s",
                    config.name, 0 if train_set is None else len(train_set),
                    0 if train_set is None else len(np.unique(train_set.labels)),
                    0 if val_set is None else len(np.unique(val_set.labels)),
                    0 if test_set is None else len(np.unique(test_set.labels)), run_dir)
    trainer = Trainer(config, run_dir, train_set, val_set, device=device, progress=progress)
    if test_set is not None:
        seen = trainer.train_classes
        if trainer.val_input is not None:
            seen = np.union1d(seen, val_set.labels)
        if np.intersect1d(test_set.labels, seen).size:
            warnings.warn("test classes overlap the training/validation classes: the test "
                          "metrics are not those of unseen classes", stacklevel=2)
    baseline_path = run_dir / "baseline.json"
    if payload is not None:
        trainer.restore(payload)
        baseline = json.loads(baseline_path.read_text()) if baseline_path.exists() else {}
    else:  # step 0: the number to beat (untrained or pretrained-only), before any update
        baseline = evaluate_baseline(trainer, test_set)
        atomic_write_json(baseline_path, baseline)
    state = trainer.fit()

    result = TrainResult.from_state(trainer, state)
    metrics_out: dict[str, Any] = {"best_step": result.best_step, "best_epoch": int(state.best_epoch),
                                   "val": result.val_metrics}
    if test_set is not None:
        result.test_metrics = metrics_out["test"] = evaluate_test_set(trainer, test_set)
    metrics_out["baseline"] = result.baseline = baseline
    for line in baseline_warnings(baseline, {"val": result.val_metrics, "test": result.test_metrics}):
        warnings.warn(line, stacklevel=2)
    atomic_write_json(run_dir / "metrics.json", metrics_out)
    return result



def embed_run(
    checkpoint: str | Path,
    split: str = "test",
    *,
    output: str | Path | None = None,
    data_root: str | Path | None = None,
    device: str = "auto",
    progress: bool = False,
) -> tuple[Path, np.ndarray, np.ndarray, ExperimentConfig]:
    """Embed one split of a trained run with its best checkpoint (``dmlkit embed``).

    The datasets come from the checkpoint's config (the training split gets the evaluation
    transform, no augmentation). Writes ``output`` (default ``RUN_DIR/embeddings/<split>.npz``,
    with the dataset rows as ``indices``) and returns ``(path, embeddings, labels, config)``.
    """
    if split not in ("train", "val", "test"):
        raise ConfigError(f"the split must be train, val or test, got {split!r}")
    ckpt = find_checkpoint(checkpoint)
    model, config = load_checkpoint(ckpt)
    dataset = build_datasets(config, (split,), data_root=data_root, augment_train=False)[split]
    if dataset is None:
        raise DataError(f"the config's class split has no {split} classes")
    emb, labels = embed_split(model, dataset, config, device, progress=progress)
    if output is None:
        run = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent
        output = run / "embeddings" / f"{split}.npz"
    path = save_embeddings(output, emb, labels, indices=dataset_rows(dataset))
    return path, emb, labels, config


def __getattr__(name: str) -> Any:
    """Deprecation shim for the frozen-trunk helpers that moved to :mod:`dmlkit.embeddings`."""
    if name not in ("trunk_features", "_HeadOnly"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"dmlkit.training.trainer.{name} moved to dmlkit.embeddings "
                  "(trunk_features(model, dataset, InferenceOptions), HeadOnly)",
                  DeprecationWarning, stacklevel=2)
    if name == "_HeadOnly":
        return HeadOnly

    def trunk_features(model, dataset, config: ExperimentConfig, device, progress: bool = False):
        return _trunk_features(model, dataset, InferenceOptions.from_config(config, device), progress)

    return trunk_features
