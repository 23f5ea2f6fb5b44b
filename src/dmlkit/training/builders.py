"""Config -> objects: each builder takes the config section it needs.

``build_model(config.model)``, ``build_miner(config.miner)``, ``build_loss(config.loss, ...)``,
``build_optimizer(config.optimizer, ...)``, ``build_split(config.data.split, dataset)``,
``build_datasets(config.data, ...)`` and ``build_sampler(config.sampler, labels, seed)``.
Each also accepts a whole :class:`~dmlkit.config.ExperimentConfig` (and reads its section),
which is how they were called before the sections were separated. Bad values raise
:class:`~dmlkit.exceptions.ConfigError` naming the config key.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from dmlkit.config import (
    DataConfig,
    ExperimentConfig,
    LossConfig,
    MinerConfig,
    ModelConfig,
    OptimizerConfig,
    SamplerConfig,
    SplitConfig,
)
from dmlkit.data import ClassSplit, default_split, get_transforms, split_classes
from dmlkit.data.transforms import PRESETS as TRANSFORM_PRESETS
from dmlkit.exceptions import ConfigError, DependencyError, DmlkitError
from dmlkit.losses import LOSSES, CombinedLoss, CrossBatchMemory, ProxyLoss, get_loss
from dmlkit.miners import MINERS, get_miner
from dmlkit.models import (
    TRUNKS,
    EmbeddingModel,
    build_trunk,
    freeze_batchnorm,
    mark_fresh_batchnorm,
    trunk_loads_weights,
)
from dmlkit.samplers import MPerClassSampler
from dmlkit.training.data_root import load_dataset_at
from dmlkit.validation import check_parameter_numbers

__all__ = [
    "UnusedParametersWarning",
    "build_datasets",
    "build_loss",
    "build_miner",
    "build_model",
    "build_optimizer",
    "build_sampler",
    "build_split",
    "check_world_size",
    "loaded_trunk",
    "pairing_problems",
    "split_parameters",
    "without_memory",
]

logger = logging.getLogger("dmlkit.training")
_S = TypeVar("_S")


class UnusedParametersWarning(UserWarning):
    """A module has trainable parameters that no optimiser updates (e.g. ``loss_lr: 0``)."""


def _section(config: Any, name: str, kind: type[_S]) -> _S:
    """``config.<name>`` of a whole experiment config, or ``config`` itself if it is the section."""
    if isinstance(config, ExperimentConfig):
        return getattr(config, name)
    if isinstance(config, kind):
        return config
    raise TypeError(f"expected {kind.__name__} (config.{name}) or ExperimentConfig, got {type(config).__name__}")


def build_model(
    config: ModelConfig | ExperimentConfig, *, in_channels: int | None = None, pretrained: bool | None = None
) -> EmbeddingModel:
    """The :class:`dmlkit.models.EmbeddingModel` a ``model`` section describes (BatchNorm frozen if asked).

    ``pretrained=False`` skips loading pretrained weights (used when a checkpoint supplies them).
    The built model owns ``model.embedding_size`` (the trunk's width for an ``identity`` head).
    ``model.freeze_batchnorm`` freezes the trunk's BatchNorm only where its statistics were
    loaded (:func:`loaded_trunk`); a randomly initialised trunk's BatchNorm is marked fresh
    (:func:`dmlkit.models.mark_fresh_batchnorm`) and trains, since frozen at mean 0,
    variance 1 it would be the identity (docs/guide.md, "Trunks and the embedding model").
    """
    m = _section(config, "model", ModelConfig)
    try:
        trunk, feature_dim = build_trunk(
            m.trunk,
            pretrained=m.pretrained if pretrained is None else pretrained,
            weights=m.weights if (pretrained is None or pretrained) else None,
            in_channels=in_channels or m.in_channels,
            **m.trunk_options,
        )
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        # RuntimeError: torch's load_state_dict on weights of other shapes (timm's loader)
        first = " ".join(str(exc).split())[:300]
        raise ConfigError(f"model.trunk {m.trunk!r} (model.trunk_options {m.trunk_options}): {first}") from None
    model = EmbeddingModel(trunk, feature_dim, m.embedding_size, head=m.head, normalize=m.normalize)
    # decided by the config, not by ``pretrained``: a checkpoint's rebuild is the trained model
    if not loaded_trunk(m):
        mark_fresh_batchnorm(model.trunk)  # any later freeze_batchnorm(model) leaves it training
    elif m.freeze_batchnorm:
        freeze_batchnorm(model.trunk)  # loaded statistics (not small_cnn's fresh bn_neck)
    return model


def loaded_trunk(config: ModelConfig | ExperimentConfig) -> bool:
    """Whether the ``model`` section's trunk starts from loaded weights (``model.weights``, or
    published weights with ``model.pretrained``): :func:`dmlkit.models.trunk_loads_weights`.
    ``model.freeze_batchnorm`` applies to such a trunk only (:func:`build_model`)."""
    m = _section(config, "model", ModelConfig)
    return trunk_loads_weights(m.trunk, m.pretrained, m.weights)


def model_setting_problems(config: ExperimentConfig) -> list[tuple[str, str]]:
    """``(key, message)`` for each ``data.transform``, ``model.weights`` and ``model.trunk`` value
    that :func:`build_model` or the datasets would refuse, found without building anything (so
    the preflight reports them before a run directory is written)."""
    problems = []
    m = config.model
    if config.data.transform is not None and config.data.transform.lower() not in TRANSFORM_PRESETS:
        problems.append(("data.transform", f"{config.data.transform!r} is unknown; choose one of "
                                           f"{list(TRANSFORM_PRESETS)}"))
    if m.weights is not None and not Path(m.weights).expanduser().exists():
        problems.append(("model.weights", f"file not found: {m.weights}"))
    name = m.trunk.strip()
    if not name.startswith("timm:") and name not in TRUNKS:
        import torchvision

        if name.removeprefix("torchvision:") not in set(torchvision.models.list_models()):
            problems.append(("model.trunk", f"{m.trunk!r} is unknown: use one of {sorted(TRUNKS)}, a "
                                            "torchvision model (e.g. resnet50) or timm:NAME"))
    if m.trunk_options and not problems:
        problems += _trunk_option_problems(m, config.model.in_channels)
    return problems


def _trunk_option_problems(m: ModelConfig, in_channels: int) -> list[tuple[str, str]]:
    """``model.trunk_options`` the trunk refuses, or whose features the head refuses (e.g.
    ``widths: [8, 0]``: 0 features), found by building both on the ``meta`` device (shapes
    only: no memory, no weights read or downloaded)."""
    what = f"trunk {m.trunk!r}"
    try:
        with torch.device("meta"), warnings.catch_warnings():
            # torch's "Initializing zero-element tensors is a no-op": the refusal says more
            warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
            trunk, feature_dim = build_trunk(m.trunk, pretrained=False, in_channels=in_channels,
                                             **m.trunk_options)
            what = f"the {m.head} head, for the trunk's {feature_dim} features"
            EmbeddingModel(trunk, feature_dim, m.embedding_size, head=m.head, normalize=m.normalize)
    except DependencyError:  # a missing extra (timm, efficientnet) is not the options' fault
        raise
    except (DmlkitError, ValueError, KeyError, TypeError, RuntimeError) as exc:
        reason = " ".join(str(exc).split())[:300] or type(exc).__name__
        return [("model.trunk_options", f"{m.trunk_options} is refused by {what}: {reason}")]
    return []


def build_miner(config: MinerConfig | ExperimentConfig | None) -> nn.Module | None:
    """The miner a ``miner`` section describes, or ``None`` (no section)."""
    m = config.miner if isinstance(config, ExperimentConfig) else config
    if m is None:
        return None
    if not isinstance(m, MinerConfig):
        raise TypeError(f"expected MinerConfig (config.miner) or ExperimentConfig, got {type(m).__name__}")
    if m.name not in MINERS:
        raise ConfigError(f"miner.name {m.name!r} is unknown; available: {sorted(MINERS)}")
    check_parameter_numbers("miner.params", MINERS[m.name], m.params)
    try:
        return get_miner(m.name, **m.params)
    except TypeError as exc:
        raise ConfigError(f"miner.params for {m.name!r}: {exc}") from exc


def build_loss(
    config: LossConfig | ExperimentConfig, num_classes: int, embedding_size: int,
    miner: nn.Module | None = None,
) -> nn.Module:
    """The loss a ``loss`` section describes; classification/proxy losses get ``num_classes``/``embedding_size``.

    Any loss param given as ``"auto"`` for ``num_classes``/``embedding_size`` is filled in too
    (e.g. ``{name: margin, params: {num_classes: auto}}``: one learnable beta per class).

    With ``loss.cross_batch_memory`` the loss is wrapped in ``CrossBatchMemory`` (Wang et al.,
    CVPR 2020) and ``miner`` (if any) moves inside the wrapper, which mines against the memory.
    """
    section = _section(config, "loss", LossConfig)
    name = section.name
    if name not in LOSSES:
        raise ConfigError(f"loss.name {name!r} is unknown; available: {sorted(LOSSES)}")
    params = dict(section.params)
    # "auto" asks the trainer for the value (e.g. margin loss with one beta per class)
    for key, value in (("num_classes", num_classes), ("embedding_size", embedding_size)):
        if params.get(key) == "auto":
            params[key] = value
    if getattr(LOSSES[name], "requires_num_classes", False):
        for key in ("num_classes", "embedding_size"):
            if key in params:
                raise ConfigError(f"loss.params.{key} is set by the trainer from the data/model; remove it")
        params.update(num_classes=num_classes, embedding_size=embedding_size)
    check_parameter_numbers("loss.params", LOSSES[name], params)
    try:
        loss = get_loss(name, **params)
    except TypeError as exc:
        raise ConfigError(f"loss.params for {name!r}: {exc}") from exc
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"loss.params for {name!r}: {exc}") from exc
    if section.cross_batch_memory:
        loss = CrossBatchMemory(loss, embedding_size, section.cross_batch_memory, miner=miner)
    return loss


def without_memory(section: LossConfig) -> LossConfig:
    """``section`` without ``cross_batch_memory`` (to check the loss's own parameters alone)."""
    return section.model_copy(update={"cross_batch_memory": None})


def pairing_problems(config: ExperimentConfig, loss_key: str = "loss",
                     miner_key: str = "miner") -> list[tuple[str, str]]:
    """``(key, message)`` for a miner or a cross-batch memory that the loss cannot use, found
    from the registry without building anything (the key to set to ``null`` in CLI spelling).

    A miner is refused by a loss that does not accept indices (classification/proxy losses,
    coupled clusters, prototypical, which mine or weigh pairs themselves); the memory
    (:class:`~dmlkit.losses.CrossBatchMemory`) by those and by ``combined``, which passes its
    terms no reference set. Without this check the first would fail at the first training
    step, the second in :func:`build_loss` (a ``loss.params`` problem in the preflight).
    """
    name = config.loss.name
    cls = LOSSES.get(name)
    if cls is None:  # an unknown name is reported under loss.name
        return []
    quoted = f"{loss_key}.name {name!r}"
    if config.loss.cross_batch_memory:
        if issubclass(cls, CombinedLoss):
            why = "gives its terms no reference set"
        elif issubclass(cls, ProxyLoss):
            why = "compares embeddings with its own proxies/weights"
        elif not cls.accepts_indices:
            why = "does not take a miner's indices"
        else:
            return []
        return [(f"{loss_key}.cross_batch_memory",
                 f"is {config.loss.cross_batch_memory} but {quoted} {why}: the memory needs a "
                 "pair-based loss")]
    if config.miner is not None and config.miner.name in MINERS and not cls.accepts_indices:
        return [(miner_key, f"{config.miner.name!r} is set but {quoted} does not take a miner's "
                            "pairs or triplets (the first training step would refuse them)")]
    if config.miner is not None and config.miner.name in MINERS and issubclass(cls, CombinedLoss):
        terms = (config.loss.params or {}).get("losses") or []
        takers = [t for t in terms if isinstance(t, dict) and t.get("use_indices", True)
                  and getattr(LOSSES.get(str(t.get("name"))), "accepts_indices", False)]
        if terms and not takers:  # the miner would run every step and be ignored
            return [(miner_key, f"{config.miner.name!r} is set but no term of {quoted} takes a "
                                "miner's pairs or triplets (each is a proxy/classification loss or "
                                "has use_indices: false)")]
    return []


def split_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(trunk parameters, every other parameter)`` of a model with a ``trunk`` attribute."""
    trunk = getattr(model, "trunk", None)
    trunk_ids = {id(p) for p in trunk.parameters()} if trunk is not None else set()
    trunk_params = [p for p in model.parameters() if id(p) in trunk_ids]
    other = [p for p in model.parameters() if id(p) not in trunk_ids]
    return trunk_params, other


def build_optimizer(
    config: OptimizerConfig | ExperimentConfig, model: nn.Module, loss: nn.Module,
    miner: nn.Module | None = None, *, frozen_trunk: bool | None = None,
) -> torch.optim.Optimizer:
    """One optimiser with parameter groups ``trunk``, ``embedder`` and ``loss``, each its own lr.

    ``frozen_trunk`` defaults to ``model.frozen_trunk`` of a whole config (``False`` for a bare
    ``optimizer`` section). A group with lr 0 is left out and its parameters get
    ``requires_grad = False``; if that group is the loss's (or miner's) own weights,
    :class:`UnusedParametersWarning` is raised and logged, because those weights then stay at
    their random initialisation.
    """
    opt = _section(config, "optimizer", OptimizerConfig)
    if frozen_trunk is None:
        frozen_trunk = config.model.frozen_trunk if isinstance(config, ExperimentConfig) else False
    trunk_params, embedder_params = split_parameters(model)
    trunk_params = [p for p in trunk_params if p.requires_grad]
    embedder_params = [p for p in embedder_params if p.requires_grad]
    loss_params = [p for p in loss.parameters() if p.requires_grad]
    miner_params = [p for p in miner.parameters() if p.requires_grad] if miner is not None else []
    groups: list[dict[str, Any]] = []
    if frozen_trunk or opt.trunk_lr == 0:
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


def build_sampler(config: SamplerConfig | ExperimentConfig, labels: Any, seed: int, *,
                  num_replicas: int = 1, rank: int = 0) -> MPerClassSampler:
    """The M-per-class batch sampler a ``sampler`` section describes, over ``labels``.

    ``num_replicas``/``rank`` (distributed training): every rank draws the same *global*
    ``classes_per_batch x samples_per_class`` batch from ``seed`` and yields its contiguous
    share of ``C x M / num_replicas`` items, so the gathered batch is the one-process batch.
    """
    s = _section(config, "sampler", SamplerConfig)
    return MPerClassSampler(
        np.asarray(labels), samples_per_class=s.samples_per_class, classes_per_batch=s.classes_per_batch,
        batches_per_epoch=s.batches_per_epoch, seed=seed, num_replicas=num_replicas, rank=rank,
    )


def check_world_size(config: SamplerConfig | ExperimentConfig, world_size: int) -> None:
    """Refuse a world size that does not divide the global batch (before anything starts)."""
    s = _section(config, "sampler", SamplerConfig)
    if world_size > 1 and s.batch_size % world_size:
        raise ConfigError(
            f"the global batch sampler.classes_per_batch x sampler.samples_per_class = "
            f"{s.classes_per_batch} x {s.samples_per_class} = {s.batch_size} items cannot be split "
            f"evenly over {world_size} processes: make it a multiple of {world_size} (e.g. "
            f"--set sampler.classes_per_batch=...) or start another number of processes"
        )


# -- data ------------------------------------------------------------------------------------
def build_split(config: SplitConfig | DataConfig | ExperimentConfig, dataset) -> ClassSplit:
    """The :class:`dmlkit.data.ClassSplit` a ``data.split`` section describes for ``dataset``.

    ``val_fraction`` carves validation classes out of the training classes: the last ones in
    the dataset's class order (``order: default``) or a seeded random choice (``random``).
    """
    if isinstance(config, ExperimentConfig):
        config = config.data
    sc = config.split if isinstance(config, DataConfig) else _section(config, "split", SplitConfig)
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
            raise ConfigError(f"data.split.val_fraction={sc.val_fraction} leaves fewer than 2 training classes")
        if sc.order == "random":
            train = np.random.default_rng(sc.seed).permutation(train).tolist()
        val = sorted(int(c) for c in train[-n_val:])
        split = ClassSplit(train=sorted(int(c) for c in train[:-n_val]), val=val,
                           test=split.test, meta={**split.meta, "val_fraction": sc.val_fraction})
    return split


def build_datasets(
    config: DataConfig | ExperimentConfig,
    splits: tuple[str, ...] = ("train", "val", "test"),
    *,
    data_root: str | Path | None = None,
    augment_train: bool | None = None,
    dataset: Any = None,
    split: ClassSplit | None = None,
) -> dict[str, Any]:
    """``{split name: MetricDataset or None}`` from a ``data`` section, with its transforms.

    The data root is ``data_root`` (``--data-root``), else ``data.root``, else
    ``$DMLKIT_DATA``, else ``~/.cache/dmlkit/data`` (:func:`dmlkit.utils.data_root`). The
    training split gets the train-time augmentation when ``augment_train`` (default: yes,
    unless the whole config's ``model.frozen_trunk`` is set: features are computed once, so
    augmentation could not vary); every other split gets the evaluation transform.
    The split object is under key ``"split"``. ``dataset``: the config's dataset already
    loaded (e.g. by :func:`dmlkit.training.preflight.preflight`), so it is not read twice.
    ``split``: the class split to apply instead of the one ``data.split`` describes (a resumed
    run's own ``split.json``), checked against the dataset (:meth:`ClassSplit.check`: its
    classes must be there, under the names it recorded).
    """
    if augment_train is None:
        augment_train = not (isinstance(config, ExperimentConfig) and config.model.frozen_trunk)
    d = _section(config, "data", DataConfig)
    if dataset is None:
        dataset = load_dataset_at(d, data_root, fix="use --data-root to point at the data")
    if split is None:
        split = build_split(d, dataset)
    else:
        split.check(dataset)
    out: dict[str, Any] = {"split": split}
    for name in splits:
        ids = [int(c) for c in getattr(split, name)]
        if not ids:
            out[name] = None
            continue
        subset = dataset.subset_classes(ids)
        if d.transform is not None:
            augment = name == "train" and augment_train
            subset = subset.with_transform(get_transforms(d.transform, train=augment, image_size=d.image_size))
        out[name] = subset
    return out
