"""Training: builders from config sections, one trainer for every loss/miner, checkpoints.

Public API::

    from dmlkit.training import load_config, train, load_checkpoint

    config = load_config("configs/quickstart.yaml", ["training.epochs=2"])
    result = train(config, "runs/quickstart")            # -> TrainResult; writes the run directory
    model, config = load_checkpoint("runs/quickstart")   # best checkpoint, eval mode

Modules: :mod:`~dmlkit.training.builders` (config section -> object),
:mod:`~dmlkit.training.loop` (:class:`Trainer` over a :class:`TrainState`),
:mod:`~dmlkit.training.checkpoint` (checkpoints, resume checks),
:mod:`~dmlkit.training.runlog` (``log.jsonl``) and :mod:`~dmlkit.training.trainer`
(:func:`train`). The experiment config lives in :mod:`dmlkit.config` and inference in
:mod:`dmlkit.embeddings`; their names are re-exported here so existing imports keep working.
"""

from __future__ import annotations

from dmlkit.config import (
    FIXED_SECTIONS,
    OPTIMIZER_PRESETS,
    DataConfig,
    EvaluationConfig,
    ExperimentConfig,
    LossConfig,
    MinerConfig,
    ModelConfig,
    OptimizerConfig,
    SamplerConfig,
    SplitConfig,
    TrainingConfig,
    apply_overrides,
    config_from_dict,
    dump_config,
    load_config,
    parse_overrides,
)
from dmlkit.embeddings import embed, embed_split, resolve_device
from dmlkit.training.builders import (
    UnusedParametersWarning,
    build_datasets,
    build_loss,
    build_miner,
    build_model,
    build_optimizer,
    build_sampler,
    build_split,
)
from dmlkit.training.checkpoint import find_checkpoint, load_checkpoint, read_checkpoint
from dmlkit.training.loop import Trainer, TrainState
from dmlkit.training.runlog import read_log
from dmlkit.training.trainer import TrainResult, embed_run, embed_run_to_shards, train

__all__ = [
    "FIXED_SECTIONS",
    "OPTIMIZER_PRESETS",
    "DataConfig",
    "EvaluationConfig",
    "ExperimentConfig",
    "LossConfig",
    "MinerConfig",
    "ModelConfig",
    "OptimizerConfig",
    "SamplerConfig",
    "SplitConfig",
    "TrainResult",
    "TrainState",
    "Trainer",
    "TrainingConfig",
    "UnusedParametersWarning",
    "apply_overrides",
    "build_datasets",
    "build_loss",
    "build_miner",
    "build_model",
    "build_optimizer",
    "build_sampler",
    "build_split",
    "config_from_dict",
    "dump_config",
    "embed",
    "embed_run",
    "embed_run_to_shards",
    "embed_split",
    "find_checkpoint",
    "load_checkpoint",
    "load_config",
    "parse_overrides",
    "read_checkpoint",
    "read_log",
    "resolve_device",
    "train",
]
