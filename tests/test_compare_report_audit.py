"""Compare / plot / report audit: panels and lines of one name, the projection a map names, NaN
bars in the relative-improvement figure, null means in results.json. Small synthetic inputs only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest

from _reference import bench_entries
from dmlkit.embeddings import save_embeddings
from dmlkit.report import figures

LABELS = np.repeat(np.arange(6), 4)


def _emb_file(path, seed=0, dim=8):
    x = np.random.default_rng(seed).normal(size=(LABELS.size, dim)).astype(np.float32)
    return save_embeddings(path, x, LABELS)


def _capture(monkeypatch, name):
    """Replace ``figures.<name>`` by a recorder of its arguments that returns an empty figure."""
    calls = []

    def fake(*args, **kwargs):
        calls.append((args, kwargs))
        return plt.figure()

    monkeypatch.setattr(figures, name, fake)
    return calls


# -- plot histograms / curves: two inputs of one name ----------------------------------------
def test_histograms_of_two_files_of_one_name_draw_two_panels(tmp_path, run_cli, monkeypatch):
    a, b = _emb_file(tmp_path / "runA" / "test.npz", 0), _emb_file(tmp_path / "runB" / "test.npz", 1)
    calls = _capture(monkeypatch, "similarity_histograms")
    code, _, err = run_cli(["plot", "histograms", str(a), str(b), str(a), "-o", str(tmp_path / "h")])
    assert code == 0, err
    assert list(calls[0][0][0]) == ["runA/test", "runB/test", "runA/test (2)"]


def test_curves_of_two_runs_of_one_name_draw_two_lines(tmp_path, run_cli, monkeypatch):
    dirs = []
    for bench, loss in (("x", 1.0), ("y", 2.0)):
        d = tmp_path / bench / "fold0"
        d.mkdir(parents=True)
        (d / "log.jsonl").write_text(json.dumps({"event": "train", "step": 1, "loss": loss}) + "\n")
        dirs.append(str(d))
    calls = _capture(monkeypatch, "training_curves")
    code, _, err = run_cli(["plot", "curves", *dirs, "-o", str(tmp_path / "c")])
    assert code == 0, err
    logs = calls[0][0][0]
    assert list(logs) == ["x/fold0", "y/fold0"]
    assert [r[0]["loss"] for r in logs.values()] == [1.0, 2.0]


# -- plot map: the title names the projection drawn ------------------------------------------
def test_map_without_umap_learn_is_titled_pca(tmp_path, run_cli, monkeypatch):
    path = _emb_file(tmp_path / "e.npz")
    monkeypatch.setitem(sys.modules, "umap", None)  # umap-learn not installed: PCA draws the map
    calls = _capture(monkeypatch, "embedding_map")
    code, _, err = run_cli(["plot", "map", str(path), "-o", str(tmp_path / "m")])
    assert code == 0, err
    title = calls[0][0][2]
    assert title.startswith("PCA") and "UMAP needs umap-learn" in title


def test_map_of_2d_embeddings_is_not_titled_tsne(tmp_path, run_cli, monkeypatch):
    path = _emb_file(tmp_path / "e.npz", dim=2)
    calls = _capture(monkeypatch, "embedding_map")
    code, _, err = run_cli(["plot", "map", str(path), "--method", "tsne", "-o", str(tmp_path / "m")])
    assert code == 0, err
    assert "TSNE" not in calls[0][0][2] and calls[0][0][2].startswith("2-D embeddings")


def test_projection_title_names_the_requested_method_when_drawn():
    assert figures.projection_title("pca", 10, 8) == "PCA"
    assert figures.drawn_projection("umap", 3, 8) == "pca"
    assert figures.drawn_projection("tsne", 10, 8) == "tsne"


# -- relative improvement: NaN is n/a, not an empty bar on the zero line ----------------------
def test_relative_improvement_labels_a_missing_value_n_a():
    values = {"contrastive": {"map_at_r": 0.2}, "triplet": {"map_at_r": 0.25},
              "ms": {"map_at_r": float("nan")}, "arc": {"map_at_r": 0.3}}
    fig = figures.relative_improvement(values)
    texts = [t.get_text() for t in fig.axes[0].texts]
    plt.close(fig)
    assert texts == ["n/a", "+50.0", "n/a", "+20.0"]


def test_relative_improvement_over_a_baseline_without_value_is_n_a():
    fig = figures.relative_improvement({"contrastive": {"map_at_r": float("nan")}, "ms": {"map_at_r": 0.3}})
    texts = [t.get_text() for t in fig.axes[0].texts]
    plt.close(fig)
    assert texts == ["n/a"]


# -- results.json with a null mean (a NaN mean as strict JSON stores it) ----------------------
def _results(tmp_path):
    from dmlkit.protocol.config import bench_config_from_dict
    from dmlkit.protocol.results import build_results, write_results
    from dmlkit.protocol.splits import make_bench_split

    cfg = bench_config_from_dict({
        "name": "audit", "fixed": {"data": {"dataset": "omniglot"}, "model": {"embedding_size": 8}},
        "protocol": {"seeds": [0, 1, 2], "trials": 1},
        "methods": [{"name": "contrastive", "loss": {"name": "contrastive"}},
                    {"name": "ms", "loss": {"name": "multi_similarity"}}]})
    entries = bench_entries(tmp_path, cfg, LABELS, 6)
    write_results(build_results(cfg, make_bench_split(range(12), "halves", folds=2), entries,
                                bench_dir=tmp_path), tmp_path)
    data = json.loads((tmp_path / "results.json").read_text())
    data["methods"]["ms"]["concatenated"]["map_at_r"]["mean"] = None
    (tmp_path / "results.json").write_text(json.dumps(data))
    return tmp_path / "results.json"


def test_compare_and_plot_improvement_read_a_null_mean_as_n_a(tmp_path, run_cli, monkeypatch):
    from dmlkit.protocol.compare import compare_results

    path = _results(tmp_path)
    report = compare_results([path], metrics=["map_at_r"], modes=["separated"])
    rel = report["relative_improvement"]["contrastive"]["relative_percent"]["ms"]
    assert rel["concatenated"]["map_at_r"] is None and rel["separated"]["map_at_r"] is not None
    code, out, err = run_cli(["compare", str(path), "--metric", "map_at_r"])
    assert code == 0, err
    assert "n/a" in out
    calls = _capture(monkeypatch, "relative_improvement")
    code, _, err = run_cli(["plot", "improvement", str(path), "-o", str(tmp_path / "i")])
    assert code == 0, err
    assert np.isnan(calls[0][0][0]["ms"]["map_at_r"])


@pytest.mark.parametrize("values", [(None, 0.2), (0.3, None), (0.3, 0.0), (0.3, float("nan"))])
def test_relative_percent_is_none_without_both_values(values):
    from dmlkit.protocol.compare import relative_percent

    assert relative_percent(*values) is None
    assert relative_percent(0.3, 0.2) == pytest.approx(50.0)


def test_report_map_without_umap_learn_is_titled_pca(tmp_path, monkeypatch):
    from dmlkit.report.builder import ReportOptions, _embedding_sections, _Split

    x = np.random.default_rng(0).normal(size=(LABELS.size, 8)).astype(np.float32)
    monkeypatch.setitem(sys.modules, "umap", None)
    calls = _capture(monkeypatch, "embedding_map")

    def no_files(fig, base, formats=("png", "svg")):  # the figures' drawing is not under test
        plt.close(fig)
        return [Path(f"{base}.{fmt}") for fmt in formats]

    monkeypatch.setattr(figures, "save_figure", no_files)
    sections = _embedding_sections(_Split("test", x, LABELS), None, {}, tmp_path,
                                   ReportOptions(maps=("umap",), thumbnails=False), "the model")
    assert calls[0][0][2].startswith("PCA (UMAP needs umap-learn")
    captions = [f.caption for s in sections for f in s.figures if "map of" in f.caption]
    assert captions and all(c.startswith("PCA") for c in captions)


def test_compare_names_the_run_file_that_holds_nan(tmp_path, run_cli):
    from dmlkit.embeddings import load_embeddings

    path = _results(tmp_path)
    bad = tmp_path / "ms" / "seed1" / "fold0" / "embeddings" / "test.npz"
    emb, labels, _ = load_embeddings(bad)
    emb[3, 0] = np.nan
    save_embeddings(bad, emb, labels)
    code, _, err = run_cli(["compare", str(path), "--metric", "map_at_r"])
    assert code == 2 and str(bad) in err and "NaN" in err, err


# -- seeds numpy and scikit-learn refuse are usage errors, not tracebacks -----------------------
@pytest.mark.parametrize("argv", [["plot", "gallery", "{f}", "--seed", "-1"],
                                  ["plot", "map", "{f}", "--method", "pca", "--seed", "-1"],
                                  ["plot", "map", "{f}", "--method", "pca", "--seed", str(2**32)],
                                  ["report", "{d}", "--seed", "-1"]])
def test_a_seed_outside_0_to_2_32_is_one_usage_error(tmp_path, run_cli, argv):
    path = _emb_file(tmp_path / "e.npz")
    argv = [a.format(f=path, d=tmp_path) for a in argv] + ["-o", str(tmp_path / "out")]
    code, out, err = run_cli(argv)
    assert code == 2 and "Traceback" not in err and "--seed" in err, err
    assert not list(tmp_path.glob("out*"))


def test_compare_prints_names_with_brackets_as_text(tmp_path, run_cli):
    path = _results(tmp_path)
    data = json.loads(path.read_text())
    data["name"] = "cub[v2]"
    other = tmp_path / "other.json"
    other.write_text(json.dumps(data))
    code, out, err = run_cli(["compare", str(path), str(other), "-m", "ms", "-m", "ms@cub[v2]",
                              "--metric", "map_at_r", "--mode", "separated"])
    assert code == 0, err
    assert "ms@cub[v2]" in out


def test_report_of_a_bench_with_a_null_mean_shows_n_a(tmp_path, run_cli):
    _results(tmp_path)
    code, out, err = run_cli(["report", str(tmp_path), "--maps", "pca", "-q"])
    assert code == 0, err
    page = (tmp_path / "report.html").read_text()
    row = next(line for line in page.splitlines() if line.startswith("<tr><td>ms</td>"))
    assert row.count("<td>n/a</td>") == 1


# -- -o with a dot in the name: the name is kept, not cut at the dot -----------------------------
def test_output_names_with_dots_are_kept(tmp_path, run_cli):
    path = _emb_file(tmp_path / "e.npz")
    for name in ("lr0.001", "lr0.01", "figure.png"):
        code, out, err = run_cli(["plot", "per-class", str(path), "-o", str(tmp_path / name)])
        assert code == 0, err
    assert sorted(p.name for p in tmp_path.glob("*.png")) == ["figure.png", "lr0.001.png", "lr0.01.png"]
    assert sorted(p.name for p in tmp_path.glob("*.svg")) == ["figure.svg", "lr0.001.svg", "lr0.01.svg"]


def test_results_markdown_reads_a_null_or_nan_mean_as_n_a_and_never_bolds_it(tmp_path):
    """Was: results.md's table raised a TypeError on a null mean, and a NaN mean in the first
    method's row stayed the column's best (bold)."""
    from dmlkit.protocol.results import render_markdown

    data = json.loads(_results(tmp_path).read_text())
    text = render_markdown(data)
    ms_row = next(line for line in text.splitlines() if line.startswith("| ms"))
    assert "n/a" in ms_row
    first = next(iter(data["methods"]))
    data["methods"][first]["concatenated"]["map_at_r"]["mean"] = float("nan")
    data["methods"]["ms"]["concatenated"]["map_at_r"]["mean"] = 0.5
    rows = {line.split("|")[1].strip(): line for line in render_markdown(data).splitlines() if line.startswith("|")}
    assert "**50.00" in rows["ms"] and "**nan" not in rows[first].lower()
