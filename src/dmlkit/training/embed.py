"""Deprecated location of inference: it moved to :mod:`dmlkit.embeddings` (one inference loop).

``from dmlkit.training.embed import embed, resolve_device`` keeps working (with a
``DeprecationWarning``); ``dmlkit.training`` still re-exports both names.
"""

from __future__ import annotations

import warnings
from typing import Any

import dmlkit.embeddings as _embeddings


def __getattr__(name: str) -> Any:
    if name not in ("embed", "resolve_device"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(f"dmlkit.training.embed.{name} moved to dmlkit.embeddings.{name}; import it from there",
                  DeprecationWarning, stacklevel=2)
    return getattr(_embeddings, name)
