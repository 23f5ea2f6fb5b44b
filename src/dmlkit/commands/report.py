"""``dmlkit report`` and ``dmlkit plot``: the HTML report and its figures one at a time."""

from __future__ import annotations

from pathlib import Path

import typer

from dmlkit.limits import MAX_BINS

plot_app = typer.Typer(help="Make one figure from embeddings files or logs (PNG + SVG).", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.command("report")(report)
    app.add_typer(plot_app, name="plot")


def report(
    directory: Path = typer.Argument(..., help="A run directory (dmlkit train) or benchmark directory (dmlkit bench)."),
    output: Path | None = typer.Option(None, "-o", "--output", help="The HTML file (default DIRECTORY/report.html)."),
    data_root: Path | None = typer.Option(None, "--data-root", help="Dataset root (default: the run's data.root, else $DMLKIT_DATA or ~/.cache/dmlkit/data)."),
    maps: list[str] = typer.Option(["umap,tsne,pca"], "--maps", help="2-D maps to draw, comma-separated or repeated (umap, tsne, pca)."),
    max_points: int = typer.Option(2000, min=10, help="Samples per split for the histograms and maps (at least 10)."),
    no_thumbnails: bool = typer.Option(False, "--no-thumbnails", help="Do not draw image thumbnails."),
    seed: int = typer.Option(0, min=0, max=2**32 - 1, help="Seed for every random choice in the report (0 to 2**32 - 1)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress messages."),
) -> None:
    """Write a self-contained HTML report (figures embedded, no network needed to open it)."""
    from dmlkit.commands._console import output_console
    from dmlkit.commands._options import listed
    from dmlkit.report import ReportOptions, build_report

    console = output_console(stderr=True, quiet=quiet)
    options = ReportOptions(
        maps=tuple(listed(maps)),
        max_points=max_points, thumbnails=not no_thumbnails, data_root=data_root, seed=seed,
        progress=lambda message: console.print(f"[dim]{message}[/]"),
    )
    page = build_report(directory, output, options)
    typer.echo(str(page))


def _load(path: Path):
    """``(embeddings, labels, extra)`` of a file, refused when not finite (nothing is drawn
    from NaN)."""
    from dmlkit.embeddings import load_embeddings
    from dmlkit.validation import check_embeddings

    emb, labels, extra = load_embeddings(path, codes=True)  # codes into extra["class_names"]
    check_embeddings(emb, f"embeddings in {path}")
    return emb, labels, extra


def _figure_data(path: Path, labels, extra, thumbnails: bool):
    """The class names (and thumbnails) of a file's rows, as the report finds them
    (:func:`dmlkit.report.saved.saved_figure_data`: the file's own names, its run's
    ``split.json``, the run's dataset): a run's ``embeddings/test.npz`` stores class ids only,
    and its figures showed ids. What cannot be had is said on stderr, one ``note:`` line each."""
    from dmlkit.report.saved import saved_figure_data

    found = saved_figure_data(path, labels, extra, thumbnails=thumbnails)
    for note in found.notes:
        typer.echo(f"note: {path}: {note}", err=True)
    return found


def _distinct_names(paths: list[Path], name_of) -> list[str]:
    """One legend/panel name per path, ``name_of(path)`` where that is unique; two files or runs
    of one name (``runA/test.npz``, ``runB/test.npz``) get as many parent folders as tell them
    apart, and the same path given twice a count (keyed by name, the second replaced the first
    and one panel or line was drawn for two)."""
    resolved = [p.resolve() for p in paths]
    parents = [[part for part in r.parent.parts if part != r.anchor] for r in resolved]
    depth = [0] * len(paths)

    def names() -> list[str]:
        return ["/".join(parents[i][len(parents[i]) - d:] + [name_of(p)]) if d else name_of(p)
                for i, (p, d) in enumerate(zip(paths, depth))]

    while True:
        current = names()
        clash = [i for i, n in enumerate(current) if depth[i] < len(parents[i]) and any(
            m == n and resolved[j] != resolved[i] for j, m in enumerate(current))]
        if not clash:
            break
        for i in clash:
            depth[i] += 1
    seen: dict[str, int] = {}
    out = []
    for n in current:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n} ({seen[n]})")
    return out


def _out(output: Path | None, default: str) -> Path:
    return output or Path(default)  # save_figure drops a .png/.svg ending, keeps other dots


