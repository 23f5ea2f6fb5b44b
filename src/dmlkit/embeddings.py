"""The embeddings stage: one inference loop, frozen-trunk feature caching, embeddings files.

Everything that turns a dataset into an ``(N, D)`` array goes through :func:`embed`: batches
in dataset order, no gradients, eval mode (each sub-module's own train/eval mode restored
afterwards, so frozen BatchNorm stays frozen), ``torch.autocast`` on CUDA when asked, outputs
flattened to ``(N, D)`` float32, non-finite output refused. Around it:

* :class:`InferenceOptions` (batch size, device, workers, AMP, frozen trunk, feature cache):
  ``InferenceOptions.from_config(config)`` reads the experiment config's ``evaluation``,
  ``data``, ``model`` and ``training`` sections;
* :func:`embed_model`: a model's embeddings of a dataset as the run saw it (in frozen-trunk
  mode via cached trunk features and the model's head, :class:`HeadOnly`);
* :func:`extract_features`: the frozen trunk's features, computed once and cached in an
  ``.npz`` keyed by ``sha256(trunk name, trunk weights, dataset fingerprint, transform)``;
* :func:`save_embeddings` / :func:`load_embeddings`: the ``.npz`` file format that
  ``dmlkit embed`` writes and ``dmlkit evaluate``, ``dmlkit report`` and the apps read.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import warnings
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from dmlkit.config import DEFAULT_EVAL_BATCH_SIZE, ExperimentConfig
from dmlkit.data.base import ArrayDataset, MetricDataset
from dmlkit.distributed import all_gather_unequal, context, shard_bounds
from dmlkit.embedding_files import DATASET_ID, read_embedding_file, repeated_name
from dmlkit.exceptions import ConfigError, NonFiniteError, ShapeError
from dmlkit.models.placement import to_device
from dmlkit.signals import ignore_stop_signals, signals_deferred
from dmlkit.utils import atomic_write_bytes, portable_path
from dmlkit.validation import check_embeddings, check_labels

__all__ = [
    "DEFAULT_EVAL_BATCH_SIZE",
    "FILE_SIZES",
    "HeadOnly",
    "InferenceOptions",
    "autocast_dtype",
    "dataset_items",
    "dataset_rows",
    "default_feature_cache_dir",
    "embed",
    "embed_model",
    "embed_sharded",
    "rank_share",
    "items_base",
    "relative_paths",
    "embed_split",
    "iter_embed",
    "iter_embed_model",
    "extract_features",
    "feature_cache_key",
    "file_sizes",
    "load_embeddings",
    "resolve_device",
    "save_embeddings",
    "state_dict_digest",
    "trunk_features",
    "trunk_features_sharded",
]

_CACHE_VERSION = "3"  # 2: trunk options and non-persistent buffers in the key; 3: the precision


def resolve_device(device: str | torch.device | None = "auto") -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; asking for CUDA without one is an error."""
    if isinstance(device, torch.device):
        return device
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("the device is 'cuda' but no CUDA GPU is available: use 'auto' or 'cpu'")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ConfigError(f"unknown device {device!r}: use 'auto', 'cpu', 'cuda' or 'cuda:N'") from None


def autocast_dtype(device: str | torch.device) -> torch.dtype:
    """The ``torch.autocast`` dtype of ``training.amp`` on ``device`` (training and inference):
    bfloat16 where the GPU has it natively (no scaler), else float16 (a T4 or V100 only emulates
    bfloat16, slowly; a scaler in training); bfloat16 on the CPU, where dmlkit never autocasts."""
    cuda = torch.device(device).type == "cuda"
    return torch.float16 if cuda and not torch.cuda.is_bf16_supported(including_emulation=False) else torch.bfloat16


