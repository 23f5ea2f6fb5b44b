"""A new user's single-run workflow (train -> embed -> evaluate -> report), checked against
independent computations: what the report shows must be what ``dmlkit evaluate`` and the
benchmark give for the same embeddings."""

from __future__ import annotations

import json
import re
import warnings

import numpy as np
import pytest

from dmlkit.embeddings import save_embeddings
from dmlkit.metrics import evaluate, pos_neg_histograms


def _report_table_row(html: str, title: str) -> list[str]:
    """The cells of the report table row whose first cell is ``title``."""
    match = re.search(r"<tr><td>" + re.escape(title) + r"</td>(.*?)</tr>", html)
    assert match, f"no row {title!r}"
    return re.findall(r"<td[^>]*>(.*?)</td>", match.group(1))


def test_report_pos_neg_js_is_the_whole_splits_value(tmp_path):
    """The report's pos_neg_js column said it was the value of metrics.json and `dmlkit
    evaluate`, but was computed on the drawn sample of ``max_points`` rows (0.1584 against
    evaluate's 0.1590 on the quickstart's test split)."""
    from dmlkit.report import ReportOptions
    from dmlkit.report.builder import _embedding_sections, _sample_rows, _Split
    from dmlkit.report.html import render_page

    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(12), 6)
    emb = (rng.normal(size=(12, 8))[labels] + 1.2 * rng.normal(size=(72, 8))).astype(np.float32)
    test = _Split("test", emb, labels)
    options = ReportOptions(maps=(), max_points=24, gallery_queries=1, gallery_k=2)
    sections = _embedding_sections(test, None, {}, tmp_path, options, "the model")
    html = render_page("t", "s", sections, tmp_path / "report.html")
    cells = _report_table_row(html, "test, after training")
    whole = evaluate(emb, labels, metrics=["pos_neg_js"])["pos_neg_js"]
    drawn = _sample_rows(labels, options.max_points, options.seed)
    sample = pos_neg_histograms(emb[drawn], labels[drawn]).js
    assert abs(whole - sample) > 1e-3  # the test can tell them apart
    assert float(cells[1]) == pytest.approx(whole, abs=6e-5)
    # the pair counts are the drawn sample's (4 classes of 6), and say so
    assert cells[2:] == ["60", "216"] and "positive pairs drawn" in html


def test_bench_report_concatenates_as_the_benchmark_does(tmp_path):
    """The bench report normalised only the concatenation of the fold models' test embeddings;
    the benchmark (and compare) normalise each fold model's rows first
    (``concatenate_normalized``), so with ``model.normalize: false`` a fold model of large norm
    drowned the other in the report's figures and pos_neg_js, not in results.json."""
    from dmlkit.report import ReportOptions, build_report
    from dmlkit.report.builder import _concatenated_test
    from dmlkit.validation import concatenate_normalized

    rng = np.random.default_rng(1)
    labels = np.repeat(np.arange(6), 5)
    good = np.eye(8)[labels] * 3 + 0.3 * rng.normal(size=(30, 8))  # separates the classes
    noise = 1000 * rng.normal(size=(30, 8))  # a fold model of huge norm and no structure
    runs = []
    for fold, emb in enumerate((good, noise)):
        path = tmp_path / "final" / "triplet" / "seed0" / f"fold{fold}" / "embeddings" / "test.npz"
        save_embeddings(path, emb.astype(np.float32), labels)
        runs.append({"seed": 0, "fold": fold, "embeddings": str(path)})
    split, missing = _concatenated_test(runs, "triplet")
    assert not missing
    expected = concatenate_normalized([good.astype(np.float32), noise.astype(np.float32)])
    np.testing.assert_allclose(split.embeddings, expected, atol=1e-6)
    # and the page's pos_neg_js is that of the benchmark's concatenation
    cell = {"mean": 0.5, "ci95": None, "values": [0.5]}
    sections = {m: cell for m in ("precision_at_1", "r_precision", "map_at_r")}
    (tmp_path / "results.json").write_text(json.dumps(
        {"methods": {"triplet": {"concatenated": sections, "separated": sections}}}))
    html = build_report(tmp_path, options=ReportOptions(maps=())).read_text()
    js = float(_report_table_row(html, "test, after training")[1])
    assert js == pytest.approx(evaluate(expected, labels, metrics=["pos_neg_js"])["pos_neg_js"], abs=6e-5)


