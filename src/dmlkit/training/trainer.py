"""``train()``: one call from a config to a complete run directory.

:func:`train` opens the run directory (or checks that a resumed one fits the config), builds
the datasets from ``config.data`` unless the caller passes them (the protocol passes its
cross-validation folds), runs a :class:`~dmlkit.training.loop.Trainer`, then embeds the test
classes with the best checkpoint. It writes the same run directory as ``dmlkit train``::

    config.yaml, provenance.json, split.json (datasets from the config), log.jsonl,
    checkpoints/{last,best}.pt, embeddings/test.npz, metrics.json (skipped.txt: the images
    data.options.skip_corrupt left out, with why)

Under ``torchrun`` (``WORLD_SIZE`` > 1) :func:`train` joins the process group itself, checks
that every rank got the same config and that the world size divides the global batch, and
lets rank 0 alone write the run directory; see ``docs/distributed.md``.

The builders live in :mod:`dmlkit.training.builders`, the loop in :mod:`dmlkit.training.loop`,
checkpoints and resume checks in :mod:`dmlkit.training.checkpoint`, what keeps a run
directory's data, checkpoints and embeddings one run's in :mod:`dmlkit.training.run_identity`
and inference in :mod:`dmlkit.embeddings`; their public names stay importable from here.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dmlkit.config import ExperimentConfig, config_from_dict, dump_config
from dmlkit.data.skipped import SKIPPED_FILE, holding_skip_warnings, record_skipped
from dmlkit.distributed import (
    agree,
    barrier,
    context,
    init_distributed,
    launched_by_torchrun,
    leaving_alone_on_failure,
    mark_every_rank,
    on_main,
    shutdown,
)
from dmlkit.embedding_shards import DEFAULT_SHARD_ROWS, ShardedEmbeddings, embed_to_shards
from dmlkit.embeddings import (
    HeadOnly,
    InferenceOptions,
    dataset_items,
    dataset_rows,
    embed_model,
    embed_sharded,
    embed_split,
    resolve_device,
    save_embeddings,
)
from dmlkit.embeddings import trunk_features as _trunk_features
from dmlkit.exceptions import CheckpointError, ConfigError, DataError
from dmlkit.provenance import write_provenance
from dmlkit.training.builders import (
    UnusedParametersWarning,
    build_datasets,
    build_loss,
    build_miner,
    build_model,
    build_optimizer,
    build_split,
    check_world_size,
)
from dmlkit.training.checkpoint import (
    RESUMABLE_CHANGES,
    check_resumable,
    read_checkpoint,
    refuse_fresh_start,
    sweep_orphan_temporaries,
)
from dmlkit.training.data_root import run_data_root, with_data_root
from dmlkit.training.loop import Trainer, TrainState
from dmlkit.training.preflight import preflight, refuse_degenerate_eval
from dmlkit.training.run_identity import (
    check_resumed_data,
    data_differences,
    default_embeddings_name,
    load_run_checkpoint,
    read_run_split,
    recording_data,
    refuse_other_data_in_run,
    refuse_replacing_run_test_embeddings,
    run_dir_of,
    with_run_split,
)
from dmlkit.training.same_inputs import (
    check_same_checkpoint,
    check_same_config_on_ranks,
    check_same_data,
)
from dmlkit.utils import (
    atomic_write_json,
    directory_lock,
    read_json_object,
    seed_everything,
)

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
    "with_run_split",
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
    #: full epochs trained (an epoch that ``max_steps`` cut short does not count)
    epochs_completed: int = 0
    steps: int = 0
    stop_reason: str = "epochs"
    #: ``max_steps`` stopped the run inside epoch ``epochs_completed + 1``
    partial_epoch: bool = False
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
            stop_reason=str(state.stop_reason or "epochs"), train_seconds=float(state.elapsed),
            partial_epoch=bool(state.partial_epoch),
        )


#: Written when a run ends: removed when it resumes (until then they would describe an older
#: best checkpoint than the one training moves to, and a report would mix the two).
_FINAL_OUTPUTS = ("metrics.json", "embeddings/test.npz")
#: Written from step 0 on: removed when a run starts afresh in a directory without a checkpoint
#: (left by an attempt killed before its first one; the log would interleave the two attempts).
_ATTEMPT_OUTPUTS = ("log.jsonl", "log.csv", "baseline.json", "checkpoints/best.pt", SKIPPED_FILE)
#: The lock file of a run directory: one ``train`` at a time.
_RUN_LOCK = "train.lock"


def open_run_dir(run_dir: Path, config: ExperimentConfig, resume: bool, *, world_size: int = 1,
                 allow_world_size_change: bool = False) -> dict[str, Any] | None:
    """Create (or reopen, with ``resume``) a run directory; returns the ``last.pt`` payload to resume.

    Writes ``config.yaml`` and, once, ``provenance.json``. Refuses to overwrite an existing
    run, to resume a missing one, to resume with a config that changes the training, or (unless
    ``allow_world_size_change``) to resume a checkpoint of another ``world_size``
    (:func:`check_world_size_change`): every refusal comes before any file is written or removed.
    Removes the outputs that would be stale: on resume :data:`_FINAL_OUTPUTS`, on a fresh start
    those and :data:`_ATTEMPT_OUTPUTS`.
    """
    last_path = run_dir / "checkpoints" / "last.pt"
    payload: dict[str, Any] | None = None
    if resume:
        if not last_path.exists():
            raise CheckpointError(f"nothing to resume: {last_path} does not exist; run without --resume to start")
        payload = read_checkpoint(last_path)
        check_resumable(payload["config"], config)
        check_world_size_change(payload, world_size, run_dir, allow_world_size_change)
        sweep_orphan_temporaries(run_dir)  # left by a kill during an atomic write
        stale = _FINAL_OUTPUTS  # they describe a state the resumed run moves past
    else:  # a fresh start: what is there comes from an attempt killed before its first checkpoint
        stale = _FINAL_OUTPUTS + _ATTEMPT_OUTPUTS
        refuse_fresh_start(run_dir, stale)
    for name in stale:
        (run_dir / name).unlink(missing_ok=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    if payload is None or not (run_dir / "provenance.json").exists():  # first: it marks the run's
        write_provenance(run_dir / "provenance.json", config.seed, extra={"run_dir": str(run_dir)})
    dump_config(config, run_dir / "config.yaml")
    return payload


def evaluate_baseline(trainer: Trainer, test_set) -> dict[str, dict[str, float]]:
    """The model as it starts (untrained, or pretrained trunk + fresh head) on validation and
    test: the number training has to beat. Computed at step 0 without touching any random
    state, so training is the same with or without it; written to ``baseline.json``."""
    rng = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
           torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)
    out: dict[str, dict[str, float]] = {}
    try:
        val = trainer.val_metrics()  # the validation path training uses (cached features)
        if val is not None:
            out["val"] = val
        if test_set is not None and len(np.unique(np.asarray(test_set.labels))) >= 2:
            emb, lab = embed_sharded(lambda part: embed_model(trainer.model, part, trainer.options,
                                                              progress=False), test_set)
            out["test"] = trainer.metrics_of(emb, lab)
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
        before, after = base.get("map_at_r"), now.get("map_at_r")  # None: NaN read back from JSON
        if before is not None and after is not None and after <= before:
            lines.append(f"training did not beat the untrained model on {split}: MAP@R "
                         f"{100 * now['map_at_r']:.2f} after training vs {100 * base['map_at_r']:.2f} "
                         "at step 0; check the learning rate, the loss settings and the data")
    return lines


def evaluate_test_set(trainer: Trainer, test_set) -> dict[str, float]:
    """Embed ``test_set`` with the best checkpoint, write ``embeddings/test.npz``, return its metrics."""
    # rank 0 reads best.pt and sends the weights (no shared filesystem needed between nodes)
    trainer.model.load_state_dict(on_main(lambda: read_checkpoint(trainer.best_path)["model"]))
    emb, lab = embed_sharded(lambda part: embed_model(trainer.model, part, trainer.options,
                                                      progress=trainer.progress), test_set)
    metrics = trainer.metrics_of(emb, lab)
    if context().is_main:
        save_embeddings(trainer.run_dir / "embeddings" / "test.npz", emb, lab,
                        **dataset_items(test_set, run_data_root(trainer.config.data.root, None)))
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
    allow_world_size_change: bool = False,
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
            ``config.yaml`` so that ``dmlkit embed``/``dmlkit report`` find them again. A
            config that sets another ``data.root`` is refused (one must not silently
            replace the other). With datasets from the config, every size constraint is
            checked against the data first (:func:`dmlkit.training.preflight.preflight`).
        allow_world_size_change: resume a checkpoint written by another number of processes
            (refused by default: the continuation is then statistically the same run but not
            bit-identical, see ``docs/distributed.md``); without ``resume`` a
            :class:`~dmlkit.exceptions.ConfigError`.

    Distributed: started by ``torchrun`` (``WORLD_SIZE`` > 1 in the environment) this joins
    the process group (NCCL on CUDA, gloo on CPU), which stays joined for later calls and is
    left when the process exits; a process group the caller started is used as it is. Every
    rank returns the same result; rank 0 alone writes files.
    """
    if allow_world_size_change and not resume:  # never silently ignored, as the CLI's flags
        raise ConfigError("allow_world_size_change applies with resume=True (--allow-world-size-change with "
                          "--resume): a new run has no earlier number of processes")
    if not isinstance(config, ExperimentConfig):
        config = config_from_dict(config)
    # before joining (no rank waits for others to report a bad batch; rank 0 prints the line,
    # dmlkit.commands._ranks): --data-root and the config's own data.root must name the same
    # folder, and the world size must split the batch
    config = with_data_root(config, data_root)
    world = (context().world_size if context().enabled
             else int(os.environ["WORLD_SIZE"]) if launched_by_torchrun() else 1)
    check_world_size(config.sampler, world)
    ctx, device = join_process_group(resolve_device(config.training.device))
    with leaving_alone_on_failure():
        result = _train(config, Path(run_dir), device, train_set=train_set, val_set=val_set,
                        test_set=test_set, resume=resume, progress=progress and ctx.is_main,
                        allow_world_size_change=allow_world_size_change)
        barrier()  # rank 0 has written metrics.json before any rank returns
    return result


