"""The experiment config: the pipeline's spine, one typed YAML-backed section per stage.

An :class:`ExperimentConfig` has one section per stage of the pipeline; each stage reads only
its own section (``dmlkit.training.build_model(config.model)``, ...)::

    name, seed
    data       dataset, root, options, split {kind, ratios, order, seed, val_fraction, path},
               transform, image_size, num_workers
    model      trunk, pretrained, weights, in_channels, embedding_size, head, normalize,
               freeze_batchnorm, frozen_trunk, feature_cache_dir
    loss       name, params (, cross_batch_memory)
    miner      name, params        (or null)
    sampler    classes_per_batch, samples_per_class, batches_per_epoch
    optimizer  preset, name, trunk_lr, embedder_lr, loss_lr, weight_decay, momentum
    training   epochs, max_steps, eval_every_epochs, patience, grad_clip, amp, device, ...
    evaluation batch_size, memory_mb, backend, cluster_restarts   (inference and metrics)

The sections ``data``, ``model``, ``sampler``, ``optimizer``, ``training`` and ``evaluation`` are what the
fair-comparison protocol of "A Metric Learning Reality Check" (Musgrave et al., ECCV 2020)
keeps fixed across methods (:data:`FIXED_SECTIONS`); only ``loss`` and ``miner`` vary
(:meth:`ExperimentConfig.with_method`). The default optimiser preset is the paper's: RMSprop,
learning rate 1e-6 for trunk and embedder.

Configs are loaded with :func:`load_config` (YAML + ``key.sub=value`` overrides whose values
are parsed as YAML) and written with :func:`dump_config`. Every validation problem is raised
as :class:`dmlkit.exceptions.ConfigError` naming the offending key.
"""

from __future__ import annotations

import copy
import os
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from dmlkit.config_yaml import (  # also public here, as before the split
    YamlDumper,
    YamlLoader,
    format_validation_error,
    load_yaml,
    parse_overrides,
    read_yaml_mapping,
    set_dotted,
    validate_settings,
)
from dmlkit.exceptions import ConfigError
from dmlkit.limits import MAX_BATCHES_PER_EPOCH
from dmlkit.losses import LOSSES
from dmlkit.miners import MINERS
from dmlkit.utils import atomic_write_text
from dmlkit.validation import check_parameter_numbers

__all__ = [
    "check_run_name", "FIXED_SECTIONS", "LEGACY_KEYS", "OPTIMIZER_PRESETS",
    "DEFAULT_EVAL_BATCH_SIZE", "DataConfig", "EvaluationConfig", "ExperimentConfig", "LossConfig",
    "MinerConfig", "ModelConfig", "OptimizerConfig", "SamplerConfig", "SplitConfig",
    "TrainingConfig", "apply_dict_overrides", "apply_overrides", "config_from_dict", "dump_config",
    "format_validation_error", "fresh_preset", "load_config", "move_legacy_keys", "parse_overrides",
    "read_yaml_mapping", "load_yaml", "validate_settings", "YamlDumper", "YamlLoader",
]

#: Sections that the fair protocol keeps identical across methods.
FIXED_SECTIONS: tuple[str, ...] = ("data", "model", "sampler", "optimizer", "training", "evaluation")

#: The one default batch size of inference (embedding a dataset, trunk features).
DEFAULT_EVAL_BATCH_SIZE = 256
#: The default working memory of the blockwise kNN, MiB (``dmlkit.metrics`` default budget).
DEFAULT_EVAL_MEMORY_MB = 256

