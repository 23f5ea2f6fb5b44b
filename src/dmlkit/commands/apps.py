"""``dmlkit index | query | verify | fewshot | oneshot``: use a trained embedding."""

from __future__ import annotations

import json
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("index")(index)
    app.command("query")(query)
    app.command("verify")(verify)
    app.command("fewshot")(fewshot)
    app.command("oneshot")(oneshot)


def _print(data: dict, as_json: bool, title: str) -> None:
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("measure")
    table.add_column("value", justify="right")
    for key, value in data.items():
        if isinstance(value, float):
            value = f"{value:.4f}"
        elif isinstance(value, (list, dict)):
            value = json.dumps(value if not isinstance(value, list) or len(value) < 8 else f"{len(value)} values")
        table.add_row(key, str(value))
    Console().print(table)


def index(
    embeddings: Path = typer.Argument(..., help="Reference embeddings (.npz from dmlkit embed, .npy, .pt)."),
    output: Path = typer.Option(..., "-o", "--output", help="Index file to write (.npz)."),
    distance: str = typer.Option("cosine", help="cosine, euclidean or dot."),
) -> None:
    """Build a searchable index from reference embeddings (labels and ids are kept)."""
    from dmlkit.apps import EmbeddingIndex
    from dmlkit.utils import load_embeddings

    emb, labels, extra = load_embeddings(embeddings)
    ids = extra.get("paths", extra.get("ids", extra.get("indices")))
    idx = EmbeddingIndex(emb, labels, ids, distance=distance)
    idx.save(output)
    typer.echo(f"indexed {len(idx)} embeddings of size {idx.dim} -> {output}")


def query(
    index_file: Path = typer.Argument(..., help="An index from `dmlkit index`."),
    queries: Path = typer.Argument(..., help="Query embeddings (.npz/.npy/.pt)."),
    k: int = typer.Option(5, "-k", help="Neighbours per query."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
) -> None:
    """The k nearest references of each query, with scores, labels and ids."""
    import numpy as np

    from dmlkit.apps import EmbeddingIndex
    from dmlkit.exceptions import DataError

    idx = EmbeddingIndex.load(index_file)
    if queries.suffix == ".npy":
        q = np.load(queries)
    else:
        from dmlkit.utils import load_embeddings

        try:
            q, _, _ = load_embeddings(queries)
        except DataError:  # queries need no labels
            with np.load(queries) as data:
                q = data["embeddings"]
    result = idx.search(q, k)
    records = result.to_records()
    if as_json:
        typer.echo(json.dumps(records, indent=2))
        return
    for qi, row in enumerate(records):
        shown = ", ".join(
            f"#{r['index']}" + (f" (label {r['label']})" if "label" in r else "") + f" {r['score']:.3f}" for r in row
        )
        typer.echo(f"query {qi}: {shown}")


def verify(
    embeddings: Path = typer.Argument(..., help="Embeddings with labels (.npz/.pt)."),
    pairs: int = typer.Option(6000, help="Number of balanced pairs (half positive)."),
    folds: int = typer.Option(10, help="Folds for choosing the threshold (LFW protocol)."),
    distance: str = typer.Option("cosine"),
    seed: int = typer.Option(0),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Verification accuracy with k-fold thresholds, ROC AUC, EER and TAR@FAR."""
    from dmlkit.apps import verify as run_verify
    from dmlkit.utils import load_embeddings

    emb, labels, _ = load_embeddings(embeddings)
    result = run_verify(emb, labels, num_pairs=pairs, folds=folds, distance=distance, seed=seed).to_dict()
    result.pop("fold_accuracies")
    _print(result, as_json, f"Verification: {embeddings.name}")


def fewshot(
    embeddings: Path = typer.Argument(..., help="Embeddings with labels (.npz/.pt) of unseen classes."),
    way: int = typer.Option(5, help="Classes per episode (N-way)."),
    shot: int = typer.Option(1, help="Support items per class (K-shot)."),
    queries: int = typer.Option(5, help="Query items per class."),
    episodes: int = typer.Option(1000),
    distance: str = typer.Option("euclidean", help="euclidean (prototypical networks) or cosine."),
    seed: int = typer.Option(0),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """N-way K-shot accuracy of nearest-prototype classification over random episodes."""
    from dmlkit.apps import few_shot_accuracy
    from dmlkit.utils import load_embeddings

    emb, labels, _ = load_embeddings(embeddings)
    result = few_shot_accuracy(emb, labels, way, shot, queries, episodes, distance, seed)
    _print(result, as_json, f"{way}-way {shot}-shot: {embeddings.name}")


def oneshot(
    checkpoint: Path = typer.Argument(..., help="A run directory or checkpoint trained on Omniglot."),
    data_root: Path | None = typer.Option(None, "--data-root", help="Holds omniglot/one_shot_all_runs.zip."),
    distance: str = typer.Option("cosine"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Error on the 20 official Omniglot 20-way one-shot runs (Lake et al. 2015)."""
    from dmlkit.apps import load_omniglot_one_shot_runs, omniglot_one_shot_error
    from dmlkit.apps.fewshot import checkpoint_image_embedder

    runs = load_omniglot_one_shot_runs(data_root)
    result = omniglot_one_shot_error(checkpoint_image_embedder(checkpoint), runs, distance)
    _print(result, as_json, "Omniglot 20-way one-shot runs")
