"""The results table in the Reality Check's layout, with 95 % confidence intervals.

Rows are methods (``pretrained`` first), columns are ``{concatenated, separated} x {P@1, RP,
MAP@R}`` (plus any extra metrics), each cell ``mean +- half-width`` in percent, the half-width
being the Student-t 95 % interval over the repeats (:func:`dmlkit.protocol.stats.mean_ci`;
``n/a`` with a single repeat). The best mean of each column (the pretrained row excluded; every
method tied at the shown precision, :func:`best_cells`) is in bold, as in the paper's tables. Written as ``results.json`` (everything, traceable),
``results.csv`` (one row per method x mode x metric) and ``results.md``.
"""

from __future__ import annotations

import copy
import csv
import hashlib
import io
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dmlkit.embeddings import load_embeddings
from dmlkit.exceptions import DataError, DataNotFoundError
from dmlkit.protocol.stats import mean_ci
from dmlkit.protocol.study import _redact
from dmlkit.provenance import provenance
from dmlkit.utils import atomic_write_json, atomic_write_text
from dmlkit.validation import check_embeddings

__all__ = [
    "METRIC_LABELS",
    "MODES",
    "best_cells",
    "build_results",
    "cell_of",
    "embeddings_digest",
    "load_listed_embeddings",
    "failure_notes",
    "is_ranked",
    "format_cell",
    "load_results",
    "markdown_text",
    "missing_methods",
    "missing_note",
    "ordered_methods",
    "resolved_runs",
    "render_csv",
    "render_markdown",
    "rich_table",
    "row_label",
    "write_results",
]

MODES: tuple[str, ...] = ("concatenated", "separated")
METRIC_LABELS: dict[str, str] = {
    "precision_at_1": "P@1", "r_precision": "RP", "map_at_r": "MAP@R", "map": "mAP",
    "nmi": "NMI", "ami": "AMI", "pair_f1": "F1", "pos_neg_js": "JS",
}
FORMAT = "dmlkit.bench_results/1"


def embeddings_digest(embeddings: Any, labels: Any) -> str:
    """SHA-256 of a run's test embeddings (float32) and labels (int64), with their shapes.

    ``results.json`` records it per run (``embeddings_sha256``) so that a reader can tell the
    file the table was computed on from one rewritten since: a final run trained again with a
    new best (a grown search) by a final stage that was then interrupted left the old table
    pointing at a mix of old and new fold models, which ``dmlkit compare`` read silently."""
    emb = np.ascontiguousarray(embeddings, dtype=np.float32)
    lab = np.ascontiguousarray(labels).astype(np.int64, copy=False)
    h = hashlib.sha256(f"{emb.shape}{lab.shape}".encode())
    h.update(emb.tobytes())
    h.update(lab.tobytes())
    return h.hexdigest()


def load_listed_embeddings(run: Mapping[str, Any], owner: str) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """``load_embeddings`` of a run ``results.json`` lists (``run["embeddings"]``), refused
    (:class:`DataError`) when it holds NaN or infinity (naming the file, not "query embeddings")
    or its :func:`embeddings_digest` is not the recorded ``embeddings_sha256``: it is not the
    file the table was computed on. ``owner`` names the method or results file in the message."""
    path = Path(run["embeddings"])
    if run.get(_STORED_FROM_CWD) and not path.exists():
        raise DataNotFoundError(
            f"embeddings file not found: {path} ({owner}): its results.json was written by an older "
            "dmlkit, with run paths relative to the folder `dmlkit bench` ran in; run this from "
            "that folder, or rewrite it with `dmlkit bench CONFIG --stage final`")
    emb, lab, extra = load_embeddings(path)
    check_embeddings(emb, f"embeddings in {path}")
    recorded = run.get("embeddings_sha256")
    if recorded and embeddings_digest(emb, lab) != recorded:
        raise DataError(
            f"{path} ({owner}) is not the file the results table was computed on: it was "
            "rewritten since (a later final stage trained this run again, or the file was "
            "replaced); rerun `dmlkit bench CONFIG --stage final` to rewrite results.json")
    return emb, lab, extra


