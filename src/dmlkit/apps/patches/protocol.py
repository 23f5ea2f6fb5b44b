"""The cross-subset protocol of Brown et al. / Zagoruyko & Komodakis and the paper's Table 1.

Train each architecture once per training subset (on that subset's largest ``m50`` file),
test it on the pairs of every other subset it is paired with (``m50_100000_100000_0.txt``
when present, as for the Brown data; else the smallest ``m50`` file), report FPR95 (and ROC AUC) for each
train/test combination and the mean over the combinations, one column per architecture.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import ConfigDict, Field, field_validator

from dmlkit.apps.patches.brown import load_subset, match_files, numbered_sheets, subset_folder
from dmlkit.apps.patches.models import build_patch_model, prepare_patches
from dmlkit.apps.patches.training import (
    PatchTrainingSettings,
    TrainSettings,
    score_pairs,
    train_patch_model,
)
from dmlkit.config import StrictNumbers, apply_dict_overrides, read_yaml_mapping, validate_settings
from dmlkit.exceptions import CheckpointError, ConfigError, DataNotFoundError
from dmlkit.limits import MAX_THREADS
from dmlkit.metrics.roc import fpr95, roc_auc
from dmlkit.models import to_device
from dmlkit.models.trunks import load_failure_reason
from dmlkit.provenance import write_provenance
from dmlkit.utils import (
    atomic_torch_save,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    seed_everything,
)
from dmlkit.utils import data_root as default_root

__all__ = [
    "PatchExperimentConfig",
    "evaluate_patch_run",
    "hardest_pairs_figure",
    "load_patch_config",
    "load_patch_model",
    "results_table",
    "run_patch_protocol",
    "subsets_root",
]

#: The six train/test combinations of the paper, on the Brown subsets.
BROWN_COMBINATIONS = [
    ("yosemite", "notredame"), ("yosemite", "liberty"), ("notredame", "yosemite"),
    ("notredame", "liberty"), ("liberty", "yosemite"), ("liberty", "notredame"),
]


class _Strict(StrictNumbers):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class PatchDataConfig(_Strict):
    root: str | None = None  # folder holding one folder per subset; None: <data root>/patches_offline
    combinations: list[tuple[str, str]] = Field(default_factory=lambda: list(BROWN_COMBINATIONS))
    train_pairs: int | None = Field(None, ge=1)  # m50 file for training: None = the largest
    test_pairs: int | None = Field(None, ge=1)  # m50 file for testing: None = the 100k file, else the smallest
    max_test_pairs: int | None = Field(None, ge=1)

    @field_validator("combinations")
    @classmethod
    def _distinct(cls, v: list[tuple[str, str]]) -> list[tuple[str, str]]:
        if not v:
            raise ValueError("give at least one [train, test] combination")
        for a, b in v:
            if a == b:
                raise ValueError(f"train and test subsets must differ, got {a}/{b}")
        return v


class PatchModelConfig(_Strict):
    architectures: list[str] = Field(default_factory=lambda: ["2ch-2stream", "2ch-deep", "2ch", "siam", "siam-l2"])
    patch_size: int = 32
    width: float = 0.25

    @field_validator("architectures")
    @classmethod
    def _some_distinct(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("give at least one architecture")
        if len(set(v)) != len(v):
            raise ValueError(f"each architecture once, got {v}")
        return v


class PatchTrainingConfig(PatchTrainingSettings):
    """``training``: :class:`PatchTrainingSettings` plus where it runs; every value checked when
    the config is read, before a run directory is written."""

    threads: int | None = Field(None, ge=1, le=MAX_THREADS)  # a huge count overflowed torch.set_num_threads
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: cuda when available


class PatchExperimentConfig(_Strict):
    """``configs/patches*.yaml``: data, model and training sections plus a seed."""

    seed: int = Field(0, ge=0, lt=2**32)  # numpy refuses other seeds
    data: PatchDataConfig = Field(default_factory=PatchDataConfig)
    model: PatchModelConfig = Field(default_factory=PatchModelConfig)
    training: PatchTrainingConfig = Field(default_factory=PatchTrainingConfig)


def load_patch_config(path: str | Path, overrides: list[str] | None = None) -> PatchExperimentConfig:
    """Read a YAML config; ``overrides`` like ``training.epochs=1`` (YAML values)."""
    raw = read_yaml_mapping(path, "patch experiment settings", "configs/patches_offline.yaml")
    return validate_settings(PatchExperimentConfig, apply_dict_overrides(raw, overrides),
                             "patch config", str(path))


def subsets_root(cfg: PatchExperimentConfig, data_root: str | Path | None) -> Path:
    """The folder holding one folder per subset: ``data.root`` (relative to the data root) or
    ``<data root>/patches_offline``. An absolute ``data.root`` with a ``data_root`` too is a
    :class:`ConfigError` (``--data-root`` was silently ignored: a rescore "on another root" read
    the run's own data)."""
    if cfg.data.root is not None:
        p = Path(cfg.data.root).expanduser()
        if p.is_absolute() and data_root is not None:
            raise ConfigError(
                f"data.root is the absolute folder {p}, so --data-root {data_root} does not apply (it locates "
                "a relative data.root or <data root>/patches_offline): drop one of them (for a run, edit "
                "data.root in its config.yaml)")
        return p if p.is_absolute() else default_root(data_root) / p
    return default_root(data_root) / "patches_offline"


def load_patch_model(path: str | Path):
    """A model saved by :func:`run_patch_protocol` (``torch.load(weights_only=True)``)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} not found: train it with `dmlkit patches train`")
    ck = _read_checkpoint(path)
    try:
        model = build_patch_model(ck["arch"], int(ck["patch_size"]), float(ck["width"]))
        model.load_state_dict(ck["state_dict"])
    except (KeyError, RuntimeError, TypeError, ValueError, ConfigError) as exc:
        raise CheckpointError(f"{path} is not a patch-network checkpoint: {exc}") from None
    model.eval()
    return model


def _read_checkpoint(path: Path) -> dict[str, Any]:
    """The dict of a checkpoint file, or a one-line :class:`CheckpointError` (torch raises many
    types for a corrupt or foreign file)."""
    import torch

    try:
        ck = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {load_failure_reason(exc)}") from None
    if not isinstance(ck, dict):
        raise CheckpointError(f"{path} is not a patch-network checkpoint (no dict inside): retrain it with --fresh")
    return ck


class _Subsets:
    """Subsets loaded once and their network inputs, cached by name."""

    def __init__(self, root: Path, patch_size: int) -> None:
        self.root, self.patch_size, self._cache = root, patch_size, {}

    def get(self, name: str):
        if name not in self._cache:
            sub = load_subset(self.root, name)
            self._cache[name] = (sub, prepare_patches(sub.patches, self.patch_size))
        return self._cache[name]


def _device(name: str):
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") or (name == "cuda" and not torch.cuda.is_available()):
        raise ConfigError(f"training.device must be auto, cpu or cuda (with a GPU), got {name!r}")
    return torch.device(name)


#: The key of a checkpoint's ``settings`` that identifies its training data (:func:`_training_data_id`).
_DATA_KEY = "train_data_sha256"


def _training_data_id(root: Path, cfg: PatchExperimentConfig, train_name: str,
                      cache: dict[str, str] | None = None) -> str:
    """SHA-256 of the files a model trained on ``train_name`` learnt from: the subset's
    ``info.txt``, the ``m50`` file training reads (``data.train_pairs``, else the largest) and its
    patch sheets (``patches<4 digits>.bmp``, the Brown layout's names), each with its name and
    length (:func:`_subset_files_id`).

    A content hash, not a path: the same subset moved or copied to another data root keeps it,
    while another subset under the same name (a relative ``data.root`` under another
    ``--data-root``) does not; a resumed run compares it with the checkpoint's, as it does the
    settings. Reads every sheet once (about 1 s per GB); ``cache`` keeps it per subset for a run.
    """
    if cache is not None and train_name in cache:
        return cache[train_name]
    folder = root / train_name
    found = match_files(folder)
    m50 = found[cfg.data.train_pairs if cfg.data.train_pairs is not None else max(found)]
    value = _subset_files_id(folder, m50, f"training subset {train_name}")
    if cache is not None:
        cache[train_name] = value
    return value


def _subset_files_id(folder: Path, m50: Path, what: str) -> str:
    """SHA-256 of a subset folder's ``info.txt``, the ``m50`` file read and its patch sheets
    (``patches<4 digits>.bmp``), each with its name and length; ``what`` names the subset in the
    error of an unreadable file."""
    import hashlib

    sheets = [path for _, path in sorted(numbered_sheets(folder).items())]
    digest = hashlib.sha256()
    for path in [folder / "info.txt", m50, *sheets]:
        try:
            with path.open("rb") as f:
                digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
        except OSError as exc:
            raise DataNotFoundError(f"cannot read {path} of {what}: {exc.strerror or exc}") from None
    return digest.hexdigest()


#: The key of a scores file (``scores/<arch>/<train>__<test>.npz``) that identifies the test
#: subset its pair indices point into (:func:`scored_subset_id`).
_TEST_DATA_KEY = "test_data_sha256"


def scored_subset_id(sub: Any, pairs: Any) -> str:
    """SHA-256 of the test subset ``sub`` (a loaded :class:`~dmlkit.apps.patches.PatchSubset`)
    as scored on ``pairs`` (read from its ``m50`` file ``pairs.source``): its ``info.txt``, that
    file and its patch sheets, as :func:`_training_data_id` hashes a training subset. A run
    stores it in each scores file, whose pair indices mean patches of this subset only: the
    figure of ``patches evaluate`` compares it with the subset it loads."""
    return _subset_files_id(sub.folder, sub.folder / pairs.source, f"test subset {sub.name}")


def _training_signature(cfg: PatchExperimentConfig, arch: str, data_id: str | None = None) -> dict[str, Any]:
    """What a checkpoint's weights depend on (stored in it; a resumed run must ask for the same):
    the model, seed and training settings, and ``data_id``, the identity of the training data
    (:func:`_training_data_id`)."""
    signature = {"arch": arch, "patch_size": cfg.model.patch_size, "width": cfg.model.width, "seed": cfg.seed,
                 "train_pairs": cfg.data.train_pairs,
                 **cfg.training.model_dump(mode="json", include=set(PatchTrainingSettings.model_fields))}
    if data_id is not None:
        signature[_DATA_KEY] = data_id
    return signature


def _check_resumable(out: Path, cfg: PatchExperimentConfig, trains: list[str], root: Path,
                     data_ids: dict[str, str] | None = None) -> None:
    """Refuse to resume from a checkpoint trained with other settings than ``cfg`` (it would be
    scored silently under the new config), or on other data than the subset now under ``root``
    (a relative ``data.root`` under another ``--data-root``: models of the first root were scored
    and the provenance rewritten to the second), before anything is written.

    A checkpoint of an older dmlkit records no data identity: it is reused with a warning (its
    settings still checked), since refusing would discard every model of an existing run; pass
    ``--fresh`` to retrain it if its data may differ. ``data_ids`` caches the subsets' hashes."""
    import warnings

    unrecorded: list[Path] = []
    for arch in cfg.model.architectures:
        for train_name in trains:
            ck_path = out / "models" / arch / f"{train_name}.pt"
            if not ck_path.is_file():
                continue
            have = _checked_settings(ck_path, cfg, arch, "pass --fresh to retrain, or write the run to another -o folder")
            trained_on = have.get(_DATA_KEY)
            if trained_on is None:
                unrecorded.append(ck_path)
                continue
            data_id = _training_data_id(root, cfg, train_name, data_ids)
            if trained_on != data_id:
                raise ConfigError(
                    f"{ck_path} was trained on other data than the subset '{train_name}' at {root / train_name} "
                    f"(training files SHA-256 {trained_on[:12]}... there, {data_id[:12]}... here): pass "
                    "--fresh to retrain on this data, write the run to another -o folder, or point "
                    "--data-root / data.root at the data it was trained on"
                )
    if unrecorded:  # one line for the run, not one per checkpoint
        what = (f"{unrecorded[0]} does not record which data it was" if len(unrecorded) == 1 else
                f"{len(unrecorded)} checkpoints ({unrecorded[0]}, ...) do not record which data they were")
        warnings.warn(f"{what} trained on (written by an older dmlkit): reused as trained on the subsets "
                      f"under {root}; pass --fresh to retrain if the data differ", UserWarning, stacklevel=2)


def _checked_settings(ck_path: Path, cfg: PatchExperimentConfig, arch: str, fix: str) -> dict[str, Any]:
    """The settings the checkpoint ``ck_path`` of ``arch`` records (:func:`_training_signature`;
    an older one: its model only), or a :class:`ConfigError` naming the first that ``cfg`` asks
    otherwise and ``fix``: its weights would be scored under a config they were not trained with."""
    want = _training_signature(cfg, arch)
    ck = _read_checkpoint(ck_path)
    have = ck.get("settings") or {k: ck.get(k) for k in ("arch", "patch_size", "width")}
    for key, value in have.items():
        if key in want and want[key] != value:
            raise ConfigError(f"{ck_path} was trained with {key}={value!r} but the config asks for {want[key]!r}: {fix}")
    return have


def _check_train_test_differ(root: Path, cfg: PatchExperimentConfig) -> None:
    """The train and test subsets of every combination are two folders under ``root``. The
    config compares the names as written, so ``photos`` against ``photos/`` (``./photos``, an
    absolute path, a symlink) trained and tested on the same subset: a leak."""
    for a, b in cfg.data.combinations:
        folder = (root / a).resolve()
        if folder == (root / b).resolve():
            raise ConfigError(f"data.combinations: train and test subsets must differ, but {a!r} and {b!r} "
                              f"are the same folder {folder}: test on another subset")


def _check_match_file(folder: Path, num_pairs: int | None, key: str) -> None:
    """The ``m50`` file a run will read exists (found before any model trains, not after)."""
    found = match_files(folder)
    if not found:
        raise DataNotFoundError(f"{folder}: no m50_<n>_<n>_0.txt match file")
    if num_pairs is not None and num_pairs not in found:
        raise DataNotFoundError(f"{folder}: no match file with {key}={num_pairs} pairs; found {sorted(found)}")


def _check_batch_fits(cfg: PatchExperimentConfig, train_name: str, file_pairs: int) -> None:
    """The training pairs (the ``m50`` file's, at most ``training.max_train_pairs``) fill one
    batch: checked before the run directory is written, not after the data are loaded."""
    n = min(file_pairs, cfg.training.max_train_pairs or file_pairs)
    if n < cfg.training.batch_size:
        raise ConfigError(
            f"training on {train_name} would use {n} pairs (its m50 file has {file_pairs}; "
            f"training.max_train_pairs = {cfg.training.max_train_pairs}), fewer than one batch of "
            f"training.batch_size = {cfg.training.batch_size}: lower the batch size or raise max_train_pairs "
            "(--set training.batch_size=...)")


def _test_pairs(sub, cfg: PatchExperimentConfig, seed: int):
    pairs = sub.pairs(cfg.data.test_pairs, largest=False)
    m = cfg.data.max_test_pairs
    if m is not None and len(pairs) > m:
        pairs = pairs.subset(np.sort(np.random.default_rng(seed).choice(len(pairs), m, replace=False)))
    return pairs


#: The table of a run, written when every model is scored (removed when a run starts: one killed
#: part-way left the previous run's table beside the new config.yaml and checkpoints).
_RESULTS_JSON, _RESULTS_MD = "results.json", "results.md"


def run_patch_protocol(
    cfg: PatchExperimentConfig,
    out_dir: str | Path,
    *,
    data_root: str | Path | None = None,
    resume: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train every architecture on every training subset, test on the paired subsets.

    Writes ``OUT/config.yaml``, ``OUT/provenance.json``, ``OUT/models/<arch>/<train>.pt``,
    ``OUT/scores/<arch>/<train>__<test>.npz`` (pair indices, labels, scores) and
    ``OUT/results.json`` / ``results.md`` (the table). With ``resume`` a model whose
    checkpoint exists is loaded instead of retrained. The table of an earlier run in ``OUT`` is
    removed before ``config.yaml`` is written and the new one written when every model is scored,
    so a killed run leaves no table rather than the previous run's.
    """
    import torch
    import yaml

    say = log or (lambda _m: None)
    root = subsets_root(cfg, data_root)
    for name in dict.fromkeys(n for pair in cfg.data.combinations for n in pair):
        subset_folder(root, name)  # every subset, training and test, before anything is written
    _check_train_test_differ(root, cfg)
    for train_name, test_name in cfg.data.combinations:
        _check_match_file(root / train_name, cfg.data.train_pairs, "data.train_pairs")
        _check_match_file(root / test_name, cfg.data.test_pairs, "data.test_pairs")
        _check_batch_fits(cfg, train_name, cfg.data.train_pairs or max(match_files(root / train_name)))
    for a in cfg.model.architectures:
        build_patch_model(a, cfg.model.patch_size, cfg.model.width)  # fail fast on bad names
    device = _device(cfg.training.device)  # cuda without a GPU: refused before the run is written
    out = Path(out_dir)
    trains = list(dict.fromkeys(a for a, _ in cfg.data.combinations))
    data_ids: dict[str, str] = {}  # training subsets' content hashes, computed once each
    test_ids: dict[str, str] = {}  # test subsets' content hashes (stored in the scores files)
    if resume:
        _check_resumable(out, cfg, trains, root, data_ids)
    out.mkdir(parents=True, exist_ok=True)
    for stale in (_RESULTS_JSON, _RESULTS_MD):  # before config.yaml: never a new config beside an old table
        (out / stale).unlink(missing_ok=True)
    atomic_write_text(out / "config.yaml", yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    write_provenance(out / "provenance.json", cfg.seed)
    if cfg.training.threads:
        torch.set_num_threads(cfg.training.threads)
    subsets = _Subsets(root, cfg.model.patch_size)
    rows: dict[tuple[str, str], dict[str, dict[str, float]]] = {tuple(c): {} for c in cfg.data.combinations}
    timing: dict[str, dict[str, float]] = {a: {} for a in cfg.model.architectures}
    for train_name in trains:
        sub, inputs = subsets.get(train_name)
        train_pairs = sub.pairs(cfg.data.train_pairs, largest=True)
        for arch in cfg.model.architectures:
            ck = out / "models" / arch / f"{train_name}.pt"
            if resume and ck.is_file():
                model = to_device(load_patch_model(ck), device)
                secs = torch.load(ck, map_location="cpu", weights_only=True).get("train_seconds")
                if secs is not None:
                    timing[arch][train_name] = float(secs)
                say(f"{arch} trained on {train_name}: loaded {ck}")
            else:
                seed_everything(cfg.seed)
                model = to_device(build_patch_model(arch, cfg.model.patch_size, cfg.model.width), device)
                settings = TrainSettings(**cfg.training.model_dump(include=set(PatchTrainingSettings.model_fields)),
                                         seed=cfg.seed)
                t0 = time.perf_counter()
                history = train_patch_model(model, inputs, train_pairs, sub.point_ids, settings)
                secs = time.perf_counter() - t0
                timing[arch][train_name] = secs
                atomic_torch_save(
                    {"arch": arch, "patch_size": cfg.model.patch_size, "width": cfg.model.width,
                     "state_dict": {k: v.cpu() for k, v in model.state_dict().items()}, "train": train_name, "history": history,
                     "train_seconds": secs,
                     "settings": _training_signature(cfg, arch, _training_data_id(root, cfg, train_name, data_ids))},
                    ck,
                )
                say(f"{arch} trained on {train_name} in {secs:.0f} s (final loss {history[-1]['loss']:.3f})")
            for train2, test_name in cfg.data.combinations:
                if train2 != train_name:
                    continue
                tsub, tinputs = subsets.get(test_name)
                pairs = _test_pairs(tsub, cfg, cfg.seed)
                scores = score_pairs(model, tinputs, pairs)
                res = {"fpr95": fpr95(scores, pairs.label), "roc_auc": roc_auc(scores, pairs.label)}
                rows[(train_name, test_name)][arch] = res
                path = out / "scores" / arch / f"{train_name}__{test_name}.npz"
                if test_name not in test_ids:
                    test_ids[test_name] = scored_subset_id(tsub, pairs)
                _write_scores(path, pairs, scores, test_ids[test_name])
                say(f"  {arch} {train_name} -> {test_name}: FPR95 {100 * res['fpr95']:.2f} %, AUC {res['roc_auc']:.4f}")
    results = _assemble(cfg, rows, timing)
    atomic_write_json(out / _RESULTS_JSON, results)
    atomic_write_text(out / _RESULTS_MD, results_table(results, markdown=True))
    return results


def _write_scores(path: Path, pairs: Any, scores: np.ndarray, data_id: str) -> None:
    """``path``: the pair indices, labels and scores (``.npz``) and ``data_id``, the SHA-256 of the
    test subset the indices point into (:func:`scored_subset_id`, key ``test_data_sha256``), written
    atomically: a run killed while writing leaves the previous file or none, never a truncated one
    that ``patches evaluate --figure`` reads."""
    import io

    buffer = io.BytesIO()
    np.savez(buffer, left=pairs.left, right=pairs.right, label=pairs.label, scores=scores,
             **{_TEST_DATA_KEY: np.array(data_id)})
    atomic_write_bytes(path, buffer.getvalue())


def _assemble(cfg: PatchExperimentConfig, rows, timing) -> dict[str, Any]:
    archs = cfg.model.architectures
    table = [{"train": a, "test": b, **{k: v for k, v in r.items()}} for (a, b), r in rows.items()]
    mean = {
        arch: {m: float(np.mean([r[arch][m] for r in rows.values()])) for m in ("fpr95", "roc_auc")}
        for arch in archs
    }
    return {"architectures": archs, "rows": table, "mean": mean, "train_seconds": timing,
            "config": cfg.model_dump(mode="json")}


def results_table(results: dict[str, Any], *, markdown: bool = False, metric: str = "fpr95") -> str:
    """The paper's Table 1: one row per train/test pair plus the mean, FPR95 in percent."""
    archs = results["architectures"]
    head = ["Train", "Test", *archs]
    lines = []
    for r in results["rows"]:
        lines.append([r["train"], r["test"], *[f"{100 * r[a][metric]:.2f}" for a in archs]])
    lines.append(["mean", "", *[f"{100 * results['mean'][a][metric]:.2f}" for a in archs]])
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(x) + " |" for x in lines]
        return "\n".join(out) + "\n"
    widths = [max(len(str(x[i])) for x in [head, *lines]) for i in range(len(head))]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(x, widths)) for x in [head, *lines]) + "\n"


