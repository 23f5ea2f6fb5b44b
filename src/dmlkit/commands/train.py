"""``dmlkit train CONFIG.yaml`` and ``dmlkit embed CHECKPOINT_OR_RUN_DIR [--format shards]``."""

from __future__ import annotations

import warnings
from pathlib import Path

import typer


def _setup_logging(quiet: bool) -> None:
    """Progress logs on stderr, like the progress bars and warnings: stdout holds the results
    alone (a failed or interrupted run prints nothing there, docs/errors.md)."""
    import logging

    from rich.logging import RichHandler

    from dmlkit.commands._console import output_console

    log = logging.getLogger("dmlkit")
    if not any(isinstance(h, RichHandler) for h in log.handlers):
        # 80 columns off a terminal, as rich's default (the handler pads its lines to the width);
        # a $COLUMNS of 0 is no width of 0 (the log lines vanished)
        handler = RichHandler(console=output_console(stderr=True, pipe_width=80), show_path=False,
                              show_time=False, markup=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.WARNING if quiet else logging.INFO)


#: How a run ended (``TrainResult.stop_reason``), in words.
_STOP_REASONS = {"epochs": "all epochs done", "max_steps": "step limit reached",
                 "patience": "stopped early (patience)"}


def _metrics_table(title: str, rows: dict[str, dict[str, float] | None]):
    from rich.table import Table

    metrics: list[str] = []
    for values in rows.values():
        for key in values or {}:
            # a clustering metric's spread over the k-means restarts goes beside its mean, as
            # `dmlkit evaluate` shows it (it had a column of its own, "nmi_std (%)")
            spread = key.endswith("_std") and key[:-4] in values
            if key not in metrics and not key.startswith("num_") and not spread:
                metrics.append(key)
    from dmlkit.protocol.results import metric_label

    def cell(values: dict[str, float], m: str) -> str:
        if m not in values:
            return "-"
        value, std = values[m], values.get(f"{m}_std")
        if value is None:  # NaN, as JSON stores it (baseline.json of a resumed run)
            return "nan"
        return f"{100 * value:.2f}" + ("" if std is None else f" ± {100 * std:.2f}")

    table = Table(title=title)
    table.add_column("split")
    for m in metrics:  # every dmlkit table: rates in percent, marked (%)
        table.add_column(f"{metric_label(m)} (%)", justify="right")
    for split, values in rows.items():
        if values:
            table.add_row(split, *[cell(values, m) for m in metrics])
    return table