#: Markdown's active characters written literally: the backslash (an escape of its own), ``|``
#: (a table's cell border), the backtick, ``*``, ``[`` and ``]`` (code, emphasis, links, images)
#: as backslash escapes (CommonMark 0.31, 2.4: any ASCII punctuation may be escaped); ``&``,
#: ``<`` and ``>`` as entities (raw HTML passes through CommonMark 4.6 and GFM otherwise).
_MARKDOWN_ESCAPES = str.maketrans({"\\": "\\\\", "|": "\\|", "`": "\\`", "*": "\\*", "[": "\\[",
                                   "]": "\\]", "&": "&amp;", "<": "&lt;", ">": "&gt;"})


def markdown_text(text: object) -> str:
    """``text`` as one line of literal Markdown text, safe in a table cell: line breaks (every
    separator :meth:`str.splitlines` knows) become spaces, and ``\\ | ` * [ ] & < >`` are escaped
    (:data:`_MARKDOWN_ESCAPES`). A method name read from a hand-edited ``results.json``
    (``<script>...</script>|=cmd``) once went into ``compare -o x.md`` raw: HTML in the page
    and a row with more cells than the header. ``results.md`` (:func:`render_markdown`) writes
    every text from the results through it too."""
    return " ".join(str(text).splitlines()).translate(_MARKDOWN_ESCAPES)


def metric_label(metric: str) -> str:
    if metric in METRIC_LABELS:
        return METRIC_LABELS[metric]
    if metric.startswith("recall_at_"):
        return "R@" + metric[len("recall_at_"):]
    if metric.startswith("precision_at_"):
        return "P@" + metric[len("precision_at_"):]
    return metric


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """Mean, 95 % half-width, values and count; no mean (``n/a``) without a value (every
    seed of the method had a diverged final run)."""
    if len(values) == 0:
        return {"mean": None, "ci95": None, "values": [], "n": 0}
    mean, ci = mean_ci(values)
    return {"mean": mean, "ci95": ci, "values": [float(v) for v in values], "n": len(values)}


def cell_of(row: Mapping[str, Any], mode: str, metric: str) -> Mapping[str, Any] | None:
    """A method's cell of ``mode`` x ``metric``, or ``None`` where its row has none (a metric the
    table lists that this method was not scored on)."""
    cells = row.get(mode)
    cell = cells.get(metric) if isinstance(cells, Mapping) else None
    return cell if isinstance(cell, Mapping) else None


def format_cell(cell: Mapping[str, Any] | None, scale: float = 100.0, digits: int = 2) -> str:
    """``"68.13 ± 0.31"`` (``"51.05 ± n/a"`` with one repeat; ``"n/a"`` without a cell or a
    mean: a NaN mean is stored as null)."""
    if cell is None or cell.get("mean") is None or math.isnan(cell["mean"]):
        return "n/a"
    mean = cell["mean"] * scale
    ci = cell.get("ci95")
    return f"{mean:.{digits}f} ± " + ("n/a" if ci is None else f"{ci * scale:.{digits}f}")


def _embedding_size(entries: Mapping[str, Mapping[str, Any]], config) -> int:
    """The fold models' embedding size as their saved embeddings have it: the model owns it (an
    ``identity`` head gives the trunk's width, not ``model.embedding_size``)."""
    for entry in entries.values():  # (None for a method whose every seed diverged)
        size = entry["evaluation"].get("embedding_size")
        if size:
            return int(size)
    return int(config.fixed.model.embedding_size)


#: The paths of a run entry: relative to the bench directory (results.json's folder) when inside it.
_RUN_PATHS = ("run_dir", "checkpoint", "embeddings")


def _in_bench(path: str | Path, bench_dir: Path) -> str:
    """``path`` relative to ``bench_dir`` when it lies inside (a copied or moved bench directory,
    or `compare` run from another folder, still finds its files), else absolute."""
    resolved = Path(path).resolve()
    try:
        return str(resolved.relative_to(Path(bench_dir).resolve()))
    except ValueError:
        return str(resolved)


