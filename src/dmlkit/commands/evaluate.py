"""``dmlkit evaluate EMB [--reference REF] ...``: retrieval, clustering and histogram metrics."""

from __future__ import annotations

import contextlib
import hashlib
import warnings
from pathlib import Path
from typing import Any

import typer

from dmlkit.commands._console import echo_json

_COUNTS = ("num_queries", "num_queries_without_positive")
#: ``--k``'s default (given, even at this value, it needs recall_at_k or precision_at_k among the metrics).
_DEFAULT_K = ["1,2,4,8"]


def register(app: typer.Typer) -> None:
    @app.command("evaluate")
    def evaluate_command(
        ctx: typer.Context,
        embeddings: Path = typer.Argument(..., help="Query embeddings: .npz / .pt (embeddings + labels), .npy, or a shard directory (`dmlkit embed --format shards`; streamed, retrieval metrics only)."),
        reference: Path | None = typer.Option(None, "--reference", "-r", help="Separate reference set (same formats); default: the query set, each query excluded from its own neighbours."),
        labels: Path | None = typer.Option(None, "--labels", help="Labels of a .npy query file (.npy / .txt / .csv, one per row): integer class ids or class-name strings."),
        reference_labels: Path | None = typer.Option(None, "--reference-labels", help="Labels of a .npy reference file."),
        metrics: list[str] = typer.Option(["precision_at_1,recall_at_k,r_precision,map_at_r"], "--metrics", "-m", help="Comma-separated or repeated: precision_at_1, recall_at_k, precision_at_k, r_precision, map_at_r, map, nmi, ami, pair_f1, pos_neg_js (or recall_at_<K>)."),
        k: list[str] = typer.Option(_DEFAULT_K, "--k", help="K values of recall_at_k / precision_at_k, comma-separated or repeated."),
        distance: str = typer.Option("cosine", "--distance", "-d", help="cosine | dot | euclidean | snr."),
        backend: str = typer.Option("auto", "--backend", help="kNN backend: auto | torch | numba | faiss."),
        memory_mb: int = typer.Option(256, "--memory-mb", "--memory-budget", min=1, help="Working-memory budget of the blockwise kNN (and of the blocks read from a shard directory), MiB."),
        restarts: int = typer.Option(3, "--restarts", min=1, help="k-means restarts averaged by nmi / ami / pair_f1."),
        seed: int = typer.Option(0, "--seed", help="First k-means seed."),
        device: str = typer.Option("cpu", "--device", help="cpu | cuda | auto: where the retrieval metrics run (a GPU gives the CPU's numbers; k-means runs on the CPU)."),
        per_class_out: Path | None = typer.Option(None, "--per-class", help="Also write the requested retrieval metrics per class to this JSON file (clustering metrics and pos_neg_js have no per-class value)."),
        shared_items: str | None = typer.Option(None, "--shared-items", help="Query items also in --reference (the same file in both files' 'paths'), refused by default: drop (leave them out of the reference set) or keep (count them, each can find its own image)."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    ) -> None:
        """Evaluate embeddings: P@1, Recall@K, R-Precision, MAP@R, NMI/AMI/F1, pos/neg JS divergence.

        Under torchrun (CPU ranks) each rank scores its share of the queries; rank 0 prints."""
        from dmlkit.commands._options import given, listed
        from dmlkit.commands._ranks import is_main_rank, one_error_line_per_job
        from dmlkit.exceptions import ConfigError
        from dmlkit.metrics import per_class
        from dmlkit.metrics.clustering import CLUSTERING_METRICS
        from dmlkit.utils import atomic_write_json, refuse_overwriting_inputs

        if not is_main_rank():  # under torchrun rank 0 warns for the job (each rank read the files)
            warnings.filterwarnings("ignore")
        metrics = listed(metrics)
        try:
            k_values = [int(v) for v in listed(k)]
        except ValueError:
            raise ConfigError(f"--k must be comma-separated integers, got {','.join(k)!r}") from None
        if not k_values:
            raise ConfigError(f"--k must list at least one integer, got {','.join(k)!r}")
        if given(ctx, "k") and not {m.strip().lower() for m in metrics} & {"recall_at_k", "precision_at_k"}:
            raise ConfigError("--k sets the K values of recall_at_k / precision_at_k, and -m asks for "
                              f"neither ({', '.join(metrics)}): add one, or leave --k out")
        for option in ("restarts", "seed"):  # as --k: given without a clustering metric, silently unused
            if given(ctx, option) and not {m.lower() for m in metrics} & set(CLUSTERING_METRICS):
                raise ConfigError(f"--{option} sets the k-means runs of {' / '.join(CLUSTERING_METRICS)}, and -m "
                                  f"asks for none of them ({', '.join(metrics)}): add one, or leave --{option} out")
        if per_class_out is not None:  # never over the data it reads
            refuse_overwriting_inputs(per_class_out, embeddings, reference, labels, reference_labels)
        with one_error_line_per_job():
            q, ql, r, rl, result = _compute(
                embeddings, reference, labels, reference_labels, metrics, k_values,
                per_class_out=per_class_out, device=device, restarts=restarts, seed=seed,
                progress=not as_json, shared_items=shared_items, distance=distance, backend=backend,
                memory_budget=memory_mb * 2**20)
        if not is_main_rank():
            return
        kwargs = dict(distance=distance, k_values=k_values, backend=backend,
                      memory_budget=memory_mb * 2**20)
        if per_class_out is not None:
            names = [m for m in result if m not in _COUNTS and not m.endswith("_std") and m not in
                     ("nmi", "ami", "pair_f1", "pos_neg_js")]
            table = per_class(q, ql, r, rl, names, **kwargs)  # the retrieval metrics asked for
            atomic_write_json(per_class_out, {str(c): v for c, v in table.items()})
        if as_json:
            echo_json(result)
            return
        from rich.markup import escape
        from rich.table import Table

        from dmlkit.commands._console import output_console

        # file names are text, not rich markup: "emb[red]X[blink].npz" was titled "embX.npz"
        title = f"{embeddings.name}" + (f" vs {reference.name}" if reference else " (leave-one-out)")
        out = Table(title=escape(title))
        out.add_column("metric")
        out.add_column("value (%)", justify="right")
        for name, value in result.items():
            if name in _COUNTS or name.endswith("_std"):
                continue
            spread = result.get(f"{name}_std")
            shown = f"{100 * value:.2f}" + ("" if spread is None else f" ± {100 * spread:.2f}")
            out.add_row(escape(name), shown)
        output_console().print(out)
        if any(name.endswith("_std") for name in result):
            typer.echo(f"clustering metrics: mean ± standard deviation over {restarts} k-means run(s)")
        typer.echo(
            f"{result['num_queries']} queries, {result['num_queries_without_positive']} without a "
            "same-class reference (left out of the retrieval means)"
        )


def _compute(embeddings: Path, reference: Path | None, labels: Path | None,
             reference_labels: Path | None, metrics: list[str], k_values: list[int], *,
             per_class_out: Path | None, device: str, restarts: int, seed: int, progress: bool,
             shared_items: str | None = None, **kwargs: Any) -> tuple[Any, Any, Any, Any, dict[str, Any]]:
    """``(query, query labels, reference, reference labels, metrics)`` of ``dmlkit evaluate``.

    One process: in memory (:func:`dmlkit.metrics.evaluate`), or streamed from a shard
    directory. Under torchrun: the ranks join a gloo group, each reads the files (one error line
    if a rank cannot), the ranks compare their options and inputs (:func:`_check_same_job`),
    the retrieval metrics are split by query
    (:func:`dmlkit.metrics.evaluate_streaming` with ``across_ranks=True``) and the others run on rank 0
    (:func:`dmlkit.distributed.on_main`); every rank gets the same numbers as one process.
    """
    from dmlkit.distributed import agree, launched_by_torchrun, on_main
    from dmlkit.embedding_files import read_embedding_file, read_labels_file, without_shared_items
    from dmlkit.embedding_shards import is_shard_dir, open_shards
    from dmlkit.exceptions import ConfigError
    from dmlkit.metrics import evaluate
    from dmlkit.metrics.clustering import CLUSTERING_METRICS
    from dmlkit.metrics.evaluate import expand_metric_names
    from dmlkit.metrics.streaming import evaluate_streaming, is_streamable, streamable_names

    streamed = is_shard_dir(embeddings) or (reference is not None and is_shard_dir(reference))
    across = launched_by_torchrun()

    def checked_names() -> list[str]:
        if reference is None and reference_labels is not None:
            raise ConfigError("--reference-labels needs --reference")
        if across and device != "cpu":
            raise ConfigError("--device: under torchrun each rank evaluates its share of the queries "
                              "on the CPU; for a GPU run one process with --device cuda")
        if across and per_class_out is not None:
            raise ConfigError("--per-class: run one process (per-class tables are not split across "
                              "torchrun ranks)")
        if per_class_out is not None and not any(
                n not in (*CLUSTERING_METRICS, "pos_neg_js") for n in expand_metric_names(metrics, k_values)):
            raise ConfigError(f"--per-class: {','.join(metrics)} score the whole set, not each class; "
                              "request a retrieval metric too (e.g. -m nmi,map_at_r: the per-class "
                              "file holds the retrieval metrics requested)")
        if streamed and per_class_out is not None:
            raise ConfigError("--per-class needs in-memory embeddings: save an .npz (dmlkit embed) "
                              "or leave --per-class out for a shard directory")
        if shared_items is not None and (reference is None or shared_items not in ("drop", "keep")):
            raise ConfigError(f"--shared-items {shared_items}: " + ("choose drop or keep" if reference is not None else
                              "it says what to do with query items also in --reference, and there is none"))
        return streamable_names(metrics, k_values) if streamed else expand_metric_names(metrics, k_values)

    def read(path: Path, labels_path: Path | None) -> tuple[Any, Any, dict[str, Any]]:
        """``(embeddings, labels, the file's other arrays)`` of one file (a shard directory: none)."""
        if not is_shard_dir(path):
            return read_embedding_file(path, labels_path)
        shards = open_shards(path)
        if labels_path is None:
            return shards, shards.labels, {}
        warnings.warn(f"{labels_path} replaces the {shards.count} labels stored in {path}", stacklevel=2)  # as for an .npz
        return shards, read_labels_file(labels_path), {}

    def read_all() -> tuple[Any, Any, Any, Any]:
        q, ql, q_extra = read(embeddings, labels)
        if reference is None:
            return q, ql, None, None
        r, rl, r_extra = read(reference, reference_labels)
        r, rl = without_shared_items(ql, q_extra, r, rl, r_extra, shared_items,
                                     reference_name=f"the reference set {reference}", spell="--shared-items {}")
        return q, ql, r, rl

    if across:
        import torch

        from dmlkit.training.trainer import join_process_group

        join_process_group(torch.device("cpu"))  # then every check is agreed: one line a job
        names = agree(checked_names)
        q, ql, r, rl = agree(read_all)
        _check_same_job({"-m": ",".join(names), "--k": ",".join(map(str, k_values)),
                         "--distance": kwargs["distance"], "--backend": kwargs["backend"],
                         "--memory-mb": str(kwargs["memory_budget"] // 2**20), "--restarts": str(restarts),
                         "--seed": str(seed)}, q, ql, r, rl)
        by_query = [n for n in names if is_streamable(n)]
        rest = [n for n in names if not is_streamable(n)]
        parts: dict[str, Any] = {}
        with _each_warning_once():  # both parts check the same inputs: rank 0 says each thing once
            if rest:
                parts.update(on_main(evaluate, q, ql, r, rl, metrics=rest, cluster_restarts=restarts,
                                     seed=seed, **kwargs))
            if by_query:
                parts.update(evaluate_streaming(q, ql, r, rl, metrics=by_query, progress=progress,
                                                across_ranks=True, **kwargs))
        order = [*names, "num_queries", "num_queries_without_positive"]
        return q, ql, r, rl, {n: parts[n] for n in [*order, *(m for m in parts if m not in order)]}
    names = checked_names()
    q, ql, r, rl = read_all()
    if device != "cpu":  # (imported only then: a small CPU job loads no more than it needs)
        import torch

        from dmlkit.embeddings import resolve_device

        dev = resolve_device(device)
        if dev.type != "cpu":
            if streamed:
                raise ConfigError("--device: a shard directory is streamed through the CPU; evaluate an "
                                  ".npz (dmlkit embed) on the GPU, or leave --device out")
            q = torch.as_tensor(q).to(dev)
            r = None if r is None else torch.as_tensor(r).to(dev)
    if streamed:
        return q, ql, r, rl, evaluate_streaming(q, ql, r, rl, metrics=names, progress=progress, **kwargs)
    return q, ql, r, rl, evaluate(q, ql, r, rl, metrics=names, cluster_restarts=restarts, seed=seed,
                                  **kwargs)


#: The rows of ``_check_same_job`` that name inputs (the others are options).
_INPUTS = ("query embeddings", "query labels", "reference embeddings", "reference labels")


def _check_same_job(options: dict[str, str], q: Any, ql: Any, r: Any, rl: Any) -> None:
    """Refuse ranks that were given different options or read different inputs (one collective).

    Each rank scores its share of the queries against its own copy of the references: ranks
    with another ``-d``, another ``-m`` (then a 10-minute hang) or another copy of a file mixed
    them into one confident result. ``options`` are the values that change the numbers; the
    inputs are compared by shape, dtype and content (:func:`_content`). One line on every rank,
    printed by rank 0, naming what differs and what each rank holds."""
    from dmlkit.distributed import mark_every_rank  # lazy: torch, only under torchrun
    from dmlkit.exceptions import ConfigError, DataError
    from dmlkit.training.same_inputs import differences_across_ranks

    inputs = dict(zip(_INPUTS, (_content(q), _content(ql), _content(r), _content(rl))))
    differing = differences_across_ranks({**options, **inputs})
    if not differing:
        return
    kind = DataError if set(differing) & set(_INPUTS) else ConfigError
    raise mark_every_rank(kind(
        f"the ranks were given different options or inputs ({'; '.join(f'{k}: {v}' for k, v in differing.items())}): "
        "start every rank with the same options and an identical copy of each file (its path may "
        "differ between machines)"))


def _content(x: Any) -> str:
    """``601 x 16 float32 (sha256 4a24af9dbfcd0e11)``: an input's shape, dtype and content digest,
    equal for identical copies wherever they lie; ``none`` for ``None``.

    An array read into memory is hashed as it is (about as long as reading its ``.npz`` from the
    page cache: 0.23 s vs 0.19 s for 195 MiB; the evaluation is quadratic); a shard directory,
    streamed and possibly larger than memory, by the SHA-256 of each shard's embeddings file that
    its manifest records (``dmlkit embed --format shards`` writes them), so nothing is read
    twice; a file the manifest has no digest of is hashed."""
    if x is None:
        return "none"
    manifest = getattr(x, "manifest", None)
    if manifest is not None:  # a shard directory (dmlkit.embedding_shards.ShardedEmbeddings)
        from dmlkit.utils import sha256_file  # lazy: numpy-free start-up of the command line

        h = hashlib.sha256()
        for shard in manifest["shards"]:
            name = shard["embeddings"]
            h.update((shard.get("sha256", {}).get(name) or sha256_file(x.directory / name)).encode())
        shape, dtype = x.shape, x.storage_dtype
    else:
        import numpy as np  # lazy: only under torchrun (the command line starts without numpy)

        a = np.ascontiguousarray(x)
        h = hashlib.sha256(a.dtype.str.encode() + repr(a.shape).encode())
        h.update(repr(a.tolist()).encode() if a.dtype.hasobject else a.reshape(-1).view(np.uint8))
        shape, dtype = a.shape, a.dtype
    return f"{' x '.join(map(str, shape))} {dtype} (sha256 {h.hexdigest()[:16]})"


def _each_warning_once() -> contextlib.AbstractContextManager[None]:
    """Give each warning of the block (by category and text) once, when the block ends: under
    torchrun rank 0 runs the full-ranking metrics and its share of the streamed ones, and both
    check the same inputs (rank 0 printed "... also appear, identical, in the reference set"
    twice; one process prints it once)."""
    from dmlkit.utils import holding_warnings  # lazy: numpy-free start-up of the command line

    def first_of_each(held: list[warnings.WarningMessage], failed: bool) -> list[warnings.WarningMessage]:
        seen: set[tuple[type, str]] = set()
        kept = []
        for w in held:
            if (w.category, str(w.message)) not in seen:
                seen.add((w.category, str(w.message)))
                kept.append(w)
        return kept

    return holding_warnings(first_of_each)
