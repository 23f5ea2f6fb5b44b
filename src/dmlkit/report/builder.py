"""Build the HTML report of a training run directory or a benchmark directory.

``build_report(path)`` looks at ``path``: a benchmark directory has ``results.json`` (written by
``dmlkit bench``), a run directory has ``config.yaml`` and ``log.jsonl`` (written by
``dmlkit train``). It writes ``report.html`` and ``figures/*.png|svg`` into the directory (or
``out``) and returns the page's path. Figures that need data which is not available (e.g. the
images, for thumbnails) are left out with a note saying why, never faked; so are the class
names and thumbnails of figures drawn from saved embeddings files (:mod:`dmlkit.report.saved`).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from dmlkit.config import load_config
from dmlkit.data import load_image
from dmlkit.embeddings import embed_split, load_embeddings
from dmlkit.exceptions import ConfigError, DataError, DataNotFoundError, DmlkitError
from dmlkit.protocol.compare import BASELINES, baseline_methods
from dmlkit.protocol.results import (
    best_cells,
    cell_of,
    failure_notes,
    format_cell,
    load_listed_embeddings,
    load_results,
    metric_label,
    missing_note,
    ordered_methods,
    row_label,
)
from dmlkit.report import figures
from dmlkit.report.html import Figure, Section, render_page, table_html
from dmlkit.report.saved import (
    dataset_class_names,
    file_class_names,
    image_getter,
    saved_figure_data,
)
from dmlkit.report.sections import (
    ReportOptions,
    _embedding_sections,
    _sample_rows,
    _Split,
    hist_dict,
)
from dmlkit.training import build_datasets, build_model, read_log
from dmlkit.training.run_identity import (
    data_differences,
    load_run_checkpoint,
    read_run_split,
    with_run_split,
)
from dmlkit.training.trainer import baseline_warnings
from dmlkit.utils import atomic_write_text, os_error_message, read_json_object
from dmlkit.validation import concatenate_normalized

__all__ = ["ReportOptions", "build_report", "hist_dict", "mean_of", "read_jsonl"]

_MAIN_METRICS = ("precision_at_1", "r_precision", "map_at_r")


def build_report(path: str | os.PathLike, out: str | os.PathLike | None = None,
                 options: ReportOptions | None = None) -> Path:
    """Write ``report.html`` (+ ``figures/``; another page name ``out``: ``<name>_figures/``) for a
    run or benchmark directory; return its path. An ``out`` that is a folder is refused
    (:class:`ConfigError`) before any work."""
    src = Path(path)
    if not src.is_dir():
        raise DataNotFoundError(f"{src} is not a directory: pass a run directory (dmlkit train) "
                                "or a benchmark directory (dmlkit bench)")
    options = options or ReportOptions()
    unknown = sorted(set(options.maps) - set(figures.PROJECTIONS))
    if unknown:
        raise ConfigError(f"unknown 2-D map(s) {', '.join(unknown)}: use {', '.join(figures.PROJECTIONS)}")
    page = Path(out) if out is not None else src / "report.html"
    if page.is_dir():  # checked now: writing the page failed only after every split was embedded
        raise ConfigError(f"the report page {page} is a folder: name the HTML file to write "
                          f"(e.g. {page / 'report.html'})")
    # report.html keeps figures/; any other page name its own <name>_figures/, so that pages
    # written into one folder do not overwrite (and then link) each other's figures
    fig_dir = page.parent / ("figures" if page.name == "report.html" else f"{page.stem}_figures")
    fig_dir.mkdir(parents=True, exist_ok=True)
    # any torch draw of this thread from a generator of its own (_run_embeddings names those it
    # makes): the caller's global RNG is neither read nor advanced
    with _ThreadRandom(torch.Generator().manual_seed(options.seed)):
        if (src / "results.json").exists():
            title, subtitle, sections = _bench_sections(src, fig_dir, options)
        elif (src / "config.yaml").exists():
            try:
                load_config(src / "config.yaml")
            except DmlkitError as exc:
                raise DataError(f"{src} is not a readable run directory: {exc}") from None
            title, subtitle, sections = _run_sections(src, fig_dir, options)
        else:
            raise DataError(f"{src} holds neither results.json (benchmark) nor config.yaml (training run)")
    atomic_write_text(page, render_page(title, subtitle, sections, page))
    return page


# -- embeddings of a run ------------------------------------------------------------------------
#: torch's random draws that take a ``generator`` (the CPU ones :class:`_ThreadRandom` routes)
_RANDOM_DRAWS = frozenset({
    torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal, torch.bernoulli, torch.multinomial,
    torch.poisson, torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.random_, torch.Tensor.bernoulli_,
    torch.Tensor.bernoulli, torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.log_normal_,
    torch.Tensor.cauchy_, torch.Tensor.multinomial,
})


class _ThreadRandom(TorchFunctionMode):
    """This thread's torch random draws on the CPU that name no generator (a model's weight
    initialisation, a DataLoader's base seed, torchvision's random transforms) drawn from
    ``generator`` instead of the process-wide one.

    A :class:`~torch.overrides.TorchFunctionMode` is per thread, so the report neither reseeds
    nor consumes the caller's global RNGs (``seed_everything`` reset Python's, numpy's and
    torch's: the caller's next draws were the run seed's first), and a thread drawing from the
    global torch RNG meanwhile does not change its numbers (it changed the untrained model,
    "test, before training" JS 0.4540 serially, 0.3816 and 0.5169 with a ``torch.rand`` loop
    beside it). ``torch.Generator().manual_seed(s)`` draws what the global generator draws after
    ``torch.manual_seed(s)``, so the models and embeddings are those of the seeded serial run.
    """

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.generator = generator

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if kwargs.get("generator") is None and ("generator" in kwargs or func in _RANDOM_DRAWS) \
                and _on_cpu(args, kwargs):
            kwargs["generator"] = self.generator
        return func(*args, **kwargs)


def _on_cpu(args: Sequence[Any], kwargs: Mapping[str, Any]) -> bool:
    """Whether a random draw writes a CPU tensor (the tensor it fills or samples, else its
    ``device``, else the default device): a CPU generator cannot draw on another device."""
    first = args[0] if args else kwargs.get("tensor", kwargs.get("input"))
    if isinstance(first, torch.Tensor):
        return first.device.type == "cpu"
    device = kwargs.get("device")
    return torch.device(device if device is not None else torch.get_default_device()).type == "cpu"


def _run_embeddings(run_dir: Path, options: ReportOptions, notes: list[str]) -> tuple[dict[str, _Split], dict[str, _Split]]:
    """``(trained, untrained)`` embeddings per split; falls back to ``embeddings/test.npz`` (with
    a note and a warning) when the run's data or checkpoint cannot be loaded, when the checkpoint
    is another run's (:func:`~dmlkit.training.run_identity.load_run_checkpoint`), or when the data
    read now are not those the run recorded in ``split.json``: the model-based figures beside this
    run's ``metrics.json`` would show another model or other data.

    The untrained model is the run's step-0 model (``dmlkit train`` seeds torch with the run's
    seed, then builds it); it and the embedding passes draw from one generator seeded so
    (:class:`_ThreadRandom`), not from the process-wide RNGs."""
    trained: dict[str, _Split] = {}
    untrained: dict[str, _Split] = {}
    try:
        with _ThreadRandom(torch.Generator()):  # the checkpoint's model: drawn weights its state replaces
            config = with_run_split(load_config(run_dir / "config.yaml"), run_dir)
            datasets = build_datasets(config, ("train", "val", "test"), data_root=options.data_root)
            _, model, _ = load_run_checkpoint(run_dir)
        differences = data_differences(read_run_split(run_dir), {k: v for k, v in datasets.items() if k != "split"})
        if differences:
            raise DataError(f"the data read now are not those the run was trained on: {'; '.join(differences)}")
        own_random = _ThreadRandom(torch.Generator().manual_seed(config.seed))
        with own_random:
            initial = build_model(config).eval()
    except DmlkitError as exc:
        notes.append(f"The run's data or checkpoint could not be loaded ({exc}); figures use the "
                     "saved test embeddings only.")
        # said on the terminal too: a damaged checkpoint should not pass unnoticed behind exit 0
        warnings.warn(f"{run_dir}: the run's data or checkpoint could not be loaded ({exc}); the "
                      "report's figures use the saved test embeddings only", stacklevel=2)
        saved = run_dir / "embeddings" / "test.npz"
        if saved.exists():  # names from split.json, thumbnails where the data still load
            emb, lab, extra = load_embeddings(saved)
            found = saved_figure_data(saved, lab, extra, run_dir, data_root=options.data_root,
                                      thumbnails=options.thumbnails)
            trained["test"] = _Split("test", emb, lab, found.image_of, found.class_names, found.notes)
        return trained, untrained
    for name in ("train", "val", "test"):
        ds = datasets.get(name)
        if ds is None:
            continue
        options.progress(f"embedding the {name} split")
        labels = np.asarray(ds.labels)
        rows = np.arange(len(labels)) if name == "test" else _sample_rows(labels, options.max_points, options.seed)
        sub = ds.subset(rows) if len(rows) < len(labels) else ds
        with own_random:
            emb, lab = embed_split(model, sub, config, device="cpu")
        getter = image_getter(sub) if options.thumbnails else None
        names = dataset_class_names(ds)
        lacking = ["No thumbnails: the run's data are not images that can be read."] \
            if options.thumbnails and getter is None else []
        trained[name] = _Split(name, emb, lab, getter, names, lacking)
        if name == "test":
            with own_random:
                emb0, lab0 = embed_split(initial, sub, config, device="cpu")
            untrained[name] = _Split(name, emb0, lab0, getter, names)
    return trained, untrained


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a run's ``log.jsonl`` (a line cut by a crash is skipped; no file: ``[]``);
    a file that is not UTF-8 text is a :class:`DataError`."""
    try:
        return read_log(path)
    except UnicodeDecodeError as exc:
        raise DataError(f"{path} is not a dmlkit log: not UTF-8 text (byte {exc.start})") from None
    except OSError as exc:
        raise DataError(os_error_message(exc, path)) from None


