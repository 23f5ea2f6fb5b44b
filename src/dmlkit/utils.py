"""Small shared helpers: seeding, atomic writes, provenance, and embeddings files."""

from __future__ import annotations

import json
import os
import platform
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, MutableMapping
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from dmlkit.exceptions import DataError, DataNotFoundError, ShapeError

__all__ = [
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "atomic_torch_save",
    "data_root",
    "load_embeddings",
    "provenance",
    "registering",
    "save_embeddings",
    "seed_everything",
]

_T = TypeVar("_T", bound=type)


def registering(
    registry: MutableMapping[str, type], kind: str, names: tuple[str, ...]
) -> Callable[[_T], _T]:
    """Class decorator storing ``cls`` in ``registry`` under each of ``names``.

    Shared by :func:`dmlkit.losses.base.register_loss` and :func:`dmlkit.miners.register_miner`.
    Registering a *different* class under a taken name raises ``RuntimeError`` (``kind`` names
    the registry in the message); registering the same class again is a no-op.
    """

    def decorator(cls: _T) -> _T:
        for name in names:
            if name in registry and registry[name] is not cls:
                raise RuntimeError(f"{kind} name {name!r} registered twice")
            registry[name] = cls
        return cls

    return decorator


def seed_everything(seed: int, deterministic: bool = False) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA); optionally request deterministic kernels."""
    import torch

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def data_root(explicit: str | os.PathLike | None = None) -> Path:
    """The data root: ``explicit``, else ``$DMLKIT_DATA``, else ``~/.cache/dmlkit/data``."""
    if explicit is not None:
        return Path(explicit).expanduser()
    env = os.environ.get("DMLKIT_DATA")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "dmlkit" / "data"


# -- atomic writes --------------------------------------------------------------------------
def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temporary file in the same folder, fsync, rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | os.PathLike, obj: Any, indent: int = 2) -> Path:
    return atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=False, default=_json_default) + "\n")


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> Path:
    """``torch.save`` that never leaves a half-written file behind."""
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return atomic_write_bytes(path, buffer.getvalue())


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


# -- provenance ----------------------------------------------------------------------------
_PACKAGES = ("dmlkit", "torch", "torchvision", "numpy", "scikit-learn", "faiss-cpu", "optuna")


def _git_commit(cwd: Path | None = None) -> str | None:
    here = cwd or Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here, capture_output=True, text=True, timeout=5,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def provenance(seed: int | None = None, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """What is needed to reproduce a number: time, seed, versions, git commit, machine."""
    versions: dict[str, str | None] = {}
    for name in _PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    info: dict[str, Any] = {
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "seed": seed,
        "versions": versions,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "git_commit": _git_commit(),
        "argv": sys.argv,
    }
    if extra:
        info.update(extra)
    return info


# -- embeddings files ------------------------------------------------------------------------
def save_embeddings(
    path: str | os.PathLike, embeddings: Any, labels: Any, **extra: Any
) -> Path:
    """Save ``embeddings (N, D)`` and ``labels (N,)`` (+ extra arrays) to ``.npz`` atomically.

    The file holds the keys ``embeddings`` (float32) and ``labels`` (int64) and any ``extra``
    arrays (e.g. ``paths``). :func:`load_embeddings` reads it back.
    """
    import io

    emb = _to_numpy(embeddings).astype(np.float32, copy=False)
    lab = _to_numpy(labels).astype(np.int64, copy=False)
    if emb.ndim != 2 or lab.ndim != 1 or emb.shape[0] != lab.shape[0]:
        raise ShapeError(f"need embeddings (N, D) and labels (N,), got {emb.shape} and {lab.shape}")
    buffer = io.BytesIO()
    np.savez(buffer, embeddings=emb, labels=lab, **{k: np.asarray(v) for k, v in extra.items()})
    return atomic_write_bytes(path, buffer.getvalue())


def load_embeddings(
    path: str | os.PathLike, labels_path: str | os.PathLike | None = None
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Read ``(embeddings, labels, extra)`` from ``.npz``, ``.npy`` or ``.pt``.

    ``.npz`` and ``.pt`` files hold ``embeddings`` and ``labels`` (a ``.pt`` may also be a
    ``(embeddings, labels)`` tuple). A ``.npy`` holds embeddings only: pass ``labels_path``
    (``.npy``/``.txt``/``.csv``, one integer label per row).
    """
    path = Path(path)
    if not path.exists():
        raise DataNotFoundError(f"embeddings file not found: {path}")
    extra: dict[str, np.ndarray] = {}
    suffix = path.suffix.lower()
    labels: np.ndarray | None = None
    try:
        if suffix == ".npz":
            with np.load(path, allow_pickle=False) as data:
                if "embeddings" not in data:
                    raise DataError(f"{path} has no 'embeddings' array (keys: {sorted(data.files)})")
                emb = data["embeddings"]
                labels = data["labels"] if "labels" in data else None
                extra = {k: data[k] for k in data.files if k not in ("embeddings", "labels")}
        elif suffix == ".npy":
            emb = np.load(path, allow_pickle=False)
        elif suffix in (".pt", ".pth"):
            import torch

            obj = torch.load(path, map_location="cpu", weights_only=True)
            if isinstance(obj, dict):
                if "embeddings" not in obj:
                    raise DataError(f"{path} holds a dict without 'embeddings' (keys: {sorted(obj)})")
                emb, labels = _to_numpy(obj["embeddings"]), obj.get("labels")
            elif isinstance(obj, (tuple, list)) and len(obj) == 2:
                emb, labels = _to_numpy(obj[0]), obj[1]
            else:
                emb = _to_numpy(obj)
            labels = None if labels is None else _to_numpy(labels)
        else:
            raise DataError(f"unsupported embeddings file {path}: use .npz, .npy or .pt")
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read embeddings from {path}: {exc}") from exc
    if labels_path is not None:
        labels = _load_labels(Path(labels_path))
    if labels is None:
        raise DataError(
            f"{path} has no labels: save an .npz with 'embeddings' and 'labels', or pass a labels file"
        )
    emb = np.asarray(emb)
    labels = np.asarray(labels)
    if emb.ndim != 2:
        raise ShapeError(f"embeddings in {path} must be 2-D (N, D), got shape {emb.shape}")
    if labels.ndim != 1 or labels.shape[0] != emb.shape[0]:
        raise ShapeError(f"labels must be (N,) with N = {emb.shape[0]}, got shape {labels.shape}")
    return emb.astype(np.float32, copy=False), labels.astype(np.int64, copy=False), extra


def _load_labels(path: Path) -> np.ndarray:
    if not path.exists():
        raise DataNotFoundError(f"labels file not found: {path}")
    if path.suffix.lower() == ".npy":
        return np.load(path, allow_pickle=False)
    return np.loadtxt(path, dtype=np.int64, delimiter="," if path.suffix.lower() == ".csv" else None)


def _to_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        if x.dtype.is_floating_point and x.dtype != x.new_empty(0).float().dtype:
            x = x.float()
        return x.numpy()
    return np.asarray(x)
