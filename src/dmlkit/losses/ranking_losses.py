"""Deprecated alias of :mod:`dmlkit.losses.pair_weighting_losses` (the module's old name).

Every public name still resolves here, with a ``DeprecationWarning``; import from
``dmlkit.losses`` or ``dmlkit.losses.pair_weighting_losses`` instead.
"""

from __future__ import annotations

import warnings
from typing import Any

from dmlkit.losses import pair_weighting_losses as _new


def __getattr__(name: str) -> Any:
    if name.startswith("__") or not hasattr(_new, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"dmlkit.losses.ranking_losses.{name} moved to dmlkit.losses.pair_weighting_losses."
        f"{name}; import it from there (or from dmlkit.losses)",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(_new, name)
