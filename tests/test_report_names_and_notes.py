"""Report and plot audit (s40_report): user names drawn literally, never as mathtext; the figures
of saved embeddings files named by class with thumbnails, or a note saying why not; the map's
legend and thumbnails; what compare's CI holds; the patches table's bold cells; the notes of the
run and bench pages. Small synthetic inputs (a 4-class image folder of 8 x 8 images); most
figures are not drawn (``figures.save_figure`` writes a 2 x 2 PNG)."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest
import yaml
from matplotlib.offsetbox import AnnotationBbox
from matplotlib.text import Text
from PIL import Image
from typer.testing import CliRunner

from _reference import bench_entries
from dmlkit.cli import app
from dmlkit.data.splits import ClassSplit
from dmlkit.embeddings import dataset_items, save_embeddings
from dmlkit.report import figures
from dmlkit.report.builder import ReportOptions, _concatenated_test, build_report
from dmlkit.report.sections import _embedding_sections, _Split

FRAC = r"bad $\frac$ x"  # invalid mathtext: a ParseSyntaxException when parsed
DOLLARS = "price $5 or $6"  # valid mathtext: drawn as "price 5*or*6" when parsed
NAMES = ["alpha", FRAC, DOLLARS, "zeta"]


def _literal(fig) -> list[str]:
    """The texts of ``fig`` holding a ``$``, each checked to be drawn as written (not mathtext),
    after drawing the figure outside dmlkit's settings (tick labels are made at draw time)."""
    fig.savefig(io.BytesIO(), format="png")  # the caller's rcParams: parse_math on
    texts = [t for t in fig.findobj(Text) if "$" in t.get_text()]
    assert all(t.get_parse_math() is False for t in texts), [t.get_text() for t in texts]
    return [t.get_text() for t in texts]


# -- F1: names are text, not mathtext -------------------------------------------------------------
def test_class_file_and_run_names_with_dollars_draw_literally(tmp_path):
    assert matplotlib.rcParams["text.parse_math"] is True  # the caller's default
    dpi = matplotlib.rcParams["savefig.dpi"]
    names = {0: FRAC, 1: DOLLARS, 2: "c"}
    fig = figures.per_class_bars({0: 0.5, 1: 0.7, 2: 0.9}, class_names=names)
    assert {FRAC, DOLLARS} <= set(_literal(fig))
    figures.save_figure(fig, tmp_path / "per_class", formats=("png",))  # raised ValueError
    pts = np.random.default_rng(0).normal(size=(9, 2))
    fig = figures.embedding_map(pts, np.repeat([0, 1, 2], 3), f"PCA of cost {FRAC}.npz", class_names=names)
    assert {FRAC, DOLLARS, f"PCA of cost {FRAC}.npz (3 classes, 9 points)"} <= set(_literal(fig))
    plt.close(fig)
    rows = [{"query": 0, "query_label": 0, "neighbors": [1], "neighbor_labels": [1], "caption": "q"}]
    fig = figures.retrieval_gallery(rows, None, class_names=names)
    assert FRAC in _literal(fig)
    plt.close(fig)
    fig = figures.training_curves({f"run {FRAC}": [{"event": "train", "step": 1, "loss": 1.0},
                                                   {"event": "train", "step": 2, "loss": 0.5}]})
    assert f"run {FRAC}" in _literal(fig)
    plt.close(fig)
    hist = {"bin_edges": np.linspace(0, 1, 3), "positive_density": np.array([0.5, 1.5]),
            "negative_density": np.array([1.5, 0.5]), "js_divergence": 0.2}
    fig = figures.similarity_histograms({f"cost {FRAC}": hist})
    assert _literal(fig)
    plt.close(fig)
    # dmlkit's settings hold while its figures are built: the caller's are as they were
    assert matplotlib.rcParams["text.parse_math"] is True and matplotlib.rcParams["savefig.dpi"] == dpi


def test_tracking_and_patch_figures_draw_names_literally():
    from dmlkit.apps.patches import hardest_pairs_figure
    from dmlkit.apps.tracking.evaluation import evaluate_ope, plot_ope

    boxes = np.array([[10.0, 10, 20, 20]] * 5)
    result = evaluate_ope({"seq": boxes + 1}, {"seq": boxes})
    fig = plot_ope({FRAC: result, DOLLARS: result}, title=f"OTB {DOLLARS}")
    shown = " ".join(_literal(fig))
    assert FRAC in shown and DOLLARS in shown
    plt.close(fig)
    patches = np.zeros((4, 8, 8), np.uint8)
    fig = hardest_pairs_figure(patches, np.array([0, 1]), np.array([2, 3]), np.array([0, 1]),
                               np.array([0.9, 0.1]), k=1, title=f"liberty {FRAC}")
    assert f"liberty {FRAC}" in _literal(fig)