def _resolve_runs(data: dict[str, Any], folder: Path) -> None:
    """Make the run paths of a loaded results file absolute: relative ones are relative to its
    folder. Files written before that hold them relative to the folder `dmlkit bench` ran in
    (``sub/bench/final/...`` beside the absolute ``bench_dir``): found under ``folder`` once the
    leading part naming the bench directory is stripped, else from the current folder; one found
    nowhere keeps its stored path, marked for :func:`load_listed_embeddings` to explain."""
    bench_parts = Path(data.get("bench_dir") or "").parts
    for entry in (data.get("methods") or {}).values():
        for run in entry.get("runs", []) if isinstance(entry, dict) else []:
            for key in _RUN_PATHS:
                value = run.get(key)
                if isinstance(value, str) and value and not Path(value).is_absolute():
                    inside, legacy = folder / value, _legacy_run_paths(value, bench_parts, folder)
                    found = next((p for p in (inside, *legacy, Path(value).resolve()) if p.exists()), None)
                    run[key] = str(found or (value if legacy else inside))
                    if found is None and legacy:
                        run[_STORED_FROM_CWD] = True


#: A run entry whose paths an older dmlkit stored relative to the folder it ran in, found nowhere.
_STORED_FROM_CWD = "_stored_relative_to_bench_cwd"


def _legacy_run_paths(value: str, bench_parts: tuple[str, ...], folder: Path) -> list[Path]:
    """Where an older dmlkit's run path ``value`` (relative to the folder `dmlkit bench` ran
    in) lies under the results file's ``folder``: each way of reading its leading components
    (``..`` aside) as the tail of the recorded bench directory, the longest first."""
    parts = Path(value).parts
    paths = []
    for i in range(len(parts) - 1, 0, -1):
        named = [p for p in parts[:i] if p not in (".", "..")]
        if named and tuple(named) == bench_parts[len(bench_parts) - len(named):]:
            paths.append(folder.joinpath(*parts[i:]))
    return paths


def resolved_runs(results: Mapping[str, Any]) -> dict[str, Any]:
    """A results mapping (as :func:`build_results` returns it) with absolute run paths: the
    relative ones are relative to its ``bench_dir``. :func:`load_results` does this on reading,
    and both refuse an incomplete table (a seed missing a fold or listing one twice would
    score "concatenated" from fewer models and average a fold twice in "separated")."""
    data = copy.deepcopy(dict(results))
    problem = _results_problem(data)
    if problem:
        raise DataError(f"the results mapping is not a complete dmlkit bench results table: {problem}")
    if data.get("bench_dir"):
        _resolve_runs(data, Path(data["bench_dir"]))
    return data


def build_results(config, split, entries: Mapping[str, Mapping[str, Any]], *, bench_dir: Path,
                  storage_url: str | None = None) -> dict[str, Any]:
    """Assemble ``results.json`` from the evaluated final runs of every method."""
    metrics = list(config.protocol.metrics)
    emb = _embedding_size(entries, config)
    k = len(split.folds)
    methods: dict[str, Any] = {}
    for name, entry in entries.items():
        ev = entry["evaluation"]
        methods[name] = {
            mode: {m: summarize(ev[mode][m]) for m in metrics} for mode in MODES
        }
        methods[name].update({
            "best_params": dict(entry.get("best_params") or {}),
            "search": entry.get("search"),
            "loss": entry.get("loss"),
            "miner": entry.get("miner"),
            "seeds": list(ev["seeds"]),
            # the runs the row was computed on: a seed with a diverged fold model is left out
            "runs": [
                {"seed": r.seed, "fold": r.fold, "run_dir": _in_bench(r.run_dir, bench_dir),
                 "checkpoint": None if r.checkpoint is None else _in_bench(r.checkpoint, bench_dir),
                 "embeddings": _in_bench(r.embeddings, bench_dir),
                 "embeddings_sha256": (ev.get("digests") or {}).get(str(r.embeddings))}
                for r in entry["runs"] if r.seed in ev["seeds"]
            ],
        })
        if ev.get("failed_runs"):
            methods[name]["seeds_failed"] = list(ev["failed_seeds"])
            methods[name]["failed_runs"] = [{**f, "run_dir": _in_bench(f["run_dir"], bench_dir)}
                                            for f in ev["failed_runs"]]
    return {
        "format": FORMAT,
        "name": config.name,
        "bench_dir": str(Path(bench_dir).resolve()),
        "metrics": metrics,
        "modes": {"concatenated": k * emb, "separated": emb},
        "split": {"kind": split.kind, "order": split.order, "order_seed": split.order_seed,
                  "folds": k, "dev_classes": len(split.dev), "test_classes": len(split.test),
                  "file": str(Path(bench_dir).resolve() / "split.json")},
        "seeds": list(config.protocol.seeds or []),
        "trials": config.protocol.trials,
        "storage": None if storage_url is None else _redact(storage_url),
        "methods": methods,
        "config": config.model_dump(mode="json"),
        "provenance": provenance(config.fixed.seed),
    }


