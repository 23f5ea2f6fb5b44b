"""Training: the experiment config, one trainer for every loss/miner, checkpoints and inference.

Public API::

    from dmlkit.training import ExperimentConfig, load_config, dump_config, train, embed, load_checkpoint

    config = load_config("configs/quickstart.yaml", ["training.epochs=2"])
    result = train(config, "runs/quickstart")            # -> TrainResult
    model, config = load_checkpoint("runs/quickstart")   # best checkpoint, eval mode
"""

from __future__ import annotations

from dmlkit.training.checkpoint import find_checkpoint, load_checkpoint, read_checkpoint
from dmlkit.training.config import (
    FIXED_SECTIONS,
    OPTIMIZER_PRESETS,
    DataConfig,
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
from dmlkit.training.embed import embed, resolve_device
from dmlkit.training.runlog import read_log
from dmlkit.training.trainer import (
    TrainResult,
    UnusedParametersWarning,
    build_datasets,
    build_loss,
    build_miner,
    build_model,
    build_optimizer,
    build_split,
    embed_split,
    train,
)

__all__ = [
    "FIXED_SECTIONS",
    "OPTIMIZER_PRESETS",
    "DataConfig",
    "ExperimentConfig",
    "LossConfig",
    "MinerConfig",
    "ModelConfig",
    "OptimizerConfig",
    "SamplerConfig",
    "SplitConfig",
    "TrainResult",
    "TrainingConfig",
    "UnusedParametersWarning",
    "apply_overrides",
    "build_datasets",
    "build_loss",
    "build_miner",
    "build_model",
    "build_optimizer",
    "build_split",
    "config_from_dict",
    "dump_config",
    "embed",
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