# -- F2: the figures of a saved test.npz name classes and show thumbnails ------------------------
@pytest.fixture
def run(tmp_path) -> Path:
    """A run directory as `dmlkit train` leaves it (config.yaml, split.json with class names,
    embeddings/test.npz with class ids, rows and paths) over a 4-class image folder."""
    from dmlkit.config import load_config
    from dmlkit.training.data_root import load_dataset_at

    root = tmp_path / "images"
    for i, name in enumerate(NAMES):
        (root / name).mkdir(parents=True)
        for j in range(3):
            Image.fromarray(np.full((8, 8), 40 * i + 10 * j, np.uint8)).save(root / name / f"{j}.png")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(
        {"data": {"dataset": "image_folder", "root": str(root)}, "loss": {"name": "contrastive"}}))
    ds = load_dataset_at(load_config(run_dir / "config.yaml").data, None, fix="")
    ClassSplit(train=[0], test=[1, 2, 3]).naming(ds.class_names).to_json(run_dir / "split.json")
    test = ds.subset_classes([1, 2, 3])
    emb = np.random.default_rng(0).normal(size=(len(test), 4)).astype(np.float32)
    save_embeddings(run_dir / "embeddings" / "test.npz", emb, test.labels, **dataset_items(test, root))
    return run_dir


def test_bench_figures_of_saved_files_name_classes_and_show_thumbnails(run):
    npz = run / "embeddings" / "test.npz"
    split, _ = _concatenated_test([{"seed": 0, "fold": 0, "run_dir": str(run), "embeddings": str(npz)}],
                                  "ms", ReportOptions())
    assert split.class_names == {0: "alpha", 1: FRAC, 2: DOLLARS, 3: "zeta"}  # split.json's
    assert split.image_of is not None and split.image_of(3).shape[:2] == (8, 8)
    assert float(split.image_of(3).mean()) == pytest.approx((40 * 2 + 0) / 255)  # row 3: class 2, image 0
    assert not split.notes


def test_plot_of_a_runs_test_file_names_classes(run, tmp_path, monkeypatch):
    seen = {}

    def capture(name):
        original = getattr(figures, name)

        def wrapped(*args, **kwargs):
            seen[name] = (args, kwargs)
            return original(*args, **kwargs)
        monkeypatch.setattr(figures, name, wrapped)

    for name in ("per_class_bars", "retrieval_gallery", "embedding_map"):
        capture(name)
    monkeypatch.setattr(figures, "save_figure", lambda fig, base, formats=("png", "svg"): plt.close(fig) or [])
    npz = str(run / "embeddings" / "test.npz")
    runner = CliRunner()
    for args in (["per-class", npz], ["gallery", npz, "--queries", "2", "--k", "2"], ["map", npz, "--method", "pca"]):
        res = runner.invoke(app, ["plot", *args, "-o", str(tmp_path / "f")])
        assert res.exit_code == 0, res.output
    assert seen["per_class_bars"][1]["class_names"][1] == FRAC
    args, kwargs = seen["retrieval_gallery"]
    assert kwargs["class_names"][2] == DOLLARS and args[1] is not None  # thumbnails
    args, kwargs = seen["embedding_map"]
    assert kwargs["class_names"][3] == "zeta" and args[3]  # thumbnails at some points


def test_names_and_thumbnails_that_cannot_be_had_are_said(run):
    from dmlkit.embeddings import load_embeddings
    from dmlkit.report.saved import saved_figure_data

    npz = run / "embeddings" / "test.npz"
    emb, labels, extra = load_embeddings(npz)
    # the images moved: names from split.json, no thumbnails, and why
    data = run.parent / "images"
    data.rename(run.parent / "moved")
    found = saved_figure_data(npz, labels, extra)
    assert found.class_names[1] == FRAC and found.image_of is None
    assert any(n.startswith("No thumbnails: the run's dataset could not be read") for n in found.notes)
    # no split.json either: the class folders of the file's paths, said so
    (run / "split.json").unlink()
    found = saved_figure_data(npz, labels, extra)
    assert found.class_names == {1: FRAC, 2: DOLLARS, 3: "zeta"}
    assert any("named by the folders" in n for n in found.notes)
    # a file outside any run, without paths: ids, said so
    bare = run.parent / "bare.npz"
    save_embeddings(bare, emb, labels)
    found = saved_figure_data(bare, labels, {})
    assert found.class_names is None and found.image_of is None
    assert any(n.startswith("Classes are shown by their ids") for n in found.notes)
    # other data at the file's rows: never drawn as its images
    (run.parent / "moved").rename(data)
    shifted = dict(extra, paths=np.asarray([p.replace("0.png", "1.png") for p in extra["paths"].tolist()]))
    found = saved_figure_data(npz, labels, shifted)
    assert found.image_of is None and any("other files" in n for n in found.notes)


