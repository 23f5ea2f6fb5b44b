"""The training loop: a :class:`Trainer` over an explicit :class:`TrainState`.

Each step (Musgrave et al., "A Metric Learning Reality Check", ECCV 2020, section 4)::

    batch      = C classes x M samples                    (dmlkit.samplers.MPerClassSampler)
    embeddings = normalize(head(trunk(x)))                (frozen BatchNorm, L2-normalised)
    indices    = miner(embeddings, labels)                (optional)
    loss       = loss_fn(embeddings, labels, indices)     (labels remapped to 0..K-1)
    optimiser step on three parameter groups: trunk, embedder, loss (each its own lr)

Every ``eval_every_epochs`` epochs the model embeds the *validation* classes (never the test
classes) and computes MAP@R and P@1; ``checkpoints/best.pt`` keeps the best validation MAP@R
and ``patience`` evaluations without improvement stop the run. ``checkpoints/last.pt`` (written
atomically at every epoch end) holds everything needed to continue a killed run bit-exactly:
model, optimiser, loss state (incl. cross-batch memory), sampler epoch, RNG states and the
:class:`TrainState`.

With ``model.frozen_trunk`` the trunk's features are computed once (and cached on disk) and
only the head is trained: the practical way to use a large pretrained trunk on a CPU.

Under ``torchrun`` (a process group is running, see :mod:`dmlkit.distributed`) the same loop
is data-parallel and exact: every rank takes its contiguous share of the one-process global
batch (rank-aware sampler), training BatchNorm layers use global-batch statistics
(:func:`~dmlkit.models.sync_batchnorm.convert_sync_batchnorm`), the model is wrapped in
``DistributedDataParallel``, the embeddings and labels are all-gathered with gradient so the
miner and the loss see the global batch, and the loss's own parameters (proxies, class
weights) get rank 0's gradient on every rank. Validation embeds a shard per rank, gathers it
in dataset order and computes the metrics once, on rank 0 (broadcast to the others). Only
rank 0 writes files, logs and progress bars.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from dmlkit.config import ExperimentConfig
from dmlkit.data import get_transforms
from dmlkit.distributed import (
    all_gather_object,
    all_gather_with_grad,
    all_reduce_sum,
    broadcast_tensors_,
    context,
    mark_every_rank,
    on_main,
)
from dmlkit.embeddings import (
    HeadOnly,
    InferenceOptions,
    autocast_dtype,
    embed,
    embed_sharded,
    resolve_device,
    trunk_features_sharded,
)
from dmlkit.exceptions import CheckpointError, DataError, NonFiniteError
from dmlkit.losses.sharding import check_shardable, sharded_loss
from dmlkit.metrics import evaluate
from dmlkit.metrics.scoring import scored_elsewhere, scoring_stamp, this_scorer
from dmlkit.models import to_device
from dmlkit.models.sync_batchnorm import convert_sync_batchnorm
from dmlkit.signals import signals_deferred
from dmlkit.training.builders import (
    build_loss,
    build_miner,
    build_model,
    build_optimizer,
    build_sampler,
)
from dmlkit.training.checkpoint import (
    INPUT_TRANSFORM_BY_NAME,
    best_record,
    capture_rng_state,
    restore_rng_state,
    save_checkpoint,
    save_trunk,
)
from dmlkit.training.preflight import refuse_degenerate_eval
from dmlkit.training.runlog import RunLogger
from dmlkit.training.seeding import SeededBatches, SeededItems, seed_worker

__all__ = ["TrainState", "Trainer", "scalar_metrics"]

logger = logging.getLogger("dmlkit.training")

#: What ``best.pt`` keeps: what inference needs (no optimiser/RNG state).
BEST_KEYS = ("config", "model", "trunk_file", "loss", "epoch", "step", "trainer", "train_classes",
             "embedding_size", INPUT_TRANSFORM_BY_NAME, "scoring")


@dataclass
class TrainState:
    """Where a run stands; saved in every checkpoint (``epoch``/``step`` as their own keys,
    the rest under ``"trainer"``) and restored on resume."""

    epoch: int = 0
    step: int = 0
    best_map: float = -math.inf
    best_step: int = 0
    best_epoch: int = 0
    best_metrics: dict[str, float] = field(default_factory=dict)
    bad_evals: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    elapsed: float = 0.0
    stop_reason: str | None = None
    #: ``max_steps`` stopped the run inside epoch ``epoch + 1``: ``step`` counts its steps,
    #: ``epoch`` (full epochs completed) does not count it
    partial_epoch: bool = False

    def trainer_record(self) -> dict[str, Any]:
        """The checkpoint's ``"trainer"`` entry: everything but ``epoch`` and ``step``."""
        record = asdict(self)
        del record["epoch"], record["step"]
        return record

    @classmethod
    def from_checkpoint(cls, payload: dict[str, Any]) -> TrainState:
        return cls(epoch=int(payload["epoch"]), step=int(payload["step"]), **payload["trainer"])