#: Named optimiser settings; explicit keys in a config override the preset's values.
OPTIMIZER_PRESETS: dict[str, dict[str, Any]] = {
    # Musgrave et al. 2020, section 4.1: RMSprop, lr 1e-6 for every network parameter. The
    # learning rate of a loss's own weights (ArcFace, ProxyNCA, ...) is a hyperparameter there;
    # 1e-4 is a sensible default for it.
    "reality_check": {
        "name": "rmsprop",
        "trunk_lr": 1e-6,
        "embedder_lr": 1e-6,
        "loss_lr": 1e-4,
        "weight_decay": 1e-4,
        "momentum": 0.9,
    },
    # Small networks trained from scratch on a CPU (the quickstart): Adam at 1e-3.
    "cpu_quick": {
        "name": "adam",
        "trunk_lr": 1e-3,
        "embedder_lr": 1e-3,
        "loss_lr": 1e-3,
        "weight_decay": 0.0,
        "momentum": 0.0,
    },
}
DEFAULT_OPTIMIZER_PRESET = "reality_check"


def _is_number_type(annotation: Any) -> bool:
    """Whether a field holds an ``int`` or ``float`` (optionally ``None``), never a ``bool``."""
    if annotation in (int, float):
        return True
    args = typing.get_args(annotation)
    return (typing.get_origin(annotation) in (typing.Union, types.UnionType) and bool(args)
            and all(a in (int, float, type(None)) for a in args) and any(a in (int, float) for a in args))


