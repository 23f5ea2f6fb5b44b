"""Report audit: figure files of methods whose names differ in punctuation, methods missing from
results.json, ties in the best cells, the 2-D map's classes, wrongly typed results fields,
compare's names for two benches of one name. Small synthetic benches; the figures are not drawn
(``figures.save_figure`` writes a 2 x 2 PNG), so each test takes well under two seconds."""

from __future__ import annotations

import json
import re
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pytest
from PIL import Image

from _reference import bench_entries
from dmlkit.exceptions import DataError
from dmlkit.protocol.compare import _merge
from dmlkit.protocol.config import bench_config_from_dict
from dmlkit.protocol.results import (
    build_results,
    load_results,
    render_csv,
    render_markdown,
    rich_table,
    write_results,
)
from dmlkit.protocol.splits import make_bench_split
from dmlkit.report import figures
from dmlkit.report.builder import ReportOptions, build_report
from dmlkit.report.sections import _embedding_sections, _Split

LABELS = np.repeat(np.arange(6), 4)
LOSSES = {"contrastive": "contrastive", "triplet": "triplet"}


def _bench(folder: Path, methods=(("contrastive", 1.5), ("ms", 0.9)), configured=None, name="b") -> Path:
    """A bench directory whose results.json has final runs of ``methods`` (name, noise); the
    config lists ``configured`` (default: the same names)."""
    names = configured or [n for n, _ in methods]
    cfg = bench_config_from_dict({
        "name": name, "fixed": {"data": {"dataset": "omniglot"}, "model": {"embedding_size": 8}},
        "protocol": {"seeds": [0, 1, 2], "trials": 1},
        "methods": [{"name": n, "loss": {"name": LOSSES.get(n, "multi_similarity")}} for n in names]})
    entries = bench_entries(folder, cfg, LABELS, 6, methods=tuple(methods))
    write_results(build_results(cfg, make_bench_split(range(12), "halves", folds=2), entries,
                                bench_dir=folder), folder)
    return folder


@pytest.fixture
def no_drawing(monkeypatch):
    """``figures.save_figure`` closes the figure and writes a tiny PNG: the bases it saved."""
    saved: list[str] = []

    def save(fig, base, formats=("png", "svg")):
        plt.close(fig)
        base = Path(base)
        base.parent.mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (2, 2), (len(saved) % 256, 0, 0)).save(f"{base}.png")
        saved.append(base.name)
        return [Path(f"{base}.png"), None]

    monkeypatch.setattr(figures, "save_figure", save)
    return saved


def _figure_links(html: str) -> dict[str, str]:
    """``{caption: linked PNG}`` of the page's figures."""
    return dict(re.findall(r'<figcaption>(.*?) \(<a href="([^"]+)">PNG</a>', html))


# -- 1: one curves file per method, also for names differing only in punctuation -----------------
def test_methods_differing_in_punctuation_get_their_own_curves_file(tmp_path, no_drawing):
    d = _bench(tmp_path, methods=(("ms-1", 0.9), ("ms_1", 1.5), ("MS_1", 1.2)))
    results = json.loads((d / "results.json").read_text())
    for name, loss in (("ms-1", 5.0), ("ms_1", 1.0), ("MS_1", 2.0)):
        for run in results["methods"][name]["runs"]:
            (d / run["run_dir"] / "log.jsonl").write_text(
                json.dumps({"event": "train", "step": 1, "loss": loss}) + "\n")
    html = build_report(d, options=ReportOptions(maps=())).read_text()
    links = {c: f for c, f in _figure_links(html).items() if "training curves" in c}
    assert len(links) == 3
    files = list(links.values())
    # three files, and none that differs from another only in letter case (macOS, Windows)
    assert len({f.lower() for f in files}) == 3, links
    assert links["ms_1: training curves of the final runs"] == "figures/curves_ms_1.png"
    assert all((d / f).is_file() for f in files)


# -- 3: one rule for the best cells of results.md, the terminal and the HTML report ---------------
def _md_bold(md: str) -> set[tuple[str, int]]:
    rows = [line.split("|")[1:-1] for line in md.splitlines() if line.startswith("| ") and "**P@1**" not in line]
    return {(r[0].strip(), j) for r in rows[1:] for j, c in enumerate(r[1:], 1) if c.strip().startswith("**")}


def _rich_bold(table) -> set[tuple[str, int]]:
    names = list(table.columns[0]._cells)
    return {(names[i], j) for j, col in enumerate(table.columns[1:], 1)
            for i, c in enumerate(col._cells) if str(c).startswith("[bold]")}