def scalar_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of an ``evaluate`` result (counts stay ints) as plain Python numbers."""
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if isinstance(v, bool):
            continue
        if isinstance(v, int | np.integer):
            out[k] = int(v)
        elif isinstance(v, float | np.floating):
            out[k] = float(v)
    return out


def check_class_sets(train_set, val_set) -> tuple[np.ndarray, Any]:
    """``(sorted training class ids, val_set or None)``; refuses too few training classes and
    warns when validation classes are not disjoint from the training classes."""
    if train_set is None or len(train_set) == 0:
        raise DataError("the training split is empty: check data.split")
    train_classes = np.unique(np.asarray(train_set.labels, dtype=np.int64))
    if train_classes.size < 2:
        raise DataError(f"training needs at least 2 classes, got {train_classes.size}")
    if val_set is not None and len(val_set) == 0:
        val_set = None
    if val_set is not None:  # one class (100 % for any model) or no positive pair (NaN): refuse
        refuse_degenerate_eval(val_set.labels, "validation")
    if val_set is not None and np.intersect1d(val_set.labels, train_classes).size:
        warnings.warn("validation classes overlap the training classes: the split is not "
                      "class-disjoint, so validation MAP@R is optimistic", stacklevel=3)
    return train_classes, val_set


class QuietRunLog:
    """What ranks other than 0 log: nothing (every method of ``RunLogger`` is a no-op)."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