@plot_app.command("map")
def plot_map(
    embeddings: Path = typer.Argument(..., help="Embeddings file (.npz/.pt with labels)."),
    method: str = typer.Option("umap", help="umap, tsne or pca."),
    classes: int = typer.Option(20, min=1, help="Number of classes to show."),
    output: Path | None = typer.Option(None, "-o", "--output", help="Output path (PNG and SVG are written)."),
    seed: int = typer.Option(0, min=0, max=2**32 - 1, help="Seed (0 to 2**32 - 1)."),
    no_thumbnails: bool = typer.Option(False, "--no-thumbnails", help="Do not draw image thumbnails (drawn where the file is a run's and its images load)."),
) -> None:
    """A 2-D map of embeddings coloured by class, named by class where the names are known
    (the file's run records them), with thumbnails where its images load."""
    import numpy as np

    from dmlkit.report import figures

    figures.check_projection(method)  # before any note about the file: a bad option is the one line
    emb, labels, extra = _load(embeddings)
    found = _figure_data(embeddings, labels, extra, thumbnails=not no_thumbnails)
    keep = np.flatnonzero(np.isin(labels, np.unique(labels)[:classes]))
    pts = figures.project_2d(emb[keep], method, seed=seed)
    thumbs = None
    if found.image_of is not None:  # as the report: 12 random points of the map
        picks = np.random.default_rng(seed).choice(len(keep), size=min(12, len(keep)), replace=False)
        thumbs = {int(p): found.image_of(int(keep[p])) for p in picks}
    # the title names what was drawn: PCA stands in for UMAP without umap-learn (was titled UMAP)
    title = f"{figures.projection_title(method, len(keep), emb.shape[1])} of {embeddings.name}"
    fig = figures.embedding_map(pts, labels[keep], title, thumbs, class_names=found.class_names)
    written = figures.save_figure(fig, _out(output, f"map_{method}"))
    typer.echo("\n".join(map(str, written)))


@plot_app.command("histograms")
def plot_histograms(
    embeddings: list[Path] = typer.Argument(..., help="One or more embeddings files, one panel each."),
    bins: int = typer.Option(100, min=2, max=MAX_BINS, help=f"Number of bins (2 to {MAX_BINS:,}: one bin has no shape)."),
    fixed: bool = typer.Option(False, "--fixed-range", help="Bins over [-1, 1], as the pos_neg_js metric (default: over the observed range, readable when all similarities lie close together)."),
    output: Path | None = typer.Option(None, "-o", "--output"),
) -> None:
    """Positive/negative cosine-similarity histograms (area 1) with their JS divergence over the drawn bins."""
    from dmlkit.metrics import pos_neg_histograms
    from dmlkit.report import figures
    from dmlkit.report.builder import hist_dict

    panels = {}
    for path, name in zip(embeddings, _distinct_names(embeddings, lambda p: p.stem)):
        emb, labels, _ = _load(path)
        panels[name] = hist_dict(pos_neg_histograms(emb, labels, bins=bins, range=None if fixed else "observed"))
    written = figures.save_figure(figures.similarity_histograms(panels), _out(output, "histograms"))
    typer.echo("\n".join(map(str, written)))


@plot_app.command("per-class")
def plot_per_class(
    embeddings: Path = typer.Argument(...),
    top: int = typer.Option(10, min=1, help="How many best and worst classes."),
    output: Path | None = typer.Option(None, "-o", "--output"),
) -> None:
    """The best and worst classes by MAP@R."""
    import math

    from dmlkit.metrics import per_class
    from dmlkit.report import figures

    emb, labels, extra = _load(embeddings)
    names = _figure_data(embeddings, labels, extra, thumbnails=False).class_names
    values = {c: r["map_at_r"] for c, r in per_class(emb, labels, metrics=["map_at_r"]).items()
              if not math.isnan(r["map_at_r"])}
    written = figures.save_figure(figures.per_class_bars(values, "map_at_r", top, class_names=names),
                                  _out(output, "per_class"))
    typer.echo("\n".join(map(str, written)))


#: The largest gallery a figure can show legibly: 64 rows of 64 thumbnails (a larger one took
#: minutes to draw, or clamped silently on a small file).
_GALLERY_MAX = 64