def is_ranked(name: str, row: Mapping[str, Any]) -> bool:
    """Whether a method's row competes for the best cell of a column: not the untrained
    ``pretrained`` row, nor a row over fewer seeds (``seeds_failed``: not comparable), in
    results.md and the HTML report alike."""
    return name != "pretrained" and not row.get("seeds_failed")


def best_cells(results: Mapping[str, Any]) -> dict[tuple[str, str], set[str]]:
    """``{(mode, metric): method names}``: the column's best cells, the one rule behind the bold
    of results.md, the terminal table and the HTML report. Among the ranked rows
    (:func:`is_ranked`), the highest mean as :func:`format_cell` shows it (in %, 2 decimals): the
    methods tied there are all best (results.md bolded only the first of them, the HTML all); a
    missing, null or NaN mean never is."""
    shown: dict[tuple[str, str], dict[str, float]] = {}
    for name, row in results["methods"].items():
        if not is_ranked(name, row):
            continue
        for mode in MODES:
            for metric, cell in (row.get(mode) or {}).items():
                mean = cell.get("mean") if isinstance(cell, Mapping) else None
                if mean is None or not math.isfinite(mean):  # never the best
                    continue
                shown.setdefault((mode, metric), {})[name] = float(f"{mean * 100:.2f}")
    best = {}
    for key, values in shown.items():
        top = max(values.values())
        best[key] = {n for n, v in values.items() if v == top}
    return best


def ordered_methods(results: Mapping[str, Any]) -> list[str]:
    """The table's row order, one for ``results.md``, the terminal, the CSV and the HTML report:
    ``pretrained`` first, then the methods as ``results.json`` lists them."""
    names = list(results["methods"])
    return (["pretrained"] if "pretrained" in names else []) + [n for n in names if n != "pretrained"]


def render_markdown(results: Mapping[str, Any]) -> str:
    """The seed's two-level table as Markdown (group row, then metric row). Every text from the
    results (method names, metric names, split, seeds, warnings) is literal Markdown
    (:func:`markdown_text`): ``render_markdown(load_results(...))`` of a hand-edited file wrote a
    ``<script>`` element and rows of more cells than the header."""
    metrics = results["metrics"]
    dims = results.get("modes", {})
    best = best_cells(results)
    groups = []
    for mode in MODES:
        label = markdown_text(f"{mode.capitalize()} ({dims.get(mode, '?')}-dim)")
        groups += [label] + [""] * (len(metrics) - 1)
    header = "| Method | " + " | ".join(groups) + " |"
    sep = "|---|" + "|".join(["---:"] * (len(metrics) * len(MODES))) + "|"
    sub = "| | " + " | ".join(f"**{markdown_text(metric_label(m))}**" for _ in MODES for m in metrics) + " |"
    lines = [header, sep, sub]
    for name in ordered_methods(results):
        row = results["methods"][name]
        cells = []
        for mode in MODES:
            for m in metrics:
                text = format_cell(cell_of(row, mode, m))
                cells.append(f"**{text}**" if name in best.get((mode, m), ()) else text)
        lines.append(f"| {markdown_text(row_label(name, row))} | " + " | ".join(cells) + " |")
    split = results.get("split", {})
    seeds = results.get("seeds", [])
    lines.append("")
    # ratio_4_1_5 is one fixed train/validation split: nothing is cross-validated
    dev = (f"{split.get('dev_classes')} training + validation classes in one fixed split"
           if split.get("kind") == "ratio_4_1_5" else
           f"{split.get('dev_classes')} cross-validation classes in {split.get('folds')} folds")
    lines.append(markdown_text(
        f"Split: {split.get('kind')} ({dev}, {split.get('test_classes')} test classes), class order "
        f"{split.get('order')}"
        + (f" (seed {split.get('order_seed')})" if split.get("order") == "random" else "")
        + f"; {results.get('trials')} search trials per method{_search_counts(results)}; "
        f"{len(seeds)} seed(s) {seeds}; "
        "mean ± 95 % CI (Student t over seeds), in %."
    ))
    lines += [f"\nWarning: {markdown_text(note)}" for note in failure_notes(results)]
    if missing := missing_note(results, name=markdown_text):
        lines.append(f"\n{missing}")
    return "\n".join(lines) + "\n"


