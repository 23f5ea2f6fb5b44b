"""``dmlkit reid SOURCE``: the re-id protocol (CMC, mAP, mINP; VehicleID; k-reciprocal re-ranking)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer

from dmlkit.commands._console import echo_json

_SHOWN = ("rank_1", "rank_5", "rank_10", "rank_20", "map", "minp")


def register(app: typer.Typer) -> None:
    app.command("reid")(reid)


def reid(
    ctx: typer.Context,
    source: Path = typer.Argument(..., help="A run directory (its test split is embedded or read from embeddings/test.npz), or an .npz of embeddings + labels (+ 'cams', and 'groups' = query/gallery unless --gallery is given)."),
    gallery: Path | None = typer.Option(None, "--gallery", "-g", help="Gallery embeddings (.npz with embeddings, labels, optional cams); SOURCE is then the query file."),
    data_root: Path | None = typer.Option(None, "--data-root", help="Data root for a run directory's dataset."),
    metric: str = typer.Option("euclidean", "--metric", "-d", help="euclidean (squared, torchreid's default) | cosine | dot."),
    normalize: bool = typer.Option(False, "--normalize", help="L2-normalise the embeddings first."),
    rerank: bool = typer.Option(False, "--rerank", help="Also evaluate k-reciprocal re-ranking (Zhong et al. 2017) and time it."),
    k1: int = typer.Option(20, "--k1", min=1, help="Re-ranking k1."),
    k2: int = typer.Option(6, "--k2", min=1, help="Re-ranking k2 (local query expansion)."),
    lambda_value: float = typer.Option(0.3, "--lambda", help="Re-ranking weight of the original distance."),
    ap_mode: str = typer.Option("standard", "--ap-mode", help="standard (torchreid / fast-reid) | trapezoid (official Market-1501 MATLAB code)."),
    no_camera_rule: bool = typer.Option(False, "--no-camera-rule", help="Keep same-id same-camera gallery items (they are junk by default)."),
    ranks: list[str] = typer.Option(["1,5,10,20"], "--ranks", help="CMC ranks shown, comma-separated or repeated."),
    repeats: int = typer.Option(10, "--repeats", min=1, help="VehicleID: gallery draws."),
    seed: int = typer.Option(0, "--seed", min=0, help="Seed of the VehicleID gallery draws and of the example queries."),
    device: str = typer.Option("auto", "--device", help="Device to embed with (a run without saved test embeddings)."),
    memory_mb: int = typer.Option(256, "--memory-mb", min=1, help="Working memory of the streamed evaluation, MiB."),
    examples: int = typer.Option(8, "--examples", min=0, help="Queries whose top-10 ranked gallery is stored in reid.json (report strip)."),
    out: Path | None = typer.Option(None, "--out", "-o", help="Write the results (full CMC, examples) as JSON here; default RUN_DIR/reid.json for a run."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Re-identification evaluation: Market-1501 protocol (CMC, mAP, mINP) or VehicleID.

    For a run directory the test split of its dataset is used: query/gallery groups and camera
    ids come from the dataset (market1501, dukemtmc_reid, msmt17, cuhk03, veri776,
    att_faces_reid; vehicleid runs the VehicleID protocol).
    """
    from dmlkit.commands._options import listed
    from dmlkit.exceptions import ConfigError

    if ap_mode not in ("standard", "trapezoid"):
        raise ConfigError(f"--ap-mode must be 'standard' or 'trapezoid', got {ap_mode!r}")
    from dmlkit.apps.reid._common import _check_metric  # lazy: CLI start-up

    _check_metric(metric, "--metric")  # now, not after reading or embedding the data
    try:
        shown_ranks = [int(v) for v in listed(ranks)]
    except ValueError:
        raise ConfigError(f"--ranks must be comma-separated integers, got {','.join(ranks)!r}") from None
    if not shown_ranks or min(shown_ranks) < 1:  # checked now, not after the evaluation
        raise ConfigError(f"--ranks must be ranks >= 1, got {','.join(ranks)!r}")
    _refuse_unused(ctx, rerank, vehicleid=None)  # --k1/--k2/--lambda without --rerank: now
    if source.is_file():  # an embeddings file: nothing to read from a dataset or to embed
        from dmlkit.commands._options import given

        for name, opt in (("data_root", "--data-root"), ("device", "--device")):
            if given(ctx, name):
                raise ConfigError(f"{opt} does not apply here (it reads and embeds a run directory's "
                                  f"test split; {source} is an embeddings file): drop it")
    if rerank:  # the re-ranked pass runs second: its settings must not fail after the first
        from dmlkit.apps.reid._common import (  # lazy: CLI start-up
            check_rerank_metric,
            check_rerank_value,
        )

        check_rerank_metric(metric)
        check_rerank_value("--lambda", "lambda_value", lambda_value)
    if out is not None and out.exists() and not out.is_file():  # before the evaluation, not after it
        raise ConfigError(f"--out {out} is a folder: name the JSON file to write (e.g. {out / 'reid.json'})")
    if out is not None:  # never over the embeddings it reads (a run's saved test embeddings included)
        from dmlkit.utils import refuse_overwriting_inputs  # lazy: CLI start-up

        read = source / "embeddings" / "test.npz" if source.is_dir() else source
        refuse_overwriting_inputs(out, read, gallery)
    data = _load_source(source, gallery, data_root, device)
    common: dict[str, Any] = dict(metric=metric, normalize=normalize,
                                  memory_budget=memory_mb * 2**20)
    result: dict[str, Any] = {"source": str(source), "metric": metric, "normalize": normalize}
    if data["protocol"] == "vehicleid":
        from dmlkit.apps.reid import vehicleid_protocol

        if rerank:
            raise ConfigError("--rerank is not available for the VehicleID protocol (groups all "
                              "'test'): drop it, or save query/gallery groups")
        _refuse_unused(ctx, rerank, vehicleid=True)
        res = vehicleid_protocol(data["emb"], data["ids"], repeats=repeats, seed=seed,
                                 ks=shown_ranks, ap_mode=ap_mode, **common)
        result.update(protocol="vehicleid", **res.to_dict())
        _finish(result, source, out, as_json, vehicleid=True)
        return
    from dmlkit.apps.reid import evaluate_reid, ranked_examples

    _refuse_unused(ctx, rerank, vehicleid=False, examples=examples)
    q, g = data["query"], data["gallery"]
    cams = (q["cams"], g["cams"])  # on one side only: refused (the camera rule needs both)
    result["camera_rule"] = not no_camera_rule and q["cams"] is not None and g["cams"] is not None
    kw: dict[str, Any] = dict(exclude_same_camera=not no_camera_rule, ap_mode=ap_mode,
                              junk_ids=_junk_codes(g), **common)
    t0 = time.perf_counter()
    res = evaluate_reid(q["emb"], g["emb"], q["ids"], g["ids"], *cams, **kw)
    result.update(protocol="market1501", seconds=time.perf_counter() - t0,
                  **res.to_dict(shown_ranks), cmc=res.cmc[:100].tolist())
    if not no_camera_rule and q["cams"] is None:  # after the refusals: a caveat on a result
        import warnings

        warnings.warn(f"{source}: no camera ids ('cams'), so the same-camera rule is off: gallery images of "
                      "the query's identity from its own camera count as positives (Market-1501 drops them); "
                      "save 'cams' to apply it, or pass --no-camera-rule to say it does not apply",
                      UserWarning, stacklevel=1)
    if rerank:
        t0 = time.perf_counter()
        rr = evaluate_reid(q["emb"], g["emb"], q["ids"], g["ids"], *cams,
                           rerank={"k1": k1, "k2": k2, "lambda_value": lambda_value}, **kw)
        result["rerank"] = {"k1": k1, "k2": k2, "lambda": lambda_value,
                            "seconds": time.perf_counter() - t0, **rr.to_dict(shown_ranks),
                            "cmc": rr.cmc[:100].tolist()}
    if examples:
        import numpy as np

        rng = np.random.default_rng(seed)
        valid = np.flatnonzero(res.valid)
        chosen = np.sort(rng.choice(valid, size=min(examples, valid.size), replace=False))
        ex = ranked_examples(q["emb"], g["emb"], q["ids"], g["ids"], *cams, queries=chosen,
                             metric=metric, normalize=normalize, exclude_same_camera=not no_camera_rule,
                             junk_ids=kw["junk_ids"])
        for e in ex:
            e["query_id"] = _identity(q, e["query"])
            e["gallery_ids"] = [_identity(g, j) for j in e["gallery"]]
            if q.get("paths") is not None and g.get("paths") is not None:
                e["query_path"] = str(q["paths"][e["query"]])
                e["gallery_paths"] = [str(g["paths"][j]) for j in e["gallery"]]
        result["examples"] = ex
    _finish(result, source, out, as_json)


