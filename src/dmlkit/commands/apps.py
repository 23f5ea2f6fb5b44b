"""``dmlkit verify | fewshot | oneshot``: use a trained embedding (index/query: ``search.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from dmlkit.commands._console import echo_json
from dmlkit.commands._options import given
from dmlkit.limits import MAX_EPISODES


def register(app: typer.Typer) -> None:
    app.command("verify")(verify)
    app.command("fewshot")(fewshot)
    app.command("oneshot")(oneshot)


#: Fractions in [0, 1] that tables show in percent (JSON keeps the fraction).
_PERCENT = {"accuracy", "accuracy_std", "accuracy_sem", "roc_auc", "eer", "ci95"}


def _print(data: dict, as_json: bool, title: str) -> None:
    """JSON (fractions as computed), or a table in the units of every dmlkit table: rates in
    percent, marked ``(%)``. The title and every cell are text, not rich markup (escaped): a
    file ``emb[red]HIDDEN[blink].npz`` was titled ``embHIDDEN.npz``, one with ``[/x]`` raised
    ``MarkupError``."""
    if as_json:
        echo_json(data)
        return
    from rich.markup import escape
    from rich.table import Table

    from dmlkit.commands._console import output_console

    table = Table(title=escape(title))
    table.add_column("measure")
    table.add_column("value", justify="right")

    def row(key: str, value: str) -> None:
        table.add_row(escape(key), escape(value))

    for key, value in data.items():
        if key in _PERCENT and isinstance(value, float):
            row(f"{key} (%)", f"{100 * value:.2f}")
        elif key.endswith("_percent") and isinstance(value, float):  # already percent (oneshot)
            row(f"{key.removesuffix('_percent')} (%)", f"{value:.2f}")
        elif key == "tar_at_far" and isinstance(value, dict):
            for far, tar in value.items():
                row(f"TAR at FAR {100 * float(far):g} % (%)", f"{100 * tar:.2f}")
        elif isinstance(value, float):
            row(key, f"{value:.4f}")
        elif isinstance(value, list | dict):
            shown = value if not isinstance(value, list) or len(value) < 8 else f"{len(value)} values"
            row(key, json.dumps(shown))
        else:
            row(key, str(value))
    output_console().print(table)


def verify(
    ctx: typer.Context,
    embeddings: Path | None = typer.Argument(None, help="Embeddings with labels (.npz/.pt); with --pair-list an .npz with a 'paths' array."),
    pairs: int = typer.Option(6000, help="Number of balanced random pairs, without --pair-list: an even number, half matched and half mismatched."),
    folds: int = typer.Option(10, help="Folds for choosing the threshold (LFW protocol); refused with a pair list that has its own folds."),
    pair_list: Path | None = typer.Option(None, "--pair-list", help="LFW pairs.txt or CSV path1,path2,same[,fold]."),
    images: Path | None = typer.Option(None, "--images", help="Image folder of the pair list (LFW: holds <Name>/<Name>_0001.jpg)."),
    checkpoint: Path | None = typer.Option(None, "--checkpoint", help="Run directory or checkpoint: embed the pair list's images with it."),
    distance: str = typer.Option("cosine", help="cosine; euclidean or dot of L2-normalised embeddings (as dmlkit evaluate, index and serve: cosine's ranking, another threshold scale); raw-euclidean or raw-dot of the embeddings as they are (the euclidean of fewshot and reid); snr. The --json result records it, with the threshold."),
    seed: int = typer.Option(0),
    device: str = typer.Option("cpu", help="Device for --checkpoint: cpu or cuda."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar while embedding."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON instead of a summary."),
) -> None:
    """Verification accuracy with k-fold thresholds, ROC AUC, EER and TAR@FAR.

    Balanced random pairs from the labels of EMBEDDINGS, or a fixed --pair-list (LFW pairs.txt: scored on its own folds) embedded with --checkpoint or found in the 'paths' of EMBEDDINGS.
    """
    from dmlkit.apps import verify as run_verify
    from dmlkit.apps.verification import check_pair_list_folds, embed_image_files, verify_pair_list
    from dmlkit.embeddings import load_embeddings
    from dmlkit.exceptions import ConfigError

    if (embeddings is None) == (checkpoint is None):
        raise ConfigError("pass either EMBEDDINGS (a file) or --checkpoint RUN_DIR (with --pair-list), not both or neither")
    _refuse_unused(ctx, pair_list is not None, checkpoint is not None)
    if pair_list is None:
        if checkpoint is not None:
            raise ConfigError("--checkpoint needs --pair-list: it embeds the images the list names")
        emb, labels, _ = load_embeddings(embeddings)
        result = run_verify(emb, labels, num_pairs=pairs, folds=folds, distance=distance, seed=seed).to_dict()
        title = f"Verification: {embeddings.name}"
    else:
        from dmlkit.data.pairs import load_pair_list

        plist = load_pair_list(pair_list, images)
        list_folds = folds if given(ctx, "folds") else None  # given with a list's own folds: refused
        check_pair_list_folds(plist, list_folds, "--folds")  # before the images are embedded
        if checkpoint is not None:
            emb = embed_image_files(checkpoint, plist.paths, device=device, progress=not quiet)
            paths = None
        else:
            from dmlkit.apps.index_files import check_embedded_files, run_item_files

            emb, paths, extra = _embeddings_with_paths(embeddings)
            paths = run_item_files(embeddings, paths, images)  # a run's paths: under its data root
            check_embedded_files(embeddings, paths, extra)  # which must hold the files it embedded
        result = verify_pair_list(emb, plist, paths, distance=distance, folds=list_folds).to_dict()
        title = f"Verification on {pair_list.name} ({result['fold_source']} folds)"
    for key in ("fold_accuracies", "fold_thresholds", "source"):  # source: the file's, below
        result.pop(key)
    if as_json:  # what the threshold was chosen on: `dmlkit serve --verification` compares it with its index
        from dmlkit.apps.index_sources import verification_source

        result["source"] = verification_source(embeddings, checkpoint)
    _print(result, as_json, title)


def _refuse_unused(ctx: typer.Context, with_list: bool, with_checkpoint: bool) -> None:
    """Refuse an option given on the command line that the chosen pair source does not use
    (it would be silently ignored): --pairs/--seed draw random pairs (no --pair-list),
    --images locates a --pair-list's files, --device embeds with --checkpoint."""
    from dmlkit.exceptions import ConfigError

    unused = [(opt, why) for name, opt, used, why in (
        ("pairs", "--pairs", not with_list, "a --pair-list scores its own pairs"),
        ("seed", "--seed", not with_list, "a --pair-list scores its own pairs"),
        ("images", "--images", with_list, "it locates the images of a --pair-list"),
        ("device", "--device", with_checkpoint, "it embeds a --pair-list's images with --checkpoint"),
    ) if given(ctx, name) and not used]
    if unused:
        opt, why = unused[0]
        raise ConfigError(f"{opt} does not apply here ({why}): drop it")


