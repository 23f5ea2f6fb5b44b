"""Checkpoints: atomic writes, RNG state capture/restore, resume checks, loading a model back.

A checkpoint is a ``torch.save`` dict that loads with ``weights_only=True`` (tensors, numbers,
strings, lists, tuples and dicts only). Keys::

    format            "dmlkit-checkpoint-1"
    config            the resolved ExperimentConfig as plain data
    model             the EmbeddingModel state dict (trunk + head). In frozen-trunk runs the
                      fixed trunk is stored once in ``trunk.pt`` beside the checkpoint
                      (``trunk_file``: a plain file name in the checkpoint's folder, any
                      other is refused) and :func:`read_checkpoint` merges it back, so
                      ``payload["model"]`` is always complete
    optimizer, scaler optimiser / GradScaler state
    loss, miner       their state dicts (learnable weights, cross-batch memory buffers, ...)
    sampler_epoch     epochs the M-per-class sampler has completed
    rng               torch / numpy / python (/ cuda) generator states (rank 0's)
    rng_ranks         distributed runs: every rank's generator states, in rank order (each
                      rank of a resumed job continues its own streams); None for one process
    world_size        the number of processes that trained the run (1 alone); resuming on
                      another number is refused unless allowed (``train(...,
                      allow_world_size_change=True)``, ``--allow-world-size-change``)
    epoch, step       epochs completed, optimiser steps taken
    trainer           best metric, best step, patience counter, history, elapsed time, flags
    train_classes     the original class ids of the training set (label i <-> train_classes[i])
"""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dmlkit.config import ExperimentConfig, config_from_dict
from dmlkit.exceptions import CheckpointError
from dmlkit.models.placement import to_device
from dmlkit.models.trunks import load_failure_reason
from dmlkit.training.builders import build_model
from dmlkit.utils import atomic_torch_save, dotted_items, os_error_message

__all__ = [
    "CHECKPOINT_FORMAT",
    "INPUT_TRANSFORM_BY_NAME",
    "RESUMABLE_CHANGES",
    "best_record",
    "capture_rng_state",
    "check_resumable",
    "find_checkpoint",
    "load_checkpoint",
    "model_from_payload",
    "read_checkpoint",
    "restore_rng_state",
    "save_checkpoint",
    "save_trunk",
    "training_changes",
]

CHECKPOINT_FORMAT = "dmlkit-checkpoint-1"
#: A checkpoint key: its googlenet / inception_v3 trunk turned RGB input into its own range
#: (``transform_input``) whatever the weights' source. Checkpoints without it were written when
#: that happened only with downloaded pretrained weights (:func:`load_checkpoint` rebuilds them so).
INPUT_TRANSFORM_BY_NAME = "input_transform_by_name"
_TRANSFORMING_TRUNKS = ("googlenet", "inception_v3")

#: Keys that may differ between a checkpoint's config and the config used to resume it: they
#: change where data lives, how long the run goes on, or how it logs and evaluates, never the
#: trained weights of the steps already taken.
RESUMABLE_CHANGES = frozenset({
    "name",
    "data.root",
    "data.num_workers",
    "model.feature_cache_dir",
    "training.epochs",
    "training.patience",
    "training.device",
    "training.log_every",
    "training.tensorboard",
    "training.csv_log",
    "evaluation.batch_size",
    "evaluation.memory_mb",
    "evaluation.backend",
    "evaluation.cluster_restarts",
})


def training_changes(saved: dict[str, Any], config: ExperimentConfig, source: str = "the checkpoint") -> list[str]:
    """The settings in which ``config`` trains differently from ``saved`` (a run's config as
    plain data), as ``key (old -> new)``: every difference but :data:`RESUMABLE_CHANGES`."""
    # validate the saved config too, so keys renamed since it was written compare equal
    old = dotted_items(config_from_dict(saved, source=source).model_dump(mode="json"))
    new = dotted_items(config.model_dump(mode="json"))
    return [f"{k} ({old.get(k)!r} -> {new.get(k)!r})" for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k) and k not in RESUMABLE_CHANGES]


def check_resumable(saved: dict[str, Any], config: ExperimentConfig) -> None:
    """Refuse to resume a checkpoint whose config (``saved``, plain data) differs from ``config``
    in anything but :data:`RESUMABLE_CHANGES` (:class:`CheckpointError` names the keys)."""
    changed = training_changes(saved, config)
    if changed:
        raise CheckpointError(
            "cannot resume: the config differs from the checkpoint's in " + ", ".join(changed)
            + ". Resume with the run's own config.yaml, or start a new run directory"
        )