class Trainer:
    """One training run of ``config`` on ``train_set`` (validated on ``val_set``), in ``run_dir``.

    Build it, optionally :meth:`restore` a ``last.pt`` payload, then :meth:`fit`. The pieces
    (``model``, ``loss_fn``, ``miner``, ``optimizer``, ``sampler``, ``state``) are attributes.
    """

    def __init__(self, config: ExperimentConfig, run_dir: str | Path, train_set, val_set=None, *,
                 device: str | torch.device | None = None, progress: bool = False) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        self.last_path, self.best_path = self.ckpt_dir / "last.pt", self.ckpt_dir / "best.pt"
        self.dist = context()  # rank / world size of the running process group (1 process: 0 / 1)
        self.progress = progress and self.dist.is_main
        self.device = resolve_device(config.training.device if device is None else device)
        self.train_classes, val_set = check_class_sets(train_set, val_set)
        self.has_val = val_set is not None
        self.options = InferenceOptions.from_config(config, self.device)

        self.model = to_device(build_model(config.model), self.device)
        if self.dist.enabled:  # BatchNorm that trains normalises over the global batch
            self.model = convert_sync_batchnorm(self.model, self.device)
        self.frozen = config.model.frozen_trunk
        #: the parts whose weights no optimiser changes (build_optimizer: lr 0 or a frozen trunk)
        #: run in eval mode, as in inference, so their BatchNorm running statistics stay fixed too
        self.fixed_parts: list[nn.Module] = [
            part for part, fixed in ((self.model.trunk, self.frozen or config.optimizer.trunk_lr == 0),
                                     (self.model.embedder, config.optimizer.embedder_lr == 0)) if fixed]
        if self.frozen:
            for p in self.model.trunk.parameters():
                p.requires_grad_(False)
            feature_set = train_set
            if config.data.transform is not None and hasattr(train_set, "with_transform"):
                # features are computed once, so a random augmentation could not vary by epoch:
                # use the deterministic evaluation transform (also keeps the feature cache valid)
                feature_set = train_set.with_transform(get_transforms(
                    config.data.transform, train=False, image_size=config.data.image_size))
            # one shard per rank in a distributed job, gathered (plain trunk_features alone)
            self.train_input = trunk_features_sharded(self.model, feature_set, self.options, self.progress)
            self.val_input = (None if val_set is None else
                              trunk_features_sharded(self.model, val_set, self.options, self.progress))
            self.step_module: nn.Module = HeadOnly(self.model)
            self.num_workers = 0
        else:
            self.train_input, self.val_input, self.step_module = train_set, val_set, self.model
            self.num_workers = config.data.num_workers
        self.embedding_size = int(self.model.embedding_size)

        self.miner = build_miner(config.miner)
        self.loss_fn = build_loss(config.loss, int(self.train_classes.size), self.embedding_size, miner=self.miner)
        self.use_miner_in_loop = self.miner is not None and not config.loss.cross_batch_memory
        if config.training.distributed_loss == "local_anchors":  # refused alike with 1 process
            check_shardable(self.loss_fn, config.loss.name)
        self.shard_loss = self.dist.enabled and config.training.distributed_loss == "local_anchors"
        self.loss_fn.to(self.device)
        if self.miner is not None:
            self.miner.to(self.device)
        self.optimizer = build_optimizer(config.optimizer, self.model, self.loss_fn, self.miner,
                                         frozen_trunk=self.frozen)
        self.trainable = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.sampler = build_sampler(config.sampler, self.train_input.labels, seed=config.seed,
                                     num_replicas=self.dist.world_size, rank=self.dist.rank)
        # the module each training step runs: DDP averages the model's gradients over ranks;
        # the loss's (and miner's) own parameters live outside it (see train_step)
        self.train_module: nn.Module = self.step_module
        self.loss_params = [p for m in (self.loss_fn, self.miner) if m is not None
                            for p in m.parameters() if p.requires_grad]
        if self.dist.enabled and any(p.requires_grad for p in self.step_module.parameters()):
            # (DDP refuses a module with nothing to train: a frozen trunk with an identity head
            # under a proxy loss trains the loss's parameters alone, kept equal as they are)
            gpu = (self.device.index if self.device.index is not None else torch.cuda.current_device()
                   ) if self.device.type == "cuda" else None  # init_distributed set LOCAL_RANK's GPU
            self.train_module = DistributedDataParallel(
                self.step_module, device_ids=None if gpu is None else [gpu])
        self.use_amp = config.training.amp and self.device.type == "cuda"
        if config.training.amp and not self.use_amp:
            logger.info("training.amp is on but the device is %s: mixed precision is CUDA-only, "
                        "using float32", self.device)
        self.amp_dtype = autocast_dtype(self.device)  # the dtype every inference autocasts to
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.use_amp and self.amp_dtype == torch.float16)
        self.classes_t = torch.as_tensor(self.train_classes, device=self.device)
        self.run_log: RunLogger | QuietRunLog = (
            RunLogger(self.run_dir, csv_log=config.training.csv_log, tensorboard=config.training.tensorboard)
            if self.dist.is_main else QuietRunLog())
        self.state = TrainState()
        self.trunk_file: str | None = None

    # -- checkpoints ------------------------------------------------------------------------
    def restore(self, payload: dict[str, Any]) -> None:
        """Continue from a ``last.pt`` payload (model, optimiser, loss, miner, RNG and loop
        state). A run that ended goes on with more epochs, or with a patience above its count
        of evaluations without gain; ``best.pt`` is made to agree (:meth:`reconcile_best`)."""
        if not np.array_equal(payload["train_classes"].numpy(), self.train_classes):
            raise CheckpointError("cannot resume: the training classes differ from the checkpoint's")
        self.model.load_state_dict(payload["model"])
        try:
            self.optimizer.load_state_dict(payload["optimizer"])
        except ValueError as exc:  # torch: "... parameter group that doesn't match the size ..."
            raise CheckpointError(
                "cannot resume: the checkpoint's optimiser state trains other parameters than this "
                f"dmlkit does with its config ({' '.join(str(exc).split())}); e.g. a run from before "
                "model.freeze_batchnorm spared a randomly initialised trunk's BatchNorm. Start a new "
                "run directory") from None
        self.loss_fn.load_state_dict(payload["loss"])
        if self.miner is not None and payload.get("miner") is not None:
            self.miner.load_state_dict(payload["miner"])
        if payload.get("scaler"):
            self.scaler.load_state_dict(payload["scaler"])
        self.state = TrainState.from_checkpoint(payload)
        per_rank = payload.get("rng_ranks")
        if per_rank is not None and len(per_rank) == self.dist.world_size:
            restore_rng_state(per_rank[self.dist.rank])  # each rank continues its own streams
        else:  # one process, or a world-size change the caller allowed: rank 0's streams
            restore_rng_state(payload["rng"])
        self.run_log.truncate_after(self.state.step)
        state, training = self.state, self.config.training
        patience_left = training.patience is None or state.bad_evals < training.patience
        if state.epoch < training.epochs and state.stop_reason in ("epochs", "patience") and patience_left:
            state.stop_reason = None  # extended: more epochs, or more patience than it ran out of
        elif not patience_left and (state.stop_reason is None or (
                state.stop_reason == "epochs" and state.epoch < training.epochs)):
            # an uninterrupted run with this patience stopped here (more epochs do not revive
            # a run whose patience ran out; a lowered patience stops a killed one)
            state.stop_reason = "patience"
        self.reconcile_best()
        self.warn_scored_elsewhere(payload.get("scoring"))
        if self.dist.is_main:
            logger.info("resumed %s at epoch %d, step %d", self.run_dir, self.state.epoch, self.state.step)

    def warn_scored_elsewhere(self, recorded: Any) -> None:
        """Warn where the resumed best validation MAP@R, which the coming evaluations must beat,
        was scored by another dmlkit (``recorded``: the checkpoint's ``"scoring"``,
        :func:`dmlkit.metrics.scoring.scored_elsewhere`): the two may differ in the last digits."""
        who, state = scored_elsewhere(recorded), self.state
        if who is None or state.stop_reason is not None or not math.isfinite(state.best_map) or not self.dist.is_main:
            return
        warnings.warn(f"{self.run_dir}: its best validation MAP@R so far ({state.best_map:.4f}, epoch "
                      f"{state.best_epoch}) was scored by {who}, the coming evaluations by this dmlkit "
                      f"({this_scorer()}); they may differ in the last digits, which can decide the best "
                      "model on a near tie. Training the run again from scratch avoids mixing them",
                      stacklevel=3)

    def payload(self) -> dict[str, Any]:
        """Everything ``last.pt`` holds (``best.pt`` keeps :data:`BEST_KEYS` of it).

        In a distributed job every rank must call it (the ranks' RNG states are gathered into
        ``rng_ranks``); ``world_size`` records how many processes trained the run."""
        rng = capture_rng_state()
        rng_ranks = all_gather_object(rng) if self.dist.enabled else None
        state_dict = self.model.state_dict()
        if self.trunk_file is not None:  # the frozen trunk is stored once, in trunk.pt
            state_dict = {k: v for k, v in state_dict.items() if not k.startswith("trunk.")}
        return {
            "config": self.config.model_dump(mode="json"),
            "model": state_dict,
            "trunk_file": self.trunk_file,
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else None,
            "loss": self.loss_fn.state_dict(),
            "miner": self.miner.state_dict() if self.miner is not None else None,
            "sampler_epoch": self.state.epoch,
            "rng": rng,
            "rng_ranks": rng_ranks,
            "world_size": self.dist.world_size,
            "epoch": self.state.epoch,
            "step": self.state.step,
            "trainer": self.state.trainer_record(),
            "scoring": scoring_stamp(),  # what scored trainer's best_map (a resume by another warns)
            "train_classes": torch.as_tensor(self.train_classes),
            "embedding_size": self.embedding_size, INPUT_TRANSFORM_BY_NAME: True,
        }

    def reconcile_best(self) -> None:
        """Make ``best.pt`` and the resumed best record (``last.pt``'s) describe one model.

        :meth:`end_epoch` writes ``best.pt`` only after ``last.pt`` recorded the new best, so
        ``last.pt``'s record is never behind ``best.pt``: after a kill between the two writes
        ``best.pt`` lags, and the record's best is then ``last.pt``'s own model (``best_step
        == step``), from which ``best.pt`` is written again here. (Writing ``best.pt`` first
        left it ahead of the record: the resume retrained that epoch, and a continuation that
        was not bit-identical kept the killed attempt's ``best.pt`` while ``metrics.json``
        named another epoch.) A ``best.pt`` ahead of ``last.pt``, left by a kill in a dmlkit
        that wrote it first, holds a model the record cannot rebuild: its best record is
        adopted (best MAP@R, step, epoch and metrics; the history keeps the evaluations this
        trajectory makes)."""
        state = self.state
        best = on_main(lambda: best_record(self.best_path))
        if best is not None and (best["step"], best["best_map"]) == (state.best_step, state.best_map):
            return
        if best is not None and best["step"] > state.step:
            logger.warning("%s is ahead of last.pt (step %d > %d): keeping it as the best model",
                           self.best_path, best["step"], state.step)
            state.best_map, state.best_step, state.best_epoch = best["best_map"], best["step"], best["best_epoch"]
            state.best_metrics = dict(best["best_metrics"])
        elif state.best_step == state.step:  # killed between last.pt and best.pt (none yet
            self.save_best()  # after a first epoch): last.pt's model is the best

    def save_best(self) -> None:
        payload = self.payload()
        if self.dist.is_main:
            save_checkpoint({k: payload[k] for k in BEST_KEYS}, self.best_path)

    def save_last(self) -> None:
        """Write ``last.pt`` (rank 0; every rank takes part in gathering the RNG states)."""
        payload = self.payload()
        if self.dist.is_main:
            save_checkpoint(payload, self.last_path)

    # -- the loop ---------------------------------------------------------------------------
    def fit(self) -> TrainState:
        """Train until ``training.epochs``, ``max_steps`` or ``patience`` stops the run."""
        if self.frozen:  # the trunk never changes: store it once instead of in every checkpoint
            self.trunk_file = "trunk.pt"
            if self.dist.is_main and not (self.ckpt_dir / self.trunk_file).exists():
                save_trunk(self.model.trunk.state_dict(), self.ckpt_dir / self.trunk_file)
        state = self.state
        t_start = time.perf_counter() - state.elapsed
        try:
            while state.stop_reason is None and state.epoch < self.config.training.epochs:
                if self.run_epoch(t_start):
                    state.epoch += 1
                else:  # max_steps stopped it inside the epoch: not a completed epoch
                    state.partial_epoch = True
                state.elapsed = time.perf_counter() - t_start
                if state.stop_reason is None and state.epoch >= self.config.training.epochs:
                    state.stop_reason = "epochs"
                self.end_epoch()
        finally:
            self.run_log.close()
        if state.stop_reason is None:  # a resume with no epoch left to train (epochs lowered)
            state.stop_reason = "epochs"
        if not self.has_val:
            warnings.warn("no validation classes: checkpoints/best.pt is the last model, not the best "
                          "on validation MAP@R", stacklevel=2)
        if self.has_val and not state.best_metrics:  # no finite validation MAP@R: never select on NaN
            warnings.warn("no validation evaluation gave a finite MAP@R, so no model was selected: "
                          "checkpoints/best.pt is the last model", stacklevel=2)
            state.best_step, state.best_epoch = state.step, state.epoch
            self.save_best()
        if not on_main(self.best_path.exists):  # e.g. resumed a finished run whose best.pt was removed
            self.save_best()
        return state

    def run_epoch(self, t_start: float) -> bool:
        """One pass of the sampler's batches (stops early at ``training.max_steps``); whether
        every batch of the epoch was trained."""
        config, state = self.config, self.state
        self.sampler.set_epoch(state.epoch)
        # every item is loaded under its own seed, a function of its place in the global batch
        # (item_seed): the augmentations are the same with 1 or W processes and any num_workers
        loader = DataLoader(
            SeededItems(self.train_input), batch_sampler=SeededBatches(self.sampler, config.seed, state.epoch),
            num_workers=self.num_workers,
            generator=torch.Generator().manual_seed(config.seed * 100_003 + state.epoch),
            worker_init_fn=seed_worker if self.num_workers else None,
            pin_memory=self.device.type == "cuda",
        )
        self.train_module.train()  # frozen BatchNorm (build_model) stays in eval mode
        for part in self.fixed_parts:  # no BatchNorm statistics drift under fixed weights
            part.eval()
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(self.sampler), desc=f"epoch {state.epoch + 1}/{config.training.epochs}",
                       leave=False)
        batches = 0
        try:
            with signals_deferred():  # a Ctrl-C / SIGTERM while the workers fork is not lost
                started = iter(loader)
            for x, y in started:
                value = self.train_step(x, y)
                batches += 1
                if state.step % config.training.log_every == 0 or state.step == 1:
                    self.log_step(value, t_start)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{value:.4f}")
                if config.training.max_steps is not None and state.step >= config.training.max_steps:
                    state.stop_reason = "max_steps"
                    break
        finally:
            if bar is not None:
                bar.close()
        return batches == len(self.sampler)

    def _loss(self, emb: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(loss, objective)`` of the (gathered) batch: the loss value every rank logs, and
        what this rank back-propagates."""
        indices = self.miner(emb, target) if self.use_miner_in_loop else None
        if self.shard_loss:  # this rank's anchors only (dmlkit.losses.sharding): sum_r part = L
            part = sharded_loss(self.loss_fn, emb, target, indices)
            # the gather's backward gives each rank's embeddings dL/dx once (not W times as
            # when every rank computes L): W * part makes DDP's average exactly dL/dtheta
            loss, objective = all_reduce_sum(part.detach()), part * self.dist.world_size
        else:
            loss = self.loss_fn(emb, target, indices) if indices is not None else self.loss_fn(emb, target)
            objective = loss
        if not torch.isfinite(loss):
            raise NonFiniteError(
                f"the {self.config.loss.name} loss became {loss.item()} at epoch {self.state.epoch + 1}, "
                f"step {self.state.step + 1}: lower the learning rates (optimizer.*_lr), set "
                "training.grad_clip (e.g. 1.0), or check loss.params"
            )
        return loss, objective

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One optimiser step on one batch; returns the loss."""
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        target = torch.searchsorted(self.classes_t, y)
        with torch.autocast(device_type=self.device.type, dtype=self.amp_dtype, enabled=self.use_amp):
            emb = self.train_module(x)
        emb = emb.float()
        if self.dist.enabled:  # the global batch, in one-process order; gradients flow back
            emb = all_gather_with_grad(emb)
            target = all_gather_with_grad(target)
        try:  # of the gathered batch: a non-finite value is met by every rank alike (one line)
            loss, objective = self._loss(emb, target)
        except NonFiniteError as exc:
            raise mark_every_rank(exc) if self.dist.enabled else exc from None
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(objective).backward()
        if self.dist.enabled and self.loss_params:  # (sharded losses have no parameters)
            # every rank computed the same loss of the same gathered batch, so the loss's own
            # parameters got the same gradient; rank 0's is sent to all so that kernels that
            # are not bitwise deterministic (CUDA atomics) cannot let the copies drift apart
            broadcast_tensors_([p.grad for p in self.loss_params if p.grad is not None])
        if self.config.training.grad_clip is not None:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.trainable, self.config.training.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.state.step += 1
        return float(loss.detach())

    def log_step(self, value: float, t_start: float) -> None:
        state = self.state
        state.elapsed = time.perf_counter() - t_start
        lrs = {g.get("name", str(i)): g["lr"] for i, g in enumerate(self.optimizer.param_groups)}
        record = {"event": "train", "epoch": state.epoch + 1, "step": state.step, "loss": value,
                  "lr": lrs.get("embedder", next(iter(lrs.values()))),
                  **{f"lr_{k}": v for k, v in lrs.items()}, "time": round(state.elapsed, 3)}
        if self.use_miner_in_loop and getattr(self.miner, "stats", None):
            record.update({f"miner_{k}": v for k, v in self.miner.stats.items()})
        self.run_log.log(record)

    def val_metrics(self) -> dict[str, float] | None:
        """Validation metrics of the current model, through the same inputs as training (cached
        trunk features for a frozen trunk); ``None`` without validation classes. Logs nothing."""
        if self.val_input is None:
            return None
        emb, lab = embed_sharded(  # one shard per rank, gathered in dataset order
            lambda part: embed(self.step_module, part, self.options.batch_size, self.device,
                               num_workers=self.num_workers, amp=self.use_amp), self.val_input)
        return self.metrics_of(emb, lab)

    def metrics_of(self, emb: np.ndarray, labels: np.ndarray) -> dict[str, float]:
        """The run's evaluation metrics of ``(emb, labels)``, computed once, on rank 0, and
        broadcast, so that every rank takes the same model-selection decisions."""
        return on_main(lambda: scalar_metrics(evaluate(
            emb, labels, metrics=list(self.config.training.eval_metrics),
            **self.config.evaluation.metric_options())))

    def validate(self) -> dict[str, float] | None:
        """Validation metrics of the current model, logged as an ``eval`` event."""
        metrics = self.val_metrics()
        if metrics is None:
            return None
        record = {"event": "eval", "epoch": self.state.epoch, "step": self.state.step, "split": "val",
                  **metrics, "time": round(self.state.elapsed, 3)}
        if self.state.partial_epoch:  # after `epoch` full epochs and part of the next
            record["partial_epoch"] = True
        self.run_log.log(record)
        self.state.history.append(record)
        return metrics

    def end_epoch(self) -> None:
        """Validate when due, keep the best model, apply patience, write ``last.pt``, then
        ``best.pt`` if this model is the new best (in that order: see :meth:`reconcile_best`)."""
        config, state = self.config, self.state
        new_best = False
        if state.epoch % config.training.eval_every_epochs == 0 or state.stop_reason is not None:
            metrics = self.validate()
            if metrics is not None:
                if metrics["map_at_r"] > state.best_map:
                    state.best_map, state.best_step, state.best_epoch = metrics["map_at_r"], state.step, state.epoch
                    state.best_metrics, state.bad_evals, new_best = metrics, 0, True
                else:
                    state.bad_evals += 1
                if self.progress:
                    logger.info("epoch %d step %d: val MAP@R %.4f P@1 %.4f (best %.4f)", state.epoch,
                                state.step, metrics["map_at_r"], metrics.get("precision_at_1", float("nan")),
                                state.best_map)
                patience = config.training.patience
                if patience is not None and state.bad_evals >= patience and state.stop_reason is None:
                    state.stop_reason = "patience"
                    logger.info("early stopping: no validation MAP@R gain in %d evaluations", patience)
        if self.val_input is None and state.stop_reason is not None:
            state.best_step, state.best_epoch, new_best = state.step, state.epoch, True
        self.save_last()
        if new_best:
            self.save_best()
        self.run_log.flush()