def _refuse_unused(ctx: typer.Context, rerank: bool, vehicleid: bool | None, examples: int = 0) -> None:
    """Refuse an option given on the command line that the protocol does not use (it would be
    silently ignored): --k1/--k2/--lambda without --rerank; for VehicleID (``vehicleid``
    True) --no-camera-rule and --examples, for the Market-1501 protocol (False) --repeats, and
    --seed with ``examples`` 0 (it seeds only the example queries there);
    ``None``: the protocol is not known yet (the source is not read)."""
    from dmlkit.commands._options import given
    from dmlkit.exceptions import ConfigError

    vid = "the VehicleID protocol (groups all 'test')"
    checks = [(name, opt, "it sets k-reciprocal re-ranking: pass --rerank too")
              for name, opt in (("k1", "--k1"), ("k2", "--k2"), ("lambda_value", "--lambda")) if not rerank]
    if vehicleid:
        checks += [("no_camera_rule", "--no-camera-rule", f"{vid} has no cameras"),
                   ("examples", "--examples", f"{vid} stores no ranked examples")]
    elif vehicleid is not None:
        checks.append(("repeats", "--repeats", "it counts the gallery draws of the VehicleID protocol; "
                                               "this source has query/gallery groups"))
        if examples == 0:
            checks.append(("seed", "--seed", "it draws the example queries, and --examples 0 stores none; "
                                             "this source has no VehicleID gallery draws"))
    for name, opt, why in checks:
        if given(ctx, name):
            raise ConfigError(f"{opt} does not apply here ({why}): drop it")