def join_process_group(device: torch.device):
    """``(context, device)`` after joining torchrun's process group (no-op alone, or when the
    caller joined one). A group joined here stays joined for later calls in this process
    (re-joining a torchrun group in one process is not supported) and is left at exit. CUDA
    ranks get their own GPU, ``cuda:LOCAL_RANK``."""
    joined_here = launched_by_torchrun() and not context().enabled
    ctx = init_distributed(device)
    if joined_here:
        atexit.register(shutdown)
    if ctx.enabled and device.type == "cuda":
        device = torch.device("cuda", ctx.local_rank)
    return ctx, device


def _train(config: ExperimentConfig, run_dir: Path, device: torch.device, *, train_set, val_set,
           test_set, resume: bool, progress: bool, allow_world_size_change: bool) -> TrainResult:
    """:func:`train` once the process group (if any) is joined."""
    check_same_config_on_ranks(config)  # per-machine paths may differ
    # every size constraint against the data, before the run dir is touched
    with holding_skip_warnings():  # said with the list's place once the run directory exists
        checked = agree(preflight, config) if train_set is None else None  # each rank's data root
    if test_set is not None:  # an explicit test set, as preflight checks the config's: one class
        # scored MAP@R = P@1 = 100 % in metrics.json for any model (the baseline skipped it)
        agree(refuse_degenerate_eval, test_set.labels, "test")
    split = recorded = None
    if checked is not None:  # a resume applies the run's own split.json (its names checked)
        recorded = on_main(read_run_split, run_dir) if resume else None
        sets = build_datasets(config, ("train", "val", "test"), dataset=checked.dataset, split=recorded)
        # with the classes' names: a later change to the data is caught, not embedded
        split = sets["split"].naming(checked.dataset.class_names)
        train_set = sets["train"]
        val_set = sets["val"] if val_set is None else val_set
        test_set = sets["test"] if test_set is None else test_set
    used = {"train": train_set, "val": val_set, "test": test_set}
    check_same_data(used)  # each rank's own copy
    if recorded is not None:  # the data it started on (a moved copy is the same), else refused
        check_resumed_data(run_dir, recorded, used, run_data_root(config.data.root, None))
    split = split if recorded is None else None  # split.json is written when a run starts
    with contextlib.ExitStack() as held:  # rank 0 locks the run directory for the whole run

        def lock() -> None:
            held.enter_context(directory_lock(
                run_dir, _RUN_LOCK, f"another `dmlkit train` is using {run_dir}: wait for it to "
                "end, or choose another run directory"))

        on_main(lock)  # refused on rank 0: the same error on every rank
        # a refusal here leaves nothing: the lock removes its file and the folders it made
        payload = on_main(open_run_dir, run_dir, config, resume, world_size=context().world_size,
                          allow_world_size_change=allow_world_size_change)
        if checked is not None:  # every image skip_corrupt left out, with why: RUN_DIR/skipped.txt
            on_main(record_skipped, checked.dataset, run_dir, stacklevel=3)
        return _train_in_dir(config, run_dir, device, split, payload, train_set=train_set,
                             val_set=val_set, test_set=test_set, progress=progress)


