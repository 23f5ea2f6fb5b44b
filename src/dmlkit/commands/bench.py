"""``dmlkit bench CONFIG.yaml``: the fair comparison of "A Metric Learning Reality Check"."""

from __future__ import annotations

from pathlib import Path

import typer

from dmlkit.limits import MAX_THREADS


def register(app: typer.Typer) -> None:
    @app.command("bench")
    def bench_command(
        config: Path = typer.Argument(..., help="Bench config (YAML), e.g. configs/bench_quick.yaml."),
        out: Path | None = typer.Option(None, "--out", "-o", help="Bench directory (default: runs/bench/<config name>)."),
        set_: list[str] = typer.Option(
            None, "--set", help="Override a config value: --set protocol.trials=10 (parsed as YAML); repeatable."
        ),
        workers: int = typer.Option(1, "--workers", "-j", min=1, help="Search with N local worker processes."),
        worker: bool = typer.Option(
            False, "--worker", help="Only run search trials of the (shared) study, then exit: join a "
            "study from another process or machine (use a postgresql:// protocol.storage)."
        ),
        method: list[str] = typer.Option(None, "--method", "-m", help="Only these methods (repeatable)."),
        stage: str = typer.Option("all", "--stage", help="all | search | final"),
        data_root: Path | None = typer.Option(
            None, "--data-root", help="Data root (default: the config's fixed.data.root, else "
            "$DMLKIT_DATA or ~/.cache/dmlkit/data); refused when fixed.data.root names another folder."),
        threads: int | None = typer.Option(
            None, "--threads", min=1, max=MAX_THREADS, help="torch CPU threads per process, 1 to "
            f"{MAX_THREADS} (default: torch's; with --workers N: cores / N). On a busy machine 1 is often fastest."
        ),
        max_trials: int | None = typer.Option(
            None, "--max-trials", min=1, help="With --worker: run at most N search trials per method, "
            "then exit (e.g. one bounded task of a SLURM array)."
        ),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="Only print the results table."),
    ) -> None:
        """The fair benchmarking protocol: cross-validated search per method, final runs, results table.

        Splits the classes, runs a cross-validated Bayesian search per method, trains the final
        fold models over seeds and writes the results table (concatenated / separated P@1,
        R-Precision, MAP@R with 95 % CIs).

        Writes OUT/{config.yaml, provenance.json, split.json, study.db, search/, final/,
        results.json, results.csv, results.md}. Rerunning the same command resumes.

        Before anything is written, every method's config is checked against the data and the
        folds' class counts: all violations in one error, each with a value that fits
        (--set protocol.folds=2 ...). Exits 2 when every search trial of a method failed, or
        (after writing the table) when every final run of a method diverged.

        With -m, the final stage trains the named methods and keeps the rows of the others whose
        final runs are on disk and current; it says which it kept and which it left out. A final
        run that diverges (NaN loss) is recorded in its failed.json and kept: the method's row is
        over the seeds whose fold models all finished, labelled (2/3 seeds), with a warning.

        Inference and metric settings are the config's fixed.evaluation section, e.g.
        --set fixed.evaluation.memory_mb=512; its memory_mb and backend,
        fixed.data.root, protocol.trials and protocol.seeds (more final runs) may change when a
        bench resumes.
        """
        import os

        from dmlkit.commands._console import output_console
        from dmlkit.exceptions import ConfigError, DmlkitError
        from dmlkit.protocol import Bench, load_bench_config, rich_table

        if stage not in ("all", "search", "final"):
            raise ConfigError(f"--stage must be all, search or final, got {stage!r}")
        # options of the other mode are refused, never silently ignored
        if max_trials is not None and (not worker or stage == "final"):
            raise ConfigError("--max-trials applies with --worker to its search trials (one bounded "
                              "worker); otherwise the bench runs protocol.trials trials per method "
                              "(--set protocol.trials=N)")
        if worker and workers != 1:
            raise ConfigError("--workers N starts N local workers of a coordinating bench; with "
                              "--worker this process is one worker: start --worker once per process")
        env_threads = os.environ.get("DMLKIT_NUM_THREADS")
        n_threads = threads
        if n_threads is None and env_threads:
            try:
                n_threads = int(env_threads)
            except ValueError:
                raise ConfigError(f"DMLKIT_NUM_THREADS={env_threads!r} is not a whole number of "
                                  "threads") from None
            if not 1 <= n_threads <= MAX_THREADS:  # as --threads: 10**23 overflowed torch, 0 and -1
                # were silently taken as 1
                raise ConfigError(f"DMLKIT_NUM_THREADS={env_threads!r}: at least 1 and at most "
                                  f"{MAX_THREADS} threads, as --threads")
        if n_threads is not None:
            import torch

            torch.set_num_threads(n_threads)
        cfg = load_bench_config(config, set_ or [])
        bench_dir = out if out is not None else Path("runs") / "bench" / cfg.name
        console = output_console()
        bench = Bench(cfg, bench_dir, data_root=data_root, console=None if quiet else console,
                      config_path=config, overrides=set_ or [], threads=threads)
        if worker:
            bench.check_shared_storage()
            bench.check_config_dir()  # a bench directory of another config is refused, as without --worker
            # the selected methods against the fold class counts, before anything is written
            bench.validate(method or None)
            bench.dir.mkdir(parents=True, exist_ok=True)
            if stage in ("all", "search"):
                summary = bench.search(methods=method or None, exclusive=False, max_trials=max_trials)
                if not quiet:
                    for name, info in summary.items():
                        console.print(f"{name}: {info}")
                bench.check_search(method or None)  # exit 2 when every trial of a method failed
            if stage == "final":  # final runs need this machine's bench directory
                bench.final_worker(methods=method or None)
            return
        results = bench.run(workers=workers, methods=method or None, stage=stage)
        if results is not None:
            console.print(rich_table(results))
            console.print(f"results: {bench.dir}/results.{{json,csv,md}}")
            lost = [name for name, row in results["methods"].items()
                    if row.get("failed_runs") and not row.get("seeds")]
            if lost:  # as when every search trial failed: the table is written, the method has no row
                from dmlkit.protocol.stages import DIVERGED_HINT  # lazy: torch-heavy, only when run

                first = results["methods"][lost[0]]["failed_runs"][0]
                raise DmlkitError(f"every final run of {', '.join(lost)} diverged (seed {first['seed']} "
                                  f"fold {first['fold']}: {first['error']}); its row in "
                                  f"{bench.dir}/results.md is n/a. {DIVERGED_HINT}")