def _finish(result: dict[str, Any], source: Path, out: Path | None, as_json: bool,
            vehicleid: bool = False) -> None:
    from dmlkit.utils import atomic_write_json

    if out is None and source.is_dir():
        out = source / "reid.json"
    if out is not None:
        atomic_write_json(out, result)
    if as_json:
        brief = {k: v for k, v in result.items() if k not in ("cmc", "examples")}
        if "rerank" in brief:
            brief["rerank"] = {k: v for k, v in brief["rerank"].items() if k != "cmc"}
        echo_json(brief)
        return
    from rich.table import Table

    from dmlkit.commands._console import output_console

    console = output_console()
    if vehicleid:
        table = Table(title=f"VehicleID: {result['num_identities']} identities, "
                            f"{result['repeats']} gallery draws")
        table.add_column("metric")
        table.add_column("mean (%)", justify="right")
        table.add_column("std (%)", justify="right")
        for key, val in result.items():
            if isinstance(val, dict) and "mean" in val:
                table.add_row(key, f"{100 * val['mean']:.2f}", f"{100 * val['std']:.2f}")
        console.print(table)
        return
    table = Table(title=f"re-id: {result['num_valid_queries']} valid queries "
                        f"({result['num_skipped_queries']} skipped), {result['num_gallery']} gallery")
    table.add_column("metric")
    table.add_column("value (%)", justify="right")
    rr = result.get("rerank")
    if rr:
        table.add_column("re-ranked (%)", justify="right")
    for key, val in result.items():
        if key.startswith("rank_") or key in ("map", "minp"):
            row = [key.replace("rank_", "Rank-").replace("minp", "mINP").replace("map", "mAP"),
                   f"{100 * val:.2f}"]
            if rr:
                row.append(f"{100 * rr[key]:.2f}")
            table.add_row(*row)
    console.print(table)
    line = f"evaluation {result['seconds']:.2f} s"
    if rr:
        line += f"; re-ranking (k1={rr['k1']}, k2={rr['k2']}, lambda={rr['lambda']}) {rr['seconds']:.2f} s"
    typer.echo(line)


def _npz(path: Path) -> dict[str, Any]:
    import numpy as np

    from dmlkit.embeddings import load_embeddings
    from dmlkit.exceptions import ShapeError

    emb, ids, extra = load_embeddings(path, codes=True)  # codes into extra["class_names"]
    cams = extra.get("cams", extra.get("camids"))
    found = {"cams": cams, "paths": extra.get("paths"), "groups": extra.get("groups")}
    for name, values in found.items():  # one per embedding row, or a wrong row would be selected
        if values is not None and np.ndim(values) != 1:
            raise ShapeError(f"{path}: '{name}' has shape {np.shape(values)}: give a 1-D array, "
                             "one value per embedding row")
        if values is not None and len(values) != len(emb):
            raise ShapeError(f"{path}: '{name}' has {len(values)} values for {len(emb)} embeddings: "
                             "give one per row")
    return {"emb": emb, "ids": ids, "names": extra.get("class_names"), **found}


def _junk_codes(d: dict[str, Any]) -> tuple[int, ...]:
    """The ids of junk images (Market-1501's ``-1``) as the source codes them: ``-1`` itself, or
    the code of the name ``"-1"`` where the file gave identity names (the rule compared codes
    0..C-1 with -1 and matched nothing: junk was scored as a wrong match)."""
    if d.get("names") is None:
        return (-1,)
    return tuple(int(code) for code, name in enumerate(d["names"]) if str(name).strip() == "-1")