def evaluate_patch_run(
    run_dir: str | Path,
    *,
    data_root: str | Path | None = None,
    max_test_pairs: int | None = None,
    scores_out: dict[tuple[str, str, str], tuple[Any, np.ndarray]] | None = None,
) -> dict[str, Any]:
    """Re-score a run's checkpoints on its test combinations (e.g. on another data root).

    ``scores_out``: a dict that receives ``(arch, train, test) -> (pairs, scores)`` of every
    combination scored, e.g. for :func:`hardest_pairs_figure` on these pairs (the run's own
    ``scores/`` files index the patches of the root it was trained on)."""
    run = Path(run_dir)
    if not (run / "config.yaml").is_file():
        raise CheckpointError(f"{run} is not a patch run directory (no config.yaml): run `dmlkit patches train` first")
    cfg = load_patch_config(run / "config.yaml")
    if max_test_pairs is not None:  # checked by the config's own rule (data.max_test_pairs >= 1)
        cfg = load_patch_config(run / "config.yaml", [f"data.max_test_pairs={max_test_pairs!r}"])
    root = subsets_root(cfg, data_root)
    _check_train_test_differ(root, cfg)  # a run of an older dmlkit, which compared the names only
    subsets = _Subsets(root, cfg.model.patch_size)
    rows: dict[tuple[str, str], dict[str, dict[str, float]]] = {tuple(c): {} for c in cfg.data.combinations}
    for arch in cfg.model.architectures:
        for train_name, test_name in cfg.data.combinations:
            ck_path = run / "models" / arch / f"{train_name}.pt"
            if ck_path.is_file():  # a re-run with other settings killed part-way left the old models
                _checked_settings(ck_path, cfg, arch, "a re-run that did not finish? finish it with "
                                  "`dmlkit patches train --fresh`")
            model = load_patch_model(ck_path).to(_device(cfg.training.device))
            tsub, tinputs = subsets.get(test_name)
            pairs = _test_pairs(tsub, cfg, cfg.seed)
            s = score_pairs(model, tinputs, pairs)
            rows[(train_name, test_name)][arch] = {"fpr95": fpr95(s, pairs.label), "roc_auc": roc_auc(s, pairs.label)}
            if scores_out is not None:
                scores_out[(arch, train_name, test_name)] = (pairs, s)
    return _assemble(cfg, rows, {})


