"""The report's figure functions on small synthetic inputs: they draw what they are given."""

import errno
import io
import os
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
from matplotlib.figure import Figure

import dmlkit.utils
from dmlkit.exceptions import DataError, ShapeError
from dmlkit.report import figures


def _clustered(n_per=15, classes=4, dim=16, seed=0):
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, dim)) * 3
    x = np.concatenate([c + rng.normal(size=(n_per, dim)) for c in centres]).astype(np.float32)
    y = np.repeat(np.arange(classes), n_per)
    return x, y


@pytest.mark.parametrize("method", ["pca", "tsne", "umap"])
def test_projection_separates_clusters(method):
    x, y = _clustered()
    pts = figures.project_2d(x, method, seed=0)
    assert pts.shape == (len(x), 2) and np.isfinite(pts).all()
    # class centroids in 2-D are farther apart than the spread within classes
    cents = np.stack([pts[y == c].mean(0) for c in range(4)])
    within = np.mean([np.linalg.norm(pts[y == c] - cents[c], axis=1).mean() for c in range(4)])
    between = np.mean([np.linalg.norm(a - b) for i, a in enumerate(cents) for b in cents[i + 1:]])
    assert between > 2 * within


def test_projection_rejects_bad_input():
    with pytest.raises(ShapeError):
        figures.project_2d(np.zeros(5))
    with pytest.raises(ValueError, match="unknown projection"):
        figures.project_2d(np.zeros((5, 3)), "isomap")
    # 3 rows: umap's spectral start failed with a traceback; PCA draws them
    three = np.eye(3, 4, dtype=np.float32)
    np.testing.assert_array_equal(figures.project_2d(three, "umap"), figures.project_2d(three, "pca"))


