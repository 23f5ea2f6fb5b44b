"""The data root of a run: the config's ``data.root`` and ``--data-root`` merged (one folder,
never two), and the dataset a config's ``data`` section names loaded from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dmlkit.config import DataConfig, ExperimentConfig
from dmlkit.data import load_dataset
from dmlkit.data.datasets import DATA_ROOT_HINT
from dmlkit.exceptions import ConfigError, DataNotFoundError
from dmlkit.utils import data_root as resolve_data_root

__all__ = ["load_config_dataset", "load_dataset_at", "merge_data_root", "run_data_root", "with_data_root"]


def merge_data_root(config_root: str | None, data_root: str | Path | None, key: str = "data.root") -> str | None:
    """The data root of a run: the config's ``data.root`` or ``--data-root``, whichever is given.

    Both given and naming the same folder is fine; two different folders raise a
    :class:`ConfigError` (one silently replacing the other would train on other data than the
    config says). Returns ``None`` when neither is given (``$DMLKIT_DATA`` applies).
    """
    if data_root is None:
        return config_root
    if config_root is None:
        return str(data_root)
    a, b = Path(config_root).expanduser().resolve(), Path(data_root).expanduser().resolve()
    if a != b:
        raise ConfigError(
            f"the config sets {key} = {config_root} but --data-root is {data_root}: they name "
            f"different folders. Drop --data-root to use the config's, or replace the config's "
            f"with --set {key}={data_root}"
        )
    return config_root


def run_data_root(config_root: str | None, data_root: str | Path | None) -> Path:
    """The folder a command on a trained run reads data from: ``data_root`` (``--data-root``)
    where given, else the run config's ``data.root``, else ``$DMLKIT_DATA``, else
    ``~/.cache/dmlkit/data``. The run's recorded root lets ``embed``, ``oneshot``, ... find the
    data from any working directory; ``--data-root`` replaces it (the data may have moved since
    training, where :func:`merge_data_root` refuses two folders for a new run)."""
    return resolve_data_root(data_root if data_root is not None else config_root)


def with_data_root(config: ExperimentConfig, data_root: str | Path | None) -> ExperimentConfig:
    """``config`` with ``data.root`` set from ``data_root`` (:func:`merge_data_root` rules).

    The root is recorded as an absolute path, whether ``data_root`` (``--data-root``) or the
    config's own ``data.root`` (a config file, ``--set``) gave it: a relative one is relative to
    the current working directory, as every path in a config is (``data.split.path``,
    ``model.feature_cache_dir``), and ``~`` is expanded. The run's ``config.yaml`` keeps it, and
    ``dmlkit embed``/``evaluate``/``report`` and ``--resume`` read it from any working directory
    (a relative ``data.root: dlink`` or ``--data-root dlink`` was recorded as ``dlink`` and read
    another folder, or none, from elsewhere). Symbolic links are kept, not resolved."""
    root = merge_data_root(config.data.root, data_root)
    if root is not None:
        root = str(Path(root).expanduser().absolute())
    if root == config.data.root:
        return config
    return config.override({"data.root": root})


def load_dataset_at(data: DataConfig, data_root: str | Path | None, *, fix: str, key: str = "data") -> Any:
    """Every class of the dataset ``data`` names, read from :func:`run_data_root`'s folder.

    Bad ``data.options`` raise a :class:`ConfigError`. Where the config's recorded ``data.root``
    was used (no ``data_root``), a :class:`DataNotFoundError` says so and how to ``fix`` it
    instead of the loaders' generic hint: ``$DMLKIT_DATA`` did not apply, pointing it elsewhere
    would change nothing."""
    try:
        return load_dataset(data.dataset, root=run_data_root(data.root, data_root), **data.options)
    except TypeError as exc:
        raise ConfigError(f"{key}.options for {data.dataset!r}: {exc}") from exc
    except DataNotFoundError as exc:
        if data_root is not None or data.root is None:
            raise
        said = str(exc).replace(DATA_ROOT_HINT, "").rstrip()
        raise DataNotFoundError(f"{said} The config records {key}.root = {data.root} ($DMLKIT_DATA "
                                f"does not apply): {fix}.") from exc


def load_config_dataset(data: DataConfig, data_root: str | Path | None = None, key: str = "data"):
    """Every class of the dataset a ``data`` section names (as ``build_datasets`` loads it), for
    a new run: ``data_root`` (``--data-root``) and the config's ``data.root`` must agree."""
    root = merge_data_root(data.root, data_root, f"{key}.root")
    fix = (f"point it at the data with --data-root PATH, or --set {key}.root=PATH where the config "
           "file sets it")
    # the config's own root (--data-root, if given, names the same folder) or --data-root alone
    given = None if data.root is not None else root
    return load_dataset_at(data, given, fix=fix, key=key), resolve_data_root(root)
