"""The HTML report of a small real run, rendered in headless Chromium."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _reference import TINY_ATT_FACES_RUN
from dmlkit.cli import app
from dmlkit.exceptions import DataError, DataNotFoundError
from dmlkit.report import ReportOptions, build_report

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

TINY_RUN = TINY_ATT_FACES_RUN


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_root) -> Path:
    import yaml

    base = tmp_path_factory.mktemp("report")
    config = base / "tiny.yaml"
    config.write_text(yaml.safe_dump(TINY_RUN))
    out = base / "run"
    res = CliRunner().invoke(app, ["train", str(config), "--run-dir", str(out),
                                   "--data-root", str(data_root), "--quiet"])
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture(scope="module")
def report_page(run_dir, data_root) -> Path:
    return build_report(run_dir, options=ReportOptions(maps=("pca",), data_root=data_root))


def test_report_has_every_section_and_figure(report_page):
    html = report_page.read_text()
    for title in ("Results", "Training curves", "Positive and negative pair similarities",
                  "Maps of the test embeddings", "Retrieval gallery", "Per-class MAP@R",
                  "Configuration and provenance"):
        assert f">{title}</h2>" in html, title
    # self-contained: images are data URIs, nothing is fetched from the network
    assert html.count('src="data:image/png;base64,') >= 5
    assert "http://" not in html.replace("http://www.w3.org", "") and "https://" not in html
    assert "<script" not in html
    # the divergence over the drawn bins and the metric (the value evaluate prints), both named
    assert "<th>JS, drawn bins</th>" in html.replace(' class="num"', "") or "JS, drawn bins" in html
    assert "pos_neg_js" in html
    figs = report_page.parent / "figures"
    for name in ("curves", "histograms", "map_pca", "gallery", "per_class"):
        assert (figs / f"{name}.png").stat().st_size > 5000
        assert (figs / f"{name}.svg").exists()


def test_embedded_figures_are_screen_sized_and_smaller_than_the_files(report_page):
    import base64
    import io
    import re

    from PIL import Image

    from dmlkit.report.html import SCREEN_WIDTH

    page = report_page.read_text()
    embedded = [base64.b64decode(b) for b in re.findall(r'src="data:image/png;base64,([^"]+)"', page)]
    assert embedded
    for data in embedded:
        with Image.open(io.BytesIO(data)) as im:
            assert im.width <= SCREEN_WIDTH
    files = sorted((report_page.parent / "figures").glob("*.png"))
    assert sum(map(len, embedded)) < 0.5 * sum(f.stat().st_size for f in files)


def test_report_shows_the_runs_numbers(report_page, run_dir):
    metrics = json.loads((run_dir / "metrics.json").read_text())
    html = report_page.read_text()
    assert f"{100 * metrics['test']['map_at_r']:.2f}" in html
    assert "before training" in html and "after training" in html


@pytest.mark.browser
@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed (apt-get install chromium)")
def test_report_renders_in_headless_chromium(report_page, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    errors: list[str] = []
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--no-first-run"],
        )
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("requestfailed", lambda r: errors.append(f"failed request {r.url}"))
        page.goto(report_page.as_uri())
        page.wait_for_load_state("load")
        images = page.eval_on_selector_all(
            "img", "els => els.map(e => [e.complete, e.naturalWidth, e.alt])")
        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert len(images) >= 5
    broken = [alt for complete, width, alt in images if not complete or width == 0]
    assert not broken, f"images that did not load: {broken}"
    assert not errors, errors
    assert shot.stat().st_size > 20000


def test_cli_report_and_plots(run_dir, tmp_path, data_root):
    runner = CliRunner()
    out = tmp_path / "r.html"
    res = runner.invoke(app, ["report", str(run_dir), "-o", str(out), "--maps", "pca", "-q",
                              "--data-root", str(data_root)])
    assert res.exit_code == 0, res.output
    # a page named other than report.html keeps its figures apart (pages sharing a folder linked
    # each other's figures)
    assert out.exists() and (tmp_path / "r_figures" / "gallery.png").exists()
    assert not (tmp_path / "figures").exists() and "r_figures/gallery.png" in out.read_text()
    emb = run_dir / "embeddings" / "test.npz"
    for args, made in (
        (["plot", "map", str(emb), "--method", "pca", "-o", str(tmp_path / "m")], "m.png"),
        (["plot", "histograms", str(emb), "-o", str(tmp_path / "h")], "h.png"),
        (["plot", "per-class", str(emb), "-o", str(tmp_path / "p")], "p.png"),
        (["plot", "gallery", str(emb), "-o", str(tmp_path / "g")], "g.png"),
        (["plot", "curves", str(run_dir), "-o", str(tmp_path / "c")], "c.png"),
    ):
        res = runner.invoke(app, args)
        assert res.exit_code == 0, (args, res.output)
        assert (tmp_path / made).stat().st_size > 5000


def test_report_errors_are_clear(tmp_path):
    with pytest.raises(DataNotFoundError, match="not a directory"):
        build_report(tmp_path / "missing")
    with pytest.raises(DataError, match="neither results.json"):
        build_report(tmp_path)


def test_a_damaged_metrics_json_is_one_error(run_dir, tmp_path):
    """`metrics.json` whose sections are not objects (hand-edited, or another tool's) was an
    AttributeError traceback; it is one DataError naming the section."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints", "embeddings"))
    (copy / "metrics.json").write_text(json.dumps({"val": {"map_at_r": "high"}, "test": 5}))
    with pytest.raises(DataError, match="'test' holds a JSON int"):
        build_report(copy)