def test_figures_save_png_and_svg(tmp_path):
    x, y = _clustered()
    pts = figures.project_2d(x, "pca")
    thumbs = {0: np.ones((8, 8)) * 0.5}
    fig = figures.embedding_map(pts, y, "PCA of test embeddings", thumbnails=thumbs)
    written = figures.save_figure(fig, tmp_path / "map")
    assert {p.suffix for p in written} == {".png", ".svg"}
    assert all(p.stat().st_size > 1000 for p in written)
    assert (tmp_path / "map.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _small_map():
    x, y = _clustered()
    return figures.embedding_map(figures.project_2d(x, "pca"), y, "PCA")


def test_an_interrupted_save_keeps_the_earlier_figures(tmp_path, monkeypatch):
    """`dmlkit plot` / `report` drew into the open file (`savefig(path)`): a kill while saving
    turned a complete map.png / map.svg into a 0-byte or truncated file. The figure is rendered
    in memory and renamed into place, so an interruption (here a KeyboardInterrupt mid-render
    for the SVG, mid-write for the PNG) leaves the earlier file as it was."""
    figures.save_figure(_small_map(), tmp_path / "map")
    before = {f: (tmp_path / f"map.{f}").read_bytes() for f in ("png", "svg")}
    real_draw, real_save = Figure.draw, PIL.Image.Image.save

    def draw_then_killed(self, renderer):
        real_draw(self, renderer)
        raise KeyboardInterrupt  # the SVG backend draws into the open file

    def half_written_then_killed(self, fp, *args, **kwargs):
        data = io.BytesIO()
        real_save(self, data, *args, **kwargs)
        cut = data.getvalue()[:100]
        if isinstance(fp, str | os.PathLike):
            Path(fp).write_bytes(cut)
        else:
            fp.write(cut)
        raise KeyboardInterrupt

    monkeypatch.setattr(Figure, "draw", draw_then_killed)
    with pytest.raises(KeyboardInterrupt):
        figures.save_figure(_small_map(), tmp_path / "map", formats=("svg",))
    monkeypatch.setattr(Figure, "draw", real_draw)
    monkeypatch.setattr(PIL.Image.Image, "save", half_written_then_killed)
    with pytest.raises(KeyboardInterrupt):
        figures.save_figure(_small_map(), tmp_path / "map", formats=("png",))
    assert {f: (tmp_path / f"map.{f}").read_bytes() for f in ("png", "svg")} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["map.png", "map.svg"]


def test_a_failed_figure_write_names_the_file(tmp_path, monkeypatch):
    """Disk full while saving said "file error: No space left on device" (a write error carries
    no file name) and left a truncated SVG: now one DataError line naming the figure, and no file."""
    def disk_full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(dmlkit.utils.os, "fsync", disk_full)
    with pytest.raises(DataError, match=r"cannot write .*map\.svg: No space left.*disk is full"):
        figures.save_figure(_small_map(), tmp_path / "map", formats=("svg",))
    assert list(tmp_path.iterdir()) == []


def test_histogram_panel_titles_show_js():
    edges = np.linspace(-1, 1, 11)
    h = {"bin_edges": edges, "positive_density": np.r_[np.zeros(5), np.full(5, 1.0)],
         "negative_density": np.r_[np.full(5, 1.0), np.zeros(5)], "js_divergence": 1.0}
    fig = figures.similarity_histograms({"after training": h})
    assert "JS divergence = 1.000" in fig.axes[0].get_title()


def test_curves_gallery_bars_improvement():
    log = [{"event": "train", "step": s, "loss": 1.0 / (s + 1)} for s in range(20)]
    log += [{"event": "eval", "step": s, "map_at_r": 0.1 * k, "precision_at_1": 0.2 * k} for k, s in enumerate((5, 10, 15))]
    fig = figures.training_curves({"fold 0": log})
    assert len(fig.axes) == 3 and fig.axes[1].get_ylabel() == "MAP@R (%)"
    # a run evaluated once: its one validation point is drawn (a fractional markevery drew none)
    once = figures.training_curves({"1 epoch": log[:20] + log[20:21]})
    once.canvas.draw()
    line = once.axes[1].get_lines()[0]
    assert len(line.get_xdata()) == 1 and line.get_markevery() == 1
    rows = [{"query": 0, "query_label": 1, "neighbors": [1, 2], "neighbor_labels": [1, 3], "caption": "q"}]
    fig = figures.retrieval_gallery(rows, image_of=lambda i: np.zeros((6, 6)))
    assert "correct" in fig.axes[1].get_xlabel() and "wrong" in fig.axes[2].get_xlabel()
    fig = figures.per_class_bars({c: c / 10 for c in range(30)}, top=5)
    # fewer classes than `top`: the titles count the bars drawn; one class ranks nothing
    few = figures.per_class_bars({0: 0.5, 1: 0.9, 2: 0.7}, top=10)
    assert few.axes[0].get_title() == "3 best classes"
    with pytest.raises(DataError, match="at least 2 classes"):
        figures.per_class_bars({0: 1.0})
    assert len(fig.axes[0].patches) == 5
    fig = figures.relative_improvement({"contrastive": {"map_at_r": 0.2}, "triplet": {"map_at_r": 0.25}, "arcface": {"map_at_r": 0.3}})
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert "+50.0" in labels and "+20.0" in labels
    with pytest.raises(DataError):
        figures.relative_improvement({"arcface": {"map_at_r": 0.3}})


def test_curves_name_every_run_and_refuse_damaged_records():
    """With more than four runs the one legend came from the loss panel alone, so a run logged
    without losses was drawn unnamed; a record without a step, or a loss that is no number,
    gave a KeyError / ValueError traceback."""
    runs = {f"run{i}": [{"event": "train", "step": 1, "loss": 1.0}, {"event": "eval", "step": 1, "map_at_r": 0.2}]
            for i in range(4)}
    runs["evals only"] = [{"event": "eval", "step": 1, "map_at_r": 0.3}]
    fig = figures.training_curves(runs)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [*(f"run{i}" for i in range(4)), "evals only"]
    for record in ({"event": "train", "loss": 0.5}, {"event": "train", "step": 1, "loss": "abc"}):
        with pytest.raises(DataError, match="log record"):
            figures.training_curves({"damaged": [record]})


def test_improvement_without_a_method_besides_the_baselines_is_refused():
    with pytest.raises(DataError, match="no method besides the baselines"):
        figures.relative_improvement({"contrastive": {"map_at_r": 0.3}, "triplet": {"map_at_r": 0.2}})