def row_label(name: str, row: Mapping[str, Any]) -> str:
    """The method's name, with ``(2/3 seeds)`` when final runs of some seeds diverged."""
    failed = row.get("seeds_failed") or []
    if not failed:
        return name
    finished = len(row.get("seeds") or [])
    return f"{name} ({finished}/{finished + len(failed)} seeds)"


def failure_notes(results: Mapping[str, Any]) -> list[str]:
    """One line per method with diverged final runs: how many, the first error, and which
    seeds its row is computed over (``n/a`` when none finished)."""
    notes = []
    for name in ordered_methods(results):
        row = results["methods"][name]
        failed = row.get("failed_runs") or []
        if not failed:
            continue
        seeds, lost = list(row.get("seeds") or []), list(row.get("seeds_failed") or [])
        first = failed[0]
        over = (f"its row is over the {len(seeds)} of {len(seeds) + len(lost)} seeds whose fold models "
                f"all finished ({seeds})" if seeds else "its row is n/a (no seed finished)")
        notes.append(f"{name}: {len(failed)} final run(s) diverged, in seed(s) {lost} (seed {first['seed']} "
                     f"fold {first['fold']}: {first['error']}); {over}")
    return notes


def missing_methods(results: Mapping[str, Any]) -> list[str]:
    """The methods of the recorded config (``config.methods``) that have no row: a final stage
    of some methods (``--stage final -m A``) leaves out those without current final runs."""
    config = results.get("config")
    listed = config.get("methods") if isinstance(config, Mapping) else None
    names = [m.get("name") for m in listed if isinstance(m, Mapping)] if isinstance(listed, list) else []
    return [n for n in names if isinstance(n, str) and n not in results["methods"]]


def missing_note(results: Mapping[str, Any], name: Callable[[str], str] = str) -> str | None:
    """``Not in this table: triplet (...)``, naming :func:`missing_methods` and how to add their
    rows, as results.md and the HTML report say it; ``None`` when every method has a row. Each
    method name is written as ``name`` returns it (:func:`markdown_text` for results.md: the
    names come from the recorded config, which a hand-edited results.json can hold anything in)."""
    missing = [name(n) for n in missing_methods(results)]
    if not missing:
        return None
    return (f"Not in this table: {', '.join(missing)} (in the config, but without current final "
            f"runs when this table was written); `dmlkit bench CONFIG --stage final "
            f"{' '.join(f'-m {n}' for n in missing)}` adds {'its row' if len(missing) == 1 else 'their rows'}.")


def _search_counts(results: Mapping[str, Any]) -> str:
    """`` (triplet 2 completed; ms 1 completed, 1 failed)``: the trials each method's best
    came from, as the search recorded them (empty for results written without the counts)."""
    parts = []
    for name in ordered_methods(results):
        search = results["methods"][name].get("search")
        if name == "pretrained" or not isinstance(search, Mapping):
            continue
        if search.get("trials") == 0:
            parts.append(f"{name} nothing searched")
        elif "counted" in search:
            text = f"{name} {search.get('finished')} completed"
            text += f", {search['failed']} failed" if search.get("failed") else ""
            extra = search.get("beyond_budget") or 0
            parts.append(text + (f" (the first {search['counted']} of {search['counted'] + extra} run)"
                                 if extra else ""))
    return f" ({'; '.join(parts)})" if parts else ""


