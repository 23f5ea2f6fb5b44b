"""One trainer for every loss and miner.

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
model, optimiser, loss state (incl. cross-batch memory), sampler epoch and RNG states.

With ``model.frozen_trunk`` the trunk's features are computed once (and cached on disk) and
only the head is trained: the practical way to use a large pretrained trunk on a CPU.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from dmlkit.exceptions import CheckpointError, ConfigError, DataError, NonFiniteError
from dmlkit.training.checkpoint import (
    capture_rng_state,
    read_checkpoint,
    restore_rng_state,
    save_checkpoint,
    save_trunk,
)
from dmlkit.training.config import ExperimentConfig, config_from_dict, dump_config
from dmlkit.training.embed import embed, resolve_device
from dmlkit.training.runlog import RunLogger
from dmlkit.utils import atomic_write_json, provenance, save_embeddings, seed_everything

__all__ = [
    "TrainResult",
    "UnusedParametersWarning",
    "build_datasets",
    "build_loss",
    "build_miner",
    "build_model",
    "build_optimizer",
    "build_split",
    "embed_split",
    "train",
]

logger = logging.getLogger("dmlkit.training")

#: Keys that may differ between a checkpoint's config and the config used to resume it.
RESUMABLE_CHANGES = {
    "name",
    "data.root",
    "data.num_workers",
    "model.feature_cache_dir",
    "training.epochs",
    "training.patience",
    "training.device",
    "training.log_every",
    "training.eval_batch_size",
    "training.tensorboard",
    "training.csv_log",
}


class UnusedParametersWarning(UserWarning):
    """A module has trainable parameters that no optimiser updates (e.g. ``loss_lr: 0``)."""


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


# -- builders ------------------------------------------------------------------------------
def build_model(
    config: ExperimentConfig, *, in_channels: int | None = None, pretrained: bool | None = None
) -> nn.Module:
    """The :class:`dmlkit.models.EmbeddingModel` the config describes (BatchNorm frozen if asked).

    ``pretrained=False`` skips loading pretrained weights (used when a checkpoint supplies them).
    """
    from dmlkit.models import EmbeddingModel, build_trunk, freeze_batchnorm

    m = config.model
    try:
        trunk, feature_dim = build_trunk(
            m.trunk,
            pretrained=m.pretrained if pretrained is None else pretrained,
            weights=m.weights if (pretrained is None or pretrained) else None,
            in_channels=in_channels or m.in_channels,
            **m.trunk_options,
        )
    except (ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"model.trunk {m.trunk!r} (model.trunk_options {m.trunk_options}): {exc}") from exc
    model = EmbeddingModel(
        trunk, feature_dim, m.embedding_size, head=m.head, normalize=m.normalize
    )
    if m.freeze_batchnorm:
        freeze_batchnorm(model)
    return model


def embedding_size_of(model: nn.Module, config: ExperimentConfig) -> int:
    return int(getattr(model, "embedding_size", config.model.embedding_size))


def build_miner(config: ExperimentConfig) -> nn.Module | None:
    """The configured miner, or ``None``."""
    if config.miner is None:
        return None
    from dmlkit.miners import MINERS, get_miner

    if config.miner.name not in MINERS:
        raise ConfigError(f"miner.name {config.miner.name!r} is unknown; available: {sorted(MINERS)}")
    try:
        return get_miner(config.miner.name, **config.miner.params)
    except TypeError as exc:
        raise ConfigError(f"miner.params for {config.miner.name!r}: {exc}") from exc


def build_loss(
    config: ExperimentConfig, num_classes: int, embedding_size: int, miner: nn.Module | None = None
) -> nn.Module:
    """The configured loss; classification/proxy losses get ``num_classes``/``embedding_size``.

    Any loss param given as ``"auto"`` for ``num_classes``/``embedding_size`` is filled in too
    (e.g. ``{name: margin, params: {num_classes: auto}}``: one learnable beta per class).

    With ``loss.cross_batch_memory`` the loss is wrapped in ``CrossBatchMemory`` and ``miner``
    (if any) moves inside the wrapper, which mines against the memory.
    """
    from dmlkit.losses import LOSSES, get_loss

    name = config.loss.name
    if name not in LOSSES:
        raise ConfigError(f"loss.name {name!r} is unknown; available: {sorted(LOSSES)}")
    params = dict(config.loss.params)
    # "auto" asks the trainer for the value (e.g. margin loss with one beta per class)
    for key, value in (("num_classes", num_classes), ("embedding_size", embedding_size)):
        if params.get(key) == "auto":
            params[key] = value
    if getattr(LOSSES[name], "requires_num_classes", False):
        for key in ("num_classes", "embedding_size"):
            if key in params:
                raise ConfigError(
                    f"loss.params.{key} is set by the trainer from the data/model; remove it"
                )
        params.update(num_classes=num_classes, embedding_size=embedding_size)
    try:
        loss = get_loss(name, **params)
    except TypeError as exc:
        raise ConfigError(f"loss.params for {name!r}: {exc}") from exc
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"loss.params for {name!r}: {exc}") from exc
    if config.loss.cross_batch_memory:
        from dmlkit.losses import CrossBatchMemory

        loss = CrossBatchMemory(loss, embedding_size, config.loss.cross_batch_memory, miner=miner)
    return loss


def _split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    trunk = getattr(model, "trunk", None)
    trunk_ids = {id(p) for p in trunk.parameters()} if trunk is not None else set()
    trunk_params = [p for p in model.parameters() if id(p) in trunk_ids]
    other = [p for p in model.parameters() if id(p) not in trunk_ids]
    return trunk_params, other


def build_optimizer(
    config: ExperimentConfig, model: nn.Module, loss: nn.Module, miner: nn.Module | None = None,
    *, frozen_trunk: bool | None = None,
) -> torch.optim.Optimizer:
    """One optimiser with parameter groups ``trunk``, ``embedder`` and ``loss``, each its own lr.

    A group with lr 0 is left out and its parameters get ``requires_grad = False``; if that
    group is the loss's (or miner's) own weights, :class:`UnusedParametersWarning` is raised
    and logged, because those weights then stay at their random initialisation.
    """
    opt = config.optimizer
    frozen = config.model.frozen_trunk if frozen_trunk is None else frozen_trunk
    trunk_params, embedder_params = _split_parameters(model)
    trunk_params = [p for p in trunk_params if p.requires_grad]
    embedder_params = [p for p in embedder_params if p.requires_grad]
    loss_params = [p for p in loss.parameters() if p.requires_grad]
    miner_params = [p for p in miner.parameters() if p.requires_grad] if miner is not None else []
    groups: list[dict[str, Any]] = []
    if frozen or opt.trunk_lr == 0:
        for p in trunk_params:
            p.requires_grad_(False)
    elif trunk_params:
        groups.append({"name": "trunk", "params": trunk_params, "lr": opt.trunk_lr})
    if opt.embedder_lr == 0:
        for p in embedder_params:
            p.requires_grad_(False)
    elif embedder_params:
        groups.append({"name": "embedder", "params": embedder_params, "lr": opt.embedder_lr})
    for owner, params in (("loss", loss_params), ("miner", miner_params)):
        if not params:
            continue
        count = sum(p.numel() for p in params)
        if opt.loss_lr == 0:
            msg = (
                f"the {owner} {type(loss if owner == 'loss' else miner).__name__} has {count} "
                "trainable parameters but optimizer.loss_lr is 0, so no optimiser updates them "
                "and they stay at their random initialisation: set optimizer.loss_lr > 0 "
                "(the Reality Check tunes it, e.g. 1e-4)"
            )
            warnings.warn(msg, UnusedParametersWarning, stacklevel=3)
            logger.warning("WARNING: %s", msg)
            for p in params:  # fixed, so no gradient is computed for them
                p.requires_grad_(False)
        else:
            groups.append({"name": owner, "params": params, "lr": opt.loss_lr})
    if not groups:
        raise ConfigError(
            "nothing to train: every learning rate is 0 or every parameter is frozen "
            "(check optimizer.trunk_lr / embedder_lr / loss_lr and model.frozen_trunk)"
        )
    kw: dict[str, Any] = {"weight_decay": opt.weight_decay}
    if opt.name == "rmsprop":
        return torch.optim.RMSprop(groups, lr=opt.embedder_lr, momentum=opt.momentum, **kw)
    if opt.name == "sgd":
        return torch.optim.SGD(groups, lr=opt.embedder_lr, momentum=opt.momentum, **kw)
    if opt.name == "adam":
        return torch.optim.Adam(groups, lr=opt.embedder_lr, **kw)
    return torch.optim.AdamW(groups, lr=opt.embedder_lr, **kw)


# -- data ------------------------------------------------------------------------------------
def build_split(config: ExperimentConfig, dataset):
    """The :class:`dmlkit.data.ClassSplit` the config describes for ``dataset``.

    ``val_fraction`` carves validation classes out of the training classes: the last ones in
    the dataset's class order (``order: default``) or a seeded random choice (``random``).
    """
    from dmlkit.data import ClassSplit, default_split, split_classes

    sc = config.data.split
    if sc.kind == "default":
        return default_split(dataset, val_fraction=sc.val_fraction, order=sc.order, seed=sc.seed)
    if sc.kind == "ratio":
        split = split_classes(dataset.classes, sc.ratios, order=sc.order, seed=sc.seed)
    else:
        split = ClassSplit.from_json(sc.path)
        split.check(dataset)
    if sc.val_fraction > 0:
        if split.val:
            raise ConfigError(
                "data.split.val_fraction carves validation classes out of the training classes, "
                "but this split already has validation classes: set val_fraction to 0"
            )
        train = list(split.train)
        n_val = max(1, int(round(sc.val_fraction * len(train))))
        if n_val >= len(train) - 1:
            raise ConfigError(
                f"data.split.val_fraction={sc.val_fraction} leaves fewer than 2 training classes"
            )
        if sc.order == "random":
            train = np.random.default_rng(sc.seed).permutation(train).tolist()
        val = sorted(int(c) for c in train[-n_val:])
        split = ClassSplit(train=sorted(int(c) for c in train[:-n_val]), val=val,
                           test=split.test, meta={**split.meta, "val_fraction": sc.val_fraction})
    return split


def build_datasets(
    config: ExperimentConfig,
    splits: tuple[str, ...] = ("train", "val", "test"),
    *,
    data_root: str | Path | None = None,
) -> dict[str, Any]:
    """``{split name: MetricDataset or None}`` from the config, with the configured transforms.

    Training data gets the train-time augmentation, except in frozen-trunk mode (features are
    computed once, so augmentation cannot vary). The split object is under key ``"split"``.
    """
    from dmlkit.data import get_transforms, load_dataset
    from dmlkit.utils import data_root as resolve_root

    d = config.data
    root = resolve_root(data_root if data_root is not None else d.root)
    try:
        dataset = load_dataset(d.dataset, root=root, **d.options)
    except TypeError as exc:
        raise ConfigError(f"data.options for {d.dataset!r}: {exc}") from exc
    split = build_split(config, dataset)
    out: dict[str, Any] = {"split": split}
    for name in splits:
        ids = [int(c) for c in getattr(split, name)]
        if not ids:
            out[name] = None
            continue
        subset = dataset.subset_classes(ids)
        if d.transform is not None:
            augment = name == "train" and not config.model.frozen_trunk
            subset = subset.with_transform(get_transforms(d.transform, train=augment, image_size=d.image_size))
        out[name] = subset
    return out


def _feature_cache_dir(config: ExperimentConfig) -> Path:
    if config.model.feature_cache_dir:
        return Path(config.model.feature_cache_dir).expanduser()
    return Path.home() / ".cache" / "dmlkit" / "features"


def trunk_features(model: nn.Module, dataset, config: ExperimentConfig, device: torch.device,
                   progress: bool = False):
    """The trunk's features of ``dataset`` as an in-memory feature dataset (cached on disk).

    The cache key covers the trunk's name and weights, the dataset's fingerprint and its
    transform (:func:`dmlkit.models.extract_features`).
    """
    from dmlkit.models import extract_features

    return extract_features(
        model.trunk, dataset, batch_size=config.training.eval_batch_size, device=device,
        cache_dir=_feature_cache_dir(config), num_workers=config.data.num_workers,
        progress=progress, amp=config.training.amp,
    )


class _HeadOnly(nn.Module):
    """``features -> embeddings`` with the model's own head (frozen-trunk mode)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model.embed_features(features)