# -- the one inference loop -------------------------------------------------------------------
def embed(
    model: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    dataset: Dataset,
    batch_size: int = DEFAULT_EVAL_BATCH_SIZE,
    device: str | torch.device | None = "auto",
    *,
    num_workers: int = 0,
    amp: bool = False,
    progress: bool = False,
    desc: str = "embed",
) -> tuple[np.ndarray, np.ndarray]:
    """``(outputs float32 (N, D), labels int64 (N,))`` of every sample of ``dataset``, in order
    (:func:`iter_embed`'s batches): ``model`` runs in eval mode without gradients, every
    sub-module's train/eval mode restored afterwards; outputs flattened to ``(N, D)``; the
    dataset's own (original) class ids. ``amp``: autocast on CUDA only, in training's dtype."""
    batches = list(iter_embed(model, dataset, batch_size, device, num_workers=num_workers, amp=amp,
                              progress=progress, desc=desc))
    if not batches:
        return np.zeros((0, 0), dtype=np.float32), np.zeros((0,), dtype=np.int64)
    return np.concatenate([e for e, _ in batches]), np.concatenate([y for _, y in batches])


def iter_embed(
    model: nn.Module | Callable[[torch.Tensor], torch.Tensor],
    dataset: Dataset,
    batch_size: int = DEFAULT_EVAL_BATCH_SIZE,
    device: str | torch.device | None = "auto",
    *,
    num_workers: int = 0,
    amp: bool = False,
    progress: bool = False,
    desc: str = "embed",
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The inference loop of :func:`embed`, one ``(float32 (B, D), int64 (B,))`` batch at a
    time in dataset order, so a caller can write outputs away (e.g. as embedding shards)
    without holding ``N x D``. NaN/inf outputs raise :class:`~dmlkit.exceptions.NonFiniteError`;
    modes are restored when the iteration ends. ``amp`` autocasts in :func:`autocast_dtype`. A
    module is placed by :func:`dmlkit.models.to_device` (moved, and on CPU or CUDA stored
    channels-last if it has convolutions), in place, as training and checkpoint loads place it."""
    dev = resolve_device(device)
    modes: dict[nn.Module, bool] = {}
    if isinstance(model, nn.Module):
        modes = {m: m.training for m in model.modules()}
        model.eval()
        to_device(model, dev)  # in place; CPU / CUDA convolutions channels-last (faster forwards)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers,
                        worker_init_fn=ignore_stop_signals, pin_memory=dev.type == "cuda")
    use_amp, amp_dtype = amp and dev.type == "cuda", autocast_dtype(dev)  # training's dtype
    try:
        with signals_deferred():  # a Ctrl-C / SIGTERM while the workers fork is not lost
            batches: Any = iter(loader)
        if progress:
            from tqdm.auto import tqdm

            batches = tqdm(batches, desc=desc, leave=False, unit="batch")
        for x, y in batches:
            x = x.to(dev, non_blocking=True)
            with torch.no_grad(), torch.autocast(device_type=dev.type, dtype=amp_dtype, enabled=use_amp):
                e = model(x)
            e = e.float().reshape(e.shape[0], -1).cpu().numpy().astype(np.float32, copy=False)
            if not np.isfinite(e).all():
                raise NonFiniteError("the model produced NaN/inf outputs: the checkpoint is likely diverged")
            yield e, np.asarray(y, dtype=np.int64)
    finally:
        for m, was_training in modes.items():
            m.training = was_training


# -- frozen-trunk features --------------------------------------------------------------------
def state_dict_digest(module: nn.Module) -> str:
    """SHA-256 over a module's state dict (names, shapes, dtypes and bytes)."""
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        h.update(name.encode())
        h.update(str((tuple(t.shape), str(t.dtype))).encode())
        tc = t.detach().cpu().contiguous()
        tc = tc.float() if tc.dtype == torch.bfloat16 else tc
        h.update(tc.numpy().tobytes() if tc.numel() else b"")
    return h.hexdigest()


def _buffers_digest(module: nn.Module) -> str:
    """SHA-256 over the buffers a state dict leaves out (``persistent=False``, e.g. a trunk's
    input conversion constants)."""
    saved = set(module.state_dict())
    h = hashlib.sha256()
    for name, t in module.named_buffers():
        if name in saved:
            continue
        tc = t.detach().cpu().float().contiguous()
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(tc.numpy().tobytes() if tc.numel() else b"")
    return h.hexdigest()


def uncacheable_transform(transform: object) -> bool:
    """Whether ``repr(transform)`` cannot identify what it does (a torchvision ``Lambda`` or an
    object with the default ``<... object at 0x...>`` repr), so it must not key a cache."""
    text = repr(transform)
    return "Lambda(" in text or " object at 0x" in text


def feature_cache_key(trunk: nn.Module, dataset: MetricDataset, key: str | None = None,
                      precision: torch.dtype = torch.float32) -> str:
    """The cache key of ``trunk`` features of ``dataset`` (with its current transform): a hash of
    the trunk's name, its recorded build options (``dmlkit_options``: ``input_space``,
    ``global_pool``, ... change the outputs, not the weights), its state dict, its
    non-persistent buffers, the dataset fingerprint, the transform's repr and the ``precision``
    of the forward (float32, or the autocast dtype of ``amp`` on CUDA: float16 features were
    reused for a bfloat16 or float32 run)."""
    name = key or getattr(trunk, "dmlkit_name", None) or type(trunk).__name__
    options = json.dumps(getattr(trunk, "dmlkit_options", None), sort_keys=True, default=repr)
    h = hashlib.sha256()
    for part in (_CACHE_VERSION, str(name), options, state_dict_digest(trunk), _buffers_digest(trunk),
                 dataset.fingerprint(), repr(dataset.transform), str(precision)):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def default_feature_cache_dir() -> Path:
    """``~/.cache/dmlkit/features``: where frozen-trunk features are cached by default."""
    return Path.home() / ".cache" / "dmlkit" / "features"


def extract_features(
    trunk: nn.Module,
    dataset: MetricDataset,
    batch_size: int = DEFAULT_EVAL_BATCH_SIZE,
    device: str | torch.device | None = "cpu",
    cache_dir: str | os.PathLike | None = None,
    *,
    key: str | None = None,
    num_workers: int = 0,
    progress: bool = False,
    amp: bool = False,
) -> ArrayDataset:
    """Trunk features of every sample of ``dataset`` as an in-memory feature dataset.

    On a CPU a pretrained trunk costs ~0.1 s per 224 x 224 image, so running it inside every
    training step is impractical: this runs it once (through :func:`embed`) and caches the
    ``(N, D)`` float32 features in ``cache_dir`` under :func:`feature_cache_key` (no stale file
    for another trunk, option, weights, subset, transform or precision). A transform whose repr
    does not say what it does (a ``Lambda``, a default object repr) is not cached (a warning).

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
    cache_file: Path | None = None
    feats: np.ndarray | None = None
    hit = False
    if cache_dir is not None and uncacheable_transform(dataset.transform):
        warnings.warn(f"features of {dataset.name} are not cached: its transform's repr (a Lambda "
                      "or a default object repr) does not identify what it does", stacklevel=2)
        cache_dir = None
    if cache_dir is not None:
        dev = resolve_device(device)
        digest = feature_cache_key(trunk, dataset, key, autocast_dtype(dev) if amp and dev.type == "cuda"
                                   else torch.float32)
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", dataset.name)[:60]
        cache_file = Path(cache_dir).expanduser() / f"{safe}-{digest[:24]}.npz"
        if cache_file.exists():
            try:
                with np.load(cache_file, allow_pickle=False) as data:
                    if np.array_equal(data["labels"], dataset.labels):
                        feats, hit = data["features"], True
            except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
                feats = None  # unreadable cache (truncated, a bad CRC): recompute and overwrite
    if feats is None:
        feats, _ = embed(trunk, dataset, batch_size, device, num_workers=num_workers, amp=amp,
                         progress=progress, desc=f"features {dataset.name}")
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


class HeadOnly(nn.Module):
    """``features -> embeddings`` with an :class:`~dmlkit.models.EmbeddingModel`'s own head."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.model.embed_features(features)


# -- a model's embeddings of a dataset --------------------------------------------------------
@dataclass(frozen=True)
class InferenceOptions:
    """How to embed a dataset: batch size, device, loader workers, AMP, frozen-trunk caching."""

    batch_size: int = DEFAULT_EVAL_BATCH_SIZE
    device: str | torch.device = "auto"
    num_workers: int = 0
    amp: bool = False
    frozen_trunk: bool = False
    cache_dir: str | os.PathLike | None = None

    @classmethod
    def from_config(cls, config: ExperimentConfig, device: str | torch.device | None = None) -> InferenceOptions:
        """The options a run of ``config`` uses (``device`` overrides ``training.device``)."""
        return cls(
            batch_size=config.evaluation.batch_size,
            device=config.training.device if device is None else device,
            num_workers=config.data.num_workers,
            amp=config.training.amp,
            frozen_trunk=config.model.frozen_trunk,
            cache_dir=config.model.feature_cache_dir or default_feature_cache_dir(),
        )

    def with_device(self, device: str | torch.device) -> InferenceOptions:
        return replace(self, device=device)


def trunk_features(model: nn.Module, dataset: MetricDataset, options: InferenceOptions,
                   progress: bool = False) -> ArrayDataset:
    """``model.trunk``'s features of ``dataset`` (cached, :func:`extract_features`)."""
    return extract_features(
        model.trunk, dataset, batch_size=options.batch_size, device=resolve_device(options.device),
        cache_dir=options.cache_dir, num_workers=options.num_workers, progress=progress,
        amp=options.amp,
    )


def trunk_features_sharded(model: nn.Module, dataset: MetricDataset, options: InferenceOptions,
                           progress: bool = False) -> ArrayDataset:
    """:func:`trunk_features` split over the ranks of a distributed job: each rank extracts (and
    caches) its contiguous shard, the shards are gathered (:func:`embed_sharded`) and every
    rank gets the whole feature dataset. The trunk's forward pass, the expensive part of a
    frozen-trunk run, is divided ``W`` ways. One process: :func:`trunk_features`."""
    ctx = context()
    if not ctx.enabled or len(dataset) < ctx.world_size:
        return trunk_features(model, dataset, options, progress)
    hits: list[bool] = []

    def extract(shard: Dataset) -> tuple[np.ndarray, np.ndarray]:
        feats = trunk_features(model, shard, options, progress)  # type: ignore[arg-type]
        hits.append(bool(feats.meta.get("cache_hit")))
        return np.asarray(feats.data, dtype=np.float32), np.asarray(feats.labels, dtype=np.int64)

    data, _ = embed_sharded(extract, dataset)
    return ArrayDataset(
        data, dataset.labels, kind="features",
        class_names=dataset.class_names, class_groups=dataset.class_groups,
        split_groups=dataset.split_groups, sample_groups=dataset.sample_groups,
        name=f"{dataset.name}:features",
        meta={"cache_hit": all(hits), "cache_file": None, "sharded_over": ctx.world_size,
              "source_fingerprint": dataset.fingerprint(), "source_paths": dataset.paths},
    )


def embed_model(model: nn.Module, dataset: MetricDataset, options: InferenceOptions | None = None,
                progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """A model's ``(embeddings, labels)`` of ``dataset`` as its run saw it.

    With ``options.frozen_trunk`` the trunk's (cached) features go through the model's head
    (:class:`HeadOnly`), exactly as in training; otherwise the whole model runs on the images."""
    options = options or InferenceOptions()
    if options.frozen_trunk:
        feats = trunk_features(model, dataset, options, progress=progress)
        return embed(HeadOnly(model), feats, options.batch_size, options.device)
    return embed(model, dataset, options.batch_size, options.device, num_workers=options.num_workers,
                 amp=options.amp, progress=progress)


def rank_share(dataset: Dataset) -> tuple[Dataset, int, int, bool]:
    """``(share, start, stop, split)``: the contiguous rows ``start:stop`` of ``dataset`` this
    rank of a distributed job embeds (:func:`dmlkit.distributed.shard_bounds`), as a dataset;
    ``split`` is False, and the share the whole dataset, for one process or a dataset with
    fewer rows than ranks (then embedded whole on every rank)."""
    ctx = context()
    n = len(dataset)  # type: ignore[arg-type]
    if not ctx.enabled or n < ctx.world_size:
        return dataset, 0, n, False
    start, stop = shard_bounds(n, ctx.world_size, ctx.rank)
    rows = np.arange(start, stop, dtype=np.int64)
    if isinstance(dataset, MetricDataset):
        return dataset.subset(rows), start, stop, True
    return torch.utils.data.Subset(dataset, rows.tolist()), start, stop, True


def embed_sharded(
    fn: Callable[[Dataset], tuple[np.ndarray, np.ndarray]], dataset: Dataset,
) -> tuple[np.ndarray, np.ndarray]:
    """``fn(dataset)`` computed in shards across the ranks of a distributed job, gathered on
    every rank in dataset order; plain ``fn(dataset)`` for one process.

    Rank ``r`` of ``W`` runs ``fn`` (e.g. ``lambda d: embed_model(model, d, options)``) on the
    contiguous rows :func:`dmlkit.distributed.shard_bounds` gives it, so every row is embedded
    exactly once (no :class:`~torch.utils.data.DistributedSampler` padding to drop); the
    shares are concatenated in rank order, which restores the dataset order. Every rank ends
    up with the whole ``(N, D)`` array: the gather costs ``N x D`` floats per rank.
    Datasets with fewer rows than ranks are embedded whole on every rank."""
    shard, _, _, split = rank_share(dataset)
    if not split:
        return fn(dataset)
    emb, labels = fn(shard)
    emb_all = all_gather_unequal(torch.from_numpy(np.ascontiguousarray(emb, dtype=np.float32)))
    labels_all = all_gather_unequal(torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64)))
    return emb_all.numpy(), labels_all.numpy()