@pytest.mark.parametrize("labels", [[0, 0, 0, 0, 0], [0, 1, 2, 3, 4], [7]], ids=["one-class", "singletons", "one-row"])
def test_clustering_metrics_of_a_trivial_partition_are_nan_not_100(labels, run_cli, tmp_path):
    """With one class (k = 1) or every class a single sample (k = N), k-means reproduces the
    labels whatever the embeddings: evaluate printed NMI = AMI = 100 % (pair F1 100 % for one
    class) for any embeddings. Now NaN (null in JSON) with a warning."""
    x = np.random.default_rng(0).normal(size=(len(labels), 3)).astype(np.float32)
    with pytest.warns(UserWarning, match="reproduces the labels whatever the embeddings"):
        res = evaluate(x, labels, metrics=["nmi", "ami", "pair_f1"])
    assert all(np.isnan(res[k]) for k in ("nmi", "ami", "pair_f1", "nmi_std", "ami_std", "pair_f1_std"))
    np.savez(tmp_path / "e.npz", embeddings=x, labels=np.asarray(labels))
    code, out, err = run_cli(["evaluate", str(tmp_path / "e.npz"), "-m", "nmi,ami", "--json"])
    assert code == 0 and json.loads(out)["nmi"] is None and json.loads(out)["ami"] is None
    assert err.strip().startswith("warning: nmi, ami:") and "Traceback" not in err


def test_clustering_metrics_still_score_two_classes():
    """The guard is only k = 1 / k = N: two separated classes still score 1."""
    x = np.array([[1, 0], [1, 0.1], [0, 1], [0.1, 1]], dtype=np.float32)
    res = evaluate(x, [0, 0, 1, 1], metrics=["nmi", "ami", "pair_f1"], cluster_restarts=1)
    assert res["nmi"] == pytest.approx(1.0) and res["pair_f1"] == pytest.approx(1.0)


def test_two_files_with_their_own_class_name_tables_are_compared_by_name(run_cli, tmp_path):
    """load_embeddings gives string labels as codes + extra["class_names"]; saved back, two
    files with different name tables (a, b, c, d and a, b, c, e) were compared by code by
    `dmlkit evaluate q -r r`: 'd' matched 'e' (P@1 0.2857 instead of 0.3333, every query
    counted as having a positive)."""
    from dmlkit.embeddings import load_embeddings

    rng = np.random.default_rng(1)
    q, r = rng.normal(size=(7, 3)).astype(np.float32), rng.normal(size=(9, 3)).astype(np.float32)
    ql = np.array(list("abacdba"))
    rl = np.array(list("aabcceab") + ["b"])
    np.savez(tmp_path / "q.npz", embeddings=q, labels=ql)
    np.savez(tmp_path / "r.npz", embeddings=r, labels=rl)
    for name in ("q", "r"):  # the round trip a user makes
        emb, lab, extra = load_embeddings(tmp_path / f"{name}.npz")
        save_embeddings(tmp_path / f"{name}2.npz", emb, lab, **extra)
    want = evaluate(q, ql, r, rl, metrics=["precision_at_1", "map_at_r"])
    code, out, err = run_cli(["evaluate", str(tmp_path / "q2.npz"), "-r", str(tmp_path / "r2.npz"),
                              "-m", "precision_at_1,map_at_r", "--json"])
    got = json.loads(out)
    assert code == 0 and got["num_queries_without_positive"] == 1 == want["num_queries_without_positive"]
    assert got["precision_at_1"] == pytest.approx(want["precision_at_1"], abs=1e-12)
    assert got["map_at_r"] == pytest.approx(want["map_at_r"], abs=1e-12)
    # a file whose labels are not codes into its class_names is refused, not read as codes
    np.savez(tmp_path / "bad.npz", embeddings=q, labels=np.arange(7), class_names=np.array(["a", "b"]))
    code, out, err = run_cli(["evaluate", str(tmp_path / "bad.npz"), "--json"])
    assert code == 2 and "not codes into its 2 class_names" in err and len(err.strip().splitlines()) == 1


def test_save_embeddings_refuses_fractional_labels_and_keeps_class_names(tmp_path):
    """save_embeddings cast labels with astype(int64): 0.1 ... 0.9 were saved as one class 0
    (and scored P@1 = 1), and string labels raised numpy's ValueError."""
    from dmlkit.embeddings import load_embeddings
    from dmlkit.exceptions import ShapeError

    x = np.eye(4, dtype=np.float32)
    with pytest.raises(ShapeError, match="fractional"):
        save_embeddings(tmp_path / "f.npz", x, [0.1, 0.2, 0.3, 0.4])
    assert not (tmp_path / "f.npz").exists()
    save_embeddings(tmp_path / "s.npz", x, ["dog", "cat", "dog", "eel"])
    emb, labels, extra = load_embeddings(tmp_path / "s.npz")  # names (codes: codes=True)
    assert labels.tolist() == ["dog", "cat", "dog", "eel"]
    save_embeddings(tmp_path / "i.npz", x, np.array([3.0, 3.0, 1.0, 1.0]))  # whole floats: ids
    assert load_embeddings(tmp_path / "i.npz")[1].tolist() == [3, 3, 1, 1]


