"""Leftovers of the single-run workflow and report audit: a damaged ``.npz`` is said to be
damaged (not "pickled data ... allow_pickle"), ``dmlkit embed -o RUN/embeddings/test.npz``
never replaces the run's own test embeddings with another split's or checkpoint's,
``--per-class`` follows the requested metrics, a fresh run keeps the user's own
``config.yaml``, and the report of a bench directory takes the seeds and files that
``results.json`` lists (numeric seed order, digests checked as ``dmlkit compare`` does)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

from _reference import omniglot_run_config
from dmlkit.embeddings import save_embeddings
from dmlkit.exceptions import ConfigError

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.filterwarnings("ignore:training did not beat the untrained model")]


def _one_line(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


def _small_npz(path: Path) -> Path:
    rng = np.random.default_rng(0)
    save_embeddings(path, rng.normal(size=(12, 4)).astype(np.float32), np.repeat(np.arange(4), 3))
    return path


# -- D. a damaged or foreign .npz -------------------------------------------------------------
@pytest.mark.parametrize("kind", ["text", "random", "truncated", "npy", "empty"])
def test_a_damaged_npz_is_called_damaged_not_pickled(tmp_path, run_cli, kind):
    good = _small_npz(tmp_path / "good.npz").read_bytes()
    path = tmp_path / "bad.npz"
    if kind == "text":
        path.write_text("embeddings,labels\n1,2\n")
    elif kind == "random":
        path.write_bytes(np.random.default_rng(0).bytes(200))
    elif kind == "truncated":
        path.write_bytes(good[: len(good) // 2])
    elif kind == "npy":
        np.save(tmp_path / "a.npy", np.zeros((3, 2)))
        path.write_bytes((tmp_path / "a.npy").read_bytes())
    else:
        path.write_bytes(b"")
    code, out, err = run_cli(["evaluate", str(path)])
    line = _one_line(err)
    assert code == 2 and "pickle" not in line and str(path) in line
    expected = {"text": "not a readable .npz", "random": "not a readable .npz",
                "truncated": "damaged or truncated", "npy": "rename it to .npy", "empty": "empty"}[kind]
    assert expected in line


def test_a_text_labels_npy_is_called_unreadable_not_pickled(tmp_path, run_cli):
    np.save(tmp_path / "e.npy", np.zeros((4, 2), dtype=np.float32))
    (tmp_path / "l.npy").write_text("0\n0\n1\n1\n")
    code, out, err = run_cli(["evaluate", str(tmp_path / "e.npy"), "--labels", str(tmp_path / "l.npy")])
    assert code == 2 and "pickle" not in err and "not a readable .npy" in err


# -- H. --per-class follows the requested metrics --------------------------------------------
def test_per_class_with_clustering_metrics_only_is_refused(tmp_path, run_cli):
    emb = _small_npz(tmp_path / "e.npz")
    out_file = tmp_path / "pc.json"
    code, out, err = run_cli(["evaluate", str(emb), "-m", "nmi", "--per-class", str(out_file)])
    assert code == 2 and "--per-class" in _one_line(err) and "nmi" in err
    assert not out_file.exists()  # no default retrieval metrics written in their place
    code, out, err = run_cli(["evaluate", str(emb), "-m", "nmi,map_at_r", "--per-class", str(out_file)])
    assert code == 0, err
    table = json.loads(out_file.read_text())
    assert {k for row in table.values() for k in row} == {"map_at_r", "num_queries",
                                                         "num_queries_without_positive"}


def test_per_class_library_refuses_whole_set_metrics():
    from dmlkit.metrics import per_class, per_query

    x = np.random.default_rng(0).normal(size=(12, 4)).astype(np.float32)
    y = np.repeat(np.arange(4), 3)
    for fn in (per_class, per_query):
        with pytest.raises(ConfigError, match="nmi"):
            fn(x, y, metrics=["nmi"])
        with pytest.raises(ConfigError, match="pos_neg_js"):
            fn(x, y, metrics=["map_at_r", "pos_neg_js"])


# -- I. a fresh run keeps the user's own config.yaml ------------------------------------------
def test_a_fresh_run_refuses_to_replace_a_users_config_yaml(tmp_path):
    from test_training_resume_audit import make_config, run

    folder = tmp_path / "project"
    folder.mkdir()
    mine = "# my notes: keep these\nname: mine\n"
    (folder / "config.yaml").write_text(mine)
    with pytest.raises(Exception, match="config.yaml") as info:
        run(make_config(**{"training.epochs": 1}), folder)
    assert "provenance.json" in str(info.value)
    assert (folder / "config.yaml").read_text() == mine
    assert not (folder / "provenance.json").exists()
    # a run directory (provenance.json first) is still started again after a kill
    result = run(make_config(**{"training.epochs": 1}), tmp_path / "run")
    assert result.best_step >= 0 and (tmp_path / "run" / "config.yaml").is_file()


def test_the_cli_keeps_a_users_config_in_the_run_dir(tmp_path, run_cli, data_root):
    folder = tmp_path / "exp"
    cfg = omniglot_run_config(tmp_path, "mine", train=range(0, 8), val=range(8, 12),
                              training={"epochs": 1, "device": "cpu"})
    folder.mkdir()
    text = "# my comment\n" + cfg.read_text()
    (folder / "config.yaml").write_text(text)
    code, out, err = run_cli(["train", str(folder / "config.yaml"), "--run-dir", str(folder), "-q",
                              "--data-root", str(data_root)])
    assert code == 2 and "config.yaml" in _one_line(err)
    assert (folder / "config.yaml").read_text() == text


# -- G. embed -o never replaces the run's own test embeddings ---------------------------------
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, data_root):
    from dmlkit.cli import main

    d = tmp_path_factory.mktemp("run")
    cfg = omniglot_run_config(d, "leftover", train=range(0, 8), val=range(8, 12),
                              sampler={"classes_per_batch": 4, "samples_per_class": 2,
                                       "batches_per_epoch": 1},
                              training={"epochs": 1, "device": "cpu"})
    try:
        main(["train", str(cfg), "--run-dir", str(d / "run"), "--data-root", str(data_root), "-q"])
    except SystemExit as exc:
        assert not exc.code
    return d / "run"


def test_embed_refuses_another_split_over_the_runs_test_npz(tiny_run, run_cli, data_root):
    own = tiny_run / "embeddings" / "test.npz"
    before = own.read_bytes()
    code, out, err = run_cli(["embed", str(tiny_run), "--split", "val", "-o", str(own), "-q",
                              "--data-root", str(data_root)])
    assert code == 2 and "test.npz" in _one_line(err) and "val" in err
    code, out, err = run_cli(["embed", str(tiny_run / "checkpoints" / "last.pt"), "-o", str(own), "-q",
                              "--data-root", str(data_root)])
    assert code == 2 and "last.pt" in _one_line(err)
    assert own.read_bytes() == before
    # the test split of best.pt may be written there again (it is the same file), and -o elsewhere works
    code, out, err = run_cli(["embed", str(tiny_run), "--split", "val", "-o", str(tiny_run / "v.npz"),
                              "-q", "--data-root", str(data_root)])
    assert code == 0, err and (tiny_run / "v.npz").is_file()


# -- C. the report of a bench directory -------------------------------------------------------
def _bench(tmp_path: Path, seeds: tuple[int, ...], stray: int | None = None) -> dict:
    """A bench directory with method ``ms`` (listed ``seeds``, one fold each, their logs) and a
    ``stray`` seed folder on disk that results.json does not list."""
    from dmlkit.protocol.results import embeddings_digest

    labels = np.repeat(np.arange(5), 4)
    runs = []
    for s in (*seeds, *(() if stray is None else (stray,))):
        fold = tmp_path / "final" / "ms" / f"seed{s}" / "fold0"
        rng = np.random.default_rng(s)
        emb = (np.eye(8)[labels] * (1 + s) + 0.1 * rng.normal(size=(labels.size, 8))).astype(np.float32)
        save_embeddings(fold / "embeddings" / "test.npz", emb, labels)
        (fold / "log.jsonl").write_text(json.dumps({"event": "train", "step": 1, "loss": 1.0 + s}) + "\n")
        if s != stray:
            runs.append({"seed": s, "fold": 0, "run_dir": str(fold), "embeddings": str(fold / "embeddings" / "test.npz"),
                         "embeddings_sha256": embeddings_digest(emb, labels)})
    cell = {"mean": 0.5, "ci95": None, "values": [0.5]}
    results = {"methods": {"ms": {"concatenated": {"map_at_r": cell}, "separated": {"map_at_r": cell},
                                  "seeds": list(seeds), "runs": runs}}, "metrics": ["map_at_r"]}
    (tmp_path / "results.json").write_text(json.dumps(results))
    return results


def test_bench_report_takes_the_smallest_listed_seed_and_only_listed_curves(tmp_path, monkeypatch):
    from dmlkit.report import builder
    from dmlkit.report.builder import ReportOptions, build_report

    _bench(tmp_path, seeds=(2, 10), stray=1)
    drawn: dict = {}
    real = builder.figures.training_curves
    monkeypatch.setattr(builder.figures, "training_curves",
                        lambda logs, *a, **k: drawn.setdefault("logs", dict(logs)) and real(logs, *a, **k))
    seen: list = []
    from dmlkit.protocol import results as listed  # where the report reads a listed run's file

    real_load = listed.load_embeddings
    monkeypatch.setattr(listed, "load_embeddings", lambda p, *a: seen.append(Path(p)) or real_load(p, *a))
    build_report(tmp_path, options=ReportOptions(maps=()))
    assert sorted(drawn["logs"]) == ["seed10 fold0", "seed2 fold0"]  # not the stray seed1
    assert [p.parts[-4] for p in seen] == ["seed2"]  # seed2 before seed10, never seed1


def test_bench_report_refuses_a_rewritten_embeddings_file(tmp_path):
    from dmlkit.exceptions import DataError
    from dmlkit.report.builder import ReportOptions, build_report

    results = _bench(tmp_path, seeds=(0,))
    path = Path(results["methods"]["ms"]["runs"][0]["embeddings"])
    save_embeddings(path, np.ones((20, 8), dtype=np.float32), np.repeat(np.arange(5), 4))
    with pytest.raises(DataError, match="not the file the results table was computed on"):
        build_report(tmp_path, options=ReportOptions(maps=()))


def test_bench_report_cli_says_the_digest_in_one_line(tmp_path, run_cli):
    results = _bench(tmp_path, seeds=(0,))
    path = Path(results["methods"]["ms"]["runs"][0]["embeddings"])
    with zipfile.ZipFile(path) as z:
        assert "embeddings.npy" in z.namelist()
    save_embeddings(path, np.ones((20, 8), dtype=np.float32), np.repeat(np.arange(5), 4))
    code, out, err = run_cli(["report", str(tmp_path)])
    assert code == 2 and "results table" in _one_line(err)