def _run_metrics(path: Path) -> dict[str, Any]:
    """A run's ``metrics.json``, its ``val`` / ``test`` / ``baseline`` sections checked to be
    objects (or null): a hand-edited or foreign file is one :class:`DataError`."""
    metrics = read_json_object(path, "metrics.json of dmlkit train")
    sections = {k: metrics.get(k) for k in ("val", "test", "baseline")}
    sections.update({f"baseline.{k}": v for k, v in (sections["baseline"] or {}).items()}
                    if isinstance(sections["baseline"], dict) else {})
    for key, value in sections.items():
        if value is not None and not isinstance(value, dict):
            raise DataError(f"{path} is not a metrics.json of dmlkit train: {key!r} holds a JSON "
                            f"{type(value).__name__}, not an object of metrics")
    return metrics


def _fmt(v: Any) -> str:
    # a bool is no metric value (true was shown as 100.00)
    return f"{100 * v:.2f}" if isinstance(v, int | float) and not isinstance(v, bool) and np.isfinite(v) else "n/a"


# -- a training run -----------------------------------------------------------------------------
def _run_sections(run_dir: Path, fig_dir: Path, options: ReportOptions) -> tuple[str, str, list[Section]]:
    notes: list[str] = []
    sections: list[Section] = []
    metrics = _run_metrics(run_dir / "metrics.json") if (run_dir / "metrics.json").exists() else {}
    if not metrics and (run_dir / "baseline.json").exists():  # interrupted: the step-0 numbers
        metrics = {"baseline": read_json_object(run_dir / "baseline.json", "baseline.json of dmlkit train")}
    rows = []
    for split in ("val", "test"):
        m = metrics.get(split) or {}
        if m:
            rows.append([split] + [_fmt(m.get(k)) for k in _MAIN_METRICS])
        base = (metrics.get("baseline") or {}).get(split) or {}
        if base:  # the number training had to beat
            rows.append([f"{split}, step 0 (untrained)"] + [_fmt(base.get(k)) for k in _MAIN_METRICS])
    results_html = [table_html(["split", "P@1 (%)", "R-Precision (%)", "MAP@R (%)"], rows)] if rows else []
    # the warning `dmlkit train` prints, on the page too (the CLI said it, the page did not)
    notes += [f"Warning: {line}." for line in _baseline_lines(metrics)]
    if not metrics.get("val") and not metrics.get("test"):
        notes.append("metrics.json has no results yet (the run may still be going or was interrupted)"
                     + ("; the table shows the step-0 numbers." if rows else "."))
    log = read_jsonl(run_dir / "log.jsonl")
    if log:
        png = figures.save_figure(figures.training_curves({run_dir.name: log}), fig_dir / "curves")
        curve_figs = [Figure(png[0], "Training loss and validation metrics", png[1])]
    else:
        curve_figs = []
        notes.append("log.jsonl is empty: no training curves.")
    trained, untrained = _run_embeddings(run_dir, options, notes)
    sections.append(Section("Results", [f"Best step: {metrics.get('best_step', 'n/a')}."], results_html))
    sections.append(Section("Training curves", [], [], curve_figs))
    if "test" in trained:
        others = {k: v for k, v in trained.items() if k != "test"}
        sections += _embedding_sections(trained["test"], untrained.get("test"), others, fig_dir, options,
                                        "the trained model")
    else:
        notes.append("No test embeddings: run `dmlkit embed RUN_DIR --split test` first.")
    if (run_dir / "reid.json").exists():
        sections.append(_reid_section(run_dir / "reid.json", fig_dir))
    sections.append(_config_section(run_dir))
    if notes:
        sections.insert(0, Section("Notes", notes))
    return f"dmlkit run report: {run_dir.name}", f"Run directory {run_dir.resolve()}", sections