@pytest.mark.parametrize("content", [b"name: quickstart\nseed: 0\n", b""], ids=["yaml", "empty"])
def test_embed_of_a_file_that_is_no_checkpoint_says_so(content, run_cli, tmp_path):
    """`dmlkit embed runs/x/config.yaml` said the YAML file "holds Python objects besides
    tensors, and dmlkit never unpickles those" (torch's weights_only refusal, reworded)."""
    path = tmp_path / "config.yaml"
    path.write_bytes(content)
    code, out, err = run_cli(["embed", str(path), "-q"])
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert ("is not a PyTorch checkpoint" if content else "is empty") in err
    assert "Python objects" not in err


def test_train_refuses_an_explicit_test_set_of_one_class(data_root, tmp_path, one_thread):
    """train(..., test_set=<one class>) wrote test MAP@R = P@1 = 100 % into metrics.json for any
    model (the config path's preflight refuses such a split; the baseline silently skipped it).
    Now one PreflightError before the run directory is touched."""
    from _reference import tiny_sections
    from dmlkit.data import get_transforms, load_dataset
    from dmlkit.exceptions import ConfigError
    from dmlkit.training import config_from_dict, train

    ds = load_dataset("omniglot", root=data_root, sets=("background",))
    t = get_transforms("grayscale", train=False, image_size=28)
    train_set = ds.subset_classes(list(range(100, 104))).with_transform(t)
    val_set = ds.subset_classes([200, 201]).with_transform(t)
    cfg = config_from_dict({
        "name": "tiny", "data": {"dataset": "omniglot", "transform": "grayscale", "image_size": 28},
        **tiny_sections(), "sampler": {"classes_per_batch": 4, "samples_per_class": 4, "batches_per_epoch": 1},
        "training": {"epochs": 1, "device": "cpu"}})
    with pytest.raises(ConfigError, match="the test split has one class"):
        train(cfg, tmp_path / "run", train_set=train_set, val_set=val_set,
              test_set=ds.subset_classes([300]).with_transform(t), progress=False)
    assert not (tmp_path / "run").exists()