def test_an_interrupted_run_shows_its_step_0_numbers_and_a_damaged_checkpoint_warns(run_dir, tmp_path, data_root):
    """No metrics.json yet: the table shows baseline.json's step-0 rows (it said only "no
    results"); a truncated best.pt is said on the terminal as well as in the page (the report
    exited 0 with the note inside the HTML only)."""
    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    (copy / "metrics.json").unlink()
    best = copy / "checkpoints" / "best.pt"
    best.write_bytes(best.read_bytes()[:1000])
    with pytest.warns(UserWarning, match="could not be loaded"):
        html = build_report(copy, options=ReportOptions(maps=(), data_root=data_root)).read_text()
    assert "test, step 0 (untrained)" in html and "the table shows the step-0 numbers" in html


def test_bench_report_from_results(tmp_path):
    """A benchmark directory: the seed's table with CIs and the relative-improvement chart."""
    import numpy as np

    from dmlkit.embeddings import save_embeddings

    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(6), 5)
    methods = {}
    for name, quality in (("pretrained", 0.2), ("contrastive", 0.5), ("triplet", 0.55), ("arcface", 0.6)):
        for fold in range(2):
            emb = rng.normal(size=(len(labels), 8)) + quality * 4 * np.eye(8)[labels % 8]
            save_embeddings(tmp_path / "final" / name / "seed0" / f"fold{fold}" / "embeddings" / "test.npz", emb, labels)
        cell = {"mean": quality, "ci95": 0.01, "values": [quality]}
        methods[name] = {"concatenated": {m: cell for m in ("precision_at_1", "r_precision", "map_at_r")},
                         "separated": {m: {**cell, "ci95": None} for m in ("precision_at_1", "r_precision", "map_at_r")}}
    (tmp_path / "results.json").write_text(json.dumps({"methods": methods}))
    page = build_report(tmp_path, options=ReportOptions(maps=("pca",)))
    html = page.read_text()
    assert "60.00 ± 1.00" in html and "60.00 ± n/a" in html and ">Papers versus reality</h2>" in html
    # only the best cell of each column is bold: arcface's six, no whole row
    assert '<tr><td>arcface</td>' + '<td class="best">60.00 ± 1.00</td>' * 3 in html
    # the untrained row is shown, never ranked (results.md's rule): it bolded itself when best
    methods["pretrained"]["separated"]["map_at_r"] = {"mean": 0.9, "ci95": None, "values": [0.9]}
    (tmp_path / "results.json").write_text(json.dumps({"methods": methods}))
    html = build_report(tmp_path, options=ReportOptions(maps=("pca",))).read_text()
    assert "90.00 ± n/a" in html and '<td class="best">90.00' not in html
    assert '<td class="best">60.00 ± n/a</td></tr>' in html  # arcface's separated MAP@R instead
    assert html.count('<td class="best">') == 6 and '<tr class="best">' not in html
    assert (tmp_path / "figures" / "relative_improvement.png").exists()
    # a fold's test embeddings missing: no "concatenated fold models" figures from the other fold
    (tmp_path / "final" / "arcface" / "seed0" / "fold1" / "embeddings" / "test.npz").unlink()
    html = build_report(tmp_path, options=ReportOptions(maps=("pca",))).read_text()
    assert "(concatenated fold models)" not in html and "fold1" in html and "is missing" in html
    # the untrained row best: the page says no method beat it
    assert "No method beat the untrained model" not in html
    methods["pretrained"] = methods["arcface"]
    methods["arcface"] = methods["contrastive"]
    (tmp_path / "results.json").write_text(json.dumps({"methods": methods}))
    html = build_report(tmp_path, options=ReportOptions(maps=())).read_text()
    assert "No method beat the untrained model" in html
    assert "test, untrained" in html and "test, after training" not in html