def _baseline_lines(metrics: Mapping[str, Any]) -> list[str]:
    """:func:`~dmlkit.training.trainer.baseline_warnings` of a ``metrics.json``: a line per
    split whose trained MAP@R is not above the step-0 model's (numbers only: a hand-edited
    value is no comparison)."""
    def numeric(section: Any) -> dict[str, float]:
        value = section.get("map_at_r") if isinstance(section, dict) else None
        ok = isinstance(value, int | float) and not isinstance(value, bool) and np.isfinite(value)
        return {"map_at_r": float(value)} if ok else {}

    baseline = metrics.get("baseline") if isinstance(metrics.get("baseline"), dict) else {}
    base = {split: numeric(baseline.get(split)) for split in ("val", "test")}
    trained = {split: numeric(metrics.get(split)) for split in ("val", "test")}
    return baseline_warnings({k: v for k, v in base.items() if v}, trained)


def _reid_section(path: Path, fig_dir: Path) -> Section:
    """``dmlkit reid``'s results: the CMC/mAP table, the CMC curve and a ranked-gallery strip."""
    res = read_json_object(path, "reid.json of dmlkit reid")
    if res.get("protocol") != "market1501":
        rows = [[k, _fmt(v["mean"]), _fmt(v["std"])] for k, v in res.items()
                if isinstance(v, dict) and "mean" in v]
        return Section("Re-identification (VehicleID)", [f"{res.get('repeats')} gallery draws."],
                       [table_html(["metric", "mean (%)", "std (%)"], rows)])
    keys = [k for k in res if k.startswith("rank_")] + ["map", "minp"]
    runs = {"plain": res} | ({"re-ranked": res["rerank"]} if res.get("rerank") else {})
    rows = [[name] + [_fmt(r.get(k)) for k in keys] for name, r in runs.items()]
    html = [table_html(["ranking"] + [k.replace("rank_", "Rank-").replace("minp", "mINP")
                                      .replace("map", "mAP") + " (%)" for k in keys], rows)]
    png = figures.save_figure(figures.cmc_curve({n: r["cmc"] for n, r in runs.items()}),
                              fig_dir / "cmc")
    figs = [Figure(png[0], "CMC curve (ranks 1-50)", png[1])]
    if res.get("examples"):
        png = figures.save_figure(figures.reid_strip(res["examples"], lambda p: load_image(p, None)),
                                  fig_dir / "reid_strip")
        figs.append(Figure(png[0], "Queries and their ranked gallery; junk marked grey", png[1]))
    return Section("Re-identification", [
        f"{res['num_valid_queries']} valid queries ({res['num_skipped_queries']} without a "
        f"cross-camera positive skipped), {res['num_gallery']} gallery images; metric "
        f"{res.get('metric')}. Source: {path.name} (dmlkit reid)."], html, figs)