@pytest.fixture
def no_drawing(monkeypatch):
    """``figures.save_figure`` closes the figure and writes a tiny PNG."""
    def save(fig, base, formats=("png", "svg")):
        plt.close(fig)
        Path(base).parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (2, 2)).save(f"{base}.png")
        return [Path(f"{base}.png"), None]

    monkeypatch.setattr(figures, "save_figure", save)


def _paragraphs(html: str) -> str:
    return " ".join(re.sub(r"<[^>]+>", "", p) for p in re.findall(r"<p[^>]*>(.*?)</p>", html, re.S))


def test_bench_page_says_which_seed_and_why_classes_are_ids(tmp_path, no_drawing):
    from dmlkit.protocol.config import bench_config_from_dict
    from dmlkit.protocol.results import build_results, write_results
    from dmlkit.protocol.splits import make_bench_split

    labels = np.repeat(np.arange(6), 4)
    cfg = bench_config_from_dict({
        "name": "b", "fixed": {"data": {"dataset": "omniglot"}, "model": {"embedding_size": 8}},
        "protocol": {"seeds": [0, 1, 2], "trials": 1},
        "methods": [{"name": "contrastive", "loss": {"name": "contrastive"}},
                    {"name": "ms", "loss": {"name": "multi_similarity"}}]})
    entries = bench_entries(tmp_path, cfg, labels, 6)
    write_results(build_results(cfg, make_bench_split(range(12), "halves", folds=2), entries,
                                bench_dir=tmp_path), tmp_path)
    text = _paragraphs(build_report(tmp_path, options=ReportOptions(maps=("pca",))).read_text())
    assert "fold models of seed 0 only" in text and "mean over 3 seeds" in text
    # the fold files hold ids only and their runs no config: said, as the module docstring promises
    assert "Classes are shown by their ids" in text and "No thumbnails" in text


# -- F4: the map's legend and thumbnails -------------------------------------------------------------
def test_map_of_twenty_classes_names_them_beside_the_axes_and_thumbnails_hide_no_point():
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(20), 5)
    pts = rng.normal(size=(100, 2)) + labels[:, None]
    thumbs = {i: np.full((8, 8), 0.5) for i in range(0, 100, 9)}
    fig = figures.embedding_map(pts, labels, "UMAP", thumbs, class_names={i: f"c{i}" for i in range(20)})
    ax = fig.axes[0]
    legend = ax.get_legend()
    assert legend is not None and [t.get_text() for t in legend.get_texts()] == [f"c{i}" for i in range(20)]
    fig.canvas.draw()
    assert legend.get_window_extent().x0 >= ax.get_window_extent().x1  # beside, covering no point
    boxes = [a for a in ax.artists if isinstance(a, AnnotationBbox)]
    assert len(boxes) == len(thumbs)
    points_z = min(c.get_zorder() for c in ax.collections)
    assert all(b.get_zorder() < points_z for b in boxes)  # under every point
    assert all(np.hypot(*b.xybox) >= 20 and b.boxcoords == "offset points" for b in boxes)  # beside
    plt.close(fig)
    many = np.repeat(np.arange(45), 2)
    fig = figures.embedding_map(rng.normal(size=(90, 2)), many, "PCA")
    assert fig.axes[0].get_legend() is None and "too many classes to name" in fig.axes[0].get_title()
    plt.close(fig)