def iter_embed_model(model: nn.Module, dataset: MetricDataset, options: InferenceOptions | None = None,
                     progress: bool = False) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """:func:`embed_model` one batch at a time (:func:`iter_embed`); frozen-trunk runs go
    through the cached trunk features and the model's head, as in :func:`embed_model`."""
    options = options or InferenceOptions()
    if options.frozen_trunk:
        feats = trunk_features(model, dataset, options, progress=progress)
        return iter_embed(HeadOnly(model), feats, options.batch_size, options.device)
    return iter_embed(model, dataset, options.batch_size, options.device, num_workers=options.num_workers,
                      amp=options.amp, progress=progress)


def embed_split(model: nn.Module, dataset: MetricDataset, config: ExperimentConfig,
                device: str | torch.device = "auto", progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """:func:`embed_model` with the options of ``config`` (``InferenceOptions.from_config``)."""
    return embed_model(model, dataset, InferenceOptions.from_config(config, device), progress)


def dataset_rows(dataset: Dataset) -> np.ndarray:
    """Row numbers of a (subset) dataset in its full dataset, for ``embeddings/*.npz``."""
    rows = getattr(dataset, "_rows", None)
    return np.asarray(rows, dtype=np.int64) if rows is not None else np.arange(len(dataset), dtype=np.int64)


def relative_paths(paths: Sequence[str], root: str | os.PathLike) -> np.ndarray:
    """``paths`` relative to the data root ``root`` (one outside it as given), spelled as a UTF-8
    system spells them (:func:`dmlkit.utils.portable_path`): a run's item ids, in any locale."""
    base = os.path.abspath(os.fspath(root))
    return np.asarray([portable_path(os.path.relpath(p, base) if os.path.abspath(p).startswith(base + os.sep) else p)
                       for p in paths], dtype=str)


def items_base(dataset: Any, root: str | os.PathLike) -> str:
    """The folder a run's item ids (its ``paths``) are relative to: the data root ``root``, or
    for a file root (a ``csv`` dataset's list) the folder its relative paths are resolved
    against (``meta["root"]``: ``image_root``, else the list's folder). Relative to the file no
    path was inside it: every id was absolute, and a copy of the data elsewhere "changed"."""
    root = os.fspath(root)
    if not os.path.isfile(root):
        return root
    meta = getattr(dataset, "meta", None)
    base = meta.get("root") if isinstance(meta, dict) else None
    return os.fspath(base) if base else os.path.dirname(os.path.abspath(root))


FILE_SIZES = "file_sizes"  #: the key of each row's file size in a run's embeddings file


def dataset_items(dataset: Dataset, root: str | os.PathLike) -> dict[str, np.ndarray]:
    """What a run's ``embeddings/*.npz`` records of its rows: ``indices`` (:func:`dataset_rows`)
    and, for data in files, ``paths`` (relative to the data root ``root`` or a ``csv`` list's
    image folder: :func:`items_base`, :func:`relative_paths`) and ``file_sizes``, so ``dmlkit
    index``/``query``/``verify`` refuse data changed since (a file added to or renamed in a class
    folder shifted the rows; other images under the same names passed; two of one size still do);
    in-memory data ``dataset_id``, its whole storage's digest (same id + index: the same item)."""
    items = {"indices": dataset_rows(dataset)}
    paths, storage = getattr(dataset, "paths", None), getattr(dataset, "_storage_fingerprint", None)
    if paths is None and storage is not None:  # the whole data set's fingerprint, not the rows'
        items[DATASET_ID] = np.asarray(hashlib.sha256(f"{type(dataset).__name__}:{storage()}".encode()).hexdigest()[:32])
    if paths is not None:
        items["paths"] = relative_paths(paths, items_base(dataset, root))
        items[FILE_SIZES] = file_sizes(paths)
    return items


def file_sizes(paths: Sequence[str | os.PathLike]) -> np.ndarray:
    """Each file's size in bytes (int64; -1: unreadable), per row: rows sliced keep theirs."""
    out = np.full(len(paths), -1, dtype=np.int64)
    for i, p in enumerate(paths):
        with contextlib.suppress(OSError):
            out[i] = os.stat(p).st_size
    return out


# -- embeddings files -------------------------------------------------------------------------
def save_embeddings(path: str | os.PathLike, embeddings: Any, labels: Any, **extra: Any) -> Path:
    """Save ``embeddings (N, D)`` and ``labels (N,)`` (+ extra arrays) to ``.npz`` atomically.

    The file holds the keys ``embeddings`` (float32) and ``labels`` (int64) and any ``extra``
    arrays (e.g. ``indices``, the dataset rows). :func:`load_embeddings` reads it back.
    Labels go through :func:`dmlkit.validation.check_labels`: a fractional float is refused
    (it was truncated: 0.1 ... 0.9 saved as one class 0), and class-name strings are stored as
    codes with their names in ``class_names`` (they raised numpy's ``ValueError``), which
    every reader turns back into the names.
    """
    emb = _to_numpy(embeddings).astype(np.float32, copy=False)
    if emb.ndim != 2:
        raise ShapeError(f"need embeddings (N, D) and labels (N,), got {emb.shape} and {np.shape(labels)}")
    lab, names = check_labels(labels, emb.shape[0], "labels")
    if names is not None:
        if "class_names" in extra:
            raise ShapeError("labels are class names and class_names is given too: pass the names "
                             "as labels, or integer codes with their class_names")
        extra["class_names"] = np.asarray(names)
    buffer = io.BytesIO()
    np.savez(buffer, embeddings=emb, labels=lab, **{k: _extra_array(k, v) for k, v in extra.items()})
    return atomic_write_bytes(path, buffer.getvalue())


def _extra_array(key: str, value: Any) -> np.ndarray:
    """An extra of :func:`save_embeddings` as an array every reader loads (``np.load`` with
    ``allow_pickle=False``): paths become strings; what numpy could only store as pickled
    Python objects (``None``, a dict, mixed or ragged items) is refused, naming the key."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    elif isinstance(value, list | tuple):
        value = [os.fspath(v) if isinstance(v, os.PathLike) else v for v in value]
    try:
        arr = np.asarray(value)
    except ValueError:  # ragged sequences
        arr = np.empty(0, dtype=object)
    if arr.dtype.hasobject:
        raise ShapeError(f"extra {key!r} is not an array of numbers or strings (numpy would pickle it, "
                         "and no reader loads pickled data): save numbers or strings, e.g. str() of each item")
    return arr


def load_embeddings(
    path: str | os.PathLike, labels_path: str | os.PathLike | None = None, *,
    class_names: Sequence[str] | np.ndarray | None = None, codes: bool = False,
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Read ``(embeddings, labels, extra)`` from ``.npz``, ``.npy`` or ``.pt``.

    ``.npz`` and ``.pt`` files hold ``embeddings`` and ``labels`` (a ``.pt`` may also be a
    ``(embeddings, labels)`` tuple). A ``.npy`` holds embeddings only: pass ``labels_path``
    (``.npy``/``.txt``/``.csv``, one label per row). Integer labels come back as int64.
    Class-name labels (strings, or codes with their ``class_names``, as :func:`save_embeddings`
    writes them) come back as names (no ``extra["class_names"]``), as ``dmlkit evaluate`` reads
    them, so two files match by name in :func:`dmlkit.metrics.evaluate` (per-file codes matched
    code 0 of one file with code 0 of the other: P@1 0.016, not 0.995). ``codes=True``: int64
    codes into the file's sorted names, ``extra["class_names"]``; ``class_names``: codes into
    that table followed by the file's names it lacks (with integer labels: :class:`ShapeError`)."""
    path = Path(path)
    table = None if class_names is None else _class_table(class_names)
    emb, labels, extra = read_embedding_file(path, labels_path)
    emb = np.asarray(emb)
    if emb.ndim != 2:
        raise ShapeError(f"embeddings in {path} must be 2-D (N, D), got shape {emb.shape}")
    # NaN, infinity and float64 values beyond float32's range are one error naming the file and
    # row, as in the CLI (the cast below turned 1e39 into inf with only numpy's RuntimeWarning)
    check_embeddings(emb, name=f"embeddings in {path}")
    # integer labels pass; fractional, NaN or mixed labels are refused (never truncated)
    labels, names = check_labels(np.asarray(labels), emb.shape[0], name=f"labels of {path}",
                                 class_names=table)
    if names is not None:  # names: no table beside them (save_embeddings(**extra) refused both)
        extra["class_names"] = np.asarray(names)
        labels = labels if codes or table is not None else extra.pop("class_names")[labels]
    return emb.astype(np.float32, copy=False), labels, extra


def _class_table(class_names: Sequence[str] | np.ndarray) -> list[str]:
    """``class_names`` of :func:`load_embeddings` as a list of distinct strings."""
    arr = np.asarray(class_names)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind != "U"):
        raise ShapeError(f"class_names must be a 1-D list of class-name strings (e.g. another file's "
                         f"extra['class_names']), got {arr.dtype} of shape {arr.shape}")
    table = [str(c) for c in arr.tolist()]
    twice = repeated_name(table)
    if twice is not None:
        raise ShapeError(f"class_names holds {twice!r} twice: pass each class name once")
    return table


def _to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        x = x.float() if x.dtype.is_floating_point else x  # a no-op for float32
        return x.numpy()
    return np.asarray(x)