def render_csv(results: Mapping[str, Any]) -> str:
    """One row per method x mode x metric: mean, ci95, n, values."""
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(["method", "mode", "metric", "mean", "ci95", "n", "values"])
    for name in ordered_methods(results):
        row = results["methods"][name]
        for mode in MODES:
            for m in results["metrics"]:
                cell = cell_of(row, mode, m)
                if cell is None:  # not scored: the row says so with empty fields
                    writer.writerow([name, mode, m, "", "", "", ""])
                    continue
                writer.writerow([
                    name, mode, m, "" if cell["mean"] is None else f"{cell['mean']:.6f}",
                    "" if cell["ci95"] is None else f"{cell['ci95']:.6f}", cell["n"],
                    # a NaN seed is null in results.json: "nan" here, as when the bench wrote it
                    " ".join("nan" if v is None else f"{v:.6f}" for v in cell["values"]),
                ])
    return buf.getvalue()


def rich_table(results: Mapping[str, Any]):
    """The table as a :class:`rich.table.Table` for the terminal."""
    from rich.table import Table

    metrics = results["metrics"]
    dims = results.get("modes", {})
    best = best_cells(results)
    table = Table(title=f"{results.get('name', 'bench')}: test accuracy (%), mean ± 95 % CI")
    table.add_column("Method")
    for mode in MODES:
        for i, m in enumerate(metrics):
            head = f"{mode[:6]}. ({dims.get(mode, '?')}-d)\n" if i == 0 else "\n"
            table.add_column(head + metric_label(m), justify="right")
    for name in ordered_methods(results):
        row = results["methods"][name]
        cells = []
        for mode in MODES:
            for m in metrics:
                text = format_cell(cell_of(row, mode, m))
                cells.append(f"[bold]{text}[/]" if name in best.get((mode, m), ()) else text)
        table.add_row(row_label(name, row), *cells)
    return table


def write_results(results: Mapping[str, Any], bench_dir: str | Path) -> dict[str, Path]:
    d = Path(bench_dir)
    return {
        "json": atomic_write_json(d / "results.json", results),
        "csv": atomic_write_text(d / "results.csv", render_csv(results)),
        "md": atomic_write_text(d / "results.md", render_markdown(results)),
    }