def _train_in_dir(config: ExperimentConfig, run_dir: Path, device: torch.device, split,
                  payload: dict[str, Any] | None, *, train_set, val_set, test_set,
                  progress: bool) -> TrainResult:
    """:func:`train` in its locked run directory (:data:`_RUN_LOCK`: a second ``train`` there is
    refused instead of interleaving its log and checkpoints), opened by :func:`open_run_dir`
    (``payload``: the checkpoint a resume continues from; ``split``: the class split of datasets
    built from the config, written to ``split.json`` with the data's fingerprints; ``None`` on
    resume, which keeps the file)."""
    ctx = context()
    seed_everything(config.seed)
    if split is not None and ctx.is_main:  # with the fingerprints of the data, which a resume,
        # `dmlkit embed` and `dmlkit report` compare theirs with
        recording_data(split, {"train": train_set, "val": val_set, "test": test_set}).to_json(run_dir / "split.json")
    if progress:
        logger.info("%s: %d train samples / %d classes, %d val classes, %d test classes -> %s%s",
                    config.name, 0 if train_set is None else len(train_set),
                    0 if train_set is None else len(np.unique(train_set.labels)),
                    0 if val_set is None else len(np.unique(val_set.labels)),
                    0 if test_set is None else len(np.unique(test_set.labels)), run_dir,
                    f" ({ctx.world_size} processes, {config.sampler.batch_size // ctx.world_size} "
                    "items each per step)" if ctx.enabled else "")
    trainer = Trainer(config, run_dir, train_set, val_set, device=device, progress=progress)
    if test_set is not None:
        seen = trainer.train_classes
        if trainer.val_input is not None:
            seen = np.union1d(seen, val_set.labels)
        if np.intersect1d(test_set.labels, seen).size and ctx.is_main:
            warnings.warn("test classes overlap the training/validation classes: the test "
                          "metrics are not those of unseen classes", stacklevel=3)
    baseline_path = run_dir / "baseline.json"
    if payload is not None:
        trainer.restore(payload)
        baseline = on_main(lambda: _read_baseline(baseline_path))
    else:  # step 0: the number to beat (untrained or pretrained-only), before any update
        baseline = evaluate_baseline(trainer, test_set)
        if ctx.is_main:
            atomic_write_json(baseline_path, baseline)
    state = trainer.fit()

    result = TrainResult.from_state(trainer, state)
    metrics_out: dict[str, Any] = {"best_step": result.best_step, "best_epoch": int(state.best_epoch),
                                   "epochs_completed": result.epochs_completed,
                                   "partial_epoch": result.partial_epoch, "val": result.val_metrics}
    if test_set is not None:
        result.test_metrics = metrics_out["test"] = evaluate_test_set(trainer, test_set)
    metrics_out["baseline"] = result.baseline = baseline
    for line in baseline_warnings(baseline, {"val": result.val_metrics, "test": result.test_metrics}):
        if ctx.is_main:  # the job's warnings, once
            warnings.warn(line, stacklevel=3)
    if ctx.is_main:
        atomic_write_json(run_dir / "metrics.json", metrics_out)
    return result


