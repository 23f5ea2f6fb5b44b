"""Frozen-trunk features: compute once, cache on disk, train only the head.

On a CPU a pretrained trunk costs ~0.1 s per 224 x 224 image, so running it inside every
training step is impractical. :func:`extract_features` runs the trunk once over a dataset (eval
mode, no gradients) and caches the ``(N, D)`` float32 features in an ``.npz`` keyed by

    sha256(trunk name, trunk state-dict bytes, dataset fingerprint, transform repr, version)

so a different trunk, weights, dataset subset or transform never reuses a stale file. The
result is an in-memory :class:`dmlkit.data.ArrayDataset` (``kind="features"``) with the same
labels, class names and groups, ready for a head-only training loop.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dmlkit.data.base import ArrayDataset, MetricDataset
from dmlkit.utils import atomic_write_bytes

__all__ = ["extract_features", "feature_cache_key", "state_dict_digest"]

_CACHE_VERSION = "1"


def state_dict_digest(module: nn.Module) -> str:
    """SHA-256 over a module's state dict (names, shapes, dtypes and bytes)."""
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        h.update(name.encode())
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        tc = t.detach().cpu().contiguous()
        if tc.dtype == torch.bfloat16:
            tc = tc.float()
        h.update(tc.numpy().tobytes() if tc.numel() else b"")
    return h.hexdigest()


def feature_cache_key(trunk: nn.Module, dataset: MetricDataset, key: str | None = None) -> str:
    """The cache key of ``trunk`` features of ``dataset`` (with its current transform)."""
    name = key or getattr(trunk, "dmlkit_name", None) or type(trunk).__name__
    h = hashlib.sha256()
    for part in (_CACHE_VERSION, str(name), state_dict_digest(trunk), dataset.fingerprint(),
                 repr(dataset.transform)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@torch.no_grad()
def _compute(trunk: nn.Module, dataset: MetricDataset, batch_size: int, device: torch.device,
             num_workers: int, progress: bool, amp: bool) -> np.ndarray:
    from torch.utils.data import DataLoader

    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers,
                        pin_memory=device.type == "cuda")
    iterator: Any = loader
    if progress:
        from tqdm.auto import tqdm

        iterator = tqdm(loader, desc=f"features {dataset.name}", unit="batch")
    modes = {m: m.training for m in trunk.modules()}
    trunk.eval()
    trunk.to(device)
    chunks = []
    try:
        for x, _ in iterator:
            x = x.to(device, non_blocking=True)
            with torch.autocast(device.type, enabled=amp and device.type == "cuda"):
                f = trunk(x)
            chunks.append(f.float().reshape(f.shape[0], -1).cpu().numpy())
    finally:
        for m, was in modes.items():
            m.training = was
    if not chunks:
        return np.zeros((0, 0), dtype=np.float32)
    return np.concatenate(chunks).astype(np.float32, copy=False)


def extract_features(
    trunk: nn.Module,
    dataset: MetricDataset,
    batch_size: int = 128,
    device: str | torch.device | None = "cpu",
    cache_dir: str | os.PathLike | None = None,
    *,
    key: str | None = None,
    num_workers: int = 0,
    progress: bool = False,
    amp: bool = False,
) -> ArrayDataset:
    """Trunk features of every sample of ``dataset`` as an in-memory feature dataset.

    Args:
        trunk: the frozen feature extractor (run in eval mode under ``no_grad``; its train/eval
            modes are restored afterwards).
        dataset: a :class:`MetricDataset` with its (evaluation) transform set.
        batch_size, device, num_workers, amp: inference settings (``device="auto"`` picks CUDA
            when available; ``amp`` uses autocast on CUDA).
        cache_dir: folder for cached ``.npz`` files; ``None`` disables caching.
        key: trunk identity for the cache (default: ``trunk.dmlkit_name`` set by
            :func:`dmlkit.models.build_trunk`); the state-dict digest is always part of the key.

    Returns:
        ``ArrayDataset(kind="features")``: ``ds[i] -> (float32 tensor (D,), label)``, the same
        labels, class names, class groups and sample groups as ``dataset``;
        ``ds.meta["cache_hit"]`` says whether the cache was used and ``ds.meta["cache_file"]``
        where it lives.
    """
    dev = _resolve_device(device)
    digest = feature_cache_key(trunk, dataset, key) if cache_dir is not None else None
    cache_file: Path | None = None
    feats: np.ndarray | None = None
    hit = False
    if cache_dir is not None and digest is not None:
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", dataset.name)[:60]
        cache_file = Path(cache_dir).expanduser() / f"{safe}-{digest[:24]}.npz"
        if cache_file.exists():
            try:
                with np.load(cache_file, allow_pickle=False) as data:
                    if np.array_equal(data["labels"], dataset.labels):
                        feats, hit = data["features"], True
            except (OSError, ValueError, KeyError):
                feats = None  # unreadable cache: recompute and overwrite
    if feats is None:
        feats = _compute(trunk, dataset, batch_size, dev, num_workers, progress, amp)
        if cache_file is not None:
            buffer = io.BytesIO()
            meta = {"dataset": dataset.name, "fingerprint": dataset.fingerprint(),
                    "trunk": key or getattr(trunk, "dmlkit_name", type(trunk).__name__),
                    "transform": repr(dataset.transform), "version": _CACHE_VERSION}
            np.savez(buffer, features=feats, labels=dataset.labels, meta=json.dumps(meta))
            atomic_write_bytes(cache_file, buffer.getvalue())
    return ArrayDataset(
        feats, dataset.labels, kind="features",
        class_names=dataset.class_names, class_groups=dataset.class_groups,
        split_groups=dataset.split_groups, sample_groups=dataset.sample_groups,
        name=f"{dataset.name}:features",
        meta={"cache_hit": hit, "cache_file": None if cache_file is None else str(cache_file),
              "source_fingerprint": dataset.fingerprint(), "source_paths": dataset.paths},
    )