class StrictNumbers(BaseModel):
    """A config model whose number fields refuse ``true`` / ``false`` (pydantic reads them as 1 and
    0: ``epochs: true`` trained one epoch without a word)."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, value: Any, info: Any) -> Any:
        if isinstance(value, bool) and info.field_name in cls.model_fields \
                and _is_number_type(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"must be a number, not {str(value).lower()}")
        return value


class _Section(StrictNumbers):
    # numbers finite: lr = inf trained NaN weights after writing the run directory
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class SplitConfig(_Section):
    """How classes are split into train / validation / test (class-disjoint).

    * ``default``: the dataset's published split (e.g. CUB 1-100 / 101-200, Omniglot background /
      evaluation); ``val_fraction`` of the training classes are carved out for validation.
    * ``ratio``: ``ratios`` = (train, val, test) fractions of all classes (seed 004 uses 4:1:5),
      in the dataset's ``order`` (``default``) or a ``random`` order seeded by ``seed``.
    * ``file``: a saved :class:`dmlkit.data.ClassSplit` (JSON) at ``path``.
    """

    kind: Literal["default", "ratio", "file"] = "default"
    ratios: tuple[float, float, float] | None = None
    order: Literal["default", "random"] = "default"
    seed: int = Field(0, ge=0, lt=2**32)  # numpy refuses other seeds
    val_fraction: float = Field(0.0, ge=0.0, lt=1.0)
    path: str | None = None

    @model_validator(mode="after")
    def _check_kind(self) -> SplitConfig:
        if self.kind == "ratio":
            if self.ratios is None:
                raise ValueError("split.kind 'ratio' needs ratios: [train, val, test], e.g. [4, 1, 5]")
            if any(r < 0 for r in self.ratios) or sum(self.ratios) <= 0:
                raise ValueError(f"split.ratios must be non-negative with a positive sum, got {self.ratios}")
            if self.ratios[0] <= 0 or self.ratios[2] <= 0:
                raise ValueError("split.ratios needs a positive train and test share")
        if self.kind == "file" and not self.path:
            raise ValueError("split.kind 'file' needs path: a ClassSplit JSON file")
        # a key the kind does not read would be ignored without a word
        if self.ratios is not None and self.kind != "ratio":
            raise ValueError(f"split.ratios is read by kind 'ratio' only, but the kind is {self.kind!r}")
        if self.path is not None and self.kind != "file":
            raise ValueError(f"split.path is read by kind 'file' only, but the kind is {self.kind!r}")
        if self.order != "default" and self.kind != "ratio":
            raise ValueError(f"split.order is read by kind 'ratio' only, but the kind is {self.kind!r}")
        return self


class DataConfig(_Section):
    """The dataset (``dmlkit.data.load_dataset`` name + options), split and transforms."""

    dataset: str
    root: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)
    split: SplitConfig = Field(default_factory=SplitConfig)
    transform: str | None = None
    image_size: int | None = Field(None, gt=0)
    num_workers: int = Field(0, ge=0)


class ModelConfig(_Section):
    """Trunk + embedder head (``dmlkit.models``).

    ``trunk_options`` are extra keyword arguments of the trunk (e.g. ``widths`` of
    ``small_cnn``); ``weights`` a local weights file that replaces the download.
    """

    trunk: str = "bn_inception"
    trunk_options: dict[str, Any] = Field(default_factory=dict)
    pretrained: bool = True
    weights: str | None = None
    in_channels: int = Field(3, gt=0)
    embedding_size: int = Field(128, gt=0)
    head: Literal["linear", "mlp", "identity"] = "linear"
    normalize: bool = True
    freeze_batchnorm: bool = True
    frozen_trunk: bool = False
    feature_cache_dir: str | None = None


class LossConfig(_Section):
    """A registered loss (``dmlkit.losses.get_loss(name, **params)``).

    ``cross_batch_memory`` (a memory size) wraps the loss in
    :class:`dmlkit.losses.CrossBatchMemory` (Wang et al., CVPR 2020).
    """

    name: str
    params: dict[str, Any] = Field(default_factory=dict)
    cross_batch_memory: int | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _check_numbers(self) -> LossConfig:
        # untyped params: refuse NaN/inf/booleans here, not only when the loss is built
        check_parameter_numbers("loss.params", LOSSES.get(self.name), self.params)
        return self


class MinerConfig(_Section):
    """A registered miner (``dmlkit.miners.get_miner(name, **params)``)."""

    name: str
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_numbers(self) -> MinerConfig:
        # untyped params: refuse NaN/inf/booleans here, not only when the miner is built
        check_parameter_numbers("miner.params", MINERS.get(self.name), self.params)
        return self


class SamplerConfig(_Section):
    """M-per-class batches: ``classes_per_batch`` x ``samples_per_class`` (the seed: 8 x 4)."""

    classes_per_batch: int = Field(8, gt=0)
    samples_per_class: int = Field(4, gt=0)
    batches_per_epoch: int | None = Field(None, gt=0, le=MAX_BATCHES_PER_EPOCH)

    @property
    def batch_size(self) -> int:
        return self.classes_per_batch * self.samples_per_class


class OptimizerConfig(_Section):
    """One optimiser with three parameter groups (trunk, embedder, loss), each with its own lr.

    ``preset`` fills every key not given explicitly (default: ``reality_check``, the seed's
    RMSprop at 1e-6). ``loss_lr = 0`` leaves a loss's own weights untrained (the trainer warns).
    ``momentum`` is read by ``rmsprop`` and ``sgd`` only: another value than the preset's (or
    the default's) with ``adam``/``adamw`` is refused rather than ignored.
    """

    preset: Literal["reality_check", "cpu_quick"] | None = DEFAULT_OPTIMIZER_PRESET
    name: Literal["rmsprop", "adam", "adamw", "sgd"] = "rmsprop"
    trunk_lr: float = Field(1e-6, ge=0.0)
    embedder_lr: float = Field(1e-6, ge=0.0)
    loss_lr: float = Field(1e-4, ge=0.0)
    weight_decay: float = Field(1e-4, ge=0.0)
    momentum: float = Field(0.9, ge=0.0, lt=1.0)

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        preset = data.get("preset", DEFAULT_OPTIMIZER_PRESET)
        if preset is None:
            cls._check_momentum_read(data, data, cls.model_fields["momentum"].default)
            return data
        if preset not in OPTIMIZER_PRESETS:
            return data  # the Literal check names the allowed presets
        merged = {**OPTIMIZER_PRESETS[preset], **data}
        cls._check_momentum_read(data, merged, OPTIMIZER_PRESETS[preset]["momentum"])
        return merged

    @classmethod
    def _check_momentum_read(cls, given: Mapping[str, Any], merged: Mapping[str, Any],
                             filled: float) -> None:
        """Refuse a ``momentum`` the optimiser would ignore: given (not the value ``filled`` by
        the preset or the default, which a resolved config.yaml repeats) for Adam or AdamW."""
        momentum, name = given.get("momentum"), merged.get("name", cls.model_fields["name"].default)
        if name in ("adam", "adamw") and isinstance(momentum, int | float) \
                and not isinstance(momentum, bool) and momentum != filled:
            raise ValueError(
                f"optimizer.momentum ({momentum}) is read by rmsprop and sgd only, but the optimizer "
                f"is {name!r}, whose momentum is its first-moment decay beta1 (torch's default 0.9): "
                "drop optimizer.momentum, or use name: sgd or rmsprop")


class TrainingConfig(_Section):
    """Length, evaluation, early stopping and logging of a run."""

    epochs: int = Field(10, gt=0)
    max_steps: int | None = Field(None, gt=0)
    eval_every_epochs: int = Field(1, gt=0)
    patience: int | None = Field(None, gt=0)
    grad_clip: float | None = Field(None, gt=0)
    amp: bool = False
    device: Literal["auto", "cpu", "cuda"] = "auto"
    log_every: int = Field(10, gt=0)
    eval_metrics: list[str] = Field(
        default_factory=lambda: ["precision_at_1", "r_precision", "map_at_r"]
    )
    tensorboard: bool = False
    csv_log: bool = False
    #: data-parallel loss: every rank computes the whole loss of the gathered batch
    #: (``replicated``), or only its own anchors' terms, exactly (``local_anchors``;
    #: contrastive, triplet, multi_similarity: dmlkit.losses.sharding, docs/distributed.md)
    distributed_loss: Literal["replicated", "local_anchors"] = "replicated"

    @field_validator("eval_metrics")
    @classmethod
    def _needs_map_at_r(cls, value: list[str]) -> list[str]:
        check_metric_names(value)
        # model selection and early stopping use validation MAP@R
        return list(dict.fromkeys([*value, "map_at_r"]))


class EvaluationConfig(_Section):
    """Inference and metrics settings: they change memory and speed, never the numbers.

    ``batch_size`` is the inference batch (embedding a split, frozen-trunk features);
    ``memory_mb`` the working memory of the blockwise exact kNN, ``backend`` its backend
    (``auto``, ``torch``, ``numba``, ``faiss``) and ``cluster_restarts`` the k-means runs the
    clustering metrics average (:func:`dmlkit.metrics.evaluate`).
    """

    batch_size: int = Field(DEFAULT_EVAL_BATCH_SIZE, gt=0)
    memory_mb: int = Field(DEFAULT_EVAL_MEMORY_MB, gt=0)
    backend: Literal["auto", "torch", "numba", "faiss"] = "auto"
    cluster_restarts: int = Field(3, ge=1)

    def metric_options(self) -> dict[str, Any]:
        """Keyword arguments of :func:`dmlkit.metrics.evaluate` for these settings."""
        return {"backend": self.backend, "memory_budget": self.memory_mb * 2**20,
                "cluster_restarts": self.cluster_restarts}


def check_metric_names(names: list[str]) -> None:
    """Refuse an unknown metric name when the config is read, not after the training (or the
    bench's whole search) it would have ended: :func:`dmlkit.metrics.evaluate.expand_metric_names`."""
    # lazy: the metrics (and torch) load only for a config that names metrics
    from dmlkit.metrics.evaluate import expand_metric_names

    try:
        expand_metric_names(names)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def move_legacy_keys(data: Any) -> Any:
    """Move ``training.eval_batch_size`` (before the evaluation section) to ``evaluation.batch_size``."""
    if not isinstance(data, Mapping):
        return data
    training = data.get("training")
    if not isinstance(training, Mapping) or "eval_batch_size" not in training:
        return data
    data = dict(data)
    training = dict(training)
    value = training.pop("eval_batch_size")
    evaluation = dict(data.get("evaluation") or {})
    if "batch_size" in evaluation and evaluation["batch_size"] != value:
        raise ConfigError(
            f"training.eval_batch_size ({value}) and evaluation.batch_size "
            f"({evaluation['batch_size']}) disagree: keep only evaluation.batch_size"
        )
    evaluation["batch_size"] = value
    data["training"], data["evaluation"] = training, evaluation
    return data


def check_run_name(name: str) -> str:
    """A run or bench ``name`` is a name, never a path: it becomes one folder under ``runs/``
    (``--run-dir``/``-o`` choose any other location)."""
    if (not name.strip() or name in (".", "..") or name.startswith("~")
            or any(sep in name for sep in ("/", "\\", "\0"))):
        raise ValueError(f"name {name!r} must be a plain name (no '/', '\\', '..' or '~'): it names "
                         "the folder under runs/; choose another location with --run-dir (train) "
                         "or -o (bench)")
    return name


class ExperimentConfig(_Section):
    """A complete, validated training experiment."""

    name: str = "experiment"
    seed: int = Field(0, ge=0, lt=2**32)  # numpy's range (the sampler's generator)
    data: DataConfig

    _check_name = field_validator("name")(classmethod(lambda cls, v: check_run_name(v)))
    model: ModelConfig = Field(default_factory=ModelConfig)
    loss: LossConfig
    miner: MinerConfig | None = None
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)

    @model_validator(mode="before")
    @classmethod
    def _legacy_keys(cls, data: Any) -> Any:
        return move_legacy_keys(data)

    def with_method(
        self, loss: LossConfig | Mapping[str, Any], miner: MinerConfig | Mapping[str, Any] | None = None
    ) -> ExperimentConfig:
        """The same fixed settings with another loss/miner (the fair protocol's only variable).

        Python-mode dumps keep every value as given (JSON mode wrote a NaN parameter as ``None``,
        which then trained with the loss's default instead of being refused)."""
        data = self.model_dump()
        data["loss"] = loss.model_dump() if isinstance(loss, BaseModel) else dict(loss)
        data["miner"] = (
            miner.model_dump() if isinstance(miner, BaseModel) else (None if miner is None else dict(miner))
        )
        return config_from_dict(data)

    def fixed_part(self) -> dict[str, Any]:
        """The sections the fair protocol keeps identical across methods, as plain data."""
        dumped = self.model_dump(mode="json")
        return {key: dumped[key] for key in FIXED_SECTIONS}

    def override(self, overrides: Iterable[str] | Mapping[str, Any]) -> ExperimentConfig:
        """A validated copy with ``key.sub=value`` overrides applied."""
        return apply_overrides(self, overrides)


