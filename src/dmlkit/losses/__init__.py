"""Metric learning losses, one module per family; see :mod:`dmlkit.losses.base`.

Every loss registered with :func:`register_loss` is importable from here by class name and
constructible by config name with :func:`get_loss`.
"""

from __future__ import annotations

import importlib
import pkgutil

from dmlkit.losses.base import LOSSES, BaseLoss, ProxyLoss, get_loss, register_loss  # noqa: F401
from dmlkit.losses.cross_batch_memory import CrossBatchMemory  # noqa: F401


def _import_all() -> None:
    for info in pkgutil.iter_modules(__path__):
        if not info.name.startswith("_") and info.name != "base":
            importlib.import_module(f"{__name__}.{info.name}")


_import_all()
globals().update({cls.__name__: cls for cls in LOSSES.values()})
__all__ = sorted({"LOSSES", "BaseLoss", "CrossBatchMemory", "ProxyLoss", "get_loss", "register_loss"} | {c.__name__ for c in LOSSES.values()})