def load_results(path: str | Path) -> dict[str, Any]:
    """Read ``results.json`` (or a bench directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "results.json"
    if not path.exists():
        raise DataNotFoundError(f"results not found: {path} (run `dmlkit bench` first)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:  # ~100,000 deep: RecursionError
        raise DataError(f"{path} is not a results file (not valid UTF-8 JSON: {exc}); "
                        "point to the results.json that `dmlkit bench` wrote") from None
    except OSError as exc:
        raise DataError(f"cannot read {path}: {exc.strerror or exc}") from None
    problem = _results_problem(data)
    if problem:
        raise DataError(f"{path} is not a complete dmlkit bench results file: {problem}; "
                        "rerun `dmlkit bench CONFIG --stage final` to rewrite it")
    _resolve_runs(data, path.parent)
    data.setdefault("_path", str(path))
    return data


def _results_problem(data: Any) -> str | None:
    """What makes ``data`` unusable as a results file (``None`` when it is fine)."""
    if not isinstance(data, dict) or not isinstance(data.get("methods"), dict) or not data["methods"]:
        return "no 'methods' table"
    metrics = data.get("metrics")
    if "metrics" in data and not (isinstance(metrics, list) and metrics
                                  and all(isinstance(m, str) for m in metrics)):
        # a string was one column per character
        return f"'metrics' must be a list of metric names, not {_shown_json(metrics)}"
    for name, entry in data["methods"].items():
        if not isinstance(entry, dict):
            return f"method {name!r} is not a mapping"
        for mode in MODES:
            if not isinstance(entry.get(mode), dict):
                return f"method {name!r} has no {mode!r} results"
            for metric, cell in entry[mode].items():
                if problem := _cell_problem(cell):
                    return f"method {name!r}, {mode} {metric}: {problem}"
        runs = entry.get("runs", [])
        if not isinstance(runs, list) or not all(
            isinstance(r, dict) and {"seed", "fold", "embeddings"} <= r.keys()
            and _is_int(r["seed"]) and _is_int(r["fold"]) and isinstance(r["embeddings"], str)
            for r in runs
        ):
            return f"method {name!r}: 'runs' must list {{seed, fold, embeddings}} entries (integers, a path)"
        if problem := _fold_problem(name, runs, data):
            return problem
        if not isinstance(entry.get("seeds_failed", []), list):
            return f"method {name!r}: 'seeds_failed' must be a list of seeds"
        for key in ("loss", "miner"):
            if not isinstance(entry.get(key), dict | type(None)):
                return f"method {name!r}: {key!r} must be a mapping or null"
    for key, kind, what in (("split", dict, "a mapping"), ("modes", dict, "a mapping"), ("seeds", list, "a list")):
        if key in data and not isinstance(data[key], kind):  # the tables read them: an AttributeError
            return f"{key!r} must be {what}, not {_shown_json(data[key])}"
    config = data.get("config", {})
    fixed = config.get("fixed", {}) if isinstance(config, dict) else None
    if not (isinstance(config, dict) and isinstance(fixed, dict)
            and isinstance(config.get("protocol", {}), dict)
            and isinstance(fixed.get("data", {}), dict)
            and isinstance(fixed.get("data", {}).get("options", {}), dict)):
        return "'config', 'config.fixed', 'config.protocol' and 'config.fixed.data.options' must be mappings"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """An int or float, never a bool (``true`` read as 1 showed as 100.00)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _shown_json(value: Any) -> str:
    """``the string "0.1"`` / ``true``: a wrong value as the JSON file has it, cut to 40 characters."""
    text = json.dumps(value, default=str)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"the string {text}" if isinstance(value, str) else text


def _cell_problem(cell: Any) -> str | None:
    """What is wrong with one table cell's types (``mean`` and ``ci95`` numbers or null, ``values``
    a list of numbers or nulls, ``n`` an integer), ``None`` when nothing is: a string ``ci95``
    made `dmlkit report` end in a TypeError traceback."""
    if not isinstance(cell, dict):
        return f"the cell must be an object of mean, ci95, values, not {_shown_json(cell)}"
    for key in ("mean", "ci95"):
        if cell.get(key) is not None and not _is_number(cell[key]):
            return f"{key!r} must be a number or null, not {_shown_json(cell[key])}"
    values = cell.get("values", [])
    if not isinstance(values, list) or not all(v is None or _is_number(v) for v in values):
        return f"'values' must be a list of numbers (null for NaN), not {_shown_json(values)}"
    if "n" in cell and not _is_int(cell["n"]):
        return f"'n' must be an integer, not {_shown_json(cell['n'])}"
    return None


def _fold_problem(name: str, runs: list[dict], data: Mapping[str, Any]) -> str | None:
    """Each seed's runs must be folds ``0 .. k-1`` once each (``split.folds``, else as many as the
    seed with the most): a seed missing a fold was concatenated from fewer fold models (one
    64-d model scored as the 128-d concatenation) and a repeated run twice, silently."""
    folds: dict[int, list[int]] = {}
    for r in runs:
        folds.setdefault(r["seed"], []).append(r["fold"])
    split = data.get("split")
    k = split.get("folds") if isinstance(split, dict) and _is_int(split.get("folds")) else None
    k = k if k is not None else max((len(f) for f in folds.values()), default=0)
    for seed, got in folds.items():
        if sorted(got) != list(range(k)):
            return (f"method {name!r}, seed {seed}: 'runs' list folds {sorted(got)}, not each of "
                    f"0..{k - 1} once")
    return None