def embed_split(model: nn.Module, dataset, config: ExperimentConfig, device: str | torch.device = "auto",
                progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Embed a dataset as the run saw it (via cached trunk features in frozen-trunk mode)."""
    dev = resolve_device(device)
    if config.model.frozen_trunk:
        feats = trunk_features(model, dataset, config, dev, progress=progress)
        return embed(_HeadOnly(model), feats, config.training.eval_batch_size, dev)
    return embed(model, dataset, config.training.eval_batch_size, dev,
                 num_workers=config.data.num_workers, amp=config.training.amp, progress=progress)


# -- the training loop ---------------------------------------------------------------------------
def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(data, dict):
        out: dict[str, Any] = {}
        for k, v in data.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: data}


def _check_resumable(saved: dict[str, Any], config: ExperimentConfig) -> None:
    old, new = _flatten(saved), _flatten(config.model_dump(mode="json"))
    changed = sorted(k for k in set(old) | set(new)
                     if old.get(k) != new.get(k) and k not in RESUMABLE_CHANGES)
    if changed:
        raise CheckpointError(
            "cannot resume: the config differs from the checkpoint's in "
            + ", ".join(f"{k} ({old.get(k)!r} -> {new.get(k)!r})" for k in changed)
            + ". Resume with the run's own config.yaml, or start a new run directory"
        )


def _seed_worker(worker_id: int) -> None:
    import random

    seed = torch.initial_seed() % 2**32
    np.random.seed(seed)
    random.seed(seed)


def _set_train_mode(module: nn.Module, model: nn.Module, config: ExperimentConfig) -> None:
    module.train()
    if config.model.freeze_batchnorm:
        from dmlkit.models import freeze_batchnorm

        freeze_batchnorm(model)


def _scalar_metrics(metrics: dict[str, Any]) -> dict[str, float]:
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
        run_dir: where config, logs, checkpoints, embeddings and metrics go.
        train_set, val_set: explicit datasets (e.g. the protocol's cross-validation folds);
            by default both come from ``config.data`` (validation = held-out training classes).
        test_set: if given, after training the best checkpoint embeds it, writes
            ``embeddings/test.npz`` and adds test metrics to ``metrics.json``. The test set is
            never used for model selection.
        resume: continue from ``run_dir/checkpoints/last.pt`` (bit-exact on CPU).
        progress: show progress bars.
        data_root: overrides ``config.data.root`` when datasets come from the config.
    """
    if not isinstance(config, ExperimentConfig):
        config = config_from_dict(config)
    run_dir = Path(run_dir)
    ckpt_dir = run_dir / "checkpoints"
    last_path, best_path = ckpt_dir / "last.pt", ckpt_dir / "best.pt"
    payload: dict[str, Any] | None = None
    if resume:
        if not last_path.exists():
            raise CheckpointError(
                f"nothing to resume: {last_path} does not exist; run without --resume to start"
            )
        payload = read_checkpoint(last_path)
        _check_resumable(payload["config"], config)
    elif last_path.exists():
        raise CheckpointError(
            f"{run_dir} already holds a run ({last_path}): pass --resume (resume=True) to continue "
            "it, or choose another run directory"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    dump_config(config, run_dir / "config.yaml")
    if payload is None or not (run_dir / "provenance.json").exists():
        atomic_write_json(run_dir / "provenance.json", provenance(config.seed, extra={"run_dir": str(run_dir)}))

    device = resolve_device(config.training.device)
    seed_everything(config.seed)
    if train_set is None:
        sets = build_datasets(config, ("train", "val"), data_root=data_root)
        train_set = sets["train"]
        val_set = sets["val"] if val_set is None else val_set
    if train_set is None or len(train_set) == 0:
        raise DataError("the training split is empty: check data.split")

    train_classes = np.unique(np.asarray(train_set.labels, dtype=np.int64))
    if train_classes.size < 2:
        raise DataError(f"training needs at least 2 classes, got {train_classes.size}")
    if payload is not None:
        saved_classes = payload["train_classes"].numpy()
        if not np.array_equal(saved_classes, train_classes):
            raise CheckpointError("cannot resume: the training classes differ from the checkpoint's")
    if val_set is not None and len(val_set) == 0:
        val_set = None
    if val_set is not None and np.intersect1d(val_set.labels, train_classes).size:
        warnings.warn("validation classes overlap the training classes: the split is not "
                      "class-disjoint, so validation MAP@R is optimistic", stacklevel=2)
    if test_set is not None:
        seen = train_classes if val_set is None else np.union1d(train_classes, val_set.labels)
        if np.intersect1d(test_set.labels, seen).size:
            warnings.warn("test classes overlap the training/validation classes: the test "
                          "metrics are not those of unseen classes", stacklevel=2)

    model = build_model(config).to(device)
    frozen = config.model.frozen_trunk
    if frozen:
        for p in model.trunk.parameters():
            p.requires_grad_(False)
        feature_set = train_set
        if config.data.transform is not None and hasattr(train_set, "with_transform"):
            # features are computed once, so a random augmentation could not vary by epoch:
            # use the deterministic evaluation transform (also keeps the feature cache valid)
            from dmlkit.data import get_transforms

            feature_set = train_set.with_transform(get_transforms(
                config.data.transform, train=False, image_size=config.data.image_size))
        train_input = trunk_features(model, feature_set, config, device, progress=progress)
        val_input = None if val_set is None else trunk_features(model, val_set, config, device, progress=progress)
        step_module: nn.Module = _HeadOnly(model)
        num_workers = 0
    else:
        train_input, val_input, step_module = train_set, val_set, model
        num_workers = config.data.num_workers
    emb_size = embedding_size_of(model, config)

    from dmlkit.samplers import MPerClassSampler

    miner = build_miner(config)
    loss_fn = build_loss(config, int(train_classes.size), emb_size, miner=miner)
    use_miner_in_loop = miner is not None and not config.loss.cross_batch_memory
    loss_fn.to(device)
    if miner is not None:
        miner.to(device)
    optimizer = build_optimizer(config, model, loss_fn, miner, frozen_trunk=frozen)
    trainable = [p for g in optimizer.param_groups for p in g["params"]]
    sampler = MPerClassSampler(
        np.asarray(train_input.labels), samples_per_class=config.sampler.samples_per_class,
        classes_per_batch=config.sampler.classes_per_batch,
        batches_per_epoch=config.sampler.batches_per_epoch, seed=config.seed,
    )
    use_amp = config.training.amp and device.type == "cuda"
    if config.training.amp and not use_amp:
        logger.info("training.amp is on but the device is %s: mixed precision is CUDA-only, using float32", device)
    amp_dtype = torch.bfloat16 if use_amp and torch.cuda.is_bf16_supported() else torch.float16
    scaler = torch.amp.GradScaler("cuda", enabled=use_amp and amp_dtype == torch.float16)
    classes_t = torch.as_tensor(train_classes, device=device)

    run_log = RunLogger(run_dir, csv_log=config.training.csv_log, tensorboard=config.training.tensorboard)
    state: dict[str, Any] = {
        "best_map": -math.inf, "best_step": 0, "best_epoch": 0, "best_metrics": {},
        "bad_evals": 0, "history": [], "elapsed": 0.0, "stop_reason": None,
    }
    epoch, step = 0, 0
    if payload is not None:
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optimizer"])
        loss_fn.load_state_dict(payload["loss"])
        if miner is not None and payload.get("miner") is not None:
            miner.load_state_dict(payload["miner"])
        if payload.get("scaler"):
            scaler.load_state_dict(payload["scaler"])
        state.update(payload["trainer"])
        epoch, step = int(payload["epoch"]), int(payload["step"])
        restore_rng_state(payload["rng"])
        run_log.truncate_after(step)
        if state["stop_reason"] == "epochs" and epoch < config.training.epochs:
            state["stop_reason"] = None  # the run was extended with more epochs
        logger.info("resumed %s at epoch %d, step %d", run_dir, epoch, step)

    trunk_file = None
    if frozen:  # the trunk never changes: store it once instead of in every checkpoint
        trunk_file = "trunk.pt"
        if not (ckpt_dir / trunk_file).exists():
            save_trunk(model.trunk.state_dict(), ckpt_dir / trunk_file)

    def model_state() -> dict[str, Any]:
        state_dict = model.state_dict()
        if trunk_file is None:
            return state_dict
        return {k: v for k, v in state_dict.items() if not k.startswith("trunk.")}

    def make_payload(epoch_done: int) -> dict[str, Any]:
        return {
            "config": config.model_dump(mode="json"),
            "model": model_state(),
            "trunk_file": trunk_file,
            "optimizer": optimizer.state_dict(),
            "scaler": scaler.state_dict() if scaler.is_enabled() else None,
            "loss": loss_fn.state_dict(),
            "miner": miner.state_dict() if miner is not None else None,
            "sampler_epoch": epoch_done,
            "rng": capture_rng_state(),
            "epoch": epoch_done,
            "step": step,
            "trainer": dict(state),
            "train_classes": torch.as_tensor(train_classes),
            "embedding_size": emb_size,
        }

    def validate(epoch_done: int) -> dict[str, float] | None:
        if val_input is None:
            return None
        from dmlkit.metrics import evaluate

        emb, lab = embed(step_module, val_input, config.training.eval_batch_size, device,
                         num_workers=num_workers, amp=use_amp)
        metrics = _scalar_metrics(evaluate(emb, lab, metrics=list(config.training.eval_metrics)))
        record = {"event": "eval", "epoch": epoch_done, "step": step, "split": "val", **metrics,
                  "time": round(state["elapsed"], 3)}
        run_log.log(record)
        state["history"].append(record)
        return metrics

    epochs = config.training.epochs
    max_steps = config.training.max_steps
    t_start = time.perf_counter() - state["elapsed"]
    bar = None
    try:
        while state["stop_reason"] is None and epoch < epochs:
            sampler.set_epoch(epoch)
            loader = DataLoader(
                train_input, batch_sampler=sampler, num_workers=num_workers,
                generator=torch.Generator().manual_seed(config.seed * 100_003 + epoch),
                worker_init_fn=_seed_worker if num_workers else None,
                pin_memory=device.type == "cuda",
            )
            _set_train_mode(step_module, model, config)
            if progress:
                from tqdm.auto import tqdm

                bar = tqdm(total=len(sampler), desc=f"epoch {epoch + 1}/{epochs}", leave=False)
            for x, y in loader:
                x = x.to(device, non_blocking=True)
                y = y.to(device, non_blocking=True)
                target = torch.searchsorted(classes_t, y)
                with torch.autocast(device_type=device.type, dtype=amp_dtype, enabled=use_amp):
                    emb = step_module(x)
                emb = emb.float()
                indices = miner(emb, target) if use_miner_in_loop else None
                loss = loss_fn(emb, target, indices) if indices is not None else loss_fn(emb, target)
                if not torch.isfinite(loss):
                    raise NonFiniteError(
                        f"the {config.loss.name} loss became {loss.item()} at epoch {epoch + 1}, step "
                        f"{step + 1}: lower the learning rates (optimizer.*_lr), set "
                        "training.grad_clip (e.g. 1.0), or check loss.params"
                    )
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                if config.training.grad_clip is not None:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(trainable, config.training.grad_clip)
                scaler.step(optimizer)
                scaler.update()
                step += 1
                value = float(loss.detach())
                if step % config.training.log_every == 0 or step == 1:
                    state["elapsed"] = time.perf_counter() - t_start
                    lrs = {g.get("name", str(i)): g["lr"] for i, g in enumerate(optimizer.param_groups)}
                    record = {"event": "train", "epoch": epoch + 1, "step": step, "loss": value,
                              "lr": lrs.get("embedder", next(iter(lrs.values()))),
                              **{f"lr_{k}": v for k, v in lrs.items()},
                              "time": round(state["elapsed"], 3)}
                    if use_miner_in_loop and getattr(miner, "stats", None):
                        record.update({f"miner_{k}": v for k, v in miner.stats.items()})
                    run_log.log(record)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{value:.4f}")
                if max_steps is not None and step >= max_steps:
                    state["stop_reason"] = "max_steps"
                    break
            if bar is not None:
                bar.close()
                bar = None
            epoch += 1
            state["elapsed"] = time.perf_counter() - t_start
            if state["stop_reason"] is None and epoch >= epochs:
                state["stop_reason"] = "epochs"
            if epoch % config.training.eval_every_epochs == 0 or state["stop_reason"] is not None:
                metrics = validate(epoch)
                if metrics is not None:
                    if metrics["map_at_r"] > state["best_map"]:
                        state.update(best_map=metrics["map_at_r"], best_step=step, best_epoch=epoch,
                                     best_metrics=metrics, bad_evals=0)
                        save_checkpoint(_best_payload(make_payload(epoch)), best_path)
                    else:
                        state["bad_evals"] += 1
                    if progress:
                        logger.info("epoch %d step %d: val MAP@R %.4f P@1 %.4f (best %.4f)", epoch, step,
                                    metrics["map_at_r"], metrics.get("precision_at_1", float("nan")),
                                    state["best_map"])
                    patience = config.training.patience
                    if patience is not None and state["bad_evals"] >= patience and state["stop_reason"] is None:
                        state["stop_reason"] = "patience"
                        logger.info("early stopping: no validation MAP@R gain in %d evaluations", patience)
            if val_input is None and state["stop_reason"] is not None:
                state.update(best_step=step, best_epoch=epoch)
                save_checkpoint(_best_payload(make_payload(epoch)), best_path)
            save_checkpoint(make_payload(epoch), last_path)
            run_log.flush()
    finally:
        if bar is not None:
            bar.close()
        run_log.close()

    if val_input is None:
        warnings.warn("no validation classes: checkpoints/best.pt is the last model "
                      "(set data.split.val_fraction to select on validation MAP@R)", stacklevel=2)
    if not best_path.exists():  # e.g. resumed a finished run whose best.pt was removed
        save_checkpoint(_best_payload(make_payload(epoch)), best_path)

    result = TrainResult(
        run_dir=run_dir, best_checkpoint=best_path, best_step=int(state["best_step"]),
        val_metrics=dict(state["best_metrics"]), history=list(state["history"]),
        last_checkpoint=last_path, epochs_completed=epoch, steps=step,
        stop_reason=str(state["stop_reason"]), train_seconds=float(state["elapsed"]),
    )
    metrics_out: dict[str, Any] = {"best_step": result.best_step, "best_epoch": int(state["best_epoch"]),
                                   "val": result.val_metrics}
    if test_set is not None:
        best = read_checkpoint(best_path)
        model.load_state_dict(best["model"])
        emb, lab = embed_split(model, test_set, config, device, progress=progress)
        from dmlkit.metrics import evaluate

        result.test_metrics = _scalar_metrics(evaluate(emb, lab, metrics=list(config.training.eval_metrics)))
        save_embeddings(run_dir / "embeddings" / "test.npz", emb, lab, indices=dataset_rows(test_set))
        metrics_out["test"] = result.test_metrics
    atomic_write_json(run_dir / "metrics.json", metrics_out)
    return result


def _best_payload(payload: dict[str, Any]) -> dict[str, Any]:
    """best.pt keeps what inference needs (no optimiser/RNG state)."""
    keep = ("config", "model", "trunk_file", "loss", "epoch", "step", "trainer", "train_classes",
            "embedding_size")
    return {k: payload[k] for k in keep}


def dataset_rows(dataset) -> np.ndarray:
    """Row numbers of a (subset) dataset in its full dataset, for ``embeddings/*.npz``."""
    rows = getattr(dataset, "_rows", None)
    return np.asarray(rows, dtype=np.int64) if rows is not None else np.arange(len(dataset), dtype=np.int64)