def _html_bold(html: str) -> set[tuple[str, int]]:
    table = html[html.index("<table>"):html.index("</table>")]
    out = set()
    for row in re.findall(r"<tr>(<td.*?)</tr>", table):
        cells = re.findall(r"<td( class=\"best\")?>(.*?)</td>", row)
        out |= {(cells[0][1], j) for j, (best, _) in enumerate(cells) if best}
    return out


def test_tied_methods_are_all_bold_in_markdown_terminal_and_html(tmp_path, no_drawing):
    d = _bench(tmp_path, methods=(("contrastive", 1.5), ("ms", 0.9), ("arcface", 0.9)))
    data = json.loads((d / "results.json").read_text())
    for name, p1 in (("ms", 0.61231), ("arcface", 0.61234)):  # 61.23 both, as shown
        data["methods"][name]["concatenated"]["map_at_r"]["mean"] = 0.5  # an exact tie
        data["methods"][name]["concatenated"]["precision_at_1"]["mean"] = p1
    (d / "results.json").write_text(json.dumps(data))
    results = load_results(d)
    md, terminal = _md_bold(render_markdown(results)), _rich_bold(rich_table(results))
    html = _html_bold(build_report(d, options=ReportOptions(maps=())).read_text())
    assert {("ms", 1), ("arcface", 1), ("ms", 3), ("arcface", 3)} <= md
    assert md == terminal == html
    assert not any(name == "contrastive" for name, _ in md)


def _html_rows(html: str) -> list[list[str]]:
    table = html[html.index("<table>"):html.index("</table>")]
    return [re.findall(r"<td(?: class=\"best\")?>(.*?)</td>", row) for row in re.findall(r"<tr>(<td.*?)</tr>", table)]


def test_every_table_orders_rows_alike_and_shows_a_missing_cell_as_na(tmp_path, no_drawing):
    d = _bench(tmp_path, methods=(("contrastive", 1.5), ("ms", 0.9), ("arcface", 2.0)))
    data = json.loads((d / "results.json").read_text())
    data["methods"]["pretrained"] = data["methods"].pop("arcface")  # listed last in the file
    del data["methods"]["ms"]["separated"]["map_at_r"]  # a metric this method was not scored on
    (d / "results.json").write_text(json.dumps(data))
    results = load_results(d)
    md_rows = [line.split("|")[1].strip() for line in render_markdown(results).splitlines()
               if line.startswith("| ") and "**P@1**" not in line][1:]
    html_rows = _html_rows(build_report(d, options=ReportOptions(maps=())).read_text())
    assert md_rows == [r[0] for r in html_rows] == ["pretrained", "contrastive", "ms"]  # one order
    ms_md = next(line for line in render_markdown(results).splitlines() if line.startswith("| ms "))
    assert ms_md.rstrip(" |").endswith("n/a")  # the last column: separated MAP@R
    assert html_rows[2][-1] == "n/a"
    assert "ms,separated,map_at_r,,,," in render_csv(results)
    assert "n/a" in str(list(rich_table(results).columns[-1]._cells))


# -- 2: configured methods missing from results.json are named; captions name what is drawn -------
def test_methods_missing_from_the_table_are_named_and_captions_name_the_baselines_drawn(tmp_path, no_drawing):
    d = _bench(tmp_path, configured=["contrastive", "ms", "triplet"])  # no final runs of triplet
    md = (d / "results.md").read_text()
    assert "triplet" in md and "Not in this table: triplet" in md, md
    html = build_report(d, options=ReportOptions(maps=())).read_text()
    body = html.split("Configuration and provenance</h2>")[0]  # not the raw config dump
    assert "Not in this table: triplet" in body
    caption = next(c for c in _figure_links(html) if c.startswith("Relative improvement"))
    assert caption == "Relative improvement over contrastive"
    section = body[body.index(">Papers versus reality</h2>"):]
    section = section[:section.index("<figure>")]
    assert "triplet" not in section.replace("no triplet row", ""), section
    assert "no triplet row" in section
    # every configured method in the table: no such line
    full = _bench(tmp_path / "full", configured=["contrastive", "ms"])
    assert "Not in this table" not in (full / "results.md").read_text()