def _config_section(directory: Path) -> Section:
    blocks = []
    for name in ("config.yaml", "provenance.json", "split.json"):
        p = directory / name
        if p.exists():
            import html as _html

            text = p.read_text()
            if len(text) > 20000:
                text = text[:20000] + "\n... (cut)"
            blocks.append(f"<h3>{name}</h3><pre>{_html.escape(text)}</pre>")
    return Section("Configuration and provenance", ["Everything needed to reproduce these numbers."], blocks)


# -- a benchmark ---------------------------------------------------------------------------------
def _bench_sections(bench_dir: Path, fig_dir: Path, options: ReportOptions) -> tuple[str, str, list[Section]]:
    results = load_results(bench_dir / "results.json")  # checked, its run paths resolved
    methods: dict[str, Any] = results["methods"]
    sections: list[Section] = []
    metrics = results.get("metrics", list(_MAIN_METRICS))
    header = ["method"] + [f"{mode} {metric_label(k)}" for mode in ("concatenated", "separated") for k in metrics]
    rows = []
    for name in ordered_methods(results):  # the order of results.md: pretrained first
        rows.append([name] + [format_cell(cell_of(methods[name], mode, k))  # n/a: no cell or mean
                              for mode in ("concatenated", "separated") for k in metrics])
    def concat_map(i: int) -> float:  # NaN (no value) ranks last: max() kept a NaN first row as the best
        value = mean_of(methods[rows[i][0]].get("concatenated", {}).get("map_at_r"))
        return value if np.isfinite(value) else -np.inf

    best = max(range(len(rows)), key=concat_map)
    untrained_best = rows[best][0] == "pretrained" and len(rows) > 1
    sections.append(Section("Results", [
        "Test-set accuracy (%) in the layout of Musgrave et al. (2020): concatenated = the fold models' "
        "embeddings concatenated and L2-normalised; separated = each fold model alone, averaged. "
        "± is the 95% confidence interval over repeated runs (n/a with a single repeat)."]
        + (["No method beat the untrained model (the 'pretrained' row) on concatenated MAP@R: the "
            "figures below show that model; train longer or search more before comparing methods."]
           if untrained_best else [])
        + [f"Warning: {note}" for note in failure_notes(results)]  # as results.md says them
        + [note for note in [missing_note(results)] if note],
        # results.md's bold cells, by the one rule (ties all bold; never the untrained row nor a
        # row over fewer seeds)
        [table_html(header, [[row_label(r[0], methods[r[0]]), *r[1:]] for r in rows],  # "(2/3 seeds)"
                    bold=_bold_cells(results, rows, metrics))]))
    concat = {n: {"map_at_r": mean_of(r.get("concatenated", {}).get("map_at_r"))} for n, r in methods.items()}
    found = baseline_methods(methods)
    baselines = list(found.values())
    if baselines and any(m not in baselines for m in concat):  # something to compare with them
        png = figures.save_figure(figures.relative_improvement(concat, baselines, mode="concatenated"),
                                  fig_dir / "relative_improvement")
        # name only the baselines drawn ("over contrastive and triplet" with no triplet row)
        over = " and ".join(b if n == b else f"{b} ({n})" for b, n in found.items())
        absent = [b for b in BASELINES if b not in found]
        losses = "losses" if len(found) > 1 else "loss"
        sections.append(Section("Papers versus reality", [
            f"Relative improvement of each method's concatenated MAP@R over the {over} {losses} "
            "under identical settings; the dashed line is no improvement."
            + (f" The benchmark has no {' or '.join(absent)} row." if absent else "")], [],
            [Figure(png[0], f"Relative improvement over {over}", png[1])]))
    curve_figs = []
    for name, entry in methods.items():
        logs = {}  # the runs results.json lists, not every seed folder left on disk
        for run in _listed_runs(bench_dir, name, entry):
            log_path = Path(run.get("run_dir") or Path(run["embeddings"]).parents[1]) / "log.jsonl"
            if log_path.is_file():
                logs[f"seed{run['seed']} fold{run['fold']}"] = read_jsonl(log_path)
        logs = {k: v for k, v in logs.items() if v}
        if logs:
            png = figures.save_figure(figures.training_curves(logs), fig_dir / f"curves_{_slug(name)}")
            curve_figs.append(Figure(png[0], f"{name}: training curves of the final runs", png[1]))
    if curve_figs:
        sections.append(Section("Training curves", ["One line per fold model and seed."], [], curve_figs))
    best_name = rows[best][0]
    best_runs = _listed_runs(bench_dir, best_name, methods[best_name])
    test, missing = _concatenated_test(best_runs, best_name, options)
    before = (_concatenated_test(_listed_runs(bench_dir, "pretrained", methods["pretrained"]), "pretrained")[0]
              if best_name != "pretrained" and "pretrained" in methods else None)
    if test is not None:
        seeds = sorted({int(r["seed"]) for r in best_runs})
        # the figures are one seed's models, the table the mean over seeds: said, not left to guess
        seed_note = (f"The figures below show {best_name}'s fold models of seed {seeds[0]} only (the "
                     f"smallest seed number), concatenated; the table above is the mean over "
                     f"{len(seeds)} seeds." if len(seeds) > 1 else
                     f"The figures below show {best_name}'s fold models of seed {seeds[0]}, concatenated.")
        sections += _embedding_sections(test, before, {}, fig_dir, options,
                                        f"{best_name} (concatenated fold models of seed {seeds[0]})",
                                        "untrained" if best_name == "pretrained" else "after training",
                                        notes=[seed_note])
    elif missing:  # a part of the concatenation would be drawn as the whole
        sections.append(Section("Embeddings", [
            f"No embedding figures for {best_name}: the concatenated fold models need every fold's "
            f"test embeddings, and {', '.join(str(m) for m in missing)} "
            f"{'is' if len(missing) == 1 else 'are'} missing (rerun `dmlkit bench CONFIG --stage final`)."],
            [], []))
    sections.append(_config_section(bench_dir))
    return f"dmlkit benchmark report: {bench_dir.name}", f"Benchmark directory {bench_dir.resolve()}", sections


