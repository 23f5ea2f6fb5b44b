"""``dmlkit patches build-data | train | evaluate``: patch correspondence (Zagoruyko & Komodakis)."""

from __future__ import annotations

from pathlib import Path

import typer

from dmlkit.commands._console import echo_json

patches_app = typer.Typer(
    help="Patch correspondence: decision networks and descriptors, FPR95, the Brown cross-subset protocol.",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    app.add_typer(patches_app, name="patches")


def _print_table(results: dict, title: str, as_json: bool) -> None:
    if as_json:
        echo_json({k: results[k] for k in ("architectures", "rows", "mean")})
        return
    from rich.table import Table

    from dmlkit.commands._console import output_console

    archs = results["architectures"]
    table = Table(title=title)
    table.add_column("Train")
    table.add_column("Test")
    for a in archs:
        table.add_column(a, justify="right")
    lines = [(r["train"], r["test"], {a: r[a]["fpr95"] for a in archs}) for r in results["rows"]]
    lines.append(("mean", "", {a: results["mean"][a]["fpr95"] for a in archs}))
    best = _lowest_shown([values for _, _, values in lines])
    for (train, test, values), bold in zip(lines, best):
        cells = [f"{100 * values[a]:.2f}" for a in archs]
        table.add_row(train, test, *[f"[bold]{c}[/bold]" if a in bold else c for a, c in zip(archs, cells)])
    output_console().print(table)


def _lowest_shown(rows: list[dict[str, float]]) -> list[set[str]]:
    """Per row of ``{architecture: FPR95}``, the architectures with the lowest FPR95 as the table
    shows it (in %, 2 decimals), by the bench tables' one rule
    (:func:`dmlkit.protocol.results.best_cells`, on the negated rates: lower is better): every
    architecture tied at the shown decimals is bold, and a NaN never is nor hides the others.
    The raw minimum bolded one of two cells that both read 5.00, and a NaN in a row's first cell
    made ``min()`` NaN, which bolded nothing in that row."""
    from dmlkit.protocol.results import best_cells

    columns = [f"row{i}" for i in range(len(rows))]
    as_results = {"methods": {arch: {"concatenated": {col: {"mean": -float(row[arch])}
                                                      for col, row in zip(columns, rows) if arch in row}}
                              for arch in {a for row in rows for a in row}}}
    best = best_cells(as_results)
    return [best.get(("concatenated", col), set()) for col in columns]


def _is_patch_results(results: object) -> bool:
    """Whether ``results`` holds what the table reads: the architectures, and a numeric FPR95 of
    each in every row (with its train and test subsets) and in the mean (a hand-edited or damaged
    file gave a KeyError or TypeError traceback)."""
    def has_fpr(cell: object) -> bool:
        value = cell.get("fpr95") if isinstance(cell, dict) else None
        return isinstance(value, int | float) and not isinstance(value, bool)

    if not isinstance(results, dict) or not {"architectures", "rows", "mean"} <= results.keys():
        return False
    archs, rows, mean = results["architectures"], results["rows"], results["mean"]
    return (isinstance(archs, list) and bool(archs) and all(isinstance(a, str) for a in archs)
            and isinstance(rows, list) and bool(rows) and isinstance(mean, dict)
            and all(isinstance(r, dict) and isinstance(r.get("train"), str) and isinstance(r.get("test"), str)
                    and all(has_fpr(r.get(a)) for a in archs) for r in rows)
            and all(has_fpr(mean.get(a)) for a in archs))


def _check_results_of_config(run_dir: Path, results: dict) -> None:
    """The stored table was written for the run's ``config.yaml``, else a one-line error naming
    the first setting that differs and ``--rescore``. A re-run rewrites ``config.yaml`` when it
    starts and ``results.json`` when it ends: one killed in between by an older dmlkit (which
    left the previous table in place) paired the old table with the new config and models."""
    from pydantic import ValidationError

    from dmlkit.apps.patches.protocol import PatchExperimentConfig, load_patch_config
    from dmlkit.exceptions import DataError
    from dmlkit.utils import dotted_items

    current = dotted_items(load_patch_config(run_dir / "config.yaml").model_dump(mode="json"))
    try:  # validated as config.yaml is, so that defaults added since fill both alike
        recorded = dotted_items(PatchExperimentConfig.model_validate(results.get("config")).model_dump(mode="json"))
    except ValidationError:
        recorded = None
    if recorded == current:
        return
    if recorded is None:
        what = "records no valid config"
    else:
        key = next(k for k in [*current, *recorded] if current.get(k) != recorded.get(k))
        what = f"was written for {key}={recorded.get(key)!r}, but config.yaml says {current.get(key)!r}"
    raise DataError(f"{run_dir / 'results.json'} {what} (a re-run that did not finish): score the run's "
                    "checkpoints with --rescore, or rerun `dmlkit patches train`")


def _check_figure_format(path: Path) -> Path:
    """The figure file to write: a suffix matplotlib cannot write is a one-line error, before any
    work; no suffix gets ``.png`` (matplotlib appends it anyway: the path reported was not the
    file written)."""
    from matplotlib.figure import Figure

    from dmlkit.exceptions import ConfigError

    if path.is_dir():
        raise ConfigError(f"--figure {path} is a folder: name the image file to write (e.g. {path / 'hardest.png'})")
    fmt = path.suffix[1:].lower()
    if not fmt:
        return path.with_name(path.name + ".png")
    supported = Figure().canvas.get_supported_filetypes()
    if fmt not in supported:
        raise ConfigError(f"--figure {path}: matplotlib cannot write '.{fmt}' files; use one of "
                          f"{', '.join('.' + f for f in sorted(supported))}")
    return path


@patches_app.command("build-data")
def build_data(
    output: Path | None = typer.Option(None, "-o", "--output", help="Folder for the subsets (default: DATA_ROOT/patches_offline)."),
    data_root: Path | None = typer.Option(None, "--data-root", help="Data root (default $DMLKIT_DATA or ~/.cache/dmlkit/data)."),
    seed: int = typer.Option(0, help="Seed of every random draw."),
    points: int = typer.Option(2000, help="3D points per subset (at most)."),
    views: int = typer.Option(4, help="Views (patches) per point."),
    train_pairs: int = typer.Option(20000, help="Pairs in the training match file."),
    test_pairs: int = typer.Option(10000, help="Pairs in the test match file."),
    subsets: list[str] = typer.Option([], "--subset", help="Build only these subsets (repeatable; default all three)."),
) -> None:
    """Build real patch correspondences from scikit-image's bundled photographs, in the Brown layout."""
    from dmlkit.apps.patches.offline import OfflineSpec, build_offline_dataset
    from dmlkit.utils import data_root as default_root

    out = output or default_root(data_root) / "patches_offline"
    spec = OfflineSpec(points_per_subset=points, views=views, train_pairs=train_pairs, test_pairs=test_pairs, seed=seed)
    summary = build_offline_dataset(out, spec, tuple(subsets) or None)
    for name, info in summary["subsets"].items():
        if subsets and name not in subsets:  # built earlier, kept in the manifest
            continue
        typer.echo(f"{name}: {info['points']} points, {info['patches']} patches from {', '.join(info['sources'])}")
    typer.echo(f"-> {out} (manifest.json)")


@patches_app.command("train")
def train(
    config: Path = typer.Argument(..., help="A configs/patches*.yaml file."),
    output: Path = typer.Option(Path("runs/patches"), "-o", "--output", help="Run directory."),
    data_root: Path | None = typer.Option(None, "--data-root", help="Data root (default $DMLKIT_DATA or ~/.cache/dmlkit/data)."),
    overrides: list[str] = typer.Option([], "--set", help="Config override, e.g. training.epochs=1 (repeatable)."),
    fresh: bool = typer.Option(False, "--fresh", help="Retrain models whose checkpoint exists."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress lines."),
    as_json: bool = typer.Option(False, "--json", help="Print the table as JSON."),
) -> None:
    """Train every architecture on each training subset and print the FPR95 table (the paper's Table 1)."""
    from dmlkit.apps.patches.protocol import load_patch_config, run_patch_protocol

    cfg = load_patch_config(config, overrides)
    say = None if quiet or as_json else (lambda m: typer.echo(m, err=True))
    results = run_patch_protocol(cfg, output, data_root=data_root, resume=not fresh, log=say)
    _print_table(results, f"FPR95 (%), {output}", as_json)


@patches_app.command("evaluate")
def evaluate(
    run_dir: Path = typer.Argument(..., help="A run directory from `dmlkit patches train`."),
    data_root: Path | None = typer.Option(None, "--data-root", help="Data root (default $DMLKIT_DATA or ~/.cache/dmlkit/data)."),
    rescore: bool = typer.Option(False, "--rescore", help="Score the checkpoints again instead of reading results.json."),
    max_test_pairs: int | None = typer.Option(None, min=1, help="With --rescore: at most this many test pairs."),
    figure: Path | None = typer.Option(None, "--figure", help="Write a figure of the hardest false positives/negatives (.png)."),
    arch: str | None = typer.Option(None, help="Architecture of the figure (default: the best mean FPR95)."),
    k: int | None = typer.Option(None, "-k", min=1, help="Pairs per row of the figure (default 8)."),
    as_json: bool = typer.Option(False, "--json", help="Print the table as JSON."),
) -> None:
    """Print a run's FPR95 table; optionally the figure of its hardest mistakes."""
    from dmlkit.apps.patches.protocol import evaluate_patch_run
    from dmlkit.exceptions import CheckpointError, ConfigError, DataError
    from dmlkit.utils import read_json

    res_file = run_dir / "results.json"
    if figure is not None:
        figure = _check_figure_format(figure)
    elif arch is not None:
        raise ConfigError("--arch picks the architecture of the figure: pass --figure too")
    elif k is not None:
        raise ConfigError("-k sets the pairs per row of the figure: pass --figure too")
    if max_test_pairs is not None and not rescore and res_file.is_file():
        raise ConfigError(f"--max-test-pairs applies when the checkpoints are scored again: pass --rescore "
                          f"(without it the table is {res_file}, scored on the run's own test pairs)")
    if data_root is not None and not rescore and figure is None and res_file.is_file():
        raise ConfigError(f"--data-root locates the subsets scored again (--rescore) or drawn in the figure "
                          f"(--figure): pass one of them (without them the table is {res_file}, read as stored)")
    rescored: dict | None = None
    if rescore or not res_file.is_file():
        rescored = {}
        results = evaluate_patch_run(run_dir, data_root=data_root, max_test_pairs=max_test_pairs,
                                     scores_out=rescored)
    else:
        results = read_json(res_file, "results.json of dmlkit patches train")
        if not _is_patch_results(results):
            raise DataError(f"{res_file} is not a results.json of dmlkit patches train (or is damaged): "
                            "rerun `dmlkit patches train`, or score the checkpoints with --rescore")
        _check_results_of_config(run_dir, results)
    if figure is None:
        _print_table(results, f"FPR95 (%), {run_dir}", as_json)
        return
    import zipfile

    import numpy as np

    from dmlkit.apps.patches.brown import load_subset
    from dmlkit.apps.patches.protocol import (
        _TEST_DATA_KEY,
        hardest_pairs_figure,
        load_patch_config,
        scored_subset_id,
        subsets_root,
    )
    from dmlkit.utils import atomic_write_figure

    archs = results["architectures"]
    name = arch or min(archs, key=lambda a: results["mean"][a]["fpr95"])
    if name not in archs:
        raise ConfigError(f"architecture '{name}' is not in this run: {', '.join(archs)}")
    row = results["rows"][0]
    cfg = load_patch_config(run_dir / "config.yaml")
    sub = load_subset(subsets_root(cfg, data_root), row["test"])
    title = f"{name}: trained on {row['train']}, tested on {row['test']}"
    k = 8 if k is None else k
    if rescored is not None:  # the pairs just scored: the run's scores/ index the patches it was trained with
        pairs, s = rescored[(name, row["train"], row["test"])]
        fig = hardest_pairs_figure(sub.patches, pairs.left, pairs.right, pairs.label, s, k=k, title=title)
    else:
        scores_file = run_dir / "scores" / name / f"{row['train']}__{row['test']}.npz"
        if not scores_file.is_file():
            raise CheckpointError(f"{scores_file} is missing: run `dmlkit patches train` to write the pair scores")
        try:
            with np.load(scores_file, allow_pickle=False) as z:
                left, right, label, scores = (z[key] for key in ("left", "right", "label", "scores"))
                scored_on = str(z[_TEST_DATA_KEY]) if _TEST_DATA_KEY in z.files else None
        except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile):  # damaged, or not ours
            raise DataError(f"{scores_file} is not a readable scores file of `dmlkit patches train` (damaged "
                            "or truncated): pass --rescore to score the checkpoints again") from None
        # the file holds patch indices: drawn from another subset they show other patches
        if scored_on is None:
            import warnings

            warnings.warn(f"{scores_file} does not record which test subset it scored (written by an older "
                          f"dmlkit): its pairs are drawn from the patches at {sub.folder}; pass --rescore if the "
                          "run was tested on other data", UserWarning, stacklevel=2)
        else:
            here = scored_subset_id(sub, sub.pairs(cfg.data.test_pairs, largest=False))
            if here != scored_on:
                raise DataError(
                    f"{sub.folder} is not the test subset the run scored (files SHA-256 {scored_on[:12]}... "
                    f"in {scores_file}, {here[:12]}... here), and its pair indices would draw other patches: "
                    "pass --rescore to score the checkpoints on this data, or point --data-root / data.root "
                    "at the data the run was tested on")
        fig = hardest_pairs_figure(sub.patches, left, right, label, scores, k=k, title=title)
    atomic_write_figure(fig, figure, dpi=120)  # a killed or failed save keeps the earlier file
    # the table after the figure: a figure that cannot be written leaves nothing on stdout
    _print_table(results, f"FPR95 (%), {run_dir}", as_json)
    typer.echo(f"figure -> {figure}", err=as_json)  # stdout holds only the JSON