def _read_baseline(path: Path) -> dict[str, Any]:
    """The step-0 numbers a resumed run reports (``baseline.json``; none if it is missing): a
    damaged file is one :class:`DataError` naming it."""
    return read_json_object(path, "baseline.json of dmlkit train") if path.exists() else {}


def check_world_size_change(payload: dict[str, Any], world_size: int, run_dir: Path,
                            allowed: bool) -> None:
    """Refuse to resume a checkpoint written by another number of processes unless ``allowed``.

    Checkpoints are written at epoch ends and the global batches depend only on the seed and
    the epoch, so a continuation on another world size draws the same batches; what differs
    is the order of floating-point sums (gradient all-reduce, BatchNorm statistics) and each
    rank's random streams (augmentation), so it is not bit-identical to the uninterrupted run.
    """
    saved = int(payload.get("world_size", 1))
    if saved == world_size:
        return
    if not allowed:
        raise mark_every_rank(CheckpointError(
            f"cannot resume {run_dir}: its checkpoint was written by {saved} process(es) but this "
            f"job has {world_size}: resume with the same number (torchrun --nproc-per-node/--nnodes), "
            "or pass --allow-world-size-change (train(..., allow_world_size_change=True)) to "
            "continue on the new world size (same global batches, not bit-identical)"))
    logger.warning("resuming a %d-process checkpoint on %d processes: the sampler shares are "
                   "re-derived from the seed and epoch; the run is not bit-identical to an "
                   "uninterrupted one", saved, world_size)