def hardest_pairs_figure(patches: np.ndarray, left, right, label, scores, k: int = 8, title: str = ""):
    """The ``k`` highest-scoring non-matches (false positives) and ``k`` lowest-scoring matches
    (false negatives), each pair drawn as two patches side by side with its score."""
    from dmlkit.report.style import figure_style  # lazy: matplotlib loads only to draw

    with figure_style():  # dmlkit's settings: the title's names drawn literally, never as mathtext
        return _hardest_pairs_figure(patches, left, right, label, scores, k, title)


def _hardest_pairs_figure(patches: np.ndarray, left, right, label, scores, k: int, title: str):
    from matplotlib.figure import Figure

    label = np.asarray(label).astype(bool)
    neg, pos = np.flatnonzero(~label), np.flatnonzero(label)
    fp = neg[np.argsort(-scores[neg], kind="stable")[:k]]
    fn = pos[np.argsort(scores[pos], kind="stable")[:k]]
    fig = Figure(figsize=(1.6 * k, 4.0))
    axes = fig.subplots(2, k, squeeze=False)
    for row, (idx, name) in enumerate(((fp, "hardest false positives"), (fn, "hardest false negatives"))):
        for c in range(k):
            ax = axes[row][c]
            ax.axis("off")
            if c < len(idx):
                i = idx[c]
                gap = np.full((patches.shape[1], 3), 255, np.uint8)
                pair = np.concatenate([patches[left[i]], gap, patches[right[i]]], axis=1)
                ax.imshow(pair, cmap="gray", vmin=0, vmax=255)
                ax.set_title(f"{scores[i]:.2f}", fontsize=8)
        axes[row][0].text(-0.1, 0.5, name, transform=axes[row][0].transAxes, rotation=90, va="center", ha="right", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig
