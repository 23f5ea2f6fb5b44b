"""``dmlkit train CONFIG.yaml`` and ``dmlkit embed CHECKPOINT_OR_RUN_DIR``."""

from __future__ import annotations

from pathlib import Path

import typer


def _setup_logging(quiet: bool) -> None:
    import logging

    from rich.logging import RichHandler

    log = logging.getLogger("dmlkit")
    if not any(isinstance(h, RichHandler) for h in log.handlers):
        handler = RichHandler(show_path=False, show_time=False, markup=False)
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
    log.setLevel(logging.WARNING if quiet else logging.INFO)


def _metrics_table(title: str, rows: dict[str, dict[str, float] | None]):
    from rich.table import Table

    metrics: list[str] = []
    for values in rows.values():
        for key in values or {}:
            if key not in metrics and not key.startswith("num_"):
                metrics.append(key)
    table = Table(title=title)
    table.add_column("split")
    for m in metrics:
        table.add_column(m, justify="right")
    for split, values in rows.items():
        if values:
            table.add_row(split, *[f"{100 * values[m]:.2f}" if m in values else "-" for m in metrics])
    return table


def register(app: typer.Typer) -> None:
    @app.command("train")
    def train_command(
        config: Path = typer.Argument(..., help="Experiment config (YAML), e.g. configs/quickstart.yaml."),
        set_: list[str] = typer.Option(
            None, "--set", help="Override a config value: --set training.epochs=3 (value parsed as YAML); repeatable."
        ),
        run_dir: Path | None = typer.Option(None, "--run-dir", help="Run directory (default: runs/<config name>)."),
        data_root: Path | None = typer.Option(None, "--data-root", help="Data root (default: $DMLKIT_DATA or ~/.cache/dmlkit/data)."),
        resume: bool = typer.Option(False, "--resume", help="Continue the run in --run-dir from checkpoints/last.pt."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars or info logs."),
    ) -> None:
        """Train an embedding model; embed the test split with the best checkpoint and print its metrics.

        Writes RUN_DIR/{config.yaml, provenance.json, split.json, log.jsonl,
        checkpoints/{last,best}.pt, embeddings/test.npz, metrics.json}, as train() of
        dmlkit.training does from Python.

        Inference and metric settings are the config's evaluation section, e.g.
        --set evaluation.memory_mb=512.
        """
        from rich.console import Console

        from dmlkit.config import load_config
        from dmlkit.training import train

        _setup_logging(quiet)
        cfg = load_config(config, list(set_ or []))
        out_dir = run_dir if run_dir is not None else Path("runs") / cfg.name
        result = train(cfg, out_dir, resume=resume, progress=not quiet, data_root=data_root)
        rows = {"val (best)": result.val_metrics or None, "test": result.test_metrics,
                "val, step 0 (untrained)": result.baseline.get("val"),
                "test, step 0 (untrained)": result.baseline.get("test")}
        Console().print(_metrics_table(f"{cfg.name}: best step {result.best_step} "
                                       f"({result.stop_reason}, {result.train_seconds:.0f} s)", rows))
        if result.test_metrics:
            t = result.test_metrics
            typer.echo(f"test MAP@R {100 * t['map_at_r']:.2f}  P@1 {100 * t.get('precision_at_1', float('nan')):.2f}  "
                       f"(run: {out_dir})")

    @app.command("embed")
    def embed_command(
        checkpoint: Path = typer.Argument(..., help="A checkpoint (.pt) or a run directory (uses checkpoints/best.pt)."),
        split: str = typer.Option("test", "--split", help="Which classes to embed: test, val or train."),
        output: Path | None = typer.Option(None, "--output", "-o", help="Output .npz (default: RUN_DIR/embeddings/<split>.npz)."),
        data_root: Path | None = typer.Option(None, "--data-root", help="Data root (overrides the config's data.root)."),
        device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
        quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bars."),
    ) -> None:
        """Embed a split with a trained model; the .npz works with `dmlkit evaluate`."""
        from dmlkit.training.trainer import embed_run

        output, emb, labels, cfg = embed_run(checkpoint, split, output=output, data_root=data_root,
                                             device=device, progress=not quiet)
        typer.echo(f"wrote {output}: {emb.shape[0]} x {emb.shape[1]} embeddings, "
                   f"{len(set(labels.tolist()))} classes ({split} split of {cfg.data.dataset})")