def embed_run(
    checkpoint: str | Path,
    split: str = "test",
    *,
    output: str | Path | None = None,
    data_root: str | Path | None = None,
    device: str = "auto",
    progress: bool = False,
) -> tuple[Path, np.ndarray, np.ndarray, ExperimentConfig]:
    """Embed one split of a trained run with a checkpoint (``dmlkit embed``): a ``.pt`` file, or
    a run directory's best one.

    The datasets come from the checkpoint's config (the training split gets the evaluation
    transform, no augmentation). Writes ``output`` (default ``RUN_DIR/embeddings/<split>.npz``
    for ``best.pt``, ``RUN_DIR/embeddings/<split>-<checkpoint stem>.npz`` for another checkpoint,
    e.g. ``test-last.npz``: :func:`default_embeddings_name`), with the dataset rows as
    ``indices`` and their files relative to the data root as ``paths``
    (:func:`~dmlkit.embeddings.dataset_items`), and returns ``(path, embeddings, labels, config)``.

    Under ``torchrun`` each rank embeds its shard of the split (:func:`embed_sharded`), every
    rank returns the whole split in dataset order, and rank 0 alone writes ``output``.
    """
    if output is not None and Path(output).suffix.lower() != ".npz":
        raise ConfigError(f"--output {output}: an npz embeddings file must end in .npz (numpy "
                          "writes an npz archive whatever the name); use --format shards for a "
                          "directory of .npy shards")
    job = _EmbeddingJob(checkpoint, split, data_root, device)
    if output is not None:
        refuse_replacing_run_test_embeddings(Path(output), job.checkpoint, split)
    path = Path(output if output is not None else job.default_output(".npz"))
    job.check_output(path)
    with leaving_alone_on_failure():
        emb, labels = embed_sharded(
            lambda part: embed_split(job.model, part, job.config, job.device,
                                     progress=progress and job.ctx.is_main), job.dataset)
        if job.ctx.is_main:
            path = save_embeddings(path, emb, labels, **dataset_items(job.dataset, job.root))
        barrier()  # the file exists before any rank returns
    return path, emb, labels, job.config