def _bold_cells(results: Mapping[str, Any], rows: Sequence[Sequence[str]],
                metrics: Sequence[str]) -> set[tuple[int, int]]:
    """``(row, column)`` of the results table's cells that :func:`best_cells` calls best (column
    0 is the method, then each mode's ``metrics``)."""
    best = best_cells(results)
    columns = [(mode, m) for mode in ("concatenated", "separated") for m in metrics]
    return {(i, j + 1) for i, row in enumerate(rows) for j, key in enumerate(columns)
            if row[0] in best.get(key, ())}


def _listed_runs(bench_dir: Path, method: str, entry: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The final runs of ``method`` that ``results.json`` lists (``seed``, ``fold``, ``run_dir``,
    ``embeddings``), by seed and fold as numbers: seed folders left on disk by an earlier
    config are not the table's. A results file without ``runs`` (hand-written) falls back to
    the ``final/<method>/seed<S>/fold<F>`` folders."""
    if entry.get("runs") is not None:
        runs = [dict(r) for r in entry["runs"]]
    else:
        runs = []
        for fold_dir in (bench_dir / "final" / method).glob("seed*/fold*"):
            seed, fold = fold_dir.parent.name[4:], fold_dir.name[4:]
            if seed.isdigit() and fold.isdigit():
                runs.append({"seed": int(seed), "fold": int(fold), "run_dir": str(fold_dir),
                             "embeddings": str(fold_dir / "embeddings" / "test.npz")})
    return sorted(runs, key=lambda r: (int(r["seed"]), int(r["fold"])))


def _concatenated_test(runs: Sequence[Mapping[str, Any]], method: str,
                       options: ReportOptions | None = None) -> tuple[_Split | None, list[Path]]:
    """The first seed's (the smallest, as a number: seed2 before seed10) fold models' test
    embeddings that ``results.json`` lists for ``method``, concatenated as the benchmark scores
    them (:func:`dmlkit.validation.concatenate_normalized`: each part normalised, then the whole),
    and the fold files that are missing: with any missing there is no concatenation (a part of
    it, drawn as the whole, was captioned as the concatenated model). A file whose digest is not
    the one ``results.json`` recorded (:func:`load_listed_embeddings`, as ``dmlkit compare``
    checks) is refused: it is not what the table was computed on.

    With ``options`` the split also gets the class names and thumbnails of the first fold's
    file (:func:`~dmlkit.report.saved.saved_figure_data`: the fold run's ``split.json``, its
    dataset where it loads), and notes of what is missing; the files store class ids only."""
    if not runs:
        return None, []
    first = min(int(r["seed"]) for r in runs)
    fold_runs = sorted((r for r in runs if int(r["seed"]) == first), key=lambda r: int(r["fold"]))
    files = [Path(r["embeddings"]) for r in fold_runs]
    missing = [f for f in files if not f.exists()]
    if missing:
        return None, missing
    parts = []
    labels = None
    first_extra: Mapping[str, np.ndarray] = {}
    for run, f in zip(fold_runs, files):
        emb, lab, extra = load_listed_embeddings(run, method)
        if labels is not None and not np.array_equal(lab, labels):
            raise DataError(f"{f}: test labels differ between folds; cannot concatenate")
        labels, first_extra = lab, first_extra or extra
        parts.append(emb)
    emb = concatenate_normalized(parts)
    if options is None:  # the names of a file saved with class-name labels, no more
        return _Split("test", emb, labels, class_names=file_class_names(first_extra)), []
    run0 = fold_runs[0]
    found = saved_figure_data(files[0], labels, first_extra, Path(run0.get("run_dir") or files[0].parents[1]),
                              data_root=options.data_root, thumbnails=options.thumbnails)
    return _Split("test", emb, labels, found.image_of, found.class_names, found.notes), []


def mean_of(cell: Any) -> float:
    """The ``mean`` of a ``results.json`` cell (or the number itself; NaN when missing)."""
    if isinstance(cell, Mapping):
        mean = cell.get("mean")  # null: a NaN mean as results.json stores it
        return float("nan") if mean is None else float(mean)
    return float(cell) if cell is not None else float("nan")


def _slug(name: str) -> str:
    """A file-name part for ``name``, one per name: a plain name (lowercase ASCII letters, digits,
    ``_``) as it is, any other with each other character as ``_`` and 8 hex digits of the name's
    SHA-256 (``ms-1`` and ``ms_1``, or ``MS`` and ``ms`` on a case-insensitive disk, wrote one
    ``curves_ms_1.png``, shown under both methods' captions)."""
    safe = "".join(ch if ch.isascii() and ch.isalnum() else "_" for ch in name)
    if safe == name and name == name.lower():
        return name
    return f"{safe}_{hashlib.sha256(name.encode()).hexdigest()[:8]}"