# -- F3 / F6f: compare's terminal table says what the CI holds and the threshold -----------------
def test_compare_terminal_marks_a_ci_over_queries_only_and_states_the_threshold(tmp_path, monkeypatch):
    import dmlkit.protocol.compare as compare

    def row(variance):
        return {"a": "x", "b": "y", "mode": "concatenated", "metric": "map_at_r", "diff": 0.01,
                "ci_low": -0.02, "ci_high": 0.04, "p": 0.5, "p_holm": None, "significant": None,
                "variance": variance}

    report = {"warnings": [], "seeds": {"x": 1, "y": 1}, "queries": 10, "confidence": 0.95,
              "relative_improvement": {},
              "comparisons": [row("queries only (one seed each: the seed variance is unknown)"),
                              row("seeds and queries")]}
    monkeypatch.setattr(compare, "compare_results", lambda *a, **k: report)
    res = CliRunner().invoke(app, ["compare", str(tmp_path)], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    out = re.sub(r"\s+", " ", res.output)  # the title and caption wrap at the table's width
    assert "significant = Holm-adjusted p < 0.05" in out
    assert out.count("[-2.00, +4.00] (queries only)") == 1 and out.count("[-2.00, +4.00]") == 2
    assert "(queries only): the CI holds the variance of queries only (one seed each" in out
    markdown = compare.render_compare_markdown({**report, "min_seeds_for_significance": 3})
    assert markdown.count("[-2.00, +4.00] (queries only)") == 1 and markdown.count("[-2.00, +4.00]") == 2
    assert "A CI marked (queries only) holds the variance of queries only (one seed each" in markdown


# -- F5: the patches table bolds the lowest FPR95 as shown --------------------------------------
def test_patches_table_bolds_ties_at_the_shown_decimals_and_ignores_nan(monkeypatch):
    from rich.console import Console

    import dmlkit.commands._console as console_module
    from dmlkit.commands.patches import _print_table

    console = Console(record=True, width=120, force_terminal=True)
    monkeypatch.setattr(console_module, "output_console", lambda *a, **k: console)
    results = {"architectures": ["a", "b", "c"],
               "rows": [{"train": "liberty", "test": "notredame", "a": {"fpr95": 0.05001},
                         "b": {"fpr95": 0.05002}, "c": {"fpr95": 0.2}},
                        {"train": "liberty", "test": "yosemite", "a": {"fpr95": float("nan")},
                         "b": {"fpr95": 0.1}, "c": {"fpr95": 0.3}}],
               "mean": {"a": {"fpr95": 0.1}, "b": {"fpr95": 0.07501}, "c": {"fpr95": 0.25}}}
    _print_table(results, "t", False)
    text = console.export_text(styles=True)
    bold = "\x1b[1m"
    lines = {line.split("│")[2].strip(): line for line in text.splitlines() if line.count("│") > 3}
    assert lines["notredame"].count(f"{bold}5.00") == 2  # both shown 5.00: both bold
    assert f"{bold}10.00" in lines["yosemite"]  # the NaN in the first cell hid it
    assert f"{bold}20.00" not in text and f"{bold}7.50" in text


# -- F6: the run page's warning, pos_neg_js's resolution, failed panels, labels ----------------------
def test_run_page_says_training_did_not_beat_step_0(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump({"data": {"dataset": "image_folder", "root": str(tmp_path / "x")},
                                                     "loss": {"name": "contrastive"}}))
    (run / "metrics.json").write_text(json.dumps({
        "val": {"map_at_r": 0.7216}, "test": {"map_at_r": 0.70},
        "baseline": {"val": {"map_at_r": 0.7586}, "test": {"map_at_r": 0.60}}}))
    (run / "log.jsonl").write_text("")
    with pytest.warns(UserWarning, match="could not be loaded"):
        text = _paragraphs(build_report(run, options=ReportOptions(maps=())).read_text())
    assert ("training did not beat the untrained model on val: MAP@R 72.16 after training vs 75.86 "
            "at step 0") in text
    assert "on test" not in text


def test_pos_neg_js_in_one_bin_is_marked_and_a_failed_panel_comes_last(tmp_path, no_drawing):
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(4), 5)
    tight = (np.ones((20, 8)) + 1e-3 * rng.normal(size=(20, 8))).astype(np.float32)  # cosines ~ 1
    one_class = _Split("test", rng.normal(size=(20, 8)).astype(np.float32), np.zeros(20, np.int64))
    sections = _embedding_sections(_Split("test", tight, labels), one_class, {}, tmp_path,
                                   ReportOptions(maps=()), "the model", notes=["seed note"])
    hist = sections[0]
    assert hist.paragraphs[0] == "seed note"
    rows = re.findall(r"<tr>(.*?)</tr>", hist.html_blocks[0])[1:]
    cells = [re.findall(r"<td>(.*?)</td>", r) for r in rows]
    assert cells[0][0] == "test, after training" and "unreliable" in cells[0][2]
    assert cells[1] == ["test, before training", "not drawn", "n/a", "n/a", "n/a"]  # last, no reason
    notes = " ".join(hist.html_blocks[1:])
    assert "pos_neg_js of test, after training: every pair&#x27;s cosine similarity lies in" in notes
    assert "test, before training: not drawn: no negative pair" in notes


def test_titles_and_labels_say_what_they_show(tmp_path):
    assert figures.projection_title("tsne", 100, 8) == "t-SNE"
    fig = figures.per_class_bars({0: 0.5, 1: 0.7})
    assert fig.axes[0].get_legend().get_texts()[0].get_text() == "mean over classes 60.0%"
    plt.close(fig)
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"methods": {
        "contrastive": {"separated": {"map_at_r": {"mean": 0.5}}}, "ms": {"separated": {"map_at_r": {"mean": 0.6}}}}}))
    res = CliRunner().invoke(app, ["plot", "improvement", str(results), "--mode", "separated",
                                   "-o", str(tmp_path / "imp")])
    assert res.exit_code == 0, res.output
    svg = (tmp_path / "imp.svg").read_text()
    assert "Relative improvement in MAP@R (separated)" in svg