# -- 4: the 2-D maps draw whole classes, and the caption counts what is drawn ---------------------
@pytest.mark.parametrize("options, classes", [
    (ReportOptions(maps=("pca",), max_points=10, thumbnails=False), [0, 1]),  # 3 would make 12
    (ReportOptions(maps=("pca",), map_classes=3, thumbnails=False), [0, 1, 2]),
    (ReportOptions(maps=("pca",), thumbnails=False), [0, 1, 2, 3, 4, 5]),
])
def test_maps_draw_whole_classes_and_the_caption_counts_them(tmp_path, no_drawing, monkeypatch, options, classes):
    drawn = []
    real = figures.embedding_map
    monkeypatch.setattr(figures, "embedding_map", lambda pts, labels, *a, **k: drawn.append(labels) or real(pts, labels, *a, **k))
    x = np.random.default_rng(0).normal(size=(LABELS.size, 8)).astype(np.float32)
    sections = _embedding_sections(_Split("test", x, LABELS), None, {}, tmp_path, options, "the model")
    labels = np.asarray(drawn[0])
    assert sorted(set(labels.tolist())) == classes
    assert all((labels == c).sum() == (LABELS == c).sum() for c in classes)  # no class cut
    caption = next(f.caption for s in sections for f in s.figures if " map of " in f.caption)
    told = f"{len(classes)} of the 6 test classes" if len(classes) < 6 else "6 test classes"
    assert f"({told}, {labels.size} samples)" in caption, caption


# -- 5: wrongly typed results fields are one DataError line ---------------------------------------
def _cell(data, key, value):
    data["methods"]["ms"]["concatenated"]["map_at_r"][key] = value


@pytest.mark.parametrize("change, said", [
    (lambda d: _cell(d, "ci95", "0.1"), "'ci95' must be a number or null"),
    (lambda d: _cell(d, "ci95", True), "'ci95' must be a number or null"),
    (lambda d: _cell(d, "mean", True), "'mean' must be a number or null"),
    (lambda d: _cell(d, "mean", "0.5"), "'mean' must be a number or null"),
    (lambda d: _cell(d, "values", [0.5, "x"]), "'values' must be a list of numbers"),
    (lambda d: _cell(d, "values", 0.5), "'values' must be a list of numbers"),
    (lambda d: _cell(d, "n", "3"), "'n' must be an integer"),
    (lambda d: d.__setitem__("metrics", "map_at_r"), "'metrics' must be a list of metric names"),
    (lambda d: d.__setitem__("metrics", [1, 2]), "'metrics' must be a list of metric names"),
    (lambda d: d.__setitem__("split", "halves"), "'split' must be a mapping"),
    (lambda d: d.__setitem__("modes", [128, 64]), "'modes' must be a mapping"),
    (lambda d: d.__setitem__("seeds", 3), "'seeds' must be a list"),
])
def test_wrongly_typed_results_fields_are_one_line(tmp_path, run_cli, change, said):
    d = _bench(tmp_path)
    data = json.loads((d / "results.json").read_text())
    change(data)
    (d / "results.json").write_text(json.dumps(data))
    with pytest.raises(DataError, match=re.escape(said)) as info:
        load_results(d)
    assert "\n" not in str(info.value)
    code, out, err = run_cli(["report", str(d), "--maps", "pca", "-q"])
    assert code == 2 and "Traceback" not in err and said in " ".join(err.split()), err


# -- 7: compare names a method of a second bench of one name by where it came from ----------------
def test_compare_names_methods_of_two_benches_of_one_name_by_their_folders(tmp_path, run_cli):
    first, second = _bench(tmp_path / "first"), _bench(tmp_path / "second")  # both named "b"
    merged, origin = _merge([load_results(first), load_results(second)])
    assert list(merged) == ["contrastive", "ms", "contrastive@second", "ms@second"]
    assert origin["ms@second"] == 1
    # folders of one name too: as many parent folders as tell them apart
    a, b = _bench(tmp_path / "runA" / "b"), _bench(tmp_path / "runB" / "b")
    assert list(_merge([load_results(a), load_results(b)])[0])[2:] == ["contrastive@runB/b", "ms@runB/b"]
    # benches of different names keep the bench name
    other = _bench(tmp_path / "third", name="c")
    assert list(_merge([load_results(first), load_results(other)])[0])[2:] == ["contrastive@c", "ms@c"]
    code, out, err = run_cli(["compare", str(first), str(second), "-m", "ms", "-m", "ms@second",
                              "--metric", "map_at_r", "--mode", "separated"])
    assert code == 0, err
    assert "ms@second" in out