@plot_app.command("gallery")
def plot_gallery(
    embeddings: Path = typer.Argument(...),
    queries: int = typer.Option(6, min=1, max=_GALLERY_MAX, help=f"Number of random queries (at most {_GALLERY_MAX}: one figure row each)."),
    k: int = typer.Option(6, min=1, max=_GALLERY_MAX, help=f"Neighbours per query (at most {_GALLERY_MAX}: one thumbnail each)."),
    output: Path | None = typer.Option(None, "-o", "--output"),
    seed: int = typer.Option(0, min=0, max=2**32 - 1, help="Seed (0 to 2**32 - 1)."),
    no_thumbnails: bool = typer.Option(False, "--no-thumbnails", help="Draw class names, not the images (drawn where the file is a run's and its images load)."),
) -> None:
    """Random queries with their nearest neighbours (images where the file's run has them, else
    class names; correct ones marked)."""
    import numpy as np

    from dmlkit.metrics import knn
    from dmlkit.report import figures

    emb, labels, extra = _load(embeddings)
    found = _figure_data(embeddings, labels, extra, thumbnails=not no_thumbnails)
    rng = np.random.default_rng(seed)
    chosen = rng.choice(len(emb), size=min(queries, len(emb)), replace=False)
    result = knn(emb[chosen], emb, k=k + 1)
    rows = []
    for q, neigh in zip(chosen, result.indices.numpy()):
        neigh = [int(n) for n in neigh if n != q][:k]
        rows.append({"query": int(q), "query_label": int(labels[q]), "neighbors": neigh,
                     "neighbor_labels": [int(labels[n]) for n in neigh], "caption": f"query {q}"})
    written = figures.save_figure(figures.retrieval_gallery(rows, found.image_of, class_names=found.class_names),
                                  _out(output, "gallery"))
    typer.echo("\n".join(map(str, written)))


@plot_app.command("curves")
def plot_curves(
    run_dirs: list[Path] = typer.Argument(..., help="Run directories with log.jsonl."),
    output: Path | None = typer.Option(None, "-o", "--output"),
) -> None:
    """Training loss and validation MAP@R / P@1 per step, one line per run."""
    from dmlkit.exceptions import DataError, DataNotFoundError
    from dmlkit.report import figures
    from dmlkit.report.builder import read_jsonl

    logs = {}
    for d, name in zip(run_dirs, _distinct_names(run_dirs, lambda p: p.name)):
        if not (d / "log.jsonl").is_file():
            raise DataNotFoundError(f"{d / 'log.jsonl'} not found: pass run directories of dmlkit train")
        logs[name] = read_jsonl(d / "log.jsonl")
        if not logs[name]:
            raise DataError(f"{d / 'log.jsonl'} holds no log records: nothing to draw")
    written = figures.save_figure(figures.training_curves(logs), _out(output, "curves"))
    typer.echo("\n".join(map(str, written)))


@plot_app.command("improvement")
def plot_improvement(
    results: Path = typer.Argument(..., help="results.json of dmlkit bench."),
    metric: str = typer.Option("map_at_r"),
    mode: str = typer.Option("concatenated", help="concatenated or separated."),
    output: Path | None = typer.Option(None, "-o", "--output"),
) -> None:
    """Relative improvement of each method over contrastive and triplet."""
    import math

    from dmlkit.exceptions import ConfigError, DataError
    from dmlkit.protocol.compare import baseline_methods
    from dmlkit.protocol.results import MODES
    from dmlkit.report import figures
    from dmlkit.report.builder import mean_of
    from dmlkit.utils import read_json

    if mode not in MODES:
        raise ConfigError(f"--mode must be one of {', '.join(MODES)}, got {mode!r}")
    data = read_json(results, "results.json of dmlkit bench")
    methods = data.get("methods") if isinstance(data, dict) else None
    if not isinstance(methods, dict) or not methods or not all(isinstance(r, dict) for r in methods.values()):
        raise DataError(f"{results} is not a results.json of dmlkit bench (no 'methods' mapping)")
    try:
        values = {n: {metric: mean_of((r.get(mode) or {}).get(metric))} for n, r in methods.items()}
    except (TypeError, ValueError, AttributeError):  # a cell that is no number or {"mean": number}
        raise DataError(f"{results}: a method's {mode} {metric!r} is not a number or {{'mean': number}}: "
                        "the file is damaged (rerun the bench's final stage)") from None
    if not any(math.isfinite(v[metric]) for v in values.values()):
        raise DataError(f"{results} holds no finite {mode} {metric!r} value for any method: nothing to draw")
    baselines = list(baseline_methods(methods).values())
    written = figures.save_figure(figures.relative_improvement(values, baselines, metric=metric, mode=mode),
                                  _out(output, "improvement"))
    typer.echo("\n".join(map(str, written)))