# -- loading, overrides, dumping ------------------------------------------------------------
def config_from_dict(data: Mapping[str, Any], source: str | None = None) -> ExperimentConfig:
    """Validate a plain mapping into an :class:`ExperimentConfig` (errors -> ConfigError)."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"an experiment config must be a mapping, got {type(data).__name__}")
    return validate_settings(ExperimentConfig, move_legacy_keys(dict(data)), "experiment config", source)


#: Keys that moved: an override of the old key sets the new one.
LEGACY_KEYS: dict[str, str] = {"training.eval_batch_size": "evaluation.batch_size"}


def _current_key(key: str) -> str:
    for old, new in LEGACY_KEYS.items():
        if key == old or key.endswith("." + old):
            return key[: len(key) - len(old)] + new
    return key


def apply_dict_overrides(data: dict[str, Any], overrides: Iterable[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """A deep copy of ``data`` with ``key.sub=value`` overrides set (old key names accepted).

    Renamed keys of ``data`` (and of a bench config's ``fixed`` part) move to their new names
    first, so that an override of the new name wins over an old name in the file.
    """
    data = move_legacy_keys(copy.deepcopy(data))
    if isinstance(data.get("fixed"), Mapping):
        data["fixed"] = move_legacy_keys(data["fixed"])
    given: dict[str, tuple[str, Any]] = {}
    for key, value in parse_overrides(overrides).items():
        current = _current_key(key)
        if current in given and given[current][1] != value:  # an old and a new name, both set
            raise ConfigError(f"{given[current][0]} ({given[current][1]}) and {key} ({value}) "
                              f"disagree: keep only {current}")
        given[current] = (key, value)
        set_dotted(data, current, value)
    return data


def apply_overrides(
    config: ExperimentConfig | Mapping[str, Any], overrides: Iterable[str] | Mapping[str, Any] | None
) -> ExperimentConfig:
    """A new validated config with ``key.sub=value`` overrides (or a ``{key: value}`` mapping).

    The config is dumped in Python mode, so that no value changes on the way (JSON mode turned
    a NaN loss parameter into ``None``: the loss's default, where the NaN must be refused)."""
    base = config.model_dump() if isinstance(config, BaseModel) else copy.deepcopy(dict(config))
    parsed = parse_overrides(overrides)
    if isinstance(config, BaseModel) and _switches_preset(base["optimizer"], parsed, "optimizer"):
        # a resolved config holds the old preset's values explicitly: switching the preset
        # starts the optimiser section afresh (other optimizer.* overrides still apply)
        base["optimizer"] = {}
    return config_from_dict(apply_dict_overrides(base, parsed), source="overrides")


def load_config(
    path: str | os.PathLike | None, overrides: Iterable[str] | Mapping[str, Any] | None = None
) -> ExperimentConfig:
    """Read a YAML config (or start empty with ``path=None``) and apply overrides."""
    data: Any = {}
    source = None
    if path is not None:
        source = str(path)
        data = read_yaml_mapping(path, "sections (data, model, loss, ...)", "configs/ for examples")
    parsed = parse_overrides(overrides)
    data = apply_dict_overrides(fresh_preset(data, parsed, "optimizer"), parsed)
    return config_from_dict(data, source=source)


def fresh_preset(data: dict[str, Any], parsed: Mapping[str, Any], key: str) -> dict[str, Any]:
    """``data`` with its optimizer section (at dotted ``key``) emptied when ``parsed`` overrides
    ``KEY.preset`` and the section gives every value a preset would fill (a resolved config, as
    ``dump_config`` writes it: its ``preset`` is only a label). Switching the preset then starts
    the section afresh, as :func:`apply_overrides` does (a run's config.yaml kept Adam at 1e-3
    under the new "reality_check" label); a hand-written section's explicit keys still win.
    Naming the preset the section already has changes nothing (its explicit values stay)."""
    parent, _, name = key.rpartition(".")
    holder = data
    for part in filter(None, parent.split(".")):
        holder = holder.get(part) if isinstance(holder, dict) else None
    section = holder.get(name) if isinstance(holder, dict) else None
    resolved = isinstance(section, dict) and all(
        k in section for preset in OPTIMIZER_PRESETS.values() for k in preset)
    if resolved and _switches_preset(section, parsed, key):
        holder[name] = {}
    return data


def _switches_preset(section: Mapping[str, Any], parsed: Mapping[str, Any], key: str) -> bool:
    """Whether ``parsed`` sets ``KEY.preset`` to another preset than ``section``'s."""
    return f"{key}.preset" in parsed and \
        parsed[f"{key}.preset"] != section.get("preset", DEFAULT_OPTIMIZER_PRESET)


def dump_config(config: ExperimentConfig, path: str | os.PathLike | None = None) -> str:
    """The fully resolved config as YAML; also written atomically to ``path`` when given."""
    text = yaml.dump(config.model_dump(mode="json"), Dumper=YamlDumper, sort_keys=False, default_flow_style=None)
    if path is not None:
        atomic_write_text(path, text)
    return text