def capture_rng_state() -> dict[str, Any]:
    """The state of every random generator the trainer touches, in a weights_only-safe form."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": _python_state_to_lists(random.getstate()),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state`."""
    torch.set_rng_state(state["torch"])
    npy = state["numpy"]
    np.random.set_state(
        (npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"], npy["cached_gaussian"])
    )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _python_state_to_lists(state: tuple) -> list:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def content_digest(obj: Any) -> str:
    """SHA-256 over a checkpoint's content: every tensor's dtype, shape and bytes and every other
    value's ``repr``, dict keys in sorted order. Stored in the checkpoint (``"digest"``) and
    recomputed on load, so bit rot or a damaged copy is refused instead of loaded silently."""
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, dict):
            h.update(b"{")
            for k in sorted(x, key=repr):
                h.update(repr(k).encode())
                walk(x[k])
            h.update(b"}")
        elif isinstance(x, (list, tuple)):
            h.update(b"[")
            for v in x:
                walk(v)
            h.update(b"]")
        else:
            h.update(repr(x).encode())

    walk(obj)
    return h.hexdigest()


def sweep_orphan_temporaries(run_dir: str | os.PathLike) -> list[Path]:
    """Delete the temporary files an atomic write leaves when killed mid-write (``.NAME.*.tmp``
    beside the target) in a run directory and its ``checkpoints/``; returns what was removed."""
    removed = []
    for folder in (Path(run_dir), Path(run_dir) / "checkpoints", Path(run_dir) / "embeddings"):
        if folder.is_dir():
            for tmp in folder.glob(".*.tmp"):
                tmp.unlink(missing_ok=True)
                removed.append(tmp)
    return removed


def refuse_fresh_start(run_dir: str | os.PathLike, outputs: tuple[str, ...]) -> None:
    """Refuse a fresh start (no ``--resume``) into ``run_dir`` before anything there is written
    or removed (:class:`CheckpointError`): when it holds a run (``checkpoints/last.pt``: a new
    config.yaml beside the old checkpoint let ``--resume`` continue the old weights under the
    new config), or when it holds any of ``outputs`` (the files the caller will remove as left
    by an attempt killed before its first checkpoint) or ``config.yaml`` but no
    ``provenance.json``, which every attempt writes first: then they are the user's own files."""
    run_dir = Path(run_dir)
    last_path = run_dir / "checkpoints" / "last.pt"
    if last_path.exists():
        raise CheckpointError(
            f"{run_dir} already holds a run ({last_path}): pass --resume (resume=True) to continue "
            "it, or choose another run directory"
        )
    found = [name for name in (*outputs, "config.yaml") if (run_dir / name).exists()]
    if found and not (run_dir / "provenance.json").is_file():
        # without provenance.json they are the user's own files (a project folder's log.csv,
        # metrics.json or config.yaml, whose comments the resolved config replaced), removed unasked
        raise CheckpointError(
            f"{run_dir} holds {', '.join(found)} but no dmlkit run (no provenance.json): a new "
            "run would replace them; choose another run directory (--run-dir), or move them")


