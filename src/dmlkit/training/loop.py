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
"""

from __future__ import annotations

import logging
import math
import random
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from dmlkit.config import ExperimentConfig
from dmlkit.data import get_transforms
from dmlkit.embeddings import HeadOnly, InferenceOptions, embed, resolve_device, trunk_features
from dmlkit.exceptions import CheckpointError, DataError, NonFiniteError
from dmlkit.metrics import evaluate
from dmlkit.models import freeze_batchnorm
from dmlkit.training.builders import (
    build_loss,
    build_miner,
    build_model,
    build_optimizer,
    build_sampler,
)
from dmlkit.training.checkpoint import (
    capture_rng_state,
    restore_rng_state,
    save_checkpoint,
    save_trunk,
)
from dmlkit.training.runlog import RunLogger

__all__ = ["TrainState", "Trainer", "scalar_metrics"]

logger = logging.getLogger("dmlkit.training")

#: What ``best.pt`` keeps: what inference needs (no optimiser/RNG state).
BEST_KEYS = ("config", "model", "trunk_file", "loss", "epoch", "step", "trainer", "train_classes",
             "embedding_size")


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


def _seed_worker(worker_id: int) -> None:
    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


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
    if val_set is not None and np.intersect1d(val_set.labels, train_classes).size:
        warnings.warn("validation classes overlap the training classes: the split is not "
                      "class-disjoint, so validation MAP@R is optimistic", stacklevel=3)
    return train_classes, val_set


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
        self.progress = progress
        self.device = resolve_device(config.training.device if device is None else device)
        self.train_classes, val_set = check_class_sets(train_set, val_set)
        self.has_val = val_set is not None
        self.options = InferenceOptions.from_config(config, self.device)

        self.model = build_model(config.model).to(self.device)
        self.frozen = config.model.frozen_trunk
        if self.frozen:
            for p in self.model.trunk.parameters():
                p.requires_grad_(False)
            feature_set = train_set
            if config.data.transform is not None and hasattr(train_set, "with_transform"):
                # features are computed once, so a random augmentation could not vary by epoch:
                # use the deterministic evaluation transform (also keeps the feature cache valid)
                feature_set = train_set.with_transform(get_transforms(
                    config.data.transform, train=False, image_size=config.data.image_size))
            self.train_input = trunk_features(self.model, feature_set, self.options, progress)
            self.val_input = None if val_set is None else trunk_features(self.model, val_set, self.options, progress)
            self.step_module: nn.Module = HeadOnly(self.model)
            self.num_workers = 0
        else:
            self.train_input, self.val_input, self.step_module = train_set, val_set, self.model
            self.num_workers = config.data.num_workers
        self.embedding_size = int(self.model.embedding_size)

        self.miner = build_miner(config.miner)
        self.loss_fn = build_loss(config.loss, int(self.train_classes.size), self.embedding_size, miner=self.miner)
        self.use_miner_in_loop = self.miner is not None and not config.loss.cross_batch_memory
        self.loss_fn.to(self.device)
        if self.miner is not None:
            self.miner.to(self.device)
        self.optimizer = build_optimizer(config.optimizer, self.model, self.loss_fn, self.miner,
                                         frozen_trunk=self.frozen)
        self.trainable = [p for g in self.optimizer.param_groups for p in g["params"]]
        self.sampler = build_sampler(config.sampler, self.train_input.labels, seed=config.seed)
        self.use_amp = config.training.amp and self.device.type == "cuda"
        if config.training.amp and not self.use_amp:
            logger.info("training.amp is on but the device is %s: mixed precision is CUDA-only, "
                        "using float32", self.device)
        self.amp_dtype = torch.bfloat16 if self.use_amp and torch.cuda.is_bf16_supported() else torch.float16
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.use_amp and self.amp_dtype == torch.float16)
        self.classes_t = torch.as_tensor(self.train_classes, device=self.device)
        self.run_log = RunLogger(self.run_dir, csv_log=config.training.csv_log,
                                 tensorboard=config.training.tensorboard)
        self.state = TrainState()
        self.trunk_file: str | None = None

    # -- checkpoints ------------------------------------------------------------------------
    def restore(self, payload: dict[str, Any]) -> None:
        """Continue from a ``last.pt`` payload (model, optimiser, loss, RNG and loop state)."""
        if not np.array_equal(payload["train_classes"].numpy(), self.train_classes):
            raise CheckpointError("cannot resume: the training classes differ from the checkpoint's")
        self.model.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        self.loss_fn.load_state_dict(payload["loss"])
        if self.miner is not None and payload.get("miner") is not None:
            self.miner.load_state_dict(payload["miner"])
        if payload.get("scaler"):
            self.scaler.load_state_dict(payload["scaler"])
        self.state = TrainState.from_checkpoint(payload)
        restore_rng_state(payload["rng"])
        self.run_log.truncate_after(self.state.step)
        if self.state.stop_reason == "epochs" and self.state.epoch < self.config.training.epochs:
            self.state.stop_reason = None  # the run was extended with more epochs
        logger.info("resumed %s at epoch %d, step %d", self.run_dir, self.state.epoch, self.state.step)

    def payload(self) -> dict[str, Any]:
        """Everything ``last.pt`` holds (``best.pt`` keeps :data:`BEST_KEYS` of it)."""
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
            "rng": capture_rng_state(),
            "epoch": self.state.epoch,
            "step": self.state.step,
            "trainer": self.state.trainer_record(),
            "train_classes": torch.as_tensor(self.train_classes),
            "embedding_size": self.embedding_size,
        }

    def save_best(self) -> None:
        payload = self.payload()
        save_checkpoint({k: payload[k] for k in BEST_KEYS}, self.best_path)

    # -- the loop ---------------------------------------------------------------------------
    def fit(self) -> TrainState:
        """Train until ``training.epochs``, ``max_steps`` or ``patience`` stops the run."""
        if self.frozen:  # the trunk never changes: store it once instead of in every checkpoint
            self.trunk_file = "trunk.pt"
            if not (self.ckpt_dir / self.trunk_file).exists():
                save_trunk(self.model.trunk.state_dict(), self.ckpt_dir / self.trunk_file)
        state = self.state
        t_start = time.perf_counter() - state.elapsed
        try:
            while state.stop_reason is None and state.epoch < self.config.training.epochs:
                self.run_epoch(t_start)
                state.epoch += 1
                state.elapsed = time.perf_counter() - t_start
                if state.stop_reason is None and state.epoch >= self.config.training.epochs:
                    state.stop_reason = "epochs"
                self.end_epoch()
        finally:
            self.run_log.close()
        if not self.has_val:
            warnings.warn("no validation classes: checkpoints/best.pt is the last model "
                          "(set data.split.val_fraction to select on validation MAP@R)", stacklevel=2)
        if not self.best_path.exists():  # e.g. resumed a finished run whose best.pt was removed
            self.save_best()
        return state

    def run_epoch(self, t_start: float) -> None:
        """One pass of the sampler's batches (stops early at ``training.max_steps``)."""
        config, state = self.config, self.state
        self.sampler.set_epoch(state.epoch)
        loader = DataLoader(
            self.train_input, batch_sampler=self.sampler, num_workers=self.num_workers,
            generator=torch.Generator().manual_seed(config.seed * 100_003 + state.epoch),
            worker_init_fn=_seed_worker if self.num_workers else None,
            pin_memory=self.device.type == "cuda",
        )
        self.step_module.train()
        if config.model.freeze_batchnorm:
            freeze_batchnorm(self.model)
        bar = None
        if self.progress:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(self.sampler), desc=f"epoch {state.epoch + 1}/{config.training.epochs}",
                       leave=False)
        try:
            for x, y in loader:
                value = self.train_step(x, y)
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

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One optimiser step on one batch; returns the loss."""
        x = x.to(self.device, non_blocking=True)
        y = y.to(self.device, non_blocking=True)
        target = torch.searchsorted(self.classes_t, y)
        with torch.autocast(device_type=self.device.type, dtype=self.amp_dtype, enabled=self.use_amp):
            emb = self.step_module(x)
        emb = emb.float()
        indices = self.miner(emb, target) if self.use_miner_in_loop else None
        loss = self.loss_fn(emb, target, indices) if indices is not None else self.loss_fn(emb, target)
        if not torch.isfinite(loss):
            raise NonFiniteError(
                f"the {self.config.loss.name} loss became {loss.item()} at epoch {self.state.epoch + 1}, "
                f"step {self.state.step + 1}: lower the learning rates (optimizer.*_lr), set "
                "training.grad_clip (e.g. 1.0), or check loss.params"
            )
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
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
        emb, lab = embed(self.step_module, self.val_input, self.options.batch_size, self.device,
                         num_workers=self.num_workers, amp=self.use_amp)
        return scalar_metrics(evaluate(emb, lab, metrics=list(self.config.training.eval_metrics),
                                       **self.config.evaluation.metric_options()))

    def validate(self) -> dict[str, float] | None:
        """Validation metrics of the current model, logged as an ``eval`` event."""
        metrics = self.val_metrics()
        if metrics is None:
            return None
        record = {"event": "eval", "epoch": self.state.epoch, "step": self.state.step, "split": "val",
                  **metrics, "time": round(self.state.elapsed, 3)}
        self.run_log.log(record)
        self.state.history.append(record)
        return metrics

    def end_epoch(self) -> None:
        """Validate when due, keep the best model, apply patience, write ``last.pt``."""
        config, state = self.config, self.state
        if state.epoch % config.training.eval_every_epochs == 0 or state.stop_reason is not None:
            metrics = self.validate()
            if metrics is not None:
                if metrics["map_at_r"] > state.best_map:
                    state.best_map, state.best_step, state.best_epoch = metrics["map_at_r"], state.step, state.epoch
                    state.best_metrics, state.bad_evals = metrics, 0
                    self.save_best()
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
            state.best_step, state.best_epoch = state.step, state.epoch
            self.save_best()
        save_checkpoint(self.payload(), self.last_path)
        self.run_log.flush()
