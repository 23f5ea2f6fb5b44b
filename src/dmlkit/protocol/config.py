"""The benchmark config: fixed settings, the protocol, and the methods under comparison.

A :class:`BenchConfig` has three parts (Musgrave, Belongie & Lim, "A Metric Learning Reality
Check", ECCV 2020, section 4):

``fixed``
    Everything that must be identical for every method: the trunk, embedding size, batch
    construction (C classes x M samples), augmentation, optimiser and learning rates, frozen
    BatchNorm, L2 normalisation and training length. It reuses the sections of the training
    config (:class:`dmlkit.config.ExperimentConfig`): ``seed``, ``data``, ``model``,
    ``sampler``, ``optimizer``, ``training``, ``evaluation``, plus an optional ``classification_sampler`` that
    replaces ``sampler`` for classification/proxy losses (the seed uses C=8 x M=4 for
    embedding losses and C=32 x M=1 for classification losses).
``protocol``
    How classes are split (``halves``: first half of the classes for cross-validation, second
    half for test, as in the seed; ``default``: the dataset's published train/test classes,
    e.g. SOP's 11,318 / 11,316; ``ratio_4_1_5``: train/val/test 4:1:5 of Oi et al., seed
    004), in the dataset's default class order or a seeded random order; the number of
    class-disjoint folds; the Bayesian search (Optuna TPE, trials, storage); the seeds of the
    final runs; the metrics; how training runs start (``launcher``: in the worker process, or
    as ``nproc_per_trial`` ranks under torchrun, :class:`TorchrunSettings`).
``methods``
    A list of ``{name, loss {name, params}, miner {name, params} | null, search {...}}``.
    A method may only choose its loss and miner and declare which of *their* hyperparameters
    (and the learning rate of the loss's own weights, ``optimizer.loss_lr``) are searched.
    Anything else is a fixed setting and is rejected with :class:`ConfigError`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal

import yaml
from pydantic import ConfigDict, Field, field_validator, model_validator

from dmlkit.config import (
    DataConfig,
    EvaluationConfig,
    ExperimentConfig,
    LossConfig,
    MinerConfig,
    ModelConfig,
    OptimizerConfig,
    SamplerConfig,
    StrictNumbers,
    TrainingConfig,
    YamlDumper,
    apply_dict_overrides,
    check_metric_names,
    check_run_name,
    config_from_dict,
    fresh_preset,
    move_legacy_keys,
    parse_overrides,
    read_yaml_mapping,
    validate_settings,
)
from dmlkit.config_yaml import packaged_presets
from dmlkit.exceptions import ConfigError
from dmlkit.limits import MAX_THREADS
from dmlkit.losses import LOSSES, needs_pair_batches
from dmlkit.miners import MINERS

__all__ = [
    "DATA_ROOT_FIX",
    "DEFAULT_METRICS",
    "METHOD_KEYS",
    "SEARCHABLE_OPTIMIZER_KEYS",
    "BenchConfig",
    "FixedSettings",
    "MethodConfig",
    "ProtocolConfig",
    "SearchParam",
    "TorchrunSettings",
    "load_bench_config",
]

#: The seed's three accuracy metrics (the table's columns).
DEFAULT_METRICS: tuple[str, ...] = ("precision_at_1", "r_precision", "map_at_r")
#: The only keys a method may set; everything else is fixed across methods.
METHOD_KEYS: frozenset[str] = frozenset({"name", "loss", "miner", "search", "description"})
#: Optimiser settings that belong to a method: the learning rate of the loss's own weights.
SEARCHABLE_OPTIMIZER_KEYS: frozenset[str] = frozenset({"loss_lr"})
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")
#: A seed numpy accepts: 0 <= seed < 2**32 (a negative or larger one crashed mid-run).
Seed = Annotated[int, Field(ge=0, lt=2**32, strict=True)]


class _Strict(StrictNumbers):
    # numbers finite: a search range of -inf failed every trial after the bench was written
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class FixedSettings(_Strict):
    """The settings every method shares (the training config's fixed sections)."""

    seed: Seed = 0
    data: DataConfig
    model: ModelConfig = Field(default_factory=ModelConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    classification_sampler: SamplerConfig | None = None
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)

    @model_validator(mode="before")
    @classmethod
    def _legacy_keys(cls, data: Any) -> Any:
        return move_legacy_keys(data)

    @model_validator(mode="after")
    def _split_is_the_protocols(self) -> FixedSettings:
        if self.data.split.kind != "default" or self.data.split.val_fraction:
            raise ValueError(
                "fixed.data.split is decided by the protocol: remove it and set "
                "protocol.split / protocol.order instead"
            )
        return self


class SearchParam(_Strict):
    """One searched hyperparameter: a float/int range (optionally log-scaled) or choices."""

    type: Literal["float", "int", "categorical"] = "float"
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    choices: list[Any] | None = None

    @model_validator(mode="after")
    def _check(self) -> SearchParam:
        if self.type == "categorical":
            if not self.choices:
                raise ValueError("a categorical search parameter needs a non-empty 'choices' list")
            ignored = [k for k, v in (("low", self.low), ("high", self.high), ("step", self.step)) if v is not None]
            if ignored or self.log:  # a saved config holds them as null / false
                raise ValueError(f"a categorical search parameter takes only 'choices', not "
                                 f"{', '.join(ignored + ['log'] * self.log)}: remove it, or use type "
                                 "float / int for a range")
            return self
        if self.choices is not None:
            raise ValueError(f"'choices' needs type: categorical (type {self.type} searches the range "
                             "low..high): set type: categorical, or remove choices")
        if self.step is not None and self.step <= 0:
            raise ValueError(f"step must be > 0, got {self.step}")
        if self.type == "int" and self.step is not None and self.step != int(self.step):
            raise ValueError(f"an int search parameter needs an integer step, got {self.step}")
        if self.low is None or self.high is None:
            raise ValueError(f"a {self.type} search parameter needs 'low' and 'high'")
        if self.low > self.high:
            raise ValueError(f"low ({self.low}) must not exceed high ({self.high})")
        if self.log and self.low <= 0:
            raise ValueError(f"a log-scaled range needs low > 0, got {self.low}")
        if self.log and self.step is not None:
            raise ValueError("'step' and 'log' cannot be combined (Optuna)")
        if self.type == "int" and (self.low != int(self.low) or self.high != int(self.high)):
            raise ValueError("an int search parameter needs integer 'low' and 'high'")
        return self


class MethodConfig(_Strict):
    """A method under comparison: its loss, its miner and its searched hyperparameters."""

    name: str
    description: str | None = None
    loss: LossConfig
    miner: MinerConfig | None = None
    search: dict[str, SearchParam] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _only_method_keys(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            name = data.get("name", "?")
            extra = sorted(set(data) - METHOD_KEYS)
            if extra:
                raise ValueError(
                    f"method {name!r} sets {', '.join(extra)}: these are fixed settings that must "
                    "be identical across methods (trunk, embedding size, batches, augmentation, "
                    "optimiser, training length). Put them once under 'fixed'; a method may only "
                    "set name, loss, miner and search"
                )
        return data

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _NAME_RE.match(value) or value == "pretrained":
            raise ValueError(
                f"method name {value!r} must be letters, digits, '_', '-', '.', '+' "
                "(and not 'pretrained', the reserved baseline row)"
            )
        return value

    @model_validator(mode="after")
    def _check_search(self) -> MethodConfig:
        for key in self.search:
            section, _, param = key.partition(".")
            if not param or "." in param:
                raise ValueError(
                    f"method {self.name!r}: search key {key!r} must be 'loss.<param>', "
                    "'miner.<param>' or 'optimizer.loss_lr'"
                )
            if section in ("loss", "miner"):
                part = self.loss if section == "loss" else self.miner
                if part is None:
                    raise ValueError(f"method {self.name!r} searches {key!r} but has no miner")
                if param in part.params:  # the search would silently replace the fixed value
                    raise ValueError(
                        f"method {self.name!r}: {key} is both fixed ({section}.params.{param} = "
                        f"{part.params[param]!r}) and searched: keep one of the two")
                continue
            if section == "optimizer" and param in SEARCHABLE_OPTIMIZER_KEYS:
                continue
            raise ValueError(
                f"method {self.name!r} searches {key!r}: only the method's own hyperparameters "
                "(loss.*, miner.*, optimizer.loss_lr) may vary; every other setting is fixed and "
                "must be identical across methods (set it once under 'fixed')"
            )
        return self


class TorchrunSettings(_Strict):
    """How ``protocol.launcher: torchrun`` starts each training run of a trial.

    Every training run (one fold of a search trial, one final fold model) becomes one
    single-node job of ``protocol.nproc_per_trial`` processes started by ``python -m
    torch.distributed.run`` (:mod:`dmlkit.protocol.launch`). ``rdzv_endpoint`` ``null`` uses
    ``--standalone``: a rendezvous on this host with a free port per run, so several bench
    workers on one machine never collide; set ``HOST:PORT`` only if ``localhost`` does not
    resolve. ``threads_per_process`` sets ``OMP_NUM_THREADS`` of each rank (default: this
    machine's cores / ``nproc_per_trial``). ``timeout_s`` bounds one training run's wall time:
    the job is stopped and the trial recorded as failed. ``extra_args`` are passed to torchrun
    before the script (e.g. ``["--monitor-interval", "1"]``).
    """

    rdzv_backend: Literal["c10d"] = "c10d"
    rdzv_endpoint: str | None = None
    threads_per_process: int | None = Field(None, ge=1, le=MAX_THREADS)
    timeout_s: float | None = Field(None, gt=0)
    kill_grace_s: float = Field(30.0, gt=0)
    extra_args: list[str] = Field(default_factory=list)

    @field_validator("rdzv_endpoint")
    @classmethod
    def _endpoint(cls, value: str | None) -> str | None:
        if value is not None:
            host, sep, port = value.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"protocol.torchrun.rdzv_endpoint {value!r} must be HOST:PORT")
        return value

    @field_validator("extra_args")
    @classmethod
    def _extra(cls, value: list[str]) -> list[str]:
        owned = ("--nproc-per-node", "--nproc_per_node", "--nnodes", "--standalone", "--rdzv-endpoint",
                 "--rdzv_endpoint", "--rdzv-backend", "--rdzv_backend", "--rdzv-id", "--rdzv_id",
                 "--max-restarts", "--max_restarts", "-m", "--module", "--no-python", "--no_python")
        clash = [a for a in value if a.split("=", 1)[0] in owned]
        if clash:
            raise ValueError(
                f"protocol.torchrun.extra_args sets {clash}: dmlkit sets these itself "
                "(use protocol.nproc_per_trial and protocol.torchrun.rdzv_endpoint)"
            )
        return value


class ProtocolConfig(_Strict):
    """Splits, cross-validation, search and final runs."""

    split: Literal["halves", "default", "ratio_4_1_5"] = "halves"
    order: Literal["default", "random"] = "default"
    order_seed: Seed = 0
    num_classes: int | None = Field(None, gt=3)
    folds: int | None = Field(None, ge=1)
    trials: int = Field(50, ge=1)
    sampler: Literal["tpe", "random"] = "tpe"
    sampler_seed: Seed = 0
    n_startup_trials: int = Field(10, ge=0)
    storage: str | None = None
    study_prefix: str | None = None
    heartbeat_interval: int = Field(30, ge=1)
    grace_period: int = Field(120, ge=2)
    seeds: list[Seed] | None = None
    repeats: int = Field(1, ge=1)
    metrics: list[str] = Field(default_factory=lambda: list(DEFAULT_METRICS))

    @field_validator("metrics")
    @classmethod
    def _known_metrics(cls, value: list[str]) -> list[str]:
        check_metric_names(value)  # before the search, not at the final stage
        return value
    keep_search_checkpoints: bool = False
    pretrained: bool = True
    launcher: Literal["local", "torchrun"] = "local"
    nproc_per_trial: int = Field(1, ge=1)
    torchrun: TorchrunSettings = Field(default_factory=TorchrunSettings)

    def search_fingerprint(self) -> dict[str, Any] | None:
        """The sampler settings (``sampler``, ``sampler_seed``, ``n_startup_trials``) that decide
        which points a study samples, or None where all are the defaults: studies created
        before these were part of the key used the defaults mostly, and still resume (as
        :meth:`BenchConfig.fixed_fingerprint` keeps ``cluster_restarts`` out at its default)."""
        keys = ("sampler", "sampler_seed", "n_startup_trials")
        values = {k: getattr(self, k) for k in keys}
        return None if all(values[k] == type(self).model_fields[k].default for k in keys) else values

    @model_validator(mode="after")
    def _resolve(self) -> ProtocolConfig:
        if self.folds is None:
            self.folds = 4 if self.split == "halves" else 1
        if self.split == "ratio_4_1_5" and self.folds != 1:
            raise ValueError(
                "split 'ratio_4_1_5' has one fixed train/validation/test split (Oi et al.): set "
                "folds: 1, or use split 'halves' for k-fold cross-validation"
            )
        if self.grace_period <= self.heartbeat_interval:  # a live worker's trial would look dead
            raise ValueError(f"protocol.grace_period ({self.grace_period} s) must exceed "
                             f"protocol.heartbeat_interval ({self.heartbeat_interval} s): a trial is "
                             "taken over when its worker misses its heartbeats for that long")
        if self.split in ("halves", "default") and self.folds < 2:
            raise ValueError(f"split {self.split!r} cross-validates: folds must be >= 2 (the seed uses 4)")
        if self.split == "default" and self.num_classes is not None:
            raise ValueError("num_classes cannot be combined with the dataset's default split")
        if self.seeds is None:
            self.seeds = list(range(self.repeats))
        elif not self.seeds:  # else repeats 0 is saved, and the bench cannot be read again
            raise ValueError("protocol.seeds is empty: list at least one training seed (or leave it "
                             "out for protocol.repeats seeds 0, 1, ...)")
        else:
            if len(set(self.seeds)) != len(self.seeds):
                raise ValueError(f"protocol.seeds must be distinct, got {self.seeds}")
            if "repeats" in self.model_fields_set and self.repeats != len(self.seeds):
                raise ValueError(f"protocol.repeats = {self.repeats} but protocol.seeds lists "
                                 f"{len(self.seeds)} seeds: give one of the two")
            self.repeats = len(self.seeds)
        self.metrics = list(dict.fromkeys([*DEFAULT_METRICS, *self.metrics]))
        if self.launcher == "local" and self.nproc_per_trial != 1:
            raise ValueError(
                f"protocol.nproc_per_trial = {self.nproc_per_trial} needs protocol.launcher: torchrun "
                "(the local launcher trains in the worker process itself)"
            )
        if self.storage is not None and not self.storage.startswith(SUPPORTED_STORAGE):
            if "://" in self.storage:  # another database: named by its scheme only (a password?)
                raise ValueError(
                    f"protocol.storage: a {self.storage.split('://', 1)[0]}:// database is not supported; "
                    "dmlkit's studies live in SQLite (sqlite:///path/study.db, or null for "
                    "BENCH_DIR/study.db) or PostgreSQL (postgresql://user@host:port/db)"
                )
            raise ValueError(
                f"protocol.storage {self.storage!r} must be a database URL "
                "(sqlite:///path/study.db or postgresql://user@host:port/db) or null"
            )
        if self.storage is not None and _url_has_password(self.storage):
            raise ValueError(
                "protocol.storage holds a password; dmlkit writes its config, argv and results to "
                "disk and never stores a password: drop it from the URL "
                "(postgresql://user@host:port/db) and give it to PostgreSQL through the "
                "PGPASSWORD environment variable or a ~/.pgpass line (host:port:db:user:password, "
                "mode 0600), which libpq reads"
            )
        return self


#: The URL schemes ``protocol.storage`` accepts: the engines dmlkit supports (SQLite, and
#: PostgreSQL for studies shared between machines).
SUPPORTED_STORAGE = ("sqlite:", "postgresql:", "postgresql+", "postgres:")


def _url_has_password(url: str) -> bool:
    """A password in the URL's user info (``user:pw@host``) or its query (``?password=``)."""
    from urllib.parse import parse_qs, urlsplit

    parts = urlsplit(url)
    try:
        in_userinfo = parts.password is not None
    except ValueError:  # an unparsable netloc: look for user:pw@ by hand
        in_userinfo = ":" in parts.netloc.rpartition("@")[0]
    return in_userinfo or any(k.lower() == "password" for k in parse_qs(parts.query))


#: How to point a bench at its data when ``fixed.data.root`` names the wrong folder (``--data-root``
#: naming another folder is refused, so the config's root is what to change).
DATA_ROOT_FIX = "point it at the data with --set fixed.data.root=PATH"


class BenchConfig(_Strict):
    """A whole fair comparison: ``name``, ``fixed``, ``protocol``, ``methods``."""

    name: str = "bench"
    fixed: FixedSettings
    protocol: ProtocolConfig = Field(default_factory=ProtocolConfig)
    methods: list[MethodConfig] = Field(min_length=1)

    _check_name = field_validator("name")(classmethod(lambda cls, v: check_run_name(v)))

    @model_validator(mode="before")
    @classmethod
    def _top_level(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            stray = sorted(set(data) & {"data", "model", "sampler", "optimizer", "training", "loss", "miner", "seed"})
            if stray:
                bench = [p for p in packaged_presets() if p.startswith("bench_")]
                raise ValueError(
                    f"{', '.join(stray)} at the top level: fixed settings go under 'fixed', "
                    "losses/miners under 'methods'"
                    + ("" if "fixed" in data or "methods" in data else
                       f" (a training config, for `dmlkit train`? the bench presets: {', '.join(bench)})")
                )
        return data

    @model_validator(mode="after")
    def _unique(self) -> BenchConfig:
        names = [m.name for m in self.methods]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"method names must be unique, repeated: {dup}")
        return self

    @model_validator(mode="after")
    def _run_seeds_fit(self) -> BenchConfig:
        """Every training seed the protocol derives (:meth:`search_seed`, :meth:`final_seed`)
        must be below ``2**32`` (numpy's range, as the training config requires). Accepted, a
        too large seed failed every search trial past fold 0, or the final stage after the
        whole search."""
        k, top = int(self.protocol.folds or 1), max(self.protocol.seeds or [0])
        if self.search_seed(k - 1) >= 2**32:
            raise ValueError(f"fixed.seed = {self.fixed.seed}: the search trains fold f with seed "
                             f"fixed.seed + f, up to {self.search_seed(k - 1)}, past numpy's 2**32 - 1; "
                             f"use at most {2**32 - k}")
        last = self.final_seed(top, k - 1)
        if last >= 2**32:
            fits = (2**32 - self.fixed.seed) // k - 2
            raise ValueError(
                f"protocol.seeds holds {top}: final run f of seed s trains with seed fixed.seed + "
                f"folds * (s + 1) + f, up to {last}, past numpy's 2**32 - 1; "
                + (f"use seeds up to {fits}" if fits >= 0 else f"lower fixed.seed (at most {2**32 - 2 * k})"))
        return self

    @model_validator(mode="after")
    def _ranks_divide_batches(self) -> BenchConfig:
        """Each of ``nproc_per_trial`` ranks takes an equal share of the global batch."""
        n = self.protocol.nproc_per_trial
        samplers = {"fixed.sampler": self.fixed.sampler}
        if self.fixed.classification_sampler is not None:
            samplers["fixed.classification_sampler"] = self.fixed.classification_sampler
        for key, sampler in samplers.items():
            if sampler.batch_size % n:
                raise ValueError(
                    f"protocol.nproc_per_trial = {n} does not divide the global batch of {key} "
                    f"({sampler.classes_per_batch} classes x {sampler.samples_per_class} samples = "
                    f"{sampler.batch_size}): choose a divisor of it, or change the batch"
                )
        return self

    # -- derived -------------------------------------------------------------------------
    def search_seed(self, fold: int) -> int:
        """The training seed of fold ``fold`` in every search trial: ``fixed.seed + fold``."""
        return self.fixed.seed + int(fold)

    def final_seed(self, seed: int, fold: int) -> int:
        """The training seed of final run ``fold`` of ``seed`` (one of ``protocol.seeds``), and of
        the pretrained row's model of that fold and seed: ``fixed.seed + folds * (seed + 1) +
        fold``. The seeds come in blocks of ``folds`` consecutive integers from ``fixed.seed``:
        block 0 is the search's (:meth:`search_seed`), block ``seed + 1`` the final runs' of
        ``seed``. So no final run trains with a search run's seed, whatever ``fixed.seed``,
        ``folds`` and ``seeds`` are (an earlier dmlkit used ``1000 * seed + fold``: with
        ``fixed.seed: 0`` the final runs of seed 0 were the winning trial's models, bit for
        bit), and no two final runs share one."""
        return self.fixed.seed + int(self.protocol.folds or 1) * (int(seed) + 1) + int(fold)

    def method(self, name: str) -> MethodConfig:
        for m in self.methods:
            if m.name == name:
                return m
        raise ConfigError(f"no method {name!r} in the config (have: {[m.name for m in self.methods]})")

    def experiment(
        self, method: MethodConfig | None, params: Mapping[str, Any] | None = None, *, seed: int | None = None,
        name: str | None = None,
    ) -> ExperimentConfig:
        """The training config of ``method`` with searched ``params`` applied.

        ``method=None`` gives the config of the untrained baseline (the ``pretrained`` row): the
        fixed settings with a placeholder loss that is never trained.
        """
        fixed = self.fixed.model_dump(mode="json")
        cls_sampler = fixed.pop("classification_sampler")
        data: dict[str, Any] = {
            "name": name or f"{self.name}-{method.name if method else 'pretrained'}",
            **fixed,
        }
        if seed is not None:
            data["seed"] = int(seed)
        if method is None:
            data["loss"] = {"name": "contrastive", "params": {}}
            data["miner"] = None
            return config_from_dict(data, source="bench config (pretrained)")
        data["loss"] = method.loss.model_dump()  # python mode: values as given
        data["miner"] = None if method.miner is None else method.miner.model_dump()
        if cls_sampler is not None and not needs_pair_batches(method.loss.name, method.loss.params):
            data["sampler"] = cls_sampler
        for key, value in (params or {}).items():
            section, _, param = key.partition(".")
            if section in ("loss", "miner"):
                data[section]["params"][param] = value
            else:
                data[section][param] = value
        return config_from_dict(data, source=f"bench config (method {method.name!r})")

    def fixed_fingerprint(self) -> dict[str, Any]:
        """The fixed settings that decide the results, in the shape studies were keyed by.

        The ``evaluation`` section's memory and backend change memory and speed only, so they
        are left out; its batch size stands where it stood before the section existed
        (``training.eval_batch_size``), so that searches started by an earlier version still
        resume; ``cluster_restarts`` (NMI, AMI and F1 average that many k-means runs) is kept
        where it is not the default, which such searches used.
        """
        fixed = self.fixed.model_dump(mode="json")
        evaluation = fixed.pop("evaluation")
        fixed["training"]["eval_batch_size"] = evaluation["batch_size"]
        if evaluation["cluster_restarts"] != EvaluationConfig.model_fields["cluster_restarts"].default:
            fixed["evaluation"] = {"cluster_restarts": evaluation["cluster_restarts"]}
        # where this machine keeps its data and feature cache is not a setting of the
        # experiment: workers on machines with other paths must join the same study
        fixed["data"]["root"] = None
        fixed["model"]["feature_cache_dir"] = None
        return fixed


# -- loading -----------------------------------------------------------------------------------
def bench_config_from_dict(data: Mapping[str, Any], source: str | None = None) -> BenchConfig:
    """Validate a mapping into a :class:`BenchConfig`; every problem is a :class:`ConfigError`."""
    if not isinstance(data, Mapping):
        raise ConfigError(f"a bench config must be a mapping, got {type(data).__name__}")
    config = validate_settings(BenchConfig, dict(data), "bench config", source, show_values=False)
    # every method must give a valid training config (unknown loss/miner names, bad params)
    for method in config.methods:
        config.experiment(method)
        _check_registered(method)
    return config


def _check_registered(method: MethodConfig) -> None:
    if method.loss.name not in LOSSES:
        raise ConfigError(f"method {method.name!r}: unknown loss {method.loss.name!r}; known: {sorted(LOSSES)}")
    if method.miner is not None and method.miner.name not in MINERS:
        raise ConfigError(
            f"method {method.name!r}: unknown miner {method.miner.name!r}; known: {sorted(MINERS)}"
        )


def load_bench_config(
    path: str | os.PathLike, overrides: Iterable[str] | Mapping[str, Any] | None = None
) -> BenchConfig:
    """Read a bench YAML file and apply ``key.sub=value`` overrides (values parsed as YAML).

    Overrides address list items by index, e.g. ``methods.0.loss.params.margin=0.2``.
    """
    data = read_yaml_mapping(path, "'fixed', 'protocol' and 'methods'", "configs/bench_*.yaml")
    parsed = parse_overrides(overrides)
    data = apply_dict_overrides(fresh_preset(data, parsed, "fixed.optimizer"), parsed)
    return bench_config_from_dict(data, source=str(path))


def dump_bench_config(config: BenchConfig) -> str:
    """The resolved config as YAML (written beside the results)."""
    return yaml.dump(config.model_dump(mode="json"), Dumper=YamlDumper, sort_keys=False, default_flow_style=None)