def register(app: typer.Typer) -> None:
    @app.command("train")
    def train_command(
        config: Path = typer.Argument(..., help="Experiment config (YAML), e.g. configs/quickstart.yaml."),
        set_: list[str] = typer.Option(
            None, "--set", help="Override a config value: --set training.epochs=3 (value parsed as YAML); repeatable."
        ),
        run_dir: Path | None = typer.Option(None, "--run-dir", help="Run directory (default: runs/<config name>)."),
        data_root: Path | None = typer.Option(None, "--data-root", help="Data root (default: the config's data.root, else $DMLKIT_DATA or ~/.cache/dmlkit/data); refused when data.root names another folder."),
        resume: bool = typer.Option(False, "--resume", help="Continue the run in --run-dir from checkpoints/last.pt."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars or info logs."),
        allow_world_size_change: bool = typer.Option(
            False, "--allow-world-size-change",
            help="With --resume: continue a run written by another number of processes (same global "
                 "batches, not bit-identical)."),
    ) -> None:
        """Train an embedding model; embed the test split with the best checkpoint and print its metrics.

        Runs unchanged under torchrun (torchrun --nproc-per-node N -m dmlkit train CONFIG): the
        sampler's C x M batch is the global batch, split over the N processes; rank 0 writes.

        Writes RUN_DIR/{config.yaml, provenance.json, split.json, log.jsonl,
        checkpoints/{last,best}.pt, embeddings/test.npz, metrics.json}, as train() of
        dmlkit.training does from Python.

        Inference and metric settings are the config's evaluation section, e.g.
        --set evaluation.memory_mb=512.
        """
        from dmlkit.commands._console import output_console
        from dmlkit.commands._ranks import is_main_rank, one_error_line_per_job
        from dmlkit.config import load_config
        from dmlkit.exceptions import ConfigError
        from dmlkit.training import train

        if allow_world_size_change and not resume:  # never silently ignored
            raise ConfigError("--allow-world-size-change applies with --resume (a new run has no "
                              "earlier number of processes)")
        main_rank = is_main_rank()
        if not main_rank:  # other ranks stay quiet: rank 0 logs, warns and prints for the job
            quiet = True
            warnings.filterwarnings("ignore")
        _setup_logging(quiet)
        with one_error_line_per_job():
            cfg = load_config(config, list(set_ or []))
            out_dir = run_dir if run_dir is not None else Path("runs") / cfg.name
            result = train(cfg, out_dir, resume=resume, progress=not quiet, data_root=data_root,
                           allow_world_size_change=allow_world_size_change)
        if not main_rank:
            return
        rows = {"val (best)": result.val_metrics or None, "test": result.test_metrics,
                "val, step 0 (untrained)": result.baseline.get("val"),
                "test, step 0 (untrained)": result.baseline.get("test")}
        stopped = _STOP_REASONS.get(str(result.stop_reason), str(result.stop_reason))
        output_console().print(_metrics_table(f"{cfg.name}: best step {result.best_step}; {stopped} "
                                              f"after {result.train_seconds:.0f} s", rows))
        if any(key.endswith("_std") for values in rows.values() for key in values or {}):
            typer.echo(f"clustering metrics: mean ± standard deviation over "
                       f"{cfg.evaluation.cluster_restarts} k-means run(s)")
        if result.test_metrics:  # only the metrics the run computed (training.eval_metrics)
            t = result.test_metrics
            shown = [f"{label} {100 * t[key]:.2f} %" for key, label in
                     (("map_at_r", "MAP@R"), ("precision_at_1", "P@1")) if key in t]
            typer.echo(f"test {'  '.join(shown)}  (run: {out_dir})")

    @app.command("embed")
    def embed_command(
        ctx: typer.Context,
        checkpoint: Path = typer.Argument(..., help="A checkpoint (.pt) or a run directory (uses checkpoints/best.pt)."),
        split: str = typer.Option("test", "--split", help="Which classes to embed: test, val or train."),
        output: Path | None = typer.Option(None, "--output", "-o", help="Output .npz (default: RUN_DIR/embeddings/<split>.npz for best.pt, <split>-<checkpoint>.npz for another checkpoint, e.g. test-last.npz) or shard directory (default: RUN_DIR/embeddings/<split>-shards, <split>-<checkpoint>-shards)."),
        data_root: Path | None = typer.Option(None, "--data-root", help="Data root (overrides the config's data.root)."),
        device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
        fmt: str = typer.Option("npz", "--format", help="npz (one file) or shards (a directory of memory-mapped .npy shards, written batch by batch: for sets larger than RAM)."),
        dtype: str = typer.Option("float32", "--dtype", help="Shard dtype: float32 or float16 (--format shards)."),
        shard_rows: int = typer.Option(65536, "--shard-rows", min=1, help="Rows per shard file (--format shards)."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing shard directory (--format shards)."),
    ) -> None:
        """Embed a split with a trained model; the .npz (or shard directory) works with `dmlkit evaluate`.

        Without -o, a checkpoint other than best.pt writes its own file (embeddings/test-last.npz
        for checkpoints/last.pt): embeddings/test.npz stays the best checkpoint's, which the
        run's metrics.json describes.
        """
        from dmlkit.commands._options import given
        from dmlkit.exceptions import ConfigError

        if fmt not in ("npz", "shards"):
            raise ConfigError(f"--format must be npz or shards, got {fmt!r}")
        shard_only = [f"--{n.replace('_', '-')}" for n in ("dtype", "shard_rows", "overwrite") if given(ctx, n)]
        if fmt == "npz" and shard_only:  # never silently ignored, even at their default values
            raise ConfigError(f"{', '.join(shard_only)} apply to --format shards only (an .npz holds float32 "
                              "embeddings and is replaced as a whole): add --format shards, or leave them out")
        from dmlkit.commands._ranks import is_main_rank, one_error_line_per_job

        main_rank = is_main_rank()  # under torchrun: each rank a share
        if fmt == "shards":
            from dmlkit.training.trainer import embed_run_to_shards

            with one_error_line_per_job():
                shards, cfg = embed_run_to_shards(checkpoint, split, output=output, data_root=data_root,
                                                  device=device, dtype=dtype, shard_rows=shard_rows,
                                                  overwrite=overwrite, progress=not quiet)
            if main_rank:
                typer.echo(f"wrote {shards.directory}: {shards.count} x {shards.dim} {dtype} embeddings in "
                           f"{len(shards.manifest['shards'])} shard(s), {len(set(shards.labels.tolist()))} "
                           f"classes ({split} split of {cfg.data.dataset})")
            return
        from dmlkit.training.trainer import embed_run

        with one_error_line_per_job():
            output, emb, labels, cfg = embed_run(checkpoint, split, output=output, data_root=data_root,
                                                 device=device, progress=not quiet and main_rank)
        if main_rank:
            typer.echo(f"wrote {output}: {emb.shape[0]} x {emb.shape[1]} embeddings, "
                       f"{len(set(labels.tolist()))} classes ({split} split of {cfg.data.dataset})")
