"""Deprecated location of the experiment config: it moved to :mod:`dmlkit.config`.

``from dmlkit.training.config import ExperimentConfig`` keeps working (with a
``DeprecationWarning``); new code imports ``dmlkit.config`` (or ``dmlkit.training``, which
re-exports the public names).
"""

from __future__ import annotations

import warnings
from typing import Any

import dmlkit.config as _config


def __getattr__(name: str) -> Any:
    if name.startswith("__") or not hasattr(_config, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"dmlkit.training.config.{name} moved to dmlkit.config.{name}; import it from there",
        DeprecationWarning, stacklevel=2,
    )
    return getattr(_config, name)
