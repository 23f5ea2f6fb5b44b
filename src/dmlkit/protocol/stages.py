"""The two stages of the Reality Check protocol (Musgrave et al., ECCV 2020) that train models:
the cross-validated search of one method on the development classes (:class:`SearchStage`)
and the final runs per fold and seed on the test classes (:class:`FinalStage`), with their
helpers (run seeds, the full dataset, run claims, separated/concatenated evaluation of the
final runs). :class:`dmlkit.protocol.runner.Bench` orchestrates them.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.markup import escape

from dmlkit.config import dump_config, load_yaml
from dmlkit.data import ClassSplit, get_transforms
from dmlkit.embeddings import dataset_items, embed_split, load_embeddings, save_embeddings
from dmlkit.exceptions import DataError, DmlkitError, NonFiniteError
from dmlkit.metrics import evaluate
from dmlkit.metrics.scoring import scored_elsewhere, scoring_stamp, this_scorer
from dmlkit.protocol.config import DATA_ROOT_FIX, BenchConfig, MethodConfig
from dmlkit.protocol.results import embeddings_digest
from dmlkit.protocol.space import suggest
from dmlkit.protocol.splits import BenchSplit, TestClassGuard
from dmlkit.training import build_model, train
from dmlkit.training.checkpoint import training_changes
from dmlkit.training.data_root import load_dataset_at, run_data_root
from dmlkit.utils import (
    atomic_write_json,
    atomic_write_text,
    open_appending,
    process_alive,
    read_json,
    seed_everything,
)
from dmlkit.validation import concatenate_normalized

logger = logging.getLogger(__name__)
__all__ = ["DIVERGED_HINT", "FAILED_RUN", "PRETRAINED", "FinalRun", "FinalStage", "SearchStage", "evaluate_runs",
           "load_full_dataset", "method_fingerprint", "release_claims", "run_seed"]


PRETRAINED = "pretrained"
#: A final run that diverged (its loss or embeddings became NaN or infinite) records why in this
#: file of its run directory; later final stages keep the failure instead of training it again.
FAILED_RUN = "failed.json"
#: What a user can do about a diverged final run (said after the table).
DIVERGED_HINT = (
    "A diverged final run is recorded in its failed.json and kept (the same seed and settings "
    "diverge again). To retry with a lower learning rate or gradient clipping (fixed settings, so "
    "in a new bench directory): --out NEW --set fixed.optimizer.trunk_lr=1e-4 --set "
    "fixed.optimizer.embedder_lr=1e-4 --set fixed.training.grad_clip=1.0; or delete the failed "
    "runs' directories to train them again")


def run_seed(config: BenchConfig, seed: int, fold: int | None = None) -> int:
    """The training seed of fold ``fold`` in repeat ``seed`` of the final runs (and of the
    pretrained row, which uses the same seeds): ``fixed.seed + folds * (seed + 1) + fold``
    (:meth:`BenchConfig.final_seed`). The search trains fold ``f`` with ``fixed.seed + f``
    (:meth:`BenchConfig.search_seed`), the first block of ``folds`` seeds, so the final runs
    never repeat a search run's seed.

    Fold models of one repeat start from different initialisations (as the seed's four
    independent models do). Before 29 Nov 2026 this was ``run_seed(seed, fold) = 1000 seed +
    fold``, whose seed 0 repeated the search's seeds; a call of that form is refused.
    """
    if fold is None or not hasattr(config, "final_seed"):  # the old two-number call
        raise TypeError(f"run_seed(config, seed, fold) takes the bench config, a seed and a fold (got a "
                        f"{type(config).__name__} and {2 if fold is None else 3} arguments): final seeds are "
                        "fixed.seed + folds * (seed + 1) + fold, no longer 1000 * seed + fold")
    return config.final_seed(seed, fold)


def _say(console: Any, message: str) -> None:
    if console is not None:
        console.print(message)


def _with_transform(dataset, config: BenchConfig, train: bool):
    """Apply the fixed data transform (train-time augmentation only for training sets)."""
    d = config.fixed.data
    if d.transform is None:
        return dataset
    augment = train and not config.fixed.model.frozen_trunk
    return dataset.with_transform(get_transforms(d.transform, train=augment, image_size=d.image_size))


def load_full_dataset(config: BenchConfig, data_root: str | Path | None = None):
    """Every class of the configured dataset (``dmlkit.data.load_dataset``); the data root is
    ``data_root`` (``--data-root``), else ``fixed.data.root``, else ``$DMLKIT_DATA``."""
    return load_dataset_at(config.fixed.data, data_root, fix=DATA_ROOT_FIX, key="fixed.data")


# -- search ---------------------------------------------------------------------------------------
class SearchStage:
    """Cross-validated Bayesian search of one method, on the development classes only.

    ``dev_dataset`` must hold only development classes (the guard checks it): the search has no
    reference to the test classes at all.
    """

    def __init__(
        self, config: BenchConfig, split: BenchSplit, dev_dataset, bench_dir: Path, *,
        guard: TestClassGuard, train_fn: Callable[..., Any] | None = None, console: Any = None,
    ) -> None:
        self.config = config
        self.split = split
        self.guard = guard
        self.dev = guard.check(dev_dataset, "the search's dataset")
        self.bench_dir = Path(bench_dir)
        self.console = console
        self.train_fn = train if train_fn is None else train_fn
        self._fold_sets: dict[int, tuple[Any, Any]] = {}

    def fold_sets(self, fold: int) -> tuple[Any, Any]:
        if fold not in self._fold_sets:
            f = self.split.folds[fold]
            train_set = _with_transform(self.dev.subset_classes(list(f.train)), self.config, train=True)
            val_set = _with_transform(self.dev.subset_classes(list(f.val)), self.config, train=False)
            self.guard.check(train_set, f"fold {fold}'s training set")
            self.guard.check(val_set, f"fold {fold}'s validation set")
            self._fold_sets[fold] = (train_set, val_set)
        return self._fold_sets[fold]

    def objective(self, method: MethodConfig) -> Callable[[Any], float]:
        protocol = self.config.protocol

        def objective(trial) -> float:
            params = suggest(trial, method.search)
            trial.set_user_attr("params", params)
            trial.set_user_attr(SCORING_ATTR, scoring_stamp())  # a resume by another dmlkit warns
            values = []
            for fold in self.split.folds:
                train_set, val_set = self.fold_sets(fold.index)
                cfg = self.config.experiment(
                    method, params, seed=self.config.search_seed(fold.index),
                    name=f"{self.config.name}-{method.name}-trial{trial.number}-fold{fold.index}",
                )
                run_dir = self.bench_dir / "search" / method.name / f"trial{trial.number}" / f"fold{fold.index}"
                if run_dir.exists():  # a previous, interrupted attempt of this very trial number
                    shutil.rmtree(run_dir)
                result = self.train_fn(cfg, run_dir, train_set=train_set, val_set=val_set, progress=False)
                value = float(result.val_metrics["map_at_r"])
                values.append(value)
                trial.set_user_attr(f"fold{fold.index}_val", dict(result.val_metrics))
                trial.report(float(np.mean(values)), step=fold.index)
                if not protocol.keep_search_checkpoints:
                    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
            mean = float(np.mean(values))
            trial.set_user_attr("fold_map_at_r", values)
            return mean

        return objective


def method_fingerprint(config: BenchConfig, method: MethodConfig, split: BenchSplit, *,
                       legacy: bool = False) -> dict[str, Any]:
    """What a study depends on: resuming with a different one is refused. The sampler settings
    are in it where they are not the defaults (:meth:`ProtocolConfig.search_fingerprint`);
    ``legacy`` leaves them out, as a dmlkit before them computed it (stored without
    :data:`~dmlkit.protocol.study.FINGERPRINT_VERSION`; :func:`open_study` accepts it only where
    the sampler settings are shown to be the same)."""
    key = {"fixed": config.fixed_fingerprint(), "method": method.model_dump(mode="json"),
           "split": split.to_dict()}
    search = None if legacy else config.protocol.search_fingerprint()
    if search is not None:
        key["search"] = search
    blob = json.dumps(key, sort_keys=True)
    return {"sha256": hashlib.sha256(blob.encode()).hexdigest()}


#: The trial user attribute naming the dmlkit that scored its value (:func:`warn_mixed_scoring`).
SCORING_ATTR = "dmlkit_scoring"


def warn_mixed_scoring(study, name: str, trials: int) -> None:
    """Warn where study ``name`` has trials left to run (of ``trials``) and completed ones whose
    value another dmlkit scored (:func:`dmlkit.metrics.scoring.scored_elsewhere`): the new
    trials' values may differ in the last digits, which decides a near tie for the best
    parameters. Not refused: the trials are valid, and the user chooses."""
    from optuna.trial import TrialState

    done = [t for t in study.get_trials(deepcopy=False) if t.state.is_finished()]
    others = {scored_elsewhere(t.user_attrs.get(SCORING_ATTR)) for t in done if t.state == TrialState.COMPLETE}
    others.discard(None)
    if len(done) >= trials or not others:
        return
    warnings.warn(
        f"study {name!r}: earlier trials were scored by {' and by '.join(sorted(others))}, new ones "
        f"by this dmlkit ({this_scorer()}); their validation MAP@R may differ in the last digits, "
        "which can decide the best parameters on a near tie. A new bench directory avoids mixing "
        f"them (or `--stage final --set protocol.trials={len(done)}`, which keeps the earlier trials "
        "and searches no more)", stacklevel=3)


# -- final runs -----------------------------------------------------------------------------------
@dataclass
class FinalRun:
    """One fold model of one seed; ``error`` is set for a run that diverged (no embeddings)."""

    method: str
    seed: int
    fold: int
    run_dir: Path
    embeddings: Path
    checkpoint: Path | None
    error: str | None = None


class FinalStage:
    """Train the fold models with the best hyperparameters and embed the test classes."""

    def __init__(
        self, config: BenchConfig, split: BenchSplit, full_dataset, bench_dir: Path, *,
        train_fn: Callable[..., Any] | None = None, console: Any = None,
    ) -> None:
        self.config = config
        self.split = split
        self.bench_dir = Path(bench_dir)
        self.console = console
        dev = full_dataset.subset_classes(list(split.dev))
        self.test = _with_transform(full_dataset.subset_classes(list(split.test)), config, train=False)
        self.dev = dev
        self.train_fn = train if train_fn is None else train_fn

    def _fold_sets(self, fold: int):
        f = self.split.folds[fold]
        return (_with_transform(self.dev.subset_classes(list(f.train)), self.config, train=True),
                _with_transform(self.dev.subset_classes(list(f.val)), self.config, train=False))

    def _plan(self, method: MethodConfig, params: dict[str, Any]):
        """``(seed, fold, run_dir, config, stale changes)`` of every final run of ``method``."""
        for seed in self.config.protocol.seeds or [0]:
            for fold in self.split.folds:
                run_dir = self.bench_dir / "final" / method.name / f"seed{seed}" / f"fold{fold.index}"
                cfg = self.config.experiment(
                    method, params, seed=run_seed(self.config, seed, fold.index),
                    name=f"{self.config.name}-{method.name}-seed{seed}-fold{fold.index}",
                )
                yield seed, fold, run_dir, cfg, _stale_changes(run_dir, cfg)

    def _run(self, method: MethodConfig, seed: int, fold: int, run_dir: Path) -> FinalRun:
        return FinalRun(method.name, seed, fold, run_dir, run_dir / "embeddings" / "test.npz",
                        run_dir / "checkpoints" / "best.pt", _recorded_failure(run_dir))

    def current_runs(self, method: MethodConfig, params: dict[str, Any]) -> list[FinalRun] | str:
        """The final runs of ``method`` as they are on disk, when every one is finished (or
        recorded as diverged) with ``params`` and the current settings; else why not (a final
        stage for other methods keeps this method's row only then)."""
        runs = []
        for seed, fold, run_dir, _, stale in self._plan(method, params):
            if stale:
                return f"seed {seed} fold {fold.index} was trained with other settings ({'; '.join(stale)})"
            run = self._run(method, seed, fold.index, run_dir)
            if run.error is None and not (run.embeddings.exists() and (run_dir / "metrics.json").exists()):
                return f"seed {seed} fold {fold.index} has no finished final run"
            runs.append(run)
        return runs

    def run_method(self, method: MethodConfig, params: dict[str, Any], *, claim: bool = False) -> list[FinalRun]:
        """Train (or reuse) every fold model of every seed; with ``claim``, skip runs another
        live worker process has claimed (a ``.claimed`` file created atomically in the run
        directory, naming the host and pid of its process).

        A run whose training diverges (:class:`~dmlkit.exceptions.NonFiniteError`) is recorded
        in its ``failed.json`` and returned with its ``error``; the other runs go on. A recorded
        failure is kept by later calls (training it again with the same settings and seed would
        diverge again) until its settings change or its directory is deleted."""
        runs = []
        for seed, fold, run_dir, cfg, stale in self._plan(method, params):
            emb_path = run_dir / "embeddings" / "test.npz"
            failed = not stale and _recorded_failure(run_dir) is not None
            done = failed or (not stale and emb_path.exists() and (run_dir / "metrics.json").exists())
            if not done and claim and not _claim(run_dir):
                continue
            if stale:  # trained with an earlier best (a search resumed with more trials)
                _say(self.console, f"  final {method.name}: seed {seed} fold {fold.index} was trained with "
                     f"other settings ({'; '.join(stale)}): training it again")
                _clear_run(run_dir)
            if failed:
                _say(self.console, f"  final {method.name}: seed {seed} fold {fold.index} diverged in an "
                     f"earlier final stage (kept as failed; delete {run_dir} to train it again)")
            if not done:
                train_set, val_set = self._fold_sets(fold.index)
                resume = (run_dir / "checkpoints" / "last.pt").exists()
                _say(self.console, f"  final {method.name}: seed {seed} fold {fold.index}"
                     + (" (resuming)" if resume else ""))
                try:
                    self.train_fn(cfg, run_dir, train_set=train_set, val_set=val_set, test_set=self.test,
                                  resume=resume, progress=False)
                except NonFiniteError as exc:  # the run's own outcome: recorded, the stage goes on
                    error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    atomic_write_json(run_dir / FAILED_RUN, {"error": error, "seed": seed, "fold": fold.index})
                    _say(self.console, f"  [yellow]final {method.name}: seed {seed} fold {fold.index} "
                         f"diverged:[/] {escape(error)}")
            if not (run_dir / "split.json").exists():  # the classes it was trained and tested on
                ClassSplit(fold.train, fold.val, self.split.test,
                           meta={"bench": self.config.name, "fold": fold.index}
                           ).naming({**self.dev.class_names, **self.test.class_names}
                                    ).to_json(run_dir / "split.json")
            runs.append(self._run(method, seed, fold.index, run_dir))
        return runs

    def run_all(self, method: MethodConfig, params: dict[str, Any]) -> list[FinalRun]:
        """Every final run of ``method``, as :meth:`run_method` with ``claim``: trains the runs
        no live worker has claimed, then waits (every :data:`CLAIM_POLL_S` seconds) for those
        that other workers (``dmlkit bench --worker --stage final``) are training; a run whose
        worker died without finishing it is trained here."""
        expected = len(self.config.protocol.seeds or [0]) * len(self.split.folds)
        said = False
        while True:
            runs = self.run_method(method, params, claim=True)
            if len(runs) >= expected:
                return runs
            if not said:
                _say(self.console, f"  final {method.name}: waiting for {expected - len(runs)} run(s) "
                     "that other workers are training")
                said = True
            time.sleep(CLAIM_POLL_S)

    def run_pretrained(self) -> list[FinalRun]:
        """Trunk + untrained embedder, one per fold and seed (initialised as the fold models are,
        :func:`run_seed`). Embeddings made with other settings (their ``config.yaml``: another
        seed, from a dmlkit with the earlier seed formula) are made again."""
        runs = []
        for seed in self.config.protocol.seeds or [0]:
            for fold in self.split.folds:
                run_dir = self.bench_dir / "final" / PRETRAINED / f"seed{seed}" / f"fold{fold.index}"
                emb_path = run_dir / "embeddings" / "test.npz"
                cfg = self.config.experiment(None, seed=run_seed(self.config, seed, fold.index))
                stale = emb_path.exists() and _stale_changes(run_dir, cfg)
                if stale:
                    _say(self.console, f"  pretrained: seed {seed} fold {fold.index} was embedded with other "
                         f"settings ({'; '.join(stale)}): embedding it again")
                if stale or not emb_path.exists():
                    seed_everything(cfg.seed)
                    model = build_model(cfg.model)
                    with torch.no_grad():
                        emb, lab = embed_split(model, self.test, cfg, cfg.training.device)
                    # the dataset rows and their files, as the trained runs' files hold them:
                    # compare pairs by the rows
                    save_embeddings(emb_path, emb, lab, **dataset_items(self.test, run_data_root(cfg.data.root, None)))
                    atomic_write_text(run_dir / "config.yaml", dump_config(cfg))
                runs.append(FinalRun(PRETRAINED, seed, fold.index, run_dir, emb_path, None))
        return runs


def _stale_changes(run_dir: Path, cfg: Any) -> list[str]:
    """How the run in ``run_dir`` (its ``config.yaml``) trains differently from ``cfg``; empty
    for a matching run or none."""
    import yaml

    path = run_dir / "config.yaml"
    if not path.exists():
        return []
    try:
        saved = load_yaml(path.read_text(encoding="utf-8"))
        return training_changes(saved, cfg, source=str(path))
    except (OSError, ValueError, yaml.YAMLError, DmlkitError) as exc:  # unreadable: not this run
        return [f"{path.name} unreadable: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"]


def _recorded_failure(run_dir: Path) -> str | None:
    """The error a diverged run recorded in its ``failed.json`` (``None`` for none)."""
    path = run_dir / FAILED_RUN
    if not path.exists():
        return None
    try:
        return str(read_json(path, FAILED_RUN)["error"])
    except (OSError, DataError, KeyError, TypeError):  # DataError: corrupt or nested ~100,000 deep
        return f"diverged (its {FAILED_RUN} is unreadable)"


def _clear_run(run_dir: Path) -> None:
    """Remove what a run directory holds, except this process's claim on it."""
    for entry in run_dir.iterdir():
        if entry.name == CLAIM:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


#: Seconds :meth:`FinalStage.run_all` waits between looks at the runs other workers train.
CLAIM_POLL_S = 5.0
CLAIM = ".claimed"


def _claim_owner() -> str:
    """What a claim file holds: ``host pid`` of the process that claimed the run."""
    return f"{socket.gethostname()} {os.getpid()}"


def _claim_is_live(path: Path) -> bool:
    """Whether the process that wrote the claim ``path`` is alive. A claim made on another
    machine (a shared bench directory) counts as live: its process cannot be looked at from
    here. A claim this process holds counts as dead (nothing to wait for)."""
    try:
        owner = path.read_text().split()
    except FileNotFoundError:
        return False
    except OSError:
        return True
    if len(owner) == 1:  # written by an older dmlkit: the pid alone, on this machine
        owner = [socket.gethostname(), owner[0]]
    if len(owner) != 2 or not owner[1].isdigit():  # being written (created, not yet filled in)
        return True
    host, pid = owner[0], int(owner[1])
    if host != socket.gethostname():
        return True
    return pid != os.getpid() and process_alive(pid)  # a zombie (exited, not reaped) is no worker


#: The lock file (beside the run directories of a seed) that serialises claim takeovers.
CLAIM_TAKEOVER = ".claim-takeover"


def _create_claim(path: Path) -> bool:
    """Create the claim ``path`` for this process if no file is there (atomically)."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, _claim_owner().encode())
    os.close(fd)
    return True


def _claim(run_dir: Path) -> bool:
    """Claim a final run for this process: create ``run_dir/.claimed`` atomically. A claim this
    process holds already, or one whose process is gone (a killed worker), is taken over; a live
    worker's claim is not (``False``).

    A takeover (look at the claim, remove it, create ours) runs under an ``flock`` on
    :data:`CLAIM_TAKEOVER`: two workers that both found a dead worker's claim could otherwise
    both take the run (the second removing the first one's new claim). Only claims made on this
    machine are ever taken over (:func:`_claim_is_live`), so a lock local to it suffices."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / CLAIM
    if _create_claim(path):
        return True
    with open_appending(run_dir.parent / CLAIM_TAKEOVER) as lock:  # never written: the lock is the state
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
        if _claim_is_live(path):
            return False
        path.unlink(missing_ok=True)  # its worker is gone (or it is this process's own)
        return _create_claim(path)


def release_claims(bench_dir: Path) -> int:
    """Remove the final-run claims whose worker process is gone (a killed worker's runs are
    trained again); a live worker's claims stay. Returns how many were removed."""
    n = 0
    for path in Path(bench_dir).glob(f"final/*/seed*/fold*/{CLAIM}"):
        if not _claim_is_live(path):
            path.unlink(missing_ok=True)
            n += 1
    return n


def evaluate_runs(runs: Sequence[FinalRun], metrics: Sequence[str], **options: Any) -> dict[str, Any]:
    """Per seed: separated (mean over fold models) and concatenated metrics.

    ``options`` are keyword arguments of :func:`dmlkit.metrics.evaluate` (backend, memory
    budget, cluster restarts: ``EvaluationConfig.metric_options()``). The result also holds
    the fold models' ``embedding_size`` (read from their embeddings: the model owns it) and
    ``digests``, ``{embeddings path: embeddings_digest}`` of the files it read.

    A seed with a diverged fold model (a run with an ``error``) has neither a concatenated
    embedding nor a full separated mean: it is left out of ``seeds`` and listed in
    ``failed_seeds`` (and its failed runs in ``failed_runs``), so that a table never shows a
    mean over fewer seeds without saying so.
    """
    embedding_size = None
    by_seed: dict[int, list[FinalRun]] = {}
    for r in runs:
        by_seed.setdefault(r.seed, []).append(r)
    failed_runs = [{"seed": r.seed, "fold": r.fold, "run_dir": r.run_dir, "error": r.error}
                   for r in sorted(runs, key=lambda r: (r.seed, r.fold)) if r.error is not None]
    failed_seeds = sorted({f["seed"] for f in failed_runs})
    separated: dict[str, list[float]] = {m: [] for m in metrics}
    concatenated: dict[str, list[float]] = {m: [] for m in metrics}
    digests: dict[str, str] = {}
    for seed in sorted(set(by_seed) - set(failed_seeds)):
        fold_runs = sorted(by_seed[seed], key=lambda r: r.fold)
        embs, labels = [], None
        per_fold: dict[str, list[float]] = {m: [] for m in metrics}
        for r in fold_runs:
            emb, lab, _ = load_embeddings(r.embeddings)
            if labels is not None and not np.array_equal(labels, lab):
                raise DataError(f"{r.embeddings}: test labels differ between fold models of seed {seed}")
            labels = lab
            digests[str(r.embeddings)] = embeddings_digest(emb, lab)
            embs.append(emb)
            embedding_size = int(emb.shape[1])
            res = evaluate(emb, lab, metrics=list(metrics), **options)
            for m in metrics:
                per_fold[m].append(float(res[m]))
        for m in metrics:
            separated[m].append(float(np.mean(per_fold[m])))
        cat = concatenate_normalized(embs)
        res = evaluate(cat, labels, metrics=list(metrics), **options)
        for m in metrics:
            concatenated[m].append(float(res[m]))
    return {"seeds": sorted(set(by_seed) - set(failed_seeds)), "separated": separated,
            "concatenated": concatenated, "embedding_size": embedding_size, "digests": digests,
            "failed_seeds": failed_seeds, "failed_runs": failed_runs}


# -- the whole benchmark ------------------------------------------------------------------------