def _identity(d: dict[str, Any], row: int) -> int | str:
    """The identity of a row as the file gave it: its name, or its integer id."""
    code = int(d["ids"][row])
    return code if d.get("names") is None else str(d["names"][code])


def _select(d: dict[str, Any], mask) -> dict[str, Any]:
    """The rows ``mask`` of a source's per-row arrays (its name table stays whole)."""
    rows = {k: (None if v is None else v[mask]) for k, v in d.items() if k not in ("groups", "names")}
    return {**rows, "names": d.get("names")}


def _one_code_table(query: dict[str, Any], gallery: dict[str, Any]) -> None:
    """Code the identities of two files with one table where they are names
    (:func:`dmlkit.validation.check_label_pair`): each file stores string labels as codes into
    its own sorted ``class_names``, so code 0 of the query file and code 0 of the gallery file
    can name different people (compared as codes, every match was scored as a miss)."""
    import numpy as np

    from dmlkit.validation import check_label_pair

    q_ids, g_ids = (d["ids"] if d["names"] is None else d["names"][d["ids"]] for d in (query, gallery))
    q_codes, g_codes, names = check_label_pair(q_ids, len(q_ids), g_ids, len(g_ids), ("query ids", "gallery ids"))
    query["ids"], gallery["ids"] = q_codes.numpy(), g_codes.numpy()
    query["names"] = gallery["names"] = None if names is None else np.asarray(names)


def _load_source(source: Path, gallery: Path | None, data_root: Path | None,
                 device: str) -> dict[str, Any]:
    import numpy as np

    from dmlkit.exceptions import DataError, DataNotFoundError

    if gallery is not None:
        query, gallery_set = _npz(source), _npz(gallery)
        _one_code_table(query, gallery_set)
        return {"protocol": "market1501", "query": query, "gallery": gallery_set}
    if source.is_dir():
        d = _embed_run(source, data_root, device)
    elif source.exists():
        d = _npz(source)
    else:
        raise DataNotFoundError(f"{source} is neither a run directory nor an embeddings file")
    groups = d.get("groups")
    if groups is None:
        raise DataError(f"{source}: no query/gallery groups; pass --gallery GALLERY.npz or save "
                        "a 'groups' array (query/gallery per row)")
    groups = np.asarray(groups).astype(str)
    if "query" in groups:
        return {"protocol": "market1501", "query": _select(d, groups == "query"),
                "gallery": _select(d, groups == "gallery")}
    if set(groups.tolist()) == {"test"}:
        return {"protocol": "vehicleid", "emb": d["emb"], "ids": d["ids"]}
    raise DataError(f"{source}: groups must be query/gallery (or all 'test' for VehicleID), got "
                    f"{sorted(set(groups.tolist()))}")


def _embed_run(run_dir: Path, data_root: Path | None, device: str) -> dict[str, Any]:
    """The run's test split: embeddings (saved ones when they match), ids, cams, groups."""
    import numpy as np

    from dmlkit.embeddings import dataset_items, load_embeddings, resolve_device
    from dmlkit.exceptions import DataError, DataNotFoundError
    from dmlkit.training import build_datasets, embed_split, load_checkpoint, load_config
    from dmlkit.training.data_root import run_data_root

    cfg_path = run_dir / "config.yaml"
    if not cfg_path.exists():
        raise DataNotFoundError(f"{run_dir} has no config.yaml: is it a run directory of dmlkit train?")
    config = load_config(cfg_path)
    test = build_datasets(config, ("test",), data_root=data_root)["test"]
    if test is None or test.sample_groups is None:
        raise DataError(f"the run's dataset {config.data.dataset!r} has no query/gallery groups: "
                        "use a re-id dataset (e.g. market1501, att_faces_reid)")
    items = dataset_items(test, run_data_root(config.data.root, data_root))
    saved = run_dir / "embeddings" / "test.npz"
    emb = None
    if saved.exists():  # reused only where it embedded these very files (rows, labels, paths)
        e, labels, extra = load_embeddings(saved)
        same = all(key in extra and np.array_equal(extra[key], items[key]) for key in items)
        if same and np.array_equal(labels, test.labels):
            emb = e
    if emb is None:
        target = resolve_device(device)  # cuda without a GPU: one line, not torch's traceback
        model, cfg = load_checkpoint(run_dir, device=target)
        emb, _ = embed_split(model, test, cfg, device=target)
    cams = getattr(test, "cams", None)
    return {"emb": np.asarray(emb), "ids": test.labels, "cams": cams, "groups": test.sample_groups,
            "paths": None if test.paths is None else np.asarray(test.paths)}
