"""``dmlkit index | query | export | serve``: retrieval with a trained embedding, at scale."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from dmlkit.commands._console import echo_json

_KINDS = "flat (exact), ivf_flat, ivf_pq or hnsw"
#: Defaults of `dmlkit index`'s build settings (``index_faiss.SETTING_DEFAULTS``, and the recall
#: measurement's): whether one was given is read from the command line (:func:`given`), never
#: from its value, so an explicit ``--ef-search 64`` is refused where it does not apply.
_PQ_NBITS, _HNSW_M, _EF_CONSTRUCTION, _EF_SEARCH, _RECALL_K, _RECALL_QUERIES = 8, 32, 40, 64, 10, 1000
#: What ``--allow-other-source`` lets ``index --add`` and ``query`` take (refused by default).
_OTHER_SOURCE = ("another run (model) or dataset than the index's, or other vectors under its ids: "
                 "a deliberate merge (ids and vectors taken as they are)")
#: `dmlkit index`'s options that set how an index is built or its recall measured: parameter names.
_BUILD_OPTIONS = {"--nlist": "nlist", "--pq-m": "pq_m", "--nprobe": "nprobe", "--gpu": "gpu",
                  "--pq-nbits": "pq_nbits", "--hnsw-m": "hnsw_m", "--ef-construction": "ef_construction",
                  "--ef-search": "ef_search", "--seed": "seed", "--recall-k": "recall_k",
                  "--recall-queries": "recall_queries"}


def register(app: typer.Typer) -> None:
    app.command("index")(index)
    app.command("query")(query)
    app.command("export")(export)
    app.command("serve")(serve)


def _load_any_embeddings(path: Path):
    """``(embeddings, labels or None, extra)`` of an .npz/.npy/.pt file (labels optional): integer
    ids, or class-name strings, which :class:`~dmlkit.apps.EmbeddingIndex` encodes against the
    names it already holds (the same name keeps its code across files)."""
    import numpy as np

    from dmlkit.embedding_files import read_embedding_file
    from dmlkit.validation import check_labels

    emb, labels, extra = read_embedding_file(path, labels_required=False)
    if labels is not None:  # integer ids, or class names (the index codes them against its own)
        codes, names = check_labels(labels, len(emb), name=f"labels of {path}")
        labels = codes if names is None else np.asarray(names)[codes]
    return emb, labels, extra


def index(
    ctx: typer.Context,
    embeddings: Path | None = typer.Argument(None, help="Reference embeddings (.npz from `dmlkit train`/`embed`, .npy, .pt, or a shard directory from `dmlkit embed --format shards`, added block by block)."),
    output: Path = typer.Option(..., "-o", "--output", help="Index to write: a directory, or one file ending in .npz."),
    add: bool = typer.Option(False, "--add", help="Add EMBEDDINGS to the existing index OUTPUT (same kind and training)."),
    remove: list[str] | None = typer.Option(None, "--remove", help="Remove this item id from the index OUTPUT (repeatable)."),
    kind: str | None = typer.Option(None, help=f"Index kind: {_KINDS} (default flat; with --add/--remove, the index's own)."),
    distance: str | None = typer.Option(None, help="cosine, euclidean or dot (default cosine; with --add/--remove, the index's own)."),
    target_recall: float | None = typer.Option(None, "--target-recall", help="Tune nprobe/rerank/efSearch to the cheapest setting with recall@k >= this (e.g. 0.95)."),
    recall_k: int = typer.Option(_RECALL_K, "--recall-k", help="k of the measured recall@k."),
    recall_queries: int = typer.Option(_RECALL_QUERIES, "--recall-queries", help="Held-out queries of the recall measurement."),
    nlist: int | None = typer.Option(None, help="IVF cells (default 4 sqrt(N))."),
    pq_m: int | None = typer.Option(None, "--pq-m", help="PQ sub-quantisers (must divide the size; default size/4)."),
    pq_nbits: int = typer.Option(_PQ_NBITS, "--pq-nbits", help="Bits per PQ code."),
    hnsw_m: int = typer.Option(_HNSW_M, "--hnsw-m", help="HNSW neighbours per node."),
    ef_construction: int = typer.Option(_EF_CONSTRUCTION, "--ef-construction", help="HNSW build beam."),
    nprobe: int | None = typer.Option(None, help="IVF cells scanned per query (without --target-recall)."),
    ef_search: int = typer.Option(_EF_SEARCH, "--ef-search", help="HNSW search beam (without --target-recall)."),
    gpu: bool = typer.Option(False, "--gpu", help="Put IVF indexes on the GPU (faiss with GPU support)."),
    seed: int = typer.Option(0),
    data_root: Path | None = typer.Option(None, "--data-root", help="Resolve a run's dataset paths as ids."),
    allow_other_source: bool = typer.Option(False, "--allow-other-source", help=f"With --add: accept embeddings of {_OTHER_SOURCE}."),
    as_json: bool = typer.Option(False, "--json", help="Print the index summary as JSON."),
) -> None:
    """Build a searchable index; approximate kinds measure (and can tune) their recall@k.

    Items keep their labels and ids: the file's `paths`/`ids`, or, for a run's
    embeddings/<split>.npz, the dataset files' paths relative to the data root.
    """
    with _index_lock(output):  # from load (or build) to save: two at once lost one's changes
        _index(ctx, embeddings, output, add, remove, kind, distance, target_recall, recall_k, recall_queries,
               nlist, pq_m, pq_nbits, hnsw_m, ef_construction, nprobe, ef_search, gpu, seed, data_root,
               allow_other_source, as_json)


def _index_lock(output: Path):
    """The lock a build, ``--add`` or ``--remove`` of the index ``output`` holds (the file
    ``.<name>.lock`` beside it, :func:`~dmlkit.utils.directory_lock`: a directory index is replaced
    as a whole when saved): a second one meanwhile is refused, where it silently lost the first's
    items (both loaded the index, each saved its own change)."""
    from dmlkit.utils import directory_lock  # lazy: the CLI imports its modules on use

    return directory_lock(output.parent, f".{output.name}.lock",
                          f"another `dmlkit index` is writing {output}: wait for it to end, then run this "
                          "command again")


def _index(ctx: typer.Context, embeddings: Path | None, output: Path, add: bool, remove: list[str] | None,
           kind: str | None, distance: str | None, target_recall: float | None, recall_k: int,
           recall_queries: int, nlist: int | None, pq_m: int | None, pq_nbits: int, hnsw_m: int,
           ef_construction: int, nprobe: int | None, ef_search: int, gpu: bool, seed: int,
           data_root: Path | None, allow_other_source: bool, as_json: bool) -> None:
    """:func:`index` with the lock of ``output`` held."""
    from dmlkit.apps import EmbeddingIndex
    from dmlkit.apps.index import item_ids
    from dmlkit.commands._options import given
    from dmlkit.embedding_shards import is_shard_dir, open_shards
    from dmlkit.exceptions import ConfigError, DataError
    from dmlkit.utils import refuse_overwriting_inputs, sha256_file

    if allow_other_source and not add:
        raise ConfigError("--allow-other-source applies to --add (embeddings added to an existing index): drop it")
    for option, value, choices in (("--kind", kind, _KINDS), ("--distance", distance, "cosine, euclidean or dot")):
        if value is not None and not value.strip():  # '' silently meant the default (flat, cosine)
            raise ConfigError(f"{option} is empty: name one ({choices}), or leave {option} out for the default")
    # the build settings given on the command line (even at their default value: an explicit
    # --ef-search 64 for an IVF index was accepted and ignored): each applies to some kinds only
    structure = [option for option, param in _BUILD_OPTIONS.items() if given(ctx, param)]
    if remove or add:
        # build settings of the structure an existing index keeps: given with --add/--remove they
        # were silently ignored (--target-recall too, which now re-tunes the changed index; the
        # recall measurement's settings go with it)
        kept = [name for name in structure
                if not (target_recall is not None and name in ("--recall-k", "--recall-queries"))]
        if kept:
            raise ConfigError(f"{', '.join(kept)} {'set' if len(kept) > 1 else 'sets'} how an index is built or measured; {output} keeps its own "
                              "with --add/--remove: build a new index (or pass --target-recall R to re-tune this one)")
        idx = EmbeddingIndex.load(output)
        # an existing index keeps its kind and distance: a different one asked for is an error,
        # not silently ignored
        for option, asked, own in (("--kind", kind, idx.kind), ("--distance", distance, idx.distance)):
            if asked is not None and asked != own:
                raise ConfigError(f"{output} is a {own} index ({option} {own}); {option} {asked} needs a new "
                                  "index: build one without --add/--remove")
        if target_recall is not None and idx.kind == "flat":
            raise ConfigError(f"{output} is a flat (exact) index: --target-recall tunes an approximate kind")
        say = (lambda text: typer.echo(text, err=True)) if as_json else typer.echo  # --json: stdout is JSON only
        changed = {"removed": 0, "added": 0}
        if add and embeddings is None:
            raise ConfigError("--add needs EMBEDDINGS to add")
        if remove:
            changed["removed"] = idx.remove(remove)
        if add:
            refuse_overwriting_inputs(output, embeddings)
            if is_shard_dir(embeddings):  # streamed in blocks, ids and labels from the shards
                _refuse_other_dataset_ids(output, idx.info, embeddings, {"shards": True})
                shards = open_shards(embeddings)
                _refuse_other_source(output, idx, embeddings, {}, shards.ids, shards, allow_other_source, adding=True)
                changed["added"] = idx.add_blocks(shards)
            else:
                emb, labels, extra = _load_any_embeddings(embeddings)
                ids, facts = item_ids(embeddings, extra, data_root, labels)
                _refuse_other_dataset_ids(output, idx.info, embeddings, facts)
                _refuse_other_source(output, idx, embeddings, facts, ids, emb, allow_other_source, adding=True)
                meta = None if idx.metadata is None else [None] * len(emb)
                try:
                    idx.add(emb, labels, ids, meta)
                except DataError as exc:  # which file does not fit the index
                    raise DataError(f"{embeddings}: {exc}") from None
                changed["added"] = len(emb)
        if target_recall is not None:  # re-tuned on the index as it now is: the stored recall is fresh
            idx.tune(target_recall, k=recall_k, num_queries=recall_queries)
        idx.save(output)
        # said once saved: a refused --add (no file, another dimension) printed "removed 1 item(s)"
        # for a removal that was never saved
        if remove:
            say(f"removed {changed['removed']} item(s) from {output}")
        if add:
            say(f"added {changed['added']} item(s) to {output}")
        if as_json:
            echo_json({"output": str(output), **changed, **_summary(idx)})
            return
        if target_recall is not None:
            _echo_recall(f"{output}: {len(idx)} items", idx)
            return
        typer.echo(f"{output}: {len(idx)} items (the recall measured at build is marked stale: rebuild, or "
                   "pass --target-recall R, to re-measure)" if idx.recall else f"{output}: {len(idx)} items")
        return
    if embeddings is None:
        raise ConfigError("pass EMBEDDINGS to build an index (or --add/--remove to change OUTPUT)")
    kind, distance = kind or "flat", distance or "cosine"
    _refuse_settings_of_other_kinds(kind, structure, target_recall)
    refuse_overwriting_inputs(output, embeddings)
    shards = open_shards(embeddings) if is_shard_dir(embeddings) else None
    if shards is None:
        emb, labels, extra = _load_any_embeddings(embeddings)
        ids, info = item_ids(embeddings, extra, data_root, labels)
    else:  # an empty index of the same kind, filled block by block below
        emb = labels = ids = None
        info = {"shards": True}  # ids: dataset rows (_dataset_ids)
    info["source"] = str(embeddings)
    if shards is None:  # which file: `dmlkit serve --verification` knows a threshold chosen on it
        info["source_sha256"] = sha256_file(embeddings)
    idx = EmbeddingIndex(
        emb, labels, ids, dim=None if shards is None else shards.dim, distance=distance, kind=kind, nlist=nlist, pq_m=pq_m, pq_nbits=pq_nbits,
        hnsw_m=hnsw_m, ef_construction=ef_construction, nprobe=nprobe, ef_search=ef_search,
        target_recall=target_recall, recall_k=recall_k, recall_queries=recall_queries, gpu=gpu,
        seed=seed, info=info,
    )
    if shards is not None:
        idx.add_blocks(shards)
        if kind != "flat" and target_recall is not None:
            idx.tune(target_recall, k=recall_k, num_queries=recall_queries)
        elif kind != "flat":
            idx.measure_recall(k=recall_k, num_queries=recall_queries)
    idx.save(output)
    if as_json:
        echo_json({"output": str(output), **_summary(idx)})
        return
    _echo_recall(f"indexed {len(idx)} embeddings of size {idx.dim} ({kind}, {distance}) -> {output}", idx)


def _dataset_ids(facts: dict[str, Any]) -> str | None:
    """What the ids of a run's items are, from an index's ``info`` or :func:`item_ids`' facts:
    ``"paths"`` (files relative to the data root), ``"rows"`` (dataset row numbers: shards, or a
    run's .npz whose data was not found), ``None`` (not a run's items: the file's own ids)."""
    if "data_root" in facts:
        return "paths"
    return "rows" if facts.get("shards") or "run_dir" in facts else None


def _refuse_other_dataset_ids(output: Path, info: dict[str, Any], source: Path, facts: dict[str, Any]) -> None:
    """Refuse adding a run's items under the other kind of id than the index's (dataset rows to
    an index of file paths, or the other way): the same images were indexed twice under two ids,
    and every query found each of them twice."""
    from dmlkit.exceptions import DataError  # lazy: the CLI imports its modules on use

    have, new = _dataset_ids(info), _dataset_ids(facts)
    if have is not None and new is not None and have != new:
        names = {"paths": "file paths (from a run's .npz)", "rows": "dataset row numbers (from shards)"}
        raise DataError(f"{output} identifies a run's items by {names[have]} but {source} by {names[new]}: the same "
                        f"images would be indexed twice under two ids; add the same kind of file the index was built "
                        "from (a run's .npz, or shards)")


def _refuse_other_source(index_path: Path, idx: Any, source: Path, facts: dict[str, Any], ids: Any, vectors: Any,
                         allow: bool, *, adding: bool) -> None:
    """Refuse queries (``adding=False``) or new items (``adding=True``) of another source than
    the index's, unless ``allow`` (``--allow-other-source``): another run or dataset than
    its ``info`` records (:func:`dmlkit.apps.index_sources.source_differences`; the same ids
    and dimension passed, and another model's vectors were searched in the index's space, or
    another dataset's files matched its items by name), and ids the index holds whose vectors
    are not its own (:func:`dmlkit.apps.index_sources.check_shared_vectors`, ``serve``'s test)."""
    from dmlkit.apps.index_sources import check_shared_vectors, source_differences
    from dmlkit.exceptions import DataError

    if allow:
        return
    what = ("would be mixed into one index" if adding else
            "would be searched in the index's space (and their ids matched to its items by name)")
    fix = (f"{'add' if adding else 'query with'} embeddings of the index's run and data, or pass "
           "--allow-other-source if they belong together (a copy of the run, a deliberate merge)")
    differ = source_differences(idx.info, facts)
    if differ:
        raise DataError(f"{source} holds embeddings of {'; '.join(differ)} (the index {index_path}'s): another model's "
                        f"vectors, or another dataset's files, {what}; {fix}")
    check_shared_vectors(idx, ids, vectors, source, fix)


def _refuse_settings_of_other_kinds(kind: str, options: list[str], target_recall: float | None) -> None:
    """Refuse build ``options`` given on the command line (at any value, the default's
    included) that the ``kind`` does not use (``--kind hnsw --nprobe 16``, a flat index
    with ``--target-recall``, a fixed ``--nprobe``/``--ef-search`` that ``--target-recall``
    replaces): each was silently ignored. The settings of each kind are
    :data:`dmlkit.apps.index_faiss.KIND_SETTINGS` (the seed and the recall options: every
    approximate kind). Unknown kinds are left to the index's own error."""
    from dmlkit.apps.index_faiss import KIND_SETTINGS  # lazy: the CLI imports its modules on use
    from dmlkit.exceptions import ConfigError

    if kind not in KIND_SETTINGS:
        return
    uses = {"--" + name.replace("_", "-") for name in KIND_SETTINGS[kind]}
    uses |= {"--seed", "--recall-k", "--recall-queries"} if kind != "flat" else set()
    unused = [name for name in options if name not in uses]
    if kind == "flat" and target_recall is not None:
        unused.insert(0, "--target-recall")
    if unused:
        raise ConfigError(f"{', '.join(unused)} {'do' if len(unused) > 1 else 'does'} not apply to {kind} indexes"
                          + (" (exact search, recall 1.0)" if kind == "flat" else "")
                          + ": leave it out, or pick the --kind it belongs to")
    fixed = [name for name in ("--nprobe", "--ef-search") if name in options]
    if fixed and target_recall is not None:
        raise ConfigError(f"{fixed[0]} fixes the search setting that --target-recall tunes: give one of them")


def _summary(idx: Any) -> dict[str, Any]:
    """The index's :meth:`~dmlkit.apps.EmbeddingIndex.describe`, without the tuner's list of tries."""
    summary = idx.describe()
    if summary["recall"]:
        summary["recall"] = {k: v for k, v in summary["recall"].items() if k != "tried"}
    return summary


def _echo_recall(line: str, idx: Any) -> None:
    """``line`` with the index's measured recall, and a warning when its target was not reached."""
    rec = idx.recall
    if rec:
        held = "held-out" if rec.get("held_out") else "indexed (seen in training or in the graph: optimistic)"
        line += (f"; recall@{rec['k']} = {100 * rec['recall']:.2f} % on {rec['num_queries']} {held} queries "
                 f"with {rec['setting']}")
    typer.echo(line)
    if rec and rec.get("met") is False:
        typer.echo(f"warning: target recall {rec['target']} not reached; kept the most accurate setting "
                   "(use more nlist/ef or another kind)", err=True)


def _indexed_row_ids(idx: Any, q: Any) -> Any:
    """Row numbers as the ids of id-less queries that are the items of an index built without
    ids (which numbers its items from 0): only if every query row equals the stored vector of
    that number, bit for bit, so excluding "self" cannot drop another item."""
    import numpy as np

    from dmlkit.exceptions import DataError

    ids = np.arange(len(q)).astype(str)
    try:
        stored = idx.get(ids)
    except DataError:  # a row number the index does not hold
        return None
    return ids if np.array_equal(stored, np.asarray(q, dtype=np.float32)) else None


def query(
    index_path: Path = typer.Argument(..., help="An index from `dmlkit index` (directory or .npz)."),
    queries: Path | None = typer.Argument(None, help="Query embeddings (.npz/.npy/.pt or a shard directory, searched block by block); or use --id."),
    item_id: list[str] | None = typer.Option(None, "--id", help="Query by indexed item id (repeatable); the item itself is excluded."),
    k: int = typer.Option(10, "-k", help="Neighbours per query (10, as EmbeddingIndex.search and the service)."),
    exclude_self: bool = typer.Option(False, "--exclude-self", help="Drop each query's own item (same id) from its results."),
    exact: bool = typer.Option(False, "--exact", help="Exact search on an approximate index."),
    limit: int = typer.Option(20, "--limit", help="Queries shown in the table (0: all); --json and -o hold all."),
    output: Path | None = typer.Option(None, "-o", "--output", help="Write every result as JSON to this file."),
    data_root: Path | None = typer.Option(None, "--data-root", help="Resolve a run's dataset paths as query ids."),
    allow_other_source: bool = typer.Option(False, "--allow-other-source", help=f"Accept queries of {_OTHER_SOURCE}."),
    as_json: bool = typer.Option(False, "--json", help="Print every result as JSON."),
) -> None:
    """The k nearest references of each query, with scores, labels and ids."""
    import numpy as np

    from dmlkit.apps import EmbeddingIndex
    from dmlkit.apps.index import item_ids
    from dmlkit.embedding_shards import is_shard_dir, open_shards
    from dmlkit.exceptions import ConfigError, DataError
    from dmlkit.utils import atomic_write_json, refuse_overwriting_inputs

    if output is not None:
        refuse_overwriting_inputs(output, index_path, queries)
    if limit < 0:
        raise ConfigError(f"--limit must be 0 (all) or positive, got {limit}")
    if (queries is None) == (not item_id):
        raise ConfigError("pass QUERIES (an embeddings file) or --id ITEM, not both or neither")
    if allow_other_source and queries is None:
        raise ConfigError("--allow-other-source applies to QUERIES (an embeddings file); --id queries are the index's own items")
    idx = EmbeddingIndex.load(index_path, mmap=True)  # pages of the vectors load as searches touch them
    if queries is None:
        qids = np.asarray(item_id).astype(str)
        q = idx.get(qids)
        exclude_self = True
    elif is_shard_dir(queries):  # searched block by block below
        q = open_shards(queries)
        qids = q.ids.astype(str)
        _refuse_other_source(index_path, idx, queries, {}, qids, q, allow_other_source, adding=False)
    else:
        q, qlabels, extra = _load_any_embeddings(queries)
        if len(q) == 0:  # nothing to search is a mistake on the command line, not an empty answer
            raise DataError(f"{queries} holds no query embeddings (shape {tuple(q.shape)})")
        qids, facts = item_ids(queries, extra, data_root, qlabels)
        _refuse_other_source(index_path, idx, queries, facts, qids, q, allow_other_source, adding=False)
    if exclude_self and qids is None:
        qids = _indexed_row_ids(idx, q)
        if qids is None:
            raise DataError(f"--exclude-self needs ids for the queries: {queries} has no paths/ids/indices array "
                            "and its rows are not the index's first items (save it with save_embeddings(..., ids=...))")
    if exclude_self and queries is not None and not np.isin(np.asarray(qids).astype(str), idx.ids).any():
        raise DataError(f"--exclude-self matches queries to indexed items by id, but no id of {queries} "
                        f"(e.g. {str(qids[0])!r}) is in the index (e.g. {str(idx.ids[0])!r}): build both "
                        "from the same kind of file (a run's .npz, or shards), or leave --exclude-self out")
    records = []
    step = 65536 if queries is not None and is_shard_dir(queries) else max(1, len(q))
    for a0 in range(0, len(q), step):
        sl = slice(a0, a0 + step)
        records += idx.search(q[sl], k, exclude_ids=qids[sl] if exclude_self else None, exact=exact).to_records()
    # one shape for -o and --json: each query's id (its row number in a file without ids)
    payload = [{"query": str(qids[i] if qids is not None else i), "results": row} for i, row in enumerate(records)]
    if output is not None:
        atomic_write_json(output, payload, indent=1)
    if as_json:
        echo_json(payload)
        return
    shown = records if limit == 0 else records[:limit]
    for qi, row in enumerate(shown):
        name = f"query {qi}" + (f" ({qids[qi]})" if qids is not None else "")
        items = ", ".join(
            (r.get("id") or f"#{r['index']}") + (f" [label {r['label']}]" if "label" in r else "") + f" {r['score']:.3f}"
            for r in row
        )
        typer.echo(f"{name}: {items}")
    if len(records) > len(shown):
        hint = "--limit 0 shows all" + ("" if output is not None else "; --json or -o FILE writes every result")
        typer.echo(f"... {len(records) - len(shown)} more queries not shown ({hint})")
    if output is not None:
        typer.echo(f"wrote {len(records)} results to {output}")


def export(
    run_dir: Path = typer.Argument(..., help="A run directory (or checkpoint) from `dmlkit train`."),
    format: str = typer.Option("onnx", "--format", help="onnx or torchscript."),
    output: Path | None = typer.Option(None, "-o", "--output", help="File to write (default RUN_DIR/export/model.onnx|.pt)."),
    parity_samples: int = typer.Option(256, "--parity-samples", help="Real test images used for the parity check."),
    data_root: Path | None = typer.Option(None, "--data-root", help="Data root for the parity sample (overrides the run config's data.root)."),
    opset: int | None = typer.Option(None, help="ONNX opset, within the range torch's exporter supports (default: the one dmlkit.apps.export uses, which exports every dmlkit model); ONNX exports only."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON instead of a summary."),
) -> None:
    """Export the embedding model; check numerical and retrieval parity with PyTorch on real images."""
    from dmlkit.apps.export import export_model

    report = export_model(run_dir, format=format, output=output, parity_samples=parity_samples,
                          data_root=data_root, opset=opset)
    p = report["parity"]
    if as_json:  # the same exit code as the summary: a failed parity check is exit 1 here too
        echo_json(report)
        if not p["passed"]:
            typer.echo("warning: parity check failed (see the parity report)", err=True)
            raise typer.Exit(1)
        return
    typer.echo(f"exported {report['format']} -> {report['output']} (parity report: {report['parity_file']})")
    typer.echo(f"parity on {p['num_samples']} real {p['split']} images: max |diff| {p['max_abs_diff']:.2e}, "
               f"same top-10 for {100 * p['top10_identical']:.2f}% of queries (overlap {100 * p['top10_overlap']:.2f}%), "
               f"MAP@R {100 * p['map_at_r_torch']:.2f}% (torch) vs {100 * p['map_at_r_export']:.2f}% ({report['runtime']})")
    if not p["passed"]:
        typer.echo("warning: parity check failed (see the parity report)", err=True)
        raise typer.Exit(1)


def serve(
    index_path: Path = typer.Option(..., "--index", help="An index from `dmlkit index`."),
    model: Path | None = typer.Option(None, "--model", help="Run directory or exported model (.onnx/.pt) for image queries."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (default loopback only)."),
    port: int = typer.Option(8000, min=0, max=65535, help="Port to listen on (0: any free port)."),
    threshold: float | None = typer.Option(None, help="Verification threshold, on the index's own distance (cosine; euclidean/dot of normalised rows; raw-euclidean/raw-dot for an index built without normalisation): the `threshold` of `dmlkit verify --distance` of that name. --verification records its distance instead."),
    verification: Path | None = typer.Option(None, "--verification", help="JSON from `dmlkit verify --json` holding the threshold."),
    data_root: Path | None = typer.Option(None, "--data-root", help="Where the indexed files' thumbnails are read."),
    max_upload_mb: float = typer.Option(8.0, "--max-upload-mb", help="Largest request body accepted, in MiB (2^20 bytes: 8 = 8,388,608 bytes)."),
    max_k: int = typer.Option(100, "--max-k", help="Largest k a request may ask for."),
    image_workers: int | None = typer.Option(None, "--image-workers", min=1, help="Image queries decoded and embedded at once, off the event loop (default: the CPU count, at most 4)."),
    image_queue: int | None = typer.Option(None, "--image-queue", min=0, help="Image queries that may wait for a worker (default: 4 per worker); one more gets 503 with Retry-After."),
    allowed_host: list[str] | None = typer.Option(None, "--allowed-host", help="A Host header name the service answers (repeat for more; '*': any). Default: on a loopback address 127.0.0.1, localhost and [::1] only, against DNS rebinding (add the name a local reverse proxy forwards); elsewhere any."),
) -> None:
    """An HTTP search service with a web page: query by image, embedding or id; verify two images."""
    import math

    from dmlkit.apps.service import ServiceConfig, run_server
    from dmlkit.exceptions import ConfigError

    if not math.isfinite(max_upload_mb) or max_upload_mb * 2**20 < 1:  # int(nan) and int(inf) raised a traceback
        raise ConfigError(f"--max-upload-mb must be a positive number of MiB (2^20 bytes, at least one byte), got {max_upload_mb}")
    hosts = None
    if allowed_host:  # added to the loopback names (a proxy's name), or to nothing off loopback
        from dmlkit.apps.service.app import loopback_hosts

        hosts = (*loopback_hosts(host), *allowed_host)
    run_server(ServiceConfig(index=index_path, model=model, threshold=threshold, verification=verification,
                             data_root=data_root, max_upload_bytes=int(max_upload_mb * 2**20), max_k=max_k,
                             image_workers=image_workers, image_queue=image_queue, allowed_hosts=hosts),
               host=host, port=port)