def test_a_reference_set_equal_to_the_query_set_warns(run_cli, tmp_path):
    """`dmlkit evaluate test.npz -r test.npz` (or a copy) printed P@1 = 100 % without a word:
    with a separate reference set no query is excluded, so each finds itself at rank 1."""
    from dmlkit.embedding_shards import write_shards
    from dmlkit.metrics.streaming import evaluate_streaming

    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5)).astype(np.float32)
    y = np.repeat(np.arange(8), 5)
    with pytest.warns(UserWarning, match="every query finds itself at rank 1"):
        assert evaluate(x, y, x.copy(), y, metrics=["precision_at_1"])["precision_at_1"] == 1.0
    with pytest.warns(UserWarning, match="every query finds itself at rank 1"):
        evaluate_streaming(x, y, x.copy(), y, metrics=["precision_at_1"], block_rows=7)
    save_embeddings(tmp_path / "t.npz", x, y)
    save_embeddings(tmp_path / "copy.npz", x, y)
    code, out, err = run_cli(["evaluate", str(tmp_path / "t.npz"), "-r", str(tmp_path / "copy.npz"),
                              "-m", "precision_at_1", "--json"])
    assert code == 0 and err.startswith("warning: the reference embeddings are the query embeddings")
    shards = tmp_path / "shards"
    write_shards(shards, x, y)
    code, out, err = run_cli(["evaluate", str(shards), "-r", str(shards), "-m", "precision_at_1", "--json"])
    assert code == 0 and "every query finds itself at rank 1" in err
    # a copy with one row changed is no longer "the query set", but its 39 identical rows are
    # still found first (tests/test_shared_rows.py); a reference set sharing no row says nothing
    x2 = x.copy()
    x2[-1] += 1
    with pytest.warns(UserWarning, match="39 of the 40 query embeddings also appear"):
        evaluate(x, y, x2, y, metrics=["precision_at_1"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        evaluate(x, y, x + 1, y, metrics=["precision_at_1"])
        evaluate_streaming(x, y, x + 1, y, metrics=["precision_at_1"], block_rows=7)


def test_train_summary_shows_a_clustering_spread_beside_its_mean():
    """dmlkit train's table gave each ``<metric>_std`` a column of its own ("nmi_std (%)"), read
    as a metric; `dmlkit evaluate` shows "mean ± std". Now the train table does too."""
    from rich.console import Console

    from dmlkit.commands.train import _metrics_table

    rows = {"val (best)": {"nmi": 0.5, "map_at_r": 0.25, "num_queries": 4, "nmi_std": 0.125},
            "test": {"nmi": 0.75, "map_at_r": 0.5, "nmi_std": 0.0625}, "val, step 0 (untrained)": None}
    console = Console(width=200, record=True)
    console.print(_metrics_table("t", rows))
    text = console.export_text()
    assert "_std" not in text and "50.00 ± 12.50" in text and "75.00 ± 6.25" in text


def test_a_labels_file_replacing_a_files_own_labels_is_said(run_cli, tmp_path):
    """`dmlkit evaluate e.npz --labels other.txt` used the text file's labels instead of the
    ones stored in e.npz without a word (a labels file of another split with as many lines
    scored silently)."""
    x = np.random.default_rng(0).normal(size=(6, 3)).astype(np.float32)
    save_embeddings(tmp_path / "e.npz", x, [0, 0, 1, 1, 2, 2])
    (tmp_path / "other.txt").write_text("0\n1\n2\n0\n1\n2\n")
    code, out, err = run_cli(["evaluate", str(tmp_path / "e.npz"), "--labels", str(tmp_path / "other.txt"),
                              "-m", "precision_at_1", "--json"])
    assert code == 0 and "other.txt replaces the 6 labels stored in" in err
    np.save(tmp_path / "e.npy", x)  # a .npy has no labels: nothing is replaced, nothing said
    code, out, err = run_cli(["evaluate", str(tmp_path / "e.npy"), "--labels", str(tmp_path / "other.txt"),
                              "-m", "precision_at_1", "--json"])
    assert code == 0 and err == ""


def test_evaluate_of_a_run_directory_names_its_embeddings_file(run_cli, tmp_path):
    """`dmlkit evaluate RUN_DIR` said "a directory without a shard manifest.json: ... a shard
    write that was interrupted (write it again)", advice that fits no run directory."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("name: x\n")
    code, out, err = run_cli(["evaluate", str(run)])
    assert code == 2 and "is a run directory of dmlkit train" in err
    assert str(run / "embeddings" / "test.npz") in err and "shard" not in err


def test_a_fresh_run_never_removes_a_folders_own_files(tmp_path):
    """A fresh `dmlkit train --run-dir DIR` removed DIR's metrics.json, log.jsonl, log.csv,
    baseline.json (the leftovers of a killed attempt, as it took them) even where DIR was a
    project folder and they were the user's own: now refused unless DIR holds a dmlkit run."""
    from dmlkit.exceptions import CheckpointError
    from dmlkit.training import config_from_dict
    from dmlkit.training.trainer import open_run_dir

    cfg = config_from_dict({"name": "x", "data": {"dataset": "omniglot"}, "loss": {"name": "triplet"}})
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "log.csv").write_text("epoch,loss\n1,0.5\n")
    (mine / "metrics.json").write_text('{"mine": 1}')
    with pytest.raises(CheckpointError, match="holds metrics.json, log.csv but no dmlkit run"):
        open_run_dir(mine, cfg, resume=False)
    assert (mine / "log.csv").read_text() == "epoch,loss\n1,0.5\n" and not (mine / "config.yaml").exists()
    # a killed attempt's leftovers (it wrote provenance.json first) are still cleared
    (mine / "provenance.json").write_text("{}")
    assert open_run_dir(mine, cfg, resume=False) is None
    assert not (mine / "metrics.json").exists() and (mine / "config.yaml").exists()


def test_report_samples_at_least_two_classes_for_its_histograms():
    """With `dmlkit report --max-points 10` and classes of 10 or more images the sample held one
    class: no negative pair, so no split got a histogram (nor its pos_neg_js)."""
    from dmlkit.report.builder import _sample_rows

    labels = np.repeat(np.arange(5), 20)
    rows = _sample_rows(labels, 10, 0)
    assert np.unique(labels[rows]).size == 2 and len(rows) == 40
    assert np.unique(labels[_sample_rows(labels, 60, 0)]).size == 3  # up to max_points otherwise
    pos_neg_histograms(np.random.default_rng(0).normal(size=(40, 3)), labels[rows])  # draws


def test_torchrun_evaluate_warns_once_for_the_job(tmp_path):
    """Under torchrun every rank read the files and ran the checks, so a warning (here the
    reference that is the query set) was printed once per rank; rank 0 now warns for the job."""
    from test_distributed_evaluate import _torchrun

    x = np.random.default_rng(0).normal(size=(20, 4)).astype(np.float32)
    y = np.repeat(np.arange(5), 4)
    save_embeddings(tmp_path / "t.npz", x, y)
    save_embeddings(tmp_path / "copy.npz", x, y)
    proc = _torchrun(tmp_path, ["evaluate", str(tmp_path / "t.npz"), "-r", str(tmp_path / "copy.npz"),
                                "-m", "precision_at_1", "--json"])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("every query finds itself at rank 1") == 1