def embed_run_to_shards(
    checkpoint: str | Path,
    split: str = "test",
    *,
    output: str | Path | None = None,
    data_root: str | Path | None = None,
    device: str = "auto",
    dtype: str = "float32",
    shard_rows: int = DEFAULT_SHARD_ROWS,
    overwrite: bool = False,
    progress: bool = False,
) -> tuple[ShardedEmbeddings, ExperimentConfig]:
    """:func:`embed_run` into a shard directory (``dmlkit embed --format shards``; default
    ``RUN_DIR/embeddings/<split>-shards``, ``<split>-<checkpoint stem>-shards`` for another
    checkpoint than ``best.pt``), batch by batch: for splits larger than RAM
    (:func:`dmlkit.embedding_shards.embed_to_shards`). Under ``torchrun`` each rank embeds and
    writes its share of the rows and rank 0 writes the manifest; every rank returns the set."""
    job = _EmbeddingJob(checkpoint, split, data_root, device)
    directory = output if output is not None else job.default_output("-shards")
    job.check_output(directory)
    with leaving_alone_on_failure():
        shards = embed_to_shards(
            job.model, job.dataset, directory, InferenceOptions.from_config(job.config, job.device),
            dtype=dtype, shard_rows=shard_rows, overwrite=overwrite, progress=progress,
            metadata={"checkpoint": str(job.checkpoint), "split": split, "dataset": job.config.data.dataset},
        )
    return shards, job.config


def _load_split(checkpoint: str | Path, split: str, data_root: str | Path | None) -> tuple:
    """``(checkpoint file, model, config, dataset, differences)`` of ``split`` of a trained run
    (a checkpoint of another run refused); ``differences``: how the dataset differs from the
    data the run recorded (:func:`~dmlkit.training.run_identity.data_differences`)."""
    if split not in ("train", "val", "test"):
        raise ConfigError(f"the split must be train, val or test, got {split!r}")
    found, model, config = load_run_checkpoint(checkpoint)
    config = with_run_split(config, run_dir_of(found))
    dataset = build_datasets(config, (split,), data_root=data_root, augment_train=False)[split]
    if dataset is None:
        raise DataError(f"the config's class split has no {split} classes")
    return found, model, config, dataset, data_differences(read_run_split(run_dir_of(found)), {split: dataset})


class _EmbeddingJob:
    """What embedding a split of a trained run needs: the process group joined (under
    torchrun), the rank's device, the best checkpoint's model and config, and the split's
    dataset (evaluation transform). What each rank reads is agreed on (:func:`agree`): an
    error is one line for the job, and no rank is left waiting for another that failed. Then the
    ranks compare the checkpoint files and the split they loaded (a stale copy on one machine
    mixed two models or two datasets in one embeddings file): one error line, nothing written.
    :meth:`check_output` refuses to write embeddings of other data than the run's into the run."""

    def __init__(self, checkpoint: str | Path, split: str, data_root: str | Path | None,
                 device: str) -> None:
        self.ctx, self.device = join_process_group(resolve_device(device))
        self.split = split
        self.checkpoint, self.model, self.config, self.dataset, self.differences = agree(
            _load_split, checkpoint, split, data_root)
        check_same_checkpoint(self.checkpoint)
        check_same_data({split: self.dataset})
        self.root = run_data_root(self.config.data.root, data_root)  # where the split's files are

    def check_output(self, output: str | Path) -> None:
        """Refuse ``output`` inside the run directory when the split is not the run's data."""
        refuse_other_data_in_run(Path(output), self.checkpoint, self.split, self.differences)

    def default_output(self, suffix: str) -> Path:
        """``RUN_DIR/embeddings/<split><suffix>`` for the best checkpoint, else
        ``RUN_DIR/embeddings/<split>-<checkpoint name><suffix>`` (:func:`default_embeddings_name`)."""
        return run_dir_of(self.checkpoint) / "embeddings" / default_embeddings_name(
            self.checkpoint, self.split, suffix)


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
