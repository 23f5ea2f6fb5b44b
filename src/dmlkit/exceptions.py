"""The dmlkit exception hierarchy.

Every error a user can cause (bad config, missing data, wrong shapes, NaN embeddings, a class
with one sample, ...) is a :class:`DmlkitError`. Its message says what went wrong *and what to
do about it*. The CLI prints these without a traceback and exits with code 2.
"""

from __future__ import annotations


class DmlkitError(Exception):
    """Base class of every error dmlkit raises on purpose."""

    exit_code: int = 2


class ConfigError(DmlkitError, ValueError):
    """A configuration value or file is invalid."""


class DataError(DmlkitError):
    """Input data is missing, corrupt or malformed (files, labels, splits)."""


class DataNotFoundError(DataError, FileNotFoundError):
    """A dataset or file is not where it should be; the message says where to put it."""


class ShapeError(DmlkitError, ValueError):
    """Tensors have incompatible shapes or dtypes."""


class NonFiniteError(DmlkitError, ValueError):
    """Embeddings or a loss contain NaN or infinity."""


class CheckpointError(DmlkitError):
    """A checkpoint cannot be written, read or resumed from."""


class DependencyError(DmlkitError, ImportError):
    """An optional dependency is needed; the message names the extra to install."""


def require(module: str, extra: str):
    """Import an optional dependency or raise :class:`DependencyError` naming the pip extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise DependencyError(
            f"'{module}' is needed for this feature: pip install 'dmlkit[{extra}]'"
        ) from exc