def save_checkpoint(payload: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write a checkpoint atomically (never a half-written file, even if killed), with the
    :func:`content_digest` that :func:`read_checkpoint` verifies."""
    payload = {"format": CHECKPOINT_FORMAT, **payload}
    payload["digest"] = content_digest(payload)
    try:
        return atomic_torch_save(payload, path)
    except OSError as exc:
        raise CheckpointError(os_error_message(exc, path, writing=True)) from exc


def find_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` itself if it is a file, else ``RUN_DIR/checkpoints/best.pt`` (or ``last.pt``)."""
    path = Path(path)
    if path.is_file():
        return path
    if path.is_dir():
        for candidate in (path / "checkpoints" / "best.pt", path / "checkpoints" / "last.pt",
                          path / "best.pt", path / "last.pt"):
            if candidate.is_file():
                return candidate
        raise CheckpointError(
            f"{path} holds no checkpoint (looked for checkpoints/best.pt and checkpoints/last.pt): "
            "pass a run directory written by `dmlkit train` or a .pt file"
        )
    raise CheckpointError(f"checkpoint not found: {path}")


def read_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint dict written by :func:`save_checkpoint` (``weights_only=True``)."""
    path = find_checkpoint(path)
    try:
        with open(path, "rb") as fh:
            magic = fh.read(2)
    except OSError as exc:
        raise CheckpointError(os_error_message(exc, path)) from None
    if magic[:2] != b"PK" and magic[:1] != b"\x80":  # neither torch's zip nor a pickle: a config,
        # a log, an embeddings .npy (torch's own words were "it holds Python objects")
        what = "empty" if not magic else "not a PyTorch checkpoint"
        raise CheckpointError(f"{path} is {what}: pass a run directory or a .pt file that dmlkit "
                              "train wrote (checkpoints/best.pt or last.pt)")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises many types for corrupt/foreign files
        raise CheckpointError(
            f"cannot read checkpoint {path}: {load_failure_reason(exc)}; resume from another "
            "one or retrain"
        ) from None
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a dmlkit checkpoint (format {CHECKPOINT_FORMAT!r} expected)")
    stored = payload.pop("digest", None)  # checkpoints written before digests load unchecked
    if stored is not None and stored != content_digest(payload):
        raise CheckpointError(f"{path} is corrupt: its content does not match the digest stored when it "
                              "was written (bit rot or a damaged copy); resume from another checkpoint "
                              "or retrain")
    trunk_file = payload.get("trunk_file")
    if trunk_file and "model" in payload:
        # frozen-trunk runs store the (fixed) trunk once, beside the checkpoints: a plain file
        # name there ("trunk.pt"); an absolute or ../ one had any file outside the run loaded,
        # and the error then told whether that file existed
        if (not isinstance(trunk_file, str) or Path(trunk_file).name != trunk_file
                or trunk_file in ("..", ".") or "\0" in trunk_file):
            raise CheckpointError(f"{path} names its frozen trunk's weights {trunk_file!r:.80}, "
                                  "which is not a file name beside it (dmlkit writes 'trunk.pt'): the "
                                  "checkpoint is damaged or was edited; retrain or use another checkpoint")
        trunk_path = path.parent / trunk_file
        if not trunk_path.is_file():
            raise CheckpointError(
                f"{path} keeps its frozen trunk's weights in {trunk_path}, which is missing: "
                "copy checkpoints/ as a whole"
            )
        try:
            trunk = torch.load(trunk_path, map_location=map_location, weights_only=True)
            trunk_state = trunk["trunk"]
        except Exception as exc:  # truncated or foreign trunk file
            raise CheckpointError(f"cannot read the frozen trunk {trunk_path}: "
                                  f"{load_failure_reason(exc)}; copy checkpoints/ as a whole or retrain") from None
        payload["model"] = {**{f"trunk.{k}": v for k, v in trunk_state.items()}, **payload["model"]}
    return payload


def best_record(path: str | os.PathLike) -> dict[str, Any] | None:
    """The record a checkpoint was written with: its ``step`` and ``epoch`` and its
    ``"trainer"`` entry (``best_map``, ``best_step``, ``best_epoch``, ``best_metrics``, ...);
    ``None`` when ``path`` is no file. An unreadable file reads as step -1 with no best
    (:meth:`~dmlkit.training.loop.Trainer.reconcile_best` writes it again when it can)."""
    if not Path(path).is_file():
        return None
    try:
        payload = read_checkpoint(path)
    except CheckpointError:
        return {"step": -1, "epoch": -1, "best_map": float("nan"), "best_step": -1,
                "best_epoch": -1, "best_metrics": {}}
    return {**payload["trainer"], "step": int(payload["step"]), "epoch": int(payload["epoch"])}


def save_trunk(trunk_state: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write a frozen trunk's weights once (``checkpoints/trunk.pt``), atomically."""
    try:
        return atomic_torch_save({"format": CHECKPOINT_FORMAT, "trunk": trunk_state}, path)
    except OSError as exc:
        raise CheckpointError(os_error_message(exc, path, writing=True)) from exc


def load_checkpoint(path: str | os.PathLike, device: str | torch.device = "cpu"):
    """``(model, config)`` from a checkpoint file or run directory, model in eval mode.

    The model is rebuilt from the stored config without downloading pretrained weights (the
    checkpoint holds every weight) and moved to ``device``.
    """
    return model_from_payload(read_checkpoint(path), path, device)


def model_from_payload(payload: dict[str, Any], path: str | os.PathLike,
                       device: str | torch.device = "cpu"):
    """:func:`load_checkpoint` of a payload already read (``path``: the file it came from)."""
    config = config_from_dict(payload["config"], source=str(path))
    model_config = config.model
    if (model_config.trunk.strip().removeprefix("torchvision:") in _TRANSFORMING_TRUNKS
            and not payload.get(INPUT_TRANSFORM_BY_NAME)
            and "transform_input" not in model_config.trunk_options):  # the rule it was trained with
        legacy = bool(model_config.pretrained and model_config.weights is None)
        model_config = model_config.model_copy(
            update={"trunk_options": {**model_config.trunk_options, "transform_input": legacy}})
    model = build_model(model_config, pretrained=False)
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as exc:
        raise CheckpointError(
            f"the weights in {path} do not fit the model its config describes: {exc}"
        ) from exc
    to_device(model, device).eval()
    return model, config