def _embeddings_with_paths(path: Path) -> tuple:
    """``(embeddings, paths, its arrays but the embeddings)`` of an ``.npz`` holding ``embeddings`` and
    ``paths`` (labels optional)."""
    import numpy as np

    from dmlkit.embedding_files import check_numpy_file
    from dmlkit.exceptions import DataError, DataNotFoundError

    if not path.is_file():
        raise DataNotFoundError(f"embeddings file not found: {path}")
    hint = ("embed the pair list with --checkpoint RUN_DIR, or write an .npz with "
            "save_embeddings(path, emb, labels, paths=...)")
    if path.suffix.lower() != ".npz":
        raise DataError(f"{path}: with --pair-list the embeddings must be an .npz with a 'paths' array; {hint}")
    check_numpy_file(path, ".npz", "embeddings")  # np.load takes a damaged file for a pickle
    try:
        with np.load(path, allow_pickle=False) as data:
            if "embeddings" not in data or "paths" not in data:
                raise DataError(f"{path} needs 'embeddings' and 'paths' arrays (has {sorted(data.files)}); {hint}")
            extra = {k: data[k] for k in data.files if k != "embeddings"}
            return data["embeddings"], [str(p) for p in data["paths"].tolist()], extra
    except (OSError, ValueError) as exc:
        raise DataError(f"cannot read embeddings from {path}: {exc}") from exc


def fewshot(
    embeddings: Path = typer.Argument(..., help="Embeddings with labels (.npz/.pt) of unseen classes."),
    way: int = typer.Option(5, help="Classes per episode (N-way, at least 2)."),
    shot: int = typer.Option(1, help="Support items per class (K-shot)."),
    queries: int = typer.Option(5, help="Query items per class."),
    episodes: int = typer.Option(1000, max=MAX_EPISODES, help=f"Random episodes averaged (at most {MAX_EPISODES:,})."),
    distance: str = typer.Option("euclidean", help="euclidean (squared, raw embeddings: prototypical networks) or cosine, in any case; other names are refused."),
    seed: int = typer.Option(0),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON instead of a summary."),
) -> None:
    """N-way K-shot accuracy of nearest-prototype classification over random episodes.

    Only classes with at least shot + queries items enter episodes: the result counts them
    (classes_used) and the others (classes_skipped), with a warning when any are skipped.
    """
    from dmlkit.apps import few_shot_accuracy
    from dmlkit.embeddings import load_embeddings

    emb, labels, _ = load_embeddings(embeddings)
    result = few_shot_accuracy(emb, labels, way, shot, queries, episodes, distance, seed)
    _print(result, as_json, f"{way}-way {shot}-shot: {embeddings.name}")


def oneshot(
    checkpoint: Path = typer.Argument(..., help="A run directory or checkpoint trained on Omniglot."),
    data_root: Path | None = typer.Option(None, "--data-root", help="Holds omniglot/one_shot_all_runs.zip (default: the run's data.root, else $DMLKIT_DATA or ~/.cache/dmlkit/data)."),
    distance: str = typer.Option("cosine", help="cosine or euclidean (as `dmlkit fewshot --distance`)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON instead of a summary."),
) -> None:
    """Error on the 20 official Omniglot 20-way one-shot runs (Lake et al. 2015).

    The runs are read from --data-root, else the run's recorded data.root, else $DMLKIT_DATA
    (as ``dmlkit embed`` finds a run's data)."""
    from dmlkit.apps import load_omniglot_one_shot_runs, omniglot_one_shot_error
    from dmlkit.apps.fewshot import model_image_embedder
    from dmlkit.training import load_checkpoint
    from dmlkit.training.data_root import run_data_root

    model, config = load_checkpoint(checkpoint)  # a bad checkpoint fails before the data load
    runs = load_omniglot_one_shot_runs(run_data_root(config.data.root, data_root))
    embedder = model_image_embedder(model, config)
    result = omniglot_one_shot_error(embedder, runs, distance)
    _print(result, as_json, "Omniglot 20-way one-shot runs")
