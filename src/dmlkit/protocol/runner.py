"""``dmlkit bench``: the Reality Check protocol end to end (Musgrave et al., ECCV 2020).

1. split the classes (:mod:`dmlkit.protocol.splits`) and write ``split.json``;
2. for every method, a Bayesian search (Optuna TPE) whose objective is the mean validation
   MAP@R over the class-disjoint cross-validation folds (:class:`SearchStage`); the search only
   ever receives the development classes, and a :class:`TestClassGuard` checks every dataset
   it trains or validates on;
3. with each method's best hyperparameters, one model per fold and seed, each embedding the
   test classes; "separated" (each fold model's own accuracy, averaged over folds) and
   "concatenated" (the fold models' embeddings concatenated and L2-normalised) accuracies per
   seed (:class:`FinalStage`), plus the "pretrained" row (trunk + untrained embedder);
4. the results table with 95 % confidence intervals over seeds (:mod:`dmlkit.protocol.results`).

Directory layout (``docs/architecture.md``)::

    BENCH_DIR/config.yaml, provenance.json, split.json, study.db
    BENCH_DIR/search/<method>/trial<k>/fold<f>/     search runs
    BENCH_DIR/final/<method>/seed<s>/fold<f>/       final runs; embeddings/test.npz (failed.json: diverged)
    BENCH_DIR/results.{json,csv,md}
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from rich.markup import escape

from dmlkit.config import load_yaml
from dmlkit.data.skipped import holding_skip_warnings, record_skipped
from dmlkit.data.splits import default_split
from dmlkit.exceptions import ConfigError, DmlkitError
from dmlkit.protocol.config import (
    BenchConfig,
    MethodConfig,
    bench_config_from_dict,
    dump_bench_config,
)
from dmlkit.protocol.preflight import check_bench
from dmlkit.protocol.processes import run_worker_processes
from dmlkit.protocol.results import build_results, failure_notes, write_results
from dmlkit.protocol.splits import BenchSplit, TestClassGuard, make_bench_split
from dmlkit.protocol.stages import (  # noqa: F401  (re-exported: the stages' old home)
    DIVERGED_HINT,
    PRETRAINED,
    FinalRun,
    FinalStage,
    SearchStage,
    _claim,
    _say,
    _with_transform,
    evaluate_runs,
    load_full_dataset,
    method_fingerprint,
    release_claims,
    run_seed,
    warn_mixed_scoring,
)
from dmlkit.protocol.study import (
    check_sqlite_folder,
    completed_and_failed,
    count_completed,
    count_finished,
    counted_trials,
    fail_running_trials,
    in_memory_storage,
    make_sampler,
    make_storage,
    open_study,
    resolve_storage_url,
    run_worker,
    slot_order,
    storage_lock,
    study_summary,
)
from dmlkit.provenance import write_provenance
from dmlkit.training.data_root import merge_data_root, run_data_root
from dmlkit.training.preflight import Preflight
from dmlkit.utils import atomic_write_text, directory_lock, read_json_object

__all__ = ["Bench", "FinalStage", "SearchStage", "run_seed", "trial_sampler_seed"]

logger = logging.getLogger(__name__)


class Bench:
    """One benchmark directory: split, searches, final runs and results."""

    def __init__(
        self, config: BenchConfig, bench_dir: str | Path, *, data_root: str | Path | None = None,
        console: Any = None, train_fn: Callable[..., Any] | None = None,
        config_path: str | Path | None = None, overrides: Sequence[str] = (), threads: int | None = None,
    ) -> None:
        self.config = config
        self.dir = Path(bench_dir)
        # before the data is loaded and checked: mkdir said "cannot access X: File exists" at the end
        existing = next((p for p in (self.dir, *self.dir.parents) if p.exists()), None)
        if existing is not None and not existing.is_dir():
            raise ConfigError(f"the bench directory {self.dir} cannot be made: {existing} is a file; "
                              "name a directory with --out (-o)")
        merge_data_root(config.fixed.data.root, data_root, "fixed.data.root")  # two folders: refused
        self.data_root = data_root
        self.console = console
        if train_fn is None and config.protocol.launcher != "local":
            # torchrun's ranks run dmlkit.protocol.launch as __main__: not imported with the package
            from dmlkit.protocol.launch import launcher_for  # lazy: ranks run it as __main__

            train_fn = launcher_for(config, data_root=data_root, threads=threads)
        self.train_fn = train_fn
        self._full_dataset = None
        self.config_path = None if config_path is None else Path(config_path)
        self.overrides = list(overrides)
        self.threads = threads
        self._storage = None
        # check_config_dir compared this directory's own study.db's config.yaml: the sampler
        # settings an older dmlkit left out of a study's key are shown to be the same
        self._sampler_settings_checked = False
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._split: BenchSplit | None = None

    # -- shared pieces ----------------------------------------------------------------------
    def full_dataset(self):
        """Every class of the configured dataset (:func:`load_full_dataset`), loaded once per
        ``Bench``: validation, the split, the search and the final stage all start from it
        (the search stage itself only ever receives the development classes)."""
        if self._full_dataset is None:
            self._full_dataset = load_full_dataset(self.config, self.data_root)
        return self._full_dataset

    @property
    def storage_url(self) -> str:
        return resolve_storage_url(self.config.protocol.storage, self.dir)

    @property
    def storage(self):
        if self._storage is None:
            p = self.config.protocol
            self._storage = make_storage(self.storage_url, heartbeat_interval=p.heartbeat_interval,
                                         grace_period=p.grace_period)
        return self._storage

    def study_name(self, method: MethodConfig) -> str:
        prefix = self.config.protocol.study_prefix or self.config.name
        return f"{prefix}/{method.name}"

    def _open_study(self, method: MethodConfig, split: BenchSplit):
        """Open ``method``'s study with this config's trials, sampler, key and heartbeat; warn
        where its earlier trials were scored by another dmlkit (:func:`warn_mixed_scoring`)."""
        p = self.config.protocol
        study = open_study(self.storage, self.study_name(method), p.trials, sampler=p.sampler,
                           seed=p.sampler_seed, n_startup_trials=p.n_startup_trials,
                           fingerprint=method_fingerprint(self.config, method, split),
                           heartbeat={"heartbeat_interval": p.heartbeat_interval,
                                      "grace_period": p.grace_period},
                           legacy_fingerprint=method_fingerprint(self.config, method, split, legacy=True),
                           legacy_checked=self._sampler_settings_checked)
        warn_mixed_scoring(study, self.study_name(method), p.trials)
        return study

    def split(self, full_dataset=None) -> BenchSplit:
        """The protocol's split (``split.json`` if it exists, else computed from the dataset)."""
        if self._split is not None:
            return self._split
        path = self.dir / "split.json"
        p = self.config.protocol
        if path.exists():
            data = read_json_object(path, "bench split file")  # corrupt or nested ~100,000 deep: one DataError line
            split = BenchSplit.from_dict(data["meta"])
            if (split.kind, split.order, split.order_seed, len(split.folds)) != (p.split, p.order, p.order_seed, p.folds):
                raise ConfigError(
                    f"{path} was made with another protocol split ({split.kind}, order {split.order}, "
                    f"{len(split.folds)} folds); use a new bench directory"
                )
        else:
            if full_dataset is None:
                full_dataset = self.full_dataset()
            default_dev = None
            if p.split == "default":
                published = default_split(full_dataset)
                default_dev = [*published.train, *published.val]
            split = make_bench_split(
                full_dataset.classes.tolist(), p.split, order=p.order, seed=p.order_seed,
                folds=int(p.folds or 1), num_classes=p.num_classes, default_dev=default_dev,
            )
            split.class_split().to_json(path)
        self._split = split
        return split

    def prepare(self) -> None:
        """Write config/provenance; refuse a directory made by a different config."""
        self.dir.mkdir(parents=True, exist_ok=True)
        self.check_config_dir()
        atomic_write_text(self.dir / "config.yaml", dump_bench_config(self.config))
        prov_path = self.dir / "provenance.json"
        if not prov_path.exists():
            write_provenance(prov_path, self.config.fixed.seed, extra={
                "bench_dir": str(self.dir.resolve()), "config_path": str(self.config_path),
                "overrides": self.overrides})

    def check_config_dir(self) -> None:
        """Refuse a bench directory whose ``config.yaml`` holds another config (settings that
        may change on resume aside); a directory without one is accepted. One that matches
        shows the sampler settings of the directory's own ``study.db`` (protocol.storage left
        out), which an older dmlkit left out of the study's key."""
        cfg_path = self.dir / "config.yaml"
        if cfg_path.exists():
            old = bench_config_from_dict(load_yaml(cfg_path.read_text(encoding="utf-8")))
            a, b = old.model_dump(mode="json"), self.config.model_dump(mode="json")
            # the fixed settings as the studies compare them: where the data lives and how the
            # metrics are computed (fixed.evaluation's memory_mb, backend, ...) may change on
            # resume, as `dmlkit bench --help` advises for a final stage out of memory
            a["fixed"], b["fixed"] = old.fixed_fingerprint(), self.config.fixed_fingerprint()
            for d in (a, b):  # these may grow/change on resume
                d["protocol"].pop("trials", None)
                d["protocol"].pop("storage", None)
                # the final runs' seeds (compare's "too few seeds" advises more): the search is
                # unchanged, each seed's runs are its own, and the table uses the listed seeds
                d["protocol"].pop("seeds", None)
                d["protocol"].pop("repeats", None)
                for key in ("launcher", "nproc_per_trial", "torchrun"):  # how runs start, not what
                    d["protocol"].pop(key, None)
            if a != b:
                raise ConfigError(
                    f"{self.dir} holds a benchmark with another config ({cfg_path}); "
                    "use a new --out directory, or rerun with the same config to resume"
                )
            self._sampler_settings_checked = self.config.protocol.storage is old.protocol.storage is None

    def check_shared_storage(self) -> None:
        """Refuse an in-memory study database where other processes (workers, a later
        ``--stage``) must read the study."""
        storage = self.config.protocol.storage
        if in_memory_storage(storage):
            raise ConfigError(
                f"protocol.storage {storage!r} is an in-memory database: it lives in one process, so "
                "worker processes and separate --stage runs cannot share its study; use a file (leave "
                "protocol.storage out for BENCH_DIR/study.db) or a PostgreSQL URL")

    def validate(self, methods: Sequence[str] | None = None) -> Preflight:
        """Check the config of every method (or those named) against the dataset and the folds'
        class counts, all at once (:func:`dmlkit.protocol.preflight.check_bench`): one error
        listing every violation with a value that fits, before the first trial and before
        anything is written."""
        root = run_data_root(self.config.fixed.data.root, self.data_root)
        report = check_bench(self.config, self.full_dataset(), root=root,
                             methods=None if not methods else [m.name for m in self._methods(methods)])
        report.dataset = None  # keep no reference to the test classes
        report.raise_errors()
        for problem in report.warnings:
            _say(self.console, f"[yellow]warning:[/] {problem.line()}")
        if self.console is None:  # --quiet, and Python: each as a PreflightWarning (one line)
            report.emit_warnings()
        return report

    # -- search -----------------------------------------------------------------------------
    def _dev_dataset(self):
        full = self.full_dataset()
        split = self.split(full)
        dev = full.subset_classes(list(split.dev))
        del full  # the search keeps no reference to the test classes
        return dev, split

    def search(self, *, methods: Sequence[str] | None = None, exclusive: bool = True,
               max_trials: int | None = None) -> dict[str, dict[str, Any]]:
        """Run (or join, or resume) every method's search; returns a summary per method.

        ``exclusive`` (the local coordinator, no other worker alive) marks RUNNING trials left by
        a killed process as interrupted at once; shared workers rely on heartbeats instead.
        """
        dev, split = self._dev_dataset()
        guard = TestClassGuard(split.test)
        stage = SearchStage(self.config, split, dev, self.dir, guard=guard, train_fn=self.train_fn,
                            console=self.console)
        p = self.config.protocol
        summary: dict[str, dict[str, Any]] = {}
        for method in self._methods(methods):
            if not method.search:
                summary[method.name] = {"finished": 0, "note": "no searched hyperparameters"}
                continue
            study = self._open_study(method, split)
            if exclusive:
                n = fail_running_trials(study)
                if n:
                    _say(self.console, f"[yellow]{method.name}: {n} interrupted trial(s) will be rerun[/]")
            _say(self.console, f"[bold]{method.name}[/]: search {_progress(study, p.trials)}")

            def on_end(frozen, method=method, study=study) -> None:
                # escaped: an error's text (gloo's "[/.../pair.cc:561]") is no rich markup
                value = ("failed: " + escape(str(frozen.user_attrs.get("error", "?"))) if frozen.value is None
                         else f"{frozen.value:.4f}")
                _say(self.console, f"  {method.name} trial {frozen.number}: {escape(str(frozen.params))} -> {value}"
                     f"  \\[{_progress(study, p.trials)}]")

            run_worker(study, stage.objective(method), heartbeat_interval=p.heartbeat_interval,
                       max_trials=max_trials, on_trial_end=on_end,
                       sampler_factory=lambda number: make_sampler(
                           p.sampler, trial_sampler_seed(p.sampler_seed, number), p.n_startup_trials))
            summary[method.name] = study_summary(study)
        return summary

    def wait_for_search(self, methods: Sequence[str] | None = None, *, poll_s: float | None = None,
                        timeout_s: float | None = None) -> None:
        """With a shared study: wait until every trial slot is finished, wherever it runs.

        Trials running on other machines are waited for (every ``poll_s`` seconds, default the
        heartbeat interval); a trial whose worker died goes stale after
        ``protocol.grace_period``, is re-enqueued with the same parameters and is run here.
        ``timeout_s`` (default: none) bounds the wait.
        """
        import optuna
        from optuna.storages import fail_stale_trials
        from optuna.trial import TrialState

        p = self.config.protocol
        poll = float(poll_s if poll_s is not None else p.heartbeat_interval)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        said: set[str] = set()
        while True:
            waiting, running = [], {}
            for method in self._methods(methods):
                if not method.search:
                    continue
                study = optuna.load_study(storage=self.storage, study_name=self.study_name(method))
                with warnings.catch_warnings(), storage_lock(study._storage):
                    warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                    fail_stale_trials(study)  # a dead worker's trial comes back as WAITING
                if count_finished(study) >= p.trials:
                    continue
                states = [t.state for t in study.get_trials(deepcopy=False)]
                if TrialState.WAITING in states:
                    waiting.append(method.name)
                running[method.name] = states.count(TrialState.RUNNING)
            if waiting:
                self.search(methods=waiting, exclusive=False)
                continue
            if not running:
                return
            for name, n in running.items():
                if name not in said:
                    said.add(name)
                    _say(self.console, f"{name}: waiting for {n} trial(s) running on other workers")
            if deadline is not None and time.monotonic() > deadline:
                raise DmlkitError(
                    f"the search is not over after {timeout_s:g} s ({running} trials still running on "
                    "other workers); rerun the same command later to continue"
                )
            time.sleep(poll)

    def failed_searches(self, methods: Sequence[str] | None = None) -> dict[str, str]:
        """``{method: first error}`` for each method whose search is over (no trial waiting or
        running) and has no completed trial."""
        import optuna
        from optuna.trial import TrialState

        failed = {}
        for method in self._methods(methods):
            if not method.search:
                continue
            try:
                study = optuna.load_study(storage=self.storage, study_name=self.study_name(method))
            except KeyError:
                continue
            trials = study.get_trials(deepcopy=False)
            pending = [t for t in trials if t.state in (TrialState.WAITING, TrialState.RUNNING)]
            if trials and not pending and count_completed(study) == 0:
                errors = [t.user_attrs.get("error") for t in trials if t.user_attrs.get("error")]
                failed[method.name] = errors[0] if errors else "no trial completed"
        return failed

    def check_search(self, methods: Sequence[str] | None = None) -> None:
        """Raise (exit code 2) when every search trial of a method failed."""
        failed = self.failed_searches(methods)
        if failed:
            detail = "; ".join(f"{name}: {error}" for name, error in failed.items())
            raise DmlkitError(
                f"every search trial failed for {', '.join(failed)} ({detail}). Fix the method's "
                f"config or search ranges; the failed trials are in {self.storage_url}"
            )

    def _methods(self, names: Sequence[str] | None) -> list[MethodConfig]:
        if not names:
            return list(self.config.methods)
        return [self.config.method(n) for n in names]

    def best_params(self, method: MethodConfig) -> tuple[dict[str, Any], dict[str, Any]]:
        """The best trial's parameters (and a summary); ``{}`` for a method with nothing searched.

        The best is chosen among the method's first ``protocol.trials`` counted trials (completed
        or failed, in slot order: an interrupted trial's retry stands in its place,
        :func:`dmlkit.protocol.study.slot_order`) only: a study grown to more trials
        (``--set protocol.trials=5`` for one method) is read with the budget the table reports, so that every method's row
        comes from the same number of trials. The summary says how many were used
        (``counted``: ``finished`` completed + ``failed``) and how many more the study holds
        (``beyond_budget``)."""
        if not method.search:
            return {}, {"trials": 0}
        import optuna
        from optuna.trial import TrialState

        try:
            study = optuna.load_study(storage=self.storage, study_name=self.study_name(method))
        except KeyError:
            raise DmlkitError(f"no search study for {method.name!r}: run the search first (`dmlkit bench "
                              "CONFIG --stage search`, or the same command without --stage)") from None
        p = self.config.protocol
        counted = sorted(counted_trials(study), key=slot_order)  # a retry in its slot's place
        if len(counted) < p.trials:  # trial slots still to run (completed or failed)
            raise DmlkitError(
                f"the search of {method.name!r} is not over ({_progress(study, p.trials)}): rerun "
                "`dmlkit bench` (it resumes) or wait for the workers to finish"
            )
        used = counted[: p.trials]
        completed = [t for t in used if t.state == TrialState.COMPLETE]
        if not completed:
            raise DmlkitError(
                f"every search trial of {method.name!r} failed (the first {p.trials} counted; see the "
                f"'error' attribute of the trials in {self.storage_url}); fix the method's config or "
                "search ranges"
            )
        best = max(completed, key=lambda t: t.value)  # the first of equal values
        return dict(best.params), {
            "trial": best.number, "val_map_at_r": best.value,
            "fold_map_at_r": best.user_attrs.get("fold_map_at_r"), **study_summary(study),
            "finished": len(completed), "failed": len(used) - len(completed), "counted": len(used),
            "beyond_budget": len(counted) - len(used),
        }

    # -- final --------------------------------------------------------------------------------
    def final_worker(self, *, methods: Sequence[str] | None = None) -> None:
        """Train unclaimed final runs (a worker process of ``--workers N``)."""
        full = self.full_dataset()
        stage = FinalStage(self.config, self.split(full), full, self.dir, train_fn=self.train_fn,
                           console=self.console)
        for method in self._methods(methods):
            params, _ = self.best_params(method)
            stage.run_method(method, params, claim=True)

    def final(self, *, methods: Sequence[str] | None = None) -> dict[str, Any]:
        """Final runs of every method (or those named) and the pretrained row, evaluated; writes
        the results. With ``methods``, every other method whose final runs are all on disk and
        current (:meth:`FinalStage.current_runs`) keeps its row, evaluated again from its files;
        the others are left out, and the console says which and why. Diverged runs are recorded
        (:meth:`FinalStage.run_method`): their seeds are left out of the row, which says so."""
        full = self.full_dataset()
        split = self.split(full)
        stage = FinalStage(self.config, split, full, self.dir, train_fn=self.train_fn, console=self.console)
        metrics = list(self.config.protocol.metrics)
        options = self.config.fixed.evaluation.metric_options()
        entries: dict[str, dict[str, Any]] = {}
        # every method's search over before anything is embedded or trained
        chosen = {method.name: (method, *self.best_params(method)) for method in self._methods(methods)}
        if self.config.protocol.pretrained:
            _say(self.console, "[bold]pretrained[/]: embedding the test classes with untrained embedders")
            runs = stage.run_pretrained()
            entries[PRETRAINED] = {"runs": runs, "evaluation": evaluate_runs(runs, metrics, **options),
                                   "best_params": {}, "search": None}
        kept, left = [], []
        for method in self.config.methods:  # the config's order, whichever were named
            if method.name in chosen:
                _, params, search_info = chosen[method.name]
                _say(self.console, f"[bold]{method.name}[/]: final runs with {params or 'the default parameters'}")
                runs = stage.run_all(method, params)  # a live worker's runs: waited for
            elif not (self.dir / "final" / method.name).is_dir():
                left.append((method.name, "no final runs"))
                continue
            else:
                try:
                    params, search_info = self.best_params(method)
                    runs = stage.current_runs(method, params)
                except DmlkitError as exc:  # its search is not over
                    runs = str(exc)
                if isinstance(runs, str):
                    left.append((method.name, runs))
                    continue
                kept.append(method.name)
            entries[method.name] = {"runs": runs, "evaluation": evaluate_runs(runs, metrics, **options),
                                    "best_params": params, "search": search_info,
                                    "loss": method.loss.model_dump(mode="json"),
                                    "miner": None if method.miner is None else method.miner.model_dump(mode="json")}
        if kept:
            _say(self.console, f"kept the rows of {', '.join(kept)}: their final runs are current")
        if left:
            _say(self.console, f"[yellow]not in the table:[/] {escape('; '.join(f'{n} ({why})' for n, why in left))}; "
                 f"add {' '.join(f'-m {n}' for n, _ in left)} to train them")
        results = build_results(self.config, split, entries, bench_dir=self.dir,
                                storage_url=self.storage_url)
        write_results(results, self.dir)
        notes = failure_notes(results)
        for note in notes:  # a warning, not console text: said with --quiet and from Python too
            warnings.warn(note, stacklevel=2)
        if notes:
            _say(self.console, DIVERGED_HINT)
        return results

    # -- orchestration -----------------------------------------------------------------------------
    def run(self, *, workers: int = 1, methods: Sequence[str] | None = None, stage: str = "all") -> dict[str, Any] | None:
        """Validate, then run the stages (``all``, ``search`` or ``final``); ``final`` returns
        the results. Raises when every search trial of a method failed."""
        if workers > 1 or stage != "all":
            self.check_shared_storage()
        check_sqlite_folder(self.config.protocol.storage)  # before anything is written
        with holding_skip_warnings():  # said with the list's place once the bench directory exists
            self.validate(methods)  # before anything is written: a refused config leaves no trace
        self.prepare()
        record_skipped(self.full_dataset(), self.dir)  # every image skip_corrupt left out, with why
        with _bench_lock(self.dir) if self.config.protocol.storage is None else contextlib.nullcontext():
            if stage in ("all", "search"):
                if workers > 1:
                    self._spawn_workers(workers, methods, "search")
                else:
                    # a shared database may have live workers elsewhere: rely on their heartbeats
                    self.search(methods=methods, exclusive=self.config.protocol.storage is None)
                    if self.config.protocol.storage is not None:  # wait for the other workers
                        self.wait_for_search(methods)
                self.check_search(methods)
            if stage in ("all", "final"):
                release_claims(self.dir)
                if workers > 1:
                    for method in self._methods(methods):  # here, in one line: not in N workers' logs
                        self.best_params(method)
                    self._spawn_workers(workers, methods, "final")
                return self.final(methods=methods)
        return None

    def _spawn_workers(self, workers: int, methods: Sequence[str] | None, stage: str) -> None:
        """Run ``workers`` worker processes (search trials or final runs) and wait for them.

        Each is a ``multiprocessing`` (spawn) process running :func:`_worker_main` on this
        bench's config, so ``Bench.run(workers=N)`` works from Python as well as from the CLI.
        """
        # with the local SQLite study the coordinator is the only process alive: trials left
        # RUNNING by a killed run can be reset now (a shared database relies on heartbeats)
        reset = stage == "search" and self.config.protocol.storage is None
        for method in self._methods(methods) if reset else []:
            if not method.search:
                continue
            fail_running_trials(self._open_study(method, self.split()))
        threads = self.threads or max(1, (os.cpu_count() or 1) // workers)
        args = (self.config.model_dump(mode="json"), str(self.dir), stage, list(methods or []),
                None if self.data_root is None else str(self.data_root), threads)
        _say(self.console, f"{stage}: starting {workers} worker processes (logs: {self.dir}/worker*-{stage}.log)")
        # SIGTERM / Ctrl-C stop the workers (and their torchrun jobs) before this process exits
        codes = run_worker_processes(_worker_main, [(*args, str(self.dir / f"worker{i}-{stage}.log"))
                                                    for i in range(workers)],
                                     [f"dmlkit-{stage}-{i}" for i in range(workers)],
                                     env={"DMLKIT_NUM_THREADS": str(threads), "OMP_NUM_THREADS": str(threads)})
        failed = [code for code in codes if code != 0]
        if failed:
            raise DmlkitError(
                f"{len(failed)} worker(s) failed (exit codes {failed}); see {self.dir}/worker*.log, "
                "then rerun the same command to resume"
            )


def trial_sampler_seed(sampler_seed: int, number: int) -> int:
    """The seed of trial ``number``'s sampler, inside numpy's range (0 to 2**32 - 1): a seed
    past it failed the trial's sampling and left the trial RUNNING for ever."""
    return (sampler_seed + 7919 * number) % 2**32


def _progress(study, trials: int) -> str:
    """``"2/3 trials completed, 1 failed"``: only COMPLETE trials count as completed."""
    completed, failed = completed_and_failed(study)
    return f"{completed}/{trials} trials completed" + (f", {failed} failed" if failed else "")


def _worker_main(config: dict[str, Any], bench_dir: str, stage: str, methods: list[str],
                 data_root: str | None, threads: int, log_path: str) -> None:
    """A worker process of ``Bench.run(workers=N)``: search trials of the shared study, or
    unclaimed final runs. Its output goes to ``log_path``."""
    with open(log_path, "ab", buffering=0) as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        torch.set_num_threads(threads)
        bench = Bench(bench_config_from_dict(config), bench_dir, data_root=data_root, threads=threads)
        if stage == "search":
            bench.search(methods=methods or None, exclusive=False)
        else:
            bench.final_worker(methods=methods or None)


def _bench_lock(bench_dir: Path):
    """An exclusive lock on the bench directory (one local coordinator at a time)."""
    return directory_lock(bench_dir, "bench.lock",
                          f"another `dmlkit bench` is running in {bench_dir}; to help it, start "
                          "`dmlkit bench CONFIG --worker` with a shared storage URL instead")
